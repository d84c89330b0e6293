//! Tunnel forwarding (`forwarding = "tunnel"`), end to end over namespaces: the server is a
//! router beyond the gateway's links (`fs`, behind `rt`), holds the VIPs on its loopback and
//! runs `balancer-agent decap`; its router sends the answers to the client over the client's
//! own link to the switch, not through the gateway.
//!
//! For each family, a stream of server-sent events and an upload of 256 KiB through the VIP.
//! The stream must arrive whole, from the far server; the upload's full-size segments do
//! not fit the gateway's link to the servers once the outer header is added, so the program
//! must answer them with the ICMP "too big" for the MTU less the header, and the client's
//! path MTU discovery must carry the upload through. No answer may pass the gateway (the
//! client receives nothing on its link to the gateway), the program translates no reply and
//! drops nothing, and the server's `decap` counts what it took apart.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use balancer_agent::config::Forwarding;
use balancer_agent::control::PoolView;
use balancer_tests::agent::{agent_binary, Agent, AgentConfig, PoolViewExt};
use balancer_tests::client::{self, SseStream};
use balancer_tests::process::Process;
use balancer_tests::topology::{Family, Topology};
use balancer_tests::{check_nothing_remains, serial};

const SSE_SERVER: &str = env!("CARGO_BIN_EXE_sse-server");
const XDP_PASS: &str = env!("CARGO_BIN_EXE_xdp-pass");

const POOLS: [(&str, Family, &str, &str); 2] = [
    ("tunnel-v4", Family::V4, "10.6.0.2", "10.4.0.1"),
    ("tunnel-v6", Family::V6, "fd00:6::2", "fd00:4::1"),
];
const EVENTS: u32 = 20;
const INTERVAL_MS: u64 = 100;
const UPLOAD: usize = 256 * 1024;
/// What the client may receive on its link to the gateway while nothing of ours comes that
/// way but the program's ICMP answers: neighbour discovery and the like.
const STRAY_PACKETS: u64 = 20;

#[test]
fn streams_and_uploads_through_a_tunnel_to_a_server_beyond_a_router() {
    let _serial = serial();
    let agent = agent_binary().unwrap();
    let mut topology = Topology::build_bare().unwrap();
    topology.direct_return().unwrap();
    topology.attach_xdp_pass(Path::new(XDP_PASS)).unwrap();
    topology
        .add_far_server(1500, Path::new(SSE_SERVER))
        .unwrap();
    topology
        .tunnel_to_far_server(Path::new(SSE_SERVER), true)
        .unwrap();
    if let Err(e) = scenario(&topology, &agent) {
        panic!("{e:?}");
    }
    drop(topology);
    check_nothing_remains().unwrap();
}

