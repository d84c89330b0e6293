//! Routing quality (issue 8, item 3): the same inference-shaped workload through five
//! policies in front of a pool of four time-scaled `inference-sim` servers with a prefix
//! cache, in the gateway topology:
//!
//! - round-robin: HAProxy `balance roundrobin` (TCP mode, VIP local to the gateway);
//! - least-connections: HAProxy `balance leastconn`;
//! - random: nftables DNAT `numgen random`;
//! - ours without hints: the agent and its XDP program, clients on ephemeral ports;
//! - ours with hints: the same, clients binding the hint port of their preamble with
//!   `balancer_agent::hint::connect` (requests without a shared preamble stay unhinted).
//!
//! The workload is generated once from a fixed seed, so every policy gets exactly the same
//! requests at the same offsets: a few shared preambles drawn by Zipf (and a share of
//! requests with none), user prompts and answers each spread over 100x (log-uniform), Poisson
//! arrivals with a burst at four times the base rate for the first 2 s of every 10 s. Each
//! request is a fresh connection with a streaming completion. Before each policy's run the
//! simulators restart (empty caches). The policies run in turn, once for each of two KV-cache
//! sizes (a tight one, where one server holds a few of the preambles and the four together
//! hold them all, and a roomy one, where every server can hold every preamble), the order
//! rotating from one cache size to the next; `--quick` runs the tight one only, shorter.
//!
//! Figures, per cache size: TTFT (from the start of `connect` to the first token)
//! p50 and p99; completed tokens per second (completion tokens of the requests that finished,
//! over the time from the first arrival to the last completion); prefix-cache hit rate
//! (cached prompt tokens over prompt tokens, from each answer's usage); worst queue (the
//! highest `waiting` any simulator reported, polled every 100 ms on `/admin/state`); and,
//! to see what the hints did, the share of the requests with a preamble that the home of
//! the preamble's hint bucket served.
//!
//! `cargo bench -p balancer-tests --bench routing [-- --quick]`, as root.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use balancer_agent::affinity::{home, Member};
use balancer_agent::hint;
use balancer_common::hint::HintRange;
use balancer_tests::agent::{release_agent_binary, Agent, AgentConfig};
use balancer_tests::backends::SimBackends;
use balancer_tests::bench::{fmt, quick_flag, Report};
use balancer_tests::competitors::{Haproxy, Nft};
use balancer_tests::sim::client::{self as sim_client, chunk_text, Item, Stream};
use balancer_tests::topology::{backend_name, Family, Topology, BACKENDS, BACKEND_PORT};
use serde_json::json;

const SIM: &str = env!("CARGO_BIN_EXE_inference-sim");
const XDP_PASS: &str = env!("CARGO_BIN_EXE_xdp-pass");

const POOL: &str = "chat-v4";
/// The simulators: twice real time, a batch of 8; the KV cache size is the regime's.
const TIME_SCALE: &str = "2";
const SLOTS: u32 = 8;

/// How much of the preambles a simulator's KV cache holds besides its running batch (on
/// average 8 requests of about 1,900 tokens, 15k tokens); the eight preambles take 13.3k.
struct Regime {
    key: &'static str,
    kv_tokens: usize,
    what: &'static str,
}

