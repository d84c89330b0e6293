//! `demo`, run by `cargo xtask demo` (as root): the worked example of the design brief, live
//! in network namespaces. Four inference servers behind the VIP 192.0.2.60:8000, the agent
//! scraping them every 2 s, a workload whose 2,000-token preamble is hinted to its home until
//! the home is full and the agent spills it, one completion streamed with curl, and
//! 10.4.0.14 drained until it leaves the pool. It ends by itself after about a minute
//! (`--ci`: about half), or on Ctrl-C, and leaves nothing behind; `--keep` leaves it all
//! running and `--clean` removes it.
//!
//! Two processes: the one started (the front) starts a second one (the runner) in a session
//! of its own, which owns the namespaces and every process in them, and relays its output.
//! Ctrl-C reaches the front only, which passes it on, so the runner can stop things in
//! order. With `--keep` the runner stays when its work is done while the front returns.

#[path = "../demo_out.rs"]
mod out;
#[path = "../demo_scenario.rs"]
mod scenario;
#[path = "../demo_workload.rs"]
mod workload;

use std::ffi::OsString;
use std::io::{IsTerminal, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use balancer_tests::netns;
use clap::{Parser, ValueEnum};

#[derive(Parser)]
#[command(
    about = "The balancer's worked example, live in network namespaces (run by `cargo xtask demo`)"
)]
struct Args {
    /// Shorter (about 25 s), and plain text without terminal control codes: for tests.
    #[arg(long = "ci", visible_alias = "non-interactive")]
    ci: bool,
    /// Leave the topology, the servers and the agent running at the end, and say how to
    /// explore them; `--clean` removes them.
    #[arg(long, conflicts_with = "clean")]
    keep: bool,
    /// Remove a demo left running by `--keep` (and whatever a killed demo left).
    #[arg(long)]
    clean: bool,
    /// llama-server instead of the simulators (needs --llama-server and --model).
    #[arg(long, requires_all = ["llama_server", "model"])]
    real: bool,
    /// The llama-server executable, for --real.
    #[arg(long)]
    llama_server: Option<PathBuf>,
    /// The GGUF model, for --real.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Seconds from the start of the workload to the end.
    #[arg(long)]
    duration: Option<u64>,
    /// The balancer-agent executable [default: next to this one].
    #[arg(long)]
    agent: Option<PathBuf>,
    /// The inference-sim executable [default: next to this one].
    #[arg(long)]
    sim: Option<PathBuf>,
    /// The xdp-pass executable [default: next to this one].
    #[arg(long)]
    xdp_pass: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Color::Auto)]
    color: Color,
    /// Internal: the process that runs the demo (started by the front).
    #[arg(long, hide = true)]
    runner: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Color {
    Auto,
    Always,
    Never,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = if args.clean {
        clean()
    } else if args.runner {
        runner(&args)
    } else {
        front(&args)
    };
    result.unwrap_or_else(|e| {
        eprintln!("demo: {e:#}");
        ExitCode::FAILURE
    })
}

/// One line, and no further: the demo builds namespaces and attaches XDP programs.
fn require_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the demo needs root (network namespaces, veth pairs, XDP): run `cargo xtask demo` as root");
    }
    Ok(())
}

/// `name` next to this executable, unless given.
fn sibling(given: &Option<PathBuf>, name: &str) -> Result<PathBuf> {
    let path = match given {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("this executable has no directory")?
            .join(name),
    };
    if !path.is_file() {
        bail!(
            "{} not found: build it first (`cargo xtask demo` builds everything)",
            path.display()
        );
    }
    Ok(path)
}

/// The runner of the front: the pid signals go to.
static RUNNER: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward_signal(_: libc::c_int) {
    let pid = RUNNER.load(Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe.
        unsafe { libc::kill(pid, libc::SIGINT) };
    }
}

extern "C" fn request_stop(_: libc::c_int) {
    out::request_stop();
}

fn on_signals(signals: &[libc::c_int], handler: extern "C" fn(libc::c_int)) {
    for &signal in signals {
        // SAFETY: the handlers only touch atomics and call kill.
        unsafe { libc::signal(signal, handler as libc::sighandler_t) };
    }
}

