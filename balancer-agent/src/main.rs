use std::{path::PathBuf, process::ExitCode};

use anyhow::Result;
use balancer_agent::config::Config;
use clap::{Parser, Subcommand};

/// An XDP load balancer for pools of LLM inference servers.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load the XDP program, attach it, fill its maps, and keep them current. SIGHUP reloads
    /// the configuration; SIGINT or SIGTERM detach and exit.
    Run {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Check a configuration file and print what it defines, without touching the system.
    Check {
        #[arg(long, short)]
        config: PathBuf,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match execute(Cli::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, the whole chain: this is what operators and scripts read.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn execute(command: Command) -> Result<()> {
    match command {
        Command::Run { config } => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(balancer_agent::run::run(&config)),
        Command::Check { config } => {
            let c = Config::load(&config)?;
            println!("{}: ok", config.display());
            for p in &c.pool {
                println!(
                    "pool {} {}:{} ({} servers)",
                    p.name,
                    p.vip,
                    p.port,
                    p.server.len()
                );
                for s in &p.server {
                    println!("  {}:{} weight {}", s.address, s.port, s.weight);
                }
            }
            Ok(())
        }
    }
}
