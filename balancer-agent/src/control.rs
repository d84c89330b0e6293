//! The control socket: one JSON request per connection, one JSON response. The CLI and the
//! running agent share these types, so they cannot drift apart.

use std::{
    fmt::Write as _,
    io::{BufRead, BufReader, Write},
    os::unix::net::UnixStream,
    path::Path,
    time::Duration,
};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::{config::Forwarding, ready::Readiness};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Request {
    Show {
        pool: String,
    },
    /// Every pool, in the file's order.
    ShowAll,
    Drain {
        pool: String,
        server: String,
    },
    Undrain {
        pool: String,
        server: String,
    },
    DrainStatus {
        pool: String,
        server: String,
    },
    Counters,
    /// The pool's hint buckets in use.
    Buckets {
        pool: String,
    },
    /// The pool's hint port range, for clients that ask the agent.
    Hint {
        pool: String,
    },
    /// The other gateways this one shares flows with (`[sync]`).
    Peers,
    /// The interfaces the program is attached to.
    Interfaces,
    /// Read the configuration file again and apply it, as SIGHUP does.
    Reload,
    /// Whether this gateway should take traffic yet (`ready.rs`).
    Ready,
    /// Say not ready, whatever else, until `Restore`: the routers take the gateway out.
    Withdraw,
    Restore,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Response {
    Pool(PoolView),
    Pools {
        pools: Vec<PoolView>,
    },
    Done {
        message: String,
    },
    DrainStatus(DrainStatus),
    Counters {
        counters: Vec<(String, u64)>,
    },
    Buckets(BucketsView),
    Hint {
        start: u16,
        span: u16,
        buckets: u16,
    },
    Peers {
        peers: Vec<PeerRow>,
    },
    Interfaces {
        interfaces: Vec<InterfaceRow>,
    },
    /// A reload went through: the pools in place, and what only a restart changes.
    Reloaded {
        pools: usize,
        warnings: Vec<String>,
    },
    Ready(Readiness),
    Error {
        message: String,
    },
}

/// One pool in the operator's terms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolView {
    pub pool: String,
    pub vip: String,
    /// Absent from an older agent's answer, which knew only NAT.
    #[serde(default)]
    pub forwarding: Forwarding,
    pub servers: Vec<ServerRow>,
    /// Client packets to the VIP that the program dropped, whatever the reason (`counters`
    /// says which), since the VIP took its place in the maps; absent from an older agent's
    /// answer.
    #[serde(default)]
    pub dropped: u64,
}

/// One server. `None` is a signal the server does not publish (or has not yet).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerRow {
    pub server: String,
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    /// KV-cache memory in use, 0..=1.
    pub kv_mem: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub state: String,
    pub weight: u32,
    /// Connections through us that have not closed.
    pub flows: u64,
    /// New connections per second, over the last fold of the counters.
    pub new_per_s: f64,
    /// Why the weight is what it is.
    pub reason: String,
    pub dialect: Option<String>,
    /// Age of the last good scrape.
    pub metrics_age_ms: Option<u64>,
    pub scrape_error: Option<String>,
    pub health: String,
    /// No good scrape for three scrape intervals, or none yet: the numbers are old, or none
    /// (absent from an older agent's answer).
    #[serde(default)]
    pub stale: bool,
    /// Past a threshold (queue, TTFT, KV) on fresh metrics; absent from an older agent's
    /// answer, as are the two counts below.
    #[serde(default)]
    pub saturated: bool,
    /// It has its weight only because every server of its pool is saturated or DOWN.
    #[serde(default)]
    pub fail_open: bool,
    /// Connections the program opened to the server since its maps were made, and those
    /// of them that closed.
    #[serde(default)]
    pub flows_opened: u64,
    #[serde(default)]
    pub flows_closed: u64,
}

/// A pool's hint buckets that carried connections lately, most popular first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BucketsView {
    pub pool: String,
    pub buckets: Vec<BucketRow>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BucketRow {
    pub bucket: u16,
    /// Hinted connections, older ones decayed (by e after two minutes).
    pub hinted: f64,
    /// Where the bucket's connections go while it has room.
    pub home: String,
    /// The home by rendezvous hashing alone, before balancing moved it.
    pub rendezvous_home: String,
    /// Servers it spills to, most recent last.
    pub warm: Vec<String>,
}

