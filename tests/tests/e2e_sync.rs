//! Two gateways that share their flows (`[sync]`), end to end over namespaces with four
//! simulators: streams open through the first gateway, to an IPv4 and an IPv6 VIP in turn;
//! the operator drains, on both, every
//! server that carries one; then the first gateway fails (its links go down, its agent is
//! killed) and the client's and servers' routes move to the second, as ECMP would.
//!
//! The second gateway never saw those SYNs, and its Maglev table holds none of the drained
//! servers: without the shared flows, every stream's next packet would go to another server
//! (which answers with a reset) and its server's replies would not be translated back. With
//! them, every stream must end with all its tokens and `[DONE]` and receive tokens after the
//! failover, while new connections through the second gateway avoid the drained servers.
//! Before the failover, the second gateway's agent restarts with an empty flow table: it
//! learns the streams by asking the first for its flows. Meanwhile the gateways roll a new
//! key out, by reloads on the first and the restart of the second: each accepts the other's
//! datagrams at every step. A datagram from an address that is not a peer changes nothing
//! and is counted. `peers` tells each gateway's view of the other: up while it runs (with
//! the events it sent, and a restart), silent once it is gone; `show` alone, both pools.
//! `ready` (and `GET /ready`) holds a gateway back while a peer may still answer, and says
//! ready once the restarted gateway has every server checked and the first's flows; not
//! while the operator has it withdrawn.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use balancer_agent::control::{PeerRow, PeerState, PoolView};
use balancer_agent::ready::Readiness;
use balancer_tests::agent::{agent_binary, Agent, AgentConfig, SyncSection};
use balancer_tests::backends::SimBackends;
use balancer_tests::sim::client::{self, read_on, Stream};
use balancer_tests::topology::{
    backend_name, Family, Topology, BACKENDS, BACKEND_PORT, GATEWAY_SERVER_SIDE,
    SECOND_GATEWAY_INTERFACES,
};
use balancer_tests::{check_nothing_remains, serial};
use serde_json::json;

const SIM: &str = env!("CARGO_BIN_EXE_inference-sim");
const XDP_PASS: &str = env!("CARGO_BIN_EXE_xdp-pass");

/// Both pools, one per family: the streams alternate between them.
const POOLS: [(&str, Family); 2] = [("chat-v4", Family::V4), ("chat-v6", Family::V6)];
const STREAMS: usize = 6;
/// About 23 s at the simulator's 65 tokens/s: the failover comes a few seconds in, after
/// an agent restart, two reloads and some 30 CLI calls, which take far longer on a loaded
/// machine than the 3 s they take on an idle one.
const TOKENS: u64 = 1500;
/// Drained on both gateways before the streams open, so that they land on the other three
/// and at least this one is left for new connections once those three are drained.
const SPARE: usize = 3;
const SYNC_PORT: u16 = 7471;
/// The second gateway's metrics endpoint, on its namespace's loopback.
const METRICS_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9477);
const PROBES: usize = 12;

#[test]
fn streams_survive_a_gateway_failover() {
    let _serial = serial();
    let agent = agent_binary().unwrap();
    let mut topology = Topology::build_bare().unwrap();
    topology.add_second_gateway().unwrap();
    topology.attach_xdp_pass(Path::new(XDP_PASS)).unwrap();
    if let Err(e) = scenario(&topology, &agent) {
        panic!("{e:?}");
    }
    drop(topology);
    check_nothing_remains().unwrap();
}

fn wait_counter(agent: &Agent, name: &str, at_least: u64) -> Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let v = agent.counter(name)?;
        if v >= at_least {
            return Ok(v);
        }
        ensure!(
            Instant::now() < deadline,
            "{name} is {v}, not {at_least} yet"
        );
        thread::sleep(Duration::from_millis(50));
    }
}

/// `balancer-agent ready --json`, which exits 1 while not ready.
fn readiness(agent: &Agent) -> Result<Readiness> {
    let out = agent.cli_command(&["ready", "--json"]).output()?;
    let r: Readiness = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "ready --json printed {:?}",
            String::from_utf8_lossy(&out.stdout)
        )
    })?;
    ensure!(
        out.status.success() == r.ready,
        "ready --json exited {} for {r:?}",
        out.status
    );
    Ok(r)
}

