//! The demo's clients, all in the client namespace: most send a 2,000-token preamble with
//! its prefix hint (the source port names the preamble's bucket), a few send prompts of their
//! own from ordinary ports; every request streams its completion. A small HTTP/1.1 client
//! whose every read gives up when the demo stops.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use balancer_agent::affinity::{home, Member};
use balancer_common::hint::HintRange;
use serde_json::{json, Value};

use crate::out;

/// The preamble's length in the simulator's tokens (whitespace-separated words).
pub const PREAMBLE_WORDS: usize = 2000;
/// With llama-server on a few CPU threads, a 2,000-token preamble costs tens of seconds of
/// prefill on every slot that has not seen it: `--real` uses a shorter one (about 400 of
/// its tokens).
pub const REAL_PREAMBLE_WORDS: usize = 300;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How often a blocked read looks at the stop flags.
const POLL: Duration = Duration::from_millis(200);
/// Longest silence within one response.
const IDLE_LIMIT: Duration = Duration::from_secs(30);
/// Longest response.
const RESPONSE_LIMIT: Duration = Duration::from_secs(120);
/// Most bytes kept of a response head or of one event.
const MAX_LINE: usize = 64 << 10;

const SENTENCES: [&str; 12] = [
    "Greet the customer by name when the ticket carries one, and never invent a name.",
    "Answer in the language of the question; if unsure, answer in English and offer to switch.",
    "Quote order numbers exactly as the customer wrote them, including leading zeros.",
    "Refunds up to fifty euros may be promised; anything larger goes to a human agent.",
    "Never ask for a full card number, a password, or a one-time code, whatever the reason.",
    "When a parcel is late by more than five working days, open a carrier claim and say so.",
    "Keep answers under two hundred words unless the customer asks for a detailed walkthrough.",
    "Link to the help centre article that matches the topic, and only to articles that exist.",
    "If the customer is angry, acknowledge the problem once, then move on to the solution.",
    "Escalate anything about safety, legal threats or data protection to the duty manager.",
    "Summarise what was agreed at the end of every conversation, in a short bulleted list.",
    "Do not discuss competitors, prices of other shops, or internal tooling and policies.",
];

/// The support bot's system prompt shared by most requests: exactly `length` words.
/// `revision` changes its first line, hence its hash, hence its bucket.
pub fn preamble(revision: u32, length: usize) -> String {
    let mut words: Vec<String> = format!(
        "You are the customer support assistant of Example Shop, policy revision {revision}. \
         Follow every rule below."
    )
    .split_whitespace()
    .map(str::to_owned)
    .collect();
    let mut rule = 1;
    while words.len() < length {
        let sentence = SENTENCES[(rule - 1) % SENTENCES.len()];
        words.push("Rule".to_owned());
        words.push(format!("{rule}:"));
        words.extend(sentence.split_whitespace().map(str::to_owned));
        rule += 1;
    }
    words.truncate(length);
    words.join(" ")
}

/// The servers that may be homes, as the agent names them (`address:port`, configured
/// weight 100).
pub fn members(servers: &[SocketAddr]) -> Vec<Member> {
    servers
        .iter()
        .enumerate()
        .map(|(i, s)| Member {
            id: u32::try_from(i).expect("a handful of servers") + 1,
            key: s.to_string(),
            weight: 100,
        })
        .collect()
}

/// The home of `bucket` among `servers`, as the agent computes it.
pub fn home_of(bucket: u16, servers: &[SocketAddr]) -> Option<SocketAddr> {
    let id = home(bucket, &members(servers))?;
    Some(servers[usize::try_from(id).ok()? - 1])
}

