"""Checks the Python client against the published vectors (the Rust side checks the same
file), and that connect() really binds a port of the right bucket."""
import json
import pathlib
import socket
import unittest

import balancer_hint

VECTORS = pathlib.Path(__file__).resolve().parents[2] / "balancer-common" / "hint-vectors.json"


class Vectors(unittest.TestCase):
    def test_published_vectors(self):
        data = json.loads(VECTORS.read_text(encoding="utf-8"))
        self.assertEqual(data["scheme"], "fnv1a64-mod-buckets-v1")
        self.assertGreaterEqual(len(data["vectors"]), 5)
        for v in data["vectors"]:
            with self.subTest(prefix=v["prefix"][:40]):
                h = balancer_hint.fnv1a64(v["prefix"].encode("utf-8"))
                self.assertEqual(f"{h:016x}", v["fnv1a64"])
                self.assertEqual(balancer_hint.bucket(v["prefix"], v["buckets"]), v["bucket"])
                got = list(balancer_hint.ports(v["prefix"], v["start"], v["span"], v["buckets"]))
                self.assertEqual(got[:3], v["first_ports"])
                for p in got:
                    self.assertEqual((p - v["start"]) % v["buckets"], v["bucket"])
                    self.assertLess(p, v["start"] + v["span"])


class Connect(unittest.TestCase):
    def test_connects_from_a_port_of_the_bucket_skipping_busy_ones(self):
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        prefix = "You are a helpful assistant."
        first = next(iter(balancer_hint.ports(prefix)))
        blocker = socket.socket()
        blocker.bind(("", first))  # the bucket's first port is taken
        try:
            conn = balancer_hint.connect(server.getsockname(), prefix, timeout=5)
            port = conn.getsockname()[1]
            self.assertNotEqual(port, first)
            self.assertEqual((port - balancer_hint.DEFAULT_START) % 256, balancer_hint.bucket(prefix))
            conn.close()
        finally:
            blocker.close()
            server.close()


if __name__ == "__main__":
    unittest.main()
