//! `cargo xtask bench [--quick]`: the benchmark suite of issue 8, from one run.
//!
//! Runs the four benchmarks of the tests crate (packet cost, gateway throughput, routing
//! quality, agent cost) one after the other, each with `cargo bench -p balancer-tests
//! --bench NAME`, its output in `target/bench/NAME.log`. Each leaves in `target/bench/` its
//! markdown section (`REPORT.md`), its figures (`REPORT.figures`) and its summary lines
//! (`REPORT.summary`). This checks that every figure was produced (not its value), puts the
//! sections together under a header naming the machine, the kernel and the date, and prints
//! a compact summary.
//!
//! The full run writes `docs/benchmarks.md`; `--quick` runs reduced versions (under three
//! minutes once built; part of `cargo xtask test`) and writes `target/bench/benchmarks.md`
//! instead, leaving the docs alone. A full run whose tables are committed gets its row in
//! both tables of `docs/benchmark-history.md`, by hand.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};

use crate::cmd;

/// (cargo bench target, report name, what it measures).
const BENCHES: [(&str, &str, &str); 4] = [
    (
        "packet_cost",
        "packet-cost",
        "packet cost under BPF_PROG_TEST_RUN",
    ),
    (
        "gateway",
        "gateway",
        "gateway throughput: ours, nftables, HAProxy (and ours with DSR)",
    ),
    ("routing", "routing", "routing quality on four simulators"),
    ("agent_cost", "agent-cost", "agent cost with 256 servers"),
];

pub fn run(quick: bool) -> Result<()> {
    if !cmd::is_root()? {
        bail!(
            "cargo xtask bench needs root (BPF_PROG_TEST_RUN, network namespaces, XDP, \
             nftables, HAProxy); run it as root"
        );
    }
    let root = cmd::workspace_root();
    let out = root.join("target/bench");
    fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let mode = if quick { "quick" } else { "full" };
    let load_before = load_average();

    // Build first, so that the timings below are the benchmarks' own.
    let built = Instant::now();
    println!("==> building the benchmarks (release)");
    // The agent with the benchmarks, as `release_agent_binary` in tests/src/agent.rs builds
    // it: built alone it would be compiled a second time with other features.
    cmd::run(
        cmd::cargo()
            .current_dir(&root)
            .args(cmd::RELEASE_BUILD_ARGS),
    )?;
    cmd::run(
        cmd::cargo()
            .current_dir(&root)
            .args(["bench", "-p", "balancer-tests", "--no-run"]),
    )?;
    let build_time = built.elapsed();

    let started = Instant::now();
    let mut sections = Vec::new();
    let mut summary = Vec::new();
    let mut timings = Vec::new();
    for (bench, report, what) in BENCHES {
        for ext in ["md", "figures", "summary"] {
            let stale = out.join(format!("{report}.{ext}"));
            if stale.exists() {
                fs::remove_file(&stale).with_context(|| format!("removing {}", stale.display()))?;
            }
        }
        let log = out.join(format!("{bench}.log"));
        println!("==> {what} ({bench}, {mode}); log: {}", log.display());
        let t = Instant::now();
        let mut command = cmd::cargo();
        command
            .current_dir(&root)
            .args(["bench", "-p", "balancer-tests", "--bench", bench]);
        if quick {
            command.args(["--", "--quick"]);
        }
        run_logged(&mut command, &log)?;
        let took = t.elapsed();
        check_not_rebuilt(&log)?;
        let section = read(&out.join(format!("{report}.md")))?;
        check_figures(&out.join(format!("{report}.figures")))?;
        summary.extend(
            read(&out.join(format!("{report}.summary")))?
                .lines()
                .map(str::to_owned),
        );
        println!("    done in {:.0} s", took.as_secs_f64());
        timings.push(format!("{bench} {:.0} s", took.as_secs_f64()));
        sections.push(section);
    }
    let total = started.elapsed();
    let load_after = load_average();

    let mut doc = header(
        quick,
        &load_before,
        &load_after,
        total,
        build_time,
        &timings,
    )?;
    for section in &sections {
        doc.push_str(section.trim_end());
        doc.push_str("\n\n");
    }
    let target: PathBuf = if quick {
        out.join("benchmarks.md")
    } else {
        root.join("docs/benchmarks.md")
    };
    fs::write(&target, &doc).with_context(|| format!("writing {}", target.display()))?;

    println!();
    println!("== benchmark summary ({mode}) ==");
    for line in &summary {
        println!("{line}");
    }
    println!(
        "total {:.0} s ({}), build {:.0} s; load average {} before, {} after",
        total.as_secs_f64(),
        timings.join(", "),
        build_time.as_secs_f64(),
        load_before,
        load_after
    );
    println!("wrote {}", target.display());
    Ok(())
}

