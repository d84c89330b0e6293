//! Restarts that lose nothing (`agent.pin_dir`), end to end over namespaces with four
//! simulators. The first agent drains one server, then streams open through the VIP and run
//! on, token after token, while
//!
//! 1. the agent is killed (SIGKILL, as a crash): the program stays attached, forwards the
//!    streams both ways, and balances new connections with the last tables;
//! 2. a new agent takes the pinned maps and links over, still draining the server, and is
//!    stopped (SIGTERM), which leaves everything attached;
//! 3. an agent whose configuration does not fit the pinned flow table refuses to start with
//!    a clear error, changing nothing;
//! 4. a third agent takes over again; its counters go on from the first agent's, and a
//!    second agent on the same pins is refused.
//!
//! Every stream must end with all its tokens and `[DONE]`, and receive tokens while no
//! agent runs; no new connection may reach the drained server. Last, `balancer-agent
//! detach` (refused while an agent runs) removes the pins and the program leaves the
//! gateway's interfaces.

use std::path::Path;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use balancer_tests::agent::{agent_binary, Agent, AgentConfig, PoolViewExt};
use balancer_tests::backends::SimBackends;
use balancer_tests::netns::PinDir;
use balancer_tests::process::run as run_cli;
use balancer_tests::sim::client::{self, Item, Stream};
use balancer_tests::topology::{backend_name, Family, Topology, BACKENDS};
use balancer_tests::{check_nothing_remains, serial};
use serde_json::json;

const SIM: &str = env!("CARGO_BIN_EXE_inference-sim");
const XDP_PASS: &str = env!("CARGO_BIN_EXE_xdp-pass");

const POOL: &str = "chat-v4";
const STREAMS: usize = 4;
/// About 18 s at the simulator's 65 tokens/s: long enough for every step above.
const TOKENS: u64 = 1200;
/// How long the gateway runs without an agent, after the crash and after the stop.
const UNATTENDED: Duration = Duration::from_millis(1500);
/// New connections through the VIP at each step.
const PROBES: usize = 8;
/// Drained by the first agent: every later agent goes on draining it.
const DRAINED: usize = 3;

#[test]
fn restarts_keep_open_streams() {
    let _serial = serial();
    let agent = agent_binary().unwrap();
    let mut topology = Topology::build_bare().unwrap();
    topology.attach_xdp_pass(Path::new(XDP_PASS)).unwrap();
    let pins = PinDir::new("restart").unwrap();
    if let Err(e) = scenario(&topology, &agent, &pins.path()) {
        panic!("{e:?}");
    }
    drop(pins);
    drop(topology);
    check_nothing_remains().unwrap();
}

/// What a stream saw: tokens and when each came, and how it ended.
struct Seen {
    backend: String,
    arrivals: Vec<Instant>,
    finish_reason: Option<String>,
    done: bool,
}

