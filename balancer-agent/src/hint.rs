//! The client side of prefix hints, for Rust clients and the `hint` command: connect from a
//! source port that names the prefix's bucket (the scheme is in `balancer_common::hint` and
//! `docs/affinity.md`).

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream},
    time::Duration,
};

use balancer_common::hint::HintRange;
use socket2::{Domain, Protocol, Socket, Type};

/// Opens a connection to `vip` from a free source port of `prefix`'s bucket, trying the
/// bucket's ports in order: ports in use, or whose previous connection to `vip` is still in
/// TIME_WAIT, are skipped.
pub fn connect(
    vip: SocketAddr,
    range: HintRange,
    prefix: &[u8],
    timeout: Option<Duration>,
) -> io::Result<TcpStream> {
    let bucket = range.bucket_of_prefix(prefix);
    for port in range.ports(bucket) {
        let socket = Socket::new(Domain::for_address(vip), Type::STREAM, Some(Protocol::TCP))?;
        if let Err(e) = socket.bind(&SocketAddr::new(unspecified(vip.ip()), port).into()) {
            if skippable(&e) {
                continue;
            }
            return Err(e);
        }
        let connected = match timeout {
            Some(t) => socket.connect_timeout(&vip.into(), t),
            None => socket.connect(&vip.into()),
        };
        match connected {
            Ok(()) => return Ok(socket.into()),
            Err(e) if skippable(&e) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AddrInUse,
        format!("every source port of bucket {bucket} is in use"),
    ))
}

/// The first port of `prefix`'s bucket that is free to bind on this host now.
pub fn free_port(range: HintRange, prefix: &[u8], family: IpAddr) -> io::Result<u16> {
    let bucket = range.bucket_of_prefix(prefix);
    for port in range.ports(bucket) {
        let domain = Domain::for_address(SocketAddr::new(family, 0));
        let socket = Socket::new(domain, Type::STREAM, Some(Protocol::TCP))?;
        match socket.bind(&SocketAddr::new(unspecified(family), port).into()) {
            Ok(()) => return Ok(port),
            Err(e) if skippable(&e) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AddrInUse,
        format!("every source port of bucket {bucket} is in use"),
    ))
}

fn unspecified(like: IpAddr) -> IpAddr {
    match like {
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    }
}

fn skippable(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::AddrInUse | io::ErrorKind::AddrNotAvailable
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn connects_from_a_port_of_the_bucket_and_skips_taken_ones() {
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let range = HintRange::new(21000, 512, 16).unwrap();
        let prefix = b"You are a helpful assistant.";
        let bucket = range.bucket_of_prefix(prefix);
        let first = range.ports(bucket).next().unwrap();
        let _taken = TcpListener::bind(("0.0.0.0", first)).unwrap();
        let a = connect(
            server.local_addr().unwrap(),
            range,
            prefix,
            Some(Duration::from_secs(5)),
        )
        .unwrap();
        let b = connect(
            server.local_addr().unwrap(),
            range,
            prefix,
            Some(Duration::from_secs(5)),
        )
        .unwrap();
        for s in [&a, &b] {
            let port = s.local_addr().unwrap().port();
            assert_ne!(port, first);
            assert_eq!(range.bucket_of_port(port), Some(bucket));
        }
        assert_ne!(
            a.local_addr().unwrap().port(),
            b.local_addr().unwrap().port()
        );
        assert_ne!(
            free_port(range, prefix, "127.0.0.1".parse().unwrap()).unwrap(),
            first
        );
    }

    #[test]
    fn a_full_bucket_is_an_error() {
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let range = HintRange::new(21600, 4, 4).unwrap();
        let prefix = b"x";
        let only = range.ports(range.bucket_of_prefix(prefix)).next().unwrap();
        let _taken = TcpListener::bind(("0.0.0.0", only)).unwrap();
        let err = connect(server.local_addr().unwrap(), range, prefix, None).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
    }
}
