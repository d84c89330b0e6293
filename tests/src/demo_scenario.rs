//! The worked example of the design brief, live: the topology, four inference servers, the
//! agent, a workload whose preamble overloads its home so that the agent spills it, one
//! completion streamed with curl, 10.4.0.14 drained until it leaves the pool, and the agent
//! stopped and started again mid-workload, its program staying attached (`agent.pin_dir`).

use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use balancer_common::hint::HintRange;
use balancer_tests::netns;
use balancer_tests::process::Process;
use balancer_tests::topology::{Topology, BACKENDS, GATEWAY_INTERFACES, VIP4, VIP_PORT};

use crate::out::{self, Out, Style};
use crate::workload::{self, Stop, Tally, Workload};

pub const POOL: &str = "chat-pool";
/// 10.4.0.14: the server the operator drains.
const DRAINED: usize = 3;
/// 10.4.0.12: the home the demo picks its preamble for, as in the brief.
const WANTED_HOME: usize = 1;

/// The size of the workload, for the simulators or for llama-server (four of them share
/// two CPU cores here, one thread each).
struct Shape {
    /// Batch slots of every server (`--max-running`, llama-server's `-np`), and the pool's
    /// `slots`: a bucket's home takes this many hinted connections at once, then spills.
    slots: u32,
    /// Clients that send the preamble with its hint: more than the home's slots.
    hinted_clients: u32,
    /// Clients with prompts of their own, from ordinary source ports.
    other_clients: u32,
    /// Users with the preamble who all arrive at once, each with one request.
    burst: u32,
    /// Shortest and longest answer to a request with the preamble.
    hinted_tokens: (u32, u32),
    /// Answer to the other requests.
    other_tokens: u32,
}

const SIM_SHAPE: Shape = Shape {
    slots: 8,
    hinted_clients: 10,
    other_clients: 3,
    burst: 12,
    hinted_tokens: (120, 250),
    other_tokens: 150,
};

const REAL_SHAPE: Shape = Shape {
    slots: 4,
    hinted_clients: 6,
    other_clients: 2,
    burst: 4,
    hinted_tokens: (16, 48),
    other_tokens: 32,
};

impl Options {
    fn shape(&self) -> &'static Shape {
        if self.real.is_some() {
            &REAL_SHAPE
        } else {
            &SIM_SHAPE
        }
    }
}
/// The simulators' prefill speed: a cold 2,000-token preamble costs 125 ms.
const PREFILL_TOKENS_PER_S: u32 = 16_000;
const KV_TOKENS: u32 = 16_384;
const SIM_MODEL: &str = "sim-model";
const REAL_MODEL: &str = "smollm2-135m";
const METRICS_PORT: u16 = 8001;
/// Where `--keep` records a demo that runs on, for `--clean`.
pub const STATE_DIR: &str = "/run/balancer-demo";
/// A kept demo ends by itself after this long.
const KEEP_LIMIT: Duration = Duration::from_secs(24 * 3600);

/// llama-server instead of the simulators.
pub struct Real {
    pub llama_server: PathBuf,
    pub model: PathBuf,
}

pub struct Options {
    /// Shorter, for the test.
    pub ci: bool,
    pub keep: bool,
    /// The demo's length from the start of the workload; the mode's default when None.
    pub duration: Option<Duration>,
    pub agent: PathBuf,
    pub sim: PathBuf,
    pub xdp_pass: PathBuf,
    pub real: Option<Real>,
}

/// When things happen, in seconds after the first table (the agent has scraped by then).
struct Timeline {
    /// Streams opened first, to have something running on 10.4.0.14 when it is drained.
    long_tokens: u32,
    drain_at: f64,
    workload_at: f64,
    /// Between two clients' first requests.
    stagger: f64,
    curl_at: f64,
    burst_at: f64,
    /// The agent is stopped and started again, as for an upgrade (once the drained server
    /// has left, so that nothing waits on the agent then).
    restart_at: f64,
    table_every: f64,
    end_at: f64,
}

impl Timeline {
    fn new(options: &Options) -> Self {
        let mut t = if options.ci {
            Timeline {
                long_tokens: 400,
                drain_at: 1.0,
                workload_at: 2.0,
                stagger: 0.3,
                curl_at: 9.0,
                burst_at: 13.0,
                restart_at: 17.0,
                table_every: 4.0,
                end_at: 24.0,
            }
        } else {
            Timeline {
                long_tokens: 650,
                drain_at: 2.0,
                workload_at: 3.0,
                stagger: 0.6,
                curl_at: 18.0,
                burst_at: 32.0,
                restart_at: 42.0,
                table_every: 5.0,
                end_at: 55.0,
            }
        };
        if options.real.is_some() {
            // One CPU thread per server, a few servers per core: everything takes longer.
            t.long_tokens = 200;
            t.end_at += 20.0;
        }
        if let Some(d) = options.duration {
            t.end_at = d.as_secs_f64().max(t.burst_at + 6.0);
        }
        t.restart_at = t.restart_at.min(t.end_at - 5.0);
        t
    }
}

fn server_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 4, 0, 11 + u8::try_from(i).expect("four servers"))
}

fn server_addr(i: usize) -> SocketAddr {
    SocketAddr::new(server_ip(i).into(), 8000)
}

fn vip() -> SocketAddr {
    SocketAddr::new(VIP4.into(), VIP_PORT)
}

