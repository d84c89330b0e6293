//! The configuration file: the agent's public interface. Keys are never renamed; new keys
//! get defaults so that old files keep working. Loading either yields a configuration that
//! the data path can carry out, or an error naming the file, the key and the problem.

use std::{
    collections::{HashMap, HashSet},
    fmt,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
};

use balancer_common::{
    hint::{HintRange, DEFAULT_HINT_BUCKETS},
    DEFAULT_FLOW_ENTRIES, DEFAULT_IDLE_TIMEOUT_S, MAGLEV_SIZE, MAX_INTERFACES, MAX_REPLY_VIPS,
    MAX_VIPS,
};
use serde::Deserialize;

use crate::dialect::Dialect;

/// At least 100 Maglev slots per server keeps each server's share within 1% of its weight.
pub const MAX_SERVERS_PER_POOL: usize = (MAGLEV_SIZE / 100) as usize;
/// Weights are relative; a cap keeps the Maglev fill loop's counters small.
pub const MAX_WEIGHT: u32 = 1_000_000;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub agent: Agent,
    /// Sharing flows with the other gateways of the same VIPs; none when absent.
    #[serde(default)]
    pub sync: Option<FlowSync>,
    #[serde(default)]
    pub pool: Vec<Pool>,
}

/// `[sync]`: gateways behind ECMP tell each other every flow they place, so that a
/// connection keeps its server when its packets move to another gateway (`sync.rs`). Read
/// at start only.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowSync {
    /// Where this agent receives its peers' flows (UDP).
    pub listen: SocketAddr,
    /// The other gateways' `listen` addresses; datagrams from any other address are refused.
    pub peers: Vec<SocketAddr>,
    /// A file holding the key all the gateways share (at least 32 bytes; surrounding
    /// whitespace is ignored): every datagram is authenticated with it.
    pub key_file: PathBuf,
    /// Files of keys also accepted from peers, while a new key is rolled out (the key
    /// files are read again at every reload).
    #[serde(default)]
    pub accept_key_files: Vec<PathBuf>,
}

impl FlowSync {
    /// The same socket and peers: what a reload can keep running with (the keys change at
    /// a reload, the rest at a restart).
    pub fn same_peering(&self, other: &FlowSync) -> bool {
        self.listen == other.listen && self.peers == other.peers
    }
}

/// Keys accepted besides `key_file`: one rollout at a time needs one; a few leave room.
pub const MAX_ACCEPTED_KEYS: usize = 4;

/// More peers than this is a configuration mistake: every flow is sent to each.
pub const MAX_SYNC_PEERS: usize = 32;
/// With `[sync]`, the shortest idle timeout: keepalives go out every third of it, at most a
/// second late, so that a peer's entry outlives one lost keepalive.
pub const MIN_SYNC_IDLE_TIMEOUT_S: u32 = 10;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Agent {
    /// Interfaces the program is attached to.
    pub interfaces: Vec<String>,
    /// Unix socket of the CLI.
    #[serde(default = "default_control_socket")]
    pub control_socket: PathBuf,
    /// Flow-table capacity in entries, one per connection. Read at start only: the table is
    /// created once.
    #[serde(default = "default_flow_entries")]
    pub flow_table_entries: u32,
    /// How often every server's metrics are fetched.
    #[serde(default = "default_scrape_interval_ms")]
    pub scrape_interval_ms: u64,
    /// Per-request limit of a scrape; by default the interval, at most one second.
    #[serde(default)]
    pub scrape_timeout_ms: Option<u64>,
    /// How often each server gets a one-token completion.
    #[serde(default = "default_health_interval_ms")]
    pub health_interval_ms: u64,
    #[serde(default = "default_health_timeout_ms")]
    pub health_timeout_ms: u64,
    /// A server with a queue whose progress counter (see `dialect`) scrapes have found
    /// unchanged, while it had requests, for this long is hung, not busy: its checks that
    /// time out count as failed again.
    #[serde(default = "default_hung_after_ms")]
    pub hung_after_ms: u64,
    /// Consecutive failed checks that take a server DOWN.
    #[serde(default = "default_fall")]
    pub fall: u32,
    /// Consecutive good checks that bring it back UP.
    #[serde(default = "default_rise")]
    pub rise: u32,
    /// Where the agent serves its own Prometheus metrics (`GET /metrics`); none when absent.
    #[serde(default)]
    pub metrics_listen: Option<SocketAddr>,
    /// A directory on bpffs where the agent pins its maps and links. With it, the program
    /// stays attached when the agent stops or dies, and the next agent takes its maps and
    /// links over: open connections survive a restart or an upgrade. Without it, stopping
    /// the agent detaches the program. Read at start only.
    #[serde(default)]
    pub pin_dir: Option<PathBuf>,
    /// How the program is attached: in the driver (native), or in the stack (generic). Read
    /// at start only.
    #[serde(default)]
    pub xdp_mode: XdpMode,
}

#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum XdpMode {
    /// Native, or generic where the driver has no XDP support.
    #[default]
    Auto,
    /// Native only: an interface whose driver cannot fails the start or the reload.
    Native,
    /// Generic everywhere (a driver whose native XDP misbehaves, say).
    Generic,
}

