//! Issue 2, item 3: new connections through a VIP spread over four backends by weight; a
//! backend whose weight is set to 0 gets no new connection while a stream already on it runs
//! to its end, and so does a stream on a backend the reload removes from the pool; the same
//! for an IPv6 VIP; and nothing remains afterwards, also when a test fails.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use balancer_tests::agent::{agent_binary, Agent, AgentConfig};
use balancer_tests::client::{self, SseStream};
use balancer_tests::netns::Netns;
use balancer_tests::topology::{backend_name, Family, Topology, BACKENDS, GATEWAY_INTERFACES};
use balancer_tests::{check_nothing_remains, serial};

const SSE_SERVER: &str = env!("CARGO_BIN_EXE_sse-server");
const XDP_PASS: &str = env!("CARGO_BIN_EXE_xdp-pass");

/// Shares 20/20/40/20 %.
const WEIGHTS: [u32; BACKENDS] = [100, 100, 200, 100];
/// Allowed deviation of a backend's count from its weight share, relative to the share.
const TOLERANCE: f64 = 0.10;
/// The backend whose weight goes to 0: b2.
const DRAINED: usize = 1;
/// The backend the reload removes from the pools: b4.
const REMOVED: usize = 3;
/// Source ports, fixed so that a run is reproducible (the balancer hashes the 5-tuple), and
/// above 16384-32767, which carries affinity hints.
///
/// The issue asks for 2,000 connections within ±10% of each share, but with 2,000 a 20% share
/// expects 400 ± 17.9 (one standard deviation), so ±10% is only 2.2 sigma: about one window
/// of 2,000 ports in ten fails on a perfectly weighted table, and ports 40000-41999 to the
/// IPv6 VIP are such a window (b4 gets 341). 8,000 connections make it 4.5 sigma, which a
/// correct balancer passes for any hash, in about 3 s.
const SPREAD_PORTS: Range<u16> = 40000..48000;
const STREAM_PORTS: Range<u16> = 48000..48050;
const ORPHAN_PORTS: Range<u16> = 48050..48100;
const AFTER_RELOAD_PORTS: Range<u16> = 48100..48500;
const STREAM_EVENTS: u32 = 30;
const STREAM_INTERVAL_MS: u64 = 1000;

#[test]
fn ipv4_vip() {
    forwarding(Family::V4);
}

#[test]
fn ipv6_vip() {
    forwarding(Family::V6);
}

/// A hop narrower than both ends (the gateway's link to the switch at 1300 bytes, clients
/// and servers at 1500): an upload's full-size segments are too big for it, and the client's
/// path MTU discovery learns that only from an ICMP error that quotes its own connection,
/// to the VIP. The program answers so; the stack would quote the translated packet, which
/// the client ignores, and the upload would stall.
#[test]
fn uploads_cross_a_narrower_hop() {
    on_topology(narrower_hop);
}

fn narrower_hop(topology: &mut Topology, agent: &Path) -> Result<()> {
    const UPLOAD: usize = 256 * 1024;
    let config = config(topology);
    let agent = Agent::start(topology, agent, &config)?;
    topology.set_gateway_switch_mtu(1300)?;
    each_family(
        &agent,
        topology.client(),
        [49000, 49001],
        ("too_big_answered", 1),
        |vip, port| client::post_length(vip, port, UPLOAD),
        |reply| reply.body == format!("{UPLOAD}\n"),
    )?;
    agent.stop()
}

/// A hop narrower than both ends on the clients' side of the gateway (a router one link
/// before the client, at 1300 bytes): a download's full-size segments are too big for it,
/// and the router's ICMP error goes to their source, the VIP. The program sends it on to the
/// server, translated back to the server's own connection, whose path MTU discovery then
/// sends smaller segments; the stack would drop it, and the download would stall.
#[test]
fn downloads_cross_a_narrower_hop_beyond_the_gateway() {
    on_topology(narrower_hop_beyond);
}

