//! `cargo xtask test`: the project's single test entry point (also what CI
//! runs via .ci/run).

use std::process::Command;

use anyhow::{bail, Result};

use crate::{cmd, setup};

struct Step {
    name: &'static str,
    cmd: Command,
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

    // Steps run in order and stop at the first failure. Later steps (e.g. the
    // benchmark in `--quick` mode) go at the end of this list.
    let steps = vec![
        Step {
            name: "fmt",
            cmd: fmt,
        },
        Step {
            name: "clippy",
            cmd: clippy,
        },
        Step {
            name: "test",
            cmd: test,
        },
    ];

    let mut passed = 0;
    for mut step in steps {
        println!("==> {}", step.name);
        if let Err(e) = cmd::run(step.cmd.current_dir(&root)) {
            println!("xtask test: {passed} passed, 1 failed");
            return Err(e.context(format!("step `{}` failed", step.name)));
        }
        passed += 1;
    }
    println!("xtask test: {passed} passed, 0 failed");
    Ok(())
}
