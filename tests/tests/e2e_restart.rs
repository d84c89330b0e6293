//! Restarts that lose nothing (`agent.pin_dir`), end to end over namespaces with four
//! simulators. The first agent finds one server DOWN (its simulator killed) and drains
//! another, then streams open through the VIP and run on, token after token, while
//!
//! 1. the agent is killed (SIGKILL, as a crash): the program stays attached, forwards the
//!    streams both ways, and balances new connections with the last tables;
//! 2. a new agent, its servers listed in another order, takes the pinned maps and links
//!    over: the DOWN server is still DOWN, the drained one still DRAINING, and each stream's
//!    server still counts the stream (its id was recovered); it is stopped (SIGTERM),
//!    which leaves everything attached;
//! 3. an agent whose configuration does not fit the pinned flow table, names an interface
//!    that does not exist, or one another XDP program holds, refuses to start with a clear
//!    error, changing nothing;
//! 4. a third agent takes over again, from pins that lack the ring of shared flows (as an
//!    older build's would); its counters go on from the first agent's, and a second agent
//!    on the same pins is refused.
//!
//! Every stream must end with all its tokens and `[DONE]`, and receive tokens while no
//! agent runs; no new connection may reach the DOWN or the drained server. Last, an agent
//! configured without `g1` detaches from it, and `balancer-agent detach` (refused while an
//! agent runs) removes the pins and the program leaves the gateway's interfaces; it refuses
//! a `pin_dir` that is the bpffs mount itself, as the agent does.

use std::collections::BTreeMap;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use aya::maps::{DevMapHash, Map, MapData};
use balancer_tests::agent::{agent_binary, Agent, AgentConfig, PoolViewExt};
use balancer_tests::backends::SimBackends;
use balancer_tests::netns::PinDir;
use balancer_tests::process::{run as run_cli, Process};
use balancer_tests::sim::client::{self, read_on, Stream};
use balancer_tests::topology::{backend_name, Family, Topology, BACKENDS};
use balancer_tests::{check_nothing_remains, serial};
use serde_json::json;

const SIM: &str = env!("CARGO_BIN_EXE_inference-sim");
const XDP_PASS: &str = env!("CARGO_BIN_EXE_xdp-pass");

const POOL: &str = "chat-v4";
const STREAMS: usize = 4;
/// About 23 s at the simulator's 65 tokens/s: long enough for every step above.
const TOKENS: u64 = 1500;
/// How long the gateway runs without an agent, after the crash and after the stop.
const UNATTENDED: Duration = Duration::from_millis(1500);
/// New connections through the VIP at each step: with two servers out, one that wrongly
/// took connections would be missed by 16 probes once in 65536.
const PROBES: usize = 16;
/// Drained by the first agent: every later agent goes on draining it.
const DRAINED: usize = 3;
/// Its simulator is killed before the first agent's streams: every agent must keep it DOWN.
const DEAD: usize = 2;

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

/// `PROBES` short completions through the VIP, each on a new connection; every one must
/// succeed (none may go to the dead server), and none reach the drained server. Returns the backends that answered.
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

/// The state `show` gives backend `i`.
fn state(agent: &Agent, i: usize) -> Result<String> {
    Ok(agent
        .show(POOL)?
        .server(Family::V4.backend(i))?
        .state
        .clone())
}