impl Agent {
    pub fn scrape_timeout_ms(&self) -> u64 {
        self.scrape_timeout_ms
            .unwrap_or(self.scrape_interval_ms.min(1000))
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pool {
    pub name: String,
    pub vip: IpAddr,
    pub port: u16,
    /// How the client's packets reach a server. Read at start only: a change would strand
    /// the pool's open connections.
    #[serde(default)]
    pub forwarding: Forwarding,
    /// With `forwarding = "tunnel"`: the outer header's source, an address of this gateway
    /// that the servers route back to and take tunnelled packets from.
    #[serde(default)]
    pub tunnel_source: Option<IpAddr>,
    /// A connection idle for longer than this loses its backend.
    #[serde(default = "default_idle_timeout_s")]
    pub idle_timeout_s: u32,
    /// A server with this many requests waiting is saturated: weight 0, and new connections
    /// only where every other choice is fuller (`docs/policy.md`).
    #[serde(default = "default_spill_waiting")]
    pub spill_waiting: u32,
    /// A server whose recent time to first token reaches this is saturated.
    #[serde(default = "default_spill_ttft_ms")]
    pub spill_ttft_ms: u32,
    /// A server whose KV-cache memory use reaches this fraction is saturated.
    #[serde(default = "default_kv_high")]
    pub kv_high: f64,
    /// Metric dialect of every server of the pool; detected from the names when absent.
    #[serde(default)]
    pub dialect: Option<Dialect>,
    /// Model named in health-check completions; the server's first model when absent.
    #[serde(default)]
    pub model: Option<String>,
    /// A file holding the bearer token the servers' API wants (their `--api-key`), sent with
    /// every health check and scrape; read at start and at every reload
    /// (`access::load`).
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// HTTPS to the servers for health checks and scrapes (`[pool.tls]`); plain HTTP when
    /// absent.
    #[serde(default)]
    pub tls: Option<PoolTls>,
    /// Source ports that carry prefix hints, "FIRST-LAST" inclusive, or "off".
    #[serde(default = "default_hint_ports")]
    pub hint_ports: String,
    #[serde(default = "default_hint_buckets")]
    pub hint_buckets: u16,
    /// Requests each server runs at once (vLLM's max_num_seqs, llama.cpp's -np): how many
    /// new connections a bucket's home takes before it spills. Learned from the highest
    /// running count seen when absent.
    #[serde(default)]
    pub slots: Option<u32>,
    /// How far above its weighted share of the hinted connections a server may be home for
    /// popular buckets before some move to the next server of their rendezvous order
    /// (docs/affinity.md); 0 keeps the plain rendezvous homes.
    #[serde(default = "default_home_load_bound")]
    pub home_load_bound: f64,
    #[serde(default)]
    pub server: Vec<Server>,
}

/// How the agent's health checks and scrapes verify a pool's servers over HTTPS
/// (`access::Tls`): against `ca_file`, for `server_name` or else the server's address, with
/// `cert_file` and `key_file` as the agent's own certificate where the servers ask for one.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolTls {
    pub ca_file: PathBuf,
    #[serde(default)]
    pub server_name: Option<String>,
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    #[serde(default)]
    pub key_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Forwarding {
    /// Translated to the server's address and port; its replies come back through the
    /// gateway, which translates them back.
    #[default]
    Nat,
    /// Direct server return: unchanged, to the server's MAC. The server is on a link of the
    /// gateway, holds the VIP on a loopback, listens on the VIP's port and answers the client
    /// itself.
    Dsr,
    /// Direct server return through a tunnel: unchanged inside an outer IPv4 (IPIP) or IPv6
    /// (IP6IP6) header from `tunnel_source` to the server, which may be routers away. The
    /// server takes the header off, holds the VIP, listens on the VIP's port and answers the
    /// client itself.
    Tunnel,
}

impl Forwarding {
    /// The servers answer the clients themselves: nothing of theirs comes back through the
    /// gateway, and the client's FIN is the end of a connection there is to see.
    pub fn direct(self) -> bool {
        self != Forwarding::Nat
    }

    /// As the configuration spells it.
    pub fn name(self) -> &'static str {
        match self {
            Forwarding::Nat => "nat",
            Forwarding::Dsr => "dsr",
            Forwarding::Tunnel => "tunnel",
        }
    }
}

impl Pool {
    /// The hint range; checked when the file is loaded, so None only means "off".
    pub fn hint_range(&self) -> Option<HintRange> {
        parse_hint_range(&self.hint_ports, self.hint_buckets)
            .ok()
            .flatten()
    }
}

fn parse_hint_range(ports: &str, buckets: u16) -> Result<Option<HintRange>, String> {
    if ports == "off" {
        // Unused, but a value out of range is a mistake all the same.
        return HintRange::check_buckets(buckets)
            .map(|()| None)
            .map_err(|e| format!("hint_buckets = {buckets}: {}", e.message()));
    }
    let bad = || format!("{ports:?} is not \"FIRST-LAST\" (e.g. \"16384-32767\") or \"off\"");
    let (first, last) = ports.split_once('-').ok_or_else(bad)?;
    let first: u16 = first.trim().parse().map_err(|_| bad())?;
    let last: u16 = last.trim().parse().map_err(|_| bad())?;
    if last < first {
        return Err(format!("{ports:?}: the last port is below the first"));
    }
    let span = u32::from(last) - u32::from(first) + 1;
    let span = u16::try_from(span).map_err(|_| format!("{ports:?}: at most 65535 ports"))?;
    HintRange::new(first, span, buckets)
        .map(Some)
        .map_err(|e| format!("{ports:?} with hint_buckets = {buckets}: {}", e.message()))
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Server {
    pub address: IpAddr,
    /// Inference API port.
    pub port: u16,
    /// Port of the Prometheus metrics endpoint.
    pub metrics_port: u16,
    /// Relative weight; 0 takes no new connection.
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Overrides the pool's `dialect` for this server.
    #[serde(default)]
    pub dialect: Option<Dialect>,
}

/// Where the agent listens and the CLI connects unless told otherwise.
pub const DEFAULT_CONTROL_SOCKET: &str = "/run/balancer/agent.sock";

fn default_control_socket() -> PathBuf {
    PathBuf::from(DEFAULT_CONTROL_SOCKET)
}
fn default_flow_entries() -> u32 {
    DEFAULT_FLOW_ENTRIES
}
fn default_idle_timeout_s() -> u32 {
    DEFAULT_IDLE_TIMEOUT_S
}
fn default_weight() -> u32 {
    100
}
fn default_scrape_interval_ms() -> u64 {
    2000
}
fn default_health_interval_ms() -> u64 {
    5000
}
fn default_health_timeout_ms() -> u64 {
    2000
}
fn default_hung_after_ms() -> u64 {
    30_000
}
fn default_fall() -> u32 {
    3
}
fn default_rise() -> u32 {
    2
}
fn default_spill_waiting() -> u32 {
    1
}
fn default_spill_ttft_ms() -> u32 {
    500
}
fn default_kv_high() -> f64 {
    0.95
}
fn default_hint_ports() -> String {
    "16384-32767".into()
}
fn default_home_load_bound() -> f64 {
    1.25
}
fn default_hint_buckets() -> u16 {
    DEFAULT_HINT_BUCKETS
}

/// A configuration that could not be loaded, with where and why.
#[derive(Debug)]
pub struct ConfigError {
    pub file: PathBuf,
    pub key: String,
    pub problem: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            write!(f, "{}: {}", self.file.display(), self.problem)
        } else {
            write!(
                f,
                "{}: `{}`: {}",
                self.file.display(),
                self.key,
                self.problem
            )
        }
    }
}

impl std::error::Error for ConfigError {}

fn validate_tls(tls: &PoolTls) -> Result<(), (&'static str, String)> {
    let files = [
        ("ca_file", Some(&tls.ca_file)),
        ("cert_file", tls.cert_file.as_ref()),
        ("key_file", tls.key_file.as_ref()),
    ];
    for (key, file) in files {
        if file.is_some_and(|f| f.as_os_str().is_empty()) {
            return Err((key, "must not be empty".into()));
        }
    }
    match (&tls.cert_file, &tls.key_file) {
        (Some(_), None) => return Err(("key_file", "is required with cert_file".into())),
        (None, Some(_)) => return Err(("cert_file", "is required with key_file".into())),
        _ => {}
    }
    if let Some(name) = &tls.server_name {
        rustls::pki_types::ServerName::try_from(name.as_str()).map_err(|_| {
            (
                "server_name",
                format!("{name:?} is not a DNS name or an IP address"),
            )
        })?;
    }
    Ok(())
}

