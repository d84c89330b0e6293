//! Gateway throughput over namespaces (issue 8, item 2): our XDP balancer, nftables DNAT
//! load balancing (`numgen random`, conntrack) and HAProxy in TCP mode (`roundrobin`), each
//! in turn in the gateway namespace of the same topology (client, gateway, switch, four
//! backends running `bench-server`), in rounds within one run, the order rotating from round
//! to round. Every system serves the VIP 192.0.2.60:8000; for HAProxy it is a local address
//! of the gateway, for the others it is routed to the gateway and translated there.
//!
//! Per system and round, with `loadgen` in the client namespace (every request a fresh
//! connection, `GET /` answered by a few bytes, the server closing first):
//! - new connections per second, closed loop with a fixed number of concurrent clients;
//! - connect-to-first-byte p50 and p99 under a fixed offered load (open loop);
//! - bulk throughput of a few long streams;
//! - gateway CPU per 1000 connections during the connections-per-second phase: the
//!   machine's softirq time (`/proc/stat`), where the XDP program, nftables, conntrack and
//!   forwarding run, plus HAProxy's own CPU (user + system, `/proc/PID/stat`) for HAProxy.
//!   Namespaces share the machine's CPUs, so softirq also holds the client's and backends'
//!   receive processing, the same for every system; the difference is the gateway's.
//!
//! For context, the bulk phase's loss: TCP segments retransmitted, per thousand the client
//! received, and packets the gateway's links dropped on transmit.
//!
//! Each figure is the median over the rounds; the ratios compare those medians.
//!
//! A fourth system runs in the same rounds for context, outside the goal: ours with direct
//! server return (`forwarding = "dsr"`). Its servers answer the client over a link of the
//! client's own to their switch, not through the gateway, so its path is not the others'.
//!
//! Also for context, after those rounds: the bulk phase again with jumbo frames (MTU 9000
//! on every link between the client and the backends), ours, nftables and HAProxy in
//! rounds of their own, as inference clusters often run.
//!
//! `cargo bench -p balancer-tests --bench gateway [-- --quick]`, as root.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use balancer_tests::agent::{release_agent_binary, Agent, AgentConfig};
use balancer_tests::bench::{cpu_seconds, fmt, median, quick_flag, MachineCpu, Report};
use balancer_tests::competitors::{Haproxy, Nft};
use balancer_tests::netns::Netns;
use balancer_tests::process::Process;
use balancer_tests::topology::{
    backend_name, Family, Topology, BACKENDS, BACKEND_PORT, METRICS_PORT,
};
use serde_json::Value;

const BENCH_SERVER: &str = env!("CARGO_BIN_EXE_bench-server");
const LOADGEN: &str = env!("CARGO_BIN_EXE_loadgen");
const XDP_PASS: &str = env!("CARGO_BIN_EXE_xdp-pass");

struct Plan {
    rounds: usize,
    /// Rounds of the jumbo-frame bulk phase (context, outside the goal).
    jumbo_rounds: usize,
    warmup: Duration,
    concurrency: usize,
    rate_phase: Duration,
    offered: f64,
    latency_phase: Duration,
    streams: usize,
    bulk_phase: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum System {
    Xdp,
    Nft,
    Haproxy,
    XdpDsr,
}

const SYSTEMS: [System; 4] = [System::Xdp, System::Nft, System::Haproxy, System::XdpDsr];
/// The systems of the jumbo-frame rounds, in the order of `SYSTEMS`: not DSR, whose
/// answers go around the gateway (and its links for them stay at 1500).
const JUMBO_SYSTEMS: [System; 3] = [System::Xdp, System::Nft, System::Haproxy];
const JUMBO_MTU: u32 = 9000;

impl System {
    fn label(self) -> &'static str {
        match self {
            System::Xdp => "XDP balancer (ours)",
            System::Nft => "nftables DNAT",
            System::Haproxy => "HAProxy TCP",
            System::XdpDsr => "XDP balancer, DSR",
        }
    }