const REGIMES: [Regime; 2] = [
    Regime {
        key: "tight",
        kv_tokens: 20480,
        what: "a cache of 20480 tokens: about 5k beyond the batch, so one server holds a few \
               preambles and the four together hold them all",
    },
    Regime {
        key: "roomy",
        kv_tokens: 32768,
        what: "a cache of 32768 tokens: about 17k beyond the batch, so every server can hold \
               every preamble",
    },
];
/// The agent's scrape interval (1 s of the simulators' time).
const SCRAPE_INTERVAL_MS: u64 = 500;
const RANGE: HintRange = HintRange::DEFAULT;
/// Shared preambles, in order of popularity (Zipf, s = 1), and their lengths in words
/// (= tokens), not ordered by popularity.
const PREAMBLE_WORDS: [usize; 8] = [1500, 600, 3000, 400, 2000, 1000, 4000, 800];
const ZIPF_S: f64 = 1.0;
/// Share of requests with no shared preamble.
const NO_PREAMBLE: f64 = 0.2;
/// User prompt words and answer tokens: log-uniform over these ranges (100x each).
const USER_WORDS: (f64, f64) = (20.0, 2000.0);
const ANSWER_TOKENS: (f64, f64) = (10.0, 1000.0);
/// Arrivals: Poisson at the base rate, four times that during the first 2 s of every 10 s.
/// The pool runs 32 sequences at once (4 x 8); a mean answer (215 tokens) takes about 1.8 s
/// in a full batch, so it completes about 17 requests/s before prefill: 8/s (12.8/s on
/// average with the bursts) loads it to about three quarters, and the bursts (32/s) go past
/// it, so that queues form. (At 4/s no policy ever queued: nothing to compare.)
const BASE_RATE: f64 = 8.0;
const BURST_FACTOR: f64 = 4.0;
const BURST_PERIOD: f64 = 10.0;
const BURST_LENGTH: f64 = 2.0;
const SEED: u64 = 0x5eed_0008;
/// Requests in flight beyond which new ones are shed (and counted as failed).
const MAX_IN_FLIGHT: usize = 256;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const READ_TIMEOUT: Duration = Duration::from_secs(60);
const QUEUE_POLL: Duration = Duration::from_millis(100);
/// Bound on waiting for the server's close after `[DONE]`.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

struct Plan {
    /// One round per regime (indexes into [`REGIMES`]), the order of the policies rotating.
    regimes: Vec<usize>,
    /// Arrivals for this long.
    duration: f64,
    /// Bound on waiting for the last requests after the arrivals end.
    drain: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Policy {
    RoundRobin,
    LeastConn,
    Random,
    Ours,
    OursHints,
}

const POLICIES: [Policy; 5] = [
    Policy::RoundRobin,
    Policy::LeastConn,
    Policy::Random,
    Policy::Ours,
    Policy::OursHints,
];

impl Policy {
    fn label(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin (HAProxy roundrobin)",
            Policy::LeastConn => "least-connections (HAProxy leastconn)",
            Policy::Random => "random (nftables numgen random)",
            Policy::Ours => "ours, no hints",
            Policy::OursHints => "ours, with hints",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Policy::RoundRobin => "roundrobin",
            Policy::LeastConn => "leastconn",
            Policy::Random => "random",
            Policy::Ours => "ours",
            Policy::OursHints => "ours_hints",
        }
    }
}

/// One request of the workload.
struct Job {
    at: Duration,
    preamble: Option<usize>,
    user: String,
    max_tokens: u32,
}

/// What one request saw.
#[derive(Debug, Clone, Default)]
struct Outcome {
    ttft_ms: Option<f64>,
    finished_at: Option<Duration>,
    prompt_tokens: u64,
    cached_tokens: u64,
    completion_tokens: u64,
    error: Option<String>,
    /// Backend index that answered (its `x-backend` header).
    backend: Option<usize>,
}

/// One policy's run.
#[derive(Debug, Clone, Default)]
struct Run {
    outcomes: Vec<Outcome>,
    worst_queue: u64,
    /// Ours with hints: each preamble's home (backend index) as the agent had it at the end
    /// of the run, which balancing may have moved from the rendezvous home.
    homes: Option<Vec<usize>>,
}

fn main() -> Result<()> {
    let quick = quick_flag("routing")?;
    let plan = if quick {
        Plan {
            regimes: vec![0],
            duration: 5.0,
            drain: Duration::from_secs(30),
        }
    } else {
        Plan {
            regimes: vec![0, 1],
            duration: 40.0,
            drain: Duration::from_secs(90),
        }
    };
    balancer_tests::require_root()?;
    let started = Instant::now();
    let agent = release_agent_binary()?;
    let preambles: Vec<String> = PREAMBLE_WORDS
        .iter()
        .enumerate()
        .map(|(k, &n)| words(&format!("p{k}w"), n))
        .collect();
    let jobs = workload(plan.duration);
    let mut topology = Topology::build_bare()?;
    topology.attach_xdp_pass(Path::new(XDP_PASS))?;
    let result = rounds(&topology, &agent, &plan, &preambles, &jobs);
    drop(topology);
    let runs = result?;
    let homes = homes(&preambles);
    report(&plan, quick, &jobs, &homes, &runs, started.elapsed()).write()
}