/// Starts an agent with `config`, its first pool moved to another port, and `gx`, which
/// another XDP program holds, as well: its refusal, once it is checked that the pinned
/// `EGRESS` did not take gx in.
fn taken_interface_refused(
    topology: &Topology,
    binary: &Path,
    config: &AgentConfig,
    pins: &Path,
) -> Result<String> {
    let gw = topology.gw();
    with_veth(topology, ["gx", "gy"], || {
        let mut holder = gw.command(XDP_PASS);
        holder.arg("gx");
        let log = topology.dir().join("gx-xdp-pass.log");
        let mut holder = Process::spawn("xdp-pass on gx", holder, &log)?;
        holder.wait_for_line(0, Duration::from_secs(10), |line| line.trim() == "attached")?;
        let mut taking = config.clone();
        taking.agent.interfaces.push("gx".into());
        taking.pools[0].port += 1;
        let refused = Agent::start_refused(topology, binary, &taking);
        holder.stop(Duration::from_secs(5))?;
        let refused = refused?;
        let link = gw.ip(&["-o", "link", "show", "dev", "gx"])?;
        let index: u32 = link
            .split(':')
            .next()
            .and_then(|i| i.trim().parse().ok())
            .with_context(|| format!("gx's index in {link:?}"))?;
        let egress = pins.join(format!("maps-v{}/EGRESS", balancer_common::PIN_LAYOUT));
        let data = MapData::from_pin(&egress).context("opening the pinned EGRESS")?;
        let egress = DevMapHash::try_from(Map::DevMapHash(data))?;
        let indexes: Vec<u32> = egress.keys().collect::<Result<_, _>>()?;
        ensure!(
            !indexes.contains(&index),
            "a refused start left gx ({index}) in EGRESS: {indexes:?}"
        );
        Ok(refused)
    })
}

/// Runs `f` with a veth pair `pair` up in the gateway's namespace; deletes it after,
/// whatever `f` did.
fn with_veth<T>(topology: &Topology, pair: [&str; 2], f: impl FnOnce() -> Result<T>) -> Result<T> {
    let gw = topology.gw();
    gw.ip(&[
        "link", "add", pair[0], "type", "veth", "peer", "name", pair[1],
    ])?;
    let done = (|| {
        for dev in pair {
            gw.ip(&["link", "set", dev, "up"])?;
        }
        f()
    })();
    gw.ip(&["link", "del", pair[0]])?;
    done
}

