//! Issue 6: a real inference server behind the VIP. Two llama.cpp `llama-server`s (the
//! brief's build and model, from `cargo xtask real-backend`'s cache) in backends b1 and b2 of
//! the gateway topology, one thread and a few slots each, API and metrics on one port; the
//! agent on the gateway with `dialect = "llamacpp"`. Every figure is measured and printed.
//!
//! 1. A streamed completion through the VIP arrives token by token (the first event well
//!    before the last), and at temperature 0 its text equals that of the same request sent
//!    straight to each server.
//! 2. The agent scrapes the llama.cpp dialect: `show --json` gives running and waiting (and
//!    they follow a stream), null for KV memory and TTFT, which llama.cpp does not publish;
//!    the table shows `-` there.
//! 3. More concurrent streams than b1 has slots, started straight on b1: its
//!    `requests_deferred` takes its weight to 0, and new connections through the VIP all land
//!    on b2 (each asks `/props`, whose `model_path` names the server), until the streams end.
//! 4. The same bounded workload of a few shared preambles, unhinted and then hinted (source
//!    ports of the preamble's bucket): the hinted run has the higher
//!    `llamacpp:prompt_tokens_cached_total` / `llamacpp:prompt_tokens_total` (cached tokens
//!    over tokens actually processed, summed over both servers); both ratios are printed.
//!
//! The servers run with `--cache-ram 0`: a server then keeps exactly one prompt per slot, as
//! a GPU server's KV cache holds a limited number of prefixes. With llama.cpp's default host
//! prompt cache (8 GiB), a 135M model's server keeps hundreds of preambles, every server
//! ends up holding every preamble, and affinity would only save each preamble's first visit
//! to the second server.
//!
//! The scenarios share the topology, the servers and one agent; each waits until both
//! servers are idle first. A failed scenario does not stop the others; the test fails at the
//! end with all their errors, printing every process's log.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::thread::{self, sleep};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use balancer_agent::affinity::{home, Member};
use balancer_agent::control::{PoolView, ServerRow};
use balancer_agent::hint;
use balancer_common::hint::HintRange;
use balancer_tests::agent::{agent_binary, Agent, AgentConfig, PoolViewExt};
use balancer_tests::llama::{self, completion_body, CompletionStream, Streamed};
use balancer_tests::real_backend::{self, LlamaOptions, LlamaServer, RealBackend, MODEL_ALIAS};
use balancer_tests::topology::{
    backend_name, Family, Topology, BACKENDS, BACKEND_PORT, GATEWAY_INTERFACES,
};
use balancer_tests::{check_nothing_remains, serial};
use serde_json::Value;

const XDP_PASS: &str = env!("CARGO_BIN_EXE_xdp-pass");

const POOL: &str = "chat-v4";
/// Backends b1 and b2 run a server each; b3 and b4 stay empty.
const SERVERS: usize = 2;
/// `-np`: requests a server runs at once.
const SLOTS: u32 = 3;
/// Context per slot: room for a preamble, a question and the longest answer here.
const CTX_PER_SLOT: u32 = 2048;
const SCRAPE_INTERVAL: Duration = Duration::from_millis(500);
const SPILL_WAITING: u32 = 1;
/// The hint scheme's defaults: ports 16384-32767, 256 buckets.
const RANGE: HintRange = HintRange::DEFAULT;
/// Bound on waiting for the agent (or a server) to show a state.
const SETTLE: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(50);

#[test]
fn llama_server_behind_the_vip() {
    let _serial = serial();
    // First, so that a missing build says what to run before anything else happens.
    let real = real_backend::locate().unwrap();
    let agent = agent_binary().unwrap();
    let started = Instant::now();
    let mut topology = Topology::build_bare().unwrap();
    topology.attach_xdp_pass(Path::new(XDP_PASS)).unwrap();
    println!("topology ready in {:.1} s", secs(started.elapsed()));
    // Panicking with the topology alive makes it print every process's log.
    if let Err(e) = run(&topology, &agent, &real) {
        panic!("{e:?}");
    }
    drop(topology);
    check_nothing_remains().unwrap();
    println!("total {:.1} s", secs(started.elapsed()));
}

