"""Client side of balancer's prefix hints: pick the TCP source port that tells the balancer
which prompt prefix a connection carries, so that it lands on the server that holds it.

The scheme (docs/affinity.md): h = FNV-1a 64 over the prefix's UTF-8 bytes, bucket = h mod B,
and the source port p lies in [start, start + span) with (p - start) mod B == bucket.
Standard library only, so it can be copied into any client.
"""

import errno
import socket

DEFAULT_START = 16384
DEFAULT_SPAN = 16384
DEFAULT_BUCKETS = 256

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1


def fnv1a64(data: bytes) -> int:
    h = _FNV_OFFSET
    for b in data:
        h ^= b
        h = (h * _FNV_PRIME) & _MASK
    return h


def bucket(prefix: str, buckets: int = DEFAULT_BUCKETS) -> int:
    return fnv1a64(prefix.encode("utf-8")) % buckets


def ports(prefix: str, start: int = DEFAULT_START, span: int = DEFAULT_SPAN,
          buckets: int = DEFAULT_BUCKETS):
    """The source ports that carry this prefix's bucket, lowest first."""
    return range(start + bucket(prefix, buckets), start + span, buckets)


def connect(address, prefix: str, start: int = DEFAULT_START, span: int = DEFAULT_SPAN,
            buckets: int = DEFAULT_BUCKETS, timeout=None) -> socket.socket:
    """A TCP connection to `address` (host, port) from a free port of the prefix's bucket.

    Ports in use (or in TIME_WAIT towards the same address) are skipped; OSError when every
    port of the bucket is taken.
    """
    last = None
    for port in ports(prefix, start, span, buckets):
        try:
            return socket.create_connection(address, timeout=timeout, source_address=("", port))
        except OSError as e:
            if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                raise
            last = e
    raise OSError(errno.EADDRINUSE, f"every port of bucket {bucket(prefix, buckets)} is in use") from last
