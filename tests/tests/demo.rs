//! Issue 7: the demo (`cargo xtask demo`) run non-interactively, as `demo --ci`, and its
//! output checked: the preamble's home is where the agent's rendezvous hashing puts it, at
//! least one spill from that home to another server that is up, the drained server gone
//! from the pool at the end, a completion streamed with curl, an agent restart that takes
//! the pinned maps and links over without a failed request, and nothing left behind
//! (namespaces, the demo's processes).

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use balancer_agent::affinity::{home, Member};
use balancer_tests::agent::agent_binary;
use balancer_tests::{check_nothing_remains, serial};

const DEMO: &str = env!("CARGO_BIN_EXE_demo");
const SIM: &str = env!("CARGO_BIN_EXE_inference-sim");
const XDP_PASS: &str = env!("CARGO_BIN_EXE_xdp-pass");
/// The demo takes about 35 s; past this it is interrupted (and then killed).
const LIMIT: Duration = Duration::from_secs(110);
const DRAINED: &str = "10.4.0.14:8000";

#[test]
fn the_demo_shows_spills_a_drain_and_a_stream_and_leaves_nothing_behind() {
    let _serial = serial();
    let agent = agent_binary().unwrap();
    let started = Instant::now();
    let mut child = Command::new(DEMO)
        .arg("--ci")
        .arg("--agent")
        .arg(&agent)
        .args(["--sim", SIM, "--xdp-pass", XDP_PASS])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the demo");
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let status = wait_bounded(&mut child);
    let output = reader.join().unwrap();
    let errors = errors.join().unwrap();
    println!("{output}");
    eprintln!("{errors}");
    println!("the demo took {:.1} s", started.elapsed().as_secs_f64());
    if let Err(e) = check(&output, status) {
        panic!("{e:#}\n(the demo's output is above)");
    }
    check_nothing_remains().unwrap();
}

/// How long the demo has to clean up after a Ctrl-C before it is killed.
const CLEANUP: Duration = Duration::from_secs(20);

