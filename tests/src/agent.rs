//! The balancer agent running in the gateway namespace, driven through its public interface:
//! the configuration file, signals, and its log.

use std::marker::PhantomData;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
#[cfg(feature = "agent")]
use balancer_agent::control::{BucketsView, InterfaceRow, PeerRow, PoolView, ServerRow};
use serde::Serialize;

use crate::netns::Netns;
use crate::process::{run, Process, STOP_GRACE};
use crate::topology::{Family, Topology, BACKENDS, BACKEND_PORT, GATEWAY_INTERFACES, METRICS_PORT};

const READY_TIMEOUT: Duration = Duration::from_secs(30);
const RELOAD_TIMEOUT: Duration = Duration::from_secs(30);

/// The agent's configuration file (see the agent's docs for the keys).
#[derive(Debug, Clone, Serialize)]
pub struct AgentConfig {
    pub agent: AgentSection,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync: Option<SyncSection>,
    #[serde(rename = "pool")]
    pub pools: Vec<Pool>,
}

/// `[agent]`; a key left `None` is not written, so that the agent's default applies.
#[derive(Debug, Clone, Serialize)]
pub struct AgentSection {
    pub interfaces: Vec<String>,
    pub control_socket: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scrape_interval_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health_interval_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health_timeout_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fall: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rise: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hung_after_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<SocketAddr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flow_table_entries: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pin_dir: Option<PathBuf>,
    /// "auto", "native" or "generic".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub xdp_mode: Option<String>,
}

/// `[sync]`: sharing flows with other gateways.
#[derive(Debug, Clone, Serialize)]
pub struct SyncSection {
    pub listen: SocketAddr,
    pub peers: Vec<SocketAddr>,
    pub key_file: PathBuf,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub accept_key_files: Vec<PathBuf>,
}

/// `[[pool]]`; as in [`AgentSection`], `None` keys are left to the agent's defaults.
#[derive(Debug, Clone, Serialize)]
pub struct Pool {
    pub name: String,
    pub vip: IpAddr,
    pub port: u16,
    /// "nat" or "dsr".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forwarding: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tunnel_source: Option<IpAddr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spill_waiting: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spill_ttft_ms: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_high: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dialect: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// A file holding the servers' API key, sent with the health checks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key_file: Option<PathBuf>,
    /// `[pool.tls]`: HTTPS for the health checks and scrapes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<PoolTls>,
    /// Requests each server runs at once: a bucket's home takes this many hinted
    /// connections before it spills (learned from the highest running count when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slots: Option<u32>,
    /// Source ports that carry prefix hints, "FIRST-LAST" or "off".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint_ports: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint_buckets: Option<u16>,
    #[serde(rename = "server")]
    pub servers: Vec<Server>,
}

/// `[pool.tls]`.
#[derive(Debug, Clone, Serialize)]
pub struct PoolTls {
    pub ca_file: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Server {
    pub address: IpAddr,
    pub port: u16,
    pub metrics_port: u16,
    pub weight: u32,
}

impl AgentConfig {
    /// The agent on both gateway interfaces with two pools, `chat-v4` and `chat-v6`, each of
    /// the four backends with `weights[i]` for backend `i`.
    pub fn gateway(topology: &Topology, weights: [u32; BACKENDS]) -> Self {
        let pool = |name: &str, family: Family| Pool {
            name: name.to_owned(),
            vip: family.vip().ip(),
            port: family.vip().port(),
            forwarding: None,
            tunnel_source: None,
            spill_waiting: None,
            spill_ttft_ms: None,
            kv_high: None,
            dialect: None,
            model: None,
            api_key_file: None,
            tls: None,
            slots: None,
            hint_ports: None,
            hint_buckets: None,
            servers: weights
                .iter()
                .enumerate()
                .map(|(i, &weight)| Server {
                    address: family.backend(i),
                    port: BACKEND_PORT,
                    metrics_port: METRICS_PORT,
                    weight,
                })
                .collect(),
        };
        Self {
            agent: AgentSection {
                interfaces: GATEWAY_INTERFACES.map(String::from).to_vec(),
                control_socket: topology.dir().join("agent.sock"),
                scrape_interval_ms: None,
                health_interval_ms: None,
                health_timeout_ms: None,
                fall: None,
                rise: None,
                hung_after_ms: None,
                metrics_listen: None,
                flow_table_entries: None,
                pin_dir: None,
                xdp_mode: None,
            },
            sync: None,
            pools: vec![pool("chat-v4", Family::V4), pool("chat-v6", Family::V6)],
        }
    }

