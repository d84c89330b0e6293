//! Agent cost (issue 8, item 4): the agent's CPU per scrape tick and its memory with 256
//! servers to scrape, at 100 ms and at 1 s intervals, and the kernel memory of its maps with
//! a flow table sized for a million connections.
//!
//! One namespace holds everything: a veth pair for the agent to attach to (nothing flows
//! there), 256 addresses on its loopback interface, and one `bench-server` process listening on
//! every one of them (API port 8000, metrics port 8001) and serving the exposition an idle
//! `inference-sim` publishes in the vLLM dialect (captured at the start). The agent, built
//! with `--release`, scrapes them over loopback: two pools of 128 servers (a pool holds at
//! most 163). Health checks run once at the start and then every 600 s, so that the window
//! measures the scrape loop (scrapes, parsing, policy, map updates).
//!
//! - CPU per tick: the agent's user + system time (`/proc/PID/stat`) over a window after
//!   every server has been scraped, divided by the scrape rounds in the window: the
//!   `/metrics` requests `bench-server` answered in it, over 256. The rounds due in the
//!   window (window / interval) are shown next to them: fewer done than due means the agent
//!   did not keep up. Every server must still be fresh at the end of the window.
//! - Memory: VmRSS and VmHWM of the agent at the end of the window.
//! - Map memory: `memlock` of every BPF map the agent holds (`/proc/PID/fdinfo`), the
//!   kernel's own accounting of the map's memory; the flow table is preallocated, and the
//!   figure is read again after filling it with distinct flows, to show it does not grow.
//! - The walk of that filled table that answers a drain status (`drain --wait` asks for one
//!   at every poll): its time and its entries.
//! - Health checks: the agent's CPU per round of checks of the 256 servers, every second,
//!   over HTTP and over HTTPS (`[pool.tls]`: every check a new connection and a full
//!   handshake, verified), scrapes once a minute; rounds counted by the completions
//!   `bench-server` answered.
//!
//! `cargo bench -p balancer-tests --bench agent_cost [-- --quick]`, as root.

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use aya::maps::{HashMap as BpfHashMap, Map, MapData, MapInfo};
use balancer_agent::dataplane::{live_flows, monotonic_ns};
use balancer_common::{FlowEntry, FlowKey, FAMILY_V4, IPPROTO_TCP};
use balancer_tests::agent::{release_agent_binary, ShownPool};
use balancer_tests::bench::{cpu_seconds, fmt, quick_flag, status_kib, Report};
use balancer_tests::netns::{sweep_stale, temp_dir, Netns};
use balancer_tests::process::{run, Process, STOP_GRACE};
use balancer_tests::sim::client as sim_client;
use balancer_tests::sim::launch::SimServer;
use balancer_tests::sim::tls;

const SIM: &str = env!("CARGO_BIN_EXE_inference-sim");
const BENCH_SERVER: &str = env!("CARGO_BIN_EXE_bench-server");

const SERVERS: usize = 256;
const POOLS: usize = 2;
/// A flow table for a million connections: one entry each, both directions.
const CONNECTIONS: u32 = 1_000_000;
const FLOW_ENTRIES: u32 = CONNECTIONS;
const READY_TIMEOUT: Duration = Duration::from_secs(30);

struct Plan {
    /// (interval, warm-up, window)
    intervals: [(Duration, Duration, Duration); 2],
    /// Health checks every [`HEALTH_INTERVAL`]: (warm-up, window).
    health: (Duration, Duration),
    /// Flow-table entries written before the second map-memory reading.
    fill: u32,
}

/// One interval's figures.
#[derive(Debug, Default)]
struct Cost {
    interval: Duration,
    cpu_ms_per_tick: Option<f64>,
    cpu_percent: Option<f64>,
    /// Scrape rounds done in the window, and due (window / interval).
    ticks: f64,
    due: f64,
    rss_mib: Option<f64>,
    hwm_mib: Option<f64>,
    stale: usize,
}

/// Health checks' figures, over HTTP or HTTPS.
#[derive(Debug)]
struct HealthCost {
    https: bool,
    cpu_ms_per_round: Option<f64>,
    /// Rounds of checks done in the window, and due (window / interval).
    rounds: f64,
    due: f64,
    /// Servers not UP at the end of the window.
    down: usize,
}

