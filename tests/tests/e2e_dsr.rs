//! Direct server return (`forwarding = "dsr"`), end to end over namespaces with four
//! simulators that hold the VIPs on their loopbacks and route the client's network over a
//! link of the client's own to their switch, not through the gateway.
//!
//! Streams open to an IPv4 and an IPv6 VIP in turn; the operator drains, with `--wait`, the
//! server that carries the first, in both pools. Every stream must end with all its tokens
//! and `[DONE]`; new connections meanwhile avoid the drained server; `drain --wait` must
//! return once its streams ended, though the gateway sees only the client's half of each
//! connection (its FIN). No answer may pass the gateway: the client receives nothing on its
//! link to the gateway and every token on its link to the switch, and the program translated
//! no reply and dropped nothing. Then another server becomes reachable from the gateway only
//! through a router, then only out of an interface the program does not run on: scrapes and
//! checks still reach it, but the program could not hand it a packet; its health check must
//! say so and take it down before any connection is lost on it, and bring it back once its
//! route is direct again. A reload that would switch the
//! pools to NAT is refused.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use balancer_agent::config::Forwarding;
use balancer_agent::control::PoolView;
use balancer_tests::agent::{agent_binary, Agent, AgentConfig, PoolViewExt};
use balancer_tests::backends::SimBackends;
use balancer_tests::netns::Netns;
use balancer_tests::sim::client::{self, read_on, Stream};
use balancer_tests::topology::{backend_name, Family, Topology, BACKENDS, BACKEND_PORT};
use balancer_tests::{check_nothing_remains, serial};
use serde_json::json;

const SIM: &str = env!("CARGO_BIN_EXE_inference-sim");
const XDP_PASS: &str = env!("CARGO_BIN_EXE_xdp-pass");

const POOLS: [(&str, Family); 2] = [("chat-v4", Family::V4), ("chat-v6", Family::V6)];
const STREAMS: usize = 8;
/// About 3 s at the simulator's 65 tokens/s.
const TOKENS: u64 = 200;
const PROBES: usize = 12;
/// What the client may receive on its link to the gateway while nothing of ours comes that
/// way: neighbour discovery and the like.
const STRAY_PACKETS: u64 = 20;

#[test]
fn streams_answered_directly_by_the_servers() {
    let _serial = serial();
    let agent = agent_binary().unwrap();
    let mut topology = Topology::build_bare().unwrap();
    topology.direct_return().unwrap();
    topology.route_answers(true).unwrap();
    topology.attach_xdp_pass(Path::new(XDP_PASS)).unwrap();
    if let Err(e) = scenario(&topology, &agent) {
        panic!("{e:?}");
    }
    drop(topology);
    check_nothing_remains().unwrap();
}

/// Backend `(index + 1) % BACKENDS` becomes reachable from the gateway only through backend
/// `(index + 2) % BACKENDS`, which forwards (sending no redirects) for both families; then
/// only out of `g2`, a link of the gateway to the servers' switch where no program runs.
/// `index` is the drained server, left out.
fn off_the_program_s_links(topology: &Topology, agent: &Agent, index: usize) -> Result<()> {
    let (server, router) = ((index + 1) % BACKENDS, (index + 2) % BACKENDS);
    let r = topology.backend(router);
    r.sysctl("net.ipv4.ip_forward", "1")?;
    r.sysctl("net.ipv4.conf.all.send_redirects", "0")?;
    r.sysctl("net.ipv4.conf.eth0.send_redirects", "0")?;
    r.sysctl("net.ipv6.conf.all.forwarding", "1")?;
    let via_router = |family: Family| {
        let router = family.backend(router);
        (
            format!("via {router} dev g1"),
            format!("through the router {router}"),
        )
    };
    taken_down(topology, agent, server, "behind a router", via_router)?;
    topology.unattached_gateway_link("g2")?;
    let via_g2 = |_| {
        (
            "dev g2".to_owned(),
            "through g2, which is not in agent.interfaces".to_owned(),
        )
    };
    taken_down(
        topology,
        agent,
        server,
        "out of an interface without the program",
        via_g2,
    )
}