fn narrower_hop_beyond(topology: &mut Topology, agent: &Path) -> Result<()> {
    const DOWNLOAD: usize = 48 * 1024;
    topology.add_far_client(1300)?;
    let config = config(topology);
    let agent = Agent::start(topology, agent, &config)?;
    each_family(
        &agent,
        topology.far_client()?,
        [49002, 49003],
        ("icmp_to_backend", 1),
        |vip, port| client::get_bytes(vip, port, DOWNLOAD),
        |reply| reply.body.len() == DOWNLOAD,
    )?;
    agent.stop()
}

/// A hop narrower than both ends on the servers' side of the gateway (a router between the
/// switch and the server, at 1300 bytes): an upload's full-size segments are too big for
/// it, and the router's ICMP error goes to their source, the client, quoting the segment as
/// the gateway translated it (to the server). The program puts the VIP back into the quote,
/// so that the client's path MTU discovery finds its connection; unchanged, the client
/// would ignore it and the upload would stall.
#[test]
fn uploads_cross_a_narrower_hop_beyond_the_gateway() {
    on_topology(narrower_hop_beyond_to_servers);
}

fn narrower_hop_beyond_to_servers(topology: &mut Topology, agent: &Path) -> Result<()> {
    const UPLOAD: usize = 256 * 1024;
    topology.add_far_server(1300, Path::new(SSE_SERVER))?;
    let mut config = config(topology);
    for (pool, far) in config.pools.iter_mut().zip(["10.6.0.2", "fd00:6::2"]) {
        pool.servers.truncate(1);
        pool.servers[0].address = far.parse()?;
    }
    let agent = Agent::start(topology, agent, &config)?;
    each_family(
        &agent,
        topology.client(),
        [49006, 49007],
        ("icmp_to_client", 1),
        |vip, port| client::post_length(vip, port, UPLOAD),
        |reply| reply.body == format!("{UPLOAD}\n") && reply.backend == "far",
    )?;
    agent.stop()
}

/// `xdp_mode = "generic"`: attached in the stack rather than the driver, the program
/// forwards as in native mode, both ways, IPv4 and IPv6. The kernel does no GRO where a
/// generic program runs, so however the interfaces' GRO is set, it sees segments as they
/// came, whose checksums it can translate.
#[test]
fn generic_mode_forwards_with_gro_on() {
    on_topology(generic_mode);
}

fn generic_mode(topology: &mut Topology, agent: &Path) -> Result<()> {
    const UPLOAD: usize = 1 << 20;
    let gw = topology.gw();
    for dev in GATEWAY_INTERFACES {
        gw.exec("ethtool", &["-K", dev, "gro", "on"])?;
    }
    let mut config = config(topology);
    config.agent.xdp_mode = Some("generic".into());
    let agent = Agent::start(topology, agent, &config)?;
    let attached = topology.gateway_xdp()?;
    ensure!(
        attached.len() == 2 && attached.iter().all(|a| a.contains("xdpgeneric")),
        "not attached in generic mode: {attached:?}"
    );
    let interfaces = agent.interfaces()?;
    ensure!(
        interfaces.iter().all(|i| i.mode == "generic"),
        "interfaces: {interfaces:?}"
    );
    // Segments, not coalesced frames: at most one MSS each.
    each_family(
        &agent,
        topology.client(),
        [49004, 49005],
        ("forward", (UPLOAD / 1460) as u64),
        |vip, port| client::post_length(vip, port, UPLOAD),
        |reply| reply.body == format!("{UPLOAD}\n"),
    )?;
    agent.stop()
}

/// Jumbo frames (MTU 9000 on every link) in native mode: the program is multi-buffer aware,
/// so veth runs it natively at that MTU and hands it frames longer than a page in several
/// buffers, and the gateway's veths transmit such frames (their peers have XDP programs).
/// Downloads and uploads cross the gateway whole, in frames past a 1500 MTU's, redirected.
#[test]
fn jumbo_frames_cross_in_native_mode() {
    on_topology(jumbo_frames);
}