type Scenario = fn(&Bed) -> Result<()>;

fn run(topology: &Topology, agent: &Path, real: &RealBackend) -> Result<()> {
    let started = Instant::now();
    let options = LlamaOptions {
        slots: SLOTS,
        ctx_per_slot: CTX_PER_SLOT,
        extra: ["--cache-ram", "0"].map(String::from).to_vec(),
    };
    let servers = (0..SERVERS)
        .map(|i| {
            LlamaServer::start(
                topology.backend(i),
                real,
                &backend_name(i),
                api(i),
                &options,
                topology.dir(),
            )
        })
        .collect::<Result<Vec<_>>>()?;
    println!(
        "{SERVERS} llama-servers ({} -np {SLOTS} -c {} -t 1 --cache-ram 0) ready in {:.1} s",
        real.llama_server.display(),
        SLOTS * CTX_PER_SLOT,
        secs(started.elapsed())
    );

    let started = Instant::now();
    let agent = Agent::start(topology, agent, &config(topology))?;
    let attached = topology.gateway_xdp()?;
    ensure!(
        attached.len() == GATEWAY_INTERFACES.len(),
        "the agent is ready but XDP is attached only to {attached:?}"
    );
    let bed = Bed {
        topology,
        servers,
        agent,
    };
    bed.wait_show("every server UP and scraped", SETTLE, |pool| {
        Ok(pool
            .servers
            .iter()
            .all(|s| s.state == "UP" && s.metrics_age_ms.is_some() && s.scrape_error.is_none()))
    })?;
    println!("agent ready in {:.1} s", secs(started.elapsed()));

    let scenarios: [(&str, Scenario); 4] = [
        ("1. a stream through the VIP", stream_through_the_vip),
        ("2. the llama.cpp dialect in show", dialect_in_show),
        ("3. a deferred queue moves new connections", deferred_queue),
        (
            "4. prefix affinity and llama.cpp's prompt cache",
            affinity_and_cache,
        ),
    ];
    let mut failed = Vec::new();
    for (name, scenario) in scenarios {
        println!("\n=== {name}");
        let started = Instant::now();
        let result = bed.wait_idle().and_then(|()| scenario(&bed));
        match result {
            Ok(()) => println!("=== {name}: passed in {:.1} s", secs(started.elapsed())),
            Err(e) => {
                println!("=== {name}: FAILED: {e:#}");
                failed.push(format!("{name}: {e:?}"));
            }
        }
    }
    let Bed { agent, servers, .. } = bed;
    if let Err(e) = agent.stop() {
        failed.push(format!("stopping the agent: {e:?}"));
    }
    drop(servers);
    ensure!(
        failed.is_empty(),
        "{} of 4 scenarios failed:\n{}",
        failed.len(),
        failed.join("\n\n")
    );
    Ok(())
}

/// The IPv4 pool over b1 and b2: llama.cpp's metrics on the API port, hints with the
/// scheme's defaults, `slots` as the servers have.
fn config(topology: &Topology) -> AgentConfig {
    let mut config = AgentConfig::gateway(topology, [100; BACKENDS]);
    config.pools.retain(|pool| pool.name == POOL);
    config.agent.scrape_interval_ms = Some(millis(SCRAPE_INTERVAL));
    let pool = &mut config.pools[0];
    pool.servers.truncate(SERVERS);
    for server in &mut pool.servers {
        server.metrics_port = BACKEND_PORT;
    }
    pool.dialect = Some("llamacpp".into());
    pool.model = Some(MODEL_ALIAS.into());
    pool.slots = Some(SLOTS);
    pool.spill_waiting = Some(SPILL_WAITING);
    pool.hint_ports = Some(format!(
        "{}-{}",
        RANGE.start,
        u32::from(RANGE.start) + u32::from(RANGE.span) - 1
    ));
    pool.hint_buckets = Some(RANGE.buckets);
    config
}

/// What the scenarios share.
struct Bed<'t> {
    topology: &'t Topology,
    servers: Vec<LlamaServer>,
    agent: Agent<'t>,
}

