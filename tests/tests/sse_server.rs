//! The SSE server on loopback: identity, streaming pace, limits, and robustness.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use balancer_tests::client::{self, SseStream};
use balancer_tests::process::Process;

const SSE_SERVER: &str = env!("CARGO_BIN_EXE_sse-server");

/// A server on ephemeral loopback ports, IPv4 and IPv6; returns it and its addresses.
fn start(dir: &tempfile::TempDir) -> (Process, Vec<SocketAddr>) {
    let mut cmd = Command::new(SSE_SERVER);
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--listen",
        "[::1]:0",
        "--name",
        "bx",
    ]);
    let mut server = Process::spawn("sse-server", cmd, &dir.path().join("log")).unwrap();
    // Listeners report in the order of the arguments, so the IPv6 one comes last.
    server
        .wait_for_line(0, Duration::from_secs(10), |l| {
            l.starts_with("listening on [")
        })
        .unwrap();
    let addresses = server
        .output()
        .lines()
        .filter_map(|l| l.strip_prefix("listening on "))
        .map(|a| a.parse().unwrap())
        .collect();
    (server, addresses)
}

/// Sends raw bytes and returns whatever comes back before the server closes.
fn raw(server: SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect_timeout(&server, client::TIMEOUT).unwrap();
    stream.set_read_timeout(Some(client::TIMEOUT)).unwrap();
    stream.write_all(request).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

#[test]
fn identity_on_both_families() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, addresses) = start(&dir);
    for address in addresses {
        let reply = client::get(address, 0).unwrap();
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(reply.backend, "bx");
        assert_eq!(reply.body, "bx\n");
    }
}

#[test]
fn events_arrive_as_they_are_produced() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, addresses) = start(&dir);
    let interval = Duration::from_millis(400);
    let opened = Instant::now();
    let log = SseStream::open(addresses[0], 0, 3, interval.as_millis() as u64)
        .unwrap()
        .finish()
        .unwrap();
    assert_eq!(log.seqs(), [0, 1, 2]);
    assert!(log.done, "no [DONE]");
    assert!(log.events.iter().all(|e| e.backend == "bx"));
    let first = log.events[0].at - opened;
    let last = log.events[2].at - opened;
    // Buffered output would deliver all three together at the end.
    assert!(first < interval, "first event after {first:?}");
    assert!(last >= 2 * interval, "last event after {last:?}");
}

#[test]
fn rejects_what_it_does_not_serve_and_survives_garbage() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, addresses) = start(&dir);
    let server = addresses[0];
    for target in [
        "/stream?events=100001&interval_ms=10",
        "/stream?events=1&interval_ms=60001",
        "/stream?events=many&interval_ms=10",
        "/stream",
    ] {
        let response = raw(
            server,
            format!("GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        );
        assert!(response.starts_with("HTTP/1.1 400"), "{target}: {response}");
    }
    let response = raw(
        server,
        b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert!(response.starts_with("HTTP/1.1 404"), "{response}");
    let response = raw(server, b"\x00\x01 garbage\r\n\r\n");
    assert!(response.starts_with("HTTP/1.1 400"), "{response}");
    // A client that goes away in the middle of a stream.
    let mut stream = SseStream::open(server, 0, 100, 10).unwrap();
    assert_eq!(stream.next_event().unwrap().unwrap().seq, 0);
    drop(stream);

    let reply = client::get(server, 0).unwrap();
    assert_eq!(reply.body, "bx\n");
}