fn sim_args(regime: &Regime) -> Vec<String> {
    [
        "--dialect",
        "vllm",
        "--time-scale",
        TIME_SCALE,
        "--max-running",
        &SLOTS.to_string(),
        "--kv-tokens",
        &regime.kv_tokens.to_string(),
    ]
    .map(String::from)
    .to_vec()
}

/// Each preamble's home: the backend index its hint bucket's rendezvous hashing picks among
/// the four servers, as a fresh agent with this one pool numbers them (1 to 4, in order).
fn homes(preambles: &[String]) -> Vec<usize> {
    let members: Vec<Member> = (0..BACKENDS)
        .map(|i| Member {
            id: i as u32 + 1,
            key: SocketAddr::new(Family::V4.backend(i), BACKEND_PORT).to_string(),
            weight: 100,
        })
        .collect();
    preambles
        .iter()
        .map(|p| {
            let bucket = RANGE.bucket_of_prefix(p.as_bytes());
            home(bucket, &members).map_or(usize::MAX, |id| id as usize - 1)
        })
        .collect()
}

/// Each preamble's home as the running agent has it (`buckets`), or its rendezvous home if
/// its bucket is not in use.
fn agent_homes(agent: &Agent, preambles: &[String]) -> Result<Vec<usize>> {
    let view = agent.buckets(POOL)?;
    let rendezvous = homes(preambles);
    preambles
        .iter()
        .zip(rendezvous)
        .map(|(p, plain)| {
            let bucket = RANGE.bucket_of_prefix(p.as_bytes());
            let Some(row) = view.buckets.iter().find(|b| b.bucket == bucket) else {
                return Ok(plain);
            };
            (0..BACKENDS)
                .find(|&i| {
                    row.home == SocketAddr::new(Family::V4.backend(i), BACKEND_PORT).to_string()
                })
                .with_context(|| format!("bucket {bucket}: home {} is no backend", row.home))
        })
        .collect()
}

/// Runs every policy once per regime; returns, per regime of the plan, the runs by policy.
fn rounds(
    topology: &Topology,
    agent: &Path,
    plan: &Plan,
    preambles: &[String],
    jobs: &[Job],
) -> Result<Vec<Vec<Run>>> {
    let first: Vec<Vec<String>> = (0..BACKENDS)
        .map(|_| sim_args(&REGIMES[plan.regimes[0]]))
        .collect();
    let mut sims = SimBackends::start(topology, Path::new(SIM), &first)?;
    let mut all = Vec::new();
    for (round, &r) in plan.regimes.iter().enumerate() {
        let regime = &REGIMES[r];
        let args: Vec<Vec<String>> = (0..BACKENDS).map(|_| sim_args(regime)).collect();
        let mut runs = vec![Run::default(); POLICIES.len()];
        for k in 0..POLICIES.len() {
            let p = (k + round) % POLICIES.len();
            let policy = POLICIES[p];
            let t = Instant::now();
            // Empty caches and zero counters for every run.
            for (i, a) in args.iter().enumerate() {
                sims.restart(i, a)?;
            }
            let run = with_policy(topology, agent, policy, preambles, || {
                run_workload(topology, &sims, plan, policy, preambles, jobs)
            })
            .with_context(|| format!("{} cache, {}", regime.key, policy.label()))?;
            let s = Stats::of(&run, jobs, &homes(preambles));
            eprintln!(
                "{} cache {:<38} TTFT p50 {} ms p99 {} ms  {} tokens/s  hit rate {}  home {}  worst queue {}  failed {}  ({:.1} s)",
                regime.key,
                policy.label(),
                fmt(s.p50, 0),
                fmt(s.p99, 0),
                fmt(s.tokens_per_s, 0),
                fmt(s.hit_rate, 3),
                fmt(s.home_share, 3),
                s.worst_queue,
                s.failed,
                t.elapsed().as_secs_f64()
            );
            for e in run.outcomes.iter().filter_map(|o| o.error.as_ref()).take(3) {
                eprintln!("  failed: {e}");
            }
            runs[p] = run;
        }
        all.push(runs);
    }
    Ok(all)
}