fn scenario(topology: &Topology, binary: &Path, pins: &Path) -> Result<()> {
    let args: Vec<Vec<String>> = (0..BACKENDS).map(|_| Vec::new()).collect();
    let mut sims = SimBackends::start(topology, Path::new(SIM), &args)?;
    let mut config = AgentConfig::gateway(topology, [100; BACKENDS]);
    config.pools.retain(|p| p.name == POOL);
    let agent = &mut config.agent;
    agent.scrape_interval_ms = Some(500);
    agent.health_interval_ms = Some(300);
    agent.health_timeout_ms = Some(250);
    agent.fall = Some(2);
    agent.rise = Some(2);
    agent.pin_dir = Some(pins.to_owned());

    let first = Agent::start(topology, binary, &config)?;
    sims.kill(DEAD)?;
    first.wait_show(
        POOL,
        "the killed server DOWN",
        (Duration::from_secs(10), Duration::from_millis(50)),
        |pool| Ok(pool.server(Family::V4.backend(DEAD))?.state == "DOWN"),
    )?;
    let drained = Family::V4.backend(DRAINED).to_string();
    first.cli(&["drain", POOL, &drained])?;
    probe(topology, "with the first agent")?;
    let mut readers = Vec::new();
    let mut streams_on: BTreeMap<String, u64> = BTreeMap::new();
    for k in 0..STREAMS {
        let body = json!({
            "prompt": format!("stream {k} across agent restarts"),
            "max_tokens": TOKENS, "stream": true, "ignore_eos": true,
        });
        let stream = topology
            .client()
            .enter(|| Stream::open(Family::V4.vip(), "/v1/completions", &body))?;
        stream.set_timeout(Duration::from_secs(10))?;
        let backend = stream.head.header("x-backend").unwrap_or("?").to_owned();
        *streams_on.entry(backend).or_default() += 1;
        readers.push(read_on(stream));
    }
    let opened = first.counter("flow_new_syn")?;
    ensure!(opened >= (PROBES + STREAMS) as u64, "flow_new_syn {opened}");

    // 1. A crash.
    first.kill()?;
    let crashed = Instant::now();
    thread::sleep(UNATTENDED);
    let spread = probe(topology, "with no agent, after the crash")?;
    println!("no agent: new connections reached {spread:?}");
    let unattended = [(crashed, Instant::now())];

    // 2. Takeover, the servers listed in reverse, then a clean stop.
    let mut reordered = config.clone();
    reordered.pools[0].servers.reverse();
    let second = Agent::start(topology, binary, &reordered)?;
    let interfaces = second.interfaces()?;
    ensure!(
        interfaces.len() == 2
            && interfaces
                .iter()
                .all(|i| i.taken_over && i.mode == "native" && i.state == "attached"),
        "second agent's interfaces: {interfaces:?}"
    );
    ensure!(
        state(&second, DEAD)? == "DOWN",
        "second agent: {}",
        state(&second, DEAD)?
    );
    // Each stream counted by its server: the ids it had were recovered, whatever the order.
    second.wait_show(
        POOL,
        "every stream counted by its server",
        (Duration::from_secs(5), Duration::from_millis(50)),
        |pool| {
            Ok(pool.servers.iter().enumerate().all(|(i, row)| {
                let name = backend_name(BACKENDS - 1 - i);
                row.flows >= streams_on.get(&name).copied().unwrap_or(0)
            }))
        },
    )?;
    let log = second.log();
    for what in ["took over the pinned maps", "took over the hint buckets"] {
        ensure!(
            log.contains(what),
            "second agent did not log {what:?}: {log}"
        );
    }
    for dev in ["g0", "g1"] {
        ensure!(
            log.lines()
                .any(|l| l.contains("took over the pinned link") && l.contains(dev)),
            "second agent did not take over {dev}: {log}"
        );
    }
    probe(topology, "with the second agent")?;
    ensure!(
        state(&second, DRAINED)? == "DRAINING",
        "second agent: {}",
        state(&second, DRAINED)?
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
    // Nor may one whose control socket path names a file of another kind: it is left alone.
    let mut clobbering = config.clone();
    let precious = topology.dir().join("precious.toml");
    std::fs::write(&precious, "keep me")?;
    clobbering.agent.control_socket = precious.clone();
    let refused = Agent::start_refused(topology, binary, &clobbering)?;
    ensure!(
        refused.contains("is not a socket") && std::fs::read_to_string(&precious)? == "keep me",
        "a control_socket naming a file: {refused}"
    );
    // Nor one naming an interface that does not exist, and it must not get as far as the
    // pinned maps: its pool moved to another port, written there, would leave the VIP's
    // port unbalanced for the probes below.
    let mut mistyped = config.clone();
    mistyped.agent.interfaces.push("g9".into());
    mistyped.pools[0].port += 1;
    let refused = Agent::start_refused(topology, binary, &mistyped)?;
    ensure!(
        refused.contains("no interface named \"g9\""),
        "an unknown interface: {refused}"
    );
    // Nor one naming an interface another XDP program holds: the interfaces come before
    // any write to the maps an earlier agent pinned, so neither its pool's new port nor the
    // interface (`EGRESS`) reaches them.
    let refused = taken_interface_refused(topology, binary, &config, pins)?;
    println!("refused: {refused}");
    ensure!(
        refused.contains("gx"),
        "an interface another program holds: {refused}"
    );
    // `check` finds it first, and passes the file that names none.
    let (passed, said) = Agent::check(topology, binary, &mistyped)?;
    ensure!(
        !passed && said.contains("no interface named \"g9\""),
        "check of an unknown interface: {said}"
    );
    let (passed, said) = Agent::check(topology, binary, &config)?;
    ensure!(
        passed && said.contains(": ok"),
        "check of the running file: {said}"
    );
    probe(topology, "after the refused starts")?;

    // 4. Takeover again; the counters go on. No second agent may share the pins. The ring
    // of shared flows, the next-hop cache and the interfaces to send out of (and which take
    // frames in several buffers) are unpinned first, as a build that had none of them would
    // have left them: they hold no state, so the upgrade goes on and pins new ones (the
    // interfaces filled before the takeover, or the probe's packets would go to the stack).
    let stateless = ["FLOW_EVENTS", "HOPS", "EGRESS", "EGRESS_FRAGS"]
        .map(|m| pins.join(format!("maps-v{}/{m}", balancer_common::PIN_LAYOUT)));
    for map in &stateless {
        std::fs::remove_file(map).with_context(|| format!("unpinning {}", map.display()))?;
    }
    let third = Agent::start(topology, binary, &config)?;
    for map in &stateless {
        ensure!(
            map.exists(),
            "the third agent did not pin a new {}",
            map.display()
        );
    }
    probe(topology, "with the third agent")?;
    let passed = third.counter("pass_egress")?;
    ensure!(
        passed == 0,
        "{passed} packets went to the stack for want of an interface to send them out of"
    );
    let mut rival = config.clone();
    rival.agent.control_socket = topology.dir().join("rival.sock");
    let refused = Agent::start_refused(topology, binary, &rival)?;
    ensure!(
        refused.contains("another agent is using"),
        "a second agent on the same pins: {refused}"
    );
    ensure!(
        state(&third, DRAINED)? == "DRAINING" && state(&third, DEAD)? == "DOWN",
        "third agent: {} and {}",
        state(&third, DRAINED)?,
        state(&third, DEAD)?
    );
    let total = third.counter("flow_new_syn")?;
    ensure!(
        // The probes since: after the crash, with the second agent, after the stop, after
        // the refusals, with the third.
        total >= opened + 5 * PROBES as u64,
        "flow_new_syn went from {opened} to {total}: the counters were not taken over"
    );
    third.wait_show(
        POOL,
        "every live server scraped",
        (Duration::from_secs(20), Duration::from_millis(50)),
        |pool| {
            Ok(pool
                .servers
                .iter()
                .enumerate()
                .all(|(i, s)| i == DEAD || s.metrics_age_ms.is_some()))
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
        seen.complete(TOKENS)
            .with_context(|| format!("stream {k} ended early"))?;
        ensure!(
            during.iter().all(|n| *n > 0),
            "stream {k} stalled while no agent ran: {during:?} tokens"
        );
    }

    // An interface no longer configured is detached at the next start.
    third.stop()?;
    let mut narrower = config.clone();
    narrower.agent.interfaces.retain(|i| i == "g0");
    let fourth = Agent::start(topology, binary, &narrower)?;
    ensure!(
        fourth
            .log()
            .lines()
            .any(|l| l.contains("no longer configured") && l.contains("g1")),
        "fourth agent: {}",
        fourth.log()
    );
    let attached = topology.gateway_xdp()?;
    ensure!(
        attached.len() == 1 && attached[0].starts_with("g0"),
        "after dropping g1: {attached:?}"
    );

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
    fourth.stop()?;
    let out = detach()?;
    println!("{}", out.trim());
    ensure!(out.contains("g0") && !out.contains("g1"), "detach: {out}");
    ensure!(!pins.exists(), "{} remains", pins.display());
    let attached = topology.gateway_xdp()?;
    ensure!(attached.is_empty(), "still attached: {attached:?}");
    let again = detach().expect_err("a second detach has nothing to remove");
    ensure!(
        format!("{again:#}").contains("nothing is pinned"),
        "second detach: {again:#}"
    );
    // The bpffs mount itself (the pins' parent here) is refused as a place to pin (`run`),
    // and so as one to unpin everything from: what its root holds may be anyone's.
    let mut at_root = config.clone();
    at_root.agent.pin_dir = pins.parent().map(Path::to_owned);
    let root_path = topology.dir().join("at-root.toml");
    std::fs::write(&root_path, at_root.to_toml()?)?;
    let mut cmd = topology.gw().command(binary);
    cmd.args(["detach", "--config"]).arg(&root_path);
    let refused = run_cli(&mut cmd).expect_err("detach from the bpffs mount's root");
    ensure!(
        format!("{refused:#}").contains("is a mount point"),
        "detach from the bpffs mount's root: {refused:#}"
    );
    Ok(())
}