/// The gateway's route to backend `server` becomes `how(family)`'s route (after the
/// destination), in both pools: its health check must fail saying `how(family)`'s reason,
/// taking it DOWN, before a connection is lost on it; none reaches it meanwhile, none is
/// dropped. Then the route goes and the server comes back UP.
fn taken_down(
    topology: &Topology,
    agent: &Agent,
    server: usize,
    what: &str,
    how: impl Fn(Family) -> (String, String),
) -> Result<()> {
    let name = backend_name(server);
    let gw = topology.gw();
    let route = |verb: &str, family: Family| {
        let len = if family == Family::V4 { 32 } else { 128 };
        let route = format!(
            "route {verb} {}/{len} {}",
            family.backend(server),
            how(family).0
        );
        gw.ip(&route.split(' ').collect::<Vec<_>>())
    };
    for (_, family) in POOLS {
        route("add", family)?;
    }
    let before = agent.counters()?;
    let timing = (Duration::from_secs(10), Duration::from_millis(50));
    for (pool, family) in POOLS {
        let reason = how(family).1;
        let down = |view: &PoolView| {
            let row = view.server(family.backend(server))?;
            Ok(row.state == "DOWN" && row.health.contains(&reason))
        };
        let (view, _) = agent
            .wait_show(pool, &format!("{name} DOWN, {reason}"), timing, down)
            .with_context(|| format!("a server {what} stayed UP"))?;
        println!("{pool}: {}", view.server(family.backend(server))?.health);
        let table = agent.cli(&["show", "pool", pool])?;
        let said = format!(
            "{} is DOWN: failed: ",
            SocketAddr::new(family.backend(server), BACKEND_PORT)
        );
        ensure!(
            table.contains(&said) && table.contains(&reason),
            "show does not say why {name} is DOWN:\n{table}"
        );
    }
    let probes = probe(topology.client(), &format!("{name} {what}"))?;
    ensure!(
        !probes.contains(&name),
        "a new connection reached {name}, {what}: {probes:?}"
    );
    let after = agent.counters()?;
    let drops: Vec<_> = after
        .iter()
        .filter(|(k, v)| k.starts_with("drop_dsr") && before.get(*k) != Some(*v))
        .collect();
    ensure!(
        drops.is_empty(),
        "packets dropped with {name} {what}: {drops:?}"
    );
    for (_, family) in POOLS {
        route("del", family)?;
    }
    for (pool, family) in POOLS {
        let up = |view: &PoolView| Ok(view.server(family.backend(server))?.state == "UP");
        agent.wait_show(pool, &format!("{name} UP again"), timing, up)?;
    }
    Ok(())
}

/// `PROBES` short completions from the client, to the two pools' VIPs in turn, each a new
/// connection that must be answered; the server that answered each.
fn probe(client: &Netns, when: &str) -> Result<Vec<String>> {
    client.enter(|| {
        (0..PROBES)
            .map(|k| {
                let body = json!({"prompt": format!("probe {k}, {when}"), "max_tokens": 2});
                let reply = client::post(POOLS[k % 2].1.vip(), "/v1/completions", &body)?;
                ensure!(
                    reply.status() == 200,
                    "probe {k} {when}: {}",
                    reply.status()
                );
                Ok(reply.head.header("x-backend").unwrap_or("?").to_owned())
            })
            .collect()
    })
}