/// Sets `policy` up in the gateway, runs `f`, and tears it down whatever happened.
fn with_policy(
    topology: &Topology,
    agent: &Path,
    policy: Policy,
    preambles: &[String],
    f: impl FnOnce() -> Result<Run>,
) -> Result<Run> {
    let vip = Family::V4.vip();
    let servers: Vec<_> = (0..BACKENDS)
        .map(|i| SocketAddr::new(Family::V4.backend(i), BACKEND_PORT))
        .collect();
    let dir = topology.dir();
    match policy {
        Policy::RoundRobin | Policy::LeastConn => {
            let balance = if policy == Policy::RoundRobin {
                "roundrobin"
            } else {
                "leastconn"
            };
            let _haproxy =
                Haproxy::start(topology.gw(), dir, vip, &servers, balance, READ_TIMEOUT)?;
            f()
        }
        Policy::Random => {
            let _nft = Nft::start(topology.gw(), dir, vip, &servers, "random")?;
            f()
        }
        Policy::Ours | Policy::OursHints => {
            let mut config = AgentConfig::gateway(topology, [100; BACKENDS]);
            config.pools.retain(|p| p.name == POOL);
            config.agent.scrape_interval_ms = Some(SCRAPE_INTERVAL_MS);
            let pool = &mut config.pools[0];
            pool.slots = Some(SLOTS);
            pool.hint_ports = Some(format!(
                "{}-{}",
                RANGE.start,
                u32::from(RANGE.start) + u32::from(RANGE.span) - 1
            ));
            pool.hint_buckets = Some(RANGE.buckets);
            let running = Agent::start(topology, agent, &config)?;
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let pool = running.show(POOL)?;
                if pool.servers.iter().all(|s| {
                    s.state == "UP" && s.metrics_age_ms.is_some() && s.scrape_error.is_none()
                }) {
                    break;
                }
                ensure!(
                    Instant::now() < deadline,
                    "the agent did not scrape every server: {pool:?}"
                );
                thread::sleep(Duration::from_millis(50));
            }
            let out = f().and_then(|mut run| {
                if policy == Policy::OursHints {
                    run.homes = Some(agent_homes(&running, preambles)?);
                }
                Ok(run)
            });
            if out.is_err() {
                eprintln!("agent log:\n{}", running.log());
            }
            running.stop()?;
            out
        }
    }
}

/// Plays `jobs` from the client namespace while polling every simulator's queue.
fn run_workload(
    topology: &Topology,
    sims: &SimBackends,
    plan: &Plan,
    policy: Policy,
    preambles: &[String],
    jobs: &[Job],
) -> Result<Run> {
    let stop = AtomicBool::new(false);
    let worst = Mutex::new(0u64);
    thread::scope(|scope| {
        let pollers: Vec<_> = (0..BACKENDS)
            .map(|i| {
                let (stop, worst, addr) = (&stop, &worst, sims.metrics(i));
                scope.spawn(move || {
                    topology.backend(i).enter(|| {
                        // Bounded by the stop flag, and by the longest a run can take.
                        let deadline = Instant::now()
                            + Duration::from_secs_f64(plan.duration)
                            + plan.drain
                            + Duration::from_secs(30);
                        while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                            if let Ok(reply) = sim_client::get(addr, "/admin/state") {
                                if let Ok(state) = reply.json() {
                                    let waiting = state["waiting"].as_u64().unwrap_or(0);
                                    let mut w = worst.lock().expect("no panics");
                                    *w = (*w).max(waiting);
                                }
                            }
                            thread::sleep(QUEUE_POLL);
                        }
                        Ok(())
                    })
                })
            })
            .collect();
        let outcomes = topology
            .client()
            .enter(|| play(plan, policy, preambles, jobs));
        stop.store(true, Ordering::Relaxed);
        for p in pollers {
            p.join().expect("pollers do not panic")?;
        }
        Ok(Run {
            outcomes: outcomes?,
            worst_queue: *worst.lock().expect("no panics"),
            homes: None,
        })
    })
}

