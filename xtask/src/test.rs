//! `cargo xtask test`: the project's single test entry point (also what CI
//! runs via .ci/run).

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
};

use anyhow::{bail, Context, Result};

use crate::{cmd, setup};

struct Step {
    name: &'static str,
    cmd: Command,
    /// Tally the `test result:` lines of cargo test's output.
    counts_tests: bool,
}

/// Tests passed and failed, summed over every test binary of a `cargo test` run.
#[derive(Default)]
struct Tally {
    passed: u64,
    failed: u64,
}

impl Tally {
    /// Reads `test result: ok. 14 passed; 0 failed; 0 ignored; ...`.
    fn add_line(&mut self, line: &str) {
        let Some(rest) = line.strip_prefix("test result: ") else {
            return;
        };
        for part in rest.split(['.', ';']) {
            let mut words = part.split_whitespace();
            if let (Some(n), Some(what)) = (words.next(), words.next()) {
                match (n.parse::<u64>(), what) {
                    (Ok(n), "passed") => self.passed += n,
                    (Ok(n), "failed") => self.failed += n,
                    _ => {}
                }
            }
        }
    }
}

/// Runs `cmd`, echoing its stdout line by line while tallying test results.
fn run_counting(cmd: &mut Command, tally: &mut Tally) -> Result<()> {
    println!("$ {}", cmd::display(cmd));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", cmd::display(cmd)))?;
    let stdout = child.stdout.take().context("cargo test's stdout")?;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        println!("{line}");
        tally.add_line(&line);
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("{} exited with {status}", cmd::display(cmd));
    }
    Ok(())
}

pub fn run(skip_setup: bool, cargo_test_args: &[String]) -> Result<()> {
    if !cmd::is_root()? {
        bail!(
            "cargo xtask test needs root (BPF_PROG_TEST_RUN, network namespaces and XDP \
             attach); run it as root"
        );
    }
    if !skip_setup {
        println!("==> setup");
        setup::run(false)?;
    }

    let root = cmd::workspace_root();
    let mut fmt = cmd::cargo();
    fmt.args(["fmt", "--all", "--", "--check"]);
    let mut clippy = cmd::cargo();
    clippy.args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]);
    // Unit tests, BPF_PROG_TEST_RUN tests and the end-to-end namespace tests;
    // the tests crate itself serializes the namespace tests.
    let mut test = cmd::cargo();
    test.env("RUST_BACKTRACE", "1")
        .args(["test", "--workspace"])
        .args(cargo_test_args);

    // The Python hint client checks the same published vectors as the Rust side.
    let mut python = Command::new("python3");
    python.args(["-m", "unittest", "discover", "-s", "clients/python", "-v"]);

    // The benchmark suite, reduced: it checks that every figure is still produced.
    let mut bench = Command::new(std::env::current_exe().context("the xtask executable")?);
    bench.args(["bench", "--quick"]);

    // Steps run in order and stop at the first failure. Later steps go at the end of this
    // list.
    let steps = vec![
        Step {
            name: "fmt",
            cmd: fmt,
            counts_tests: false,
        },
        Step {
            name: "clippy",
            cmd: clippy,
            counts_tests: false,
        },
        Step {
            name: "python clients",
            cmd: python,
            counts_tests: false,
        },
        Step {
            name: "test",
            cmd: test,
            counts_tests: true,
        },
        Step {
            name: "bench --quick",
            cmd: bench,
            counts_tests: false,
        },
    ];

    // The last line is the plain `N passed, N failed` that CI reads: tests, not steps.
    let mut tally = Tally::default();
    let total = steps.len();
    for (done, mut step) in steps.into_iter().enumerate() {
        println!("==> {}", step.name);
        step.cmd.current_dir(&root);
        let result = if step.counts_tests {
            run_counting(&mut step.cmd, &mut tally)
        } else {
            cmd::run(&mut step.cmd)
        };
        if let Err(e) = result {
            println!(
                "xtask test: step `{}` failed after {done} of {total} steps",
                step.name
            );
            println!(
                "tests: {} passed, {} failed",
                tally.passed,
                tally.failed.max(1)
            );
            return Err(e.context(format!("step `{}` failed", step.name)));
        }
    }
    println!("xtask test: all {total} steps passed");
    println!("tests: {} passed, {} failed", tally.passed, tally.failed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Tally;

    #[test]
    fn tallies_cargo_test_result_lines() {
        let mut t = Tally::default();
        t.add_line("test result: ok. 14 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.08s");
        t.add_line(
            "test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out",
        );
        t.add_line("running 3 tests");
        t.add_line("test foo ... ok");
        assert_eq!((t.passed, t.failed), (16, 1));
    }
}