/// How often the health phases check every server.
const HEALTH_INTERVAL: Duration = Duration::from_secs(1);
/// The name the servers' certificate carries (`server_name`).
const TLS_NAME: &str = "bench.internal";
const TLS_PORT: u16 = 8443;

/// What one run measured.
struct Measured {
    costs: Vec<Cost>,
    health: Vec<HealthCost>,
    maps: Vec<MapMem>,
    filled: Vec<MapMem>,
    /// The drain-status walk of the filled flow table.
    walk: Option<Walk>,
}

/// The walk of the filled flow table that answers a drain status.
#[derive(Debug, Clone, Copy)]
struct Walk {
    entries: u64,
    /// As the agent walks it ([`live_flows`], batched).
    batched: Duration,
    /// Entry by entry, as aya's iterator walks it: two system calls an entry.
    per_entry: Duration,
}

/// One BPF map of the agent's.
#[derive(Debug, Clone)]
struct MapMem {
    id: u32,
    name: String,
    max_entries: u64,
    memlock: u64,
}

fn main() -> Result<()> {
    let quick = quick_flag("agent_cost")?;
    let plan = if quick {
        Plan {
            intervals: [
                (
                    Duration::from_millis(100),
                    Duration::from_secs(1),
                    Duration::from_secs(3),
                ),
                (
                    Duration::from_secs(1),
                    Duration::from_secs(1),
                    Duration::from_secs(4),
                ),
            ],
            fill: 100_000,
            health: (Duration::from_secs(1), Duration::from_secs(3)),
        }
    } else {
        Plan {
            intervals: [
                // 150 rounds at 100 ms, 20 at 1 s, 10 of health checks.
                (
                    Duration::from_millis(100),
                    Duration::from_secs(3),
                    Duration::from_secs(15),
                ),
                (
                    Duration::from_secs(1),
                    Duration::from_secs(3),
                    Duration::from_secs(20),
                ),
            ],
            fill: FLOW_ENTRIES,
            health: (Duration::from_secs(3), Duration::from_secs(10)),
        }
    };
    balancer_tests::require_root()?;
    let started = Instant::now();
    let agent = release_agent_binary()?;
    sweep_stale()?;
    let dir = temp_dir()?;
    let mut ns = Netns::create("agentcost")?;
    let result = measure(&mut ns, dir.path(), &agent, &plan);
    drop(ns);
    report(quick, &plan, &result?, started.elapsed()).write()
}

/// Server `i`'s address: 10.5.0.1-128 for the first pool, 10.5.1.1-128 for the second.
fn address(i: usize) -> Ipv4Addr {
    let per_pool = SERVERS / POOLS;
    Ipv4Addr::new(10, 5, (i / per_pool) as u8, (i % per_pool + 1) as u8)
}