/// The agent's configuration with the servers `servers` (indices).
fn agent_toml(socket: &Path, pins: &Path, servers: &[usize], real: bool, slots: u32) -> String {
    let mut text = format!(
        "[agent]\n\
         interfaces = [{}]\n\
         control_socket = \"{}\"\n\
         pin_dir = \"{}\"\n\
         scrape_interval_ms = 2000\n\
         {}\
         \n\
         [[pool]]\n\
         name = \"{POOL}\"\n\
         vip = \"{VIP4}\"\n\
         port = {VIP_PORT}\n\
         spill_ttft_ms = 500\n\
         spill_waiting = 1\n\
         slots = {slots}\n",
        GATEWAY_INTERFACES.map(|i| format!("\"{i}\"")).join(", "),
        socket.display(),
        pins.display(),
        // A one-token check waits behind the prefills of a busy CPU server.
        if real {
            "health_timeout_ms = 10000\n"
        } else {
            ""
        },
    );
    if real {
        text.push_str(&format!("model = \"{REAL_MODEL}\"\n"));
    }
    // llama-server publishes its metrics on its API port.
    let metrics_port = if real { 8000 } else { METRICS_PORT };
    for &i in servers {
        text.push_str(&format!(
            "\n[[pool.server]]\naddress = \"{}\"\nport = 8000\nmetrics_port = {metrics_port}\n",
            server_ip(i)
        ));
    }
    text
}