/// Runs `command` with stdout and stderr in `log`; on failure, shows the end of the log.
fn run_logged(command: &mut Command, log: &Path) -> Result<()> {
    let shown = cmd::display(command);
    println!("$ {shown}");
    let file = fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let status = command
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .status()
        .with_context(|| format!("starting `{shown}`"))?;
    if !status.success() {
        let text = fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(40)..].join("\n");
        bail!(
            "`{shown}` failed ({status}); the end of {}:\n{tail}",
            log.display()
        );
    }
    Ok(())
}

/// Everything was built before the first benchmark: a benchmark that compiled crates first
/// has a build in its timing, and something made Cargo see the build as changed (see
/// `without_run_env` in tests/src/build_args.rs). Cargo's own lines only: it also replays
/// what the agent's build script printed when it built the XDP program, as warnings.
fn check_not_rebuilt(log: &Path) -> Result<()> {
    let text = read(log)?;
    let compiled = compiled(&text);
    ensure!(
        compiled.is_empty(),
        "{}: the benchmark compiled {} crate(s) before it ran, after the build: {}",
        log.display(),
        compiled.len(),
        compiled.join(", ")
    );
    Ok(())
}

/// The crates Cargo says it compiled in `log`.
fn compiled(log: &str) -> Vec<&str> {
    log.lines()
        .filter_map(|l| l.strip_prefix("   Compiling "))
        .collect()
}

fn read(path: &Path) -> Result<String> {
    fs::read_to_string(path).with_context(|| format!("reading {} (not written?)", path.display()))
}

/// Every line `key<TAB>value` has a finite value: every figure was produced.
fn check_figures(path: &Path) -> Result<()> {
    let text = read(path)?;
    let mut count = 0;
    let mut missing = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let (key, value) = line
            .split_once('\t')
            .with_context(|| format!("{}: bad line {line:?}", path.display()))?;
        count += 1;
        if !value.trim().parse::<f64>().is_ok_and(f64::is_finite) {
            missing.push(key.to_owned());
        }
    }
    ensure!(count > 0, "{}: no figures", path.display());
    ensure!(
        missing.is_empty(),
        "{}: figures not produced: {}",
        path.display(),
        missing.join(", ")
    );
    Ok(())
}