fn measure(ns: &mut Netns, dir: &Path, agent: &Path, plan: &Plan) -> Result<Measured> {
    ns.ip(&["link", "add", "a0", "type", "veth", "peer", "name", "a1"])?;
    let batch: String = (0..SERVERS)
        .map(|i| format!("addr add {}/32 dev lo\n", address(i)))
        .collect();
    let batch_file = dir.join("addresses.batch");
    std::fs::write(&batch_file, batch)?;
    run(std::process::Command::new("ip")
        .args(["-n", ns.name(), "-batch"])
        .arg(&batch_file))?;
    for dev in ["a0", "a1"] {
        ns.ip(&["link", "set", dev, "up"])?;
    }

    // The exposition an idle simulator publishes, vLLM dialect.
    let metrics_file = dir.join("vllm-metrics.txt");
    {
        let mut cmd = ns.command(SIM);
        cmd.args([
            "--listen",
            "127.0.0.1:0",
            "--metrics-port",
            "0",
            "--dialect",
            "vllm",
        ]);
        let sim = SimServer::spawn("inference-sim", cmd, &dir.join("sim.log"))?;
        let text = ns.enter(|| sim.scrape())?;
        std::fs::write(&metrics_file, text)?;
    }

    let pki = tls::Pki::new(&dir.join("pki"))?;
    let (cert, key) = pki.issue("bench", &[TLS_NAME])?;
    let mut cmd = ns.command(BENCH_SERVER);
    for i in 0..SERVERS {
        for port in [8000, 8001] {
            cmd.arg("--listen")
                .arg(SocketAddr::new(address(i).into(), port).to_string());
        }
        cmd.arg("--tls-listen")
            .arg(SocketAddr::new(address(i).into(), TLS_PORT).to_string());
    }
    cmd.args(["--name", "bench", "--metrics-file"])
        .arg(&metrics_file)
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key);
    ns.spawn("bench-server", cmd, &dir.join("bench-server.log"))?
        .wait_for_line(0, READY_TIMEOUT, |l| l.contains("listening on"))?;

    let mut costs = Vec::new();
    let mut maps = Vec::new();
    let mut filled = Vec::new();
    let mut walk = None;
    for (k, &(interval, warmup, window)) in plan.intervals.iter().enumerate() {
        let socket = dir.join(format!("agent-{k}.sock"));
        let config = dir.join(format!("agent-{k}.toml"));
        std::fs::write(
            &config,
            config_text(&socket, interval, Duration::from_secs(600), None),
        )?;
        let mut cmd = ns.command(agent);
        cmd.args(["run", "--config"]).arg(&config);
        let log = dir.join(format!("agent-{k}.log"));
        let mut process = Process::spawn("balancer-agent", cmd, &log)?;
        let outcome = (|| -> Result<()> {
            process.wait_for_line(0, READY_TIMEOUT, |l| {
                l.split(|c: char| !c.is_ascii_alphanumeric())
                    .any(|w| w == "ready")
            })?;
            let pid = process.pid();
            wait_all_fresh(agent, &socket, interval)?;
            sleep(warmup);
            let scrapes0 = scrapes(ns)?;
            let cpu0 = cpu_seconds(pid)?;
            let t0 = Instant::now();
            sleep(window);
            let cpu = cpu_seconds(pid)? - cpu0;
            let wall = t0.elapsed();
            let scraped = scrapes(ns)? - scrapes0;
            let (rss, hwm) = (status_kib(pid, "VmRSS")?, status_kib(pid, "VmHWM")?);
            let stale = stale_servers(agent, &socket, interval)?;
            let due = wall.as_secs_f64() / interval.as_secs_f64();
            let ticks = scraped as f64 / SERVERS as f64;
            costs.push(Cost {
                interval,
                cpu_ms_per_tick: (ticks > 0.0).then(|| cpu * 1e3 / ticks),
                cpu_percent: Some(cpu / wall.as_secs_f64() * 100.0),
                ticks,
                due,
                rss_mib: Some(rss as f64 / 1024.0),
                hwm_mib: Some(hwm as f64 / 1024.0),
                stale,
            });
            eprintln!(
                "interval {interval:?}: {:.2} ms CPU per tick ({:.1}% of a core) over {ticks:.1} rounds ({due:.1} due), RSS {:.1} MiB, {stale} stale",
                cpu * 1e3 / ticks,
                cpu / wall.as_secs_f64() * 100.0,
                rss as f64 / 1024.0
            );
            if k == 0 {
                maps = map_memory(pid)?;
                let flows = maps
                    .iter()
                    .find(|m| m.max_entries == u64::from(FLOW_ENTRIES))
                    .context("no map with the flow table's size")?;
                let t = Instant::now();
                fill_flows(flows.id, plan.fill)?;
                eprintln!(
                    "filled {} flow-table entries in {:.1} s",
                    plan.fill,
                    t.elapsed().as_secs_f64()
                );
                filled = map_memory(pid)?;
                walk = Some(drain_walk(flows.id, plan.fill)?);
            }
            Ok(())
        })();
        if outcome.is_err() {
            eprintln!("agent log:\n{}", process.output());
        }
        let status = process.stop(STOP_GRACE)?;
        outcome?;
        ensure!(status.success(), "the agent exited with {status}");
    }
    let mut health = Vec::new();
    for https in [false, true] {
        let name = if https { "https" } else { "http" };
        let socket = dir.join(format!("agent-health-{name}.sock"));
        let config = dir.join(format!("agent-health-{name}.toml"));
        let ca = https.then(|| pki.ca_file());
        std::fs::write(
            &config,
            config_text(&socket, SCRAPE_ONCE, HEALTH_INTERVAL, ca.as_deref()),
        )?;
        let mut cmd = ns.command(agent);
        cmd.args(["run", "--config"]).arg(&config);
        let log = dir.join(format!("agent-health-{name}.log"));
        let mut process = Process::spawn("balancer-agent", cmd, &log)?;
        let (warmup, window) = plan.health;
        let outcome = (|| -> Result<HealthCost> {
            process.wait_for_line(0, READY_TIMEOUT, |l| l.contains("ready to take traffic"))?;
            let pid = process.pid();
            sleep(warmup);
            let checks0 = stats(ns, "completions")?;
            let cpu0 = cpu_seconds(pid)?;
            let t0 = Instant::now();
            sleep(window);
            let cpu = cpu_seconds(pid)? - cpu0;
            let wall = t0.elapsed();
            let rounds = (stats(ns, "completions")? - checks0) as f64 / SERVERS as f64;
            let mut down = 0;
            for p in 0..POOLS {
                let pool = show(agent, &socket, &format!("p{p}"))?;
                down += pool.servers.iter().filter(|s| s.state != "UP").count();
            }
            let due = wall.as_secs_f64() / HEALTH_INTERVAL.as_secs_f64();
            let cpu_ms_per_round = (rounds > 0.0).then(|| cpu * 1e3 / rounds);
            eprintln!(
                "health checks over {}: {} ms CPU per round of {SERVERS} over {rounds:.1} rounds ({due:.1} due), {down} not UP",
                name.to_uppercase(),
                fmt(cpu_ms_per_round, 1),
            );
            Ok(HealthCost {
                https,
                cpu_ms_per_round,
                rounds,
                due,
                down,
            })
        })();
        if outcome.is_err() {
            eprintln!("agent log:\n{}", process.output());
        }
        let status = process.stop(STOP_GRACE)?;
        health.push(outcome?);
        ensure!(status.success(), "the agent exited with {status}");
    }
    Ok(Measured {
        costs,
        health,
        maps,
        filled,
        walk,
    })
}

