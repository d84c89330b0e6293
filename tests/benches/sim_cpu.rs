//! The CPU one inference-sim process uses per concurrent stream, at the default speeds, with
//! 200 streams (issue 3, item 4). The goal is under 5 % of one core per 10 streams, so that
//! four simulators and the balancer fit on this 2-core machine with room for load.
//!
//! `cargo bench -p balancer-tests --no-default-features --bench sim_cpu` measures 200 streams
//! for 20 s; `-- --quick` measures 50 streams for 5 s. The simulator's CPU time comes from
//! `/proc/PID/stat` (user + system) over the measured window, after every stream has started.
//! It exits non-zero when the streams did not flow; whether the goal is met is reported.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use balancer_tests::sim::client::{Item, Stream};
use balancer_tests::sim::launch::SimServer;
use serde_json::json;

const SIM: &str = env!("CARGO_BIN_EXE_inference-sim");
const GOAL_PERCENT_PER_10: f64 = 5.0;

struct Plan {
    streams: usize,
    warmup: Duration,
    measure: Duration,
}

fn main() -> Result<()> {
    let mut quick = false;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--quick" => quick = true,
            // cargo bench passes --bench to every bench target.
            "--bench" => {}
            other => bail!("unknown argument {other:?}; usage: sim_cpu [--quick]"),
        }
    }
    let plan = if quick {
        Plan {
            streams: 50,
            warmup: Duration::from_secs(1),
            measure: Duration::from_secs(5),
        }
    } else {
        Plan {
            streams: 200,
            warmup: Duration::from_secs(3),
            measure: Duration::from_secs(20),
        }
    };
    run(&plan)
}

fn run(plan: &Plan) -> Result<()> {
    let dir = tempfile::tempdir()?;
    // Default speeds; room for every stream in the batch and in memory, so that all of them
    // generate tokens at once (the costliest case) rather than queue.
    let sim = SimServer::start(
        Path::new(SIM),
        &dir.path().join("sim.log"),
        &["--max-running", "256", "--kv-tokens", "262144"],
    )?;
    let stop = Arc::new(AtomicBool::new(false));
    let tokens = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..plan.streams)
        .map(|i| {
            let (stop, tokens, api) = (stop.clone(), tokens.clone(), sim.api);
            thread::spawn(move || -> Result<()> {
                let prompt: Vec<String> = (0..50).map(|w| format!("s{i}w{w}")).collect();
                let body = json!({
                    "prompt": prompt.join(" "), "max_tokens": 100_000, "ignore_eos": true,
                    "stream": true,
                });
                let mut stream = Stream::open(api, "/v1/completions", &body)?;
                while !stop.load(Ordering::Relaxed) {
                    match stream.next_item().with_context(|| format!("stream {i}"))? {
                        Some(Item::Chunk { .. }) => tokens.fetch_add(1, Ordering::Relaxed),
                        other => bail!("stream {i} ended early: {other:?}"),
                    };
                }
                Ok(())
            })
        })
        .collect();

    thread::sleep(plan.warmup);
    let state = sim.state()?;
    ensure!(
        state["running"] == plan.streams,
        "{} of {} streams running after the warm-up: {state}",
        state["running"],
        plan.streams
    );
    let (cpu0, tokens0, t0) = (
        cpu_seconds(sim.process.pid())?,
        tokens.load(Ordering::Relaxed),
        Instant::now(),
    );
    thread::sleep(plan.measure);
    let (cpu1, tokens1, wall) = (
        cpu_seconds(sim.process.pid())?,
        tokens.load(Ordering::Relaxed),
        t0.elapsed(),
    );
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.join().expect("client thread panicked")?;
    }

    let wall = wall.as_secs_f64();
    let percent = (cpu1 - cpu0) / wall * 100.0;
    let per_10 = percent / (plan.streams as f64 / 10.0);
    let rate = (tokens1 - tokens0) as f64 / wall;
    ensure!(rate > 0.0, "no tokens flowed during the measurement");
    let verdict = if per_10 < GOAL_PERCENT_PER_10 {
        "met"
    } else {
        "NOT met"
    };
    println!(
        "inference-sim: {} streams for {wall:.1} s at the default speeds, {rate:.0} tokens/s: \
         {percent:.2}% of one core in all, {per_10:.3}% per 10 streams \
         (goal < {GOAL_PERCENT_PER_10}%: {verdict})",
        plan.streams
    );
    Ok(())
}

/// User plus system CPU time of process `pid`, in seconds.
fn cpu_seconds(pid: libc::pid_t) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // `pid (comm) state ppid ...`; comm may hold spaces, so count from the last ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .context("bad /proc stat")?
        .1
        .split_whitespace()
        .collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after `state`.
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ensure!(per_second > 0, "no clock tick rate");
    Ok(ticks as f64 / per_second as f64)
}
