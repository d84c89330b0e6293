//! Named network namespaces that delete themselves, and the processes and threads that run
//! inside them.

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;

use anyhow::{ensure, Context, Result};

use crate::process::{run, Process};

/// Every namespace of the harness is called `blt-<pid>-<role>`, where pid is the test process
/// that made it: that is how a later run tells a crashed run's leftovers from a live run's.
pub const PREFIX: &str = "blt-";

/// A network namespace, deleted on drop together with the processes spawned into it.
pub struct Netns {
    name: String,
    processes: Vec<Process>,
}

impl Netns {
    /// Creates `blt-<our pid>-<role>` with its loopback up.
    pub fn create(role: &str) -> Result<Self> {
        crate::require_root()?;
        let name = format!("{PREFIX}{}-{role}", std::process::id());
        run(Command::new("ip").args(["netns", "add", &name]))?;
        let ns = Self {
            name,
            processes: Vec::new(),
        };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// A command that runs `program` inside the namespace.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }

    /// Runs `program args` inside the namespace to completion; returns its stdout.
    pub fn exec(&self, program: &str, args: &[&str]) -> Result<String> {
        run(self.command(program).args(args))
    }

    /// Runs `ip args...` against the namespace.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        run(Command::new("ip").args(["-n", &self.name]).args(args))
    }

    /// Packets received so far on interface `dev`.
    pub fn rx_packets(&self, dev: &str) -> Result<u64> {
        let json: serde_json::Value =
            serde_json::from_str(&self.ip(&["-j", "-s", "link", "show", dev])?)?;
        json[0]["stats64"]["rx"]["packets"]
            .as_u64()
            .with_context(|| format!("no rx packet count for {dev} in {json}"))
    }

    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        self.exec("sysctl", &["-q", "-w", &format!("{key}={value}")])
            .map(drop)
    }

    /// Starts `cmd` (made with [`Netns::command`]) and keeps it until the namespace drops.
    pub fn spawn(&mut self, name: &str, cmd: Command, log: &Path) -> Result<&mut Process> {
        let process = Process::spawn(format!("{name} in {}", self.name), cmd, log)?;
        self.processes.push(process);
        Ok(self.processes.last_mut().expect("just pushed"))
    }

    /// Runs `f` on a thread that has joined this namespace, so that the sockets it opens live
    /// here; a socket keeps its namespace when it is handed back to another thread.
    pub fn enter<T: Send>(&self, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        let path = format!("/run/netns/{}", self.name);
        let ns = File::open(&path).with_context(|| format!("opening {path}"))?;
        std::thread::scope(|scope| {
            scope
                .spawn(move || {
                    // SAFETY: a valid namespace fd; CLONE_NEWNET only changes this thread's
                    // network namespace, and the thread ends with `f`.
                    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                        return Err(std::io::Error::last_os_error())
                            .with_context(|| format!("entering {path}"));
                    }
                    f()
                })
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Processes first: a process inside would keep the namespace, and its links, alive.
        self.processes.clear();
        if let Err(e) = delete(&self.name) {
            eprintln!("{e:#}");
        }
    }
}

/// Kills whatever still runs in the namespace, then deletes it.
fn delete(name: &str) -> Result<()> {
    let pids = run(Command::new("ip").args(["netns", "pids", name]))?;
    for pid in pids.split_whitespace() {
        let pid: libc::pid_t = pid.parse().with_context(|| format!("pid {pid:?}"))?;
        // SAFETY: kill has no memory effects.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    run(Command::new("ip").args(["netns", "del", name]))
        .map(drop)
        .with_context(|| format!("deleting namespace {name}"))
}

/// The pid of the test run that made `name`, if the harness made it.
fn owner(name: &str) -> Option<libc::pid_t> {
    name.strip_prefix(PREFIX)?.split('-').next()?.parse().ok()
}

/// Whether `pid` runs; a zombie does not (a killed run stays one until its parent reaps it).
fn alive(pid: libc::pid_t) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, fields)| fields.split_whitespace().next())
            != Some("Z")
    })
}

/// The harness's namespaces that exist now, as (name, pid of the run that made it).
fn ours() -> Result<Vec<(String, libc::pid_t)>> {
    let list = run(Command::new("ip").args(["netns", "list"]))?;
    Ok(list
        .lines()
        .filter_map(|line| {
            let name = line.split_whitespace().next()?;
            Some((name.to_owned(), owner(name)?))
        })
        .collect())
}