/// How a peer is heard; each agent sends each of its peers a datagram a second
/// (`sync::HEARTBEAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PeerState {
    /// A datagram of its was accepted within `sync::SILENT_AFTER` (3.5 s).
    Up,
    /// Only refused ones came from its address lately: another key, or a clock far off.
    Refused,
    /// Nothing for longer, or never.
    Silent,
}

impl PeerState {
    pub fn as_str(self) -> &'static str {
        match self {
            PeerState::Up => "up",
            PeerState::Refused => "refused",
            PeerState::Silent => "silent",
        }
    }
}

/// A gateway this one shares flows with, as this one hears it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerRow {
    /// Its address as `sync.peers` gives it.
    pub peer: String,
    pub state: PeerState,
    /// Since its last accepted datagram; none: never.
    pub heard_ms_ago: Option<u64>,
    /// Flow events received from it.
    pub events_in: u64,
    /// Datagrams from its address refused.
    pub refused: u64,
    /// Datagrams to it that could not be sent.
    pub send_errors: u64,
    /// Times its agent restarted while this one ran.
    pub restarts: u64,
    /// What is wrong, if something is: why its datagrams are refused, why sending fails,
    /// or that it was never heard from.
    pub problem: Option<String>,
    /// The live flows it sent this agent when it started, once it said it sent them all
    /// (absent from an older agent's answer).
    pub flows_at_start: Option<u64>,
}

/// An interface the program is attached to, in the operator's terms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InterfaceRow {
    pub interface: String,
    /// Its index when the program was attached.
    pub ifindex: u32,
    /// `native`, `generic`, or `unknown` (a pinned link taken over, whose mode the kernel
    /// did not say).
    pub mode: String,
    /// An earlier agent's pinned link, which this one took over.
    pub taken_over: bool,
    /// None while it is gone.
    pub mtu: Option<u32>,
    /// A frame in several buffers (a jumbo frame) is redirected to it: its driver transmits
    /// such frames from XDP, or the program runs in generic mode everywhere. Otherwise such
    /// frames towards it take the stack (`pass_egress`).
    pub multi_buffer_tx: bool,
    /// `attached`; `gone` (deleted: the program goes back on when it returns); `created
    /// again` (not attached to yet: retried every second).
    pub state: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrainStatus {
    pub draining: bool,
    /// Running requests in the last scrape, if it was taken after the drain began.
    pub running: Option<f64>,
    /// Waiting requests in that scrape (absent from an older agent's answer).
    #[serde(default)]
    pub waiting: Option<f64>,
    /// Connections of ours still open on the server.
    pub flows: u64,
    /// Its health checks failed (absent from an older agent's answer).
    #[serde(default)]
    pub down: bool,
    /// Why its last scrape failed, if it did.
    #[serde(default)]
    pub scrape_error: Option<String>,
    /// Its last scrape failed, or its good ones are too old to count: what runs on it may
    /// never be known (absent from an older agent's answer).
    #[serde(default)]
    pub metrics_lost: bool,
}

impl DrainStatus {
    /// Nothing runs or waits on the server and no connection of ours is left; for a DOWN
    /// server whose metrics fail (it crashed, its port is blocked), no connection of ours
    /// left is enough. One whose metrics still come is alive: its scrape says when it is idle.
    pub fn finished(&self) -> bool {
        // An older agent sends no `metrics_lost`, but its scrape error says as much.
        let lost = self.metrics_lost || self.scrape_error.is_some();
        self.flows == 0 && (self.idle() || (self.down && lost && self.running.is_none()))
    }

    /// A scrape since the drain began found nothing running or waiting.
    pub fn idle(&self) -> bool {
        self.running == Some(0.0) && self.waiting.unwrap_or(0.0) == 0.0
    }
}

