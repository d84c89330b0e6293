//! Load generator of the gateway benchmark (issue 8, item 2), run in the client namespace.
//! Every request is a fresh TCP connection (`GET PATH`, `Connection: close`, read to the
//! end); every mode is bounded by a request count and a duration, and every request by a
//! timeout. Prints one JSON object on stdout.
//!
//! - `rate`: closed loop, `--concurrency` workers each opening connection after connection
//!   as fast as they can: connections per second.
//! - `latency`: open loop, a new connection every 1/`--rate` s whatever the answers do:
//!   connect-to-first-byte latency (from the start of `connect` to the first byte of the
//!   response) under a fixed offered load.
//! - `bulk`: `--streams` connections each reading `GET /bulk` for the duration: bytes per
//!   second.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use balancer_tests::bench::Histogram;
use clap::{Parser, Subcommand};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio::time::{timeout, Instant, MissedTickBehavior};

#[derive(Parser)]
#[command(about = "Connections per second, latency and bulk throughput through a gateway")]
struct Args {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand)]
enum Mode {
    /// Closed loop: connections per second.
    Rate {
        #[arg(long)]
        target: SocketAddr,
        #[arg(long, default_value_t = 32)]
        concurrency: usize,
        #[arg(long)]
        duration_ms: u64,
        #[arg(long, default_value_t = 1_000_000)]
        max_requests: u64,
    },
    /// Open loop at a fixed rate: connect-to-first-byte latency.
    Latency {
        #[arg(long)]
        target: SocketAddr,
        /// New connections per second.
        #[arg(long)]
        rate: f64,
        #[arg(long)]
        duration_ms: u64,
        #[arg(long, default_value_t = 1_000_000)]
        max_requests: u64,
        /// Requests in flight beyond which the generator sheds (and counts) new ones.
        #[arg(long, default_value_t = 4096)]
        max_in_flight: usize,
    },
    /// Long streams: bytes per second.
    Bulk {
        #[arg(long)]
        target: SocketAddr,
        #[arg(long, default_value_t = 4)]
        streams: usize,
        #[arg(long)]
        duration_ms: u64,
    },
}

/// Bound on one short request, connect included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_RESPONSE: usize = 64 * 1024;

#[derive(Default)]
struct Tally {
    latency: Histogram,
    errors: BTreeMap<String, u64>,
}

impl Tally {
    fn add(&mut self, result: Result<Duration>) {
        match result {
            Ok(d) => self.latency.record(d.as_micros() as u64),
            Err(e) => *self.errors.entry(kind(&e)).or_default() += 1,
        }
    }
}

fn kind(e: &anyhow::Error) -> String {
    let root = e.root_cause().to_string();
    let what = e.to_string();
    format!("{what}: {root}")
        .split(|c: char| c.is_ascii_digit())
        .next()
        .unwrap_or_default()
        .chars()
        .take(80)
        .collect()
}

fn main() -> Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let out = runtime.block_on(async {
        match args.mode {
            Mode::Rate {
                target,
                concurrency,
                duration_ms,
                max_requests,
            } => rate(target, concurrency, duration_ms, max_requests).await,
            Mode::Latency {
                target,
                rate,
                duration_ms,
                max_requests,
                max_in_flight,
            } => latency(target, rate, duration_ms, max_requests, max_in_flight).await,
            Mode::Bulk {
                target,
                streams,
                duration_ms,
            } => bulk(target, streams, duration_ms).await,
        }
    })?;
    println!("{out}");
    Ok(())
}

/// One short request on a fresh connection; the time from the start of `connect` to the
/// first byte of the answer.
async fn request(target: SocketAddr) -> Result<Duration> {
    let started = Instant::now();
    let work = async {
        let mut stream = TcpStream::connect(target).await.context("connect")?;
        stream.set_nodelay(true)?;
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: vip\r\nConnection: close\r\n\r\n")
            .await
            .context("write")?;
        let mut buf = vec![0u8; 4096];
        let n = stream.read(&mut buf).await.context("read")?;
        let first = started.elapsed();
        ensure!(n > 0, "closed before answering");
        ensure!(buf.starts_with(b"HTTP/1.1 200"), "not a 200 answer");
        let mut total = n;
        loop {
            let n = stream.read(&mut buf).await.context("read")?;
            if n == 0 {
                break;
            }
            total += n;
            ensure!(total <= MAX_RESPONSE, "answer too long");
        }
        Ok(first)
    };
    timeout(REQUEST_TIMEOUT, work)
        .await
        .unwrap_or_else(|_| bail!("timeout"))
}