/// Names of the namespaces this process made that still exist.
pub fn remaining() -> Result<Vec<String>> {
    let me = libc::pid_t::try_from(std::process::id())?;
    Ok(ours()?
        .into_iter()
        .filter(|(_, pid)| *pid == me)
        .map(|(name, _)| name)
        .collect())
}

/// A temporary directory named like our namespaces, so that [`sweep_stale`] finds it if this
/// run dies before its guard removes it.
pub fn temp_dir() -> Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(&format!("{PREFIX}{}-", std::process::id()))
        .tempdir()
        .context("creating a temporary directory")
}

/// A bpffs of its own for an agent's pins (`agent.pin_dir`), mounted on a temporary
/// directory named like our namespaces so that [`sweep_stale`] finds it if this run dies.
/// Its own because `ip netns exec` gives the agent a fresh `/sys`, without the host's
/// `/sys/fs/bpf`. Dropping it unmounts it, which unpins whatever is left there: the program
/// leaves the interfaces whose links were pinned.
pub struct PinDir {
    mount: std::path::PathBuf,
}

impl PinDir {
    pub fn new(role: &str) -> Result<Self> {
        let mount =
            std::env::temp_dir().join(format!("{PREFIX}{}-{role}-bpffs", std::process::id()));
        std::fs::create_dir(&mount).with_context(|| format!("creating {}", mount.display()))?;
        let dir = PinDir { mount };
        let target = std::ffi::CString::new(dir.mount.as_os_str().as_encoded_bytes())?;
        // SAFETY: NUL-terminated strings that outlive the call; no mount data.
        let rc = unsafe {
            libc::mount(
                c"bpf".as_ptr(),
                target.as_ptr(),
                c"bpf".as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        ensure!(
            rc == 0,
            "mounting bpffs on {}: {}",
            dir.mount.display(),
            std::io::Error::last_os_error()
        );
        Ok(dir)
    }

    /// The pin directory itself, inside the mount: the agent creates it.
    pub fn path(&self) -> std::path::PathBuf {
        self.mount.join("balancer")
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        unmount(&self.mount);
        if let Err(e) = std::fs::remove_dir(&self.mount) {
            eprintln!("removing {}: {e}", self.mount.display());
        }
    }
}

/// Detaches the mount at `path` (lazily: nothing can keep it busy).
fn unmount(path: &Path) {
    let Ok(target) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return;
    };
    // SAFETY: a NUL-terminated path that outlives the call.
    if unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) } != 0 {
        eprintln!(
            "unmounting {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        );
    }
}

/// Our bpffs mounts that this process made and that are still mounted.
pub fn remaining_pins() -> Result<Vec<String>> {
    let me = libc::pid_t::try_from(std::process::id())?;
    Ok(bpffs_mounts()?
        .into_iter()
        .filter(|(_, pid)| *pid == me)
        .map(|(path, _)| path.display().to_string())
        .collect())
}

/// Our bpffs mounts and the pid of the test run that made each.
fn bpffs_mounts() -> Result<Vec<(std::path::PathBuf, libc::pid_t)>> {
    let mounts =
        std::fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
    let tmp = std::env::temp_dir();
    Ok(mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_, point, kind) = (fields.next()?, fields.next()?, fields.next()?);
            let point = Path::new(point);
            if kind != "bpf" || point.parent()? != tmp {
                return None;
            }
            let pid = owner(&point.file_name()?.to_string_lossy())?;
            Some((point.to_owned(), pid))
        })
        .collect())
}

/// Deletes the namespaces of test runs that are no longer alive (crashed or killed before
/// their guards ran) with whatever still runs inside them, and their temporary directories.
pub fn sweep_stale() -> Result<()> {
    for (name, pid) in ours()? {
        if !alive(pid) {
            eprintln!("deleting namespace {name}, left by dead test run {pid}");
            delete(&name)?;
        }
    }
    // Before the directories: a mount would keep its mount point busy.
    for (path, pid) in bpffs_mounts()? {
        if !alive(pid) {
            eprintln!("unmounting {}, left by dead test run {pid}", path.display());
            unmount(&path);
        }
    }
    for entry in std::fs::read_dir(std::env::temp_dir())? {
        let path = entry?.path();
        let stale = path
            .file_name()
            .and_then(|name| owner(&name.to_string_lossy()))
            .is_some_and(|pid| !alive(pid));
        if stale && path.is_dir() {
            eprintln!("deleting {}, left by a dead test run", path.display());
            std::fs::remove_dir_all(&path)
                .with_context(|| format!("deleting {}", path.display()))?;
        }
    }
    Ok(())
}