/// A drain status waits for a walk of the flow table (about 45 s for the largest), or for
/// the one already running; anything else is answered within moments (a reload that
/// attaches to interfaces takes the longest).
pub fn answer_wait(request: &Request) -> Duration {
    match request {
        Request::DrainStatus { .. } => Duration::from_secs(180),
        _ => Duration::from_secs(30),
    }
}

/// Sends one request to the agent listening on `socket`, and waits up to `wait` for the
/// answer (see [`answer_wait`]).
pub fn call(socket: &Path, request: &Request, wait: Duration) -> Result<Response> {
    let mut stream = UnixStream::connect(socket).map_err(|e| {
        use std::io::ErrorKind::{ConnectionRefused, NotFound};
        match e.kind() {
            NotFound | ConnectionRefused => anyhow::anyhow!(
                "no agent is running (nothing listens on {})",
                socket.display()
            ),
            _ => anyhow::anyhow!("connecting to {}: {e}", socket.display()),
        }
    })?;
    stream.set_read_timeout(Some(wait))?;
    let mut line = serde_json::to_string(request)?;
    line.push('\n');
    stream.write_all(line.as_bytes())?;
    let mut answer = String::new();
    BufReader::new(stream).read_line(&mut answer).map_err(|e| {
        use std::io::ErrorKind::{TimedOut, WouldBlock};
        match e.kind() {
            WouldBlock | TimedOut => {
                anyhow::anyhow!(
                    "the agent did not answer within {:.1} s",
                    wait.as_secs_f64()
                )
            }
            _ => anyhow::anyhow!("reading the agent's answer: {e}"),
        }
    })?;
    if answer.is_empty() {
        bail!("the agent closed the connection without answering");
    }
    serde_json::from_str(&answer).context("the agent's answer is not understood")
}

/// The pool as a table whose first columns are the operator's:
/// `server running waiting kv-mem ttft-ms state`, then weight, flows, new/s; below it, each
/// server that is DOWN with its last check (why it failed, or how many good ones it still
/// needs).
pub fn render(view: &PoolView) -> String {
    let dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let mut rows = vec![[
        "server", "running", "waiting", "kv-mem", "ttft-ms", "state", "weight", "flows", "new/s",
    ]
    .map(String::from)];
    for s in &view.servers {
        rows.push([
            s.server.clone(),
            dash(s.running.map(|v| format!("{v:.0}"))),
            dash(s.waiting.map(|v| format!("{v:.0}"))),
            dash(s.kv_mem.map(|v| format!("{:.0}%", v * 100.0))),
            dash(s.ttft_ms.map(|v| format!("{v:.0}"))),
            s.state.clone(),
            s.weight.to_string(),
            s.flows.to_string(),
            format!("{:.1}", s.new_per_s),
        ]);
    }
    let mode = match view.forwarding {
        Forwarding::Nat => "",
        Forwarding::Dsr => ", direct server return",
        Forwarding::Tunnel => ", direct server return through a tunnel",
    };
    let mut out = format!(
        "pool {} (VIP {}{mode})\n{}",
        view.pool,
        view.vip,
        columns(&rows)
    );
    if view.dropped > 0 {
        let _ = writeln!(
            out,
            "{} packets to the VIP dropped (why: balancer-agent counters)",
            view.dropped
        );
    }
    for s in &view.servers {
        if s.state == "DOWN" {
            let _ = writeln!(out, "{} is DOWN: {}", s.server, s.health);
        } else if s.stale {
            // Its numbers above are old, or none: the table alone would not say so.
            let age = s.metrics_age_ms.map_or("no scrape yet".into(), |ms| {
                format!("last scrape {:.1} s ago", ms as f64 / 1000.0)
            });
            let why = s.scrape_error.as_deref().unwrap_or("no error yet");
            let _ = writeln!(out, "{} has stale metrics ({age}): {why}", s.server);
        }
    }
    out
}