/// Sends every job at its offset on a thread of its own (in the caller's namespace).
fn play(plan: &Plan, policy: Policy, preambles: &[String], jobs: &[Job]) -> Result<Vec<Outcome>> {
    let in_flight = AtomicUsize::new(0);
    let results: Vec<Mutex<Outcome>> = jobs.iter().map(|_| Mutex::default()).collect();
    let started = Instant::now();
    thread::scope(|scope| {
        for (job, slot) in jobs.iter().zip(&results) {
            let wait = job.at.saturating_sub(started.elapsed());
            thread::sleep(wait);
            if in_flight.load(Ordering::Relaxed) >= MAX_IN_FLIGHT {
                slot.lock().expect("no panics").error = Some("shed: too many in flight".into());
                continue;
            }
            in_flight.fetch_add(1, Ordering::Relaxed);
            let in_flight = &in_flight;
            scope.spawn(move || {
                let outcome = request(policy, preambles, job, started);
                *slot.lock().expect("no panics") = outcome.unwrap_or_else(|e| Outcome {
                    error: Some(format!("{e:#}")),
                    ..Default::default()
                });
                in_flight.fetch_sub(1, Ordering::Relaxed);
            });
        }
        // Every request is bounded by its timeouts; this only reports a slow end.
        let deadline = Instant::now() + plan.drain;
        while in_flight.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(20));
        }
    });
    Ok(results
        .into_iter()
        .map(|m| m.into_inner().expect("no panics"))
        .collect())
}

