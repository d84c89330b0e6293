//! The agent's own Prometheus metrics: what `show` and `counters` tell an operator, in a form
//! a monitoring system can scrape (`[agent] metrics_listen`, `GET /metrics`). Collected on
//! each scrape from a snapshot of the controller, so nothing here can drift from `show`.

use std::{sync::Arc, time::Duration};

use hyper_util::{
    rt::{TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use prometheus_client::{
    collector::Collector,
    encoding::{text::encode, DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
    registry::Registry,
};

use tokio::{net::TcpListener, sync::Semaphore, time::timeout};
use tracing::{debug, warn};

use crate::control::{PeerRow, PeerState, PoolView};

/// The OpenMetrics text format, which `render` writes and Prometheus reads.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What one scrape of the agent reports.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// The program's counters, by name (`Counter::name`), summed over CPUs.
    pub counters: Vec<(String, u64)>,
    /// Flow-table entries the sweeps deleted (`sweep.rs`), by name.
    pub reclaimed: Vec<(String, u64)>,
    /// Flows shared with other gateways (`sync.rs`), by name; empty without `[sync]`.
    pub sync: Vec<(String, u64)>,
    /// The gateways flows are shared with; empty without `[sync]`.
    pub peers: Vec<PeerRow>,
    /// Entries in the flow table at the last sweep, and its size; none before the first.
    pub flow_table: Option<(u64, u32)>,
    pub pools: Vec<PoolView>,
    /// Whether the gateway should take traffic yet (`ready.rs`).
    pub ready: bool,
    /// The pools that take hints, in the file's order.
    pub hints: Vec<PoolHints>,
}

/// A pool's hinted connections since its maps were made, summed over its hint buckets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolHints {
    pub pool: String,
    /// SYNs from a hint port.
    pub hinted: u64,
    /// Of those, the ones placed on their bucket's home.
    pub home: u64,
    /// And the others (spilled from a home past a threshold, or placed by the weighted pick).
    pub spilled: u64,
}

/// The text exposition of `snapshot`.
pub fn render(snapshot: Snapshot) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::with_prefix("balancer");
    registry.register_collector(Box::new(snapshot));
    let mut out = String::new();
    encode(&mut out, &registry)?;
    Ok(out)
}

/// What the endpoint allows its clients, so that no client, slow or many, can hold on to the
/// agent's file descriptors (its scrapes, health checks and map walks need them) or its time.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Clients served at once; one past it is closed at once. Prometheus and a person or two
    /// need a few.
    pub clients: usize,
    /// For a request's headers, from the connection's start or the previous answer.
    pub headers: Duration,
    /// For a connection: a kept-alive one is closed after it (between two requests).
    pub connection: Duration,
}

impl Limits {
    pub const DEFAULT: Limits = Limits {
        clients: 32,
        headers: Duration::from_secs(5),
        connection: Duration::from_secs(60),
    };
}

/// Serves `app` on `listener` within `limits`, until the task is dropped (the connections
/// it accepted end within their limits: they are tasks of their own).
pub async fn serve(listener: TcpListener, app: axum::Router, limits: Limits) {
    let slots = Arc::new(Semaphore::new(limits.clients));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.headers);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, say: wait for some to come back rather than spin.
                warn!("metrics endpoint: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            debug!(
                "metrics endpoint: {} clients already, closing one more",
                limits.clients
            );
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        let conn = http.serve_connection(TokioIo::new(stream), service);
        tokio::spawn(async move {
            let _slot = slot;
            let mut conn = std::pin::pin!(conn);
            if timeout(limits.connection, conn.as_mut()).await.is_err() {
                // Lets an answer under way finish; a client that takes too long to read it
                // is dropped.
                conn.as_mut().graceful_shutdown();
                let _ = timeout(limits.headers, conn).await;
            }
        });
    }
}

