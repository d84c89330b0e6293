//! HTTP/1.1 clients for the SSE server. Every request uses a fresh connection from a source
//! port the caller chooses: the balancer hashes the 5-tuple, so fixed ports make a run
//! reproducible. Call these inside the client namespace (see [`crate::netns::Netns::enter`]).

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;
use socket2::{Domain, Protocol, Socket, Type};

/// Bound on connecting and on every single read or write.
pub const TIMEOUT: Duration = Duration::from_secs(5);
const MAX_RESPONSE: u64 = 64 * 1024;
/// An event is a `data:` line and a blank line; allowing a few more bounds how long a
/// misbehaving server can keep a reader busy.
const MAX_LINES_PER_EVENT: usize = 8;

/// Connects to `server` from `src_port` (0: any port) within `timeout`.
pub(crate) fn connect_from(
    server: SocketAddr,
    src_port: u16,
    timeout: Duration,
) -> Result<TcpStream> {
    let socket = Socket::new(
        Domain::for_address(server),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    let any: IpAddr = match server {
        SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    socket
        .bind(&SocketAddr::new(any, src_port).into())
        .with_context(|| format!("binding source port {src_port}"))?;
    socket
        .connect_timeout(&server.into(), timeout)
        .with_context(|| format!("connecting to {server} from port {src_port}"))?;
    Ok(TcpStream::from(socket))
}

/// Connects to `server` from `src_port` (0: any port), with every read and write bounded.
fn connect(server: SocketAddr, src_port: u16) -> Result<TcpStream> {
    let stream = connect_from(server, src_port, TIMEOUT)?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    Ok(stream)
}

fn request(stream: &mut TcpStream, server: SocketAddr, target: &str) -> Result<()> {
    write!(
        stream,
        "GET {target} HTTP/1.1\r\nHost: {server}\r\nConnection: close\r\n\r\n"
    )
    .context("sending the request")
}

/// Bound on a body read whole, and on one read to the end of the connection.
pub(crate) const MAX_BODY: u64 = 16 << 20;
const MAX_HEAD_LINES: usize = 64;

/// Sends `method path` with `Connection: close` and an optional JSON body.
pub(crate) fn send(
    stream: &mut impl Write,
    host: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<()> {
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    match body {
        Some(body) => request.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )),
        None => request.push_str("\r\n"),
    }
    stream
        .write_all(request.as_bytes())
        .with_context(|| format!("sending {method} {path}"))
}

/// A response head: the status code and the headers, names lowercased.
#[derive(Debug, Clone)]
pub struct Head {
    pub status: u16,
    pub headers: Vec<(String, String)>,
}

impl Head {
    pub(crate) fn read(reader: &mut impl BufRead) -> Result<Self> {
        let mut line = String::new();
        reader
            .read_line(&mut line)
            .context("reading the status line")?;
        let status = line
            .strip_prefix("HTTP/1.1 ")
            .and_then(|rest| rest.get(..3))
            .and_then(|code| code.parse().ok())
            .with_context(|| format!("bad status line {line:?}"))?;
        let mut headers = Vec::new();
        for _ in 0..MAX_HEAD_LINES {
            line.clear();
            if reader.read_line(&mut line).context("reading headers")? == 0 {
                bail!("connection closed inside the response head");
            }
            let line = line.trim_end();
            if line.is_empty() {
                return Ok(Self { status, headers });
            }
            let (name, value) = line
                .split_once(':')
                .with_context(|| format!("bad header line {line:?}"))?;
            headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
        }
        bail!("more than {MAX_HEAD_LINES} header lines")
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body that follows this head: chunked, sized, or up to the end of the connection
    /// (at most [`MAX_BODY`] bytes).
    pub(crate) fn body<R: BufRead + Send + 'static>(
        &self,
        reader: R,
    ) -> Result<Box<dyn Read + Send>> {
        if self
            .header("transfer-encoding")
            .is_some_and(|t| t.eq_ignore_ascii_case("chunked"))
        {
            return Ok(Box::new(Chunked::new(reader)));
        }
        Ok(match self.header("content-length") {
            Some(length) => Box::new(reader.take(length.parse().context("content-length")?)),
            None => Box::new(reader.take(MAX_BODY)),
        })
    }

    /// The whole body that follows this head, as text (at most [`MAX_BODY`] bytes).
    pub(crate) fn body_text<R: BufRead + Send + 'static>(&self, reader: R) -> Result<String> {
        let mut text = String::new();
        self.body(reader)?
            .take(MAX_BODY)
            .read_to_string(&mut text)?;
        Ok(text)
    }
}

/// The answer to `GET /`.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    /// The `x-backend` header.
    pub backend: String,
    pub body: String,
}

/// `GET /` on a fresh connection from `src_port`.
pub fn get(server: SocketAddr, src_port: u16) -> Result<Reply> {
    let mut stream = connect(server, src_port)?;
    request(&mut stream, server, "/")?;
    reply(stream)
}

/// The answer to a request sent with `Connection: close`: the server closes after it, so
/// the body runs to EOF.
fn reply(stream: TcpStream) -> Result<Reply> {
    let mut reader = BufReader::new(stream.take(MAX_RESPONSE));
    let head = Head::read(&mut reader)?;
    let mut body = String::new();
    reader
        .read_to_string(&mut body)
        .context("reading the body")?;
    let backend = head
        .header("x-backend")
        .context("no x-backend header")?
        .to_owned();
    Ok(Reply {
        status: head.status,
        backend,
        body,
    })
}