fn jumbo_frames(topology: &mut Topology, agent: &Path) -> Result<()> {
    const MTU: u32 = 9000;
    // A download is read up to 64 KiB (`client::get_bytes`): seven jumbo frames.
    const DOWNLOAD: usize = 60 << 10;
    const UPLOAD: usize = 1 << 20;
    topology.set_mtu(MTU)?;
    let mut config = config(topology);
    config.agent.xdp_mode = Some("native".into());
    let agent = Agent::start(topology, agent, &config)?;
    let attached = topology.gateway_xdp()?;
    ensure!(
        attached.len() == 2 && attached.iter().all(|a| !a.contains("xdpgeneric")),
        "not attached natively: {attached:?}"
    );
    // As the operator sees it: the peers' programs make the gateway's veths transmit frames
    // in several buffers, which the agent finds as it attaches.
    let interfaces = agent.interfaces()?;
    println!("{}", agent.cli(&["interfaces"])?);
    ensure!(
        interfaces.len() == 2
            && interfaces.iter().all(|i| i.mode == "native"
                && i.mtu == Some(MTU)
                && i.multi_buffer_tx
                && i.state == "attached"),
        "interfaces: {interfaces:?}"
    );
    // The links the gateway sends the transfers' data out of, as their far ends count it,
    // and the mean frame each must show: the server writes its answer in pieces, which
    // make frames past a 1500 MTU's; the client's upload is sent in full segments, past
    // what veth takes in one buffer (about 3500).
    let (client, switch) = (topology.client(), topology.sw());
    let through_stack = agent.counter("pass_egress")?;
    let (down, up) = (
        (client, "c0", "return", 1514),
        (switch, "s0", "forward", 4000),
    );
    for (what, (ns, dev, counter, least), bytes, ports, transfer) in [
        (
            "download",
            down,
            DOWNLOAD,
            [49010, 49011],
            &(|vip, port| client::get_bytes(vip, port, DOWNLOAD)) as &Transfer,
        ),
        (
            "upload",
            up,
            UPLOAD,
            [49012, 49013],
            &(|vip, port| client::post_length(vip, port, UPLOAD)) as &Transfer,
        ),
    ] {
        let before = received(ns, dev)?;
        each_family(
            &agent,
            topology.client(),
            ports,
            (counter, (bytes / MTU as usize) as u64),
            transfer,
            |reply| match what {
                "download" => reply.body.len() == bytes,
                _ => reply.body == format!("{bytes}\n"),
            },
        )?;
        let after = received(ns, dev)?;
        let mean = (after.0 - before.0) / (after.1 - before.1).max(1);
        println!("{what}: {dev} received frames of {mean} bytes on average");
        ensure!(
            mean > least,
            "{what}: {dev} received frames of {mean} bytes on average, not over {least}"
        );
    }
    // Redirected, not handed to the stack: the peers' programs make veth transmit frames in
    // several buffers, and the agent found so.
    let through_stack = agent.counter("pass_egress")? - through_stack;
    ensure!(
        through_stack == 0,
        "{through_stack} frames went to the stack (pass_egress)"
    );
    agent.stop()
}

type Transfer = dyn Fn(SocketAddr, u16) -> Result<client::Reply> + Sync;

/// What `dev` in `ns` has received: bytes and packets.
fn received(ns: &Netns, dev: &str) -> Result<(u64, u64)> {
    let json = ns.ip(&["-s", "-j", "link", "show", "dev", dev])?;
    let links: serde_json::Value = serde_json::from_str(&json)?;
    let rx = &links[0]["stats64"]["rx"];
    rx["bytes"]
        .as_u64()
        .zip(rx["packets"].as_u64())
        .with_context(|| format!("{dev}'s received bytes and packets in {json}"))
}