/// The buckets in use: `bucket hinted home warm`, and where balancing moved a home, the
/// rendezvous home it moved from.
pub fn render_buckets(view: &BucketsView) -> String {
    let mut rows = vec![["bucket", "hinted", "home", "warm", "moved-from"].map(String::from)];
    for b in &view.buckets {
        rows.push([
            b.bucket.to_string(),
            format!("{:.1}", b.hinted),
            b.home.clone(),
            if b.warm.is_empty() {
                "-".into()
            } else {
                b.warm.join(",")
            },
            if b.home == b.rendezvous_home {
                "-".into()
            } else {
                b.rendezvous_home.clone()
            },
        ]);
    }
    let title = format!(
        "pool {}: {} hint buckets in use (hinted: connections, decayed over minutes)\n",
        view.pool,
        view.buckets.len()
    );
    title + &columns(&rows)
}

/// The peers, `peer state heard events-in refused send-errors restarts flows-at-start`;
/// below, each one's problem.
pub fn render_peers(peers: &[PeerRow]) -> String {
    let mut rows = vec![[
        "peer",
        "state",
        "heard",
        "events-in",
        "refused",
        "send-errors",
        "restarts",
        "flows-at-start",
    ]
    .map(String::from)];
    for p in peers {
        rows.push([
            p.peer.clone(),
            p.state.as_str().to_owned(),
            p.heard_ms_ago.map_or("never".into(), |ms| {
                format!("{:.1} s ago", ms as f64 / 1000.0)
            }),
            p.events_in.to_string(),
            p.refused.to_string(),
            p.send_errors.to_string(),
            p.restarts.to_string(),
            p.flows_at_start.map_or("-".into(), |n| n.to_string()),
        ]);
    }
    let mut out = columns(&rows);
    for p in peers {
        if let Some(problem) = &p.problem {
            let _ = writeln!(out, "{}: {problem}", p.peer);
        }
    }
    out
}

/// `balancer-agent interfaces` as a table.
pub fn render_interfaces(interfaces: &[InterfaceRow]) -> String {
    let mut rows = vec![[
        "interface",
        "index",
        "mode",
        "mtu",
        "multi-buffer-tx",
        "state",
    ]
    .map(String::from)];
    for i in interfaces {
        rows.push([
            i.interface.clone(),
            i.ifindex.to_string(),
            match i.taken_over {
                true => format!("{}, taken over", i.mode),
                false => i.mode.clone(),
            },
            i.mtu.map_or("-".into(), |m| m.to_string()),
            if i.multi_buffer_tx { "yes" } else { "no" }.into(),
            i.state.clone(),
        ]);
    }
    columns(&rows)
}

