//! Helpers for running child processes consistently.

use std::{
    env,
    ffi::OsStr,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

/// Prepends `$HOME/.cargo/bin` to this process's PATH so every child inherits
/// it: rustup-installed tools (cargo, bpf-linker) must be found even when the
/// caller's PATH (CI, sudo) lacks them.
pub fn put_cargo_bin_on_path() {
    let Some(home) = env::var_os("HOME") else {
        return;
    };
    let cargo_bin = Path::new(&home).join(".cargo/bin");
    let current = env::var_os("PATH").unwrap_or_default();
    if env::split_paths(&current).any(|p| p == cargo_bin) {
        return;
    }
    let joined = env::join_paths(std::iter::once(cargo_bin).chain(env::split_paths(&current)))
        .expect("PATH entries come from PATH itself or HOME");
    // Runs first thing in main, before any other thread exists.
    env::set_var("PATH", joined);
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

include!("../../tests/src/build_args.rs");

/// `cargo` from PATH rather than `$CARGO`: `$CARGO` points at the toolchain
/// binary and would bypass rustup's `+toolchain` handling. Without the environment Cargo
/// set for the xtask itself, as the tests' own builds do without theirs.
pub fn cargo() -> Command {
    let mut cargo = Command::new("cargo");
    without_run_env(&mut cargo);
    cargo
}

/// Human-readable rendering of a command, including env overrides.
pub fn display(cmd: &Command) -> String {
    let envs = cmd
        .get_envs()
        .filter_map(|(k, v)| v.map(|v| format!("{}={}", k.to_string_lossy(), quote(v))));
    let words = std::iter::once(quote(cmd.get_program())).chain(cmd.get_args().map(quote));
    envs.chain(words).collect::<Vec<_>>().join(" ")
}

fn quote(s: &OsStr) -> String {
    let s = s.to_string_lossy();
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%^".contains(c));
    if plain {
        s.into_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Prints and runs `cmd`, failing unless it exits successfully.
pub fn run(cmd: &mut Command) -> Result<()> {
    let shown = display(cmd);
    println!("$ {shown}");
    // CI runs without a terminal on stdin; nothing we run should ever prompt.
    let status = cmd
        .stdin(Stdio::null())
        .status()
        .with_context(|| format!("failed to start `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Runs a read-only query and returns its stdout; not printed, since setup
/// reports one line per step rather than every probe it makes.
pub fn query(cmd: &mut Command) -> Result<String> {
    let shown = display(cmd);
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("failed to start `{shown}`"))?;
    if !out.status.success() {
        bail!(
            "`{shown}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8(out.stdout).with_context(|| format!("`{shown}` printed non-UTF-8 output"))
}

/// Effective uid from /proc/self/status, avoiding a libc dependency.
pub fn is_root() -> Result<bool> {
    let status = fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .context("no effective uid in /proc/self/status")?;
    Ok(euid == "0")
}
