//! A small blocking HTTP/1.1 client for the simulator: plain requests, and completion streams
//! read event by event as they arrive. Every request has its own connection (`Connection:
//! close`), and every read is bounded by a timeout. The `_from` variants choose the source
//! port, for requests through a balancer that hashes it.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

pub use crate::client::Head;
use crate::client::MAX_BODY;

/// Bound on connecting and on each read or write, unless changed.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to `addr` from `src_port` (0: any port).
pub(crate) fn connect(addr: SocketAddr, src_port: u16) -> Result<TcpStream> {
    let stream = crate::client::connect_from(addr, src_port, TIMEOUT)?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

fn send(stream: &mut TcpStream, method: &str, path: &str, body: Option<&str>) -> Result<()> {
    crate::client::send(stream, "sim", method, path, body)
}

/// A complete response.
#[derive(Debug, Clone)]
pub struct Reply {
    pub head: Head,
    pub body: String,
}

impl Reply {
    pub fn status(&self) -> u16 {
        self.head.status
    }

    pub fn json(&self) -> Result<Value> {
        serde_json::from_str(&self.body).with_context(|| format!("not JSON: {:?}", self.body))
    }
}

/// `method path` with an optional JSON body; reads the whole response.
pub fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Result<Reply> {
    request_from(addr, 0, method, path, body)
}

/// [`request`] from source port `src_port` (0: any).
pub fn request_from(
    addr: SocketAddr,
    src_port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<Reply> {
    exchange(connect(addr, src_port)?, "sim", method, path, body)
}

/// Sends `method path` (with `host`) on `stream` and reads the whole response.
pub(crate) fn exchange(
    mut stream: impl Read + Write + Send + 'static,
    host: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<Reply> {
    crate::client::send(&mut stream, host, method, path, body)?;
    let mut reader = BufReader::new(stream);
    let head = Head::read(&mut reader)?;
    let body = head
        .body_text(reader)
        .with_context(|| format!("reading the body of {method} {path}"))?;
    Ok(Reply { head, body })
}

pub fn get(addr: SocketAddr, path: &str) -> Result<Reply> {
    request(addr, "GET", path, None)
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Result<Reply> {
    request(addr, "POST", path, Some(&body.to_string()))
}

/// Sends raw bytes and returns everything the server answers until it closes.
pub fn raw(addr: SocketAddr, bytes: &[u8]) -> Result<String> {
    let mut stream = connect(addr, 0)?;
    stream.write_all(bytes)?;
    let mut answer = Vec::new();
    stream.take(MAX_BODY).read_to_end(&mut answer)?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

/// One server-sent event of a completion stream, stamped when it was read.
#[derive(Debug, Clone)]
pub enum Item {
    Chunk { data: Value, at: Instant },
    Done { at: Instant },
}

/// A streaming completion (`"stream": true`), read as the server writes it.
pub struct Stream {
    lines: BufReader<Box<dyn Read + Send>>,
    socket: TcpStream,
    pub head: Head,
    done: bool,
}

impl Stream {
    /// POSTs `body` to `path` and reads the response head, which must be an event stream.
    pub fn open(addr: SocketAddr, path: &str, body: &Value) -> Result<Self> {
        Self::open_from(addr, 0, path, body)
    }

    /// [`Stream::open`] from source port `src_port` (0: any).
    pub fn open_from(addr: SocketAddr, src_port: u16, path: &str, body: &Value) -> Result<Self> {
        Self::open_on(connect(addr, src_port)?, TIMEOUT, path, body)
    }

    /// [`Stream::open`] on a connection the caller made (for instance from a hint port),
    /// every read and write bounded by `timeout`.
    pub fn open_on(
        mut stream: TcpStream,
        timeout: Duration,
        path: &str,
        body: &Value,
    ) -> Result<Self> {
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        stream.set_nodelay(true)?;
        send(&mut stream, "POST", path, Some(&body.to_string()))?;
        let socket = stream.try_clone()?;
        let mut reader = BufReader::new(stream);
        let head = Head::read(&mut reader)?;
        if head.status != 200 {
            let body = head.body_text(reader)?;
            bail!("{path} answered {}: {body}", head.status);
        }
        ensure!(
            head.header("content-type") == Some("text/event-stream"),
            "content-type is {:?}",
            head.header("content-type")
        );
        let body = head.body(reader)?;
        Ok(Self {
            lines: BufReader::new(body),
            socket,
            head,
            done: false,
        })
    }

    /// Changes the bound on waiting for the next bytes.
    pub fn set_timeout(&self, timeout: Duration) -> Result<()> {
        Ok(self.socket.set_read_timeout(Some(timeout))?)
    }

    /// The next event; `None` once the body ended (after `[DONE]`, or early).
    pub fn next_item(&mut self) -> Result<Option<Item>> {
        // An event is a `data:` line and a blank line; anything else is bounded too.
        for _ in 0..8 {
            if self.done {
                return Ok(None);
            }
            let mut line = String::new();
            if self.lines.read_line(&mut line)? == 0 {
                return Ok(None);
            }
            let Some(data) = line.trim_end().strip_prefix("data: ") else {
                continue;
            };
            let at = Instant::now();
            if data == "[DONE]" {
                self.done = true;
                return Ok(Some(Item::Done { at }));
            }
            let data = serde_json::from_str(data).with_context(|| format!("bad event {data:?}"))?;
            return Ok(Some(Item::Chunk { data, at }));
        }
        bail!("eight lines without an event")
    }

    /// Everything up to the end of the body.
    pub fn collect(mut self) -> Result<Vec<Item>> {
        let mut items = Vec::new();
        while let Some(item) = self.next_item()? {
            items.push(item);
        }
        Ok(items)
    }
}

/// Whether `error` is a read that timed out.
/// What a streamed completion delivered: its tokens' arrival times, and how it ended.
#[derive(Debug)]
pub struct Seen {
    /// The server that answered (`x-backend`).
    pub backend: String,
    pub arrivals: Vec<Instant>,
    pub finish_reason: Option<String>,
    /// `[DONE]` came.
    pub done: bool,
}

impl Seen {
    /// Whether it ended as a completion of `tokens` tokens does: all of them, finish reason
    /// `length`, and `[DONE]`; else what it got instead.
    pub fn complete(&self, tokens: u64) -> Result<()> {
        ensure!(
            self.arrivals.len() as u64 == tokens
                && self.finish_reason.as_deref() == Some("length")
                && self.done,
            "on {}: {} tokens of {tokens}, finish reason {:?}, [DONE] {}",
            self.backend,
            self.arrivals.len(),
            self.finish_reason,
            self.done
        );
        Ok(())
    }
}

/// Reads `stream` to its end on a thread of its own.
pub fn read_on(mut stream: Stream) -> std::thread::JoinHandle<Result<Seen>> {
    std::thread::spawn(move || {
        let mut seen = Seen {
            backend: stream.head.header("x-backend").unwrap_or("?").to_owned(),
            arrivals: Vec::new(),
            finish_reason: None,
            done: false,
        };
        while let Some(item) = stream.next_item()? {
            match item {
                Item::Chunk { data, .. } => match data["choices"][0]["finish_reason"].as_str() {
                    None => seen.arrivals.push(Instant::now()),
                    Some(reason) => seen.finish_reason = Some(reason.to_owned()),
                },
                Item::Done { .. } => seen.done = true,
            }
        }
        Ok(seen)
    })
}

pub fn is_timeout(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause.downcast_ref::<io::Error>().is_some_and(|e| {
            matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            )
        })
    })
}

/// The text of a completion or chat chunk (`choices[0].text` or `choices[0].delta.content`).
pub fn chunk_text(data: &Value) -> Option<&str> {
    let choice = data.get("choices")?.get(0)?;
    choice
        .get("text")
        .or_else(|| choice.get("delta")?.get("content"))
        .and_then(Value::as_str)
}