    /// Sets backend `index`'s weight in every pool.
    pub fn set_weight(&mut self, index: usize, weight: u32) {
        for pool in &mut self.pools {
            pool.servers[index].weight = weight;
        }
    }

    /// The file's text.
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(self).context("serialising the agent config")
    }

    fn write(&self, path: &Path) -> Result<()> {
        write_whole(path, &self.to_toml()?)
    }
}

/// Writes the file whole or not at all, so that the agent never reads half of it.
fn write_whole(path: &Path, text: &str) -> Result<()> {
    let partial = path.with_extension("partial");
    std::fs::write(&partial, text)?;
    std::fs::rename(&partial, path)?;
    Ok(())
}

/// `balancer-agent run --config PATH` in the gateway namespace, `config` written to `path`.
fn run_command(gw: &Netns, binary: &Path, config: &AgentConfig, path: &Path) -> Result<Command> {
    config.write(path)?;
    let mut cmd = gw.command(binary);
    cmd.args(["run", "--config"]).arg(path);
    Ok(cmd)
}

/// The agent's log line that says it is ready.
fn says_ready(line: &str) -> bool {
    line.split(|c: char| !c.is_ascii_alphanumeric())
        .any(|word| word == "ready")
}

/// The names these types had here before the harness used the agent's own; the benchmarks
/// still use them.
#[cfg(feature = "agent")]
pub type ShownPool = PoolView;
#[cfg(feature = "agent")]
pub type ShownServer = ServerRow;

/// Lookups in the pool `balancer-agent show pool POOL --json` prints ([`Agent::show`]).
#[cfg(feature = "agent")]
pub trait PoolViewExt {
    /// The row of the server at `address` (with or without the port).
    fn server(&self, address: IpAddr) -> Result<&ServerRow>;
}

#[cfg(feature = "agent")]
impl PoolViewExt for PoolView {
    fn server(&self, address: IpAddr) -> Result<&ServerRow> {
        self.servers
            .iter()
            .find(|s| {
                s.server
                    .parse::<std::net::SocketAddr>()
                    .is_ok_and(|a| a.ip() == address)
            })
            .with_context(|| format!("pool {} shows no server {address}", self.pool))
    }
}

/// A running `balancer-agent run --config FILE` in the gateway namespace; it cannot outlive
/// the topology. Dropping it stops the agent (SIGTERM, then SIGKILL).
pub struct Agent<'t> {
    process: Process,
    config: PathBuf,
    binary: PathBuf,
    socket: PathBuf,
    _topology: PhantomData<&'t Topology>,
}

impl<'t> Agent<'t> {
    /// Starts the agent and waits until it says it is `ready`.
    pub fn start(topology: &'t Topology, binary: &Path, config: &AgentConfig) -> Result<Self> {
        Self::start_in(topology, topology.gw(), "agent", binary, config)
    }

    /// Starts an agent in the namespace `gw` (a second gateway's), with its configuration
    /// and log named after `name` in the topology's directory.
    pub fn start_in(
        topology: &'t Topology,
        gw: &Netns,
        name: &str,
        binary: &Path,
        config: &AgentConfig,
    ) -> Result<Self> {
        let path = topology.dir().join(format!("{name}.toml"));
        let cmd = run_command(gw, binary, config, &path)?;
        let log = topology.dir().join(format!("{name}.log"));
        let mut process = Process::spawn("balancer-agent", cmd, &log)?;
        process.wait_for_line(0, READY_TIMEOUT, says_ready)?;
        Ok(Self {
            process,
            config: path,
            binary: binary.to_owned(),
            socket: config.agent.control_socket.clone(),
            _topology: PhantomData,
        })
    }

    /// Starts the agent with `config`, which it must refuse: returns its `error:` line.
    pub fn start_refused(
        topology: &Topology,
        binary: &Path,
        config: &AgentConfig,
    ) -> Result<String> {
        let path = topology.dir().join("agent-refused.toml");
        let cmd = run_command(topology.gw(), binary, config, &path)?;
        let log = topology.dir().join("agent-refused.log");
        let mut process = Process::spawn("balancer-agent (to be refused)", cmd, &log)?;
        let line = process.wait_for_line(0, READY_TIMEOUT, |line| {
            line.starts_with("error:") || says_ready(line)
        })?;
        ensure!(line.starts_with("error:"), "the agent started: {line}");
        let status = process.stop(STOP_GRACE)?;
        ensure!(
            !status.success(),
            "the agent printed {line:?} and exited with {status}"
        );
        Ok(line)
    }