impl Bed<'_> {
    fn show(&self) -> Result<PoolView> {
        self.agent.show(POOL)
    }

    /// Polls `show` until `pred` holds; returns that answer.
    fn wait_show(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&PoolView) -> Result<bool>,
    ) -> Result<PoolView> {
        Ok(self.agent.wait_show(POOL, what, (timeout, POLL), pred)?.0)
    }

    /// `balancer-agent show pool POOL`: the operator's table.
    fn table(&self) -> Result<String> {
        self.agent.cli(&["show", "pool", POOL])
    }

    /// Server `i`'s own metrics, read from inside its namespace.
    fn metrics(&self, i: usize) -> Result<BTreeMap<String, f64>> {
        self.topology.backend(i).enter(|| llama::metrics(api(i)))
    }

    /// Both servers idle by their own metrics and in the agent's picture.
    fn wait_idle(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let mut busy = Vec::new();
            for i in 0..SERVERS {
                let m = self.metrics(i)?;
                let (running, waiting) = (
                    llama::sample(&m, "llamacpp:requests_processing")?,
                    llama::sample(&m, "llamacpp:requests_deferred")?,
                );
                if running + waiting > 0.0 {
                    busy.push(format!(
                        "{}: {running} running, {waiting} deferred",
                        address(i)
                    ));
                }
            }
            if busy.is_empty() {
                break;
            }
            ensure!(Instant::now() < deadline, "servers still busy: {busy:?}");
            sleep(Duration::from_millis(200));
        }
        self.wait_show("both servers idle and weighted", SETTLE, |pool| {
            Ok(pool.servers.iter().all(|s| {
                s.state == "UP" && s.weight > 0 && s.waiting == Some(0.0) && s.running == Some(0.0)
            }))
        })?;
        Ok(())
    }

    /// Which server answers `n` new connections through the VIP, one after the other, each
    /// asking `/props` (whose `model_path` is the server's own link to the model).
    fn landings(&self, n: usize) -> Result<[usize; SERVERS]> {
        let paths: Vec<String> = self
            .servers
            .iter()
            .map(|s| s.model_path.display().to_string())
            .collect();
        self.topology.client().enter(|| {
            let mut count = [0; SERVERS];
            for k in 0..n {
                let reply = llama::get(vip(), "/props")
                    .with_context(|| format!("GET /props through the VIP, connection {k}"))?;
                ensure!(
                    reply.status == 200,
                    "/props: {} {}",
                    reply.status,
                    reply.body
                );
                let path = reply.json()?["model_path"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                let i = paths
                    .iter()
                    .position(|p| *p == path)
                    .with_context(|| format!("/props names no server of ours: {path:?}"))?;
                count[i] += 1;
            }
            Ok(count)
        })
    }
}

// ---------------------------------------------------------------------------------------
// 1. A stream through the VIP.

const STREAM_PROMPT: &str = "The old lighthouse keeper climbed the spiral stairs at dusk and";
const STREAM_TOKENS: u32 = 64;