fn request(policy: Policy, preambles: &[String], job: &Job, t0: Instant) -> Result<Outcome> {
    let vip = Family::V4.vip();
    let prompt = match job.preamble {
        Some(k) => format!("{} {}", preambles[k], job.user),
        None => job.user.clone(),
    };
    let started = Instant::now();
    let stream = match (policy, job.preamble) {
        (Policy::OursHints, Some(k)) => {
            hint::connect(vip, RANGE, preambles[k].as_bytes(), Some(CONNECT_TIMEOUT))
                .context("hinted connect")?
        }
        _ => TcpStream::connect_timeout(&vip, CONNECT_TIMEOUT).context("connect")?,
    };
    let body = json!({
        "prompt": prompt,
        "max_tokens": job.max_tokens,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    // To wait for the server's close at the end: reading our end to EOF means the server
    // closed first, so our source port does not sit in TIME_WAIT (a bucket has 64 ports).
    let socket = stream.try_clone()?;
    let mut stream = Stream::open_on(stream, READ_TIMEOUT, "/v1/completions", &body)?;
    let mut outcome = Outcome {
        backend: stream
            .head
            .header("x-backend")
            .and_then(|b| (0..BACKENDS).find(|&i| backend_name(i) == b)),
        ..Default::default()
    };
    let mut tokens = 0u64;
    // Bounded: one item per token, the usage, [DONE].
    for _ in 0..job.max_tokens as usize + 8 {
        match stream.next_item()? {
            Some(Item::Chunk { data, at }) => {
                if chunk_text(&data).is_some_and(|t| !t.is_empty()) {
                    tokens += 1;
                    if outcome.ttft_ms.is_none() {
                        outcome.ttft_ms = Some((at - started).as_secs_f64() * 1e3);
                    }
                }
                if let Some(usage) = data.get("usage").filter(|u| !u.is_null()) {
                    outcome.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
                    outcome.completion_tokens = usage["completion_tokens"].as_u64().unwrap_or(0);
                    outcome.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap_or(0);
                }
            }
            Some(Item::Done { at }) => {
                ensure!(outcome.prompt_tokens > 0, "no usage before [DONE]");
                ensure!(
                    tokens == u64::from(job.max_tokens),
                    "{tokens} tokens of {}",
                    job.max_tokens
                );
                outcome.finished_at = Some(at - t0);
                socket.set_read_timeout(Some(CLOSE_TIMEOUT))?;
                let mut rest = Vec::new();
                (&socket)
                    .take(4096)
                    .read_to_end(&mut rest)
                    .context("waiting for the server to close")?;
                return Ok(outcome);
            }
            None => bail!("the stream ended after {tokens} tokens, without [DONE]"),
        }
    }
    bail!("more events than tokens")
}

/// `n` distinct words with `tag`.
fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|j| format!("{tag}{j}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    fn log_uniform(&mut self, (low, high): (f64, f64)) -> f64 {
        (low.ln() + self.unit() * (high.ln() - low.ln())).exp()
    }
}

/// The request stream: the same for every policy.
fn workload(duration: f64) -> Vec<Job> {
    let mut rng = Rng(SEED);
    let weights: Vec<f64> = (1..=PREAMBLE_WORDS.len())
        .map(|k| 1.0 / (k as f64).powf(ZIPF_S))
        .collect();
    let total: f64 = weights.iter().sum();
    let mut jobs = Vec::new();
    let mut t = 0.0;
    loop {
        let rate = if t % BURST_PERIOD < BURST_LENGTH {
            BASE_RATE * BURST_FACTOR
        } else {
            BASE_RATE
        };
        t += -rng.unit().ln() / rate;
        if t >= duration {
            break;
        }
        let preamble = if rng.unit() < NO_PREAMBLE {
            None
        } else {
            let mut x = rng.unit() * total;
            let mut k = 0;
            while k + 1 < weights.len() && x > weights[k] {
                x -= weights[k];
                k += 1;
            }
            Some(k)
        };
        let n = jobs.len();
        let user = words(
            &format!("r{n}u"),
            rng.log_uniform(USER_WORDS).round() as usize,
        );
        let max_tokens = rng.log_uniform(ANSWER_TOKENS).round() as u32;
        jobs.push(Job {
            at: Duration::from_secs_f64(t),
            preamble,
            user,
            max_tokens,
        });
    }
    jobs
}

/// A policy's figures over one run.
#[derive(Debug, Default)]
struct Stats {
    requests: usize,
    failed: usize,
    p50: Option<f64>,
    p99: Option<f64>,
    tokens_per_s: Option<f64>,
    hit_rate: Option<f64>,
    /// Share of the finished requests with a preamble that its bucket's home served.
    home_share: Option<f64>,
    worst_queue: u64,
}

impl Stats {
    fn of(run: &Run, jobs: &[Job], homes: &[usize]) -> Self {
        let homes = run.homes.as_deref().unwrap_or(homes);
        let done: Vec<(&Outcome, &Job)> = run
            .outcomes
            .iter()
            .zip(jobs)
            .filter(|(o, _)| o.error.is_none())
            .collect();
        let mut ttft: Vec<f64> = done.iter().filter_map(|(o, _)| o.ttft_ms).collect();
        ttft.sort_by(f64::total_cmp);
        let q = |q: f64| {
            (!ttft.is_empty()).then(|| {
                let rank = ((q * ttft.len() as f64).ceil() as usize).clamp(1, ttft.len());
                ttft[rank - 1]
            })
        };
        let tokens: u64 = done.iter().map(|(o, _)| o.completion_tokens).sum();
        let prompt: u64 = done.iter().map(|(o, _)| o.prompt_tokens).sum();
        let cached: u64 = done.iter().map(|(o, _)| o.cached_tokens).sum();
        // From the first arrival (offset 0) to the last completion.
        let seconds = done
            .iter()
            .filter_map(|(o, _)| o.finished_at)
            .max()
            .map_or(0.0, |d| d.as_secs_f64());
        let with_preamble: Vec<(&Outcome, usize)> = done
            .iter()
            .filter_map(|(o, j)| Some((*o, j.preamble?)))
            .collect();
        let at_home = with_preamble
            .iter()
            .filter(|(o, k)| o.backend == Some(homes[*k]))
            .count();
        Stats {
            requests: run.outcomes.len(),
            failed: run.outcomes.len() - done.len(),
            p50: q(0.5),
            p99: q(0.99),
            tokens_per_s: (seconds > 0.0).then(|| tokens as f64 / seconds),
            hit_rate: (prompt > 0).then(|| cached as f64 / prompt as f64),
            home_share: (!with_preamble.is_empty())
                .then(|| at_home as f64 / with_preamble.len() as f64),
            worst_queue: run.worst_queue,
        }
    }
}

fn percent(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{:.1}%", v * 100.0))
}

fn report(
    plan: &Plan,
    quick: bool,
    jobs: &[Job],
    homes: &[usize],
    runs: &[Vec<Run>],
    took: Duration,
) -> Report {
    let mut out = Report {
        name: "routing".into(),
        quick,
        seconds: took.as_secs_f64(),
        ..Default::default()
    };
    let with_preamble = jobs.iter().filter(|j| j.preamble.is_some()).count();
    let prompt_tokens: Vec<usize> = jobs
        .iter()
        .map(|j| j.preamble.map_or(0, |k| PREAMBLE_WORDS[k]) + j.user.split_whitespace().count())
        .collect();
    let mut per_home = [0usize; BACKENDS];
    for j in jobs {
        if let Some(k) = j.preamble {
            per_home[homes[k]] += 1;
        }
    }
    let mut md = String::from("## 3. Routing quality\n\n");
    md += &format!(
        "Four `inference-sim` servers (vLLM metrics, prefix cache, time scale {TIME_SCALE}, \
         batch of {SLOTS}) behind the gateway. The workload (seed {SEED:#x}, identical for \
         every policy): {} requests over {:.0} s, Poisson arrivals at {BASE_RATE}/s with \
         bursts of {}x for the first {BURST_LENGTH:.0} s of every {BURST_PERIOD:.0} s (about \
         three quarters of the pool's batch capacity on average, past it in the bursts); {} \
         with one of {} shared preambles ({} to {} tokens, 13.3k in all) drawn by Zipf \
         (s = {ZIPF_S}), the rest with none; user prompts of {} to {} words and answers of {} \
         to {} tokens, log-uniform (prompts {} to {} tokens in all). Every request is a fresh \
         connection with a streaming completion (`ignore_eos`). The simulators restart before \
         every run (empty caches); the policies run in turn, their order rotating from one \
         table to the next. Ours: the agent with scrape interval {SCRAPE_INTERVAL_MS} ms, \
         `slots = {SLOTS}`, default spill thresholds, hint ports {}-{} in {} buckets; with \
         hints, a request with a preamble connects from its preamble's hint port \
         (`balancer_agent::hint::connect`). The preambles' homes (rendezvous hashing of their \
         hint buckets over the four servers: preamble, length, share of all requests, home) \
         are {}, which puts {} of the requests with a preamble on b1, b2, b3, b4 when every \
         one goes home.\n\n",
        jobs.len(),
        plan.duration,
        BURST_FACTOR,
        with_preamble,
        PREAMBLE_WORDS.len(),
        PREAMBLE_WORDS.iter().min().unwrap_or(&0),
        PREAMBLE_WORDS.iter().max().unwrap_or(&0),
        USER_WORDS.0,
        USER_WORDS.1,
        ANSWER_TOKENS.0,
        ANSWER_TOKENS.1,
        prompt_tokens.iter().min().unwrap_or(&0),
        prompt_tokens.iter().max().unwrap_or(&0),
        RANGE.start,
        u32::from(RANGE.start) + u32::from(RANGE.span) - 1,
        RANGE.buckets,
        (0..PREAMBLE_WORDS.len())
            .map(|k| {
                let n = jobs.iter().filter(|j| j.preamble == Some(k)).count();
                format!(
                    "p{} {} tokens {:.0}% {}",
                    k + 1,
                    PREAMBLE_WORDS[k],
                    n as f64 * 100.0 / jobs.len().max(1) as f64,
                    homes.get(k).map_or("-".into(), |&h| backend_name(h))
                )
            })
            .collect::<Vec<_>>()
            .join(", "),
        per_home
            .iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(", "),
    );
    md += "TTFT: from the start of `connect` to the first token, client side. Tokens/s: \
           completion tokens of finished requests over the time from the first arrival to the \
           last completion. Hit rate: cached prompt tokens over prompt tokens, from every \
           answer's usage (about 73% is the most any policy can reach: user prompts are never \
           shared). At home: the share of the requests with a preamble that the server the \
           preamble's hint bucket has as home answered (`x-backend`); about 25% is chance; for \
           ours with hints, the home the agent had at the end of the run (it balances homes by \
           their hinted traffic), for the others the rendezvous home. \
           Worst queue: the highest `waiting` any simulator reported (polled every 100 ms).\n\n";
    for (&r, runs) in plan.regimes.iter().zip(runs) {
        let regime = &REGIMES[r];
        let stats: Vec<Stats> = runs.iter().map(|run| Stats::of(run, jobs, homes)).collect();
        let ours = &stats[POLICIES.len() - 1];
        md += &format!("### {} cache: {}\n\n", regime.key, regime.what);
        md += "| policy | TTFT p50 (ms) | TTFT p99 (ms) | p99 / ours with hints | completed tokens/s | prefix-cache hit rate | at home | worst queue | failed / requests |\n\
               |---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
        let mut goal_p99 = Vec::new();
        let mut goal_hits = Vec::new();
        for (policy, s) in POLICIES.iter().zip(&stats) {
            let p99_ratio = match (s.p99, ours.p99) {
                (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                _ => None,
            };
            md += &format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} / {} |\n",
                policy.label(),
                fmt(s.p50, 0),
                fmt(s.p99, 0),
                if *policy == Policy::OursHints {
                    "1".into()
                } else {
                    format!("{}x", fmt(p99_ratio, 2))
                },
                fmt(s.tokens_per_s, 0),
                percent(s.hit_rate),
                percent(s.home_share),
                s.worst_queue,
                s.failed,
                s.requests
            );
            let k = format!("{}.{}", regime.key, policy.key());
            out.figures.insert(format!("{k}.ttft_p50_ms"), s.p50);
            out.figures.insert(format!("{k}.ttft_p99_ms"), s.p99);
            out.figures
                .insert(format!("{k}.tokens_per_s"), s.tokens_per_s);
            out.figures.insert(format!("{k}.hit_rate"), s.hit_rate);
            out.figures.insert(format!("{k}.home_share"), s.home_share);
            out.figures
                .insert(format!("{k}.worst_queue"), Some(s.worst_queue as f64));
            out.figures
                .insert(format!("{k}.failed"), Some(s.failed as f64));
            if *policy != Policy::OursHints {
                out.figures.insert(format!("{k}.p99_ratio"), p99_ratio);
                let p99_met = p99_ratio.is_some_and(|r| r >= 2.0);
                let hits_met = matches!((ours.hit_rate, s.hit_rate), (Some(a), Some(b)) if a > b);
                goal_p99.push(format!(
                    "{} {}x ({})",
                    policy.key(),
                    fmt(p99_ratio, 2),
                    if p99_met { "met" } else { "MISSED" }
                ));
                let precise = |v: Option<f64>| fmt(v.map(|h| h * 100.0), 2) + "%";
                goal_hits.push(format!(
                    "{} {} vs {} ({})",
                    policy.key(),
                    precise(ours.hit_rate),
                    precise(s.hit_rate),
                    if hits_met { "met" } else { "MISSED" }
                ));
            }
            out.summary.push(format!(
                "routing  {:<5} {:<38} TTFT p50 {:>5} p99 {:>6} ms  {:>5} tok/s  hits {:>6}  home {:>6}  queue {:>3}  failed {}",
                regime.key,
                policy.label(),
                fmt(s.p50, 0),
                fmt(s.p99, 0),
                fmt(s.tokens_per_s, 0),
                percent(s.hit_rate),
                percent(s.home_share),
                s.worst_queue,
                s.failed
            ));
        }
        if let Some(h) = &runs[POLICIES.len() - 1].homes {
            md += &format!(
                "\nOurs with hints, the preambles' homes at the end of the run (`balancer-agent \
                 buckets`): {}.\n",
                h.iter()
                    .enumerate()
                    .map(|(k, &i)| format!("p{} {}", k + 1, backend_name(i)))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        md += &format!(
            "\nGoal, ours with hints against every other policy ({} cache):\n\n\
             - TTFT p99 at least 2x lower: {}.\n\
             - higher prefix-cache hit rate: {}.\n\n",
            regime.key,
            goal_p99.join(", "),
            goal_hits.join(", ")
        );
        out.summary.push(format!(
            "routing  {:<5} goal p99 >= 2x: {}",
            regime.key,
            goal_p99.join(", ")
        ));
        out.summary.push(format!(
            "routing  {:<5} goal hit rate: {}",
            regime.key,
            goal_hits.join(", ")
        ));
    }
    out.markdown = md;
    out
}