    /// `balancer-agent check` of `config`, in the gateway's namespace: whether it passed, and
    /// what it printed.
    pub fn check(
        topology: &Topology,
        binary: &Path,
        config: &AgentConfig,
    ) -> Result<(bool, String)> {
        let path = topology.dir().join("agent-checked.toml");
        config.write(&path)?;
        let out = topology
            .gw()
            .command(binary)
            .args(["check", "--config"])
            .arg(&path)
            .output()
            .context("running balancer-agent check")?;
        let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        Ok((out.status.success(), text.into_owned()))
    }

    /// SIGKILL, as a crash: the agent gets no chance to clean up.
    pub fn kill(mut self) -> Result<()> {
        self.process.signal(libc::SIGKILL)?;
        self.process.stop(STOP_GRACE)?;
        Ok(())
    }

    /// Rewrites the config file, sends SIGHUP and waits for the agent to report the reload.
    pub fn reload(&mut self, config: &AgentConfig) -> Result<()> {
        let line = self.reload_text(&config.to_toml()?)?;
        ensure!(line.contains("config reloaded"), "agent: {line}");
        Ok(())
    }

    /// Writes `text` as the config file, sends SIGHUP, and returns the line in which the
    /// agent reports the outcome (`config reloaded` or `reload failed ...`).
    pub fn reload_text(&mut self, text: &str) -> Result<String> {
        write_whole(&self.config, text)?;
        let mark = self.process.output_len();
        self.process.signal(libc::SIGHUP)?;
        self.process.wait_for_line(mark, RELOAD_TIMEOUT, |line| {
            line.contains("config reloaded") || line.contains("reload failed")
        })
    }

    /// Writes `text` as the config file and runs `balancer-agent reload`: whether it
    /// succeeded, and what it printed (stdout, then stderr).
    pub fn reload_cli(&mut self, text: &str) -> Result<(bool, String)> {
        write_whole(&self.config, text)?;
        let out = self
            .cli_command(&["reload"])
            .output()
            .context("running balancer-agent reload")?;
        let said = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        Ok((out.status.success(), said.into_owned()))
    }

    /// Everything the agent has logged so far.
    pub fn log(&self) -> String {
        self.process.output()
    }

    /// Where the log ends now, for [`Agent::wait_for_log`].
    pub fn log_len(&self) -> u64 {
        self.process.output_len()
    }

    /// Waits until the agent logs, at or after byte `from`, a line that satisfies `pred`.
    pub fn wait_for_log(
        &mut self,
        from: u64,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Result<String> {
        self.process.wait_for_line(from, timeout, pred)
    }

    /// The CLI, `balancer-agent ARGS... --socket SOCKET`, to spawn.
    pub fn cli_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.args(args).arg("--socket").arg(&self.socket);
        cmd
    }

    /// Runs the CLI to completion; returns its output, or fails with its error line.
    pub fn cli(&self, args: &[&str]) -> Result<String> {
        run(&mut self.cli_command(args))
    }

    /// `balancer-agent counters`: the XDP program's counters and the agent's own, by name.
    pub fn counters(&self) -> Result<std::collections::BTreeMap<String, u64>> {
        let text = self.cli(&["counters", "--json"])?;
        let pairs: Vec<(String, u64)> =
            serde_json::from_str(&text).with_context(|| format!("counters: {text:?}"))?;
        Ok(pairs.into_iter().collect())
    }

    /// One counter of [`Agent::counters`].
    pub fn counter(&self, name: &str) -> Result<u64> {
        let counters = self.counters()?;
        counters
            .get(name)
            .copied()
            .with_context(|| format!("no counter {name} in {counters:?}"))
    }

    /// `balancer-agent show pool POOL --json`.
    #[cfg(feature = "agent")]
    pub fn show(&self, pool: &str) -> Result<PoolView> {
        let text = self.cli(&["show", "pool", pool, "--json"])?;
        serde_json::from_str(&text).with_context(|| format!("show --json printed {text:?}"))
    }