fn stream_through_the_vip(bed: &Bed) -> Result<()> {
    let body = completion_body(STREAM_PROMPT, STREAM_TOKENS, true);
    let via = bed
        .topology
        .client()
        .enter(|| CompletionStream::open(llama::connect(vip())?, &body)?.finish())
        .context("the stream through the VIP")?;
    let events: Vec<_> = via.text_events().collect();
    ensure!(
        via.done,
        "the stream through the VIP ended without [DONE] after {} events",
        via.events.len()
    );
    let n = events.len();
    ensure!(
        n >= STREAM_TOKENS as usize * 3 / 4,
        "{n} events with text for {STREAM_TOKENS} tokens: not token by token"
    );
    let first = events[0].at - via.sent;
    let last = events[n - 1].at - via.sent;
    // Events read within a millisecond of the one before came in one burst.
    let separate = events
        .windows(2)
        .filter(|w| w[1].at - w[0].at >= Duration::from_millis(1))
        .count()
        + 1;
    println!(
        "through the VIP: {n} events with text ({STREAM_TOKENS} tokens asked); first after \
         {:.0} ms, last after {:.0} ms; {separate} arrived apart from the one before",
        ms(first),
        ms(last)
    );
    ensure!(
        first * 3 < last,
        "the first event ({first:?}) did not come well before the last ({last:?})"
    );
    ensure!(
        separate * 2 >= n,
        "only {separate} of {n} events arrived apart: the stream came in bursts"
    );
    let text = via.text();
    println!("text: {:?}", abbreviate(&text, 100));

    for i in 0..SERVERS {
        let direct: Streamed = bed
            .topology
            .backend(i)
            .enter(|| CompletionStream::open(llama::connect(api(i))?, &body)?.finish())
            .with_context(|| format!("the stream straight to {}", address(i)))?;
        ensure!(
            direct.done,
            "the stream straight to {} ended early",
            address(i)
        );
        let same = direct.text() == text;
        println!(
            "straight to {}: {} events, the same text: {same}",
            address(i),
            direct.text_events().count()
        );
        ensure!(
            same,
            "temperature 0, yet {} answered straight {:?}, through the VIP {:?}",
            address(i),
            direct.text(),
            text
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 2. The llama.cpp dialect in show.

/// Long enough to be seen running by several scrapes.
const BUSY_TOKENS: u32 = 200;

fn dialect_in_show(bed: &Bed) -> Result<()> {
    // The raw JSON: the keys are there, null where llama.cpp publishes nothing.
    let raw: Value = serde_json::from_str(&bed.agent.cli(&["show", "pool", POOL, "--json"])?)?;
    for row in raw["servers"]
        .as_array()
        .context("no servers in show --json")?
    {
        let server = row["server"].as_str().unwrap_or_default();
        println!(
            "show --json, idle: {server}: dialect {}, running {}, waiting {}, kv_mem {}, \
             ttft_ms {}",
            row["dialect"], row["running"], row["waiting"], row["kv_mem"], row["ttft_ms"]
        );
        ensure!(
            row["dialect"] == "llamacpp",
            "{server}: dialect {}",
            row["dialect"]
        );
        ensure!(
            row["running"].is_number() && row["waiting"].is_number(),
            "{server}: running {} and waiting {} should be numbers",
            row["running"],
            row["waiting"]
        );
        for key in ["kv_mem", "ttft_ms"] {
            ensure!(
                row.get(key) == Some(&Value::Null),
                "{server}: {key} is {:?}, but llama.cpp publishes no such signal",
                row.get(key)
            );
        }
    }

    // A stream straight to b1: the agent's running follows the server's own gauge, and the
    // counter the agent reads as progress moves while it runs, not only at its end.
    let target = 0;
    let decodes = || llama::sample(&bed.metrics(target)?, "llamacpp:n_decode_total");
    let decodes_before = decodes()?;
    thread::scope(|scope| -> Result<()> {
        let stream = scope.spawn(|| {
            bed.topology.backend(target).enter(|| {
                let body = completion_body(STREAM_PROMPT, BUSY_TOKENS, true);
                CompletionStream::open(llama::connect(api(target))?, &body)?.finish()
            })
        });
        let deadline = Instant::now() + SETTLE;
        let decodes_mid = loop {
            let now = decodes()?;
            if now > decodes_before {
                break now;
            }
            ensure!(
                !stream.is_finished(),
                "llamacpp:n_decode_total did not move before the stream ended ({now})"
            );
            ensure!(
                Instant::now() < deadline,
                "llamacpp:n_decode_total still {now}"
            );
            sleep(POLL);
        };
        let seen = bed.wait_show("b1 running 1 in show", SETTLE, |pool| {
            Ok(pool.server(Family::V4.backend(target))?.running == Some(1.0))
        });
        let own = bed.metrics(target);
        let table = bed.table();
        let streamed = stream.join().expect("the stream does not panic");
        let (seen, own, table, streamed) = (seen?, own?, table?, streamed?);
        let row = seen.server(Family::V4.backend(target))?;
        println!(
            "during a stream to {}: show says running {:?}, waiting {:?}; the server's own \
             llamacpp:requests_processing {}, llamacpp:requests_deferred {}",
            address(target),
            row.running,
            row.waiting,
            llama::sample(&own, "llamacpp:requests_processing")?,
            llama::sample(&own, "llamacpp:requests_deferred")?,
        );
        print!("{table}");
        // The operator's table: `-` in kv-mem and ttft-ms for every server.
        let rows: Vec<Vec<&str>> = table
            .lines()
            .skip_while(|l| !l.starts_with("server"))
            .map(|l| l.split_whitespace().collect())
            .collect();
        ensure!(
            rows.first().map(|h| &h[3..5]) == Some(&["kv-mem", "ttft-ms"][..]),
            "unexpected header in:\n{table}"
        );
        ensure!(
            rows.len() == SERVERS + 1,
            "not one row per server:\n{table}"
        );
        for r in &rows[1..] {
            ensure!(
                r[3] == "-" && r[4] == "-",
                "kv-mem and ttft-ms should be '-' for llama.cpp:\n{table}"
            );
        }
        ensure!(streamed.done, "the stream ended early");
        let decodes_after = decodes()?;
        println!(
            "llamacpp:n_decode_total (the agent's progress signal): {decodes_before} before the \
             stream, {decodes_mid} while it ran, {decodes_after} after"
        );
        // One llama_decode() per token at least: a counter moved per step.
        ensure!(
            decodes_after - decodes_before >= f64::from(BUSY_TOKENS),
            "llamacpp:n_decode_total moved by {} over a stream of {BUSY_TOKENS} tokens",
            decodes_after - decodes_before
        );
        Ok(())
    })?;
    let idle = bed.wait_show("b1 back to running 0", SETTLE, |pool| {
        Ok(pool.server(Family::V4.backend(target))?.running == Some(0.0))
    })?;
    println!(
        "after the stream: running {:?}",
        idle.server(Family::V4.backend(target))?.running
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 3. A deferred queue moves new connections.

/// Two more than the slots: two requests wait.
const FLOOD_STREAMS: u32 = SLOTS + 2;
/// Long enough that the queue outlasts the agent's reaction and the counting: at one thread
/// for three sequences, several seconds.
const FLOOD_TOKENS: u32 = 200;
/// New connections counted before, during and after.
const PROBES: usize = 20;

fn deferred_queue(bed: &Bed) -> Result<()> {
    let (target, other) = (0, 1);
    let before = bed.landings(PROBES)?;
    println!(
        "before: {PROBES} new connections through the VIP land {} on {}, {} on {}",
        before[target],
        address(target),
        before[other],
        address(other)
    );

    let log_mark = bed.agent.log().len();
    let mut timeline = Timeline::new(target);
    let (during, queued) = thread::scope(|scope| -> Result<_> {
        let flood = scope.spawn(|| flood(bed, target));
        // The target's weight as the agent shows it: to 0 once the queue is seen, ...
        let saturated = timeline.until(bed, "saturated with a queue", |row| {
            row.weight == 0 && row.waiting >= Some(f64::from(SPILL_WAITING))
        })?;
        let own = bed.metrics(target)?;
        let queued = (
            llama::sample(&own, "llamacpp:requests_processing")?,
            llama::sample(&own, "llamacpp:requests_deferred")?,
        );
        print!("{}", bed.table()?);
        let reason = &saturated.server(Family::V4.backend(target))?.reason;
        println!("{}'s weight reason: {reason}", address(target));
        // ... meanwhile, new connections through the VIP, ...
        let during = bed.landings(PROBES)?;
        let still = llama::sample(&bed.metrics(target)?, "llamacpp:requests_deferred")?;
        ensure!(
            still >= 1.0,
            "{} no longer had a queue after the counting: the flood was too short",
            address(target)
        );
        // ... and back once the queue is gone (the deferred streams got their slots).
        timeline.until(bed, "weighted again", |row| {
            row.weight > 0 && row.waiting == Some(0.0)
        })?;
        let streams = flood.join().expect("the flood does not panic")?;
        // Weighted again is not yet room: while its slots are all busy the program's spill
        // budget sends new connections elsewhere. Those slots free as the streams end, which
        // the agent learns at its next scrape; idle, the server has the other's weight and
        // every slot free, so that 20 connections all missing it is a one-in-a-million event.
        timeline.until(bed, "seen idle", |row| {
            row.weight > 0 && row.running == Some(0.0) && row.waiting == Some(0.0)
        })?;
        for (k, s) in streams.iter().enumerate() {
            let n = s.text_events().count();
            ensure!(
                s.done && n * 4 >= FLOOD_TOKENS as usize * 3,
                "flood stream {k} ended early ({n} events)"
            );
        }
        let ends: Vec<String> = streams
            .iter()
            .map(|s| {
                let last = s.events.last().map_or(Duration::ZERO, |e| e.at - s.sent);
                format!("{:.1}", secs(last))
            })
            .collect();
        println!(
            "the {FLOOD_STREAMS} streams straight to {} ({SLOTS} slots) ended after {} s",
            address(target),
            ends.join(", ")
        );
        Ok((during, queued))
    })?;
    println!(
        "{}'s own metrics when the agent showed weight 0: requests_processing {}, \
         requests_deferred {}",
        address(target),
        queued.0,
        queued.1
    );
    println!(
        "{}'s weight in show, from the first stream on:",
        address(target)
    );
    timeline.print();
    let log = bed.agent.log();
    let server = api(target).to_string();
    println!("the agent's log meanwhile:");
    for line in log.get(log_mark..).unwrap_or_default().lines() {
        if line.contains(&server) {
            println!("  {}", line.trim());
        }
    }
    println!(
        "during: {PROBES} new connections through the VIP land {} on {}, {} on {}",
        during[target],
        address(target),
        during[other],
        address(other)
    );
    ensure!(
        during[target] == 0,
        "{} of {PROBES} new connections went to the server with a queue",
        during[target]
    );

    let after = bed.landings(PROBES)?;
    println!(
        "after: {PROBES} new connections land {} on {}, {} on {}",
        after[target],
        address(target),
        after[other],
        address(other)
    );
    ensure!(
        after[target] > 0,
        "{} takes no new connection after its queue is gone",
        address(target)
    );
    Ok(())
}

/// [`FLOOD_STREAMS`] concurrent streams of [`FLOOD_TOKENS`] tokens straight to server `i`,
/// from its own namespace (as other gateways' clients would), read to their ends.
fn flood(bed: &Bed, i: usize) -> Result<Vec<Streamed>> {
    bed.topology.backend(i).enter(|| {
        thread::scope(|scope| {
            let streams: Vec<_> = (0..FLOOD_STREAMS)
                .map(|k| {
                    scope.spawn(move || {
                        let prompt = format!("Story number {k}: {STREAM_PROMPT}");
                        let body = completion_body(&prompt, FLOOD_TOKENS, true);
                        CompletionStream::open(llama::connect(api(i))?, &body)?.finish()
                    })
                })
                .collect();
            streams
                .into_iter()
                .map(|s| s.join().expect("streams do not panic"))
                .collect()
        })
    })
}

/// A server's row in `show` over time: a point whenever weight, running or waiting changes.
struct Timeline {
    server: usize,
    started: Instant,
    points: Vec<(Duration, u32, Option<f64>, Option<f64>)>,
}

impl Timeline {
    fn new(server: usize) -> Self {
        Self {
            server,
            started: Instant::now(),
            points: Vec::new(),
        }
    }

    /// Polls `show` until the server's row satisfies `pred`; the server must stay UP (a
    /// health check that times out behind a queue is busy, not dead).
    fn until(
        &mut self,
        bed: &Bed,
        what: &str,
        pred: impl Fn(&ServerRow) -> bool,
    ) -> Result<PoolView> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let pool = bed.show()?;
            let row = pool.server(Family::V4.backend(self.server))?;
            let point = (self.started.elapsed(), row.weight, row.running, row.waiting);
            if self.points.last().map(|p| (p.1, p.2, p.3)) != Some((point.1, point.2, point.3)) {
                self.points.push(point);
            }
            ensure!(
                row.state == "UP",
                "{} went {}: {}",
                address(self.server),
                row.state,
                row.reason
            );
            if pred(row) {
                return Ok(pool);
            }
            ensure!(
                Instant::now() < deadline,
                "{}: not {what} within 120 s; seen: {:?}",
                address(self.server),
                self.points
            );
            sleep(POLL);
        }
    }

    fn print(&self) {
        for (at, weight, running, waiting) in &self.points {
            println!(
                "  t={:>6.0} ms  weight {weight:>5}  running {}  waiting {}",
                ms(*at),
                dash(*running),
                dash(*waiting)
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// 4. Prefix affinity and llama.cpp's prompt cache.

/// Preambles per run: two with each server as their bucket's home (hinted run), fewer than
/// a server's slots, more than a server holds when it sees them all.
const PREAMBLES: usize = 4;
/// Each preamble's requests per run.
const ROUNDS: usize = 5;
const PREAMBLE_WORDS: usize = 240;
const ANSWER_TOKENS: u32 = 4;

/// A preamble of [`PREAMBLE_WORDS`] words, its own from the first word on (llama.cpp picks a
/// slot by longest common prefix).
fn preamble(tag: &str) -> String {
    const WORDS: [&str; 24] = [
        "system",
        "policy",
        "requires",
        "careful",
        "answers",
        "about",
        "the",
        "inventory",
        "ledger",
        "shipping",
        "delays",
        "customer",
        "refund",
        "warehouse",
        "audit",
        "report",
        "quarter",
        "supplier",
        "contract",
        "terms",
        "and",
        "every",
        "regional",
        "office",
    ];
    // A small LCG seeded by the tag: deterministic, different for every tag.
    let mut x = tag.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let mut words = vec![format!("{tag}:")];
    for _ in 1..PREAMBLE_WORDS {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        words.push(WORDS[usize::try_from(x >> 59).expect("5 bits") % WORDS.len()].to_owned());
    }
    words.join(" ")
}

/// The agent's picture of b1 and b2 (ids in configuration order from 1, as a fresh agent
/// assigns them): the rendezvous home of `bucket`.
fn home_of(bucket: u16) -> usize {
    let members: Vec<Member> = (0..SERVERS)
        .map(|i| Member {
            id: u32::try_from(i + 1).expect("two servers"),
            key: api(i).to_string(),
            weight: 100,
        })
        .collect();
    let id = home(bucket, &members).expect("both servers are eligible");
    usize::try_from(id).expect("small ids") - 1
}

/// Prompt tokens processed and found cached, summed over the servers.
fn prompt_counters(bed: &Bed) -> Result<(f64, f64)> {
    let (mut processed, mut cached) = (0.0, 0.0);
    for i in 0..SERVERS {
        let m = bed.metrics(i)?;
        processed += llama::sample(&m, "llamacpp:prompt_tokens_total")?;
        cached += llama::sample(&m, "llamacpp:prompt_tokens_cached_total")?;
    }
    Ok((processed, cached))
}

/// What one run of the workload did.
struct Run {
    processed: f64,
    cached: f64,
    elapsed: Duration,
    /// Cached tokens per request, as each answer's `timings.cache_n` says.
    cache_n: Vec<u64>,
}

impl Run {
    fn ratio(&self) -> f64 {
        self.cached / self.processed
    }
}

/// [`ROUNDS`] rounds of one request per preamble, one after the other, through the VIP:
/// from a port of the preamble's bucket when `hinted`, from an ephemeral port otherwise.
fn workload(bed: &Bed, preambles: &[String], hinted: bool) -> Result<Run> {
    let (p0, c0) = prompt_counters(bed)?;
    let started = Instant::now();
    let cache_n = bed.topology.client().enter(|| {
        let mut cache_n = Vec::new();
        for round in 0..ROUNDS {
            for (k, pre) in preambles.iter().enumerate() {
                let prompt = format!("{pre}\nQuestion {round}.{k}: which office reports first?");
                let stream = if hinted {
                    let s =
                        hint::connect(vip(), RANGE, pre.as_bytes(), Some(llama::CONNECT_TIMEOUT))
                            .with_context(|| format!("a hinted connection for preamble {k}"))?;
                    llama::prepare(&s)?;
                    s
                } else {
                    llama::connect(vip())?
                };
                let body = completion_body(&prompt, ANSWER_TOKENS, false);
                let reply = llama::request_on(stream, "POST", "/v1/completions", Some(&body))?;
                ensure!(
                    reply.status == 200,
                    "completion: {} {}",
                    reply.status,
                    reply.body
                );
                let answer = reply.json()?;
                cache_n.push(answer["timings"]["cache_n"].as_u64().unwrap_or_default());
            }
        }
        Ok(cache_n)
    })?;
    let elapsed = started.elapsed();
    let (p1, c1) = prompt_counters(bed)?;
    Ok(Run {
        processed: p1 - p0,
        cached: c1 - c0,
        elapsed,
        cache_n,
    })
}

fn affinity_and_cache(bed: &Bed) -> Result<()> {
    // Unhinted: any four preambles. Hinted: four others (nothing cached from the first run
    // helps), two homed on each server.
    let unhinted_set: Vec<String> = (0..PREAMBLES)
        .map(|k| preamble(&format!("plain{k}")))
        .collect();
    let mut per_home = [0; SERVERS];
    let hinted_set: Vec<String> = (0..)
        .map(|k| preamble(&format!("hinted{k}")))
        .filter(|p| {
            let h = home_of(RANGE.bucket_of_prefix(p.as_bytes()));
            per_home[h] += 1;
            per_home[h] <= PREAMBLES / SERVERS
        })
        .take(PREAMBLES)
        .collect();
    let buckets: Vec<String> = hinted_set
        .iter()
        .map(|p| {
            let b = RANGE.bucket_of_prefix(p.as_bytes());
            format!("bucket {b} (home {})", address(home_of(b)))
        })
        .collect();
    println!(
        "{PREAMBLES} preambles of {PREAMBLE_WORDS} words, {ROUNDS} rounds of one request each \
         ({ANSWER_TOKENS} tokens), one request at a time; hinted: {}",
        buckets.join(", ")
    );

    let plain = workload(bed, &unhinted_set, false)?;
    bed.wait_idle()?;
    let hinted = workload(bed, &hinted_set, true)?;
    for (name, run) in [("unhinted", &plain), ("hinted", &hinted)] {
        println!(
            "{name:>8}: prompt_tokens_cached_total +{:.0}, prompt_tokens_total +{:.0}: cached / \
             processed = {:.2} ({:.0}% of prompt tokens from the cache), in {:.1} s; cached \
             tokens per request {:?}",
            run.cached,
            run.processed,
            run.ratio(),
            100.0 * run.cached / (run.cached + run.processed),
            secs(run.elapsed),
            run.cache_n
        );
    }
    ensure!(
        plain.processed > 0.0 && hinted.processed > 0.0,
        "no prompt tokens counted"
    );
    println!(
        "hints raise cached / processed from {:.2} to {:.2} ({:.1}x)",
        plain.ratio(),
        hinted.ratio(),
        hinted.ratio() / plain.ratio().max(f64::MIN_POSITIVE)
    );
    ensure!(
        hinted.ratio() > 1.5 * plain.ratio(),
        "hinted cached / processed {:.2} is not well above unhinted {:.2}",
        hinted.ratio(),
        plain.ratio()
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Small helpers.

fn api(i: usize) -> SocketAddr {
    SocketAddr::new(Family::V4.backend(i), BACKEND_PORT)
}

fn vip() -> SocketAddr {
    Family::V4.vip()
}

fn address(i: usize) -> String {
    Family::V4.backend(i).to_string()
}

fn dash(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.0}"))
}

fn abbreviate(text: &str, chars: usize) -> String {
    let mut short: String = text.chars().take(chars).collect();
    if text.chars().count() > chars {
        short.push_str("...");
    }
    short
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).expect("short durations")
}
