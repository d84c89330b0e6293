//! A small blocking HTTP/1.1 client for llama.cpp's `llama-server`: plain requests, streamed
//! completions read event by event as they arrive, and its Prometheus metrics. Requests go
//! over a connection the caller may open itself (a hinted one from
//! `balancer_agent::hint::connect`, one from a chosen port), one request per connection
//! (`Connection: close`), every read bounded. Call inside a namespace (see
//! [`crate::netns::Netns::enter`]).

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

/// Bound on connecting.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on each read or write: generous, since a request may wait for a free slot behind
/// long streams on a server with one thread.
pub const IO_TIMEOUT: Duration = Duration::from_secs(120);
const MAX_BODY: u64 = 16 << 20;
const MAX_HEAD_LINES: usize = 64;

/// A connection from an ephemeral port, with bounded reads and writes.
pub fn connect(addr: SocketAddr) -> Result<TcpStream> {
    let stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .with_context(|| format!("connecting to {addr}"))?;
    prepare(&stream)?;
    Ok(stream)
}

/// Bounds reads and writes on a connection opened elsewhere.
pub fn prepare(stream: &TcpStream) -> Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    stream.set_nodelay(true)?;
    Ok(())
}

fn send(stream: &mut TcpStream, method: &str, path: &str, body: Option<&str>) -> Result<()> {
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: llama\r\nConnection: close\r\n");
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

/// Status and headers (names lowercased).
#[derive(Debug, Clone)]
pub struct Head {
    pub status: u16,
    pub headers: Vec<(String, String)>,
}

impl Head {
    fn read(reader: &mut impl BufRead) -> Result<Self> {
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

    /// The body after this head: chunked, sized, or up to the end of the connection.
    fn body(&self, reader: BufReader<TcpStream>) -> Result<Box<dyn Read + Send>> {
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
}

/// A complete response.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Result<Value> {
        serde_json::from_str(&self.body).with_context(|| format!("not JSON: {:?}", self.body))
    }
}

/// `method path` with an optional JSON body on `stream`; reads the whole response.
pub fn request_on(
    mut stream: TcpStream,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<Reply> {
    send(
        &mut stream,
        method,
        path,
        body.map(Value::to_string).as_deref(),
    )?;
    let mut reader = BufReader::new(stream);
    let head = Head::read(&mut reader)?;
    let mut text = String::new();
    head.body(reader)?
        .take(MAX_BODY)
        .read_to_string(&mut text)
        .with_context(|| format!("reading the body of {method} {path}"))?;
    Ok(Reply {
        status: head.status,
        body: text,
    })
}

pub fn get(addr: SocketAddr, path: &str) -> Result<Reply> {
    request_on(connect(addr)?, "GET", path, None)
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Result<Reply> {
    request_on(connect(addr)?, "POST", path, Some(body))
}

/// One event of a streamed completion, stamped when it was read.
#[derive(Debug, Clone)]
pub struct Event {
    /// `choices[0].text` (empty for events without text).
    pub text: String,
    pub at: Instant,
    pub data: Value,
}

/// A streamed completion read to its end.
#[derive(Debug, Clone)]
pub struct Streamed {
    /// When the request was sent.
    pub sent: Instant,
    pub events: Vec<Event>,
    /// Whether `data: [DONE]` arrived.
    pub done: bool,
}

impl Streamed {
    /// The whole text, the events' pieces in order.
    pub fn text(&self) -> String {
        self.events.iter().map(|e| e.text.as_str()).collect()
    }

    /// The events that carry text.
    pub fn text_events(&self) -> impl Iterator<Item = &Event> {
        self.events.iter().filter(|e| !e.text.is_empty())
    }
}

/// `POST /v1/completions` with `"stream": true` on `stream`, read event by event.
pub struct CompletionStream {
    lines: BufReader<Box<dyn Read + Send>>,
    sent: Instant,
    events: Vec<Event>,
    done: bool,
}

impl CompletionStream {
    /// Sends `body` (which must ask for `"stream": true`) and reads the response head, which
    /// must open an event stream.
    pub fn open(mut stream: TcpStream, body: &Value) -> Result<Self> {
        ensure!(body["stream"] == true, "not a streaming request: {body}");
        let sent = Instant::now();
        send(
            &mut stream,
            "POST",
            "/v1/completions",
            Some(&body.to_string()),
        )?;
        let mut reader = BufReader::new(stream);
        let head = Head::read(&mut reader)?;
        if head.status != 200 {
            let mut text = String::new();
            head.body(reader)?
                .take(MAX_BODY)
                .read_to_string(&mut text)?;
            bail!("/v1/completions answered {}: {text}", head.status);
        }
        let content_type = head.header("content-type").unwrap_or_default();
        ensure!(
            content_type.starts_with("text/event-stream"),
            "content-type is {content_type:?}, not an event stream"
        );
        Ok(Self {
            lines: BufReader::new(head.body(reader)?),
            sent,
            events: Vec::new(),
            done: false,
        })
    }

    /// The next event with data; `None` at the end (`[DONE]`, or the body ended).
    pub fn next_event(&mut self) -> Result<Option<&Event>> {
        let mut line = String::new();
        loop {
            if self.done {
                return Ok(None);
            }
            line.clear();
            if self.lines.read_line(&mut line)? == 0 {
                return Ok(None);
            }
            let Some(data) = line.trim_end().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim_start();
            let at = Instant::now();
            if data == "[DONE]" {
                self.done = true;
                return Ok(None);
            }
            let data: Value =
                serde_json::from_str(data).with_context(|| format!("bad event {data:?}"))?;
            if let Some(error) = data.get("error") {
                bail!("the stream reports an error: {error}");
            }
            let text = data["choices"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            self.events.push(Event { text, at, data });
            return Ok(self.events.last());
        }
    }

    /// Everything up to the end.
    pub fn finish(mut self) -> Result<Streamed> {
        while self.next_event()?.is_some() {}
        Ok(Streamed {
            sent: self.sent,
            events: self.events,
            done: self.done,
        })
    }
}

/// A completion request body: `prompt`, greedy (temperature 0), exactly `max_tokens` tokens
/// (`ignore_eos`), the prompt cache on (llama.cpp's default, written out).
pub fn completion_body(prompt: &str, max_tokens: u32, stream: bool) -> Value {
    serde_json::json!({
        "model": crate::real_backend::MODEL_ALIAS,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "cache_prompt": true,
        "stream": stream,
    })
}

/// The samples of a Prometheus exposition without labels (all of llama.cpp's but one), by
/// name.
pub fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.contains('{'))
        .filter_map(|l| {
            let (name, value) = l.split_once(' ')?;
            Some((name.to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}

/// `GET /metrics` of the server at `addr`.
pub fn metrics(addr: SocketAddr) -> Result<BTreeMap<String, f64>> {
    let reply = get(addr, "/metrics")?;
    ensure!(
        reply.status == 200,
        "{addr}/metrics answered {}: {}",
        reply.status,
        reply.body
    );
    Ok(parse_metrics(&reply.body))
}

/// One sample of [`metrics`], which must be there.
pub fn sample(metrics: &BTreeMap<String, f64>, name: &str) -> Result<f64> {
    metrics
        .get(name)
        .copied()
        .with_context(|| format!("no {name} in the exposition"))
}

/// HTTP/1.1 chunked transfer decoding.
struct Chunked<R> {
    inner: R,
    remaining: usize,
    finished: bool,
}

impl<R: BufRead> Chunked<R> {
    fn new(inner: R) -> Self {
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