/// The preamble the demo uses: the first revision whose home is `wanted` both with and
/// without `leaving` in the pool (so the drain does not move it), or failing that the first
/// whose home does not move. Returns the text, its bucket and its home.
pub fn choose_preamble(
    length: usize,
    range: HintRange,
    all: &[SocketAddr],
    leaving: SocketAddr,
    wanted: SocketAddr,
) -> (String, u16, SocketAddr) {
    let staying: Vec<SocketAddr> = all.iter().copied().filter(|s| *s != leaving).collect();
    let mut fallback = None;
    for revision in 1..=200 {
        let text = preamble(revision, length);
        let bucket = range.bucket_of_prefix(text.as_bytes());
        let (Some(before), Some(after)) = (home_of(bucket, all), home_of(bucket, &staying)) else {
            continue;
        };
        if before != after {
            continue;
        }
        if after == wanted {
            return (text, bucket, after);
        }
        fallback.get_or_insert((text, bucket, after));
    }
    fallback.expect("some revision keeps its home when one server of four leaves")
}

/// Moves the calling thread into network namespace `name` for the rest of its life.
pub fn enter_netns(name: &str) -> Result<()> {
    let path = format!("/run/netns/{name}");
    let ns = File::open(&path).with_context(|| format!("opening {path}"))?;
    // SAFETY: a valid namespace fd; CLONE_NEWNET changes only this thread's namespace.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("entering {path}"));
    }
    Ok(())
}

/// The demo is stopping: not a failure of the request.
#[derive(Debug)]
pub struct Stopped;

impl fmt::Display for Stopped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("stopped")
    }
}

impl std::error::Error for Stopped {}

/// What ends a client: the demo stopping (signal, error) or its own part of it ending.
#[derive(Clone, Copy)]
pub struct Stop<'a>(pub &'a AtomicBool);

impl Stop<'_> {
    pub fn now(self) -> bool {
        out::stop_requested() || self.0.load(Ordering::SeqCst)
    }

    /// Sleeps up to `d`, less if the stop comes first.
    pub fn sleep(self, d: Duration) {
        let end = Instant::now() + d;
        while !self.now() {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            std::thread::sleep(left.min(Duration::from_millis(50)));
        }
    }
}

/// Connects to `vip` from a port of `prefix`'s bucket, or from any port without a prefix.
pub fn connect(vip: SocketAddr, prefix: Option<&str>) -> Result<TcpStream> {
    let stream = match prefix {
        Some(p) => balancer_agent::hint::connect(
            vip,
            HintRange::DEFAULT,
            p.as_bytes(),
            Some(CONNECT_TIMEOUT),
        )
        .with_context(|| format!("connecting to {vip} with a hint"))?,
        None => TcpStream::connect_timeout(&vip, CONNECT_TIMEOUT)
            .with_context(|| format!("connecting to {vip}"))?,
    };
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(POLL))?;
    stream.set_write_timeout(Some(CONNECT_TIMEOUT))?;
    Ok(stream)
}

enum Framing {
    Chunked,
    Length(usize),
    Close,
}

/// A response being read: its head, then its server-sent events.
pub struct Response<'a> {
    stream: TcpStream,
    stop: Stop<'a>,
    buf: Vec<u8>,
    started: Instant,
    last_byte: Instant,
    pub status: u16,
    /// `x-backend`: which server answered (the simulators send it).
    pub backend: Option<String>,
    framing: Framing,
    /// Body bytes not yet split into events.
    body: Vec<u8>,
    body_done: bool,
    /// The error body, for a status other than 200.
    pub error: Option<String>,
}

/// One server-sent event of a completion stream.
#[derive(Debug, PartialEq)]
pub enum Event {
    Token(String),
    Done,
}

/// Sends `POST /v1/completions` with `body` on `stream` and reads the response head.
pub fn post<'a>(mut stream: TcpStream, body: &Value, stop: Stop<'a>) -> Result<Response<'a>> {
    let body = body.to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        stream.peer_addr()?,
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    let now = Instant::now();
    let mut response = Response {
        stream,
        stop,
        buf: Vec::new(),
        started: now,
        last_byte: now,
        status: 0,
        backend: None,
        framing: Framing::Close,
        body: Vec::new(),
        body_done: false,
        error: None,
    };
    response.read_head()?;
    Ok(response)
}

