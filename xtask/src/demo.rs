//! `cargo xtask demo`: checks the prerequisites (it installs nothing: that is `cargo xtask
//! setup`), builds the agent and the tests crate's binaries, then becomes the demo binary
//! (`tests/src/bin/demo.rs`), which shows the design brief's worked example live in network
//! namespaces and removes everything when it ends.

use std::{
    env,
    ffi::OsString,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Result};

use crate::{cmd, real_backend, setup};

/// What the demo runs besides the shell's basics: the harness builds namespaces with `ip`,
/// turns checksum offload off with `ethtool`, checks links with `ping`; the demo streams with
/// `curl`. `cargo xtask setup` installs them.
const TOOLS: &[&str] = &["ip", "ethtool", "ping", "curl"];
const BINARIES: &[&str] = &["demo", "inference-sim", "xdp-pass"];

pub struct Options {
    pub keep: bool,
    pub clean: bool,
    pub real: bool,
    pub ci: bool,
    pub duration: Option<u64>,
}

pub fn run(options: &Options) -> Result<()> {
    if !cmd::is_root()? {
        bail!("cargo xtask demo needs root (network namespaces, veth pairs, XDP); run it as root");
    }
    let debug = target_dir().join("debug");
    let demo = debug.join("demo");

    if options.clean {
        // Nothing to build to clean up, unless the demo was never built.
        if !demo.is_file() {
            build()?;
        }
        return Err(exec(Command::new(&demo).arg("--clean")));
    }

    println!("==> checking prerequisites");
    setup::check_build_prerequisites()?;
    let missing: Vec<&str> = TOOLS.iter().copied().filter(|t| !on_path(t)).collect();
    if !missing.is_empty() {
        bail!(
            "{} not found; run `cargo xtask setup` (as root)",
            missing.join(", ")
        );
    }
    println!("ok: {}", TOOLS.join(", "));
    let real = if options.real {
        if !real_backend::is_present() {
            bail!(
                "--real needs llama-server and its model: run `cargo xtask real-backend` \
                 first (it builds them into {}, several minutes once)",
                real_backend::cache_root().display()
            );
        }
        Some(real_backend::ensure_present()?)
    } else {
        None
    };

    println!("==> building the agent, the simulator and the demo");
    build()?;

    let mut command = Command::new(&demo);
    command
        .arg("--agent")
        .arg(debug.join("balancer-agent"))
        .arg("--sim")
        .arg(debug.join("inference-sim"))
        .arg("--xdp-pass")
        .arg(debug.join("xdp-pass"));
    for (flag, on) in [("--keep", options.keep), ("--ci", options.ci)] {
        if on {
            command.arg(flag);
        }
    }
    if let Some(real) = real {
        command
            .arg("--real")
            .arg("--llama-server")
            .arg(real.llama_server)
            .arg("--model")
            .arg(real.model);
    }
    if let Some(seconds) = options.duration {
        command.arg("--duration").arg(seconds.to_string());
    }
    println!(
        "==> the demo ({}; Ctrl-C stops it and cleans up)",
        if options.ci {
            "about 30 s"
        } else {
            "about a minute"
        }
    );
    // The demo takes over this process: Ctrl-C and the exit status are its own.
    Err(exec(&mut command))
}

/// Replaces this process with `command`; returns only if that fails.
fn exec(command: &mut Command) -> anyhow::Error {
    let shown = cmd::display(command);
    anyhow::Error::new(command.exec()).context(format!("running {shown}"))
}

fn build() -> Result<()> {
    let mut cargo = cmd::cargo();
    cargo
        .current_dir(cmd::workspace_root())
        .args(["build", "-p", "balancer-agent", "--bin", "balancer-agent"])
        .args(["-p", "balancer-tests"]);
    for bin in BINARIES {
        cargo.args(["--bin", bin]);
    }
    cmd::run(&mut cargo)
}

/// Where cargo puts what it builds.
fn target_dir() -> PathBuf {
    env::var_os("CARGO_TARGET_DIR").map_or_else(
        || cmd::workspace_root().join("target"),
        |d| {
            let d = PathBuf::from(d);
            if d.is_absolute() {
                d
            } else {
                cmd::workspace_root().join(d)
            }
        },
    )
}

fn on_path(tool: &str) -> bool {
    let path =
        env::var_os("PATH").unwrap_or_else(|| OsString::from("/usr/sbin:/usr/bin:/sbin:/bin"));
    env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .any(|dir| is_executable(&dir.join(tool)))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
