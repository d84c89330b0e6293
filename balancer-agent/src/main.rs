use std::{
    path::{Path, PathBuf},
    process::ExitCode,
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use balancer_agent::{
    config::{Config, DEFAULT_CONTROL_SOCKET},
    control::{call, render, Request, Response},
};
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
    /// Show a pool: `show pool POOL` (or `show inference pool POOL`).
    Show {
        /// `pool POOL` or `inference pool POOL`.
        #[arg(num_args = 2..=3, value_names = ["pool", "POOL"])]
        what: Vec<String>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        #[arg(long, default_value = DEFAULT_CONTROL_SOCKET)]
        socket: PathBuf,
    },
    /// Stop sending new connections to a server; established ones finish.
    Drain {
        pool: String,
        /// Address, or address:port when the address is not enough.
        server: String,
        /// Return only when the server runs nothing and no connection of ours remains.
        #[arg(long)]
        wait: bool,
        /// Give up waiting after this many seconds.
        #[arg(long, default_value_t = 3600)]
        timeout: u64,
        #[arg(long, default_value = DEFAULT_CONTROL_SOCKET)]
        socket: PathBuf,
    },
    /// Let a drained server take new connections again.
    Undrain {
        pool: String,
        server: String,
        #[arg(long, default_value = DEFAULT_CONTROL_SOCKET)]
        socket: PathBuf,
    },
    /// The data path's counters: every verdict and every pass or drop reason.
    Counters {
        #[arg(long)]
        json: bool,
        #[arg(long, default_value = DEFAULT_CONTROL_SOCKET)]
        socket: PathBuf,
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

/// An answer that is not an error.
fn ask(socket: &Path, request: &Request) -> Result<Response> {
    match call(socket, request)? {
        Response::Error { message } => bail!("{message}"),
        r => Ok(r),
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
        Command::Show { what, json, socket } => {
            let words: Vec<&str> = what.iter().map(String::as_str).collect();
            let pool = match words[..] {
                ["pool", pool] | ["inference", "pool", pool] => pool.to_owned(),
                _ => bail!("usage: show pool POOL (or show inference pool POOL)"),
            };
            match ask(&socket, &Request::Show { pool })? {
                Response::Pool(view) if json => {
                    println!("{}", serde_json::to_string_pretty(&view)?)
                }
                Response::Pool(view) => print!("{}", render(&view)),
                other => bail!("unexpected answer: {other:?}"),
            }
            Ok(())
        }
        Command::Drain {
            pool,
            server,
            wait,
            timeout,
            socket,
        } => {
            let request = Request::Drain {
                pool: pool.clone(),
                server: server.clone(),
            };
            if let Response::Done { message } = ask(&socket, &request)? {
                println!("{message}");
            }
            if wait {
                wait_drained(&socket, pool, server, Duration::from_secs(timeout))?;
            }
            Ok(())
        }
        Command::Undrain {
            pool,
            server,
            socket,
        } => {
            if let Response::Done { message } = ask(&socket, &Request::Undrain { pool, server })? {
                println!("{message}");
            }
            Ok(())
        }
        Command::Counters { json, socket } => {
            match ask(&socket, &Request::Counters)? {
                Response::Counters { counters } if json => {
                    println!("{}", serde_json::to_string_pretty(&counters)?)
                }
                Response::Counters { counters } => {
                    for (name, value) in counters {
                        println!("{name:<24} {value}");
                    }
                }
                other => bail!("unexpected answer: {other:?}"),
            }
            Ok(())
        }
    }
}

/// Polls until the server reports nothing running (in a scrape taken after the drain began)
/// and no connection of ours is left on it.
fn wait_drained(socket: &Path, pool: String, server: String, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    let request = Request::DrainStatus { pool, server };
    let mut last = None;
    loop {
        let Response::DrainStatus(status) = ask(socket, &request)? else {
            bail!("unexpected answer to a drain status request");
        };
        if !status.draining {
            bail!("the drain was cancelled");
        }
        if status.finished() {
            println!("drained: nothing running, no connection left");
            return Ok(());
        }
        let line = format!(
            "waiting: {} running, {} connections open",
            status.running.map_or("?".into(), |r| format!("{r:.0}")),
            status.flows
        );
        if last.as_ref() != Some(&line) {
            println!("{line}");
            last = Some(line);
        }
        if Instant::now() >= deadline {
            bail!("still not drained after {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}
