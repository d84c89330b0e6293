//! End-to-end harness: network namespaces joined by veth pairs, the processes that run in
//! them, and clients that originate traffic inside them. Traffic never leaves namespaces that
//! the harness created itself, and every namespace and process is owned by a guard that
//! removes it, also when a test fails.

pub mod agent;
pub mod backends;
pub mod bench;
pub mod client;
pub mod competitors;
pub mod llama;
pub mod netns;
pub mod process;
pub mod real_backend;
pub mod sim;
pub mod test_run;
pub mod topology;

use std::sync::{Mutex, MutexGuard};

use anyhow::{bail, Context, Result};

/// Fails with a clear message unless we run as root.
pub fn require_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the end-to-end harness needs root (network namespaces, veth pairs, XDP): \
             run the tests as root"
        );
    }
    Ok(())
}

/// Holds off other tests of this process that take it: namespace names are per process, and
/// the end-of-test checks count every child process.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    // A test that failed while holding the lock has cleaned up behind itself all the same.
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// This process's children, as `pid (command) state`, zombies included.
pub fn child_processes() -> Result<Vec<String>> {
    let me = std::process::id().to_string();
    let mut children = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        if !entry
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        let path = entry.path().join("stat");
        // Processes come and go while we look.
        let Ok(stat) = std::fs::read_to_string(&path) else {
            continue;
        };
        // `pid (comm) state ppid ...`, where comm may hold spaces and parentheses.
        let (head, tail) = stat
            .rsplit_once(')')
            .with_context(|| format!("bad {}", path.display()))?;
        let mut fields = tail.split_whitespace();
        let (state, ppid) = (fields.next(), fields.next());
        if ppid == Some(me.as_str()) {
            children.push(format!("{head}) {}", state.unwrap_or("?")));
        }
    }
    Ok(children)
}

/// Fails if a namespace of this process or a child process remains; for the end of a test,
/// after its topology has been dropped.
pub fn check_nothing_remains() -> Result<()> {
    let namespaces = netns::remaining()?;
    let children = child_processes()?;
    let pins = netns::remaining_pins()?;
    if !namespaces.is_empty() || !children.is_empty() || !pins.is_empty() {
        bail!(
            "left behind: namespaces {namespaces:?}, child processes {children:?}, pins {pins:?}"
        );
    }
    Ok(())
}