impl Response<'_> {
    /// Reads more bytes into `buf`; false at the end of the connection.
    fn fill(&mut self) -> Result<bool> {
        let mut chunk = [0u8; 16 << 10];
        loop {
            if self.stop.now() {
                return Err(Stopped.into());
            }
            if self.last_byte.elapsed() > IDLE_LIMIT || self.started.elapsed() > RESPONSE_LIMIT {
                bail!("the response stalled");
            }
            match self.stream.read(&mut chunk) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    self.last_byte = Instant::now();
                    return Ok(true);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The next line of the connection, without its line end; None at its end.
    fn line(&mut self) -> Result<Option<String>> {
        loop {
            if let Some(end) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=end).collect();
                return Ok(Some(String::from_utf8_lossy(&line).trim_end().to_owned()));
            }
            if self.buf.len() > MAX_LINE {
                bail!("a line longer than {MAX_LINE} bytes");
            }
            if !self.fill()? {
                return Ok(None);
            }
        }
    }

    fn exact(&mut self, n: usize) -> Result<Vec<u8>> {
        while self.buf.len() < n {
            if !self.fill()? {
                bail!("the connection closed inside a chunk");
            }
        }
        Ok(self.buf.drain(..n).collect())
    }

    fn read_head(&mut self) -> Result<()> {
        let status = self
            .line()?
            .context("the connection closed before a response")?;
        self.status = status
            .strip_prefix("HTTP/1.1 ")
            .and_then(|s| s.get(..3))
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("bad status line {status:?}"))?;
        for _ in 0..100 {
            let line = self
                .line()?
                .context("the connection closed inside the head")?;
            if line.is_empty() {
                if self.status != 200 {
                    let mut body = Vec::new();
                    while let Some(piece) = self.body_piece()? {
                        body.extend(piece);
                    }
                    self.error = Some(String::from_utf8_lossy(&body).into_owned());
                }
                return Ok(());
            }
            let Some((name, value)) = line.split_once(':') else {
                bail!("bad header line {line:?}");
            };
            let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
            match name.as_str() {
                "x-backend" => self.backend = Some(value.to_owned()),
                "transfer-encoding" if value.eq_ignore_ascii_case("chunked") => {
                    self.framing = Framing::Chunked
                }
                "content-length" => {
                    self.framing = Framing::Length(value.parse().context("content-length")?)
                }
                _ => {}
            }
        }
        bail!("too many header lines")
    }

    /// The next piece of the body; None at its end.
    fn body_piece(&mut self) -> Result<Option<Vec<u8>>> {
        if self.body_done {
            return Ok(None);
        }
        match self.framing {
            Framing::Chunked => {
                let size = self
                    .line()?
                    .context("the connection closed inside the body")?;
                let size = size.split(';').next().unwrap_or_default().trim();
                let size = usize::from_str_radix(size, 16)
                    .with_context(|| format!("bad chunk size {size:?}"))?;
                if size == 0 {
                    self.body_done = true;
                    return Ok(None);
                }
                let piece = self.exact(size)?;
                self.exact(2)?;
                Ok(Some(piece))
            }
            Framing::Length(left) => {
                if left == 0 {
                    self.body_done = true;
                    return Ok(None);
                }
                if self.buf.is_empty() && !self.fill()? {
                    bail!("the connection closed inside the body");
                }
                let n = left.min(self.buf.len());
                self.framing = Framing::Length(left - n);
                Ok(Some(self.buf.drain(..n).collect()))
            }
            Framing::Close => {
                if self.buf.is_empty() && !self.fill()? {
                    self.body_done = true;
                    return Ok(None);
                }
                Ok(Some(std::mem::take(&mut self.buf)))
            }
        }
    }

    /// The next event of the stream; None when the stream ends.
    pub fn next_event(&mut self) -> Result<Option<Event>> {
        loop {
            while let Some(end) = self.body.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.body.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.trim_end().strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    return Ok(Some(Event::Done));
                }
                let value: Value = serde_json::from_str(data)
                    .with_context(|| format!("an event that is not JSON: {data:?}"))?;
                if let Some(text) = value["choices"][0]["text"].as_str() {
                    if !text.is_empty() {
                        return Ok(Some(Event::Token(text.to_owned())));
                    }
                }
            }
            if self.body.len() > MAX_LINE {
                bail!("an event longer than {MAX_LINE} bytes");
            }
            match self.body_piece()? {
                Some(piece) => self.body.extend(piece),
                None => return Ok(None),
            }
        }
    }

    /// Reads the stream to its end, handing every token to `on_token`.
    pub fn finish(mut self, mut on_token: impl FnMut(&str)) -> Result<Completion> {
        if self.status != 200 {
            bail!(
                "HTTP {} from {}: {}",
                self.status,
                self.backend.as_deref().unwrap_or("?"),
                self.error.as_deref().unwrap_or_default().trim()
            );
        }
        let mut completion = Completion {
            backend: self.backend.clone(),
            tokens: 0,
            ttft: None,
            done: false,
        };
        while let Some(event) = self.next_event()? {
            match event {
                Event::Token(text) => {
                    completion.tokens += 1;
                    completion.ttft.get_or_insert(self.started.elapsed());
                    on_token(&text);
                }
                Event::Done => completion.done = true,
            }
        }
        self.await_close();
        Ok(completion)
    }

    /// Waits (briefly) for the server to close the connection, as `Connection: close` asks:
    /// the side that closes first keeps the port in TIME_WAIT for a minute, and a hinted
    /// client has only 64 ports per bucket.
    fn await_close(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            self.buf.clear();
            match self.stream.read(&mut [0u8; 512]) {
                Ok(0) => return,
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(_) => return,
            }
        }
    }
}