/// `GET /bytes?n=N` on a fresh connection from `src_port`: a body of `n` bytes (at most
/// about 60 KiB: the reply is read up to 64 KiB).
pub fn get_bytes(server: SocketAddr, src_port: u16, n: usize) -> Result<Reply> {
    let mut stream = connect(server, src_port)?;
    request(&mut stream, server, &format!("/bytes?n={n}"))?;
    reply(stream)
}

/// `POST /length` with a body of `len` bytes on a fresh connection from `src_port`: the
/// server answers the length it received.
pub fn post_length(server: SocketAddr, src_port: u16, len: usize) -> Result<Reply> {
    let mut stream = connect(server, src_port)?;
    let body = "x".repeat(len);
    send(
        &mut stream,
        &server.to_string(),
        "POST",
        "/length",
        Some(&body),
    )?;
    reply(stream)
}

/// One `GET /` from each port in `src_ports`, one after the other; every one must be answered
/// by the backend it names. Returns how many each backend answered.
pub fn count_backends(
    server: SocketAddr,
    src_ports: Range<u16>,
) -> Result<BTreeMap<String, usize>> {
    let mut counts = BTreeMap::new();
    for port in src_ports {
        let reply = get(server, port).with_context(|| format!("GET / from port {port}"))?;
        ensure!(
            reply.status == 200 && reply.body == format!("{}\n", reply.backend),
            "GET / from port {port}: unexpected answer {reply:?}"
        );
        *counts.entry(reply.backend).or_default() += 1;
    }
    Ok(counts)
}

/// One event of a stream, with the time it was read.
#[derive(Debug, Clone, Deserialize)]
pub struct Event {
    pub backend: String,
    pub seq: u32,
    #[serde(skip, default = "Instant::now")]
    pub at: Instant,
}

/// A stream read to its end.
#[derive(Debug)]
pub struct StreamLog {
    pub events: Vec<Event>,
    /// Whether `data: [DONE]` arrived.
    pub done: bool,
}

impl StreamLog {
    pub fn seqs(&self) -> Vec<u32> {
        self.events.iter().map(|e| e.seq).collect()
    }
}

/// `GET /stream`, read event by event as the server produces them.
pub struct SseStream {
    lines: BufReader<Chunked<BufReader<TcpStream>>>,
    expected: u32,
    events: Vec<Event>,
    done: bool,
}

impl SseStream {
    /// Opens `/stream?events=..&interval_ms=..` from `src_port` and reads the response head.
    pub fn open(server: SocketAddr, src_port: u16, events: u32, interval_ms: u64) -> Result<Self> {
        let mut stream = connect(server, src_port)?;
        request(
            &mut stream,
            server,
            &format!("/stream?events={events}&interval_ms={interval_ms}"),
        )?;
        let mut reader = BufReader::new(stream);
        let head = Head::read(&mut reader)?;
        ensure!(head.status == 200, "stream answered {}", head.status);
        ensure!(
            head.header("content-type") == Some("text/event-stream"),
            "stream content-type is {:?}",
            head.header("content-type")
        );
        ensure!(
            head.header("transfer-encoding") == Some("chunked"),
            "stream is not chunked"
        );
        Ok(Self {
            lines: BufReader::new(Chunked::new(reader)),
            expected: events,
            events: Vec::new(),
            done: false,
        })
    }

    /// The next event; `None` once `[DONE]` or the end of the stream is reached.
    pub fn next_event(&mut self) -> Result<Option<&Event>> {
        for _ in 0..MAX_LINES_PER_EVENT {
            if self.done {
                return Ok(None);
            }
            let mut line = String::new();
            let read = self.lines.read_line(&mut line).with_context(|| {
                format!("reading the stream after {} events", self.events.len())
            })?;
            if read == 0 {
                return Ok(None);
            }
            let Some(data) = line.trim_end().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                self.done = true;
                return Ok(None);
            }
            let event: Event =
                serde_json::from_str(data).with_context(|| format!("bad event {data:?}"))?;
            ensure!(
                self.events.len() < self.expected as usize,
                "stream sent more than the {} events asked for",
                self.expected
            );
            self.events.push(event);
            return Ok(self.events.last());
        }
        bail!("stream sent {MAX_LINES_PER_EVENT} lines without an event")
    }

    /// Reads the rest of the stream.
    pub fn finish(mut self) -> Result<StreamLog> {
        while self.next_event()?.is_some() {}
        Ok(StreamLog {
            events: self.events,
            done: self.done,
        })
    }
}

/// Decodes an HTTP/1.1 chunked body (the SSE server, the simulator and llama-server stream
/// with it).
pub(crate) struct Chunked<R> {
    inner: R,
    remaining: usize,
    finished: bool,
}

impl<R: BufRead> Chunked<R> {
    pub(crate) fn new(inner: R) -> Self {
        Self {
            inner,
            remaining: 0,
            finished: false,
        }
    }
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.finished || buf.is_empty() {
            return Ok(0);
        }
        if self.remaining == 0 {
            let mut line = String::new();
            if self.inner.read_line(&mut line)? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a chunked body",
                ));
            }
            let size = line.trim_end().split(';').next().unwrap_or_default();
            self.remaining = usize::from_str_radix(size.trim(), 16).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("bad chunk size {line:?}"),
                )
            })?;
            if self.remaining == 0 {
                self.finished = true;
                return Ok(0);
            }
        }
        let want = buf.len().min(self.remaining);
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed inside a chunk",
            ));
        }
        self.remaining -= n;
        if self.remaining == 0 {
            let mut crlf = [0; 2];
            self.inner.read_exact(&mut crlf)?;
            if &crlf != b"\r\n" {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "chunk not followed by CRLF",
                ));
            }
        }
        Ok(n)
    }
}