    fn key(self) -> &'static str {
        match self {
            System::Xdp => "xdp",
            System::Nft => "nft",
            System::Haproxy => "haproxy",
            System::XdpDsr => "dsr",
        }
    }
}

/// One system's figures in one round.
#[derive(Debug, Clone, Default)]
struct Sample {
    cps: Option<f64>,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    gateway_cpu_ms_per_1k: Option<f64>,
    machine_cpu_ms_per_1k: Option<f64>,
    bulk: Bulk,
    /// Of the connections/s and latency phases; the bulk phase's are in `bulk`.
    errors: u64,
}

/// One system's bulk phase in one round.
#[derive(Debug, Clone, Default)]
struct Bulk {
    gbps: Option<f64>,
    /// TCP segments retransmitted (every namespace) per thousand the client received, and
    /// packets the links dropped on transmit.
    retrans_per_1k: Option<f64>,
    link_drops: Option<f64>,
    errors: u64,
}

/// A figure of the table: how to read it from a sample, and which way is better.
struct Figure {
    key: &'static str,
    label: String,
    higher_is_better: bool,
    decimals: usize,
    get: fn(&Sample) -> Option<f64>,
}

fn main() -> Result<()> {
    let quick = quick_flag("gateway")?;
    let plan = if quick {
        Plan {
            rounds: 1,
            jumbo_rounds: 1,
            warmup: Duration::from_millis(300),
            concurrency: 16,
            rate_phase: Duration::from_millis(1500),
            offered: 300.0,
            latency_phase: Duration::from_millis(1500),
            streams: 2,
            bulk_phase: Duration::from_millis(1500),
        }
    } else {
        Plan {
            // Five: bulk throughput moves by 20% from one round to the next.
            rounds: 5,
            // Three: context, outside the goal; five of them took 2 of the 20 minutes the
            // whole suite may take.
            jumbo_rounds: 3,
            warmup: Duration::from_millis(500),
            concurrency: 32,
            // About 60,000 connections at the 12,000/s seen; 5,000 latency samples (the
            // p99 is the 50th slowest).
            rate_phase: Duration::from_secs(5),
            offered: 1000.0,
            latency_phase: Duration::from_secs(5),
            streams: 4,
            bulk_phase: Duration::from_secs(4),
        }
    };
    balancer_tests::require_root()?;
    let started = Instant::now();
    let agent = release_agent_binary()?;
    let mut topology = Topology::build_bare()?;
    topology.direct_return()?;
    topology.attach_xdp_pass(Path::new(XDP_PASS))?;
    let servers = start_servers(&topology)?;
    let result = rounds(&topology, &agent, &plan).and_then(|samples| {
        topology.set_mtu(JUMBO_MTU)?;
        Ok((samples, jumbo_rounds(&topology, &agent, &plan)?))
    });
    drop(servers);
    drop(topology);
    let (samples, jumbo) = result?;
    let mut report = report(&plan, quick, &samples, started.elapsed());
    jumbo_report(&plan, &jumbo, &mut report);
    report.write()
}

/// `bench-server` in every backend, on the API and metrics ports, and on the VIP for DSR.
fn start_servers(topology: &Topology) -> Result<Vec<Process>> {
    let mut servers = Vec::new();
    for i in 0..BACKENDS {
        let address = Family::V4.backend(i);
        let mut cmd = topology.backend(i).command(BENCH_SERVER);
        for port in [BACKEND_PORT, METRICS_PORT] {
            cmd.arg("--listen").arg(format!("{address}:{port}"));
        }
        cmd.arg("--listen").arg(Family::V4.vip().to_string());
        cmd.args(["--name", &backend_name(i)]);
        let log = topology
            .dir()
            .join(format!("{}-bench-server.log", backend_name(i)));
        let mut server = Process::spawn(format!("bench-server in {}", backend_name(i)), cmd, &log)?;
        server.wait_for_line(0, Duration::from_secs(10), |l| l.contains("listening on"))?;
        servers.push(server);
    }
    Ok(servers)
}

