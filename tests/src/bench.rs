//! What the benchmarks (issue 8) share: their command line, CPU and memory readings from
//! `/proc`, a latency histogram, and the report each one leaves in `target/bench/`: a
//! markdown section (`NAME.md`) and its figures (`NAME.json`), which `cargo xtask bench`
//! collects and checks.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};

/// `--quick` or nothing (cargo bench adds `--bench`).
pub fn quick_flag(usage: &str) -> Result<bool> {
    let mut quick = false;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--quick" => quick = true,
            "--bench" => {}
            other => bail!("unknown argument {other:?}; usage: {usage} [--quick]"),
        }
    }
    Ok(quick)
}

/// Where the benchmarks leave their reports: `target/bench` of the workspace.
pub fn out_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench")
}

fn clock_ticks() -> Result<f64> {
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ensure!(per_second > 0, "no clock tick rate");
    Ok(per_second as f64)
}

/// User plus system CPU time of process `pid`, in seconds.
pub fn cpu_seconds(pid: libc::pid_t) -> Result<f64> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    // `pid (comm) state ppid ...`; comm may hold spaces, so count from the last ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .with_context(|| format!("bad {path}"))?
        .1
        .split_whitespace()
        .collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after `state`.
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    Ok(ticks as f64 / clock_ticks()?)
}

/// The machine's CPU time by kind, in seconds, from the `cpu` line of `/proc/stat`.
#[derive(Debug, Clone, Copy, Default)]
pub struct MachineCpu {
    pub busy: f64,
    pub softirq: f64,
    pub total: f64,
}

impl MachineCpu {
    pub fn now() -> Result<Self> {
        let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
        let line = stat
            .lines()
            .find(|l| l.starts_with("cpu "))
            .context("no cpu line in /proc/stat")?;
        // user nice system idle iowait irq softirq steal guest guest_nice
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(str::parse)
            .collect::<Result<_, _>>()
            .context("bad cpu line in /proc/stat")?;
        ensure!(v.len() >= 8, "short cpu line in /proc/stat: {line}");
        let hz = clock_ticks()?;
        let total: u64 = v[..8].iter().sum();
        let idle = v[3] + v[4];
        Ok(Self {
            busy: (total - idle) as f64 / hz,
            softirq: v[6] as f64 / hz,
            total: total as f64 / hz,
        })
    }

    pub fn since(self, earlier: Self) -> Self {
        Self {
            busy: self.busy - earlier.busy,
            softirq: self.softirq - earlier.softirq,
            total: self.total - earlier.total,
        }
    }
}

/// A field of `/proc/PID/status` in kB (`VmRSS`, `VmHWM`).
pub fn status_kib(pid: libc::pid_t, field: &str) -> Result<u64> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("no {field} in {path}"))
}

/// The machine as the report's header names it: CPU model and count, kernel.
pub fn machine() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                Some(
                    l.strip_prefix("model name")?
                        .split_once(':')?
                        .1
                        .trim()
                        .to_owned(),
                )
            })
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{model}, {cpus} CPUs")
}

/// A latency histogram in microseconds: 32 buckets per power of two (at most about 3 %
/// error), exact below 64 us.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Histogram {
    counts: Vec<u64>,
    n: u64,
    max: u64,
}

const SUB: u32 = 32;

impl Histogram {
    fn index(v: u64) -> usize {
        if v < 2 * u64::from(SUB) {
            return v as usize;
        }
        let e = 63 - v.leading_zeros(); // >= 6
        let sub = (v >> (e - 5)) & u64::from(SUB - 1);
        (2 * SUB + (e - 6) * SUB) as usize + sub as usize
    }

    /// The middle of bucket `i`'s range.
    fn value(i: usize) -> u64 {
        let i = i as u64;
        let two_sub = 2 * u64::from(SUB);
        if i < two_sub {
            return i;
        }
        let e = (i - two_sub) / u64::from(SUB) + 6;
        let sub = (i - two_sub) % u64::from(SUB);
        let low = (1 << e) + (sub << (e - 5));
        low + (1 << (e - 5)) / 2
    }

