//! Inference simulators in the backends of the gateway topology, one per backend, owned by
//! the test: it kills and restarts them, and asks them for their own picture from inside
//! their namespaces (nothing outside a backend can reach its address except through the
//! gateway).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Deserialize;
use serde_json::Value;

use crate::process::STOP_GRACE;
use crate::sim::launch::SimServer;
use crate::topology::{backend_name, Family, Topology, BACKENDS, BACKEND_PORT, METRICS_PORT};

/// What `GET /admin/state` reports (the fields the tests read).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct SimState {
    pub dialect: String,
    pub running: u64,
    pub waiting: u64,
    pub kv_usage: f64,
    /// Completion requests received, health checks included.
    pub requests_received: u64,
}

/// `inference-sim` in every backend of a topology, on the backend's IPv4 address (API on
/// [`BACKEND_PORT`], metrics on [`METRICS_PORT`]), named after the backend (`--name b1`, so
/// that every answer says who gave it). Dropping it stops them.
pub struct SimBackends<'t> {
    topology: &'t Topology,
    binary: PathBuf,
    /// `None` once killed.
    servers: Vec<Option<SimServer>>,
    /// The extra arguments each one was started with.
    args: Vec<Vec<String>>,
    /// Simulators started so far: each gets a log file of its own, so that a restart keeps
    /// the log of its predecessor.
    started: usize,
}

impl<'t> SimBackends<'t> {
    /// Starts `binary` in every backend, backend `i` with the extra arguments `args[i]`.
    pub fn start(topology: &'t Topology, binary: &Path, args: &[Vec<String>]) -> Result<Self> {
        anyhow::ensure!(args.len() == BACKENDS, "arguments for {BACKENDS} backends");
        let mut sims = Self {
            topology,
            binary: binary.to_owned(),
            servers: (0..BACKENDS).map(|_| None).collect(),
            args: vec![Vec::new(); BACKENDS],
            started: 0,
        };
        for (i, args) in args.iter().enumerate() {
            sims.restart(i, args)?;
        }
        Ok(sims)
    }

    /// Backend `i`'s API address.
    pub fn api(&self, i: usize) -> SocketAddr {
        SocketAddr::new(Family::V4.backend(i), BACKEND_PORT)
    }

    /// Backend `i`'s metrics and admin address.
    pub fn metrics(&self, i: usize) -> SocketAddr {
        SocketAddr::new(Family::V4.backend(i), METRICS_PORT)
    }

    /// The extra arguments backend `i`'s simulator runs with; `None` if it does not run.
    pub fn args(&self, i: usize) -> Option<&[String]> {
        self.servers[i].as_ref().map(|_| self.args[i].as_slice())
    }

    /// Stops backend `i`'s simulator if it runs (SIGTERM), and starts a new one with `args`.
    pub fn restart(&mut self, i: usize, args: &[String]) -> Result<()> {
        if let Some(mut old) = self.servers[i].take() {
            old.process.stop(STOP_GRACE)?;
        }
        let name = backend_name(i);
        self.started += 1;
        let log = self
            .topology
            .dir()
            .join(format!("{name}-inference-sim-{}.log", self.started));
        let mut cmd = self.topology.backend(i).command(&self.binary);
        cmd.arg("--listen")
            .arg(self.api(i).to_string())
            .args(["--metrics-port", &METRICS_PORT.to_string(), "--name", &name])
            .args(args);
        let server = SimServer::spawn(&format!("inference-sim in {name}"), cmd, &log)?;
        self.servers[i] = Some(server);
        self.args[i] = args.to_vec();
        Ok(())
    }

    /// Kills backend `i`'s simulator (SIGKILL: no goodbye to anyone) and reaps it.
    pub fn kill(&mut self, i: usize) -> Result<()> {
        let mut server = self.servers[i]
            .take()
            .with_context(|| format!("{} runs no simulator", backend_name(i)))?;
        server.process.signal(libc::SIGKILL)?;
        server.process.stop(STOP_GRACE)?;
        Ok(())
    }

    fn server(&self, i: usize) -> Result<&SimServer> {
        self.servers[i]
            .as_ref()
            .with_context(|| format!("{} runs no simulator", backend_name(i)))
    }

    /// `GET /admin/state` of backend `i`'s simulator.
    pub fn state(&self, i: usize) -> Result<SimState> {
        let server = self.server(i)?;
        let state = self.topology.backend(i).enter(|| server.state())?;
        serde_json::from_value(state.clone())
            .with_context(|| format!("{}: unexpected /admin/state {state}", backend_name(i)))
    }

    /// `POST /admin/fault` to backend `i`'s simulator.
    pub fn fault(&self, i: usize, fault: &Value) -> Result<()> {
        let server = self.server(i)?;
        self.topology.backend(i).enter(|| server.fault(fault))
    }
}
