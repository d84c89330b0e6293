//! The balancer agent running in the gateway namespace, driven through its public interface:
//! the configuration file, signals, and its log.

use std::marker::PhantomData;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context, Result};
use serde::Serialize;

use crate::process::{Process, STOP_GRACE};
use crate::topology::{Family, Topology, BACKENDS, BACKEND_PORT, GATEWAY_INTERFACES, METRICS_PORT};

const READY_TIMEOUT: Duration = Duration::from_secs(30);
const RELOAD_TIMEOUT: Duration = Duration::from_secs(30);

/// The agent's configuration file (see the agent's docs for the keys).
#[derive(Debug, Clone, Serialize)]
pub struct AgentConfig {
    pub agent: AgentSection,
    #[serde(rename = "pool")]
    pub pools: Vec<Pool>,
}

#[derive(Debug, Clone, Serialize)]
pub struct AgentSection {
    pub interfaces: Vec<String>,
    pub control_socket: PathBuf,
}

#[derive(Debug, Clone, Serialize)]
pub struct Pool {
    pub name: String,
    pub vip: IpAddr,
    pub port: u16,
    #[serde(rename = "server")]
    pub servers: Vec<Server>,
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
            },
            pools: vec![pool("chat-v4", Family::V4), pool("chat-v6", Family::V6)],
        }
    }

    /// Sets backend `index`'s weight in every pool.
    pub fn set_weight(&mut self, index: usize, weight: u32) {
        for pool in &mut self.pools {
            pool.servers[index].weight = weight;
        }
    }

    /// Writes the file whole or not at all, so that the agent never reads half of it.
    fn write(&self, path: &Path) -> Result<()> {
        let text = toml::to_string(self).context("serialising the agent config")?;
        let partial = path.with_extension("partial");
        std::fs::write(&partial, text)?;
        std::fs::rename(&partial, path)?;
        Ok(())
    }
}

/// A running `balancer-agent run --config FILE` in the gateway namespace; it cannot outlive
/// the topology. Dropping it stops the agent (SIGTERM, then SIGKILL).
pub struct Agent<'t> {
    process: Process,
    config: PathBuf,
    _topology: PhantomData<&'t Topology>,
}

impl<'t> Agent<'t> {
    /// Starts the agent and waits until it says it is `ready`.
    pub fn start(topology: &'t Topology, binary: &Path, config: &AgentConfig) -> Result<Self> {
        let path = topology.dir().join("agent.toml");
        config.write(&path)?;
        let mut cmd = topology.gw().command(binary);
        cmd.args(["run", "--config"]).arg(&path);
        let mut process = Process::spawn("balancer-agent", cmd, &topology.dir().join("agent.log"))?;
        process.wait_for_line(0, READY_TIMEOUT, |line| {
            line.split(|c: char| !c.is_ascii_alphanumeric())
                .any(|word| word == "ready")
        })?;
        Ok(Self {
            process,
            config: path,
            _topology: PhantomData,
        })
    }

    /// Rewrites the config file, sends SIGHUP and waits for the agent to report the reload.
    pub fn reload(&mut self, config: &AgentConfig) -> Result<()> {
        config.write(&self.config)?;
        let mark = self.process.output_len();
        self.process.signal(libc::SIGHUP)?;
        let line = self.process.wait_for_line(mark, RELOAD_TIMEOUT, |line| {
            line.contains("config reloaded") || line.contains("reload failed")
        })?;
        ensure!(line.contains("config reloaded"), "agent: {line}");
        Ok(())
    }

    /// Everything the agent has logged so far.
    pub fn log(&self) -> String {
        self.process.output()
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
        .get_or_init(|| build_agent().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow!(e))
}

fn build_agent() -> Result<PathBuf> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("the tests crate lives in the workspace")?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .current_dir(workspace)
        .args([
            "build",
            "-p",
            "balancer-agent",
            "--bin",
            "balancer-agent",
            "--message-format=json",
        ])
        .stdin(Stdio::null())
        .output()
        .context("running cargo build")?;
    if !output.status.success() {
        bail!(
            "cargo build -p balancer-agent failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if message["reason"] == "compiler-artifact"
            && message["target"]["name"] == "balancer-agent"
            && message["target"]["kind"]
                .as_array()
                .is_some_and(|kinds| kinds.iter().any(|k| k == "bin"))
        {
            if let Some(executable) = message["executable"].as_str() {
                return Ok(executable.into());
            }
        }
    }
    bail!("cargo build -p balancer-agent named no balancer-agent executable")
}