fn scenario(topology: &Topology, binary: &Path) -> Result<()> {
    let fs = topology.far_server()?;
    let mut cmd = fs.command(binary);
    cmd.args(["decap", "--interface", "e0"]);
    for (.., gateway) in POOLS {
        cmd.args(["--gateway", gateway]);
    }
    let mut decap = Process::spawn("decap in fs", cmd, &topology.dir().join("decap.log"))?;
    decap.wait_for_line(0, Duration::from_secs(10), |line| {
        line.contains("decapsulating")
    })?;

    let mut config = AgentConfig::gateway(topology, [100; 4]);
    config.agent.health_interval_ms = Some(500);
    config.agent.scrape_interval_ms = Some(500);
    for (pool, (name, _, server, gateway)) in config.pools.iter_mut().zip(POOLS) {
        pool.name = name.to_owned();
        pool.forwarding = Some("tunnel".to_owned());
        pool.tunnel_source = Some(gateway.parse()?);
        pool.servers.truncate(1);
        pool.servers[0].address = server.parse()?;
    }
    let agent = Agent::start(topology, binary, &config)?;
    for (pool, family, server, _) in POOLS {
        let up = |view: &PoolView| Ok(view.server(server.parse()?)?.state == "UP");
        let (view, _) = agent.wait_show(
            pool,
            "the far server UP",
            (Duration::from_secs(10), Duration::from_millis(50)),
            up,
        )?;
        ensure!(
            view.forwarding == Forwarding::Tunnel,
            "show says {pool} ({family:?}) forwards by {:?}",
            view.forwarding
        );
    }
    let client = topology.client();
    let (via_gateway, via_switch) = (client.rx_packets("c0")?, client.rx_packets("c2")?);

    for ((pool, family, ..), port) in POOLS.into_iter().zip([45001, 45002]) {
        let vip = family.vip();
        let log = client.enter(|| {
            let stream = SseStream::open(vip, port, EVENTS, INTERVAL_MS)?;
            stream.finish()
        })?;
        ensure!(
            log.seqs() == (0..EVENTS).collect::<Vec<_>>()
                && log.done
                && log.events.iter().all(|e| e.backend == "far"),
            "{pool}: the stream broke: {:?}, done {}",
            log.seqs(),
            log.done
        );
        let answered = agent.counter("too_big_answered")?;
        let started = Instant::now();
        let reply = client.enter(|| client::post_length(vip, port + 10, UPLOAD))?;
        let answers = agent.counter("too_big_answered")? - answered;
        println!(
            "{pool}: {EVENTS} events from far; {UPLOAD} bytes up in {:?}, {answers} \"too big\" answers",
            started.elapsed()
        );
        ensure!(
            reply.status == 200 && reply.body == format!("{UPLOAD}\n") && reply.backend == "far",
            "{pool}: the upload got status {}, {:?} from {}",
            reply.status,
            reply.body,
            reply.backend
        );
        ensure!(
            answers >= 1,
            "{pool}: no full-size segment was answered \"too big\": the outer header's room \
             was not checked"
        );
    }

    let via_gateway = client.rx_packets("c0")? - via_gateway;
    let via_switch = client.rx_packets("c2")? - via_switch;
    let counters = agent.counters()?;
    let counter = |name: &str| counters.get(name).copied().unwrap_or(0);
    println!(
        "the client received {via_switch} packets from the switch and {via_gateway} from the \
         gateway; encapsulated {}",
        counter("encapsulated")
    );
    ensure!(
        via_gateway <= STRAY_PACKETS + counter("too_big_answered")
            && via_switch >= u64::from(EVENTS),
        "answers came through the gateway: {via_gateway} packets on c0, {via_switch} on c2"
    );
    ensure!(
        counter("encapsulated") > 0 && counter("return") == 0,
        "the program did not tunnel, or translated replies: {counters:?}"
    );
    let drops: Vec<_> = counters
        .iter()
        .filter(|(name, value)| name.starts_with("drop_") && **value > 0)
        .collect();
    ensure!(drops.is_empty(), "packets dropped: {drops:?}");
    agent.stop()?;

    // Asked while it runs, then at its end.
    let from = decap.output_len();
    decap.signal(libc::SIGUSR1)?;
    let line = decap.wait_for_line(from, Duration::from_secs(5), |line| {
        line.starts_with("decapsulated ")
    })?;
    println!("decap, asked with SIGUSR1: {}", line.trim());
    decap.stop(Duration::from_secs(5))?;
    let said = decap.output();
    let taken = said
        .lines()
        .find_map(|line| line.strip_prefix("decapsulated "))
        .and_then(|n| n.trim().parse::<u64>().ok())
        .with_context(|| format!("decap printed no count:\n{said}"))?;
    println!(
        "decap: {}",
        said.lines().rev().take(5).collect::<Vec<_>>().join(", ")
    );
    ensure!(
        taken >= counter("encapsulated") / 2,
        "the server took apart {taken} packets of the {} the gateway tunnelled",
        counter("encapsulated")
    );
    Ok(())
}