fn load_average() -> String {
    fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

fn header(
    quick: bool,
    load_before: &str,
    load_after: &str,
    total: Duration,
    build: Duration,
    timings: &[String],
) -> Result<String> {
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| Some(l.strip_prefix("model name")?.split_once(':')?.1.trim()))
        .unwrap_or("unknown CPU");
    let nproc = cmd::query(&mut Command::new("nproc"))
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "?".into());
    let kernel = cmd::query(Command::new("uname").arg("-r"))?
        .trim()
        .to_owned();
    let date = cmd::query(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]))?
        .trim()
        .to_owned();
    let memory = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let kb: f64 = m
                .lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))?
                .split_whitespace()
                .next()?
                .parse()
                .ok()?;
            Some(format!("{:.0} GiB", kb / 1024.0 / 1024.0))
        })
        .unwrap_or_else(|| "?".into());
    let mut doc = String::from("# Benchmarks\n\n");
    if quick {
        doc += "**Quick run (`cargo xtask bench --quick`): reduced sizes, for checking that \
                every figure is produced; not for quoting.**\n\n";
    }
    doc += &format!(
        "Written by `cargo xtask bench{}` from one run: every table below comes from that run, \
         and every comparison is a ratio measured within it, competitors and ours alternating.\n\n\
         - machine: {model}, {nproc} CPUs (`nproc`), {memory} RAM\n\
         - kernel: {kernel}\n\
         - date: {date}\n\
         - load average (1, 5, 15 min) before: {load_before}; after: {load_after}. The machine \
         is shared: other builds and tests may have run during the benchmarks.\n\
         - run time: {:.0} s ({}), after {:.0} s of building\n\n\
         Where a goal is missed, the table says so. Reproduce with `cargo xtask bench` as \
         root; each part alone with `cargo bench -p balancer-tests --bench NAME [-- --quick]`.\n\n\
         Why goals are missed, as far as we know. Every full run's key figures since the \
         first: [benchmark-history.md](benchmark-history.md).\n\n\
         - packet cost: the program rewrites what it forwards, so a packet runs once per test \
         run and the floor is mostly the kernel's per-run timer (compare it with the floor at \
         `repeat` = 1000000 in section 1). What an established packet adds is mostly cache \
         misses on a cold entry of a large table (the next packet of a burst, its entry in \
         cache, shows the rest); a SYN adds a miss in that table and an insert into it, and a \
         slot of a 16 MB Maglev table. It no longer adds a FIB lookup (about 200-450 ns): it \
         takes the next hop another flow to its backend found (`HOPS`), and the answer it \
         caches holds up to the egress MTU, so the first packet after the SYN is spared one \
         too (that packet cost about twice as much before, in an A/B run). The direct \
         server return rows change no address, port or checksum and cost about what the NAT \
         rows cost: the rewrite is not where the time goes. A profile of the whole section \
         (`perf record -a -g`, samples under `bpf_test_run`) put a third of the time in the \
         hash table's bucket walk (`lookup_nulls_elem_raw`, the cold entries), a tenth in \
         hashing the keys, a tenth in the timer, and a fifth in the program itself.\n\
         - new connections/s, where it is missed: ours led nftables by 3 to 26% in each of \
         the first 22 runs, was level with it or just behind in the two runs after \
         2026-12-03 16:52 (0.98x to 1.00x), with the rounds swapping order (per-round table \
         in section 2), and 7% ahead again in the next (2026-12-07, another host) with the \
         same data path: the machine's swing, as far as we know; the gateway's CPU per \
         connection stayed the lowest.\n\
         - connect-to-first-byte p99, where it is missed: one system's p99 moves by up to 4x \
         from round to round on this shared machine (per-round table in section 2), more than \
         the systems differ; ours had the lowest in 12 of the first 19 runs. In a run that looked \
         into it (2026-12-02 05:20), the tail was not the gateway's work: in five rounds of ours and nftables alone the \
         two were level (medians 2.46 and 2.34 ms), no CPU's softirq ran out of budget \
         (`time_squeeze` in `/proc/net/softnet_stat` unchanged), nothing was dropped, \
         ksoftirqd ran for a tick or two, and stopping the agent changed nothing. Ours had \
         the lowest p50 in 18 of the first 21 runs.\n\
         - bulk throughput, where it is missed: the loss rows of section 2 show why. Forwarded \
         (ours, nftables), a stream is one TCP connection from a backend to the client, and a \
         packet lost anywhere on the way makes the backend retransmit and back off; HAProxy \
         relays between two TCP connections, each recovering on its own shorter loop, and \
         loses and retransmits a small fraction as much. A run that counted drops link by \
         link found them where a veth sends into a peer with an XDP program, which takes \
         packets into a ring of 256 frames rather than the CPU's backlog of 1000: the \
         gateway's two links (ours), and for every system the client's and the switch's \
         links facing the gateway (an `xdp-pass` program, so that ours can redirect to \
         them). The \
         client's and backends' TCP stacks share the two CPUs with the gateway, so the line \
         measures them as much as the gateway: a profile of one bulk phase found both CPUs \
         about 20% idle with ours and with nftables (not with HAProxy), and the XDP program at \
         1.6% of the samples. HAProxy had the highest bulk figure in 17 of the first 19 runs, \
         nftables in the other two. With direct server return (the context column: its \
         answers go around the gateway) the same streams run about three times as fast. \
         With jumbo frames (the context table after section 2's, MTU 9000, which the \
         program takes natively in several buffers) the same streams need a sixth of the \
         packets: in the first run that measured it (2026-12-03 16:52) ours and nftables \
         were level, 9.80 and 10.14 Gbit/s, and both about 1.6x HAProxy's 6.12.\n\
         - TTFT p99 at 2x: the routing workload's bursts exceed the pool's batch capacity and \
         its user prompts are never shared, so the tail is queueing that no placement removes; \
         hints raise the prefix-cache hit rate, not enough to halve it. The p99 of 511 \
         requests is the sixth slowest, and one policy's p99 moves by more than a second \
         between runs: hints had the lowest in 9 of the 24 runs of this workload with the \
         tight cache and 4 with the roomy one.\n\
         - hit rate, where it is close: every policy sends each server the popular preambles \
         about every second, so they stay warm everywhere; hints can win only on the rarer \
         ones, a few points at most, and one policy's hit rate moves by about a point between \
         runs: hints had the highest in 19 of those 24 runs with the tight cache and 12 \
         with the roomy one.\n\n",
        if quick { " --quick" } else { "" },
        total.as_secs_f64(),
        timings.join(", "),
        build.as_secs_f64(),
    );
    Ok(doc)
}

#[cfg(test)]
mod tests {
    use super::compiled;

    #[test]
    fn counts_cargo_compiling_lines_not_the_build_scripts_replayed_ones() {
        let log = "warning: balancer-agent@0.1.0:    Compiling aya-ebpf v0.2.1\n\
                   warning: balancer-agent@0.1.0:     Finished `release` profile\n\
                   \x20  Compiling ring v0.17.14\n\
                   \x20  Compiling balancer-agent v0.1.0 (/work/main/balancer-agent)\n\
                   \x20   Finished `bench` profile [optimized] target(s) in 1m 05s\n\
                   \x20    Running benches/routing.rs\n";
        assert_eq!(
            compiled(log),
            [
                "ring v0.17.14",
                "balancer-agent v0.1.0 (/work/main/balancer-agent)"
            ]
        );
        assert!(
            compiled("    Finished `bench` profile [optimized] target(s) in 0.15s\n").is_empty()
        );
    }
}