async fn rate(
    target: SocketAddr,
    concurrency: usize,
    duration_ms: u64,
    max_requests: u64,
) -> Result<serde_json::Value> {
    let started = Instant::now();
    let deadline = started + Duration::from_millis(duration_ms);
    let issued = Arc::new(AtomicU64::new(0));
    let mut workers = JoinSet::new();
    for _ in 0..concurrency {
        let issued = issued.clone();
        workers.spawn(async move {
            let mut tally = Tally::default();
            while Instant::now() < deadline && issued.fetch_add(1, Ordering::Relaxed) < max_requests
            {
                tally.add(request(target).await);
            }
            tally
        });
    }
    let mut tally = Tally::default();
    while let Some(t) = workers.join_next().await {
        let t = t?;
        tally.latency.merge(&t.latency);
        for (k, v) in t.errors {
            *tally.errors.entry(k).or_default() += v;
        }
    }
    Ok(summary("rate", &tally, started.elapsed(), 0))
}

async fn latency(
    target: SocketAddr,
    rate: f64,
    duration_ms: u64,
    max_requests: u64,
    max_in_flight: usize,
) -> Result<serde_json::Value> {
    ensure!(rate > 0.0 && rate.is_finite(), "--rate must be positive");
    let started = Instant::now();
    let deadline = started + Duration::from_millis(duration_ms);
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    // Missed ticks fire at once: the offered load stays what was asked for.
    ticks.set_missed_tick_behavior(MissedTickBehavior::Burst);
    let tally = Arc::new(Mutex::new(Tally::default()));
    let mut in_flight = JoinSet::new();
    let mut shed = 0u64;
    for _ in 0..max_requests {
        ticks.tick().await;
        if Instant::now() >= deadline {
            break;
        }
        while in_flight.try_join_next().is_some() {}
        if in_flight.len() >= max_in_flight {
            shed += 1;
            continue;
        }
        let tally = tally.clone();
        in_flight.spawn(async move {
            let result = request(target).await;
            tally.lock().expect("no panics").add(result);
        });
    }
    let elapsed = started.elapsed();
    while in_flight.join_next().await.is_some() {}
    let mut tally = std::mem::take(&mut *tally.lock().expect("no panics"));
    if shed > 0 {
        tally.errors.insert("shed: too many in flight".into(), shed);
    }
    Ok(summary("latency", &tally, elapsed, 0))
}

async fn bulk(target: SocketAddr, streams: usize, duration_ms: u64) -> Result<serde_json::Value> {
    let started = Instant::now();
    let deadline = started + Duration::from_millis(duration_ms);
    // Counted as they arrive, so that the bytes of a reader cut off by the deadline count.
    let bytes = Arc::new(AtomicU64::new(0));
    let mut readers = JoinSet::new();
    for _ in 0..streams {
        let bytes = bytes.clone();
        readers.spawn(async move {
            let work = read_bulk(target, bytes);
            // The stream never ends by itself: the deadline ends it.
            match tokio::time::timeout_at(deadline, work).await {
                Ok(Err(e)) => Err(e),
                Ok(Ok(())) => unreachable!("the loop only ends with an error"),
                Err(_) => Ok(()),
            }
        });
    }
    let mut tally = Tally::default();
    while let Some(r) = readers.join_next().await {
        match r? {
            Ok(()) => tally.latency.record(0),
            Err(e) => *tally.errors.entry(kind(&e)).or_default() += 1,
        }
    }
    let elapsed = started.elapsed();
    Ok(summary(
        "bulk",
        &tally,
        elapsed,
        bytes.load(Ordering::Relaxed),
    ))
}

/// Reads `GET /bulk` until an error or until it is cancelled, counting bytes in `bytes`.
async fn read_bulk(target: SocketAddr, bytes: Arc<AtomicU64>) -> Result<()> {
    let mut stream = TcpStream::connect(target).await.context("connect")?;
    stream
        .write_all(b"GET /bulk HTTP/1.1\r\nHost: vip\r\nConnection: close\r\n\r\n")
        .await
        .context("write")?;
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        let n = stream.read(&mut buf).await.context("read")?;
        ensure!(n > 0, "the stream ended early");
        bytes.fetch_add(n as u64, Ordering::Relaxed);
    }
}

fn summary(mode: &str, tally: &Tally, elapsed: Duration, bytes: u64) -> serde_json::Value {
    let secs = elapsed.as_secs_f64();
    let ok = tally.latency.count();
    let q = |q: f64| tally.latency.quantile(q);
    json!({
        "mode": mode,
        "ok": ok,
        "errors": tally.errors.values().sum::<u64>(),
        "error_kinds": tally.errors,
        "seconds": secs,
        "per_second": ok as f64 / secs,
        "p50_us": q(0.5),
        "p90_us": q(0.9),
        "p99_us": q(0.99),
        "max_us": q(1.0),
        "bytes": bytes,
        "bytes_per_second": bytes as f64 / secs,
    })
}