/// A finished completion.
#[derive(Debug)]
pub struct Completion {
    pub backend: Option<String>,
    pub tokens: u32,
    /// As the client saw it: from sending the request to the first token.
    pub ttft: Option<Duration>,
    /// `[DONE]` arrived.
    pub done: bool,
}

/// A completion request.
pub fn request_body(model: &str, prompt: &str, max_tokens: u32) -> Value {
    json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": true,
        "ignore_eos": true,
    })
}

/// Requests served, per kind and server.
#[derive(Default)]
pub struct Tally {
    inner: Mutex<TallyInner>,
}

#[derive(Default, Clone)]
pub struct Count {
    pub requests: u32,
    pub ttft_ms_sum: f64,
}

#[derive(Default, Clone)]
pub struct TallyInner {
    /// (hinted, server) -> count.
    pub served: BTreeMap<(bool, String), Count>,
    pub errors: u32,
    pub first_errors: Vec<String>,
}

impl Tally {
    fn lock(&self) -> std::sync::MutexGuard<'_, TallyInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn served(&self, hinted: bool, c: &Completion) {
        let mut t = self.lock();
        let entry = t
            .served
            .entry((hinted, c.backend.clone().unwrap_or_else(|| "?".into())))
            .or_default();
        entry.requests += 1;
        entry.ttft_ms_sum += c.ttft.map_or(0.0, |d| d.as_secs_f64() * 1e3);
    }

    fn failed(&self, e: &anyhow::Error) -> u32 {
        let mut t = self.lock();
        t.errors += 1;
        if t.first_errors.len() < 3 {
            t.first_errors.push(format!("{e:#}"));
        }
        t.errors
    }

    pub fn snapshot(&self) -> TallyInner {
        self.lock().clone()
    }
}

/// What every client of the workload shares.
pub struct Workload<'a> {
    pub vip: SocketAddr,
    pub model: &'a str,
    pub preamble: &'a str,
    pub tally: &'a Tally,
    pub out: &'a out::Out,
    pub stop: Stop<'a>,
    /// Shortest and longest answer of a request with the preamble.
    pub hinted_tokens: (u32, u32),
    /// Answer of the other requests.
    pub other_tokens: u32,
}