type Labels = Vec<(&'static str, String)>;

/// One gauge family: a value per label set, the label sets without a value left out (a
/// signal the server does not publish is not invented as 0).
fn gauges(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: impl Iterator<Item = (Labels, Option<f64>)>,
) -> Result<(), std::fmt::Error> {
    let mut family =
        encoder.encode_descriptor(name, help, None, ConstGauge::new(0.0f64).metric_type())?;
    for (labels, value) in values {
        if let Some(v) = value.filter(|v| v.is_finite()) {
            ConstGauge::new(v).encode(family.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// One gauge without labels.
fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: f64,
) -> Result<(), std::fmt::Error> {
    let metric = ConstGauge::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

/// One counter family: a value per label set.
fn counters(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: impl Iterator<Item = (Labels, u64)>,
) -> Result<(), std::fmt::Error> {
    let mut family =
        encoder.encode_descriptor(name, help, None, ConstCounter::new(0u64).metric_type())?;
    for (labels, value) in values {
        ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A counter family with one sample per named event.
fn events(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: &[(String, u64)],
) -> Result<(), std::fmt::Error> {
    let labelled = values.iter().map(|(event, value)| {
        let labels: Labels = vec![("event", event.clone())];
        (labels, *value)
    });
    counters(encoder, name, help, labelled)
}

/// A 0 or 1 gauge value.
fn flag(on: bool) -> Option<f64> {
    Some(f64::from(u8::from(on)))
}

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        events(
            &mut encoder,
            "xdp_events",
            "Packets the XDP program saw (event=packets), and each verdict and pass, drop, \
             flow and hint reason, summed over CPUs.",
            &self.counters,
        )?;
        events(
            &mut encoder,
            "agent_events",
            "Flow-table entries the agent deleted once quiet for 10 s: of connections that \
             ended (flows_reclaimed_ended) and of handshakes never completed \
             (flows_reclaimed_unanswered).",
            &self.reclaimed,
        )?;
        if !self.sync.is_empty() {
            events(
                &mut encoder,
                "sync_events",
                "Flows shared with other gateways: events sent (to each peer), datagrams that \
                 could not be sent, events received and applied, events naming a VIP or server \
                 this agent does not have, datagrams refused (not from a peer, bad tag, \
                 malformed, stale, replayed), reports too old to send.",
                &self.sync,
            )?;
        }
        if !self.peers.is_empty() {
            self.encode_peers(&mut encoder)?;
        }
        let hint_counters = [
            (
                "pool_hinted",
                "Connections opened from a hint port (SYNs), per pool.",
                (|h: &PoolHints| h.hinted) as fn(&PoolHints) -> u64,
            ),
            (
                "pool_hinted_home",
                "Hinted connections placed on their bucket's home (where the prefix is \
                 cached): over balancer_pool_hinted_total, the affinity's hit rate.",
                |h| h.home,
            ),
            (
                "pool_hinted_spilled",
                "Hinted connections not placed on their bucket's home: spilled to a warm \
                 alternate past the home's waiting or TTFT threshold, or placed by the weighted \
                 pick.",
                |h| h.spilled,
            ),
        ];
        // Only with pools that take hints.
        if !self.hints.is_empty() {
            for (name, help, value) in hint_counters {
                let values = self.hints.iter().map(|h| {
                    let labels: Labels = vec![("pool", h.pool.clone())];
                    (labels, value(h))
                });
                counters(&mut encoder, name, help, values)?;
            }
        }
        gauge(
            &mut encoder,
            "ready",
            "1 once every server was scraped and answered a check or went DOWN, and every peer \
             sent its flows (`balancer-agent ready`, GET /ready), until the agent stops; 0 \
             while withdrawn (`balancer-agent withdraw`).",
            if self.ready { 1.0 } else { 0.0 },
        )?;
        if let Some((entries, size)) = self.flow_table {
            gauge(
                &mut encoder,
                "flow_table_entries",
                "Entries in the flow table at the agent's last sweep (every 5 s or so): open \
                 connections, and for 10 s those that ended. Near the size, the LRU evicts the \
                 quietest open connections.",
                entries as f64,
            )?;
            gauge(
                &mut encoder,
                "flow_table_size",
                "Entries the flow table holds at most (agent.flow_table_entries).",
                f64::from(size),
            )?;
        }
        counters(
            &mut encoder,
            "pool_dropped",
            "Client packets to the pool's VIP that the XDP program dropped, whatever the \
             reason (balancer_xdp_events_total says which), since the VIP took its place in \
             the maps.",
            self.pools.iter().map(|p| {
                let labels: Labels = vec![("pool", p.pool.clone())];
                (labels, p.dropped)
            }),
        )?;
        let servers = || {
            self.pools.iter().flat_map(|p| {
                p.servers.iter().map(move |s| {
                    let labels: Labels =
                        vec![("pool", p.pool.clone()), ("server", s.server.clone())];
                    (labels, s)
                })
            })
        };
        let enc = &mut encoder;
        gauges(
            enc,
            "server_state",
            "1 for the server's state, 0 for the others: UP, DOWN (health checks failed), \
             DRAINING.",
            servers().flat_map(|(l, s)| {
                ["UP", "DOWN", "DRAINING"].map(|state| {
                    let mut l = l.clone();
                    l.push(("state", state.to_owned()));
                    (l, flag(s.state == state))
                })
            }),
        )?;
        gauges(
            enc,
            "server_weight",
            "Maglev weight: 0 for saturated, draining, DOWN or configured-0 servers (a DOWN \
             one with a weight: fail-open); the pool's best server has 10000.",
            servers().map(|(l, s)| (l, Some(f64::from(s.weight)))),
        )?;
        gauges(
            enc,
            "server_saturated",
            "1 while the server is past a threshold (waiting, TTFT, KV use) on fresh metrics.",
            servers().map(|(l, s)| (l, flag(s.saturated))),
        )?;
        gauges(
            enc,
            "server_fail_open",
            "1 while the server takes connections only because every server of its pool is \
             saturated, or DOWN (fail-open).",
            servers().map(|(l, s)| (l, flag(s.weight > 0 && s.fail_open))),
        )?;
        counters(
            enc,
            "server_flows_opened",
            "Connections the program opened to the server since its maps were made.",
            servers().map(|(l, s)| (l, s.flows_opened)),
        )?;
        counters(
            enc,
            "server_flows_closed",
            "Of those, the connections that closed (or that other gateways saw close).",
            servers().map(|(l, s)| (l, s.flows_closed)),
        )?;
        gauges(
            enc,
            "server_running",
            "Requests running, as the server last reported.",
            servers().map(|(l, s)| (l, s.running)),
        )?;
        gauges(
            enc,
            "server_waiting",
            "Requests waiting, as the server last reported.",
            servers().map(|(l, s)| (l, s.waiting)),
        )?;
        gauges(
            enc,
            "server_kv_usage_ratio",
            "KV-cache memory in use, 0 to 1, as the server last reported.",
            servers().map(|(l, s)| (l, s.kv_mem)),
        )?;
        gauges(
            enc,
            "server_ttft_seconds",
            "Mean time to first token over the last scrape interval's requests.",
            servers().map(|(l, s)| (l, s.ttft_ms.map(|ms| ms / 1000.0))),
        )?;
        gauges(
            enc,
            "server_flows",
            "Connections through the balancer to the server that have not closed.",
            servers().map(|(l, s)| (l, Some(s.flows as f64))),
        )?;
        gauges(
            enc,
            "server_new_flows_per_second",
            "New connections per second over the last fold of the program's counters.",
            servers().map(|(l, s)| (l, Some(s.new_per_s))),
        )?;
        gauges(
            enc,
            "server_metrics_age_seconds",
            "Age of the last good scrape of the server's metrics (absent: never scraped).",
            servers().map(|(l, s)| (l, s.metrics_age_ms.map(|ms| ms as f64 / 1000.0))),
        )?;
        gauges(
            enc,
            "server_scrape_failing",
            "1 while the last scrape of the server's metrics failed.",
            servers().map(|(l, s)| (l, Some(f64::from(u8::from(s.scrape_error.is_some()))))),
        )?;
        Ok(())
    }
}

impl Snapshot {
    fn encode_peers(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let peers = || {
            self.peers.iter().map(|p| {
                let labels: Labels = vec![("peer", p.peer.clone())];
                (labels, p)
            })
        };
        let up = format!(
            "1 while a datagram of the peer was accepted within the last {} s (each gateway \
             sends every peer one a second).",
            crate::sync::SILENT_AFTER.as_secs_f64()
        );
        gauges(
            enc,
            "sync_peer_up",
            &up,
            peers().map(|(l, p)| (l, flag(p.state == PeerState::Up))),
        )?;
        gauges(
            enc,
            "sync_peer_last_heard_seconds",
            "Time since the peer's last accepted datagram (absent: never heard from).",
            peers().map(|(l, p)| (l, p.heard_ms_ago.map(|ms| ms as f64 / 1000.0))),
        )?;
        counters(
            enc,
            "sync_peer_events_received",
            "Flow events received from the peer.",
            peers().map(|(l, p)| (l, p.events_in)),
        )?;
        counters(
            enc,
            "sync_peer_refused",
            "Datagrams from the peer's address refused (bad tag: another key; stale: clocks \
             apart; malformed, replayed).",
            peers().map(|(l, p)| (l, p.refused)),
        )?;
        counters(
            enc,
            "sync_peer_send_errors",
            "Datagrams to the peer that could not be sent.",
            peers().map(|(l, p)| (l, p.send_errors)),
        )?;
        counters(
            enc,
            "sync_peer_restarts",
            "Times the peer's agent restarted while this one ran.",
            peers().map(|(l, p)| (l, p.restarts)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::ServerRow;
    use std::time::Instant;
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpStream,
    };

    /// Waits (at most `within`) for `stream` to be closed by the other end.
    async fn closed(stream: &mut TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 4096];
        loop {
            match timeout(within, stream.read(&mut buf)).await {
                Err(_) => return false,
                Ok(Ok(0) | Err(_)) => return true,
                Ok(Ok(_)) => {}
            }
        }
    }

    async fn get(stream: &mut TcpStream) -> String {
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nhost: agent\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 4096];
        let n = timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("an answer")
            .unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[tokio::test]
    async fn the_endpoint_bounds_its_clients() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new().route("/metrics", axum::routing::get(|| async { "up" }));
        let limits = Limits {
            clients: 2,
            headers: Duration::from_millis(400),
            connection: Duration::from_secs(2),
        };
        let server = tokio::spawn(serve(listener, app, limits));

        // Two clients that send nothing take both places; a third is closed at once.
        let connected = Instant::now();
        let mut silent = [
            TcpStream::connect(addr).await.unwrap(),
            TcpStream::connect(addr).await.unwrap(),
        ];
        let mut third = TcpStream::connect(addr).await.unwrap();
        assert!(closed(&mut third, Duration::from_secs(5)).await);
        let elapsed = connected.elapsed();
        assert!(elapsed < limits.headers, "{elapsed:?}");
        // The silent ones are closed once their headers are overdue.
        for s in &mut silent {
            assert!(closed(s, Duration::from_secs(5)).await);
        }
        let elapsed = connected.elapsed();
        assert!(elapsed >= limits.headers, "{elapsed:?}");

        // Their places are free again; a client asking in time is answered, on one
        // connection, until the connection's time is up.
        let started = Instant::now();
        let mut client = TcpStream::connect(addr).await.unwrap();
        let mut answers = 0;
        while started.elapsed() < Duration::from_secs(5) {
            client
                .write_all(b"GET /metrics HTTP/1.1\r\nhost: agent\r\n\r\n")
                .await
                .ok();
            let mut buf = [0u8; 4096];
            match timeout(Duration::from_secs(5), client.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => {
                    let answer = String::from_utf8_lossy(&buf[..n]);
                    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
                    answers += 1;
                }
                _ => break,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let lived = started.elapsed();
        assert!(answers > 5, "{answers} answers");
        assert!(
            lived >= limits.connection && lived < limits.connection * 2,
            "the connection lived {lived:?}"
        );
        assert!(get(&mut TcpStream::connect(addr).await.unwrap())
            .await
            .starts_with("HTTP/1.1 200"));
        server.abort();
    }

    fn row(server: &str, state: &str, running: Option<f64>) -> ServerRow {
        ServerRow {
            server: server.into(),
            running,
            waiting: Some(2.0),
            kv_mem: None,
            ttft_ms: Some(250.0),
            state: state.into(),
            weight: 10000,
            flows: 7,
            new_per_s: 1.5,
            reason: "load 3".into(),
            dialect: Some("vllm".into()),
            metrics_age_ms: Some(400),
            scrape_error: None,
            health: "ok".into(),
            stale: false,
            saturated: false,
            fail_open: false,
            flows_opened: 10,
            flows_closed: 3,
        }
    }

    #[test]
    fn exposition_reads_back_as_the_snapshot() {
        let snapshot = Snapshot {
            counters: vec![("packets".into(), 12), ("flow_new_syn".into(), 3)],
            reclaimed: vec![("flows_reclaimed_ended".into(), 5)],
            sync: vec![("sync_sent".into(), 7)],
            peers: vec![
                PeerRow {
                    peer: "10.0.2.2:7471".into(),
                    state: PeerState::Up,
                    heard_ms_ago: Some(400),
                    events_in: 12,
                    refused: 1,
                    send_errors: 0,
                    restarts: 2,
                    problem: None,
                    flows_at_start: Some(12),
                },
                PeerRow {
                    peer: "10.0.2.3:7471".into(),
                    state: PeerState::Silent,
                    heard_ms_ago: None,
                    events_in: 0,
                    refused: 0,
                    send_errors: 5,
                    restarts: 0,
                    problem: Some("never heard from".into()),
                    flows_at_start: None,
                },
            ],
            flow_table: Some((1200, 262144)),
            ready: true,
            hints: vec![PoolHints {
                pool: "chat-pool".into(),
                hinted: 40,
                home: 31,
                spilled: 6,
            }],
            pools: vec![PoolView {
                pool: "chat-pool".into(),
                vip: "192.0.2.60:8000".into(),
                forwarding: Default::default(),
                servers: vec![
                    ServerRow {
                        saturated: true,
                        fail_open: true,
                        reason: "fail-open: shared by load (waiting 2 >= 1)".into(),
                        ..row("10.4.0.11:8000", "UP", Some(3.0))
                    },
                    row("10.4.0.12:8000", "DRAINING", None),
                ],
                dropped: 9,
            }],
        };
        let text = render(snapshot).unwrap();
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        let parsed =
            prometheus_parse::Scrape::parse(lines.iter().map(|l| Ok(l.to_string()))).unwrap();
        let labelled = |name: &str, label: &str, is: Option<&str>| {
            parsed
                .samples
                .iter()
                .filter(|s| s.metric == name)
                .filter(|s| is.is_none_or(|v| s.labels.get(label) == Some(v)))
                .map(|s| match s.value {
                    prometheus_parse::Value::Counter(v)
                    | prometheus_parse::Value::Gauge(v)
                    | prometheus_parse::Value::Untyped(v) => v,
                    _ => f64::NAN,
                })
                .collect::<Vec<_>>()
        };
        let value = |name: &str, server: Option<&str>| labelled(name, "server", server);
        assert_eq!(value("balancer_xdp_events_total", None), [12.0, 3.0]);
        // Every peer a sample, but the time since a peer never heard from.
        let peer = |name: &str| labelled(name, "peer", None);
        assert_eq!(peer("balancer_sync_peer_up"), [1.0, 0.0]);
        assert_eq!(peer("balancer_sync_peer_last_heard_seconds"), [0.4]);
        let second = labelled("balancer_sync_peer_up", "peer", Some("10.0.2.3:7471"));
        assert_eq!(second, [0.0]);
        assert_eq!(
            peer("balancer_sync_peer_events_received_total"),
            [12.0, 0.0]
        );
        assert_eq!(peer("balancer_sync_peer_refused_total"), [1.0, 0.0]);
        assert_eq!(peer("balancer_sync_peer_send_errors_total"), [0.0, 5.0]);
        assert_eq!(peer("balancer_sync_peer_restarts_total"), [2.0, 0.0]);
        assert_eq!(value("balancer_sync_events_total", None), [7.0]);
        assert_eq!(value("balancer_agent_events_total", None), [5.0]);
        assert_eq!(value("balancer_ready", None), [1.0]);
        assert_eq!(value("balancer_pool_hinted_total", None), [40.0]);
        assert_eq!(
            labelled("balancer_pool_dropped_total", "pool", Some("chat-pool")),
            [9.0]
        );
        assert_eq!(value("balancer_pool_hinted_home_total", None), [31.0]);
        assert_eq!(value("balancer_pool_hinted_spilled_total", None), [6.0]);
        assert_eq!(value("balancer_flow_table_entries", None), [1200.0]);
        assert_eq!(value("balancer_flow_table_size", None), [262144.0]);
        assert_eq!(
            value("balancer_server_running", Some("10.4.0.11:8000")),
            [3.0]
        );
        // Not published: no sample rather than a 0.
        assert!(value("balancer_server_running", Some("10.4.0.12:8000")).is_empty());
        assert!(value("balancer_server_kv_usage_ratio", None).is_empty());
        assert_eq!(
            value("balancer_server_ttft_seconds", Some("10.4.0.11:8000")),
            [0.25]
        );
        assert_eq!(value("balancer_server_flows", None), [7.0, 7.0]);
        assert_eq!(
            value("balancer_server_flows_opened_total", Some("10.4.0.11:8000")),
            [10.0]
        );
        assert_eq!(
            value("balancer_server_flows_closed_total", None),
            [3.0, 3.0]
        );
        assert_eq!(value("balancer_server_saturated", None), [1.0, 0.0]);
        assert_eq!(value("balancer_server_fail_open", None), [1.0, 0.0]);
        // Every state a sample, so that "no server UP" is a 0, not an empty answer.
        let states: Vec<(&str, f64)> = parsed
            .samples
            .iter()
            .filter(|s| {
                s.metric == "balancer_server_state"
                    && s.labels.get("server") == Some("10.4.0.12:8000")
            })
            .map(|s| match s.value {
                prometheus_parse::Value::Gauge(v) => (s.labels.get("state").unwrap(), v),
                _ => ("?", f64::NAN),
            })
            .collect();
        assert_eq!(states, [("UP", 0.0), ("DOWN", 0.0), ("DRAINING", 1.0)]);
        let draining = parsed
            .samples
            .iter()
            .find(|s| {
                s.metric == "balancer_server_state" && s.labels.get("state") == Some("DRAINING")
            })
            .expect("a state sample");
        assert_eq!(draining.labels.get("pool"), Some("chat-pool"));
        assert!(
            text.contains("# TYPE balancer_server_weight gauge"),
            "{text}"
        );
        // OpenMetrics escapes these in HELP text and the encoder writes it as given: none may
        // appear (strict parsers refuse the whole exposition).
        for help in lines.iter().filter(|l| l.starts_with("# HELP")) {
            assert!(!help.contains(['"', '\\']), "{help}");
        }
    }
}