fn validate_sync(sync: &FlowSync) -> Result<(), (String, String)> {
    if sync.listen.port() == 0 {
        return Err(("sync.listen".into(), "needs a port".into()));
    }
    // Datagrams leave from it, and peers check where they come from.
    if sync.listen.ip().is_unspecified() {
        return Err((
            "sync.listen".into(),
            "needs this gateway's own address, not a wildcard: peers recognise it by it".into(),
        ));
    }
    if sync.peers.is_empty() || sync.peers.len() > MAX_SYNC_PEERS {
        return Err((
            "sync.peers".into(),
            format!("needs 1 to {MAX_SYNC_PEERS} peers"),
        ));
    }
    let mut seen = HashSet::new();
    for peer in &sync.peers {
        // One datagram to each peer: none can go to a group or to everyone.
        let group =
            peer.ip().is_multicast() || matches!(peer.ip(), IpAddr::V4(v4) if v4.is_broadcast());
        if peer.port() == 0 || peer.ip().is_unspecified() || group {
            return Err(("sync.peers".into(), format!("{peer} cannot be a peer")));
        }
        // The kernel sends nothing from a loopback address to another host.
        if sync.listen.ip().is_loopback() && !peer.ip().is_loopback() {
            return Err((
                "sync.peers".into(),
                format!(
                    "{peer} is not reachable from sync.listen's loopback address {}",
                    sync.listen.ip()
                ),
            ));
        }
        // Datagrams to it leave from sync.listen's address.
        if peer.is_ipv4() != sync.listen.is_ipv4() {
            return Err((
                "sync.peers".into(),
                format!("{peer} is not of sync.listen's address family"),
            ));
        }
        if *peer == sync.listen {
            return Err((
                "sync.peers".into(),
                format!("{peer} is this agent's own sync.listen"),
            ));
        }
        if !seen.insert(peer) {
            return Err(("sync.peers".into(), format!("{peer} is listed twice")));
        }
    }
    if sync.key_file.as_os_str().is_empty() {
        return Err(("sync.key_file".into(), "must not be empty".into()));
    }
    if sync.accept_key_files.len() > MAX_ACCEPTED_KEYS {
        return Err((
            "sync.accept_key_files".into(),
            format!("at most {MAX_ACCEPTED_KEYS} files"),
        ));
    }
    for file in &sync.accept_key_files {
        if file.as_os_str().is_empty() || *file == sync.key_file {
            return Err((
                "sync.accept_key_files".into(),
                format!("{file:?} is empty or the key_file itself"),
            ));
        }
    }
    Ok(())
}

impl Config {
    pub fn load(file: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(file).map_err(|e| ConfigError {
            file: file.to_owned(),
            key: String::new(),
            problem: format!("cannot read: {e}"),
        })?;
        Config::parse(file, &text)
    }