/// One transfer through each family's VIP, from `ports`, made in `ns` by `transfer`: it must
/// be answered 200 as `expected` says, and the agent's `counter` must move by at least
/// `at_least` meanwhile, or the path the test is about was not taken.
fn each_family(
    agent: &Agent,
    ns: &Netns,
    ports: [u16; 2],
    (counter, at_least): (&str, u64),
    transfer: impl Fn(SocketAddr, u16) -> Result<client::Reply> + Sync,
    expected: impl Fn(&client::Reply) -> bool,
) -> Result<()> {
    for (family, port) in [Family::V4, Family::V6].into_iter().zip(ports) {
        let before = agent.counter(counter)?;
        let started = Instant::now();
        let reply = ns
            .enter(|| transfer(family.vip(), port))
            .with_context(|| format!("{family:?}: the transfer from port {port}"))?;
        let moved = agent.counter(counter)? - before;
        println!(
            "{family:?}: {} bytes of answer from {} in {:?}, {counter} +{moved}",
            reply.body.len(),
            reply.backend,
            started.elapsed()
        );
        ensure!(
            reply.status == 200 && expected(&reply),
            "{family:?}: status {}, {} bytes from {}",
            reply.status,
            reply.body.len(),
            reply.backend
        );
        ensure!(
            moved >= at_least,
            "{family:?}: {counter} moved by {moved}, not {at_least} or more: the path under test was not taken"
        );
    }
    Ok(())
}

#[test]
fn panic_with_the_agent_running_leaves_nothing_behind() {
    let _serial = serial();
    let agent = agent_binary().unwrap();
    let result = catch_unwind(AssertUnwindSafe(|| {
        let topology = topology();
        let config = config(&topology);
        let _agent = Agent::start(&topology, &agent, &config).unwrap();
        panic!("deliberate panic with the agent running");
    }));
    let payload = result.expect_err("the closure panics");
    assert_eq!(
        payload.downcast_ref::<&str>(),
        Some(&"deliberate panic with the agent running"),
        "the setup itself failed"
    );
    check_nothing_remains().unwrap();
}

/// The agent on the gateway with `WEIGHTS`. The SSE servers are no inference servers: their
/// health checks fail, and `fall` of them would take every server DOWN ten seconds in,
/// mid-test, however the forwarding fares. One check at the start, the next ten minutes on.
fn config(topology: &Topology) -> AgentConfig {
    let mut config = AgentConfig::gateway(topology, WEIGHTS);
    config.agent.health_interval_ms = Some(600_000);
    config
}

/// Runs `scenario` on a topology of its own with the agent's binary, panicking with its
/// error while the topology is alive (it then prints every process's log), and checks that
/// nothing is left behind.
fn on_topology(scenario: fn(&mut Topology, &Path) -> Result<()>) {
    let _serial = serial();
    let agent = agent_binary().unwrap();
    let mut topology = topology();
    if let Err(e) = scenario(&mut topology, &agent) {
        panic!("{e:?}");
    }
    drop(topology);
    check_nothing_remains().unwrap();
}

fn topology() -> Topology {
    let mut topology = Topology::build(Path::new(SSE_SERVER)).unwrap();
    topology.attach_xdp_pass(Path::new(XDP_PASS)).unwrap();
    topology
}

fn forwarding(family: Family) {
    let _serial = serial();
    let agent = agent_binary().unwrap();
    let topology = topology();
    // Panicking with the topology alive makes it print every process's log.
    if let Err(e) = scenario(&topology, &agent, family) {
        panic!("{family:?}: {e:?}");
    }
    drop(topology);
    check_nothing_remains().unwrap();
}