fn exit_code(status: ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    let code = status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1);
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// Starts the runner in a session of its own, relays its output until it closes it, and
/// passes Ctrl-C on to it.
fn front(args: &Args) -> Result<ExitCode> {
    require_root()?;
    let color = match args.color {
        Color::Always => true,
        Color::Never => false,
        Color::Auto => !args.ci && std::io::stdout().is_terminal(),
    };
    let mut runner_args: Vec<OsString> = vec!["--runner".into(), "--color".into()];
    runner_args.push(if color { "always" } else { "never" }.into());
    for (flag, on) in [
        ("--ci", args.ci),
        ("--keep", args.keep),
        ("--real", args.real),
    ] {
        if on {
            runner_args.push(flag.into());
        }
    }
    for (flag, path) in [
        ("--agent", sibling(&args.agent, "balancer-agent")?),
        ("--sim", sibling(&args.sim, "inference-sim")?),
        ("--xdp-pass", sibling(&args.xdp_pass, "xdp-pass")?),
    ] {
        runner_args.push(flag.into());
        runner_args.push(path.into());
    }
    for (flag, path) in [
        ("--llama-server", &args.llama_server),
        ("--model", &args.model),
    ] {
        if let Some(path) = path {
            runner_args.push(flag.into());
            runner_args.push(path.into());
        }
    }
    if let Some(d) = args.duration {
        runner_args.push("--duration".into());
        runner_args.push(d.to_string().into());
    }

    let (mut reader, writer) = std::io::pipe().context("creating a pipe")?;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(&runner_args)
        .stdin(Stdio::null())
        .stdout(writer.try_clone()?)
        .stderr(writer);
    // SAFETY: setsid and prctl are async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            // Out of the terminal's process group: Ctrl-C comes through us.
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // If we die, the runner stops and cleans up (until --keep detaches it).
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting the demo's runner")?;
    // Our copies of the pipe's write end go with the command: the pipe ends with the runner.
    drop(cmd);
    RUNNER.store(
        i32::try_from(child.id()).expect("pids fit in i32"),
        Ordering::SeqCst,
    );
    on_signals(&[libc::SIGINT, libc::SIGTERM, libc::SIGHUP], forward_signal);

    let mut buf = [0u8; 8192];
    let mut stdout = std::io::stdout();
    loop {
        match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                // Whoever reads us may be gone; the runner finishes all the same.
                let _ = stdout.write_all(&buf[..n]).and_then(|()| stdout.flush());
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e).context("reading the runner's output"),
        }
    }
    if args.keep {
        // A kept demo closes its output and runs on; one that failed exits.
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Some(status) = child.try_wait()? {
                return Ok(exit_code(status));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        return Ok(ExitCode::SUCCESS);
    }
    Ok(exit_code(child.wait()?))
}

fn runner(args: &Args) -> Result<ExitCode> {
    on_signals(&[libc::SIGINT, libc::SIGTERM], request_stop);
    let real = match (args.real, &args.llama_server, &args.model) {
        (false, _, _) => None,
        (true, Some(llama_server), Some(model)) => Some(scenario::Real {
            llama_server: llama_server.clone(),
            model: model.clone(),
        }),
        (true, _, _) => bail!("--real needs --llama-server and --model"),
    };
    let options = scenario::Options {
        ci: args.ci,
        keep: args.keep,
        duration: args.duration.map(Duration::from_secs),
        agent: sibling(&args.agent, "balancer-agent")?,
        sim: sibling(&args.sim, "inference-sim")?,
        xdp_pass: sibling(&args.xdp_pass, "xdp-pass")?,
        real,
    };
    let out = out::Out::new(args.color == Color::Always);
    scenario::run(&options, &out)?;
    if out::stop_requested() {
        out.line(out::Style::Plain, "interrupted");
        return Ok(ExitCode::from(130));
    }
    Ok(ExitCode::SUCCESS)
}

/// Whether `pid` is a demo runner that is alive.
fn is_runner(pid: libc::pid_t) -> bool {
    let alive = std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            != Some("Z")
    });
    alive
        && std::fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| c.split(|b| *b == 0).any(|arg| arg == b"--runner"))
}

/// Stops every demo that `--keep` left running (they clean up behind themselves), then
/// removes whatever demos or test runs that died left.
fn clean() -> Result<ExitCode> {
    require_root()?;
    let mut stopped = 0;
    if let Ok(entries) = std::fs::read_dir(scenario::STATE_DIR) {
        for entry in entries {
            let path = entry?.path();
            if path.extension().is_none_or(|e| e != "state") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let pid = text
                .lines()
                .find_map(|l| l.strip_prefix("pid="))
                .and_then(|p| p.parse::<libc::pid_t>().ok());
            if let Some(pid) = pid.filter(|p| is_runner(*p)) {
                stop_runner(pid, &path)?;
                stopped += 1;
            }
            let _ = std::fs::remove_file(&path);
        }
    }
    netns::sweep_stale()?;
    if stopped == 0 {
        println!("no kept demo was running; nothing of a demo is left");
    } else {
        println!("removed: the kept demo's agent, servers and namespaces are gone");
    }
    Ok(ExitCode::SUCCESS)
}

fn stop_runner(pid: libc::pid_t, state: &Path) -> Result<()> {
    println!("stopping the kept demo (pid {pid}, {})", state.display());
    // SAFETY: kill has no memory effects.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(60);
    while is_runner(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    if is_runner(pid) {
        println!("it did not stop within 60 s: killing it; its leftovers are removed next");
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while is_runner(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(())
}
