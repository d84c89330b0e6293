use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::ExitCode,
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use balancer_agent::{
    config::{Config, Forwarding, XdpMode, DEFAULT_CONTROL_SOCKET},
    control::{
        answer_wait, call, render, render_buckets, render_interfaces, render_peers, Request,
        Response,
    },
};
use clap::{Parser, Subcommand};

/// The longest `drain --wait` accepted: a year.
const MAX_WAIT_S: u64 = 365 * 24 * 3600;

/// An XDP load balancer for pools of LLM inference servers.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load the XDP program, attach it, fill its maps, and keep them current. `reload` (or
    /// SIGHUP) reloads the configuration; SIGINT or SIGTERM detach and exit (with
    /// `agent.pin_dir`, leave the program attached and pinned for the next agent, which
    /// takes it over).
    Run {
        /// The configuration file (TOML; every key in docs/configuration.md).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Make the running agent read its configuration file again and apply it, as SIGHUP
    /// does, and say how it went: why the file is refused (nothing is applied then), or
    /// what only a restart changes.
    Reload {
        /// The agent's control socket (`agent.control_socket`).
        #[arg(long, default_value = DEFAULT_CONTROL_SOCKET)]
        socket: PathBuf,
    },
    /// Remove what a stopped agent left pinned in its `agent.pin_dir`: detaches the program
    /// from every interface (open connections through the VIPs are lost) and unpins its maps.
    Detach {
        /// The configuration file (TOML; every key in docs/configuration.md).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Check a configuration file and print what it defines, without touching the system.
    Check {
        /// The configuration file (TOML; every key in docs/configuration.md).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Show a pool: `show pool POOL` (or `show inference pool POOL`); every pool: `show`.
    Show {
        /// `pool POOL` or `inference pool POOL`; nothing (or `pools`) for every pool.
        #[arg(num_args = 0..=3, value_names = ["pool", "POOL"])]
        what: Vec<String>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// The agent's control socket (`agent.control_socket`).
        #[arg(long, default_value = DEFAULT_CONTROL_SOCKET)]
        socket: PathBuf,
    },
    /// A pool's hint buckets in use: how many hinted connections each had lately, its home,
    /// the servers it spills to, and the rendezvous home where balancing moved it.
    Buckets {
        /// The pool's name.
        pool: String,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// The agent's control socket (`agent.control_socket`).
        #[arg(long, default_value = DEFAULT_CONTROL_SOCKET)]
        socket: PathBuf,
    },
    /// Stop sending new connections to a server; established ones finish.
    Drain {
        /// The pool's name.
        pool: String,
        /// Address, or address:port when the address is not enough.
        server: String,
        /// Return only when the server runs nothing and no connection of ours remains.
        #[arg(long)]
        wait: bool,
        /// With `--wait`: give up waiting after this many seconds (at most a year).
        #[arg(long, default_value_t = 3600, requires = "wait", value_parser = clap::value_parser!(u64).range(1..=MAX_WAIT_S))]
        timeout: u64,
        /// The agent's control socket (`agent.control_socket`).
        #[arg(long, default_value = DEFAULT_CONTROL_SOCKET)]
        socket: PathBuf,
    },
    /// Let a drained server take new connections again.
    Undrain {
        /// The pool's name.
        pool: String,
        /// Address, or address:port when the address is not enough.
        server: String,
        /// The agent's control socket (`agent.control_socket`).
        #[arg(long, default_value = DEFAULT_CONTROL_SOCKET)]
        socket: PathBuf,
    },
    /// The source port that hints a prompt prefix to the pool: prints `--local-port N` for
    /// curl, or just the number with `--port`.
    Hint {
        /// The pool's name.
        #[arg(long)]
        pool: String,
        /// The prefix, as the client will send it.
        #[arg(
            long,
            conflicts_with = "prefix_file",
            required_unless_present = "prefix_file"
        )]
        prefix: Option<String>,
        /// A file holding the prefix (its bytes exactly).
        #[arg(long)]
        prefix_file: Option<PathBuf>,
        /// Print only the port number.
        #[arg(long)]
        port: bool,
        /// Read the pool's hint range from this configuration instead of asking the agent.
        #[arg(long, conflicts_with = "socket")]
        config: Option<PathBuf>,
        /// The agent's control socket (`agent.control_socket`), when it is not the default.
        #[arg(long)]
        socket: Option<PathBuf>,
    },
    /// The gateways this one shares flows with (`[sync]`): whether each is heard (every
    /// gateway sends each peer a datagram a second), what it sent, what was refused.
    Peers {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// The agent's control socket (`agent.control_socket`).
        #[arg(long, default_value = DEFAULT_CONTROL_SOCKET)]
        socket: PathBuf,
    },
    /// The interfaces the program is attached to: mode (native or generic), MTU, whether
    /// jumbo frames in several buffers are redirected to each (else they take the stack),
    /// and whether it is there.
    Interfaces {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// The agent's control socket (`agent.control_socket`).
        #[arg(long, default_value = DEFAULT_CONTROL_SOCKET)]
        socket: PathBuf,
    },
    /// Whether this gateway should take traffic yet: every server scraped and checked, and
    /// every peer's flows received (`[sync]`); exits 1 while not, saying what it waits for.
    /// For a routing daemon's health check (`GET /ready` on the metrics endpoint says the
    /// same).
    Ready {
        /// Machine-readable output (printed whether ready or not).
        #[arg(long)]
        json: bool,
        /// The agent's control socket (`agent.control_socket`).
        #[arg(long, default_value = DEFAULT_CONTROL_SOCKET)]
        socket: PathBuf,
    },
    /// Take this gateway out of the routes for maintenance: `ready` and `GET /ready` say no
    /// until `restore` (or the agent restarts), while it goes on forwarding, checking and
    /// sharing flows, so that the routers move its connections to the other gateways.
    Withdraw {
        /// The agent's control socket (`agent.control_socket`).
        #[arg(long, default_value = DEFAULT_CONTROL_SOCKET)]
        socket: PathBuf,
    },
    /// Undo `withdraw`.
    Restore {
        /// The agent's control socket (`agent.control_socket`).
        #[arg(long, default_value = DEFAULT_CONTROL_SOCKET)]
        socket: PathBuf,
    },
    /// On a server of a `forwarding = "tunnel"` pool: take the gateways' outer header off
    /// in XDP, on these interfaces, until SIGINT or SIGTERM (then detach and print the
    /// counters; SIGUSR1 prints them meanwhile). The server also needs the VIP on a
    /// loopback (docs/operations.md).
    Decap {
        /// An interface the tunnelled packets arrive on (repeat for several).
        #[arg(long = "interface", required = true, value_name = "NAME")]
        interfaces: Vec<String>,
        /// A gateway's `tunnel_source` to take packets from (repeat for several); tunnelled
        /// packets from any other address pass untouched.
        #[arg(long = "gateway", required = true, value_name = "ADDRESS")]
        gateways: Vec<std::net::IpAddr>,
        /// As `agent.xdp_mode`: native, else generic with a warning (`auto`), or only one.
        #[arg(long, value_enum, default_value = "auto")]
        xdp_mode: XdpMode,
    },
    /// The data path's counters: every verdict and every pass or drop reason.
    Counters {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// The agent's control socket (`agent.control_socket`).
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
    ask_within(socket, request, answer_wait(request))
}

fn ask_within(socket: &Path, request: &Request, wait: Duration) -> Result<Response> {
    match call(socket, request, wait)? {
        Response::Error { message } => Err(refusal(message)),
        r => Ok(r),
    }
}

/// The agent's error answer as the CLI says it.
fn refusal(message: String) -> anyhow::Error {
    // The request itself not understood: an agent from before the command (the CLI was
    // upgraded, the agent not restarted). Not a refused file that names an unknown variant.
    if message.starts_with("bad request: unknown variant") {
        return anyhow::anyhow!(
            "the running agent is older than this command: restart it with this version \
             (with agent.pin_dir, no connection breaks) ({message})"
        );
    }
    anyhow::anyhow!(message)
}

/// Asks `request`, which the agent answers with what it did, and prints that.
fn say_done(socket: &Path, request: &Request) -> Result<()> {
    match ask(socket, request)? {
        Response::Done { message } => println!("{message}"),
        other => bail!("unexpected answer: {other:?}"),
    }
    Ok(())
}

fn execute(command: Command) -> Result<()> {
    match command {
        Command::Run { config } => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(balancer_agent::run::run(&config)),
        Command::Reload { socket } => match ask(&socket, &Request::Reload)? {
            Response::Reloaded { pools, warnings } => {
                for w in warnings {
                    eprintln!("warning: {w}");
                }
                println!(
                    "reloaded: {pools} pool{}",
                    if pools == 1 { "" } else { "s" }
                );
                Ok(())
            }
            other => bail!("unexpected answer: {other:?}"),
        },
        Command::Detach { config } => {
            let c = Config::load(&config)?;
            let Some(dir) = c.agent.pin_dir else {
                bail!(
                    "{}: agent.pin_dir is not set: nothing is pinned",
                    config.display()
                );
            };
            let probe = Request::Counters;
            if call(&c.agent.control_socket, &probe, answer_wait(&probe)).is_ok() {
                bail!(
                    "an agent answers on {}: stop it first (it holds the links)",
                    c.agent.control_socket.display()
                );
            }
            if !dir.exists() {
                bail!("nothing is pinned at {}", dir.display());
            }
            let (interfaces, maps) = balancer_agent::pins::remove(&dir)?;
            println!(
                "detached from {}; unpinned {maps} maps from {}",
                if interfaces.is_empty() {
                    "no interface".to_owned()
                } else {
                    interfaces.join(", ")
                },
                dir.display()
            );
            Ok(())
        }
        Command::Decap {
            interfaces,
            gateways,
            xdp_mode,
        } => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(balancer_agent::decap::run(&interfaces, &gateways, xdp_mode)),
        Command::Check { config } => {
            let c = Config::load(&config)?;
            // What `run` would fail on, without starting.
            balancer_agent::run::require_interfaces(&c)?;
            if let Some(s) = &c.sync {
                balancer_agent::sync::Keys::load(s)?;
            }
            balancer_agent::access::load(&c)?;
            println!("{}: ok", config.display());
            for warning in balancer_agent::run::foreign_tunnel_sources(&c) {
                println!("warning: {warning}");
            }
            if let Some(s) = &c.sync {
                let peers: Vec<String> = s.peers.iter().map(ToString::to_string).collect();
                println!(
                    "sync: flows shared from {} with {}, key in {}{}",
                    s.listen,
                    peers.join(", "),
                    s.key_file.display(),
                    match s.accept_key_files.len() {
                        0 => String::new(),
                        n => format!(", {n} more accepted"),
                    }
                );
            }
            print!("{}", pools(&c));
            Ok(())
        }
        Command::Show { what, json, socket } => {
            let words: Vec<&str> = what.iter().map(String::as_str).collect();
            let request = match words[..] {
                [] | ["pools"] => Request::ShowAll,
                ["pool", pool] | ["inference", "pool", pool] => Request::Show { pool: pool.into() },
                _ => bail!(
                    "usage: show pool POOL (or show inference pool POOL), or show for every pool"
                ),
            };
            match ask(&socket, &request)? {
                Response::Pool(view) if json => {
                    println!("{}", serde_json::to_string_pretty(&view)?)
                }
                Response::Pool(view) => print!("{}", render(&view)),
                Response::Pools { pools } if json => {
                    println!("{}", serde_json::to_string_pretty(&pools)?)
                }
                Response::Pools { pools } => {
                    let tables: Vec<String> = pools.iter().map(render).collect();
                    print!("{}", tables.join("\n"));
                }
                other => bail!("unexpected answer: {other:?}"),
            }
            Ok(())
        }
        Command::Buckets { pool, json, socket } => {
            match ask(&socket, &Request::Buckets { pool })? {
                Response::Buckets(view) if json => {
                    println!("{}", serde_json::to_string_pretty(&view)?)
                }
                Response::Buckets(view) => print!("{}", render_buckets(&view)),
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
        Command::Hint {
            pool,
            prefix,
            prefix_file,
            port,
            config,
            socket,
        } => {
            let prefix = match (prefix, prefix_file) {
                (Some(p), _) => p.into_bytes(),
                (None, Some(f)) => {
                    std::fs::read(&f).map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?
                }
                (None, None) => bail!("give --prefix or --prefix-file"),
            };
            let range = hint_range(&pool, config.as_deref(), socket.as_deref())?;
            let bucket = range.bucket_of_prefix(&prefix);
            let family = "0.0.0.0".parse().expect("an address");
            let free = balancer_agent::hint::free_port(range, &prefix, family)?;
            if port {
                println!("{free}");
            } else {
                println!("--local-port {free}");
                // In u32: the range may end at port 65535.
                let first = u32::from(range.start) + u32::from(bucket);
                let last = u32::from(range.start) + u32::from(range.span) - 1;
                let every = u32::from(range.buckets);
                let ports = if first + every <= last {
                    format!(
                        "source ports {first}, {}, ... every {every} up to {last}",
                        first + every
                    )
                } else {
                    format!("source port {first} only")
                };
                eprintln!("bucket {bucket} of {}: {ports}", range.buckets);
            }
            Ok(())
        }
        Command::Peers { json, socket } => {
            match ask(&socket, &Request::Peers)? {
                Response::Peers { peers } if json => {
                    println!("{}", serde_json::to_string_pretty(&peers)?)
                }
                Response::Peers { peers } => print!("{}", render_peers(&peers)),
                other => bail!("unexpected answer: {other:?}"),
            }
            Ok(())
        }
        Command::Interfaces { json, socket } => {
            match ask(&socket, &Request::Interfaces)? {
                Response::Interfaces { interfaces } if json => {
                    println!("{}", serde_json::to_string_pretty(&interfaces)?)
                }
                Response::Interfaces { interfaces } => {
                    print!("{}", render_interfaces(&interfaces))
                }
                other => bail!("unexpected answer: {other:?}"),
            }
            Ok(())
        }
        Command::Withdraw { socket } => say_done(&socket, &Request::Withdraw),
        Command::Restore { socket } => say_done(&socket, &Request::Restore),
        Command::Ready { json, socket } => {
            let Response::Ready(r) = ask(&socket, &Request::Ready)? else {
                bail!("unexpected answer from the agent");
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else if r.ready {
                println!("ready");
                for note in &r.notes {
                    println!("  {note}");
                }
            }
            if !r.ready {
                bail!("not ready: waiting for {}", r.waiting.join("; "));
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

/// The pool's hint range, from a configuration file or from the running agent.
fn hint_range(
    pool: &str,
    config: Option<&Path>,
    socket: Option<&Path>,
) -> Result<balancer_common::hint::HintRange> {
    if let Some(file) = config {
        let c = Config::load(file)?;
        let p = c
            .pool
            .iter()
            .find(|p| p.name == pool)
            .ok_or_else(|| anyhow::anyhow!("{}: no pool named {pool:?}", file.display()))?;
        return p
            .hint_range()
            .ok_or_else(|| anyhow::anyhow!("pool {pool} takes no hints (hint_ports = \"off\")"));
    }
    let socket = socket.unwrap_or(Path::new(DEFAULT_CONTROL_SOCKET));
    match ask(socket, &Request::Hint { pool: pool.into() })? {
        Response::Hint {
            start,
            span,
            buckets,
        } => balancer_common::hint::HintRange::new(start, span, buckets)
            .map_err(|e| anyhow::anyhow!("the agent sent a bad hint range: {}", e.message())),
        other => bail!("unexpected answer: {other:?}"),
    }
}

/// Polls until the server reports nothing running or waiting (in a scrape taken after the
/// drain began) and no connection of ours is left on it, or, DOWN with its metrics failing,
/// has no connection of ours left.
fn wait_drained(socket: &Path, pool: String, server: String, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    let request = Request::DrainStatus { pool, server };
    let mut last = None;
    loop {
        // An answer waits for a walk of the flow table: no longer than the time left.
        let left = deadline.saturating_duration_since(Instant::now());
        let wait = answer_wait(&request).min(left).max(Duration::from_secs(1));
        let answer = match ask_within(socket, &request, wait) {
            Err(e) if Instant::now() >= deadline => {
                bail!("still not drained after {} s ({e:#})", limit.as_secs())
            }
            answer => answer?,
        };
        let Response::DrainStatus(status) = answer else {
            bail!("unexpected answer to a drain status request");
        };
        if !status.draining {
            bail!("the drain was cancelled");
        }
        if status.finished() {
            if status.idle() {
                println!("drained: nothing running, no connection left");
            } else {
                println!("drained: no connection left (the server is DOWN and its metrics fail)");
            }
            return Ok(());
        }
        let count = |n: Option<f64>| n.map_or("?".into(), |n| format!("{n:.0}"));
        let mut line = format!(
            "waiting: {} running, {} waiting, {} connections open",
            count(status.running),
            count(status.waiting),
            status.flows
        );
        if let Some(e) = &status.scrape_error {
            line += &format!(" ({e})");
        }
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

/// `check`'s list of the pools and their servers, addresses spelled as `show` spells them.
fn pools(c: &Config) -> String {
    let mut out = String::new();
    for p in &c.pool {
        let dsr = match p.forwarding {
            Forwarding::Nat => "",
            Forwarding::Dsr => ", direct server return",
            Forwarding::Tunnel => ", direct server return through a tunnel",
        };
        let https = match &p.tls {
            Some(_) => ", checked and scraped over HTTPS",
            None => "",
        };
        let vip = SocketAddr::new(p.vip, p.port);
        out += &format!(
            "pool {} {vip} ({} servers{dsr}{https})\n",
            p.name,
            p.server.len()
        );
        for s in &p.server {
            let addr = SocketAddr::new(s.address, s.port);
            out += &format!("  {addr} weight {}\n", s.weight);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An agent that does not know the command is said to be older; a file it refuses for
    /// an unknown variant is not.
    #[test]
    fn an_older_agent_is_told_from_a_refused_file() {
        let older = refusal(
            "bad request: unknown variant `peers`, expected one of `show`, `drain` at line 1"
                .into(),
        );
        assert!(older
            .to_string()
            .starts_with("the running agent is older than this command"));
        let refused = "reload failed, keeping the running configuration: a.toml: `dialect`: \
                       unknown variant `openai`, expected one of `vllm`";
        assert_eq!(refusal(refused.into()).to_string(), refused);
    }

    /// An IPv6 address is bracketed before its port, or `2001:db8::60:8000` reads as an
    /// address without one.
    #[test]
    fn check_lists_ipv6_addresses_with_brackets() {
        let c = Config::parse(
            Path::new("v6.toml"),
            r#"
[agent]
interfaces = ["eth0"]

[[pool]]
name = "v6"
vip = "2001:db8::60"
port = 8000

[[pool.server]]
address = "fd00:4::11"
port = 8000
metrics_port = 8000
"#,
        )
        .unwrap();
        assert_eq!(
            pools(&c),
            "pool v6 [2001:db8::60]:8000 (1 servers)\n  [fd00:4::11]:8000 weight 100\n"
        );
    }

    #[test]
    fn check_says_which_pools_are_reached_over_https() {
        let text = r#"
[agent]
interfaces = ["eth0"]

[[pool]]
name = "chat"
vip = "192.0.2.60"
port = 443

[pool.tls]
ca_file = "/etc/balancer/servers-ca.pem"

[[pool.server]]
address = "10.4.0.11"
port = 8000
metrics_port = 8000
"#;
        let c = Config::parse(Path::new("tls.toml"), text).unwrap();
        assert_eq!(
            pools(&c),
            "pool chat 192.0.2.60:443 (1 servers, checked and scraped over HTTPS)\n  \
             10.4.0.11:8000 weight 100\n"
        );
    }

    #[test]
    fn check_says_which_pools_go_through_a_tunnel() {
        let text = "[agent]\ninterfaces = [\"eth0\"]\n[[pool]]\nname = \"far\"\n\
            vip = \"192.0.2.61\"\nport = 8000\nforwarding = \"tunnel\"\n\
            tunnel_source = \"10.4.0.1\"\n[[pool.server]]\naddress = \"10.6.0.2\"\n\
            port = 8000\nmetrics_port = 8001\n";
        let c = Config::parse(Path::new("tunnel.toml"), text).unwrap();
        assert_eq!(
            pools(&c),
            "pool far 192.0.2.61:8000 (1 servers, direct server return through a tunnel)\n  \
             10.6.0.2:8000 weight 100\n"
        );
    }

    /// A wait too long for the clock is refused as an argument, not a panic mid-wait.
    #[test]
    fn drain_timeout_is_bounded() {
        let drain = |timeout: &str| {
            Cli::try_parse_from([
                "balancer-agent",
                "drain",
                "p",
                "10.4.0.11",
                "--wait",
                "--timeout",
                timeout,
            ])
        };
        assert!(drain("60").is_ok());
        assert!(drain(&MAX_WAIT_S.to_string()).is_ok());
        let without_wait = Cli::try_parse_from([
            "balancer-agent",
            "drain",
            "p",
            "10.4.0.11",
            "--timeout",
            "60",
        ]);
        let e = without_wait
            .err()
            .expect("--timeout without --wait accepted");
        assert!(e.to_string().contains("--wait"), "{e}");
        for bad in ["0", "31536001", "18446744073709551615", "soon"] {
            let Err(e) = drain(bad) else {
                panic!("{bad} accepted");
            };
            let e = e.to_string();
            assert!(e.contains("--timeout"), "{bad}: {e}");
        }
    }
}