    pub fn parse(file: &Path, text: &str) -> Result<Config, ConfigError> {
        let err = |key: String, problem: String| ConfigError {
            file: file.to_owned(),
            key,
            problem,
        };
        let config: Config = toml::from_str(text).map_err(|e| {
            // toml points at the offending text; name the key and line from it, on one line.
            let (key, line) = match e.span() {
                Some(span) => {
                    let line_no = text[..span.start].matches('\n').count() + 1;
                    let line = text.lines().nth(line_no - 1).unwrap_or("");
                    let key = line.split_once('=').map_or(line, |(k, _)| k).trim();
                    (key.to_owned(), format!(" (line {line_no})"))
                }
                None => (String::new(), String::new()),
            };
            err(
                key,
                format!("{}{line}", e.message().trim().replace('\n', "; ")),
            )
        })?;
        config
            .validate()
            .map_err(|(key, problem)| err(key, problem))?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), (String, String)> {
        let a = &self.agent;
        if a.interfaces.is_empty() {
            return Err((
                "agent.interfaces".into(),
                "needs at least one interface".into(),
            ));
        }
        if a.interfaces.len() > MAX_INTERFACES as usize {
            return Err((
                "agent.interfaces".into(),
                format!("at most {MAX_INTERFACES} interfaces"),
            ));
        }
        let mut seen = HashSet::new();
        for name in &a.interfaces {
            if name.is_empty() || name.len() > 15 || name.contains(['/', ' ']) {
                return Err((
                    "agent.interfaces".into(),
                    format!("{name:?} is not a valid interface name"),
                ));
            }
            if !seen.insert(name) {
                return Err((
                    "agent.interfaces".into(),
                    format!("{name:?} is listed twice"),
                ));
            }
        }
        if a.control_socket.as_os_str().is_empty() {
            return Err(("agent.control_socket".into(), "must not be empty".into()));
        }
        if let Some(dir) = &a.pin_dir {
            if !dir.is_absolute() || dir.parent().is_none() {
                return Err((
                    "agent.pin_dir".into(),
                    format!(
                        "{} must be an absolute path below a bpffs mount",
                        dir.display()
                    ),
                ));
            }
        }
        // With port 0 the kernel would pick one, and no scraper would know it.
        if a.metrics_listen.is_some_and(|m| m.port() == 0) {
            return Err(("agent.metrics_listen".into(), "needs a port".into()));
        }
        if let Some(sync) = &self.sync {
            validate_sync(sync)?;
        }
        if !(1024..=1 << 26).contains(&a.flow_table_entries) {
            return Err((
                "agent.flow_table_entries".into(),
                format!("{} is outside 1024..=67108864", a.flow_table_entries),
            ));
        }
        let ranges: [(&str, u64, u64, u64); 6] = [
            (
                "agent.scrape_interval_ms",
                a.scrape_interval_ms,
                100,
                60_000,
            ),
            (
                "agent.scrape_timeout_ms",
                a.scrape_timeout_ms(),
                10,
                a.scrape_interval_ms,
            ),
            (
                "agent.health_interval_ms",
                a.health_interval_ms,
                100,
                600_000,
            ),
            ("agent.health_timeout_ms", a.health_timeout_ms, 10, 60_000),
            ("agent.hung_after_ms", a.hung_after_ms, 1000, 3_600_000),
            ("agent.fall", u64::from(a.fall), 1, 100),
        ];
        for (key, v, lo, hi) in ranges {
            if !(lo..=hi).contains(&v) {
                return Err((key.into(), format!("{v} is outside {lo}..={hi}")));
            }
        }
        if !(1..=100).contains(&a.rise) {
            return Err((
                "agent.rise".into(),
                format!("{} is outside 1..=100", a.rise),
            ));
        }
        if self.pool.len() > MAX_VIPS as usize {
            return Err((
                "pool".into(),
                format!("at most {MAX_VIPS} pools are supported"),
            ));
        }
        let mut names = HashSet::new();
        let mut vips = HashSet::new();
        let mut in_pools = HashMap::new();
        for (i, p) in self.pool.iter().enumerate() {
            let at = |k: &str| format!("pool[{i}].{k}");
            // It names the pool on the command line, in logs and as a metrics label.
            let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
            if p.name.is_empty() || !p.name.chars().all(plain) {
                return Err((
                    at("name"),
                    format!(
                        "{:?} must be non-empty: letters, digits, '-', '_' and '.' only",
                        p.name
                    ),
                ));
            }
            if !names.insert(&p.name) {
                return Err((at("name"), format!("{:?} is used by two pools", p.name)));
            }
            if p.port == 0 {
                return Err((at("port"), "must be 1-65535".into()));
            }
            if let Some(problem) = unroutable(p.vip) {
                return Err((at("vip"), format!("{} cannot be a VIP: {problem}", p.vip)));
            }
            if !vips.insert((p.vip, p.port)) {
                return Err((
                    at("vip"),
                    format!("{}:{} is used by two pools", p.vip, p.port),
                ));
            }
            // The program refreshes a flow's last packet time once a second: a timeout of
            // one second would expire flows that are sending.
            if p.idle_timeout_s < 2 || p.idle_timeout_s > 7 * 24 * 3600 {
                return Err((at("idle_timeout_s"), "must be 2 s to 7 days".into()));
            }
            if self.sync.is_some() && p.idle_timeout_s < MIN_SYNC_IDLE_TIMEOUT_S {
                return Err((
                    at("idle_timeout_s"),
                    format!(
                        "must be at least {MIN_SYNC_IDLE_TIMEOUT_S} s with [sync]: peers' \
                         entries live on keepalives sent every third of it"
                    ),
                ));
            }
            if !(1..=100_000).contains(&p.spill_waiting) {
                return Err((at("spill_waiting"), "must be 1-100000".into()));
            }
            if !(1..=600_000).contains(&p.spill_ttft_ms) {
                return Err((at("spill_ttft_ms"), "must be 1-600000".into()));
            }
            if !(p.kv_high > 0.0 && p.kv_high <= 1.0) {
                return Err((at("kv_high"), format!("{} is not in (0, 1]", p.kv_high)));
            }
            if p.model.as_ref().is_some_and(|m| m.is_empty()) {
                return Err((at("model"), "must not be empty".into()));
            }
            if p.api_key_file
                .as_ref()
                .is_some_and(|f| f.as_os_str().is_empty())
            {
                return Err((at("api_key_file"), "must not be empty".into()));
            }
            if let Some(tls) = &p.tls {
                validate_tls(tls).map_err(|(k, e)| (at(&format!("tls.{k}")), e))?;
            }
            match (p.forwarding, p.tunnel_source) {
                (Forwarding::Tunnel, None) => {
                    return Err((
                        at("tunnel_source"),
                        "is required with forwarding = \"tunnel\": the outer header's source, \
                         an address of this gateway"
                            .into(),
                    ))
                }
                (Forwarding::Tunnel, Some(a)) if a.is_ipv4() != p.vip.is_ipv4() => {
                    return Err((
                        at("tunnel_source"),
                        format!(
                            "{a} is not of the VIP's family ({}): the outer header is of the \
                             client's packet's family (IPIP, IP6IP6)",
                            p.vip
                        ),
                    ))
                }
                (Forwarding::Tunnel, Some(a)) => {
                    if let Some(problem) = unroutable(a) {
                        return Err((
                            at("tunnel_source"),
                            format!("{a} cannot be a tunnel's source: {problem}"),
                        ));
                    }
                    if let Some(q) = self.pool.iter().find(|q| q.vip == a) {
                        return Err((
                            at("tunnel_source"),
                            format!(
                                "{a} is pool {}'s VIP, which the servers hold themselves: \
                                 name an address of this gateway's own",
                                q.name
                            ),
                        ));
                    }
                }
                (_, Some(_)) => {
                    return Err((
                        at("tunnel_source"),
                        "is only for forwarding = \"tunnel\"".into(),
                    ))
                }
                (_, None) => {}
            }
            parse_hint_range(&p.hint_ports, p.hint_buckets).map_err(|e| (at("hint_ports"), e))?;
            let bound = p.home_load_bound;
            if bound != 0.0 && !(1.0..=100.0).contains(&bound) {
                return Err((at("home_load_bound"), "must be 0 (off) or 1-100".into()));
            }
            if p.slots.is_some_and(|n| !(1..=1_000_000).contains(&n)) {
                return Err((at("slots"), "must be 1-1000000".into()));
            }
            if p.server.len() > MAX_SERVERS_PER_POOL {
                return Err((
                    at("server"),
                    format!("at most {MAX_SERVERS_PER_POOL} servers per pool"),
                ));
            }
            let mut servers = HashSet::new();
            for (j, s) in p.server.iter().enumerate() {
                let at = |k: &str| format!("pool[{i}].server[{j}].{k}");
                if s.address.is_ipv4() != p.vip.is_ipv4() {
                    return Err((
                        at("address"),
                        format!("{} is not of the VIP's family ({})", s.address, p.vip),
                    ));
                }
                if let Some(problem) = unroutable(s.address) {
                    return Err((
                        at("address"),
                        format!("{} cannot be a server: {problem}", s.address),
                    ));
                }
                if s.port == 0 {
                    return Err((at("port"), "must be 1-65535".into()));
                }
                if p.forwarding.direct() && s.port != p.port {
                    return Err((
                        at("port"),
                        format!(
                            "must be the pool's port {} with forwarding = \"{}\": the server \
                             receives the client's packets unchanged",
                            p.port,
                            p.forwarding.name()
                        ),
                    ));
                }
                if s.metrics_port == 0 {
                    return Err((at("metrics_port"), "must be 1-65535".into()));
                }
                if s.weight > MAX_WEIGHT {
                    return Err((at("weight"), format!("must be 0-{MAX_WEIGHT}")));
                }
                if !servers.insert((s.address, s.port)) {
                    return Err((
                        at("address"),
                        format!("{}:{} is listed twice in this pool", s.address, s.port),
                    ));
                }
                // DSR and tunnel pools have no replies to tell apart.
                let pools = in_pools.entry((s.address, s.port)).or_insert(0);
                *pools += usize::from(p.forwarding == Forwarding::Nat);
                if *pools > MAX_REPLY_VIPS {
                    return Err((
                        at("address"),
                        format!(
                            "{}:{} is in more than {MAX_REPLY_VIPS} NAT pools; the program \
                             tells whose replies are whose from at most that many VIPs",
                            s.address, s.port
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Why packets to `a` cannot be balanced, if they cannot.
pub fn unroutable(a: IpAddr) -> Option<&'static str> {
    match a {
        // No IPv4 packet carries it: the pool would receive nothing.
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => {
            Some("an IPv4-mapped IPv6 address (write the IPv4 address)")
        }
        a if a.is_unspecified() => Some("unspecified"),
        a if a.is_loopback() => Some("loopback"),
        a if a.is_multicast() => Some("multicast"),
        IpAddr::V4(v4) if v4.is_broadcast() => Some("broadcast"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[agent]
interfaces = ["eth0", "eth1"]
control_socket = "/run/balancer/agent.sock"

[[pool]]
name = "chat-pool"
vip = "192.0.2.60"
port = 8000

[[pool.server]]
address = "10.4.0.11"
port = 8000
metrics_port = 8001
weight = 100

[[pool.server]]
address = "10.4.0.12"
port = 8000
metrics_port = 8001
"#;

    #[test]
    fn control_loop_keys_have_defaults_and_limits() {
        let c = parse(GOOD).unwrap();
        assert_eq!(c.agent.scrape_interval_ms, 2000);
        assert_eq!(c.agent.scrape_timeout_ms(), 1000);
        assert_eq!((c.agent.fall, c.agent.rise), (3, 2));
        assert_eq!(c.agent.hung_after_ms, 30_000);
        assert_eq!(c.pool[0].spill_ttft_ms, 500);
        assert_eq!(c.pool[0].dialect, None);
        let fast = GOOD.replace("[agent]", "[agent]\nscrape_interval_ms = 100");
        assert_eq!(parse(&fast).unwrap().agent.scrape_timeout_ms(), 100);
        for (from, to, key) in [
            (
                "[agent]",
                "[agent]\nscrape_interval_ms = 50",
                "agent.scrape_interval_ms",
            ),
            (
                "[agent]",
                "[agent]\nscrape_timeout_ms = 5000",
                "agent.scrape_timeout_ms",
            ),
            ("[agent]", "[agent]\nfall = 0", "agent.fall"),
            (
                "[agent]",
                "[agent]\nhung_after_ms = 999",
                "agent.hung_after_ms",
            ),
            ("[agent]", "[agent]\nrise = \"2\"", "rise"),
            (
                "port = 8000\n\n[[pool.server]]",
                "port = 8000\nkv_high = 1.5\n\n[[pool.server]]",
                "pool[0].kv_high",
            ),
            (
                "port = 8000\n\n[[pool.server]]",
                "port = 8000\nspill_waiting = 0\n\n[[pool.server]]",
                "pool[0].spill_waiting",
            ),
            (
                "port = 8000\n\n[[pool.server]]",
                "port = 8000\ndialect = \"openai\"\n\n[[pool.server]]",
                "dialect",
            ),
        ] {
            let err = parse(&GOOD.replacen(from, to, 1)).expect_err(to);
            assert!(err.contains(key), "{to}: {err}");
        }
        let forced = GOOD.replacen("weight = 100", "weight = 100\ndialect = \"llamacpp\"", 1);
        assert_eq!(
            parse(&forced).unwrap().pool[0].server[0].dialect,
            Some(Dialect::Llamacpp)
        );
    }

    fn parse(text: &str) -> Result<Config, String> {
        Config::parse(Path::new("balancer.toml"), text).map_err(|e| e.to_string())
    }

    #[test]
    fn the_documented_example_loads_with_defaults() {
        let c = parse(GOOD).unwrap();
        assert_eq!(c.agent.flow_table_entries, DEFAULT_FLOW_ENTRIES);
        assert_eq!(c.pool[0].idle_timeout_s, 600);
        assert_eq!(c.pool[0].server[1].weight, 100);
        assert_eq!(c.pool[0].vip, "192.0.2.60".parse::<IpAddr>().unwrap());
    }

    /// Each bad value must name the file and the key, and say what is wrong.
    #[test]
    fn a_server_serves_at_most_four_pools() {
        // `nat` pools, then `dsr` more with direct server return, which need no replies.
        let pools = |nat: usize, dsr: usize| {
            let mut text = String::from("[agent]\ninterfaces = [\"eth0\"]\n");
            for i in 0..nat + dsr {
                let forwarding = if i < nat { "nat" } else { "dsr" };
                text += &format!(
                    "[[pool]]\nname = \"p{i}\"\nvip = \"192.0.2.{}\"\nport = 8000\n\
                     forwarding = \"{forwarding}\"\n\
                     [[pool.server]]\naddress = \"10.4.0.11\"\nport = 8000\nmetrics_port = 8001\n",
                    60 + i
                );
            }
            parse(&text)
        };
        assert!(pools(MAX_REPLY_VIPS, 0).is_ok());
        assert!(pools(MAX_REPLY_VIPS, 2).is_ok());
        let err = pools(MAX_REPLY_VIPS + 1, 0).unwrap_err();
        assert!(
            err.contains("pool[4].server[0].address") && err.contains("more than 4 NAT pools"),
            "{err}"
        );
    }

    #[test]
    fn bad_values_name_file_key_and_problem() {
        // One more than the program's map of interfaces to send out of holds.
        let names: Vec<String> = (0..=MAX_INTERFACES).map(|i| format!("\"e{i}\"")).collect();
        let too_many_interfaces = format!("interfaces = [{}]", names.join(", "));
        let cases: &[(&str, &str, &str)] = &[
            ("weight = 100", "weight = \"heavy\"", "weight"),
            ("weight = 100", "weight = -1", "weight"),
            (
                "weight = 100",
                "weight = 2000000",
                "pool[0].server[0].weight",
            ),
            ("address = \"10.4.0.11\"", "address = \"10.4.0\"", "address"),
            (
                "address = \"10.4.0.11\"",
                "address = \"fd00::1\"",
                "pool[0].server[0].address",
            ),
            ("vip = \"192.0.2.60\"", "vip = \"0.0.0.0\"", "pool[0].vip"),
            (
                "vip = \"192.0.2.60\"",
                "vip = \"::ffff:192.0.2.60\"",
                "IPv4-mapped",
            ),
            (
                "address = \"10.4.0.11\"",
                "address = \"127.0.0.1\"",
                "pool[0].server[0].address",
            ),
            (
                "interfaces = [\"eth0\", \"eth1\"]",
                "interfaces = [\"eth0\", \"eth1\"]\nmetrics_listen = \"127.0.0.1:0\"",
                "agent.metrics_listen",
            ),
            (
                "port = 8000\n\n[[pool.server]]",
                "port = 0\n\n[[pool.server]]",
                "pool[0].port",
            ),
            (
                "port = 8000\n\n[[pool.server]]",
                "port = 70000\n\n[[pool.server]]",
                "port",
            ),
            (
                "port = 8000\n\n[[pool.server]]",
                "port = 8000\nidle_timeout_s = 1\n\n[[pool.server]]",
                "pool[0].idle_timeout_s",
            ),
            (
                "metrics_port = 8001\nweight",
                "metrics_port = 0\nweight",
                "metrics_port",
            ),
            (
                "interfaces = [\"eth0\", \"eth1\"]",
                "interfaces = []",
                "agent.interfaces",
            ),
            (
                "interfaces = [\"eth0\", \"eth1\"]",
                &too_many_interfaces,
                "agent.interfaces",
            ),
            (
                "interfaces = [\"eth0\", \"eth1\"]",
                "interfaces = [\"eth0\", \"eth0\"]",
                "agent.interfaces",
            ),
            (
                "interfaces = [\"eth0\", \"eth1\"]",
                "interfaces = \"eth0\"",
                "interfaces",
            ),
            ("name = \"chat-pool\"", "name = \"\"", "pool[0].name"),
            (
                "name = \"chat-pool\"",
                "name = \"chat pool\"",
                "pool[0].name",
            ),
            (
                "name = \"chat-pool\"",
                "name = 'chat\"pool'",
                "pool[0].name",
            ),
            ("name = \"chat-pool\"", "nmae = \"chat-pool\"", "nmae"),
            ("10.4.0.12", "10.4.0.11", "pool[0].server[1].address"),
        ];
        for (from, to, key) in cases {
            assert!(GOOD.contains(from), "{from}");
            let text = GOOD.replacen(from, to, 1);
            let err = parse(&text).expect_err(to);
            assert!(err.starts_with("balancer.toml: "), "{err}");
            assert!(err.contains(key), "{to}: {err}");
        }
    }

    #[test]
    fn tls_table_names_its_files() {
        let tls = "[pool.tls]\nca_file = \"/etc/balancer/servers-ca.pem\"\n";
        let with = |extra: &str| {
            GOOD.replacen(
                "port = 8000\n\n[[pool.server]]",
                &format!("port = 8000\n\n{tls}{extra}\n[[pool.server]]"),
                1,
            )
        };
        assert_eq!(parse(GOOD).unwrap().pool[0].tls, None);
        let named = "server_name = \"vllm.internal\"\ncert_file = \"/etc/balancer/agent.pem\"\n\
                     key_file = \"/etc/balancer/agent.key\"\n";
        let c = parse(&with(named)).unwrap();
        assert_eq!(
            c.pool[0].tls,
            Some(PoolTls {
                ca_file: "/etc/balancer/servers-ca.pem".into(),
                server_name: Some("vllm.internal".into()),
                cert_file: Some("/etc/balancer/agent.pem".into()),
                key_file: Some("/etc/balancer/agent.key".into()),
            })
        );
        assert!(parse(&with("server_name = \"10.4.0.11\"\n")).is_ok());
        for (extra, problem) in [
            (
                "cert_file = \"/etc/balancer/agent.pem\"\n",
                "`pool[0].tls.key_file`: is required with cert_file",
            ),
            (
                "key_file = \"/etc/balancer/agent.key\"\n",
                "`pool[0].tls.cert_file`: is required with key_file",
            ),
            (
                "server_name = \"vllm internal\"\n",
                "`pool[0].tls.server_name`: \"vllm internal\" is not a DNS name",
            ),
            (
                "cert_file = \"\"\nkey_file = \"k\"\n",
                "`pool[0].tls.cert_file`: must not be empty",
            ),
            ("verify = false\n", "unknown field `verify`"),
        ] {
            let err = parse(&with(extra)).expect_err(extra);
            assert!(err.contains(problem), "{extra}: {err}");
        }
        let err = parse(&with("").replacen("ca_file = ", "# ", 1)).unwrap_err();
        assert!(err.contains("missing field `ca_file`"), "{err}");
    }

    #[test]
    fn sync_names_its_socket_peers_and_key() {
        let sync = "[sync]\nlisten = \"10.0.0.1:7471\"\npeers = [\"10.0.0.2:7471\"]\n\
                    key_file = \"/etc/balancer/sync.key\"\n";
        let text = GOOD.replacen("\n[[pool]]", &format!("\n{sync}\n[[pool]]"), 1);
        let c = parse(&text).unwrap();
        let s = c.sync.unwrap();
        assert_eq!(
            s.peers,
            vec!["10.0.0.2:7471".parse::<SocketAddr>().unwrap()]
        );
        assert_eq!(parse(GOOD).unwrap().sync, None);
        assert!(s.accept_key_files.is_empty());
        let rolling = text.replacen(
            "key_file = \"/etc/balancer/sync.key\"",
            "key_file = \"/etc/balancer/sync.key\"\naccept_key_files = [\"/etc/balancer/new.key\"]",
            1,
        );
        let r = parse(&rolling).unwrap().sync.unwrap();
        assert_eq!(
            r.accept_key_files,
            vec![PathBuf::from("/etc/balancer/new.key")]
        );
        assert!(r.same_peering(&s) && r != s);
        for (from, to, problem) in [
            (
                "peers = [\"10.0.0.2:7471\"]",
                "peers = []",
                "needs 1 to 32 peers",
            ),
            (
                "peers = [\"10.0.0.2:7471\"]",
                "peers = [\"10.0.0.1:7471\"]",
                "this agent's own sync.listen",
            ),
            (
                "peers = [\"10.0.0.2:7471\"]",
                "peers = [\"10.0.0.2:7471\", \"10.0.0.2:7471\"]",
                "listed twice",
            ),
            (
                "peers = [\"10.0.0.2:7471\"]",
                "peers = [\"0.0.0.0:7471\"]",
                "cannot be a peer",
            ),
            (
                "peers = [\"10.0.0.2:7471\"]",
                "peers = [\"10.0.0.2:7471\", \"[fd00::2]:7471\"]",
                "not of sync.listen's address family",
            ),
            (
                "peers = [\"10.0.0.2:7471\"]",
                "peers = [\"239.1.1.1:7471\"]",
                "cannot be a peer",
            ),
            (
                "peers = [\"10.0.0.2:7471\"]",
                "peers = [\"255.255.255.255:7471\"]",
                "cannot be a peer",
            ),
            ("10.0.0.1:7471", "127.0.0.1:7471", "not reachable from sync.listen's loopback"),
            ("10.0.0.1:7471", "10.0.0.1:0", "needs a port"),
            ("10.0.0.1:7471", "0.0.0.0:7471", "not a wildcard"),
            (
                "port = 8000\n\n[[pool.server]]",
                "port = 8000\nidle_timeout_s = 5\n\n[[pool.server]]",
                "at least 10 s with [sync]",
            ),
            ("10.0.0.1:7471", "10.0.0.1", "invalid socket address"),
            (
                "key_file = \"/etc/balancer/sync.key\"",
                "key_file = \"\"",
                "must not be empty",
            ),
            (
                "key_file = \"/etc/balancer/sync.key\"",
                "",
                "missing field `key_file`",
            ),
            (
                "key_file = \"/etc/balancer/sync.key\"",
                "key_file = \"/etc/balancer/sync.key\"\naccept_key_files = [\"/etc/balancer/sync.key\"]",
                "sync.accept_key_files",
            ),
            (
                "key_file = \"/etc/balancer/sync.key\"",
                "key_file = \"/etc/balancer/sync.key\"\naccept_key_files = [\"a\", \"b\", \"c\", \"d\", \"e\"]",
                "at most 4 files",
            ),
        ] {
            let bad = text.replacen(from, to, 1);
            let err = parse(&bad).expect_err(to);
            assert!(err.contains(problem), "{to}: {err}");
        }
    }

    #[test]
    fn duplicate_pools_are_refused() {
        let text =
            format!("{GOOD}\n[[pool]]\nname = \"chat-pool\"\nvip = \"192.0.2.61\"\nport = 8000\n");
        assert!(parse(&text).unwrap_err().contains("used by two pools"));
        let text =
            format!("{GOOD}\n[[pool]]\nname = \"other\"\nvip = \"192.0.2.60\"\nport = 8000\n");
        assert!(parse(&text)
            .unwrap_err()
            .contains("192.0.2.60:8000 is used by two pools"));
    }

    #[test]
    fn hint_ranges() {
        let c = parse(GOOD).unwrap();
        assert_eq!(c.pool[0].hint_range(), Some(HintRange::DEFAULT));
        let with =
            |extra: &str| GOOD.replacen("port = 8000\n", &format!("port = 8000\n{extra}\n"), 1);
        let off = parse(&with("hint_ports = \"off\"")).unwrap();
        assert_eq!(off.pool[0].hint_range(), None);
        let custom = parse(&with("hint_ports = \"20000-20999\"\nhint_buckets = 100")).unwrap();
        assert_eq!(
            custom.pool[0].hint_range(),
            Some(HintRange::new(20000, 1000, 100).unwrap())
        );
        for (extra, needle) in [
            ("hint_ports = \"20000\"", "is not \"FIRST-LAST\""),
            ("hint_ports = \"30000-20000\"", "below the first"),
            (
                "hint_ports = \"20000-20099\"\nhint_buckets = 256",
                "fewer ports than there are buckets",
            ),
            ("hint_buckets = 0", "at least 1"),
            ("hint_ports = \"off\"\nhint_buckets = 0", "at least 1"),
            (
                "hint_ports = \"off\"\nhint_buckets = 5000",
                "maximum of 1024",
            ),
            ("hint_buckets = 5000", "maximum of 1024"),
            ("hint_ports = \"0-100\"\nhint_buckets = 4", "port 0"),
            ("slots = 0", "pool[0].slots"),
            ("home_load_bound = 0.9", "pool[0].home_load_bound"),
            ("home_load_bound = nan", "pool[0].home_load_bound"),
        ] {
            let err = parse(&with(extra)).expect_err(extra);
            assert!(
                err.contains(needle) && err.contains("pool[0]"),
                "{extra}: {err}"
            );
        }
    }

    #[test]
    fn forwarding_is_nat_unless_dsr_and_dsr_keeps_the_port() {
        assert_eq!(parse(GOOD).unwrap().pool[0].forwarding, Forwarding::Nat);
        let dsr = GOOD.replacen("port = 8000\n", "port = 8000\nforwarding = \"dsr\"\n", 1);
        assert_eq!(parse(&dsr).unwrap().pool[0].forwarding, Forwarding::Dsr);
        let moved = dsr.replacen(
            "address = \"10.4.0.12\"\nport = 8000",
            "address = \"10.4.0.12\"\nport = 9000",
            1,
        );
        let err = parse(&moved).unwrap_err();
        assert!(
            err.contains("pool[0].server[1].port") && err.contains("must be the pool's port 8000"),
            "{err}"
        );
        let nat = moved.replacen("forwarding = \"dsr\"", "forwarding = \"nat\"", 1);
        assert!(parse(&nat).is_ok());
        let other = dsr.replacen("\"dsr\"", "\"ipvs\"", 1);
        assert!(parse(&other)
            .unwrap_err()
            .contains("unknown variant `ipvs`"));
    }

    #[test]
    fn tunnel_needs_a_source_of_the_vips_family_and_keeps_the_port() {
        let tunnel = |extra: &str| {
            GOOD.replacen(
                "port = 8000\n",
                &format!("port = 8000\nforwarding = \"tunnel\"\n{extra}"),
                1,
            )
        };
        let good = parse(&tunnel("tunnel_source = \"10.4.0.1\"\n")).unwrap();
        assert_eq!(good.pool[0].forwarding, Forwarding::Tunnel);
        assert_eq!(
            good.pool[0].tunnel_source,
            Some("10.4.0.1".parse().unwrap())
        );
        for (extra, says) in [
            (
                "",
                "pool[0].tunnel_source`: is required with forwarding = \"tunnel\"",
            ),
            (
                "tunnel_source = \"fd00::1\"\n",
                "fd00::1 is not of the VIP's family",
            ),
            (
                "tunnel_source = \"0.0.0.0\"\n",
                "0.0.0.0 cannot be a tunnel's source",
            ),
            (
                "tunnel_source = \"192.0.2.60\"\n",
                "192.0.2.60 is pool chat-pool's VIP",
            ),
        ] {
            let err = parse(&tunnel(extra)).unwrap_err();
            assert!(err.contains(says), "{extra:?}: {err}");
        }
        let nat = GOOD.replacen(
            "port = 8000\n",
            "port = 8000\ntunnel_source = \"10.4.0.1\"\n",
            1,
        );
        let err = parse(&nat).unwrap_err();
        assert!(err.contains("is only for forwarding = \"tunnel\""), "{err}");
        let moved = tunnel("tunnel_source = \"10.4.0.1\"\n").replacen(
            "address = \"10.4.0.12\"\nport = 8000",
            "address = \"10.4.0.12\"\nport = 9000",
            1,
        );
        let err = parse(&moved).unwrap_err();
        assert!(
            err.contains("must be the pool's port 8000 with forwarding = \"tunnel\""),
            "{err}"
        );
    }

    #[test]
    fn xdp_mode_is_auto_native_or_generic() {
        assert_eq!(parse(GOOD).unwrap().agent.xdp_mode, XdpMode::Auto);
        let with =
            |mode: &str| GOOD.replacen("[agent]\n", &format!("[agent]\nxdp_mode = {mode}\n"), 1);
        assert_eq!(
            parse(&with("\"generic\"")).unwrap().agent.xdp_mode,
            XdpMode::Generic
        );
        assert_eq!(
            parse(&with("\"native\"")).unwrap().agent.xdp_mode,
            XdpMode::Native
        );
        let err = parse(&with("\"skb\"")).unwrap_err();
        assert!(
            err.contains("xdp_mode") && err.contains("unknown variant `skb`"),
            "{err}"
        );
    }

    #[test]
    fn not_toml_is_an_error_not_a_panic() {
        assert!(parse("[agent\ninterfaces=").is_err());
        assert!(parse("").unwrap_err().contains("agent"));
    }

    /// Keys of each table (`[agent]`, the first `[[pool]]`, its first server, `[sync]`).
    const KEYS: [&[&str]; 4] = [
        &[
            "interfaces",
            "flow_table_entries",
            "scrape_interval_ms",
            "scrape_timeout_ms",
            "health_interval_ms",
            "health_timeout_ms",
            "hung_after_ms",
            "fall",
            "rise",
            "metrics_listen",
            "pin_dir",
            "xdp_mode",
        ],
        &[
            "name",
            "vip",
            "port",
            "forwarding",
            "tunnel_source",
            "idle_timeout_s",
            "spill_waiting",
            "spill_ttft_ms",
            "kv_high",
            "dialect",
            "model",
            "hint_ports",
            "hint_buckets",
            "slots",
            "home_load_bound",
        ],
        &["address", "port", "metrics_port", "weight", "dialect"],
        &["listen", "peers", "key_file", "accept_key_files"],
    ];

    /// Values on both sides of every documented limit, and of every type.
    const VALUES: [&str; 46] = [
        "-1",
        "0",
        "1",
        "2",
        "9",
        "10",
        "50",
        "99",
        "100",
        "101",
        "999",
        "1000",
        "1023",
        "1024",
        "5000",
        "60000",
        "60001",
        "600000",
        "600001",
        "604801",
        "3600001",
        "1000001",
        "67108865",
        "4294967296",
        "nan",
        "inf",
        "-0.0",
        "0.5",
        "1.0",
        "1.5",
        "100.5",
        "\"\"",
        "\"x\"",
        "\"off\"",
        "\"1024-1100\"",
        "\"0-65535\"",
        "\"192.0.2.60\"",
        "\"0.0.0.0:7471\"",
        "\"10.0.0.1:0\"",
        "\"[::1]:9477\"",
        "\"/sys/fs/bpf/x\"",
        "true",
        "[]",
        "[\"eth0\"]",
        "[\"10.0.0.2:7471\"]",
        "{}",
    ];

    /// What the documentation promises of a configuration that loads.
    fn holds_together(c: &Config) -> Result<(), String> {
        let a = &c.agent;
        let within = |what: &str, v: u64, lo: u64, hi: u64| {
            (lo..=hi)
                .contains(&v)
                .then_some(())
                .ok_or(format!("{what} = {v}"))
        };
        within(
            "flow_table_entries",
            a.flow_table_entries.into(),
            1024,
            67_108_864,
        )?;
        within("scrape_interval_ms", a.scrape_interval_ms, 100, 60_000)?;
        within(
            "scrape_timeout_ms",
            a.scrape_timeout_ms(),
            10,
            a.scrape_interval_ms,
        )?;
        within("health_interval_ms", a.health_interval_ms, 100, 600_000)?;
        within("health_timeout_ms", a.health_timeout_ms, 10, 60_000)?;
        within("hung_after_ms", a.hung_after_ms, 1000, 3_600_000)?;
        within("fall", a.fall.into(), 1, 100)?;
        within("rise", a.rise.into(), 1, 100)?;
        for p in &c.pool {
            within("port", p.port.into(), 1, 65535)?;
            let min_idle = if c.sync.is_some() {
                MIN_SYNC_IDLE_TIMEOUT_S
            } else {
                2
            };
            within(
                "idle_timeout_s",
                p.idle_timeout_s.into(),
                min_idle.into(),
                604_800,
            )?;
            within("spill_waiting", p.spill_waiting.into(), 1, 100_000)?;
            within("spill_ttft_ms", p.spill_ttft_ms.into(), 1, 600_000)?;
            if let Some(n) = p.slots {
                within("slots", n.into(), 1, 1_000_000)?;
            }
            if !(p.kv_high > 0.0 && p.kv_high <= 1.0) {
                return Err(format!("kv_high = {}", p.kv_high));
            }
            let bound = p.home_load_bound;
            if bound != 0.0 && !(1.0..=100.0).contains(&bound) {
                return Err(format!("home_load_bound = {bound}"));
            }
            if p.model.as_deref() == Some("") || p.server.is_empty() {
                return Err("an empty model, or no server".into());
            }
            for s in &p.server {
                within("server port", s.port.into(), 1, 65535)?;
                within("metrics_port", s.metrics_port.into(), 1, 65535)?;
                within("weight", s.weight.into(), 0, MAX_WEIGHT.into())?;
            }
        }
        if let Some(s) = &c.sync {
            if s.listen.port() == 0 || s.listen.ip().is_unspecified() || s.peers.is_empty() {
                return Err(format!("sync: {s:?}"));
            }
        }
        Ok(())
    }

    /// The first pool's table of a configuration document.
    fn pool(doc: &mut toml::Table) -> Option<&mut toml::Table> {
        doc["pool"].as_array_mut()?[0].as_table_mut()
    }

    /// [`GOOD`] with `[sync]`, and with each `(table, key, value)` of `picks` set (indices
    /// into [`KEYS`], a table's keys, modulo their number, and [`VALUES`]).
    fn substituted(picks: &[(usize, usize, usize)]) -> String {
        let base = format!(
            "{GOOD}\n[sync]\nlisten = \"10.0.0.1:7471\"\npeers = [\"10.0.0.2:7471\"]\n\
             key_file = \"/etc/balancer/sync.key\"\n"
        );
        let mut doc: toml::Table = toml::from_str(&base).unwrap();
        for &(table, key, value) in picks {
            let keys = KEYS[table];
            let literal: toml::Table = toml::from_str(&format!("v = {}", VALUES[value])).unwrap();
            let at = match table {
                0 => doc["agent"].as_table_mut(),
                1 => pool(&mut doc),
                2 => pool(&mut doc)
                    .and_then(|p| p["server"].as_array_mut())
                    .and_then(|s| s[0].as_table_mut()),
                _ => doc["sync"].as_table_mut(),
            }
            .unwrap();
            at.insert(keys[key % keys.len()].into(), literal["v"].clone());
        }
        toml::to_string(&doc).unwrap()
    }

    /// A configuration that holds together, or one error that names the file.
    fn loads_sanely_or_is_refused(text: &str) -> Result<(), String> {
        match parse(text) {
            Ok(c) => holds_together(&c).map_err(|e| format!("{e}, loaded from\n{text}")),
            Err(e) if e.starts_with("balancer.toml") && !e.contains('\n') => Ok(()),
            Err(e) => Err(format!("the error: {e}")),
        }
    }

    /// Every value for every key, one at a time.
    #[test]
    fn every_value_for_every_key_loads_sanely_or_is_refused() {
        for (table, keys) in KEYS.iter().enumerate() {
            for key in 0..keys.len() {
                for (value, literal) in VALUES.iter().enumerate() {
                    let text = substituted(&[(table, key, value)]);
                    if let Err(e) = loads_sanely_or_is_refused(&text) {
                        panic!("{} = {literal}: {e}", keys[key]);
                    }
                }
            }
        }
    }

    proptest::proptest! {
        /// Any values for several keys at once, never a panic.
        #[test]
        fn any_values_for_any_keys_load_sanely_or_are_refused(
            picks in proptest::collection::vec((0..4usize, 0..14usize, 0..46usize), 2..5),
        ) {
            let text = substituted(&picks);
            let outcome = loads_sanely_or_is_refused(&text);
            proptest::prop_assert!(outcome.is_ok(), "{outcome:?}");
        }
    }
}