/// Times what a drain status costs the agent: the walk of the whole flow table that counts
/// one server's open connections ([`live_flows`]), here backend 1's, which every entry
/// written names; and, for comparison, a walk entry by entry with aya's iterator.
fn drain_walk(flows_id: u32, written: u32) -> Result<Walk> {
    let t = Instant::now();
    live_flows(flows_id, &HashSet::from([1]), None)?;
    let batched = t.elapsed();
    let t = Instant::now();
    let mut entries = 0;
    for item in flow_table(flows_id)?.iter() {
        entries += u64::from(item.is_ok());
    }
    let per_entry = t.elapsed();
    // An LRU table may evict a few entries before it is full.
    ensure!(
        entries >= u64::from(written) * 99 / 100,
        "the walk found {entries} of the {written} entries written"
    );
    eprintln!(
        "drain-status walk of {entries} entries: {:.0} ms batched, {:.0} ms entry by entry",
        batched.as_secs_f64() * 1e3,
        per_entry.as_secs_f64() * 1e3
    );
    Ok(Walk {
        entries,
        batched,
        per_entry,
    })
}

/// The `/metrics` requests `bench-server` has answered so far.
fn scrapes(ns: &Netns) -> Result<u64> {
    stats(ns, "metrics_requests")
}

/// The count `key` (`metrics_requests`, `completions`) of `bench-server`'s `/stats`.
fn stats(ns: &Netns, key: &str) -> Result<u64> {
    let addr = SocketAddr::new(address(0).into(), 8001);
    let reply = ns.enter(|| sim_client::get(addr, "/stats"))?;
    reply.json()?[key]
        .as_u64()
        .with_context(|| format!("bench-server /stats: {}", reply.body))
}

/// The scrape interval of the health phases: one round at the start, none in the window.
const SCRAPE_ONCE: Duration = Duration::from_secs(60);