fn scenario(topology: &Topology, binary: &Path) -> Result<()> {
    // On their own IPv6 address (the IPv4 one is the default) and on both VIPs.
    let args: Vec<Vec<String>> = (0..BACKENDS)
        .map(|i| {
            let mut args = Vec::new();
            for addr in [
                Family::V6.backend(i),
                Family::V4.vip().ip(),
                Family::V6.vip().ip(),
            ] {
                args.push("--listen".to_owned());
                args.push(SocketAddr::new(addr, BACKEND_PORT).to_string());
            }
            args
        })
        .collect();
    let _sims = SimBackends::start(topology, Path::new(SIM), &args)?;
    let mut config = AgentConfig::gateway(topology, [100; BACKENDS]);
    config.agent.scrape_interval_ms = Some(500);
    config.agent.health_interval_ms = Some(500);
    for pool in &mut config.pools {
        pool.forwarding = Some("dsr".to_owned());
    }
    let mut agent = Agent::start(topology, binary, &config)?;
    for (pool, family) in POOLS {
        let every_server_up = |view: &PoolView| {
            Ok((0..BACKENDS).all(|i| {
                view.server(family.backend(i))
                    .is_ok_and(|row| row.state == "UP")
            }))
        };
        let timing = (Duration::from_secs(10), Duration::from_millis(50));
        let (view, _) = agent.wait_show(pool, "every server UP", timing, every_server_up)?;
        ensure!(
            view.forwarding == Forwarding::Dsr,
            "show says {pool} forwards by {:?}",
            view.forwarding
        );
    }
    let client = topology.client();
    let (via_gateway, via_switch) = (client.rx_packets("c0")?, client.rx_packets("c2")?);

    let mut readers = Vec::new();
    let mut carrying = BTreeSet::new();
    let mut victim = String::new();
    for k in 0..STREAMS {
        let body = json!({
            "prompt": format!("stream {k}, answered directly"),
            "max_tokens": TOKENS, "stream": true, "ignore_eos": true,
        });
        let stream =
            client.enter(|| Stream::open(POOLS[k % 2].1.vip(), "/v1/completions", &body))?;
        stream.set_timeout(Duration::from_secs(10))?;
        let backend = stream.head.header("x-backend").unwrap_or("?").to_owned();
        if k == 0 {
            victim = backend.clone();
        }
        carrying.insert(backend);
        readers.push(read_on(stream));
    }
    ensure!(
        carrying.len() > 1,
        "every stream went to {carrying:?}: the pick is not balancing"
    );
    let index = (0..BACKENDS)
        .find(|&i| backend_name(i) == victim)
        .with_context(|| format!("{victim} is not a backend"))?;

    let (drains, probes, seen) = thread::scope(|scope| {
        let drains: Vec<_> = POOLS
            .iter()
            .map(|&(pool, family)| {
                let server = family.backend(index).to_string();
                let agent = &agent;
                scope.spawn(move || {
                    let said = agent.cli(&["drain", pool, &server, "--wait", "--timeout", "30"]);
                    (said, Instant::now())
                })
            })
            .collect();
        // Both pools draining before the probes.
        let draining = POOLS.iter().try_for_each(|&(pool, family)| {
            let server = family.backend(index);
            let is_it = |s: &str| s.parse::<SocketAddr>().is_ok_and(|a| a.ip() == server);
            agent
                .wait_show(
                    pool,
                    &format!("{server} draining"),
                    (Duration::from_secs(10), Duration::from_millis(20)),
                    |view| {
                        Ok(view
                            .servers
                            .iter()
                            .any(|s| is_it(&s.server) && s.state == "DRAINING"))
                    },
                )
                .map(|_| ())
        });
        let probes = draining.and_then(|()| probe(client, "while draining"));
        let seen: Vec<_> = readers.into_iter().map(|r| r.join()).collect();
        let drains: Vec<_> = drains.into_iter().map(|d| d.join()).collect();
        (drains, probes, seen)
    });

    let mut victim_ended = None;
    let mut tokens = 0;
    for (k, seen) in seen.into_iter().enumerate() {
        let seen = seen
            .map_err(|_| anyhow::anyhow!("stream {k}: reader panicked"))?
            .with_context(|| format!("stream {k}"))?;
        println!(
            "stream {k} ({:?}) on {}: {} tokens, {:?}",
            POOLS[k % 2].1,
            seen.backend,
            seen.arrivals.len(),
            seen.finish_reason
        );
        seen.complete(TOKENS)
            .with_context(|| format!("stream {k} broke"))?;
        tokens += seen.arrivals.len() as u64;
        if seen.backend == victim {
            victim_ended = victim_ended.max(seen.arrivals.last().copied());
        }
    }
    let probes = probes?;
    ensure!(
        !probes.contains(&victim),
        "a new connection reached the draining {victim}: {probes:?}"
    );
    let victim_ended = victim_ended.context("the first stream's server has no stream")?;
    for (drain, (pool, _)) in drains.into_iter().zip(POOLS) {
        let (said, at) = drain.map_err(|_| anyhow::anyhow!("drain {pool}: panicked"))?;
        let said = said.with_context(|| format!("drain --wait in {pool}"))?;
        println!(
            "drain {victim} in {pool}: returned {:?} after its last stream ended: {}",
            at.saturating_duration_since(victim_ended),
            said.trim()
        );
        ensure!(said.contains("drained"), "drain in {pool} said: {said}");
        ensure!(
            at.saturating_duration_since(victim_ended) <= Duration::from_secs(5),
            "drain --wait in {pool} returned {:?} after the last stream on {victim} ended",
            at.saturating_duration_since(victim_ended)
        );
    }

    let via_gateway = client.rx_packets("c0")? - via_gateway;
    let via_switch = client.rx_packets("c2")? - via_switch;
    let counters = agent.counters()?;
    println!(
        "{tokens} tokens; the client received {via_switch} packets from the switch and \
         {via_gateway} from the gateway; gateway counters: {counters:?}"
    );
    ensure!(
        via_gateway <= STRAY_PACKETS && via_switch >= tokens / 2,
        "answers came through the gateway: {via_gateway} packets on c0, {via_switch} on c2"
    );
    let counter = |name: &str| counters.get(name).copied().unwrap_or(0);
    ensure!(
        counter("forward") > 0 && counter("return") == 0,
        "the program translated replies: {counters:?}"
    );
    let drops: Vec<_> = counters
        .iter()
        .filter(|(name, value)| name.starts_with("drop_dsr") && **value > 0)
        .collect();
    ensure!(drops.is_empty(), "packets dropped: {drops:?}");
    // And each pool's count of its VIP's drops, as `show` has it, agrees.
    for (pool, _) in POOLS {
        let dropped = agent.show(pool)?.dropped;
        ensure!(
            dropped == 0,
            "show: {dropped} packets to {pool}'s VIP dropped"
        );
    }

    off_the_program_s_links(topology, &agent, index)?;

    // A reload may not switch the pools back to NAT under their connections.
    let mut nat = config.clone();
    for pool in &mut nat.pools {
        pool.forwarding = None;
    }
    let said = agent.reload_text(&nat.to_toml()?)?;
    ensure!(
        said.contains("reload failed")
            && said.contains("forwarding changes only when the agent restarts"),
        "a reload to NAT said: {said}"
    );
    agent.stop()?;
    Ok(())
}
