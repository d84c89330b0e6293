//! Starting `inference-sim` from a test, a benchmark or the demo, and its admin endpoints.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::client;
use crate::process::Process;

const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// A running simulator; dropping it stops the process.
pub struct SimServer {
    pub process: Process,
    /// The first API listener.
    pub api: SocketAddr,
    /// The first metrics listener.
    pub metrics: SocketAddr,
}

impl SimServer {
    /// Starts `binary` with `args`, logging to `log`, and waits until it serves. Without a
    /// `--listen` it listens on an ephemeral loopback port, and without `--metrics-port` its
    /// metrics do too.
    pub fn start(binary: &Path, log: &Path, args: &[&str]) -> Result<Self> {
        let mut cmd = Command::new(binary);
        cmd.args(args);
        if !args.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        if !args.contains(&"--metrics-port") {
            cmd.args(["--metrics-port", "0"]);
        }
        Self::spawn("inference-sim", cmd, log)
    }

    /// Starts `cmd`, a complete simulator command line (for instance one that runs it in a
    /// network namespace), and waits until it serves. `name` names it in errors.
    pub fn spawn(name: &str, cmd: Command, log: &Path) -> Result<Self> {
        let mut process = Process::spawn(name, cmd, log)?;
        process.wait_for_line(0, READY_TIMEOUT, |line| line.trim_end() == "ready")?;
        let output = process.output();
        let listener = |role: &str| -> Result<SocketAddr> {
            let suffix = format!(" ({role})");
            output
                .lines()
                .filter_map(|l| l.strip_prefix("listening on ")?.strip_suffix(&suffix))
                .map(|a| a.parse().with_context(|| format!("bad address {a:?}")))
                .next()
                .with_context(|| format!("no {role} listener in:\n{output}"))?
        };
        let (api, metrics) = (listener("api")?, listener("metrics")?);
        Ok(Self {
            process,
            api,
            metrics,
        })
    }

    /// `GET /admin/state`: the engine's own picture.
    pub fn state(&self) -> Result<Value> {
        let reply = client::get(self.metrics, "/admin/state")?;
        if reply.status() != 200 {
            bail!("/admin/state answered {}: {}", reply.status(), reply.body);
        }
        reply.json()
    }

    /// `POST /admin/fault` with `fault` (e.g. `{"kind": "status_503"}`).
    pub fn fault(&self, fault: &Value) -> Result<()> {
        let reply = client::post(self.metrics, "/admin/fault", fault)?;
        if reply.status() != 200 {
            bail!("setting fault {fault}: {} {}", reply.status(), reply.body);
        }
        Ok(())
    }

    /// `GET /metrics` on the metrics port.
    pub fn scrape(&self) -> Result<String> {
        let reply = client::get(self.metrics, "/metrics")?;
        if reply.status() != 200 {
            bail!("/metrics answered {}: {}", reply.status(), reply.body);
        }
        Ok(reply.body)
    }
}