/// Waits for the demo up to [`LIMIT`], then interrupts it as Ctrl-C would, then, if it has
/// not cleaned up and ended within [`CLEANUP`], kills it.
fn wait_bounded(child: &mut std::process::Child) -> ExitStatus {
    let mut deadline = Instant::now() + LIMIT;
    let mut interrupted = false;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() >= deadline {
            if interrupted {
                child.kill().unwrap();
                return child.wait().unwrap();
            }
            eprintln!("the demo runs longer than {LIMIT:?}: interrupting it");
            // SAFETY: kill has no memory effects; the child is not reaped yet.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
            interrupted = true;
            deadline = Instant::now() + CLEANUP;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn server(i: u8) -> SocketAddr {
    SocketAddr::from(([10, 4, 0, 10 + i], 8000))
}

fn check(output: &str, status: ExitStatus) -> Result<()> {
    ensure!(status.success(), "the demo exited with {status}");
    ensure!(
        !output.contains('\x1b'),
        "terminal control codes in --ci output"
    );

    // The preamble's bucket, and its home as the agent computes it: rendezvous hashing over
    // the servers that may be homes (10.4.0.14 drains before the preamble's first request).
    let line = output
        .lines()
        .find(|l| l.contains("preamble: "))
        .context("no preamble line")?;
    let bucket: u16 = between(line, "hint bucket ", " of")
        .context("no bucket in the preamble line")?
        .parse()?;
    let up: Vec<SocketAddr> = (1..=3).map(server).collect();
    let members: Vec<Member> = up
        .iter()
        .enumerate()
        .map(|(i, s)| Member {
            id: i as u32 + 1,
            key: s.to_string(),
            weight: 100,
        })
        .collect();
    let id = home(bucket, &members).context("no home")?;
    let home = up[id as usize - 1];
    ensure!(
        line.ends_with(&format!("its home is {home}")),
        "the demo names another home than {home}: {line}"
    );

    // At least one spill from that home to an alternate that is up, with its reason.
    let prefix = format!("agent | bucket {bucket}: spill from {home} to ");
    let spills: Vec<&str> = output
        .lines()
        .filter_map(|l| l.split_once(&prefix).map(|(_, rest)| rest))
        .collect();
    ensure!(!spills.is_empty(), "no line with {prefix:?}");
    for spill in &spills {
        let (to, why) = spill
            .split_once(": ")
            .with_context(|| format!("no reason in the spill {spill:?}"))?;
        let to: SocketAddr = to.parse().with_context(|| format!("spill to {to:?}"))?;
        ensure!(
            to != home && up.contains(&to),
            "a spill to {to}, which is not another server that is up"
        );
        ensure!(!why.trim().is_empty(), "a spill without a reason");
    }
    ensure!(
        output.contains(&format!(" connections spilled from {home}")),
        "no connection counted as spilled from {home}"
    );

    // The drained server: draining with streams on it, then drained, then gone from the pool.
    ensure!(
        output
            .lines()
            .any(|l| l.contains(DRAINED) && l.contains("DRAINING")),
        "no table shows {DRAINED} DRAINING"
    );
    ensure!(
        output.contains("drained: nothing running, no connection left"),
        "`drain --wait` did not return"
    );
    ensure!(
        output.contains("agent | config reloaded"),
        "no reload without {DRAINED}"
    );
    // The upgrade: the agent stops and a new one takes the pinned maps and links over, and
    // no request fails, before, during or after.
    ensure!(
        output.contains("an upgrade: the agent stops")
            && output.contains("agent | left attached, pinned for the next agent")
            && output.contains("agent | took over the pinned maps")
            && output.contains("agent | g0 took over the pinned link")
            && output.contains("agent | g1 took over the pinned link"),
        "no agent restart with the program kept attached"
    );
    let failed = output
        .lines()
        .find_map(|l| l.trim().strip_suffix(" requests failed"))
        .or_else(|| {
            output
                .lines()
                .find_map(|l| l.trim().split_once(" requests failed (first: "))
                .map(|(n, _)| n)
        })
        .context("no count of failed requests")?;
    ensure!(failed == "0", "{failed} requests failed");
    let last = last_table(output)?;
    for s in &up {
        ensure!(
            last.iter().any(|row| row.starts_with(&s.to_string())),
            "{s} missing from the last table: {last:?}"
        );
    }
    ensure!(
        !last.iter().any(|row| row.contains(DRAINED)),
        "{DRAINED} is still in the last table: {last:?}"
    );

    // The completion streamed with curl.
    let curl = output
        .lines()
        .find(|l| l.contains("curl | ") && l.contains(" tokens in "))
        .context("no curl summary")?;
    let tokens: u32 = between(curl, "curl | ", " tokens")
        .context("no token count")?
        .parse()?;
    ensure!(
        tokens > 0 && curl.contains("ended with [DONE]"),
        "curl: {curl}"
    );
    ensure!(
        output
            .lines()
            .any(|l| l.contains("curl | ") && l.split_whitespace().count() > 10),
        "no tokens printed as they arrived"
    );

    // Nothing left: the namespaces, the runner whose pid names them, the agent and servers.
    ensure!(
        output.contains("cleaned up: no namespace or process of the demo is left"),
        "the demo did not report its cleanup"
    );
    let namespaces: Vec<&str> = output
        .lines()
        .find_map(|l| l.trim().strip_prefix("namespaces: "))
        .context("no namespaces line")?
        .split_whitespace()
        .collect();
    ensure!(namespaces.len() == 7, "namespaces: {namespaces:?}");
    let list = String::from_utf8(Command::new("ip").args(["netns", "list"]).output()?.stdout)?;
    for ns in &namespaces {
        ensure!(
            !list
                .lines()
                .any(|l| l.split_whitespace().next() == Some(ns)),
            "namespace {ns} is left"
        );
    }
    let runner: u32 = namespaces[0]
        .strip_prefix("blt-")
        .and_then(|rest| rest.split('-').next())
        .context("namespace name")?
        .parse()?;
    let processes = output
        .lines()
        .find_map(|l| l.split_once("processes: ").map(|(_, rest)| rest))
        .context("no processes line")?;
    let mut pids = vec![runner];
    for entry in processes.split(", ") {
        pids.push(entry.rsplit(' ').next().unwrap_or_default().parse()?);
    }
    ensure!(pids.len() == 6, "pids: {pids:?}");
    for pid in pids {
        ensure!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "process {pid} of the demo is left"
        );
    }
    Ok(())
}

/// The text between `start` and the next `end` in `line`.
fn between<'a>(line: &'a str, start: &str, end: &str) -> Option<&'a str> {
    let (_, rest) = line.split_once(start)?;
    Some(rest.split_once(end)?.0)
}

/// The rows of the last pool table (`balancer-agent show pool`, printed indented).
fn last_table(output: &str) -> Result<Vec<String>> {
    let lines: Vec<&str> = output.lines().collect();
    let start = lines
        .iter()
        .rposition(|l| l.contains("$ balancer-agent show pool chat-pool"))
        .context("no table")?;
    let rows: Vec<String> = lines[start + 1..]
        .iter()
        .take_while(|l| l.starts_with(' '))
        .map(|l| l.trim().to_owned())
        .filter(|l| l.starts_with("10."))
        .collect();
    ensure!(!rows.is_empty(), "the last table has no rows");
    Ok(rows)
}