/// Reads `stream` to its end on a thread of its own.
fn read_on(mut stream: Stream) -> JoinHandle<Result<Seen>> {
    thread::spawn(move || {
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

/// `PROBES` short completions through the VIP, each on a new connection; every one must
/// succeed, and none reach the drained server. Returns the backends that answered.
fn probe(topology: &Topology, what: &str) -> Result<Vec<String>> {
    let backends = topology.client().enter(|| probe_here(what))?;
    ensure!(
        !backends.contains(&backend_name(DRAINED)),
        "{what}: a new connection reached the drained server: {backends:?}"
    );
    Ok(backends)
}

fn probe_here(what: &str) -> Result<Vec<String>> {
    let mut backends = Vec::new();
    for k in 0..PROBES {
        let body = json!({"prompt": format!("probe {k} {what}"), "max_tokens": 2});
        let reply = client::post(Family::V4.vip(), "/v1/completions", &body)
            .with_context(|| format!("probe {k} {what}"))?;
        ensure!(
            reply.status() == 200,
            "probe {k} {what}: {}",
            reply.status()
        );
        backends.push(reply.head.header("x-backend").unwrap_or("?").to_owned());
    }
    Ok(backends)
}

fn counter(agent: &Agent, name: &str) -> Result<u64> {
    let text = agent.cli(&["counters", "--json"])?;
    let counters: Vec<(String, u64)> = serde_json::from_str(&text)?;
    counters
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v)
        .with_context(|| format!("no counter {name} in {text}"))
}

fn scenario(topology: &Topology, binary: &Path, pins: &Path) -> Result<()> {
    let args: Vec<Vec<String>> = (0..BACKENDS).map(|_| Vec::new()).collect();
    let _sims = SimBackends::start(topology, Path::new(SIM), &args)?;
    let mut config = AgentConfig::gateway(topology, [100; BACKENDS]);
    config.pools.retain(|p| p.name == POOL);
    config.agent.scrape_interval_ms = Some(500);
    config.agent.pin_dir = Some(pins.to_owned());

    let first = Agent::start(topology, binary, &config)?;
    let drained = Family::V4.backend(DRAINED).to_string();
    first.cli(&["drain", POOL, &drained])?;
    probe(topology, "with the first agent")?;
    let mut readers = Vec::new();
    for k in 0..STREAMS {
        let body = json!({
            "prompt": format!("stream {k} across agent restarts"),
            "max_tokens": TOKENS, "stream": true, "ignore_eos": true,
        });
        let stream = topology
            .client()
            .enter(|| Stream::open(Family::V4.vip(), "/v1/completions", &body))?;
        stream.set_timeout(Duration::from_secs(10))?;
        readers.push(read_on(stream));
    }
    let opened = counter(&first, "flow_new_syn")?;
    ensure!(opened >= (PROBES + STREAMS) as u64, "flow_new_syn {opened}");

    // 1. A crash.
    first.kill()?;
    let crashed = Instant::now();
    thread::sleep(UNATTENDED);
    let spread = probe(topology, "with no agent, after the crash")?;
    println!("no agent: new connections reached {spread:?}");
    let unattended = [(crashed, Instant::now())];

    // 2. Takeover, then a clean stop.
    let second = Agent::start(topology, binary, &config)?;
    let log = second.log();
    ensure!(
        log.contains("took over the pinned maps"),
        "second agent: {log}"
    );
    for dev in ["g0", "g1"] {
        ensure!(
            log.lines()
                .any(|l| l.contains("took over the pinned link") && l.contains(dev)),
            "second agent did not take over {dev}: {log}"
        );
    }
    probe(topology, "with the second agent")?;
    let state = |agent: &Agent| -> Result<String> {
        Ok(agent
            .show(POOL)?
            .server(Family::V4.backend(DRAINED))?
            .state
            .clone())
    };
    ensure!(
        state(&second)? == "DRAINING",
        "second agent: {}",
        state(&second)?
    );
    second.stop()?;
    let stopped = Instant::now();
    let attached = topology.gateway_xdp()?;
    ensure!(
        attached.len() == 2,
        "the program left the gateway after a clean stop: {attached:?}"
    );
    thread::sleep(UNATTENDED);
    probe(topology, "with no agent, after the stop")?;
    let unattended = [unattended[0], (stopped, Instant::now())];

    // 3. A flow table of another size cannot take the pinned one over.
    let mut misfit = config.clone();
    misfit.agent.flow_table_entries = Some(1 << 17);
    let refused = Agent::start_refused(topology, binary, &misfit)?;
    println!("refused: {refused}");
    ensure!(
        refused.contains("flow_table_entries") && refused.contains("detach"),
        "the refusal does not say what to do: {refused}"
    );
    probe(topology, "after the refused start")?;

    // 4. Takeover again; the counters go on. No second agent may share the pins.
    let third = Agent::start(topology, binary, &config)?;
    probe(topology, "with the third agent")?;
    let mut rival = config.clone();
    rival.agent.control_socket = topology.dir().join("rival.sock");
    let refused = Agent::start_refused(topology, binary, &rival)?;
    ensure!(
        refused.contains("another agent is using"),
        "a second agent on the same pins: {refused}"
    );
    ensure!(
        state(&third)? == "DRAINING",
        "third agent: {}",
        state(&third)?
    );
    let total = counter(&third, "flow_new_syn")?;
    ensure!(
        // The probes since: after the crash, with the second agent, after the stop, after
        // the refusal, with the third.
        total >= opened + 5 * PROBES as u64,
        "flow_new_syn went from {opened} to {total}: the counters were not taken over"
    );
    third.wait_show(
        POOL,
        "every server scraped, none DOWN",
        (Duration::from_secs(20), Duration::from_millis(50)),
        |pool| {
            Ok(pool
                .servers
                .iter()
                .all(|s| s.state != "DOWN" && s.metrics_age_ms.is_some()))
        },
    )?;

    for (k, reader) in readers.into_iter().enumerate() {
        let seen = reader
            .join()
            .map_err(|_| anyhow::anyhow!("stream {k}: reader panicked"))?
            .with_context(|| format!("stream {k}"))?;
        let during: Vec<usize> = unattended
            .iter()
            .map(|(from, to)| {
                seen.arrivals
                    .iter()
                    .filter(|t| *t > from && *t < to)
                    .count()
            })
            .collect();
        println!(
            "stream {k} on {}: {} tokens, {during:?} while no agent ran, {:?}",
            seen.backend,
            seen.arrivals.len(),
            seen.finish_reason
        );
        ensure!(
            seen.arrivals.len() as u64 == TOKENS
                && seen.finish_reason.as_deref() == Some("length")
                && seen.done,
            "stream {k} ended early: {} tokens, {:?}, [DONE] {}",
            seen.arrivals.len(),
            seen.finish_reason,
            seen.done
        );
        ensure!(
            during.iter().all(|n| *n > 0),
            "stream {k} stalled while no agent ran: {during:?} tokens"
        );
    }

    // Last, removing it all, which `detach` refuses while an agent runs.
    let config_path = topology.dir().join("agent.toml");
    let detach = || {
        let mut cmd = topology.gw().command(binary);
        cmd.args(["detach", "--config"]).arg(&config_path);
        run_cli(&mut cmd)
    };
    let busy = detach().expect_err("detach with an agent running");
    ensure!(
        format!("{busy:#}").contains("stop it first"),
        "detach with an agent running: {busy:#}"
    );
    third.stop()?;
    let out = detach()?;
    println!("{}", out.trim());
    ensure!(out.contains("g0") && out.contains("g1"), "detach: {out}");
    ensure!(!pins.exists(), "{} remains", pins.display());
    let attached = topology.gateway_xdp()?;
    ensure!(attached.is_empty(), "still attached: {attached:?}");
    let again = detach().expect_err("a second detach has nothing to remove");
    ensure!(
        format!("{again:#}").contains("nothing is pinned"),
        "second detach: {again:#}"
    );
    Ok(())
}