/// `rounds` rounds of `measure` (given the round and the system) on each of `systems`, the
/// order rotating from round to round; returns the results by system.
fn rotating<T>(
    rounds: usize,
    systems: &[System],
    mut measure: impl FnMut(usize, System) -> Result<T>,
) -> Result<Vec<Vec<T>>> {
    let mut samples: Vec<Vec<T>> = systems.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for k in 0..systems.len() {
            let s = (k + round) % systems.len();
            samples[s].push(measure(round, systems[s])?);
        }
    }
    Ok(samples)
}

/// Every round runs every system, the order rotating; returns the samples by system.
fn rounds(topology: &Topology, agent: &Path, plan: &Plan) -> Result<Vec<Vec<Sample>>> {
    rotating(plan.rounds, &SYSTEMS, |round, system| {
        let t = Instant::now();
        let sample = with_system(topology, agent, system, |pid| measure(topology, plan, pid))
            .with_context(|| format!("round {}, {}", round + 1, system.label()))?;
        eprintln!(
                "round {} {:<20} {:>7} conn/s  p50 {} ms  p99 {} ms  {} Gbit/s  gateway CPU {} ms/1k  errors {}  ({:.1} s)",
                round + 1,
                system.label(),
                fmt(sample.cps, 0),
                fmt(sample.p50_ms, 2),
                fmt(sample.p99_ms, 2),
                fmt(sample.bulk.gbps, 2),
                fmt(sample.gateway_cpu_ms_per_1k, 1),
                sample.errors + sample.bulk.errors,
                t.elapsed().as_secs_f64()
            );
        Ok(sample)
    })
}

/// The bulk phase alone, every round running each of `JUMBO_SYSTEMS`, the order rotating;
/// returns the samples by system.
fn jumbo_rounds(topology: &Topology, agent: &Path, plan: &Plan) -> Result<Vec<Vec<Bulk>>> {
    rotating(plan.jumbo_rounds, &JUMBO_SYSTEMS, |round, system| {
        let bulk = with_system(topology, agent, system, |_| {
            warm_up(topology, plan)?;
            bulk(topology, plan)
        })
        .with_context(|| format!("jumbo round {}, {}", round + 1, system.label()))?;
        eprintln!(
            "jumbo round {} {:<20} {} Gbit/s  errors {}",
            round + 1,
            system.label(),
            fmt(bulk.gbps, 2),
            bulk.errors
        );
        Ok(bulk)
    })
}

/// Sets `system` up in the gateway, runs `f` with the pid whose CPU counts besides softirq
/// (HAProxy's), and tears it down whatever happened.
fn with_system<T>(
    topology: &Topology,
    agent: &Path,
    system: System,
    f: impl FnOnce(Option<libc::pid_t>) -> Result<T>,
) -> Result<T> {
    let vip = Family::V4.vip();
    let servers: Vec<_> = (0..BACKENDS)
        .map(|i| std::net::SocketAddr::new(Family::V4.backend(i), BACKEND_PORT))
        .collect();
    match system {
        System::Xdp | System::XdpDsr => {
            let dsr = system == System::XdpDsr;
            let mut config = AgentConfig::gateway(topology, [100; BACKENDS]);
            config.pools.retain(|p| p.name == "chat-v4");
            if dsr {
                config.pools[0].forwarding = Some("dsr".into());
            }
            if dsr {
                topology.route_answers(true)?;
            }
            let out = Agent::start(topology, agent, &config).and_then(|running| {
                await_every_server_up(&running)?;
                let out = f(None);
                running.stop()?;
                out
            });
            if dsr {
                // The other systems' answers go back through the gateway, as built.
                topology.route_answers(false)?;
            }
            out
        }
        System::Nft => {
            let _nft = Nft::start(topology.gw(), topology.dir(), vip, &servers, "random")?;
            f(None)
        }
        System::Haproxy => {
            let haproxy = Haproxy::start(
                topology.gw(),
                topology.dir(),
                vip,
                &servers,
                "roundrobin",
                Duration::from_secs(30),
            )?;
            f(Some(haproxy.pid()))
        }
    }
}