/// Rows as left-aligned columns two spaces apart.
fn columns<const N: usize>(rows: &[[String; N]]) -> String {
    let widths: Vec<usize> = (0..N)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            let _ = write!(line, "{cell:<w$}  ", w = widths[c]);
        }
        out += line.trim_end();
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As docs/operations.md shows it.
    #[test]
    fn peers_render_as_the_docs_show() {
        let row =
            |peer: &str, state, heard, (events_in, refused, restarts), dumped, problem: &str| {
                PeerRow {
                    peer: peer.into(),
                    state,
                    heard_ms_ago: heard,
                    events_in,
                    refused,
                    send_errors: 0,
                    restarts,
                    problem: (!problem.is_empty()).then(|| problem.into()),
                    flows_at_start: dumped,
                }
            };
        let peers = [
            row(
                "10.4.0.2:7471",
                PeerState::Up,
                Some(300),
                (1204, 0, 1),
                Some(812),
                "",
            ),
            row(
                "10.4.0.3:7471",
                PeerState::Refused,
                None,
                (0, 37, 0),
                None,
                "its datagrams are refused: its tag does not match: another key, or altered",
            ),
        ];
        // The example sits in a list item, indented two spaces.
        let docs: Vec<&str> = include_str!("../../docs/operations.md")
            .lines()
            .map(|l| l.strip_prefix("  ").unwrap_or(l))
            .collect();
        let docs = docs.join("\n");
        let shown = render_peers(&peers);
        assert!(
            docs.contains(&format!("$ balancer-agent peers\n{shown}")),
            "{shown}"
        );
    }

    /// As docs/operations.md shows it.
    #[test]
    fn interfaces_render_as_the_docs_show() {
        let row = |interface: &str, ifindex| InterfaceRow {
            interface: interface.into(),
            ifindex,
            mode: "native".into(),
            taken_over: false,
            mtu: Some(9000),
            multi_buffer_tx: true,
            state: "attached".into(),
        };
        let shown = render_interfaces(&[row("eth0", 2), row("eth1", 3)]);
        assert!(
            include_str!("../../docs/operations.md")
                .contains(&format!("$ balancer-agent interfaces\n{shown}")),
            "{shown}"
        );
    }

    #[test]
    fn an_agent_that_does_not_answer_in_time_is_said_so() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        // Accepts, reads the request, and answers nothing.
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let mute = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut line = String::new();
            BufReader::new(&stream).read_line(&mut line).unwrap();
            std::thread::sleep(Duration::from_millis(500));
        });
        let wait = Duration::from_millis(100);
        let e = call(&socket, &Request::Counters, wait).unwrap_err();
        assert_eq!(e.to_string(), "the agent did not answer within 0.1 s");
        mute.join().unwrap();
    }

    /// A drain ends when nothing runs or waits and no connection of ours is left; a DOWN
    /// server's whose metrics have not come since the drain began (and may never come), when
    /// no connection of ours is left.
    #[test]
    fn a_drain_ends_without_metrics_only_when_down() {
        let status =
            |running: Option<f64>, waiting: Option<f64>, flows: u64, down: bool| DrainStatus {
                draining: true,
                running,
                waiting,
                flows,
                down,
                scrape_error: running.is_none().then(|| "cannot connect".into()),
                metrics_lost: running.is_none(),
            };
        assert!(status(Some(0.0), Some(0.0), 0, false).finished());
        assert!(status(Some(0.0), None, 0, false).finished());
        assert!(!status(Some(0.0), Some(1.0), 0, false).finished());
        assert!(!status(Some(0.0), Some(0.0), 1, false).finished());
        assert!(
            !status(None, None, 0, false).finished(),
            "up, metrics unknown"
        );
        assert!(status(None, None, 0, true).finished());
        assert!(
            !status(None, None, 2, true).finished(),
            "down, connections open"
        );
        // DOWN, but a scrape since the drain began shows work (quiet DSR clients, say).
        assert!(!status(Some(3.0), Some(0.0), 0, true).finished());
        // DOWN (its checks fail: a wrong model, say) but scraped fine: no scrape since the
        // drain began is no evidence that nothing runs.
        let alive = DrainStatus {
            scrape_error: None,
            metrics_lost: false,
            ..status(None, None, 0, true)
        };
        assert!(!alive.finished());
        // An older agent's answer has no `metrics_lost`: its scrape error is enough.
        let older: DrainStatus = serde_json::from_str(
            r#"{"draining":true,"running":null,"flows":0,"down":true,"scrape_error":"refused"}"#,
        )
        .unwrap();
        assert!(older.finished());
        // An older agent's answer has neither field.
        let old: DrainStatus =
            serde_json::from_str(r#"{"draining":true,"running":null,"flows":0}"#).unwrap();
        assert!(!old.down && old.scrape_error.is_none() && !old.finished());
    }

    fn row(server: &str, kv: Option<f64>, ttft: Option<f64>, state: &str) -> ServerRow {
        ServerRow {
            server: server.into(),
            running: Some(14.0),
            waiting: Some(0.0),
            kv_mem: kv,
            ttft_ms: ttft,
            state: state.into(),
            weight: 100,
            flows: 3,
            new_per_s: 1.5,
            reason: String::new(),
            dialect: None,
            metrics_age_ms: None,
            scrape_error: None,
            health: String::new(),
            stale: false,
            saturated: false,
            fail_open: false,
            flows_opened: 10,
            flows_closed: 3,
        }
    }

    #[test]
    fn table_starts_with_the_operators_columns_and_dashes_what_is_missing() {
        let mut view = PoolView {
            pool: "chat-pool".into(),
            vip: "192.0.2.60:8000".into(),
            forwarding: Forwarding::Nat,
            dropped: 0,
            servers: vec![
                row("10.4.0.11:8000", Some(0.61), Some(240.0), "UP"),
                row("10.4.0.14:8000", None, None, "DRAINING"),
                ServerRow {
                    health: "failed: no answer in 2000 ms".into(),
                    ..row("10.4.0.12:8000", None, None, "DOWN")
                },
                ServerRow {
                    stale: true,
                    reason: "draining".into(),
                    metrics_age_ms: Some(12_340),
                    scrape_error: Some("scrape 10.4.0.13:8001: cannot connect: refused".into()),
                    ..row("10.4.0.13:8000", None, None, "UP")
                },
                ServerRow {
                    stale: true,
                    reason: "stale metrics: configured weight".into(),
                    ..row("10.4.0.15:8000", None, None, "UP")
                },
            ],
        };
        let text = render(&view);
        assert!(
            text.starts_with("pool chat-pool (VIP 192.0.2.60:8000)\n"),
            "{text}"
        );
        view.forwarding = Forwarding::Dsr;
        assert!(render(&view)
            .starts_with("pool chat-pool (VIP 192.0.2.60:8000, direct server return)\n"));
        view.forwarding = Forwarding::Tunnel;
        assert!(render(&view).starts_with(
            "pool chat-pool (VIP 192.0.2.60:8000, direct server return through a tunnel)\n"
        ));
        let mut lines = text.lines().skip(1);
        let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(
            header[..6],
            ["server", "running", "waiting", "kv-mem", "ttft-ms", "state"]
        );
        assert_eq!(header[6..], ["weight", "flows", "new/s"]);
        let first: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(
            first[..6],
            ["10.4.0.11:8000", "14", "0", "61%", "240", "UP"]
        );
        let second: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(second[3..6], ["-", "-", "DRAINING"]);
        let third: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(third[5], "DOWN");
        assert_eq!(
            lines.skip(2).collect::<Vec<_>>(),
            [
                "10.4.0.12:8000 is DOWN: failed: no answer in 2000 ms",
                "10.4.0.13:8000 has stale metrics (last scrape 12.3 s ago): scrape \
                 10.4.0.13:8001: cannot connect: refused",
                "10.4.0.15:8000 has stale metrics (no scrape yet): no error yet",
            ]
        );
        // Said only when there were drops, before what is said of the servers.
        view.dropped = 7;
        assert!(render(&view).contains(
            "\n7 packets to the VIP dropped (why: balancer-agent counters)\n10.4.0.12:8000 is DOWN"
        ));
    }

    #[test]
    fn buckets_table_names_a_moved_home_and_dashes_the_rest() {
        let row = |bucket, home: &str, rendezvous: &str, warm: &[&str]| BucketRow {
            bucket,
            hinted: 12.25,
            home: home.into(),
            rendezvous_home: rendezvous.into(),
            warm: warm.iter().map(|w| w.to_string()).collect(),
        };
        let view = BucketsView {
            pool: "chat-pool".into(),
            buckets: vec![
                row(17, "10.4.0.12:8000", "10.4.0.12:8000", &["10.4.0.13:8000"]),
                row(3, "10.4.0.14:8000", "10.4.0.11:8000", &[]),
            ],
        };
        let text = render_buckets(&view);
        let lines: Vec<Vec<&str>> = text
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert!(text.starts_with("pool chat-pool: 2 hint buckets in use"));
        assert_eq!(lines[1], ["bucket", "hinted", "home", "warm", "moved-from"]);
        assert_eq!(
            lines[2],
            ["17", "12.2", "10.4.0.12:8000", "10.4.0.13:8000", "-"]
        );
        assert_eq!(
            lines[3],
            ["3", "12.2", "10.4.0.14:8000", "-", "10.4.0.11:8000"]
        );
    }

    #[test]
    fn requests_round_trip_as_json() {
        let r = Request::Drain {
            pool: "p".into(),
            server: "10.4.0.11".into(),
        };
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(text, r#"{"cmd":"drain","pool":"p","server":"10.4.0.11"}"#);
        assert_eq!(serde_json::from_str::<Request>(&text).unwrap(), r);
    }

    #[test]
    fn no_agent_is_one_clear_line() {
        let err = call(
            Path::new("/nonexistent/agent.sock"),
            &Request::Counters,
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "no agent is running (nothing listens on /nonexistent/agent.sock)"
        );
    }
}