    pub fn record(&mut self, micros: u64) {
        let i = Self::index(micros);
        if self.counts.len() <= i {
            self.counts.resize(i + 1, 0);
        }
        self.counts[i] += 1;
        self.n += 1;
        self.max = self.max.max(micros);
    }

    pub fn merge(&mut self, other: &Histogram) {
        if self.counts.len() < other.counts.len() {
            self.counts.resize(other.counts.len(), 0);
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.n += other.n;
        self.max = self.max.max(other.max);
    }

    pub fn count(&self) -> u64 {
        self.n
    }

    /// The `q` quantile (0 to 1) in microseconds; `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        if self.n == 0 {
            return None;
        }
        let rank = ((q * self.n as f64).ceil() as u64).clamp(1, self.n);
        // The last rank is the largest value seen, not its bucket's representative.
        if rank == self.n {
            return Some(self.max);
        }
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(Self::value(i).min(self.max));
            }
        }
        Some(self.max)
    }
}

/// The median of `values` (the mean of the middle two for an even count); `None` if empty
/// or if any is missing.
pub fn median(values: &[Option<f64>]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().collect::<Option<_>>()?;
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// What one benchmark leaves for `cargo xtask bench`.
#[derive(Debug, Default)]
pub struct Report {
    /// `packet-cost`, `gateway`, `routing`, `agent-cost`.
    pub name: String,
    pub quick: bool,
    /// The markdown section, from its `##` heading on.
    pub markdown: String,
    /// A few lines for the terminal summary.
    pub summary: Vec<String>,
    /// Every figure of the tables; `None` is a figure that was not produced.
    pub figures: BTreeMap<String, Option<f64>>,
    pub seconds: f64,
}

impl Report {
    /// Writes to [`out_dir`] `NAME.md` (the section), `NAME.summary` (its lines for the
    /// terminal) and `NAME.figures` (`key<TAB>value` lines, `-` for a figure not produced:
    /// what `cargo xtask bench` checks), prints the section, and fails if a figure is missing
    /// (after writing, so that the report shows which).
    pub fn write(&self) -> Result<()> {
        let dir = out_dir();
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(dir.join(format!("{}.md", self.name)), &self.markdown)?;
        let mut summary = self.summary.join("\n");
        summary.push('\n');
        std::fs::write(dir.join(format!("{}.summary", self.name)), summary)?;
        let figures: String = self
            .figures
            .iter()
            .map(|(k, v)| match v {
                Some(v) if v.is_finite() => format!("{k}\t{v}\n"),
                _ => format!("{k}\t-\n"),
            })
            .collect();
        std::fs::write(dir.join(format!("{}.figures", self.name)), figures)?;
        println!("{}", self.markdown);
        for line in &self.summary {
            println!("{line}");
        }
        let missing: Vec<&str> = self
            .figures
            .iter()
            .filter(|(_, v)| !v.is_some_and(f64::is_finite))
            .map(|(k, _)| k.as_str())
            .collect();
        ensure!(!self.figures.is_empty(), "{}: no figures at all", self.name);
        ensure!(
            missing.is_empty(),
            "{}: figures not produced: {}",
            self.name,
            missing.join(", ")
        );
        Ok(())
    }
}

/// A figure as the tables print it: `-` when missing.
pub fn fmt(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:.decimals$}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_within_three_percent() {
        let mut h = Histogram::default();
        for v in 1..=100_000u64 {
            h.record(v);
        }
        for (q, exact) in [(0.5, 50_000.0), (0.99, 99_000.0), (0.001, 100.0)] {
            let got = h.quantile(q).unwrap() as f64;
            assert!((got - exact).abs() / exact < 0.03, "q{q}: {got} vs {exact}");
        }
        assert_eq!(h.quantile(1.0), Some(100_000));
        let mut small = Histogram::default();
        small.record(7);
        assert_eq!(small.quantile(0.5), Some(7));
        assert_eq!(Histogram::default().quantile(0.5), None);
    }

    #[test]
    fn median_of_figures() {
        assert_eq!(median(&[Some(3.0), Some(1.0), Some(2.0)]), Some(2.0));
        assert_eq!(median(&[Some(1.0), Some(2.0)]), Some(1.5));
        assert_eq!(median(&[Some(1.0), None]), None);
    }
}