/// Waits until the agent has every server UP, weighted and scraped.
fn await_every_server_up(agent: &Agent) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let pool = agent.show("chat-v4")?;
        if pool
            .servers
            .iter()
            .all(|s| s.state == "UP" && s.weight > 0 && s.metrics_age_ms.is_some())
        {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the agent did not see every server UP: {pool:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `loadgen ARGS` in the client namespace; its JSON summary.
fn loadgen(topology: &Topology, args: &[String]) -> Result<Value> {
    let out = topology.client().exec(
        LOADGEN,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    )?;
    serde_json::from_str(out.trim()).with_context(|| format!("loadgen printed {out:?}"))
}

fn ms(d: Duration) -> String {
    d.as_millis().to_string()
}

/// `loadgen`'s arguments for `mode` against the VIP, then `extra`.
fn args(mode: &str, extra: &[String]) -> Vec<String> {
    let mut a = vec![
        mode.to_owned(),
        "--target".to_owned(),
        Family::V4.vip().to_string(),
    ];
    a.extend_from_slice(extra);
    a
}

/// Connections not counted: neighbours, conntrack, HAProxy's first connections.
fn warm_up(topology: &Topology, plan: &Plan) -> Result<()> {
    loadgen(
        topology,
        &args(
            "rate",
            &[
                "--concurrency".into(),
                "4".into(),
                "--duration-ms".into(),
                ms(plan.warmup),
            ],
        ),
    )
    .map(drop)
}

fn measure(topology: &Topology, plan: &Plan, pid: Option<libc::pid_t>) -> Result<Sample> {
    warm_up(topology, plan)?;
    let cpu0 = MachineCpu::now()?;
    let own0 = pid.map(cpu_seconds).transpose()?;
    let rate = loadgen(
        topology,
        &args(
            "rate",
            &[
                "--concurrency".into(),
                plan.concurrency.to_string(),
                "--duration-ms".into(),
                ms(plan.rate_phase),
            ],
        ),
    )?;
    let machine = MachineCpu::now()?.since(cpu0);
    let own = match (pid, own0) {
        (Some(pid), Some(before)) => cpu_seconds(pid)? - before,
        _ => 0.0,
    };
    let connections = rate["ok"].as_f64().unwrap_or(0.0);
    let per_1k = |cpu: f64| (connections > 0.0).then(|| cpu * 1e3 / connections * 1e3);

    let latency = loadgen(
        topology,
        &args(
            "latency",
            &[
                "--rate".into(),
                plan.offered.to_string(),
                "--duration-ms".into(),
                ms(plan.latency_phase),
            ],
        ),
    )?;
    let bulk = bulk(topology, plan)?;
    let us_to_ms = |v: &Value| v.as_f64().map(|us| us / 1e3);
    Ok(Sample {
        cps: rate["per_second"].as_f64().filter(|_| connections > 0.0),
        p50_ms: us_to_ms(&latency["p50_us"]),
        p99_ms: us_to_ms(&latency["p99_us"]),
        gateway_cpu_ms_per_1k: per_1k(machine.softirq + own),
        machine_cpu_ms_per_1k: per_1k(machine.busy),
        bulk,
        errors: errors(&rate) + errors(&latency),
    })
}

/// The bulk phase: `plan.streams` long streams, and the loss on their path.
fn bulk(topology: &Topology, plan: &Plan) -> Result<Bulk> {
    let path0 = PathCounters::read(topology)?;
    let bulk = loadgen(
        topology,
        &args(
            "bulk",
            &[
                "--streams".into(),
                plan.streams.to_string(),
                "--duration-ms".into(),
                ms(plan.bulk_phase),
            ],
        ),
    )?;
    let path = PathCounters::read(topology)?.since(&path0);
    let bytes = bulk["bytes_per_second"].as_f64().filter(|b| *b > 0.0);
    Ok(Bulk {
        gbps: bytes.map(|b| b * 8.0 / 1e9),
        retrans_per_1k: (path.client_in_segs > 0)
            .then(|| path.retrans_segs as f64 * 1e3 / path.client_in_segs as f64),
        link_drops: Some(path.link_drops as f64),
        errors: errors(&bulk),
    })
}

/// The failed requests of one `loadgen` run, their kinds printed if any.
fn errors(summary: &Value) -> u64 {
    let errors = summary["errors"].as_u64().unwrap_or(0);
    if errors != 0 {
        eprintln!("  {} errors: {}", summary["mode"], summary["error_kinds"]);
    }
    errors
}

/// Loss on the bulk streams' path, which the throughput line alone does not show: what the
/// TCP stacks retransmitted (the backends and, for HAProxy, the gateway send the data), what
/// the client received, and what the links dropped on transmit for want of room in the
/// receiving end's ring.
#[derive(Debug, Default)]
struct PathCounters {
    retrans_segs: u64,
    client_in_segs: u64,
    link_drops: u64,
}

impl PathCounters {
    fn read(topology: &Topology) -> Result<Self> {
        let mut out = Self {
            client_in_segs: tcp_counter(topology.client(), "InSegs")?,
            ..Self::default()
        };
        for ns in topology.namespaces() {
            out.retrans_segs += tcp_counter(ns, "RetransSegs")?;
            let drops = ns.exec("sh", &["-c", "cat /sys/class/net/*/statistics/tx_dropped"])?;
            for line in drops.lines() {
                out.link_drops += line
                    .trim()
                    .parse::<u64>()
                    .with_context(|| format!("tx_dropped in {}: {line:?}", ns.name()))?;
            }
        }
        Ok(out)
    }

    /// Saturating: a link deleted between two reads takes its count with it.
    fn since(&self, earlier: &Self) -> Self {
        Self {
            retrans_segs: self.retrans_segs.saturating_sub(earlier.retrans_segs),
            client_in_segs: self.client_in_segs.saturating_sub(earlier.client_in_segs),
            link_drops: self.link_drops.saturating_sub(earlier.link_drops),
        }
    }
}

/// A counter of the `Tcp:` lines of `/proc/net/snmp` in `ns` (a header line of names, then
/// one of values).
fn tcp_counter(ns: &Netns, name: &str) -> Result<u64> {
    let snmp = ns.exec("cat", &["/proc/net/snmp"])?;
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (Some(names), Some(values)) = (tcp.next(), tcp.next()) else {
        anyhow::bail!("no Tcp lines in /proc/net/snmp of {}", ns.name());
    };
    let at = names
        .split_whitespace()
        .position(|n| n == name)
        .with_context(|| format!("no Tcp {name} in /proc/net/snmp of {}", ns.name()))?;
    values
        .split_whitespace()
        .nth(at)
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("bad Tcp {name} in /proc/net/snmp of {}", ns.name()))
}

fn report(plan: &Plan, quick: bool, samples: &[Vec<Sample>], took: Duration) -> Report {
    let figures = [
        Figure {
            key: "cps",
            label: format!(
                "new connections/s, short HTTP, {} concurrent clients",
                plan.concurrency
            ),
            higher_is_better: true,
            decimals: 0,
            get: |s| s.cps,
        },
        Figure {
            key: "p50_ms",
            label: format!("connect-to-first-byte p50 at {} conn/s (ms)", plan.offered),
            higher_is_better: false,
            decimals: 3,
            get: |s| s.p50_ms,
        },
        Figure {
            key: "p99_ms",
            label: format!("connect-to-first-byte p99 at {} conn/s (ms)", plan.offered),
            higher_is_better: false,
            decimals: 3,
            get: |s| s.p99_ms,
        },
        Figure {
            key: "gbps",
            label: format!("bulk throughput, {} long streams (Gbit/s)", plan.streams),
            higher_is_better: true,
            decimals: 2,
            get: |s| s.bulk.gbps,
        },
        Figure {
            key: "gateway_cpu_ms_per_1k",
            label: "gateway CPU per 1000 connections (ms): softirq + HAProxy process".into(),
            higher_is_better: false,
            decimals: 1,
            get: |s| s.gateway_cpu_ms_per_1k,
        },
    ];
    let mut out = Report {
        name: "gateway".into(),
        quick,
        seconds: took.as_secs_f64(),
        ..Default::default()
    };
    let mut md = String::from("## 2. Gateway throughput over namespaces\n\n");
    md += &format!(
        "Client -> gateway -> switch -> four backends (`bench-server`), one namespace each, \
         veth links with tx checksum offload off (needed by XDP on veth, so no TSO for any \
         system) and GRO off (veth's default). The same gateway namespace runs, in turn: **ours** (the agent's XDP program \
         on both gateway interfaces, native mode), **nftables** DNAT in prerouting \
         (`numgen random mod 4`, conntrack reverses it), **HAProxy** {} in TCP mode, \
         `balance roundrobin`, VIP on the gateway's `lo`, default threads; and, for context \
         outside the goal, **ours with direct server return** (`forwarding = \"dsr\"`: the \
         backends hold the VIP and answer the client over a link of the client's own to \
         their switch, so the gateway forwards only the client's packets; not the same path \
         as the others'). {} round(s), order rotating; each figure is the median of the rounds. `loadgen` (tokio) runs in \
         the client namespace; every request is a fresh connection (`GET /`, a few bytes \
         back, the server closes first).\n\n",
        haproxy_version(),
        plan.rounds
    );
    md += &format!(
        "- connections/s: closed loop, {} clients for {:.1} s.\n\
         - latency: open loop, {} new connections/s for {:.1} s; time from the start of \
         `connect` to the first byte of the answer.\n\
         - bulk: {} connections each reading an endless response for {:.1} s.\n\
         - gateway CPU: during the connections/s phase, the machine's softirq time from \
         `/proc/stat` (the XDP program, nftables, conntrack and forwarding all run there), \
         plus HAProxy's user + system time from `/proc/PID/stat` for HAProxy, divided by the \
         connections made. The namespaces share the machine's CPUs, so softirq also holds \
         the client's and backends' own receive processing, the same for every system: the \
         differences are the gateway's. Tick-sampled (250 Hz).\n\
         - loss during the bulk phase (context): TCP segments retransmitted by the client's, \
         the gateway's and the backends' stacks (`RetransSegs`, `/proc/net/snmp`) per \
         thousand the client received (`InSegs`), and packets the topology's links dropped on \
         transmit (`tx_dropped`: a veth drops what it sends when its peer's ring of 256 \
         frames is full; its peer has such a ring when an XDP program is attached to it, as \
         ours is to the gateway's two links and `xdp-pass` to the client's and the switch's \
         links facing the gateway, for every system, and otherwise takes packets into the \
         CPU's backlog of 1000).\n\n",
        plan.concurrency,
        plan.rate_phase.as_secs_f64(),
        plan.offered,
        plan.latency_phase.as_secs_f64(),
        plan.streams,
        plan.bulk_phase.as_secs_f64(),
    );
    md += "| figure | ours (XDP) | nftables | HAProxy | ours vs nftables | ours vs HAProxy | goal: ahead of both | ours, DSR (context) |\n\
           |---|---:|---:|---:|---:|---:|---|---:|\n";
    let med = |s: usize, get: fn(&Sample) -> Option<f64>| {
        median(&samples[s].iter().map(get).collect::<Vec<_>>())
    };
    let mut verdicts = Vec::new();
    for f in &figures {
        let values: Vec<Option<f64>> = (0..SYSTEMS.len()).map(|s| med(s, f.get)).collect();
        let ahead = |theirs| ahead(values[0], theirs, f.higher_is_better);
        let (vs_nft, vs_hap) = (ahead(values[1]), ahead(values[2]));
        let verdict = match (vs_nft, vs_hap) {
            (Some(a), Some(b)) if a > 1.0 && b > 1.0 => "met",
            (Some(_), Some(_)) => "MISSED",
            _ => "-",
        };
        verdicts.push(format!("{}: {verdict}", f.key));
        md += &format!(
            "| {} | {} | {} | {} | {}x | {}x | {verdict} | {} |\n",
            f.label,
            fmt(values[0], f.decimals),
            fmt(values[1], f.decimals),
            fmt(values[2], f.decimals),
            fmt(vs_nft, 2),
            fmt(vs_hap, 2),
            fmt(values[3], f.decimals),
        );
        for (s, v) in SYSTEMS.iter().zip(&values) {
            out.figures.insert(format!("{}.{}", s.key(), f.key), *v);
        }
        out.figures
            .insert(format!("ratio_vs_nft.{}", f.key), vs_nft);
        out.figures
            .insert(format!("ratio_vs_haproxy.{}", f.key), vs_hap);
        out.summary.push(format!(
            "gateway  {:<44} ours {:>9}  nft {:>9}  haproxy {:>9}  ({}x, {}x) {verdict}  dsr {}",
            f.key,
            fmt(values[0], f.decimals),
            fmt(values[1], f.decimals),
            fmt(values[2], f.decimals),
            fmt(vs_nft, 2),
            fmt(vs_hap, 2),
            fmt(values[3], f.decimals)
        ));
    }
    let machine: Vec<Option<f64>> = (0..SYSTEMS.len())
        .map(|s| med(s, |x| x.machine_cpu_ms_per_1k))
        .collect();
    md += &format!(
        "| (context) whole-machine busy CPU per 1000 connections (ms): client, gateway, backends | {} | {} | {} | | | | {} |\n",
        fmt(machine[0], 1),
        fmt(machine[1], 1),
        fmt(machine[2], 1),
        fmt(machine[3], 1)
    );
    for (key, label, decimals, get) in [
        (
            "retrans_per_1k",
            "(context) bulk: TCP segments retransmitted per 1000 the client received (client, gateway, backends)",
            1,
            (|x: &Sample| x.bulk.retrans_per_1k) as fn(&Sample) -> Option<f64>,
        ),
        (
            "link_drops",
            "(context) bulk: packets the links dropped on transmit, the receiving end's ring full",
            0,
            |x: &Sample| x.bulk.link_drops,
        ),
    ] {
        let v: Vec<Option<f64>> = (0..SYSTEMS.len()).map(|s| med(s, get)).collect();
        md += &format!(
            "| {label} | {} | {} | {} | | | | {} |\n",
            fmt(v[0], decimals),
            fmt(v[1], decimals),
            fmt(v[2], decimals),
            fmt(v[3], decimals)
        );
        for (s, value) in SYSTEMS.iter().zip(&v) {
            out.figures.insert(format!("{}.{key}", s.key()), *value);
        }
    }
    let errors: Vec<u64> = samples
        .iter()
        .map(|s| s.iter().map(|x| x.errors + x.bulk.errors).sum())
        .collect();
    md += &format!(
        "| failed requests, all phases and rounds | {} | {} | {} | | | | {} |\n\n",
        errors[0], errors[1], errors[2], errors[3]
    );
    md += "Ratios are \"x ahead\": above 1 ours is better (more connections or bytes, less \
           latency or CPU), below 1 ours is behind.\n\n";
    md += "Per round (connections/s, p99 ms, Gbit/s, gateway CPU ms/1k):\n\n| round | ours | nftables | HAProxy | ours, DSR |\n|---|---|---|---|---|\n";
    for r in 0..plan.rounds {
        let cell = |s: usize| {
            samples[s].get(r).map_or("-".into(), |x| {
                format!(
                    "{} / {} / {} / {}",
                    fmt(x.cps, 0),
                    fmt(x.p99_ms, 2),
                    fmt(x.bulk.gbps, 2),
                    fmt(x.gateway_cpu_ms_per_1k, 1)
                )
            })
        };
        md += &format!(
            "| {} | {} | {} | {} | {} |\n",
            r + 1,
            cell(0),
            cell(1),
            cell(2),
            cell(3)
        );
    }
    md.push('\n');
    out.markdown = md;
    out.summary.push(format!(
        "gateway  goal ahead of both: {}",
        verdicts.join(", ")
    ));
    out
}

/// How far ahead `ours` is of `theirs`, above 1 better for us whichever way the figure
/// goes.
fn ahead(ours: Option<f64>, theirs: Option<f64>, higher_is_better: bool) -> Option<f64> {
    let (ours, theirs) = (ours?, theirs?);
    let r = if higher_is_better {
        ours / theirs
    } else {
        theirs / ours
    };
    r.is_finite().then_some(r)
}

/// The jumbo-frame rounds' table, appended to `out`: context, outside the goal.
fn jumbo_report(plan: &Plan, samples: &[Vec<Bulk>], out: &mut Report) {
    let mut md = format!(
        "### Bulk throughput with jumbo frames (context)\n\n\
         The bulk phase again after those rounds, with MTU {JUMBO_MTU} on every link between \
         the client and the backends (inference clusters often run jumbo frames): {} round(s) of ours (native mode: the \
         program takes frames longer than a page in several buffers), nftables and \
         HAProxy, the order rotating; medians. Outside the goal, which is the table above's.\n\n\
         | figure | ours (XDP) | nftables | HAProxy | ours vs nftables | ours vs HAProxy |\n\
         |---|---:|---:|---:|---:|---:|\n",
        plan.jumbo_rounds
    );
    for (key, label, decimals, higher_is_better, get) in [
        (
            "gbps",
            format!("bulk throughput, {} long streams (Gbit/s)", plan.streams),
            2,
            true,
            (|b: &Bulk| b.gbps) as fn(&Bulk) -> Option<f64>,
        ),
        (
            "retrans_per_1k",
            "TCP segments retransmitted per 1000 the client received".into(),
            1,
            false,
            |b: &Bulk| b.retrans_per_1k,
        ),
        (
            "link_drops",
            "packets the links dropped on transmit".into(),
            0,
            false,
            |b: &Bulk| b.link_drops,
        ),
    ] {
        let v: Vec<Option<f64>> = samples
            .iter()
            .map(|s| median(&s.iter().map(get).collect::<Vec<_>>()))
            .collect();
        let ahead = |theirs| ahead(v[0], theirs, higher_is_better);
        // Only throughput is a ratio worth reading; no loss at all would divide by zero.
        let (vs_nft, vs_hap) = if higher_is_better {
            (fmt(ahead(v[1]), 2) + "x", fmt(ahead(v[2]), 2) + "x")
        } else {
            (String::new(), String::new())
        };
        md += &format!(
            "| {label} | {} | {} | {} | {vs_nft} | {vs_hap} |\n",
            fmt(v[0], decimals),
            fmt(v[1], decimals),
            fmt(v[2], decimals),
        );
        for (system, value) in JUMBO_SYSTEMS.iter().zip(&v) {
            out.figures
                .insert(format!("jumbo.{}.{key}", system.key()), *value);
        }
        if higher_is_better {
            out.summary.push(format!(
                "gateway  jumbo {key:<38} ours {:>9}  nft {:>9}  haproxy {:>9}  ({vs_nft}, {vs_hap}) context",
                fmt(v[0], decimals),
                fmt(v[1], decimals),
                fmt(v[2], decimals),
            ));
        }
    }
    let errors: Vec<u64> = samples
        .iter()
        .map(|s| s.iter().map(|b| b.errors).sum())
        .collect();
    md += &format!(
        "| failed requests | {} | {} | {} | | |\n\n",
        errors[0], errors[1], errors[2]
    );
    out.markdown += &md;
}

fn haproxy_version() -> String {
    std::process::Command::new("haproxy")
        .arg("-v")
        .output()
        .ok()
        .and_then(|o| {
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            let line = text.lines().next()?.to_owned();
            Some(line.split_whitespace().nth(2)?.to_owned())
        })
        .unwrap_or_else(|| "(version unknown)".into())
}
