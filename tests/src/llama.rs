//! A small blocking HTTP/1.1 client for llama.cpp's `llama-server`: plain requests, streamed
//! completions read event by event as they arrive, and its Prometheus metrics. Requests go
//! over a connection the caller may open itself (a hinted one from
//! `balancer_agent::hint::connect`, one from a chosen port), one request per connection
//! (`Connection: close`), every read bounded. Call inside a namespace (see
//! [`crate::netns::Netns::enter`]).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

pub use crate::client::Head;

/// Bound on connecting.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on each read or write: generous, since a request may wait for a free slot behind
/// long streams on a server with one thread.
pub const IO_TIMEOUT: Duration = Duration::from_secs(120);

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
    crate::client::send(stream, "llama", method, path, body)
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
    let body = head
        .body_text(reader)
        .with_context(|| format!("reading the body of {method} {path}"))?;
    Ok(Reply {
        status: head.status,
        body,
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
            let text = head.body_text(reader)?;
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