/// Writes the file whole or not at all, so that the agent never reads half of it.
fn write_whole(path: &Path, text: &str) -> Result<()> {
    let partial = path.with_extension("partial");
    fs::write(&partial, text).with_context(|| format!("writing {}", partial.display()))?;
    fs::rename(&partial, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// A child of ours outside the namespaces (the CLI waiting for a drain): killed and reaped
/// when dropped.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// Runs `cmd` to completion and returns its stdout, or its stderr as the error.
fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{}",
            String::from_utf8_lossy(&out.stderr)
                .trim()
                .strip_prefix("error: ")
                .unwrap_or(String::from_utf8_lossy(&out.stderr).trim())
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

struct Agent {
    process: Process,
    binary: PathBuf,
    config: PathBuf,
    socket: PathBuf,
    /// `agent.pin_dir`.
    pins: PathBuf,
    log: PathBuf,
    /// The gateway namespace's command for the agent, to start it again.
    command: Command,
}

fn ready(line: &str) -> bool {
    line.contains(" ready ") || line.trim_end().ends_with(" ready")
}

impl Agent {
    fn start(topology: &Topology, binary: &Path, pins: &Path, text: &str) -> Result<Self> {
        let dir = topology.dir();
        let config = dir.join("agent.toml");
        write_whole(&config, text)?;
        let log = dir.join("agent.log");
        let command = || {
            let mut cmd = topology.gw().command(binary);
            cmd.args(["run", "--config"]).arg(&config);
            cmd
        };
        let mut process = Process::spawn("balancer-agent", command(), &log)?;
        process.wait_for_line(0, Duration::from_secs(30), ready)?;
        Ok(Self {
            process,
            binary: binary.to_owned(),
            command: command(),
            config,
            socket: dir.join("agent.sock"),
            pins: pins.to_owned(),
            log,
        })
    }

    /// Stops the agent (SIGTERM), which leaves the program attached to its pinned maps, and
    /// returns when it has exited.
    fn stop(&mut self) -> Result<()> {
        let status = self.process.stop(Duration::from_secs(10))?;
        if !status.success() {
            bail!("the agent exited with {status}");
        }
        Ok(())
    }

    /// Starts the agent again on the same configuration, its log added to the same file;
    /// returns once it is ready.
    fn start_again(&mut self) -> Result<()> {
        let mut cmd = Command::new(self.command.get_program());
        cmd.args(self.command.get_args());
        let mark = self.process.output_len();
        self.process = Process::spawn_appending("balancer-agent", cmd, &self.log)?;
        self.process
            .wait_for_line(mark, Duration::from_secs(30), ready)?;
        Ok(())
    }

    /// `balancer-agent ARGS --socket SOCKET`.
    fn cli(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.args(args).arg("--socket").arg(&self.socket);
        cmd
    }

    fn reload(&mut self, text: &str) -> Result<()> {
        write_whole(&self.config, text)?;
        let mark = self.process.output_len();
        self.process.signal(libc::SIGHUP)?;
        let line = self
            .process
            .wait_for_line(mark, Duration::from_secs(30), |line| {
                line.contains("config reloaded") || line.contains("reload failed")
            })?;
        if !line.contains("config reloaded") {
            bail!("the agent refused the new configuration: {line}");
        }
        Ok(())
    }
}

/// Starts the servers: simulators, or llama-server with `--real`.
fn start_servers(topology: &Topology, options: &Options) -> Result<Vec<Process>> {
    let mut servers = Vec::new();
    for i in 0..BACKENDS {
        if out::stop_requested() {
            bail!("stopped");
        }
        let ip = server_ip(i);
        let log = topology.dir().join(format!("server-{ip}.log"));
        let mut cmd;
        match &options.real {
            None => {
                cmd = topology.backend(i).command(&options.sim);
                cmd.arg("--listen")
                    .arg(server_addr(i).to_string())
                    .args(["--metrics-port", &METRICS_PORT.to_string()])
                    .args(["--name", &ip.to_string()])
                    .args(["--max-running", &options.shape().slots.to_string()])
                    .args(["--kv-tokens", &KV_TOKENS.to_string(), "--dialect", "vllm"])
                    .args(["--prefill-tokens-per-s", &PREFILL_TOKENS_PER_S.to_string()])
                    .args(["--model", SIM_MODEL]);
            }
            Some(real) => {
                cmd = topology.backend(i).command(&real.llama_server);
                cmd.arg("-m")
                    .arg(&real.model)
                    .args(["--host", &ip.to_string(), "--port", "8000", "--metrics"])
                    .args([
                        "-np",
                        &REAL_SHAPE.slots.to_string(),
                        "-c",
                        "16384",
                        "-t",
                        "1",
                    ])
                    .args(["--alias", REAL_MODEL, "--offline", "--no-webui"]);
            }
        }
        let mut process = Process::spawn(format!("server {ip}"), cmd, &log)?;
        match options.real {
            None => {
                process.wait_for_line(0, Duration::from_secs(20), |l| l.trim_end() == "ready")?;
            }
            Some(_) => wait_healthy(topology.backend(i).name(), server_addr(i), &mut process)?,
        }
        servers.push(process);
    }
    Ok(servers)
}

/// Polls `GET /health` from inside the server's namespace until it answers 200.
fn wait_healthy(ns: &str, addr: SocketAddr, process: &mut Process) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(180);
    let ns = ns.to_owned();
    let healthy = std::thread::scope(|s| {
        s.spawn(|| -> Result<bool> {
            workload::enter_netns(&ns)?;
            while Instant::now() < deadline && !out::stop_requested() {
                if let Ok(mut stream) =
                    std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1))
                {
                    use std::io::Write;
                    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
                    let _ = stream.write_all(
                        b"GET /health HTTP/1.1\r\nHost: server\r\nConnection: close\r\n\r\n",
                    );
                    let mut head = [0u8; 12];
                    if stream.read_exact(&mut head).is_ok() && head.ends_with(b" 200") {
                        return Ok(true);
                    }
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            Ok(false)
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })?;
    if !healthy {
        // Shows the server's own words if it died.
        process.wait_for_line(0, Duration::ZERO, |_| false)?;
        bail!("{addr} did not become healthy in 180 s");
    }
    Ok(())
}

/// Relays the agent's log lines that matter to the operator until `done`. The counts of
/// connections that spilled, which the agent logs at every update, are added up and shown
/// every `every`.
fn tail_agent_log(path: &Path, out: &Out, done: &AtomicBool, every: Duration) {
    let Ok(mut file) = fs::File::open(path) else {
        out.line(Style::Warn, &format!("cannot read {}", path.display()));
        return;
    };
    let mut pending = Vec::new();
    let mut warnings = 0;
    let mut spilled = Spilled::default();
    let mut explained = false;
    let mut next_flush = Instant::now() + every;
    loop {
        let finishing = done.load(Ordering::SeqCst);
        let mut chunk = Vec::new();
        if file.read_to_end(&mut chunk).is_err() {
            return;
        }
        pending.extend(chunk);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let Some((style, text)) = relay(&String::from_utf8_lossy(&line)) else {
                continue;
            };
            if style == Style::Spill && spilled.add(&text) {
                continue;
            }
            let first_spill = style == Style::Spill && !explained && text.contains(": spill from ");
            if style == Style::Warn {
                warnings += 1;
                if warnings > 10 {
                    if warnings == 11 {
                        out.line(Style::Warn, "agent | (more warnings in agent.log)");
                    }
                    continue;
                }
            }
            out.line(style, &format!("agent | {text}"));
            if first_spill {
                explained = true;
                if let Some(note) = explain_spill(&text) {
                    out.block(Style::Plain, &note);
                }
            }
        }
        if finishing || Instant::now() >= next_flush {
            for line in spilled.flush(every) {
                out.line(Style::Spill, &format!("agent | {line}"));
            }
            next_flush = Instant::now() + every;
        }
        if finishing {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// What the first spill means, for a newcomer.
fn explain_spill(text: &str) -> Option<String> {
    let rest = text.strip_prefix("bucket ")?;
    let (bucket, rest) = rest.split_once(": spill from ")?;
    let (from, rest) = rest.split_once(" to ")?;
    let (to, _) = rest.split_once(": ")?;
    Some(format!(
        "(the preamble's home {from} has no room for more: {to} becomes a warm alternate \
         of bucket {bucket}, and the bucket's next connections go there while it has room; \
         {to} then holds the preamble too, so the prefix has two warm servers)"
    ))
}

/// Where spilled connections went (`to 10.4.0.13:8000`, `by weight (...)`), with counts.
type Destinations = Vec<(String, u64)>;

/// The agent's `bucket N: K connections spilled from HOME: K1 to A, K2 by weight (...)`
/// lines, added up per bucket and home.
#[derive(Default)]
struct Spilled {
    /// (bucket, home) -> (total, where -> count).
    counts: std::collections::BTreeMap<(u16, String), (u64, Destinations)>,
}

impl Spilled {
    /// Takes the line if it is one of those.
    fn add(&mut self, text: &str) -> bool {
        let parse = || -> Option<(u16, u64, String, Destinations)> {
            let rest = text.strip_prefix("bucket ")?;
            let (bucket, rest) = rest.split_once(": ")?;
            let (count, rest) = rest.split_once(" connections spilled from ")?;
            let (home, parts) = rest.split_once(": ")?;
            let parts = parts
                .split(", ")
                .map(|p| {
                    let (n, what) = p.split_once(' ')?;
                    Some((what.to_owned(), n.parse().ok()?))
                })
                .collect::<Option<Vec<_>>>()?;
            Some((
                bucket.parse().ok()?,
                count.parse().ok()?,
                home.to_owned(),
                parts,
            ))
        };
        let Some((bucket, count, home, parts)) = parse() else {
            return false;
        };
        let entry = self.counts.entry((bucket, home)).or_default();
        entry.0 += count;
        for (what, n) in parts {
            match entry.1.iter_mut().find(|(w, _)| *w == what) {
                Some(slot) => slot.1 += n,
                None => entry.1.push((what, n)),
            }
        }
        true
    }

    fn flush(&mut self, every: Duration) -> Vec<String> {
        std::mem::take(&mut self.counts)
            .into_iter()
            .map(|((bucket, home), (total, parts))| {
                let parts: Vec<String> = parts.iter().map(|(w, n)| format!("{n} {w}")).collect();
                format!(
                    "bucket {bucket}: {total} connection{} spilled from {home} in the last {} s: {}",
                    if total == 1 { "" } else { "s" },
                    every.as_secs(),
                    parts.join(", ")
                )
            })
            .collect()
    }
}

/// The operator's view of one agent log line, if it is one to show (spills, saturation,
/// drains, reloads, health, warnings), without the time stamp and with the server first.
fn relay(line: &str) -> Option<(Style, String)> {
    let line = line.trim_end();
    let (head, rest) = line.split_once("balancer_agent::")?;
    let (_, message) = rest.split_once(": ")?;
    let warn = head.contains("WARN") || head.contains("ERROR");
    // tracing puts the fields after the message: peel off the ones we know.
    let mut message = message;
    let mut server = None;
    while let Some((before, field)) = message.rsplit_once(' ') {
        let Some((key, value)) = field.split_once('=') else {
            break;
        };
        match key {
            "server" | "interface" => server = Some(value),
            "pool" | "weight" | "pools" | "dir" | "vips" | "interfaces" | "buckets" => {}
            _ => break,
        }
        message = before;
    }
    let style = if message.contains("spill") {
        Style::Spill
    } else if warn {
        Style::Warn
    } else if [
        "takes no new connections",
        "takes new connections again",
        "draining",
        "drain cancelled",
        "config reloaded",
        "reload failed",
        "DOWN after",
        "UP after",
        "left attached",
        "took over",
        "as the previous agent left it",
    ]
    .iter()
    .any(|m| message.contains(m))
    {
        Style::Event
    } else {
        return None;
    };
    Some(match server {
        Some(s) => (style, format!("{s} {message}")),
        None => (style, message.to_owned()),
    })
}

/// The live table: `balancer-agent show pool chat-pool`.
fn show_table(agent: &Agent, out: &Out, title: &str) {
    out.line(
        Style::Command,
        &format!("$ balancer-agent show pool {POOL}{title}"),
    );
    match output(&mut agent.cli(&["show", "pool", POOL])) {
        Ok(table) => out.block(Style::Dim, &table),
        Err(e) => out.block(Style::Warn, &format!("{e:#}")),
    }
}

/// `balancer-agent drain chat-pool 10.4.0.14 --wait`, its output relayed as it comes; sets
/// `drained` when it reports the server empty.
fn start_drain(agent: &Agent, out: &Out) -> Result<(ChildGuard, std::process::ChildStdout)> {
    let server = server_ip(DRAINED).to_string();
    out.line(
        Style::Command,
        &format!("$ balancer-agent drain {POOL} {server} --wait"),
    );
    let mut child = agent
        .cli(&["drain", POOL, &server, "--wait", "--timeout", "120"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting balancer-agent drain")?;
    let stdout = child.stdout.take().context("the drain's output")?;
    Ok((ChildGuard(child), stdout))
}

fn relay_drain(stdout: std::process::ChildStdout, out: &Out, drained: &AtomicBool) {
    for line in BufReader::new(stdout).lines() {
        let Ok(line) = line else { break };
        out.line(Style::Dim, &format!("  {line}"));
        if line.starts_with("drained:") {
            drained.store(true, Ordering::SeqCst);
        }
    }
}

/// Opens streams from ordinary source ports until two land on 10.4.0.14, the server about
/// to be drained (the simulators say who answered), and closes the others at once.
fn open_long_streams<'a>(
    model: &str,
    tokens: u32,
    stop: Stop<'a>,
) -> Result<Vec<workload::Response<'a>>> {
    let target = server_ip(DRAINED).to_string();
    let mut kept = Vec::new();
    for n in 0..16u32 {
        if stop.now() || kept.len() == 2 {
            break;
        }
        let stream = workload::connect(vip(), None)?;
        let body = workload::request_body(model, &workload::other_prompt(100, n), tokens);
        let response = workload::post(stream, &body, stop)?;
        if response.backend.as_deref() == Some(target.as_str()) {
            kept.push(response);
        }
    }
    Ok(kept)
}

/// One completion through the VIP with curl from the client namespace, from a source port
/// that hints the preamble (asked from the agent with `balancer-agent hint`); its tokens are
/// printed as they arrive.
fn stream_with_curl(
    client_ns: &str,
    agent: &Path,
    socket: &Path,
    dir: &Path,
    out: &Out,
) -> Result<()> {
    out.line(
        Style::Title,
        "one completion through the VIP with curl, from a source port that hints the preamble:",
    );
    // A client of the workload may take the port between the two commands: ask again.
    for _ in 0..3 {
        let port = output(
            Command::new("ip")
                .args(["netns", "exec", client_ns])
                .arg(agent)
                .args(["hint", "--pool", POOL, "--prefix-file"])
                .arg(dir.join("preamble.txt"))
                .args(["--port", "--socket"])
                .arg(socket),
        )?
        .trim()
        .to_owned();
        out.line(
            Style::Command,
            &format!(
                "$ ip netns exec {client_ns} balancer-agent hint --pool {POOL} \
                 --prefix-file preamble.txt --port"
            ),
        );
        out.block(Style::Dim, &port);
        let url = format!("http://{VIP4}:{VIP_PORT}/v1/completions");
        out.line(
            Style::Command,
            &format!(
                "$ ip netns exec {client_ns} curl -sN -i --local-port {port} {url} \
                 -H 'content-type: application/json' -d @request.json"
            ),
        );
        let mut child = Command::new("ip")
            .args(["netns", "exec", client_ns, "curl", "-sN", "-i"])
            .args(["--max-time", "30", "--local-port", &port, &url])
            .args(["-H", "content-type: application/json", "-d"])
            .arg(format!("@{}", dir.join("request.json").display()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting curl")?;
        let stdout = child.stdout.take().context("curl's output")?;
        let mut child = ChildGuard(child);
        let started = Instant::now();
        let (mut backend, mut tokens, mut first, mut done) = (None, 0, None, false);
        let mut in_body = false;
        for line in BufReader::new(stdout).lines() {
            let line = line.context("reading curl's output")?;
            let line = line.trim_end();
            if !in_body {
                if line.is_empty() {
                    in_body = true;
                } else if line.starts_with("HTTP/") {
                    out.line(Style::Dim, &format!("curl | {line}"));
                } else if let Some((name, value)) = line.split_once(':') {
                    if name.eq_ignore_ascii_case("x-backend") {
                        backend = Some(value.trim().to_owned());
                    }
                }
                continue;
            }
            let Some(data) = line.strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let Ok(value) = serde_json::from_str::<serde_json::Value>(data) else {
                continue;
            };
            if let Some(text) = value["choices"][0]["text"].as_str() {
                if !text.is_empty() {
                    tokens += 1;
                    first.get_or_insert(started.elapsed());
                    out.tokens("curl |", text);
                }
            }
        }
        out.end_tokens();
        let status = child.0.wait()?;
        // 45: curl could not bind the port (taken since `hint` looked).
        if status.code() == Some(45) {
            out.line(
                Style::Dim,
                "curl | the port was taken meanwhile; asking for another",
            );
            continue;
        }
        if tokens == 0 {
            bail!("curl streamed no token ({status})");
        }
        out.line(
            Style::Plain,
            &format!(
                "curl | {tokens} tokens in {:.1} s, the first after {} ms, from {}{}",
                started.elapsed().as_secs_f64(),
                first.map_or(0, |d| d.as_millis()),
                backend.map_or("a server that does not say which".into(), |b| format!(
                    "{b}:8000 (its x-backend header)"
                )),
                if done { ", ended with [DONE]" } else { "" },
            ),
        );
        return Ok(());
    }
    bail!("curl found no free source port of the preamble's bucket")
}

/// Everything the demo started, in the order it must go: clients first, then the agent,
/// the servers, and the namespaces last.
pub fn run(options: &Options, out: &Out) -> Result<()> {
    let timeline = Timeline::new(options);
    let real = options.real.is_some();
    let model = if real { REAL_MODEL } else { SIM_MODEL };

    out.raw(
        Style::Title,
        "== balancer demo: the worked example of the design brief ==",
    );
    out.line(Style::Title, "building the network: client, gateway, switch and four servers, each in a namespace of its own");
    let mut topology = Topology::build_bare()?;
    topology.attach_xdp_pass(&options.xdp_pass)?;
    let mut namespaces = netns::remaining()?;
    let order = |name: &String| {
        ["client", "gw", "sw", "b1", "b2", "b3", "b4"]
            .iter()
            .position(|role| name.ends_with(&format!("-{role}")))
            .unwrap_or(usize::MAX)
    };
    namespaces.sort_by_key(order);
    out.block(
        Style::Dim,
        &format!(
            "namespaces: {}\n\
             client 10.9.0.2 -> gateway 10.9.0.1 | 10.4.0.1 (the balancer, XDP on g0 and g1) -> servers 10.4.0.11-14\n\
             VIP {VIP4}:{VIP_PORT}, routed to the gateway; nothing here routes out of the namespaces",
            namespaces.join(" ")
        ),
    );
    if out::stop_requested() {
        return Ok(());
    }

    match &options.real {
        None => out.line(
            Style::Title,
            &format!(
                "starting four inference servers (inference-sim: vLLM metrics, {} batch slots, \
                 {KV_TOKENS} tokens of KV cache, prefix cache): API on :8000, metrics on :{METRICS_PORT}",
                SIM_SHAPE.slots
            ),
        ),
        Some(r) => out.line(
            Style::Title,
            &format!(
                "starting four llama-server ({}, {} slots, one CPU thread each): API and metrics on :8000",
                r.model.file_name().unwrap_or_default().to_string_lossy(),
                REAL_SHAPE.slots
            ),
        ),
    }
    let servers = start_servers(&topology, options)?;

    let socket = topology.dir().join("agent.sock");
    // A bpffs of the demo's own: `ip netns exec` hides the host's /sys/fs/bpf. Dropped
    // after the agent, which unpins what it left.
    let pins = netns::PinDir::new("demo")?;
    let all: Vec<usize> = (0..BACKENDS).collect();
    let config = agent_toml(&socket, &pins.path(), &all, real, options.shape().slots);
    out.line(Style::Title, "starting the agent with this agent.toml:");
    out.block(Style::Dim, &config);
    let mut agent = Agent::start(&topology, &options.agent, &pins.path(), &config)?;
    let pids: Vec<String> = std::iter::once(format!("agent {}", agent.process.pid()))
        .chain(
            servers
                .iter()
                .enumerate()
                .map(|(i, p)| format!("{} {}", server_ip(i), p.pid())),
        )
        .collect();
    out.line(
        Style::Plain,
        &format!("agent ready; processes: {}", pids.join(", ")),
    );

    // The preamble: its bucket's home is 10.4.0.12 with and without 10.4.0.14.
    let addrs: Vec<SocketAddr> = (0..BACKENDS).map(server_addr).collect();
    let words = if real {
        workload::REAL_PREAMBLE_WORDS
    } else {
        workload::PREAMBLE_WORDS
    };
    let (preamble, bucket, home) = workload::choose_preamble(
        words,
        HintRange::DEFAULT,
        &addrs,
        addrs[DRAINED],
        addrs[WANTED_HOME],
    );
    let range = HintRange::DEFAULT;
    fs::write(topology.dir().join("preamble.txt"), &preamble)?;
    let question = "\n\nCustomer: my parcel is late, what can you do?";
    let request = workload::request_body(model, &format!("{preamble}{question}"), 60);
    fs::write(topology.dir().join("request.json"), request.to_string())?;
    out.line(
        Style::Plain,
        &format!(
            "preamble: {words} {} shared by most requests; hint bucket {bucket} of {} \
             (source ports {}, {}, ...); its home is {home}",
            if real { "words" } else { "tokens" },
            range.buckets,
            range.start + bucket,
            range.start + bucket + range.buckets,
        ),
    );

    let tally = Tally::default();
    let workload_stop = AtomicBool::new(false);
    let tail_done = AtomicBool::new(false);
    let drained = AtomicBool::new(false);
    let log = agent.log.clone();
    let result = std::thread::scope(|s| -> Result<()> {
        let every = Duration::from_secs_f64(timeline.table_every);
        let (log, tail_done) = (&log, &tail_done);
        // Ends the tail however this closure ends (a panic included), before the join.
        let _end_tail = SetOnDrop(tail_done);
        let tail = s.spawn(move || tail_agent_log(log, out, tail_done, every));
        let result = timeline_run(
            options,
            &timeline,
            &topology,
            &mut agent,
            out,
            Scene {
                model,
                preamble: &preamble,
                tally: &tally,
                workload_stop: &workload_stop,
                drained: &drained,
            },
        );
        workload_stop.store(true, Ordering::SeqCst);
        // Let the last lines of the agent's log through before the table.
        std::thread::sleep(Duration::from_millis(300));
        tail_done.store(true, Ordering::SeqCst);
        let _ = tail.join();
        result
    });
    let stopped = out::stop_requested();
    if result.is_ok() && !stopped {
        show_table(&agent, out, "   (at the end)");
        summary(out, &tally, home);
    }

    if options.keep && result.is_ok() && !stopped {
        keep(options, out, &topology, &agent, &namespaces)?;
    }

    out.line(
        Style::Title,
        "cleaning up: stopping the agent and the servers, deleting the namespaces",
    );
    drop(agent);
    drop(pins);
    // A busy llama-server takes its time over SIGTERM; nothing of theirs needs saving.
    for mut server in servers {
        let _ = server.stop(Duration::from_secs(2));
    }
    drop(topology);
    let left = netns::remaining()?;
    if left.is_empty() {
        out.line(
            Style::Plain,
            "cleaned up: no namespace or process of the demo is left",
        );
    } else {
        out.line(Style::Warn, &format!("namespaces left behind: {left:?}"));
    }
    result
}

/// What the timeline's threads share.
struct Scene<'a> {
    model: &'a str,
    preamble: &'a str,
    tally: &'a Tally,
    workload_stop: &'a AtomicBool,
    drained: &'a AtomicBool,
}

/// Sets its flag when dropped: the threads of a scope end before the scope joins them,
/// also when the scope is left by an error or a panic.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

fn timeline_run(
    options: &Options,
    timeline: &Timeline,
    topology: &Topology,
    agent: &mut Agent,
    out: &Out,
    scene: Scene<'_>,
) -> Result<()> {
    let stop = Stop(scene.workload_stop);
    let real = options.real.is_some();
    let shape = options.shape();
    let client_ns = topology.client().name().to_owned();
    let drained_ip = server_ip(DRAINED);
    // The first scrapes: the table shows four idle servers.
    stop.sleep(Duration::from_millis(2500));
    show_table(agent, out, "");
    out.block(
        Style::Plain,
        "(running, waiting: the server's own request counts; kv-mem: its KV-cache memory in use; \
         ttft-ms: its recent time to first token; weight: its share of new connections, 0 for \
         none; flows: connections through the balancer; new/s: new connections per second)",
    );

    let start = Instant::now();
    let at = |secs: f64| start + Duration::from_secs_f64(secs);
    let wait_until = |t: Instant| stop.sleep(t.saturating_duration_since(Instant::now()));
    let workload = Workload {
        vip: vip(),
        model: scene.model,
        preamble: scene.preamble,
        tally: scene.tally,
        out,
        stop,
        hinted_tokens: shape.hinted_tokens,
        other_tokens: shape.other_tokens,
    };
    let drain_child: Mutex<Option<ChildGuard>> = Mutex::new(None);
    let (binary, socket) = (agent.binary.clone(), agent.socket.clone());
    std::thread::scope(|s| -> Result<()> {
        // Dropped when this closure ends, however it ends, before the scope joins its threads.
        let _stop_threads = SetOnDrop(scene.workload_stop);
        let _kill_drain = KillOnDrop(&drain_child);

        out.line(
            Style::Title,
            &if real {
                format!("long completions from ordinary source ports, some on {drained_ip} (about to be drained)")
            } else {
                format!(
                    "long completions from ordinary source ports, until two run on {drained_ip} \
                     (about to be drained)"
                )
            },
        );
        if real {
            // llama-server answers only with its first token, after the prefill, and does
            // not say who it is: six completions go out at once, wherever they land.
            for i in 0..6 {
                let (workload, client_ns) = (&workload, &client_ns);
                s.spawn(move || workload.long(client_ns, 200 + i, timeline.long_tokens));
            }
            out.line(
                Style::Plain,
                &format!(
                    "6 long completions of {} tokens sent to the pool",
                    timeline.long_tokens
                ),
            );
        } else {
            let long = topology
                .client()
                .enter(|| open_long_streams(scene.model, timeline.long_tokens, stop))?;
            out.line(
                Style::Plain,
                &format!(
                    "{} long completion{} of {} tokens run on {drained_ip}",
                    long.len(),
                    if long.len() == 1 { "" } else { "s" },
                    timeline.long_tokens,
                ),
            );
            for response in long {
                s.spawn(move || {
                    let _ = response.finish(|_| {});
                });
            }
        }

        wait_until(at(timeline.drain_at));
        let (child, stdout) = start_drain(agent, out)?;
        *drain_child.lock().unwrap_or_else(|p| p.into_inner()) = Some(child);
        s.spawn(|| relay_drain(stdout, out, scene.drained));

        wait_until(at(timeline.workload_at));
        show_table(
            agent,
            out,
            &format!("   ({drained_ip} drains: it takes nothing new)"),
        );
        out.line(
            Style::Title,
            &format!(
                "workload: {} clients send the preamble with its hint, {} send prompts of \
                 their own; each streams completions back to back",
                shape.hinted_clients, shape.other_clients
            ),
        );
        // One after the other, as users arrive: the agent sees the home fill up.
        let (workload, client_ns) = (&workload, &client_ns);
        s.spawn(move || {
            for i in 0..shape.hinted_clients + shape.other_clients {
                s.spawn(move || workload.client(client_ns, i + 1, i < shape.hinted_clients));
                stop.sleep(Duration::from_secs_f64(timeline.stagger));
            }
        });

        let mut next_table = at(timeline.workload_at + timeline.table_every);
        let mut curl = None;
        let mut burst = false;
        let mut reloaded = false;
        let mut restarted = false;
        while Instant::now() < at(timeline.end_at) && !out::stop_requested() {
            let now = Instant::now();
            if !restarted && reloaded && now >= at(timeline.restart_at) {
                restarted = true;
                out.line(
                    Style::Title,
                    &format!(
                        "an upgrade: the agent stops (kill -TERM {}) and starts again; with \
                         agent.pin_dir the XDP program stays attached, so the streams and new \
                         connections go on",
                        agent.process.pid()
                    ),
                );
                agent.stop()?;
                out.line(Style::Plain, "agent stopped; for two seconds no agent runs");
                std::thread::sleep(Duration::from_secs(2));
                agent.start_again()?;
                out.line(
                    Style::Plain,
                    &format!(
                        "$ balancer-agent run --config agent.toml   (pid {}: ready)",
                        agent.process.pid()
                    ),
                );
                std::thread::sleep(Duration::from_millis(300));
                show_table(agent, out, "   (the new agent)");
                next_table = Instant::now() + Duration::from_secs_f64(timeline.table_every);
            }
            if !reloaded && scene.drained.load(Ordering::SeqCst) {
                reloaded = true;
                out.line(
                    Style::Title,
                    &format!(
                        "{drained_ip} runs nothing any more: removing it from agent.toml and \
                         reloading the agent (kill -HUP {})",
                        agent.process.pid()
                    ),
                );
                let rest: Vec<usize> = (0..BACKENDS).filter(|i| *i != DRAINED).collect();
                agent.reload(&agent_toml(
                    &agent.socket,
                    &agent.pins,
                    &rest,
                    real,
                    options.shape().slots,
                ))?;
                std::thread::sleep(Duration::from_millis(200));
                show_table(agent, out, &format!("   ({drained_ip} has left the pool)"));
                next_table = Instant::now() + Duration::from_secs_f64(timeline.table_every);
            } else if now >= next_table {
                show_table(agent, out, "");
                next_table += Duration::from_secs_f64(timeline.table_every);
            }
            if curl.is_none() && now >= at(timeline.curl_at) {
                let (binary, socket, dir) = (&binary, &socket, topology.dir());
                curl = Some(s.spawn(move || {
                    if let Err(e) = stream_with_curl(client_ns, binary, socket, dir, out) {
                        out.line(Style::Warn, &format!("curl: {e:#}"));
                    }
                }));
            }
            if !burst && now >= at(timeline.burst_at) {
                burst = true;
                out.line(
                    Style::Title,
                    &format!(
                        "a burst: {} more users with the preamble arrive at once, one request each",
                        shape.burst
                    ),
                );
                for i in 0..shape.burst {
                    s.spawn(move || workload.once(client_ns, 100 + i));
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if !out::stop_requested() {
            out.line(Style::Title, "stopping the workload");
        }
        scene.workload_stop.store(true, Ordering::SeqCst);
        if let Some(curl) = curl {
            let _ = curl.join();
        }
        if !reloaded && !out::stop_requested() {
            out.line(
                Style::Warn,
                &format!("{drained_ip} still runs something: it did not leave the pool"),
            );
        }
        Ok(())
    })
}

/// Kills the drain command, if it still waits, when dropped.
struct KillOnDrop<'a>(&'a Mutex<Option<ChildGuard>>);

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

fn summary(out: &Out, tally: &Tally, home: SocketAddr) {
    let t = tally.snapshot();
    let mut hinted = Vec::new();
    let mut others = Vec::new();
    let (mut n_hinted, mut n_others) = (0, 0);
    for ((is_hinted, server), count) in &t.served {
        let name = server
            .parse::<IpAddr>()
            .map_or(server.clone(), |ip| SocketAddr::new(ip, 8000).to_string());
        let role = if name == home.to_string() {
            " (its home)"
        } else {
            ""
        };
        let mean = count.ttft_ms_sum / f64::from(count.requests.max(1));
        let text = format!(
            "{} on {name}{role}, first token after {mean:.0} ms on average",
            count.requests
        );
        if *is_hinted {
            n_hinted += count.requests;
            hinted.push(text);
        } else {
            n_others += count.requests;
            others.push(text);
        }
    }
    out.line(Style::Title, "summary");
    out.block(
        Style::Plain,
        &format!(
            "{n_hinted} requests with the preamble and its hint: {}\n\
             {n_others} other requests: {}\n\
             {} requests failed{}",
            hinted.join("; "),
            others.join("; "),
            t.errors,
            t.first_errors
                .first()
                .map_or(String::new(), |e| format!(" (first: {e})")),
        ),
    );
}

/// `--keep`: leaves everything running and says how to explore it and how to remove it;
/// returns when `cargo xtask demo --clean` (SIGTERM) or a signal ends it, or after a day.
fn keep(
    options: &Options,
    out: &Out,
    topology: &Topology,
    agent: &Agent,
    namespaces: &[String],
) -> Result<()> {
    let client = topology.client().name();
    let gw = topology.gw().name();
    let a = agent.binary.display();
    let sock = agent.socket.display();
    let dir = topology.dir().display();
    let model = if options.real.is_some() {
        REAL_MODEL
    } else {
        SIM_MODEL
    };
    let prefix = namespaces
        .first()
        .and_then(|n| n.rsplit_once('-'))
        .map_or("blt-", |(p, _)| p);
    out.line(
        Style::Title,
        "--keep: everything keeps running (the workload has stopped). Explore it:",
    );
    out.block(
        Style::Plain,
        &format!(
            "the pool, live:\n\
             \x20 {a} show pool {POOL} --socket {sock}\n\
             drain a server, watch it leave, take it back:\n\
             \x20 {a} drain {POOL} 10.4.0.13 --wait --socket {sock}\n\
             \x20 {a} undrain {POOL} 10.4.0.13 --socket {sock}\n\
             the data path's counters:\n\
             \x20 {a} counters --socket {sock}\n\
             a completion through the VIP, from the client's namespace:\n\
             \x20 ip netns exec {client} curl -sN http://{VIP4}:{VIP_PORT}/v1/completions \\\n\
             \x20   -H 'content-type: application/json' \\\n\
             \x20   -d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", \"max_tokens\": 20, \"stream\": true}}'\n\
             the same with the preamble and its hint:\n\
             \x20 ip netns exec {client} curl -sN -i --local-port \\\n\
             \x20   $(ip netns exec {client} {a} hint --pool {POOL} --prefix-file {dir}/preamble.txt --port --socket {sock}) \\\n\
             \x20   http://{VIP4}:{VIP_PORT}/v1/completions -H 'content-type: application/json' -d @{dir}/request.json\n\
             the agent's log and configuration (edit it, then kill -HUP {pid} to reload):\n\
             \x20 tail -f {dir}/agent.log\n\
             \x20 {dir}/agent.toml\n\
             the namespaces, and the XDP program on the gateway:\n\
             \x20 ip netns list | grep {prefix}\n\
             \x20 ip netns exec {gw} ip -d link show g0\n\
             remove everything:\n\
             \x20 cargo xtask demo --clean",
            pid = agent.process.pid(),
        ),
    );

    let me = std::process::id();
    fs::create_dir_all(STATE_DIR).with_context(|| format!("creating {STATE_DIR}"))?;
    let state = Path::new(STATE_DIR).join(format!("{me}.state"));
    fs::write(
        &state,
        format!(
            "pid={me}\ndir={dir}\nsocket={sock}\nnamespaces={}\n",
            namespaces.join(" ")
        ),
    )
    .with_context(|| format!("writing {}", state.display()))?;

    // Detach: whoever started us may go now. Our output goes to a file from here on, and the
    // death of our parent no longer stops us.
    let log = topology.dir().join("keeper.log");
    let file = fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    // SAFETY: prctl and dup2 on valid descriptors; nothing else writes to fds 1 and 2 while
    // `out` holds the stdout lock, and nothing of ours holds that lock now.
    unsafe {
        use std::os::fd::AsRawFd;
        libc::prctl(libc::PR_SET_PDEATHSIG, 0);
        libc::dup2(file.as_raw_fd(), 1);
        libc::dup2(file.as_raw_fd(), 2);
    }
    let kept = Instant::now();
    while !out::stop_requested() && kept.elapsed() < KEEP_LIMIT {
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = fs::remove_file(&state);
    Ok(())
}
