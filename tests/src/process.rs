//! Child processes that cannot outlive the test that started them.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// How long a process gets between SIGTERM and SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(50);

/// Runs `cmd` to completion and returns its stdout; a non-zero exit is an error that shows
/// the command and its stderr.
pub fn run(cmd: &mut Command) -> Result<String> {
    let Output {
        status,
        stdout,
        stderr,
    } = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!(
            "{cmd:?} failed ({status}): {}",
            String::from_utf8_lossy(&stderr).trim()
        );
    }
    String::from_utf8(stdout).with_context(|| format!("{cmd:?} printed non-UTF-8"))
}

/// A spawned process whose stdout and stderr go to a log file. Dropping the guard stops it:
/// SIGTERM, then SIGKILL after [`STOP_GRACE`], and reaps it.
pub struct Process {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Process {
    pub fn spawn(name: impl Into<String>, cmd: Command, log: &Path) -> Result<Self> {
        let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
        Self::spawn_to(name.into(), cmd, log, out)
    }

    /// [`Process::spawn`], adding to `log` what is in it already: for a process that takes
    /// over from an earlier one whose log is being read.
    pub fn spawn_appending(name: impl Into<String>, cmd: Command, log: &Path) -> Result<Self> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        Self::spawn_to(name.into(), cmd, log, out)
    }

    fn spawn_to(name: String, mut cmd: Command, log: &Path, out: File) -> Result<Self> {
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {name}: {cmd:?}"))?;
        Ok(Self {
            name,
            child,
            log: log.to_owned(),
        })
    }

    pub fn pid(&self) -> libc::pid_t {
        libc::pid_t::try_from(self.child.id()).expect("pids fit in pid_t")
    }

    pub fn signal(&self, signal: libc::c_int) -> Result<()> {
        // SAFETY: kill has no memory effects; the child is not reaped yet (we hold it), so the
        // pid still names it.
        if unsafe { libc::kill(self.pid(), signal) } != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("signalling {}", self.name));
        }
        Ok(())
    }

    /// Everything the process has written so far.
    pub fn output(&self) -> String {
        std::fs::read(&self.log)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_else(|e| format!("<cannot read {}: {e}>", self.log.display()))
    }

    /// Where the output ends now; a later [`Process::wait_for_line`] can start there to ignore
    /// what came before.
    pub fn output_len(&self) -> u64 {
        std::fs::metadata(&self.log).map_or(0, |m| m.len())
    }

    /// Waits until a complete output line written at or after byte `from` satisfies `pred`,
    /// and returns it. Fails when the process exits first or `timeout` passes.
    pub fn wait_for_line(
        &mut self,
        from: u64,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Result<String> {
        let deadline = Instant::now() + timeout;
        let mut file = File::open(&self.log)?;
        file.seek(SeekFrom::Start(from))?;
        let mut pending = String::new();
        loop {
            // Check for exit before reading, so that a line written just before exiting is
            // still seen.
            let exited = self.child.try_wait()?;
            let mut chunk = Vec::new();
            file.read_to_end(&mut chunk)?;
            pending.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = pending.find('\n') {
                let line: String = pending.drain(..=end).collect();
                if pred(&line) {
                    return Ok(line.trim_end().to_owned());
                }
            }
            if let Some(status) = exited {
                bail!(
                    "{} exited ({status}) before the expected line; its output:\n{}",
                    self.name,
                    self.output()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not print the expected line within {timeout:?}; its output:\n{}",
                    self.name,
                    self.output()
                );
            }
            sleep(POLL);
        }
    }

    /// SIGTERM, then SIGKILL if it is still running after `grace`; returns how it ended.
    pub fn stop(&mut self, grace: Duration) -> Result<ExitStatus> {
        if let Some(status) = self.child.try_wait()? {
            return Ok(status);
        }
        self.signal(libc::SIGTERM)?;
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            sleep(POLL);
        }
        self.child.kill()?;
        let status = self.child.wait()?;
        bail!(
            "{} ignored SIGTERM for {grace:?} and was killed ({status})",
            self.name
        )
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if let Err(e) = self.stop(STOP_GRACE) {
            eprintln!("stopping {}: {e:#}", self.name);
        }
    }
}