fn scenario(topology: &Topology, agent: &Path, family: Family) -> Result<()> {
    let vip = family.vip();
    let mut config = config(topology);
    let mut agent = Agent::start(topology, agent, &config)?;
    // Shows that the check after the agent stops can see a program at all.
    let attached = topology.gateway_xdp()?;
    ensure!(
        attached.len() == GATEWAY_INTERFACES.len(),
        "the agent is ready but XDP is attached only to {attached:?}"
    );

    let started = Instant::now();
    let counts = topology
        .client()
        .enter(|| client::count_backends(vip, SPREAD_PORTS))?;
    println!(
        "{family:?}: {} connections in {:?}, weights {WEIGHTS:?}: {counts:?}",
        SPREAD_PORTS.len(),
        started.elapsed()
    );
    check_shares(&counts)?;

    let drained = backend_name(DRAINED);
    let removed = backend_name(REMOVED);
    let stream = topology
        .client()
        .enter(|| open_stream_on(vip, STREAM_PORTS, &drained))?;
    let orphan = topology
        .client()
        .enter(|| open_stream_on(vip, ORPHAN_PORTS, &removed))?;
    // Scoped, so that the readers are joined on every path out of here, errors included.
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| stream.finish());
        let orphan_reader = scope.spawn(|| orphan.finish());

        config.set_weight(DRAINED, 0);
        for pool in &mut config.pools {
            pool.servers.remove(REMOVED);
        }
        agent.reload(&config)?;
        let reloaded = Instant::now();
        let counts = topology
            .client()
            .enter(|| client::count_backends(vip, AFTER_RELOAD_PORTS))?;
        println!(
            "{family:?}: {} connections after {drained}'s weight went to 0: {counts:?}",
            AFTER_RELOAD_PORTS.len()
        );
        ensure!(
            !counts.contains_key(&drained) && !counts.contains_key(&removed),
            "{drained} (weight 0) or {removed} (removed) took new connections: {counts:?}"
        );

        for (reader, backend, what) in [
            (reader, &drained, "weight 0"),
            (orphan_reader, &removed, "removed from the pool"),
        ] {
            let log = reader
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
                .with_context(|| format!("the stream on {backend} ({what})"))?;
            let seqs = log.seqs();
            println!(
                "{family:?}: stream on {backend} ({what}) received {seqs:?}, done: {}",
                log.done
            );
            ensure!(
                seqs == (0..STREAM_EVENTS).collect::<Vec<_>>() && log.done,
                "the stream on {backend} ({what}) did not run to its end: {seqs:?}, [DONE]: {}",
                log.done
            );
            ensure!(
                log.events.iter().all(|e| e.backend == *backend),
                "the stream moved: {:?}",
                log.events
            );
            ensure!(
                log.events.last().is_some_and(|e| e.at > reloaded),
                "the stream on {backend} ended before the reload, so it proves nothing"
            );
        }
        Ok(())
    })?;

    agent.stop()?;
    let attached = topology.gateway_xdp()?;
    ensure!(
        attached.is_empty(),
        "XDP programs remain after the agent stopped: {attached:?}"
    );
    Ok(())
}

/// Opens streams from successive ports until one lands on `backend`; closes the others.
fn open_stream_on(vip: SocketAddr, ports: Range<u16>, backend: &str) -> Result<SseStream> {
    for port in ports.clone() {
        let mut stream = SseStream::open(vip, port, STREAM_EVENTS, STREAM_INTERVAL_MS)
            .with_context(|| format!("opening a stream from port {port}"))?;
        let first = stream
            .next_event()?
            .with_context(|| format!("the stream from port {port} ended before its first event"))?;
        if first.backend == backend {
            return Ok(stream);
        }
    }
    bail!("no stream from ports {ports:?} landed on {backend}")
}

fn check_shares(counts: &BTreeMap<String, usize>) -> Result<()> {
    let total: usize = counts.values().sum();
    let weight_sum: u32 = WEIGHTS.iter().sum();
    let names: Vec<String> = (0..BACKENDS).map(backend_name).collect();
    ensure!(
        counts.keys().all(|name| names.contains(name)),
        "answers from unknown backends: {counts:?}"
    );
    let mut off = Vec::new();
    for (name, weight) in names.iter().zip(WEIGHTS) {
        let got = counts.get(name).copied().unwrap_or(0);
        let expected = total as f64 * f64::from(weight) / f64::from(weight_sum);
        if (got as f64 - expected).abs() > TOLERANCE * expected {
            off.push(format!(
                "{name}: {got}, expected {expected:.0} ± {:.0}",
                TOLERANCE * expected
            ));
        }
    }
    ensure!(
        off.is_empty(),
        "shares off by more than {:.0}%: {}",
        TOLERANCE * 100.0,
        off.join("; ")
    );
    Ok(())
}