/// Scrapes every `interval`, health checks every `health`: over HTTPS on [`TLS_PORT`] with
/// `ca`, else over HTTP.
fn config_text(socket: &Path, interval: Duration, health: Duration, ca: Option<&Path>) -> String {
    let mut text = format!(
        "[agent]\ninterfaces = [\"a0\"]\ncontrol_socket = \"{}\"\nflow_table_entries = {FLOW_ENTRIES}\n\
         scrape_interval_ms = {}\nhealth_interval_ms = {}\n",
        socket.display(),
        interval.as_millis(),
        health.as_millis()
    );
    let per_pool = SERVERS / POOLS;
    let port = if ca.is_some() { TLS_PORT } else { 8000 };
    for p in 0..POOLS {
        text += &format!(
            "\n[[pool]]\nname = \"p{p}\"\nvip = \"192.0.2.{}\"\nport = 8000\ndialect = \"vllm\"\nmodel = \"bench-model\"\n",
            60 + p
        );
        if let Some(ca) = ca {
            text += &format!(
                "[pool.tls]\nca_file = \"{}\"\nserver_name = \"{TLS_NAME}\"\n",
                ca.display()
            );
        }
        for i in p * per_pool..(p + 1) * per_pool {
            text += &format!(
                "[[pool.server]]\naddress = \"{}\"\nport = {port}\nmetrics_port = 8001\n",
                address(i)
            );
        }
    }
    text
}

fn show(agent: &Path, socket: &Path, pool: &str) -> Result<ShownPool> {
    let text = run(std::process::Command::new(agent)
        .args(["show", "pool", pool, "--json", "--socket"])
        .arg(socket))?;
    serde_json::from_str(&text).with_context(|| format!("show --json printed {text:?}"))
}

/// Servers whose metrics are older than three intervals, or who failed their last scrape.
fn stale_servers(agent: &Path, socket: &Path, interval: Duration) -> Result<usize> {
    let limit = 3 * interval.as_millis() as u64;
    let mut stale = 0;
    for p in 0..POOLS {
        let pool = show(agent, socket, &format!("p{p}"))?;
        ensure!(
            pool.servers.len() == SERVERS / POOLS,
            "pool p{p} shows {} servers",
            pool.servers.len()
        );
        stale += pool
            .servers
            .iter()
            .filter(|s| s.scrape_error.is_some() || s.metrics_age_ms.is_none_or(|a| a > limit))
            .count();
    }
    Ok(stale)
}

fn wait_all_fresh(agent: &Path, socket: &Path, interval: Duration) -> Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let stale = stale_servers(agent, socket, interval)?;
        if stale == 0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("{stale} of {SERVERS} servers not scraped within {READY_TIMEOUT:?}");
        }
        sleep(Duration::from_millis(100));
    }
}

/// Every BPF map `pid` holds a descriptor of, from `/proc/PID/fdinfo`.
fn map_memory(pid: libc::pid_t) -> Result<Vec<MapMem>> {
    let mut maps: Vec<MapMem> = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))? {
        let Ok(text) = std::fs::read_to_string(entry?.path()) else {
            continue;
        };
        let field = |name: &str| -> Option<u64> {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|v| v.trim().parse().ok())
        };
        let (Some(id), Some(max_entries), Some(memlock)) =
            (field("map_id"), field("max_entries"), field("memlock"))
        else {
            continue;
        };
        let id = u32::try_from(id)?;
        if maps.iter().any(|m| m.id == id) {
            continue;
        }
        let name = MapInfo::from_id(id)
            .ok()
            .and_then(|info| info.name_as_str().map(str::to_owned))
            .unwrap_or_else(|| format!("id {id}"));
        maps.push(MapMem {
            id,
            name,
            max_entries,
            memlock,
        });
    }
    ensure!(!maps.is_empty(), "the agent holds no BPF map");
    maps.sort_by_key(|m| std::cmp::Reverse(m.memlock));
    Ok(maps)
}

/// The flow table with map id `id`, through aya.
fn flow_table(id: u32) -> Result<BpfHashMap<MapData, FlowKey, FlowEntry>> {
    let data = MapData::from_id(id).context("opening the flow table")?;
    BpfHashMap::try_from(Map::LruHashMap(data)).context("the flow table as a hash map")
}