/// `agent`'s readiness once ready, or after 20 s.
fn wait_ready(agent: &Agent) -> Result<Readiness> {
    let asked = Instant::now();
    loop {
        let r = readiness(agent)?;
        if r.ready || asked.elapsed() > Duration::from_secs(20) {
            return Ok(r);
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// `agent`'s view of its peer at `addr`.
fn peer(agent: &Agent, addr: SocketAddr) -> Result<PeerRow> {
    let peers = agent.peers()?;
    let wanted = addr.to_string();
    peers
        .into_iter()
        .find(|p| p.peer == wanted)
        .with_context(|| format!("no peer {wanted} in `peers`"))
}

/// `PROBES` short completions through the VIP on new connections: all must succeed, none
/// on a server in `avoid`.
fn probe(topology: &Topology, what: &str, avoid: &BTreeSet<String>) -> Result<()> {
    let backends = topology.client().enter(|| {
        let mut backends = Vec::new();
        for k in 0..PROBES {
            let body = json!({"prompt": format!("probe {k} {what}"), "max_tokens": 2});
            let family = POOLS[k % 2].1;
            let reply = client::post(family.vip(), "/v1/completions", &body)
                .with_context(|| format!("probe {k} {what}"))?;
            ensure!(
                reply.status() == 200,
                "probe {k} {what}: {}",
                reply.status()
            );
            backends.push(reply.head.header("x-backend").unwrap_or("?").to_owned());
        }
        Ok(backends)
    })?;
    ensure!(
        backends.iter().all(|b| !avoid.contains(b)),
        "{what}: a new connection reached a drained server: {backends:?}"
    );
    Ok(())
}

/// Drains (or undrains) backend `index` in both pools on each of `agents`.
fn drain(agents: &[&Agent], index: usize, on: bool) -> Result<()> {
    for agent in agents {
        for (pool, family) in POOLS {
            let server = family.backend(index).to_string();
            agent.cli(&[if on { "drain" } else { "undrain" }, pool, &server])?;
        }
    }
    Ok(())
}

fn scenario(topology: &Topology, binary: &Path) -> Result<()> {
    // The simulators answer on their IPv6 addresses too.
    let args: Vec<Vec<String>> = (0..BACKENDS)
        .map(|i| {
            let v6 = SocketAddr::new(Family::V6.backend(i), BACKEND_PORT);
            vec!["--listen".to_owned(), v6.to_string()]
        })
        .collect();
    let _sims = SimBackends::start(topology, Path::new(SIM), &args)?;
    let key_file = topology.dir().join("sync.key");
    std::fs::write(&key_file, "a key both gateways share, 48 bytes of it, ok\n")?;
    let new_key_file = topology.dir().join("sync-new.key");
    std::fs::write(
        &new_key_file,
        "the key that replaces it, 48 bytes of it too\n",
    )?;
    let side = GATEWAY_SERVER_SIDE.map(|a| SocketAddr::new(a.into(), SYNC_PORT));

    let mut first_config = AgentConfig::gateway(topology, [100; BACKENDS]);
    first_config.agent.scrape_interval_ms = Some(500);
    first_config.sync = Some(SyncSection {
        listen: side[0],
        peers: vec![side[1]],
        key_file: key_file.clone(),
        accept_key_files: Vec::new(),
    });
    let mut second_config = first_config.clone();
    second_config.agent.interfaces = SECOND_GATEWAY_INTERFACES.map(String::from).to_vec();
    second_config.agent.control_socket = topology.dir().join("agent2.sock");
    second_config.sync = Some(SyncSection {
        listen: side[1],
        peers: vec![side[0]],
        key_file: key_file.clone(),
        accept_key_files: Vec::new(),
    });
    second_config.agent.metrics_listen = Some(METRICS_LISTEN);
    let spawned = Instant::now();
    let first = Agent::start(topology, binary, &first_config)?;
    // About when it first asks its peer for its flows, right after it says it is ready.
    let first_up = Instant::now();
    // Its peer has not started: for the first 3.5 s after it asks, it waits to hear it (an
    // answer that took longer on a loaded machine says nothing).
    let early = readiness(&first)?;
    println!(
        "the first gateway, {:.1} s after its start: {early:?}",
        spawned.elapsed().as_secs_f64()
    );
    if spawned.elapsed() < Duration::from_secs(3) {
        let waits = |w: &str| {
            ["not heard yet", "not asked for its flows yet"]
                .map(|why| format!("{}: {why}", side[1]))
                .contains(&w.to_owned())
        };
        ensure!(
            !early.ready && early.waiting.iter().any(|w| waits(w)),
            "the first gateway must wait to hear its peer at first: {early:?}"
        );
    }
    let second = Agent::start_in(topology, topology.gw2()?, "agent2", binary, &second_config)?;
    // The second started after the first asked for its flows: heard in time (within 3.5 s
    // of that, as it is unless the machine is loaded), asked again, it says it has none,
    // and the first is ready.
    let second_up = first_up.elapsed();
    let ready = wait_ready(&first)?;
    println!(
        "the first gateway, its peer up {:.1} s after it: {ready:?}",
        second_up.as_secs_f64()
    );
    if second_up < Duration::from_millis(2500) {
        let told = format!("{}: sent its 0 live flows", side[1]);
        ensure!(
            ready.ready && ready.notes.contains(&told),
            "the first gateway must have heard from the later second: {ready:?}"
        );
    }
    let both = [&first, &second];

    drain(&both, SPARE, true)?;
    let mut readers = Vec::new();
    let mut carrying = BTreeSet::new();
    let opened = Instant::now();
    for k in 0..STREAMS {
        let body = json!({
            "prompt": format!("stream {k} across a gateway failover"),
            "max_tokens": TOKENS, "stream": true, "ignore_eos": true,
        });
        let stream = topology
            .client()
            .enter(|| Stream::open(POOLS[k % 2].1.vip(), "/v1/completions", &body))?;
        stream.set_timeout(Duration::from_secs(10))?;
        carrying.insert(stream.head.header("x-backend").unwrap_or("?").to_owned());
        readers.push(read_on(stream));
    }
    ensure!(
        !carrying.contains(&backend_name(SPARE)),
        "a stream reached the drained {}",
        backend_name(SPARE)
    );
    // The operator drains the streams' servers everywhere: their streams must finish there.
    drain(&both, SPARE, false)?;
    for i in 0..BACKENDS {
        if carrying.contains(&backend_name(i)) {
            drain(&both, i, true)?;
        }
    }
    let sent = wait_counter(&first, "sync_sent", STREAMS as u64)?;
    let applied = wait_counter(&second, "sync_applied", STREAMS as u64)?;
    println!("streams on {carrying:?}; the first gateway sent {sent} events, the second applied {applied}");
    let (of_second, of_first) = (peer(&first, side[1])?, peer(&second, side[0])?);
    ensure!(
        of_second.state == PeerState::Up && of_first.state == PeerState::Up,
        "each gateway must hear the other: {of_second:?}, {of_first:?}"
    );
    ensure!(
        of_first.events_in >= STREAMS as u64,
        "the second gateway heard of {} events from the first",
        of_first.events_in
    );

    // The second gateway restarts with an empty flow table (no pins: a reboot, as far as
    // its maps go) after the streams were reported: it asks the first for its flows. A new
    // key rolls out meanwhile: the first accepts it (a reload), the second restarts sealing
    // with it and accepting the old one, which the first still seals its flows with.
    second.stop()?;
    let mut first = first;
    let set_keys = |config: &mut AgentConfig, seal: &Path, accept: &[&Path]| {
        if let Some(sync) = &mut config.sync {
            sync.key_file = seal.to_owned();
            sync.accept_key_files = accept.iter().map(|p| p.to_path_buf()).collect();
        }
    };
    set_keys(&mut first_config, &key_file, &[&new_key_file]);
    first.reload(&first_config)?;
    set_keys(&mut second_config, &new_key_file, &[&key_file]);
    let mark = first.log_len();
    let second = Agent::start_in(
        topology,
        topology.gw2()?,
        "agent2-restarted",
        binary,
        &second_config,
    )?;
    for i in 0..BACKENDS {
        if carrying.contains(&backend_name(i)) {
            drain(&[&second], i, true)?;
        }
    }
    let dumped = first.wait_for_log(mark, Duration::from_secs(5), |l| {
        l.contains("sent our flows to a peer that started")
    })?;
    // Ready once its servers are checked and the first said it sent all its flows: the
    // streams among them, written before the end came.
    let asked = Instant::now();
    let ready = wait_ready(&second)?;
    let applied = second.counter("sync_applied")?;
    let sent = peer(&second, side[0])?.flows_at_start;
    println!(
        "the restarted second gateway: {ready:?} after {:.1} s; {applied} flows applied; \
         the first: {dumped}",
        asked.elapsed().as_secs_f64()
    );
    ensure!(
        ready.ready && sent.is_some_and(|n| n >= STREAMS as u64) && applied >= STREAMS as u64,
        "the restarted gateway must be ready with the first's flows: sent {sent:?}, {ready:?}"
    );
    let http = topology
        .gw2()?
        .enter(|| client::get(METRICS_LISTEN, "/ready"))?;
    ensure!(
        http.head.status == 200 && http.body.starts_with("ready\n"),
        "GET /ready: {} {:?}",
        http.head.status,
        http.body
    );
    // Withdrawn by the operator, not ready whatever else; restored, ready again.
    println!("{}", second.cli(&["withdraw"])?.trim_end());
    let withdrawn = readiness(&second)?;
    let http = topology
        .gw2()?
        .enter(|| client::get(METRICS_LISTEN, "/ready"))?;
    ensure!(
        !withdrawn.ready
            && withdrawn
                .waiting
                .iter()
                .any(|w| w.contains("withdrawn by the operator"))
            && http.head.status == 503
            && http.body.contains("withdrawn by the operator"),
        "withdrawn: {withdrawn:?}, GET /ready {} {:?}",
        http.head.status,
        http.body
    );
    println!("{}", second.cli(&["restore"])?.trim_end());
    ensure!(readiness(&second)?.ready, "restored, not ready");
    let restarted = peer(&first, side[1])?;
    ensure!(
        restarted.state == PeerState::Up && restarted.restarts == 1,
        "the first gateway must hear the second again, restarted once: {restarted:?}"
    );
    // The rollout's last step on the first gateway: it seals with the new key only.
    set_keys(&mut first_config, &new_key_file, &[]);
    first.reload(&first_config)?;
    probe(topology, "after the new key", &carrying)?;
    let applied = wait_counter(&second, "sync_applied", applied + PROBES as u64)?;
    let refused = [
        first.counter("sync_refused")?,
        second.counter("sync_refused")?,
    ];
    println!("with the new key the second gateway applied {applied} flows; refused: {refused:?}");
    ensure!(
        refused == [0, 0],
        "datagrams refused during the key rollout: {refused:?}"
    );

    // A datagram from a server's address, not a peer's: refused, nothing else changes.
    let refused = second.counter("sync_refused")?;
    topology.backend(0).enter(|| {
        let socket = UdpSocket::bind("0.0.0.0:0")?;
        socket.send_to(b"not a batch of flows", side[1])?;
        Ok(())
    })?;
    wait_counter(&second, "sync_refused", refused + 1)?;

    // Well into the streams.
    thread::sleep(Duration::from_secs(1));
    topology.fail_over()?;
    let failed = Instant::now();
    println!(
        "the failover, {:.1} s after the streams opened",
        failed.duration_since(opened).as_secs_f64()
    );
    first.kill()?;
    probe(topology, "through the second gateway", &carrying)?;

    for (k, reader) in readers.into_iter().enumerate() {
        let seen = reader
            .join()
            .map_err(|_| anyhow::anyhow!("stream {k}: reader panicked"))?
            .with_context(|| format!("stream {k}"))?;
        let after = seen.arrivals.iter().filter(|t| **t > failed).count();
        println!(
            "stream {k} ({:?}) on {}: {} tokens, {} before the failover and {after} after, {:?}",
            POOLS[k % 2].1,
            seen.backend,
            seen.arrivals.len(),
            seen.arrivals.len() - after,
            seen.finish_reason
        );
        seen.complete(TOKENS)
            .with_context(|| format!("stream {k} broke"))?;
        ensure!(
            after > 0,
            "stream {k} had ended before the failover: it proves nothing"
        );
    }
    let unknown = second.counter("sync_unknown")?;
    ensure!(
        unknown == 0,
        "the second gateway did not know {unknown} flows"
    );
    // The streams ran on for many seconds: the first gateway is long silent.
    let gone = peer(&second, side[0])?;
    ensure!(
        gone.state == PeerState::Silent && gone.heard_ms_ago.is_some_and(|ms| ms >= 3500),
        "the second gateway must see the first one gone: {gone:?}"
    );
    println!("{}", second.cli(&["peers"])?);
    // Both pools at once, as an operator of several sees them.
    let text = second.cli(&["show", "--json"])?;
    let pools: Vec<PoolView> = serde_json::from_str(&text).context("show --json")?;
    let names: Vec<&str> = pools.iter().map(|p| p.pool.as_str()).collect();
    ensure!(names == POOLS.map(|p| p.0), "show of every pool: {names:?}");
    let table = second.cli(&["show"])?;
    ensure!(
        POOLS
            .iter()
            .all(|(pool, _)| table.contains(&format!("pool {pool} "))),
        "show of every pool printed:\n{table}"
    );
    second.stop()?;
    Ok(())
}