    /// The pool's hint buckets in use, as `buckets --json` prints them.
    #[cfg(feature = "agent")]
    pub fn buckets(&self, pool: &str) -> Result<BucketsView> {
        let text = self.cli(&["buckets", pool, "--json"])?;
        serde_json::from_str(&text).with_context(|| format!("buckets --json printed {text:?}"))
    }

    /// The gateways the agent shares flows with, as `peers --json` prints them.
    #[cfg(feature = "agent")]
    pub fn peers(&self) -> Result<Vec<PeerRow>> {
        let text = self.cli(&["peers", "--json"])?;
        serde_json::from_str(&text).with_context(|| format!("peers --json printed {text:?}"))
    }

    /// The interfaces the program is attached to, as `interfaces --json` prints them.
    #[cfg(feature = "agent")]
    pub fn interfaces(&self) -> Result<Vec<InterfaceRow>> {
        let text = self.cli(&["interfaces", "--json"])?;
        serde_json::from_str(&text).with_context(|| format!("interfaces --json printed {text:?}"))
    }

    /// Polls `show` of `pool` every `poll` until `pred` holds: that answer, and when it
    /// came. On a timeout, the error shows the last answer as the operator's table.
    #[cfg(feature = "agent")]
    pub fn wait_show(
        &self,
        pool: &str,
        what: &str,
        (timeout, poll): (Duration, Duration),
        pred: impl Fn(&PoolView) -> Result<bool>,
    ) -> Result<(PoolView, Instant)> {
        let deadline = Instant::now() + timeout;
        loop {
            let view = self.show(pool)?;
            let at = Instant::now();
            if pred(&view)? {
                return Ok((view, at));
            }
            if at >= deadline {
                bail!(
                    "{what}: not within {timeout:?}; last show:\n{}",
                    balancer_agent::control::render(&view)
                );
            }
            std::thread::sleep(poll);
        }
    }

    /// SIGTERM; the agent must exit cleanly within the grace period.
    pub fn stop(mut self) -> Result<()> {
        let status = self.process.stop(STOP_GRACE)?;
        ensure!(
            status.success(),
            "agent exited with {status}; its log:\n{}",
            self.log()
        );
        Ok(())
    }
}

/// The `balancer-agent` executable, built once per test process. It belongs to another
/// package, so Cargo does not hand its path to our tests as it does for our own binaries.
/// Fails first thing when not root, since only root can run the agent.
pub fn agent_binary() -> Result<PathBuf> {
    crate::require_root()?;
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BINARY
        .get_or_init(|| build_agent(false).map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow!(e))
}

/// [`agent_binary`] built with `--release`, for the benchmarks: the agent's own CPU is one
/// of their figures.
pub fn release_agent_binary() -> Result<PathBuf> {
    crate::require_root()?;
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BINARY
        .get_or_init(|| build_agent(true).map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow!(e))
}

/// Builds the agent alongside what `cargo xtask test` and `cargo xtask bench` build: the
/// same targets of the same packages (`cargo test --workspace`, `cargo bench -p
/// balancer-tests`), so that Cargo resolves the dependencies' features as it did for them
/// and reuses what it compiled. Built alone, `-p balancer-agent` resolves them differently
/// and compiles the agent and a good part of its dependencies a second time, the XDP
/// program included: minutes of every CI run.
const BUILD_ARGS: [&str; 4] = ["build", "--workspace", "--bins", "--tests"];
include!("build_args.rs");

fn build_agent(release: bool) -> Result<PathBuf> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("the tests crate lives in the workspace")?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let args: &[&str] = if release {
        &RELEASE_BUILD_ARGS
    } else {
        &BUILD_ARGS
    };
    let mut cargo = Command::new(cargo);
    without_run_env(&mut cargo);
    let output = cargo
        .current_dir(workspace)
        .args(args)
        .arg("--message-format=json")
        .stdin(Stdio::null())
        .output()
        .context("running cargo build")?;
    if !output.status.success() {
        bail!(
            "cargo {} failed:\n{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        // Not the unit tests of its main.rs, which `--tests` builds under the same name.
        if message["reason"] == "compiler-artifact"
            && message["target"]["name"] == "balancer-agent"
            && message["profile"]["test"] == false
            && message["target"]["kind"]
                .as_array()
                .is_some_and(|kinds| kinds.iter().any(|k| k == "bin"))
        {
            if let Some(executable) = message["executable"].as_str() {
                return Ok(executable.into());
            }
        }
    }
    bail!(
        "cargo {} named no balancer-agent executable",
        args.join(" ")
    )
}