/// Writes `n` distinct IPv4 flows into the flow table with map id `id`.
fn fill_flows(id: u32, n: u32) -> Result<()> {
    let mut table = flow_table(id)?;
    for i in 0..n {
        let key = FlowKey {
            src: [
                u32::from_ne_bytes([172, 16 + (i >> 24) as u8, (i >> 16) as u8, (i >> 8) as u8]),
                0,
                0,
                0,
            ],
            dst: [u32::from_ne_bytes([192, 0, 2, 60]), 0, 0, 0],
            sport: (i as u16).to_be(),
            dport: 8000u16.to_be(),
            proto: IPPROTO_TCP,
            family: FAMILY_V4,
            _pad: [0; 2],
        };
        // Open connections, heard from now: the agent's sweep deletes only ended and
        // unanswered ones (and the drain status counts only open ones).
        let entry = FlowEntry {
            nat_addr: [u32::from_ne_bytes([10, 5, 0, 1]), 0, 0, 0],
            nat_port: 8000u16.to_be(),
            backend_id: 1,
            idle_timeout_s: 600,
            acked: 1,
            last_seen_ns: monotonic_ns(),
            ..Default::default()
        };
        table
            .insert(key, entry, 0)
            .context("filling the flow table")?;
    }
    Ok(())
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn report(quick: bool, plan: &Plan, measured: &Measured, took: Duration) -> Report {
    let Measured {
        costs,
        health,
        maps,
        filled,
        walk,
    } = measured;
    let mut out = Report {
        name: "agent-cost".into(),
        quick,
        seconds: took.as_secs_f64(),
        ..Default::default()
    };
    let mut md = String::from("## 4. Agent cost\n\n");
    md += &format!(
        "The agent (release build) scraping {SERVERS} servers, two pools of {}, over loopback \
         in one namespace: one `bench-server` process listens on 256 addresses and serves the \
         vLLM-dialect exposition of an idle `inference-sim` (about 9 KB, 84 samples) on each. \
         Health checks once at the start, then every 600 s, so that the window measures the \
         scrape loop. CPU: the agent's user + system time from `/proc/PID/stat` over the \
         window, divided by the scrape rounds done in it (the `/metrics` requests \
         `bench-server` answered, over 256; fewer than due means the agent fell behind); every server fresh (scraped within three \
         intervals, no error) at the end of the window. Memory: VmRSS and VmHWM from \
         `/proc/PID/status` (BPF maps are kernel memory, not in RSS).\n\n",
        SERVERS / POOLS
    );
    md += "| scrape interval | scrape rounds in the window: done / due | CPU per round (ms) | CPU (% of one core) | RSS (MiB) | peak RSS (MiB) | stale servers at the end |\n\
           |---|---:|---:|---:|---:|---:|---:|\n";
    for c in costs {
        let key = format!("interval_{}ms", c.interval.as_millis());
        md += &format!(
            "| {} ms | {:.1} / {:.1} | {} | {} | {} | {} | {} |\n",
            c.interval.as_millis(),
            c.ticks,
            c.due,
            fmt(c.cpu_ms_per_tick, 2),
            fmt(c.cpu_percent, 1),
            fmt(c.rss_mib, 1),
            fmt(c.hwm_mib, 1),
            c.stale
        );
        out.figures
            .insert(format!("{key}.cpu_ms_per_tick"), c.cpu_ms_per_tick);
        out.figures
            .insert(format!("{key}.cpu_percent"), c.cpu_percent);
        out.figures
            .insert(format!("{key}.rounds_done"), Some(c.ticks));
        out.figures.insert(format!("{key}.rounds_due"), Some(c.due));
        out.figures.insert(format!("{key}.rss_mib"), c.rss_mib);
        out.figures
            .insert(format!("{key}.stale"), Some(c.stale as f64));
        out.summary.push(format!(
            "agent    {SERVERS} servers every {:>4} ms: {:>6} ms CPU per tick ({:>5}% of a core), {:.1}/{:.1} rounds done/due, RSS {} MiB, {} stale",
            c.interval.as_millis(),
            fmt(c.cpu_ms_per_tick, 2),
            fmt(c.cpu_percent, 1),
            c.ticks,
            c.due,
            fmt(c.rss_mib, 1),
            c.stale
        ));
    }
    md += &format!(
        "\nHealth checks: the same servers checked every {} ms (a one-token completion each, \
         all at once), scraped once a minute, over HTTP and then over HTTPS (`[pool.tls]`, \
         TLS 1.3, the servers' one ECDSA P-256 certificate for `server_name`, verified: every \
         check opens a new connection and makes a full handshake). CPU as above, over the \
         check rounds done in the window (the completions `bench-server` answered, over \
         {SERVERS}).\n\n| checks over | rounds in the window: done / due | CPU per round (ms) | \
         CPU per check (us) | servers not UP at the end |\n|---|---:|---:|---:|---:|\n",
        HEALTH_INTERVAL.as_millis()
    );
    for h in health {
        let (label, key) = if h.https {
            ("HTTPS", "health_https")
        } else {
            ("HTTP", "health_http")
        };
        let per_check = h.cpu_ms_per_round.map(|ms| ms * 1e3 / SERVERS as f64);
        md += &format!(
            "| {label} | {:.1} / {:.1} | {} | {} | {} |\n",
            h.rounds,
            h.due,
            fmt(h.cpu_ms_per_round, 1),
            fmt(per_check, 0),
            h.down
        );
        out.figures
            .insert(format!("{key}.cpu_ms_per_round"), h.cpu_ms_per_round);
        out.figures
            .insert(format!("{key}.rounds_done"), Some(h.rounds));
        out.figures
            .insert(format!("{key}.down"), Some(h.down as f64));
        out.summary.push(format!(
            "agent    health checks of {SERVERS} servers over {label:<5}: {:>6} ms CPU per round ({} us per check), {:.1}/{:.1} rounds done/due, {} not UP",
            fmt(h.cpu_ms_per_round, 1),
            fmt(per_check, 0),
            h.rounds,
            h.due,
            h.down
        ));
    }
    let flows = maps
        .iter()
        .find(|m| m.max_entries == u64::from(FLOW_ENTRIES));
    let flows_after = filled
        .iter()
        .find(|m| m.max_entries == u64::from(FLOW_ENTRIES));
    let total: u64 = maps.iter().map(|m| m.memlock).sum();
    md += &format!(
        "\nMap memory, `memlock` from `/proc/PID/fdinfo` (the kernel's accounting of each \
         map), with `flow_table_entries = {FLOW_ENTRIES}`: a million connections, one entry each \
         (replies find it through `REPLIES`). The flow table is an LRU hash, preallocated: it takes \
         its memory at load, and the figure is read again after writing {} distinct \
         entries.\n\n| map | max entries | memlock (MiB) |\n|---|---:|---:|\n",
        plan.fill
    );
    for m in maps {
        md += &format!(
            "| {} | {} | {:.1} |\n",
            m.name,
            m.max_entries,
            mib(m.memlock)
        );
    }
    md += &format!("| all maps | | {:.1} |\n\n", mib(total));
    let flows_mib = flows.map(|f| mib(f.memlock));
    let after_mib = flows_after.map(|f| mib(f.memlock));
    let per_connection = flows.map(|f| f.memlock as f64 / f64::from(CONNECTIONS));
    md += &format!(
        "Flow table for a million connections: {} MiB ({} MiB after writing {} entries), {} \
         bytes per connection (one entry); all maps: {:.1} MiB.\n\n",
        fmt(flows_mib, 1),
        fmt(after_mib, 1),
        plan.fill,
        fmt(per_connection, 0),
        mib(total)
    );
    out.figures.insert("flow_table_mib".into(), flows_mib);
    out.figures
        .insert("flow_table_mib_filled".into(), after_mib);
    out.figures
        .insert("bytes_per_connection".into(), per_connection);
    out.figures.insert("all_maps_mib".into(), Some(mib(total)));
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let walk_ms = walk.map(|w| ms(w.batched));
    let per_entry_ms = walk.map(|w| ms(w.per_entry));
    md += &format!(
        "A drain status (`drain --wait` asks for one at every poll) counts the server's open \
         connections by walking the whole flow table, in batches of thousands of entries a \
         system call (`BPF_MAP_LOOKUP_BATCH`): {} ms for the {} entries found; entry by entry, \
         as aya's iterator walks a map (two system calls an entry), {} ms.\n\n",
        fmt(walk_ms, 0),
        walk.map_or(0, |w| w.entries),
        fmt(per_entry_ms, 0)
    );
    out.figures.insert("drain_walk_ms".into(), walk_ms);
    out.figures
        .insert("drain_walk_per_entry_ms".into(), per_entry_ms);
    out.summary.push(format!(
        "agent    drain-status walk of {} flow-table entries: {} ms batched, {} ms entry by entry",
        walk.map_or(0, |w| w.entries),
        fmt(walk_ms, 0),
        fmt(per_entry_ms, 0)
    ));
    out.summary.push(format!(
        "agent    maps: flow table for 1M connections {} MiB ({} bytes/connection), all maps {:.1} MiB",
        fmt(flows_mib, 1),
        fmt(per_connection, 0),
        mib(total)
    ));
    out.markdown = md;
    out
}