impl Workload<'_> {
    /// One client in a loop: requests with the preamble and its hint when `hinted`, other
    /// prompts from ordinary ports otherwise. Runs in the client namespace until stopped.
    pub fn client(&self, client_ns: &str, index: u32, hinted: bool) {
        if let Err(e) = enter_netns(client_ns) {
            self.out
                .line(out::Style::Warn, &format!("client {index}: {e:#}"));
            return;
        }
        let mut n = 0u32;
        while !self.stop.now() {
            n += 1;
            let result = if hinted {
                let prompt = format!(
                    "{}\n\nCustomer {index}-{n}: where is my parcel, order 00{}{n}?",
                    self.preamble,
                    index * 7
                );
                // Answers of several lengths.
                let (low, high) = self.hinted_tokens;
                let max_tokens = low + (index * 37 + n * 11) % (high - low + 1);
                self.one(Some(self.preamble), &prompt, max_tokens)
            } else {
                self.one(None, &other_prompt(index, n), self.other_tokens)
            };
            match result {
                Ok(c) => self.tally.served(hinted, &c),
                Err(e) if e.is::<Stopped>() => break,
                Err(e) => {
                    if self.tally.failed(&e) <= 3 {
                        self.out.line(
                            out::Style::Warn,
                            &format!("client {index}: request failed: {e:#}"),
                        );
                    }
                    self.stop.sleep(Duration::from_millis(500));
                }
            }
        }
    }

    /// One long request without the preamble, in the client namespace; its answer is read
    /// and dropped.
    pub fn long(&self, client_ns: &str, index: u32, max_tokens: u32) {
        let result = enter_netns(client_ns)
            .and_then(|()| self.one(None, &other_prompt(index, 0), max_tokens));
        if let Err(e) = result {
            if !e.is::<Stopped>() && self.tally.failed(&e) <= 3 {
                self.out.line(
                    out::Style::Warn,
                    &format!("client {index}: request failed: {e:#}"),
                );
            }
        }
    }

    /// One request with the preamble, in the client namespace.
    pub fn once(&self, client_ns: &str, index: u32) {
        let result = enter_netns(client_ns).and_then(|()| {
            let prompt = format!(
                "{}\n\nCustomer {index}: can I change the delivery address?",
                self.preamble
            );
            self.one(Some(self.preamble), &prompt, self.hinted_tokens.1)
        });
        match result {
            Ok(c) => self.tally.served(true, &c),
            Err(e) if e.is::<Stopped>() => {}
            Err(e) => {
                if self.tally.failed(&e) <= 3 {
                    self.out.line(
                        out::Style::Warn,
                        &format!("client {index}: request failed: {e:#}"),
                    );
                }
            }
        }
    }

    fn one(&self, prefix: Option<&str>, prompt: &str, max_tokens: u32) -> Result<Completion> {
        let stream = connect(self.vip, prefix)?;
        let body = request_body(self.model, prompt, max_tokens);
        post(stream, &body, self.stop)?.finish(|_| {})
    }
}

/// A prompt of its own: a ticket to summarise, about 200 words that no other request shares.
pub fn other_prompt(index: u32, n: u32) -> String {
    let mut words = vec![format!(
        "Summarise ticket {index}-{n} for the weekly report in three sentences:"
    )];
    for i in 0..25u32 {
        let sentence = SENTENCES[((index + n + i) as usize * 5) % SENTENCES.len()];
        words.push(format!("({index}.{n}.{i})"));
        words.extend(sentence.split_whitespace().take(7).map(str::to_owned));
    }
    words.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preamble_has_its_length_and_keeps_its_home() {
        for revision in [1, 2, 77] {
            assert_eq!(
                preamble(revision, PREAMBLE_WORDS)
                    .split_whitespace()
                    .count(),
                PREAMBLE_WORDS
            );
        }
        let servers: Vec<SocketAddr> = (11..=14)
            .map(|i| format!("10.4.0.{i}:8000").parse().unwrap())
            .collect();
        let (text, bucket, chosen) = choose_preamble(
            PREAMBLE_WORDS,
            HintRange::DEFAULT,
            &servers,
            servers[3],
            servers[1],
        );
        assert_eq!(HintRange::DEFAULT.bucket_of_prefix(text.as_bytes()), bucket);
        assert_eq!(home_of(bucket, &servers), Some(chosen));
        assert_eq!(home_of(bucket, &servers[..3]), Some(chosen));
    }
}
