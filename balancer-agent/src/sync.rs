//! Flow sharing between gateways (`[sync]`). Behind ECMP, a gateway that fails or leaves
//! moves its connections' packets to another one, whose Maglev table differs (weights follow
//! each agent's own scrapes) and which never saw the flows placed by a hint, a spill or a
//! second draw. So each program reports its shared flows (`FLOW_EVENTS`: open, close, and a
//! keepalive every third of the idle timeout) and the agent sends them to its peers, whose
//! agents write the same backend into their own flow tables: the connection stays on its
//! server whichever gateway its packets cross. A starting agent asks its peers for all their
//! live flows (hello), so that a gateway back from a reboot knows them too, and each peer
//! says when it has sent them all ([`Dumped`]: `balancer-agent ready` waits for it). Every agent
//! also sends each peer an empty batch every [`HEARTBEAT`], so that a peer lost, or one
//! whose datagrams are refused (another key, a clock far off), shows in `peers` and the
//! metrics before a failover needs it.
//!
//! On the wire: one UDP datagram per batch of at most [`MAX_EVENTS`] events, a version byte,
//! the batch in postcard, what later agents add after it (a trailer: postcard reads what a
//! type needs and leaves the rest, so an older agent reads the batch and ignores it), and
//! an HMAC-SHA256 of all that under the key all gateways share.
//! Servers and VIPs are named by address, since each agent numbers its backends itself. A
//! batch names its sender (a random id per agent run) and its sequence number: a datagram
//! from an address that is not a peer, with a wrong tag, sent more than [`MAX_AGE`] ago, seen
//! before (a replay), or this agent's own (a reflection) changes nothing and is counted.

use std::{
    collections::HashMap,
    mem::Discriminant,
    net::{IpAddr, SocketAddr},
    ops::ControlFlow,
    os::unix::fs::PermissionsExt,
    path::Path,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, OnceLock, PoisonError, RwLock,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, Context, Result};
use aya::maps::{MapData, RingBuf};
use balancer_common::{
    sync_epoch, words_addr, FlowEntry, FlowEvent, FlowKey, FLOW_EVENT_ALIVE, FLOW_EVENT_CLOSE,
    FLOW_EVENT_OPEN,
};
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use tokio::net::UdpSocket;
use tracing::{debug, info, warn};

use crate::{
    config::FlowSync,
    control::{PeerRow, PeerState},
};

/// The format of the datagrams; a receiver refuses any other.
pub const VERSION: u8 = 1;
/// Events per datagram: 16 IPv6 events take about 900 bytes, under any path's MTU.
pub const MAX_EVENTS: usize = 16;
/// A datagram stamped longer ago than this, or further ahead, is refused; within it, the
/// sequence numbers refuse replays. The gateways' clocks must agree within it (NTP).
pub const MAX_AGE: Duration = Duration::from_secs(30);
/// Reports the ring kept longer than this (about 10 s; no agent drained it meanwhile) are
/// dropped rather than sent as news: a flow that lives on is reported again by its
/// keepalive, while an old open could override a newer connection on the same tuple.
pub const MAX_BACKLOG_EPOCHS: u32 = 10;
/// Out-of-order datagrams of one sender accepted behind the newest one.
const REPLAY_WINDOW: u64 = 64;
/// The shortest key accepted: 32 bytes, the HMAC-SHA256 block's strength.
pub const MIN_KEY_BYTES: usize = 32;
/// How often an agent sends every peer an empty batch (the first ones are hellos): each
/// peer's datagrams then say, every second, that it runs and that its key and clock are
/// right.
pub const HEARTBEAT: Duration = Duration::from_secs(1);
/// A peer is silent once nothing came from it for this long: three heartbeats in a row lost,
/// with half a second to spare for a late one (a busy agent's beat may be).
pub const SILENT_AFTER: Duration = Duration::from_millis(3500);
/// How often the agent drains the program's ring: the longest a new flow waits before its
/// peers hear of it, at most a few hundred events each time at the gateway benchmark's rate.
pub const DRAIN_INTERVAL: Duration = Duration::from_millis(10);

const TAG_BYTES: usize = 32;
/// Longest datagram opened: a full batch of IPv6 events takes under 1200 bytes, and a longer
/// one is refused before its tag is computed over it.
pub const MAX_DATAGRAM_BYTES: usize = 2048;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    /// A new flow, placed by its SYN: it replaces what the receiver had for the tuple.
    Open,
    /// Its end (see `FlowEntry::closed`).
    Close,
    /// A live flow reported again, or one placed without its SYN: it fills a place where
    /// the receiver has no live entry, and never overrides one.
    Alive,
}

/// One flow as gateways tell each other: the client's end, the VIP it connected to, and the
/// backend it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub kind: Kind,
    pub client: SocketAddr,
    pub vip: SocketAddr,
    pub backend: SocketAddr,
}

impl Event {
    /// The event the program wrote, if it is well formed, and when (`FlowEvent::epoch`).
    pub fn from_ring(bytes: &[u8]) -> Option<(Event, u32)> {
        if bytes.len() < std::mem::size_of::<FlowEvent>() {
            return None;
        }
        // SAFETY: FlowEvent is plain integers (every bit pattern valid), and the read is
        // unaligned-safe over a slice checked to be long enough.
        let e: FlowEvent = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
        let kind = match e.kind {
            FLOW_EVENT_OPEN => Kind::Open,
            FLOW_EVENT_CLOSE => Kind::Close,
            FLOW_EVENT_ALIVE => Kind::Alive,
            _ => return None,
        };
        Some((Event::of(kind, &e.key, e.nat_addr, e.nat_port)?, e.epoch))
    }

    /// The flow `key` and its backend `addr:port` as they are stored (network order), if
    /// the family is one of ours.
    fn of(kind: Kind, key: &FlowKey, addr: [u32; 4], port: u16) -> Option<Event> {
        let end = |words, port: u16| {
            Some(SocketAddr::new(
                words_addr(words, key.family)?,
                u16::from_be(port),
            ))
        };
        Some(Event {
            kind,
            client: end(key.src, key.sport)?,
            vip: end(key.dst, key.dport)?,
            backend: end(addr, port)?,
        })
    }
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub struct Batch {
    /// The sending agent, a random number drawn when it starts.
    pub sender: u64,
    /// Counts the sender's datagrams from 1.
    pub seq: u64,
    /// Milliseconds since the Unix epoch, by the sender's clock.
    pub sent_ms: u64,
    /// The sender has just started and asks for the receiver's live flows.
    pub hello: bool,
    pub events: Vec<Event>,
    /// In the [`Trailer`] (not in the batch's own encoding, which agents before it read).
    #[serde(skip)]
    pub dumped: Option<Dumped>,
}

/// What follows the batch in a datagram: fields added after the first version, each one
/// only ever appended (postcard reads the fields a type has and leaves what follows, so an
/// agent reads what it knows of a later agent's trailer, and one before any trailer reads
/// only the batch).
#[derive(Debug, Serialize, Deserialize)]
struct Trailer {
    dumped: Option<Dumped>,
}

/// The end of the live flows a gateway sent a peer that asked for them (hello).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dumped {
    /// The run of the agent that asked: the news is for it, not for a run before it.
    pub to: u64,
    /// How many were sent.
    pub flows: u64,
}

/// The key every gateway of the VIPs shares.
#[derive(Clone)]
pub struct Key(Vec<u8>);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

impl Key {
    pub fn new(bytes: &[u8]) -> Result<Key> {
        if bytes.len() < MIN_KEY_BYTES {
            bail!(
                "the key has {} bytes; at least {MIN_KEY_BYTES} are needed (for example \
                 `head -c 48 /dev/urandom | base64`)",
                bytes.len()
            );
        }
        Ok(Key(bytes.to_vec()))
    }

    /// The file's contents without surrounding whitespace; `key` names the configuration
    /// key it came from, for the messages.
    fn load(key: &str, path: &Path) -> Result<Key> {
        let text =
            std::fs::read(path).with_context(|| format!("{key}: reading {}", path.display()))?;
        let mode = std::fs::metadata(path).map_or(0, |m| m.permissions().mode());
        if mode & 0o044 != 0 {
            warn!(
                "{key} {} is readable by others (mode {:o}): whoever reads it can steer the \
                 gateways' flows",
                path.display(),
                mode & 0o777
            );
        }
        Key::new(text.trim_ascii()).with_context(|| format!("{key} {}", path.display()))
    }

    fn mac(&self) -> Hmac<Sha256> {
        Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }
}

/// The key this agent seals its datagrams with, and the keys it also opens them with while
/// a new key is rolled out: `[sync]`'s `key_file` and `accept_key_files`.
#[derive(Debug, Clone)]
pub struct Keys {
    pub seal: Key,
    pub accept: Vec<Key>,
}

impl Keys {
    /// Reads every key file of `sync`.
    pub fn load(sync: &FlowSync) -> Result<Keys> {
        Ok(Keys {
            seal: Key::load("sync.key_file", &sync.key_file)?,
            accept: sync
                .accept_key_files
                .iter()
                .map(|path| Key::load("sync.accept_key_files", path))
                .collect::<Result<_>>()?,
        })
    }

    /// [`open`] with the sealing key, else with each accepted one.
    pub fn open(&self, datagram: &[u8], now_ms: u64) -> Result<Batch, Refused> {
        for key in std::iter::once(&self.seal).chain(&self.accept) {
            match open(key, datagram, now_ms) {
                Err(Refused::Tag) => continue,
                opened => return opened,
            }
        }
        Err(Refused::Tag)
    }
}

/// Why a datagram was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("too short to be ours")]
    Short,
    #[error("longer than {MAX_DATAGRAM_BYTES} bytes")]
    Long,
    #[error("format version {0}, not {VERSION}")]
    Version(u8),
    #[error("its tag does not match: another key, or altered")]
    Tag,
    #[error("malformed batch: {0}")]
    Malformed(String),
    #[error("{0} events, more than {MAX_EVENTS}")]
    TooMany(usize),
    #[error("stamped {0} ms away from this gateway's clock (replayed, or clocks apart)")]
    Stale(i128),
    #[error("seen before (a replay)")]
    Replayed,
    #[error("this agent's own (reflected)")]
    Reflected,
}

/// What the tag of `batch`'s datagram covers: the version, the batch, the trailer.
fn body(batch: &Batch) -> Vec<u8> {
    let out =
        postcard::to_extend(batch, vec![VERSION]).expect("a batch always serializes into a Vec");
    // Written only when it says something, so that other datagrams are as agents before
    // it send them.
    match batch.dumped {
        Some(d) => postcard::to_extend(&Trailer { dumped: Some(d) }, out)
            .expect("a trailer always serializes into a Vec"),
        None => out,
    }
}

/// `batch` as one datagram (at most [`MAX_EVENTS`] events).
pub fn seal(key: &Key, batch: &Batch) -> Vec<u8> {
    debug_assert!(batch.events.len() <= MAX_EVENTS);
    let mut out = body(batch);
    let mut mac = key.mac();
    mac.update(&out);
    out.extend_from_slice(&mac.finalize().into_bytes());
    out
}

/// The batch of a datagram, if it is authentic, well formed and recent at `now_ms`.
pub fn open(key: &Key, datagram: &[u8], now_ms: u64) -> Result<Batch, Refused> {
    if datagram.len() < 1 + TAG_BYTES {
        return Err(Refused::Short);
    }
    if datagram.len() > MAX_DATAGRAM_BYTES {
        return Err(Refused::Long);
    }
    let (body, tag) = datagram.split_at(datagram.len() - TAG_BYTES);
    let mut mac = key.mac();
    mac.update(body);
    // Constant-time comparison, before anything in the body is believed.
    mac.verify_slice(tag).map_err(|_| Refused::Tag)?;
    if body[0] != VERSION {
        return Err(Refused::Version(body[0]));
    }
    let (mut batch, trailer) = postcard::take_from_bytes::<Batch>(&body[1..])
        .map_err(|e| Refused::Malformed(e.to_string()))?;
    // A trailer this agent cannot read (it is authentic: the tag covers it) takes nothing
    // from the batch.
    if let Ok(t) = postcard::from_bytes::<Trailer>(trailer) {
        batch.dumped = t.dumped;
    }
    if batch.events.len() > MAX_EVENTS {
        return Err(Refused::TooMany(batch.events.len()));
    }
    let skew = i128::from(now_ms) - i128::from(batch.sent_ms);
    if skew.unsigned_abs() > MAX_AGE.as_millis() {
        return Err(Refused::Stale(skew));
    }
    Ok(batch)
}

/// The sequence numbers seen of each sender, to refuse replays within [`MAX_AGE`]: the
/// newest, and which of the [`REPLAY_WINDOW`] before it arrived. A sender silent for twice
/// [`MAX_AGE`] is forgotten: any datagram of its that could be replayed is too old by then.
pub struct Replays {
    own: u64,
    senders: std::collections::HashMap<u64, (u64, u64, Instant)>,
}

impl Replays {
    pub fn new(own: u64) -> Self {
        Replays {
            own,
            senders: std::collections::HashMap::new(),
        }
    }

    /// Whether `batch` is new: not this agent's own, not seen before.
    pub fn check(&mut self, batch: &Batch, now: Instant) -> Result<(), Refused> {
        if batch.sender == self.own {
            return Err(Refused::Reflected);
        }
        self.senders
            .retain(|_, (_, _, at)| now.duration_since(*at) < MAX_AGE * 2);
        let (top, seen, at) = self.senders.entry(batch.sender).or_insert((0, 0, now));
        let seq = batch.seq;
        if seq > *top {
            let shift = seq - *top;
            *seen = if shift >= REPLAY_WINDOW {
                0
            } else {
                *seen << shift
            };
            *seen |= 1;
            *top = seq;
        } else {
            let back = *top - seq;
            if back >= REPLAY_WINDOW || *seen & (1 << back) != 0 {
                return Err(Refused::Replayed);
            }
            *seen |= 1 << back;
        }
        *at = now;
        Ok(())
    }
}

/// A random id for this agent's run, for [`Batch::sender`].
pub fn sender_id() -> u64 {
    let mut id = [0u8; 8];
    // SAFETY: a buffer of exactly the length given.
    let n = unsafe { libc::getrandom(id.as_mut_ptr().cast(), id.len(), 0) };
    if n != 8 {
        // No entropy source: distinct enough between two gateways' agents.
        return u64::from(std::process::id()) << 32 ^ unix_ms();
    }
    u64::from_ne_bytes(id)
}

pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What sharing did since the agent started, for `counters`, `peers` and the metrics
/// endpoint.
#[derive(Debug)]
pub struct Stats {
    /// Events this agent sent (each to every peer).
    pub sent: AtomicU64,
    /// Datagrams that could not be sent.
    pub send_errors: AtomicU64,
    /// Events received for a VIP and server this agent has, and taken into its flow table
    /// (written, or found there already as the rules of `Dataplane::adopt_flow` want).
    pub applied: AtomicU64,
    /// Events received for a VIP or server this agent does not have.
    pub unknown: AtomicU64,
    /// Datagrams refused: not from a peer, bad tag, malformed, stale, replayed.
    pub refused: AtomicU64,
    /// Reports the ring had kept too long (no agent drained it), dropped unsent.
    pub backlog: AtomicU64,
    /// Each peer's side of it.
    pub peers: PeerLog,
    /// When this agent first asked its peers for their flows (its first hello).
    pub asked: OnceLock<Instant>,
}

impl Stats {
    pub fn new(peers: &[SocketAddr]) -> Self {
        Stats {
            sent: AtomicU64::new(0),
            send_errors: AtomicU64::new(0),
            applied: AtomicU64::new(0),
            unknown: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            backlog: AtomicU64::new(0),
            peers: PeerLog(Mutex::new(
                peers.iter().map(|p| (*p, Heard::default())).collect(),
            )),
            asked: OnceLock::new(),
        }
    }

    pub fn counters(&self) -> Vec<(String, u64)> {
        [
            ("sync_sent", &self.sent),
            ("sync_send_errors", &self.send_errors),
            ("sync_applied", &self.applied),
            ("sync_unknown", &self.unknown),
            ("sync_refused", &self.refused),
            ("sync_backlog_dropped", &self.backlog),
        ]
        .into_iter()
        .map(|(name, v)| (name.to_owned(), v.load(Ordering::Relaxed)))
        .collect()
    }
}

/// What this agent heard from each configured peer and could send it.
#[derive(Debug)]
pub struct PeerLog(Mutex<Vec<(SocketAddr, Heard)>>);

#[derive(Debug, Default)]
struct Heard {
    /// When the peer's last accepted datagram came, and the agent run that sent it.
    last: Option<(Instant, u64)>,
    /// Times the run changed: the peer's agent restarted.
    restarts: u64,
    events: u64,
    refused: u64,
    /// When the latest datagram from its address was refused, and why (the kind of
    /// reason, and its words), while none was accepted after it.
    refusing: Option<(Instant, Discriminant<Refused>, String)>,
    send_errors: u64,
    /// Why the latest datagram to it could not be sent, while none went after it.
    unsendable: Option<String>,
    /// How many live flows it sent when this agent started; none: not all of them yet.
    dumped: Option<u64>,
}

impl PeerLog {
    fn with<R>(&self, peer: SocketAddr, f: impl FnOnce(&mut Heard) -> R) -> Option<R> {
        let mut peers = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let (_, heard) = peers.iter_mut().find(|(p, _)| *p == peer)?;
        Some(f(heard))
    }

    /// A datagram from `peer`'s run `run`, with `events`, accepted at `now`.
    pub fn accepted(&self, peer: SocketAddr, run: u64, events: usize, now: Instant) {
        self.with(peer, |h| {
            if h.last.is_some_and(|(_, r)| r != run) {
                h.restarts += 1;
            }
            h.last = Some((now, run));
            h.events += events as u64;
            h.refusing = None;
        });
    }

    /// A datagram from `peer`'s address refused at `now`; whether that is news: the first
    /// since one was accepted, or for another kind of reason than the last (a run of
    /// refusals is warned about once per kind: a stale datagram's words change with each
    /// skew).
    pub fn refused(&self, peer: SocketAddr, why: &Refused, now: Instant) -> bool {
        let kind = std::mem::discriminant(why);
        self.with(peer, |h| {
            h.refused += 1;
            let last = h.refusing.replace((now, kind, why.to_string()));
            last.is_none_or(|(_, before, _)| before != kind)
        })
        .unwrap_or(true)
    }

    /// Whether a peer heard at `now` has not said it sent this agent all its flows: it may
    /// not have had a hello (lost, or it started later) or restarted while it sent them.
    pub fn awaiting_flows(&self, now: Instant) -> bool {
        let peers = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        peers.iter().any(|(_, h)| {
            h.dumped.is_none()
                && h.last
                    .is_some_and(|(at, _)| now.saturating_duration_since(at) < SILENT_AFTER)
        })
    }

    /// `peer` has sent this agent all its live flows, `flows` of them; whether that is news.
    pub fn dumped(&self, peer: SocketAddr, flows: u64) -> bool {
        self.with(peer, |h| h.dumped.replace(flows).is_none())
            .unwrap_or(false)
    }

    /// The outcome of a send to `peer`; for a failure, whether it is the first since one
    /// went (a run of failures is warned about once).
    pub fn sent(&self, peer: SocketAddr, outcome: Result<(), &std::io::Error>) -> bool {
        let failed = outcome.is_err();
        self.with(peer, |h| match outcome {
            Ok(()) => {
                h.unsendable = None;
                false
            }
            Err(e) => {
                h.send_errors += 1;
                h.unsendable.replace(e.to_string()).is_none()
            }
        })
        .unwrap_or(failed)
    }

    /// Every configured peer as `peers` shows it, at `now`.
    pub fn rows(&self, now: Instant) -> Vec<PeerRow> {
        let peers = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        peers.iter().map(|(peer, h)| h.row(*peer, now)).collect()
    }
}

impl Heard {
    fn row(&self, peer: SocketAddr, now: Instant) -> PeerRow {
        let recent = |at: Instant| now.saturating_duration_since(at) < SILENT_AFTER;
        let ago = self.last.map(|(at, _)| now.saturating_duration_since(at));
        // Up while its datagrams come, whatever else arrives from its address (a forged or
        // replayed datagram is refused too).
        let state = if self.last.is_some_and(|(at, _)| recent(at)) {
            PeerState::Up
        } else if self.refusing.as_ref().is_some_and(|(at, ..)| recent(*at)) {
            PeerState::Refused
        } else {
            PeerState::Silent
        };
        let problem = match (&self.refusing, &self.unsendable) {
            (Some((.., why)), _) => Some(format!("its datagrams are refused: {why}")),
            (None, Some(e)) => Some(format!("sending to it fails: {e}")),
            (None, None) if ago.is_none() => Some("never heard from".to_owned()),
            (None, None) => None,
        };
        PeerRow {
            peer: peer.to_string(),
            state,
            heard_ms_ago: ago.map(|a| a.as_millis() as u64),
            events_in: self.events,
            refused: self.refused,
            send_errors: self.send_errors,
            restarts: self.restarts,
            problem,
            flows_at_start: self.dumped,
        }
    }
}

/// This agent's side of the conversation: its id, its socket, its peers, its datagrams'
/// numbers.
pub struct Sender {
    pub id: u64,
    pub socket: Arc<UdpSocket>,
    pub peers: Vec<SocketAddr>,
    /// Replaced whole at a reload.
    keys: RwLock<Arc<Keys>>,
    pub stats: Arc<Stats>,
    seq: AtomicU64,
}

impl Sender {
    pub fn new(
        socket: Arc<UdpSocket>,
        peers: Vec<SocketAddr>,
        keys: Keys,
        stats: Arc<Stats>,
    ) -> Self {
        Sender {
            id: sender_id(),
            socket,
            peers,
            keys: RwLock::new(Arc::new(keys)),
            stats,
            seq: AtomicU64::new(0),
        }
    }

    pub fn keys(&self) -> Arc<Keys> {
        self.keys
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// From the next datagram on, sent or received.
    pub fn set_keys(&self, keys: Keys) {
        *self.keys.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(keys);
    }

    /// Sends `events` to each of `to`, in datagrams of at most [`MAX_EVENTS`].
    pub async fn send(&self, to: &[SocketAddr], events: &[Event]) {
        for chunk in events.chunks(MAX_EVENTS) {
            self.send_batch(to, chunk, false, None).await;
        }
    }

    /// An empty batch to each peer; with `hello`, asking for its live flows.
    async fn beat(&self, hello: bool) {
        self.send_batch(&self.peers, &[], hello, None).await;
    }

    /// Tells `to` that the dump of our flows to its run is over (`end`).
    async fn send_end(&self, to: SocketAddr, end: Dumped) {
        self.send_batch(&[to], &[], false, Some(end)).await;
    }

    async fn send_batch(
        &self,
        to: &[SocketAddr],
        events: &[Event],
        hello: bool,
        dumped: Option<Dumped>,
    ) {
        let batch = Batch {
            sender: self.id,
            seq: self.seq.fetch_add(1, Ordering::Relaxed) + 1,
            sent_ms: unix_ms(),
            hello,
            events: events.to_vec(),
            dumped,
        };
        let datagram = seal(&self.keys().seal, &batch);
        for peer in to {
            let sent = self.socket.send_to(&datagram, peer).await;
            let news = self.stats.peers.sent(*peer, sent.as_ref().map(|_| ()));
            match sent {
                Ok(_) => {
                    let n = events.len() as u64;
                    self.stats.sent.fetch_add(n, Ordering::Relaxed);
                }
                Err(e) => {
                    self.stats.send_errors.fetch_add(1, Ordering::Relaxed);
                    if news {
                        warn!(%peer, "sending flows to a peer failed: {e}");
                    }
                }
            }
        }
    }
}

/// Drains the program's ring every [`DRAIN_INTERVAL`] and sends what it holds to every peer.
pub async fn send_loop(mut ring: RingBuf<MapData>, sender: Arc<Sender>) {
    let mut events = Vec::new();
    loop {
        tokio::time::sleep(DRAIN_INTERVAL).await;
        let now = sync_epoch(crate::dataplane::monotonic_ns());
        while let Some(item) = ring.next() {
            match Event::from_ring(&item) {
                Some((e, at)) if now.wrapping_sub(at) <= MAX_BACKLOG_EPOCHS => events.push(e),
                Some(_) => {
                    sender.stats.backlog.fetch_add(1, Ordering::Relaxed);
                }
                None => {}
            }
        }
        sender.send(&sender.peers, &events).await;
        events.clear();
    }
}

/// Without `[sync]`: flows shared under an earlier agent's configuration (pinned maps) go on
/// reporting their keepalives and close until they end; this drops those reports, so that
/// the ring does not fill and `sync_lost` counts only reports a sharing agent missed.
pub async fn discard_loop(mut ring: RingBuf<MapData>) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        while ring.next().is_some() {}
    }
}

/// Sends every peer an empty batch every [`HEARTBEAT`], until the agent stops. The first is
/// a hello, asking for the peers' flows: a gateway that starts with an empty flow table (a
/// reboot, a new gateway) or missed reports while its agent was down learns the live ones
/// before traffic moves to it. So are the next ones while a peer that is heard has not said
/// it sent them all, for [`FLOWS_WAIT`]: the hello was lost, the peer started later, or it
/// restarted while it sent them (a peer sends its flows once per run that asks).
pub async fn heartbeat_loop(sender: Arc<Sender>) {
    let mut beats = tokio::time::interval(HEARTBEAT);
    beats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        beats.tick().await;
        let now = Instant::now();
        let first = sender.stats.asked.set(now).is_ok();
        let asking = sender
            .stats
            .asked
            .get()
            .is_some_and(|at| now.duration_since(*at) < FLOWS_WAIT);
        let hello = first || (asking && sender.stats.peers.awaiting_flows(now));
        sender.beat(hello).await;
    }
}

/// How long a starting agent asks its peers for their flows, and waits for each peer that
/// is heard to say it sent them all (`ready.rs`): a full flow table of 4 million entries
/// takes about a minute to send.
pub const FLOWS_WAIT: Duration = Duration::from_secs(120);
/// Datagrams of a table dump sent per millisecond: about 64,000 flows a second, which the
/// receiving agent writes into its table as they come.
const DUMP_PER_MS: usize = 4;

/// Hands every live shared flow in the flow table with map id `flows_id` to `out`, as
/// keepalives (they fill the receiver's table where it has no live entry), a millisecond's
/// worth of datagrams at a time; stops early if `out` returns false. Walks the whole table
/// through a handle of its own, so that the agent's lock is not held meanwhile, and keeps
/// no more than one part in memory whatever the table's size. Returns how many it handed.
pub fn live_flows(flows_id: u32, mut out: impl FnMut(Vec<Event>) -> bool) -> Result<usize> {
    let now = crate::dataplane::monotonic_ns();
    let part = MAX_EVENTS * DUMP_PER_MS;
    let mut events = Vec::with_capacity(part);
    let mut handed = 0;
    let mut stopped = false;
    crate::map_ops::for_each(flows_id, |k: FlowKey, e: FlowEntry| {
        if e.synced == 0 || !e.live_at(now) {
            return ControlFlow::Continue(());
        }
        events.extend(Event::of(Kind::Alive, &k, e.nat_addr, e.nat_port));
        if events.len() == part {
            handed += part;
            stopped = !out(std::mem::replace(&mut events, Vec::with_capacity(part)));
            if stopped {
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    })
    .context("walking the flow table")?;
    handed += events.len();
    if !stopped && !events.is_empty() {
        out(events);
    }
    Ok(handed)
}

/// Sends `to` (its agent's run `run`) every live shared flow of the flow table `flows_id`,
/// paced: the walk runs on a blocking thread and hands its parts over a short queue. Then
/// says how many, and keeps the end in `done` to say it again to a peer that asks again
/// (that datagram may have been lost).
async fn dump(
    sender: Arc<Sender>,
    to: SocketAddr,
    run: u64,
    flows_id: u32,
    done: Arc<OnceLock<Dumped>>,
) {
    let (parts, mut rx) = tokio::sync::mpsc::channel(4);
    let walk = tokio::task::spawn_blocking(move || {
        live_flows(flows_id, |part| parts.blocking_send(part).is_ok())
    });
    while let Some(part) = rx.recv().await {
        sender.send(&[to], &part).await;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let flows = match walk.await {
        Ok(Ok(flows)) => flows,
        // No end said: the peer's `ready` waits for one until it gives up on us.
        Ok(Err(e)) => {
            warn!(%to, "reading the flow table for a peer: {e:#}");
            return;
        }
        Err(e) => {
            warn!(%to, "reading the flow table for a peer: {e}");
            return;
        }
    };
    info!(peer = %to, flows, "sent our flows to a peer that started");
    let dumped = *done.get_or_init(|| Dumped {
        to: run,
        flows: flows as u64,
    });
    sender.send_end(to, dumped).await;
}

/// Our dump of flows to a peer's run.
struct Dump {
    run: u64,
    task: tokio::task::JoinHandle<()>,
    /// Its end, once it is over.
    done: Arc<OnceLock<Dumped>>,
}

/// Receives peers' datagrams and hands their events to `apply`, which returns how many it
/// wrote and how many named a VIP or server it does not have; answers a peer's hello with
/// the live flows of the flow table `flows_id` (a map id).
pub async fn receive_loop(
    sender: Arc<Sender>,
    flows_id: u32,
    apply: impl Fn(&[Event]) -> (u64, u64),
) {
    let peers: Vec<IpAddr> = sender.peers.iter().map(|p| p.ip().to_canonical()).collect();
    let stats = sender.stats.clone();
    // One byte more than the longest we open, so that a longer datagram shows as one.
    let mut buf = vec![0u8; MAX_DATAGRAM_BYTES + 1];
    let mut replays = Replays::new(sender.id);
    // Per peer (its configured address: two peers may share a host): our dump of flows to
    // the run it last greeted us from. A peer that restarts again gets a new dump and the
    // old one stops, so a peer in a crash loop costs one walk of the table at a time, not
    // one per start.
    let mut dumps: HashMap<SocketAddr, Dump> = HashMap::new();
    loop {
        let (len, from) = match sender.socket.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                warn!("receiving flows: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // A dual-stack socket names an IPv4 peer as ::ffff:a.b.c.d.
        let peer = from.ip().to_canonical();
        if !peers.contains(&peer) {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            debug!(%from, "refused a datagram: not from a peer");
            continue;
        }
        let opened = sender
            .keys()
            .open(&buf[..len], unix_ms())
            .and_then(|batch| replays.check(&batch, Instant::now()).map(|()| batch));
        // The address the configuration gives: the source port is not authenticated.
        let to = configured(&sender.peers, from);
        match opened {
            Ok(batch) => {
                stats
                    .peers
                    .accepted(to, batch.sender, batch.events.len(), Instant::now());
                let (applied, unknown) = apply(&batch.events);
                stats.applied.fetch_add(applied, Ordering::Relaxed);
                stats.unknown.fetch_add(unknown, Ordering::Relaxed);
                // Said after its flows, so those came first (unless lost: see `Limits` in
                // docs/operations.md's "Several gateways").
                if let Some(d) = batch.dumped.filter(|d| d.to == sender.id) {
                    if stats.peers.dumped(to, d.flows) {
                        info!(peer = %to, flows = d.flows, "a peer has sent us all its flows");
                    }
                }
                // Once per agent run that asks: it asks every second until it has the end,
                // which is said again then; a dump that ended without one (its walk failed)
                // is made again.
                let failed = |d: &&Dump| d.task.is_finished() && d.done.get().is_none();
                let greeted = (dumps.get(&to)).filter(|d| d.run == batch.sender && !failed(d));
                match greeted {
                    _ if !batch.hello => {}
                    Some(d) => {
                        if let Some(&end) = d.done.get() {
                            sender.send_end(to, end).await;
                        }
                    }
                    None => {
                        info!(peer = %to, "a peer started: sending it our flows");
                        let done = Arc::new(OnceLock::new());
                        let task = tokio::spawn(dump(
                            sender.clone(),
                            to,
                            batch.sender,
                            flows_id,
                            done.clone(),
                        ));
                        let run = batch.sender;
                        if let Some(earlier) = dumps.insert(to, Dump { run, task, done }) {
                            earlier.task.abort();
                        }
                    }
                }
            }
            Err(why) => {
                // Once per run of refusals from a peer (by address: its source port may
                // change), then quietly counted: a peer with another key or a clock far off
                // says so without flooding the log.
                stats.refused.fetch_add(1, Ordering::Relaxed);
                if stats.peers.refused(to, &why, Instant::now()) {
                    warn!(%from, "refused a datagram from a peer: {why}");
                }
            }
        }
    }
}

/// The configured address of the peer `from` (a datagram's source, accepted by its
/// address): the one with its port too if there is one, else the first with its address.
fn configured(peers: &[SocketAddr], from: SocketAddr) -> SocketAddr {
    let ip = from.ip().to_canonical();
    let same = |p: &&SocketAddr| p.ip().to_canonical() == ip;
    peers
        .iter()
        .filter(same)
        .find(|p| p.port() == from.port())
        .or_else(|| peers.iter().find(same))
        .copied()
        .unwrap_or(from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use balancer_common::{addr_words, FlowKey, IPPROTO_TCP};

    fn key(byte: u8) -> Key {
        Key::new(&[byte; 32]).unwrap()
    }

    /// `body` tagged with key 1 as `seal` would, whatever it holds (`seal` takes no more
    /// than MAX_EVENTS, nor anything but a well-formed batch).
    fn signed(body: Vec<u8>) -> Vec<u8> {
        let mut mac = key(1).mac();
        mac.update(&body);
        let mut d = body;
        d.extend_from_slice(&mac.finalize().into_bytes());
        d
    }

    fn batch(seq: u64, sent_ms: u64, n: usize) -> Batch {
        let kinds = [Kind::Open, Kind::Close, Kind::Alive];
        Batch {
            sender: 0x5eed,
            seq,
            sent_ms,
            hello: false,
            dumped: None,
            events: (0..n)
                .map(|i| Event {
                    kind: kinds[i % 3],
                    client: SocketAddr::new([10, 9, 0, 2].into(), 40000 + i as u16),
                    vip: "[2001:db8::60]:8000".parse().unwrap(),
                    backend: "[fd00:4::11]:8000".parse().unwrap(),
                })
                .collect(),
        }
    }

    #[test]
    fn dumps_go_to_the_configured_address() {
        let peers: Vec<SocketAddr> = ["10.0.0.2:7946", "10.0.0.3:7946", "10.0.0.3:7947"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        let at = |a: &str| configured(&peers, a.parse().unwrap()).to_string();
        // Another source port (forged, or rewritten on the way) does not choose the target.
        assert_eq!(at("10.0.0.2:40000"), "10.0.0.2:7946");
        // A dual-stack socket's name for an IPv4 peer.
        assert_eq!(at("[::ffff:10.0.0.2]:7946"), "10.0.0.2:7946");
        // Two peers on one host: the one the datagram came from.
        assert_eq!(at("10.0.0.3:7947"), "10.0.0.3:7947");
        assert_eq!(at("10.0.0.3:1"), "10.0.0.3:7946");
    }

    #[test]
    fn a_sealed_batch_opens_with_the_same_key() {
        for n in [0, 1, MAX_EVENTS] {
            let sent = batch(u64::MAX, 1_000_000, n);
            let datagram = seal(&key(1), &sent);
            assert!(
                datagram.len() < 1200,
                "{n} events take {} bytes",
                datagram.len()
            );
            assert_eq!(open(&key(1), &datagram, 1_000_000 + 29_000), Ok(sent));
        }
    }

    /// The end of a dump rides in the trailer: an agent from before it reads the batch and
    /// ignores the rest, and one that has it reads either.
    #[test]
    fn a_dumps_end_is_read_by_new_agents_and_ignored_by_old_ones() {
        let sent = || Batch {
            dumped: Some(Dumped {
                to: 0x5eed_0001,
                flows: 1204,
            }),
            ..batch(7, 1_000_000, 0)
        };
        let datagram = seal(&key(1), &sent());
        // As an agent before the trailer opened it: the whole body as a batch.
        let old: Batch = postcard::from_bytes(&datagram[1..datagram.len() - TAG_BYTES]).unwrap();
        assert_eq!(old, batch(7, 1_000_000, 0));
        assert_eq!(open(&key(1), &datagram, 1_000_000), Ok(sent()));
        // A later agent's trailer, a field appended: what this one knows of it is read.
        let mut later = body(&sent());
        later.extend_from_slice(&[1, 2, 3]);
        assert_eq!(open(&key(1), &signed(later), 1_000_000), Ok(sent()));
        // One it cannot read leaves the batch as it is.
        let mut unreadable = body(&batch(7, 1_000_000, 2));
        unreadable.extend_from_slice(&[1, 0xff]);
        assert_eq!(
            open(&key(1), &signed(unreadable), 1_000_000),
            Ok(batch(7, 1_000_000, 2))
        );
    }

    #[test]
    fn anything_altered_or_foreign_is_refused() {
        let datagram = seal(&key(1), &batch(1, 1_000_000, 3));
        assert_eq!(open(&key(2), &datagram, 1_000_000), Err(Refused::Tag));
        for i in [0, 1, datagram.len() / 2, datagram.len() - 1] {
            let mut bad = datagram.clone();
            bad[i] ^= 0x40;
            assert_eq!(
                open(&key(1), &bad, 1_000_000),
                Err(Refused::Tag),
                "byte {i}"
            );
        }
        assert_eq!(
            open(&key(1), &datagram[..20], 1_000_000),
            Err(Refused::Short)
        );
        assert_eq!(open(&key(1), &[], 1_000_000), Err(Refused::Short));
        let mut long = datagram.clone();
        long.resize(MAX_DATAGRAM_BYTES + 1, 0);
        assert_eq!(open(&key(1), &long, 1_000_000), Err(Refused::Long));
        assert_eq!(
            open(&key(1), &datagram[..datagram.len() - 1], 1_000_000),
            Err(Refused::Tag)
        );
    }

    #[test]
    fn authentic_but_unusable_datagrams_are_refused() {
        let mut other_version = seal(&key(1), &batch(1, 5, 1));
        other_version.truncate(other_version.len() - TAG_BYTES);
        other_version[0] = 2;
        assert_eq!(
            open(&key(1), &signed(other_version), 5),
            Err(Refused::Version(2))
        );
        assert!(matches!(
            open(&key(1), &signed(vec![VERSION, 0xff, 0xff]), 5),
            Err(Refused::Malformed(_))
        ));
        let too_many = body(&batch(1, 5, MAX_EVENTS + 1));
        assert_eq!(
            open(&key(1), &signed(too_many), 5),
            Err(Refused::TooMany(MAX_EVENTS + 1))
        );
        let datagram = seal(&key(1), &batch(1, 1_000_000, 1));
        assert_eq!(
            open(&key(1), &datagram, 1_000_000 + 30_001),
            Err(Refused::Stale(30_001))
        );
        assert_eq!(
            open(&key(1), &datagram, 1_000_000 - 30_001),
            Err(Refused::Stale(-30_001))
        );
    }

    /// Up while its datagrams are accepted, whatever else comes from its address; refused
    /// while only refused ones come; silent after three heartbeats lost; a restart counted.
    #[test]
    fn each_peer_is_told_as_it_is_heard() {
        let (a, b): (SocketAddr, SocketAddr) = (
            "10.0.2.2:7471".parse().unwrap(),
            "10.0.2.3:7471".parse().unwrap(),
        );
        let stats = Stats::new(&[a, b]);
        let log = &stats.peers;
        let t0 = Instant::now();
        let s = |secs: f64| t0 + Duration::from_secs_f64(secs);
        let row = |at: f64| log.rows(s(at)).remove(0);
        let never = row(0.0);
        assert_eq!((never.state, never.heard_ms_ago), (PeerState::Silent, None));
        assert_eq!(never.problem.as_deref(), Some("never heard from"));

        log.accepted(a, 7, 3, s(0.0));
        let up = row(1.0);
        assert_eq!((up.state, up.heard_ms_ago), (PeerState::Up, Some(1000)));
        assert_eq!((up.events_in, up.restarts, up.problem), (3, 0, None));
        // A forged datagram from its address: counted and said, the peer still up.
        assert!(
            log.refused(a, &Refused::Tag, s(1.5)),
            "the first refusal is news"
        );
        assert!(!log.refused(a, &Refused::Tag, s(1.6)), "the second is not");
        assert!(
            log.refused(a, &Refused::Replayed, s(1.7)),
            "another reason is"
        );
        let forged = row(2.0);
        assert_eq!((forged.state, forged.refused), (PeerState::Up, 3));
        assert!(forged.problem.unwrap().contains("a replay"));
        // Another run: its agent restarted. An accepted datagram clears the refusal.
        log.accepted(a, 8, 0, s(2.0));
        let restarted = row(2.5);
        assert_eq!((restarted.restarts, restarted.problem), (1, None));
        // Up for three lost heartbeats and a late one.
        assert_eq!(row(5.4).state, PeerState::Up);
        assert_eq!(row(5.5).state, PeerState::Silent);
        // Another key: only refused datagrams, then none.
        assert!(log.refused(a, &Refused::Stale(40_000), s(6.0)));
        assert!(
            !log.refused(a, &Refused::Stale(41_000), s(6.5)),
            "the same kind"
        );
        assert_eq!(row(7.0).state, PeerState::Refused);
        assert!(row(7.0).problem.unwrap().contains("clocks apart"));
        assert_eq!(row(10.0).state, PeerState::Silent);
        // The other peer: what could not be sent, until something is.
        let unreachable = std::io::Error::from(std::io::ErrorKind::HostUnreachable);
        assert!(
            !log.sent(b, Ok(())),
            "a send that works as before is no news"
        );
        assert!(log.sent(b, Err(&unreachable)), "the first failure is news");
        assert!(!log.sent(b, Err(&unreachable)), "the second is not");
        let other = log.rows(s(9.0)).remove(1);
        assert_eq!(
            (other.peer.as_str(), other.send_errors),
            ("10.0.2.3:7471", 2)
        );
        assert!(other.problem.unwrap().starts_with("sending to it fails"));
        assert!(!log.sent(b, Ok(())), "working again is not warned about");
        let sent = log.rows(s(9.0)).remove(1);
        assert_eq!(
            (sent.send_errors, sent.problem.as_deref()),
            (2, Some("never heard from"))
        );
        // An address that is not a peer's changes nothing.
        log.accepted("10.0.2.9:7471".parse().unwrap(), 9, 5, s(9.0));
        assert_eq!(log.rows(s(9.0)).iter().map(|r| r.events_in).sum::<u64>(), 3);
    }

    /// Asked again (hellos) while a peer that is heard has not said it sent all its flows:
    /// its first hello lost, started later, or restarted while it sent them.
    #[test]
    fn a_peer_heard_without_its_flows_is_awaited() {
        let (a, b): (SocketAddr, SocketAddr) = (
            "10.0.2.2:7471".parse().unwrap(),
            "10.0.2.3:7471".parse().unwrap(),
        );
        let log = Stats::new(&[a, b]).peers;
        let t0 = Instant::now();
        let s = |secs: f64| t0 + Duration::from_secs_f64(secs);
        assert!(!log.awaiting_flows(s(0.0)), "no peer heard: nothing to ask");
        log.accepted(a, 7, 0, s(0.0));
        assert!(log.awaiting_flows(s(1.0)));
        assert!(log.dumped(a, 12), "its end is news once");
        assert!(!log.dumped(a, 12));
        assert!(!log.awaiting_flows(s(1.0)));
        log.accepted(b, 9, 0, s(2.0));
        assert!(
            log.awaiting_flows(s(2.0)),
            "another peer heard without its flows"
        );
        assert!(!log.awaiting_flows(s(5.5)), "silent since: nothing to ask");
        assert_eq!(log.rows(s(5.5))[0].flows_at_start, Some(12));
    }

    #[test]
    fn replays_and_reflections_are_refused() {
        let t0 = Instant::now();
        let mut r = Replays::new(7);
        let from = |sender, seq| Batch {
            sender,
            ..batch(seq, 0, 1)
        };
        assert_eq!(r.check(&from(7, 1), t0), Err(Refused::Reflected));
        for seq in [1, 2, 5, 4] {
            assert_eq!(r.check(&from(9, seq), t0), Ok(()), "first sight of {seq}");
        }
        for seq in [1, 2, 4, 5] {
            assert_eq!(r.check(&from(9, seq), t0), Err(Refused::Replayed), "{seq}");
        }
        // Out of order within the window, once; too far behind, never.
        assert_eq!(r.check(&from(9, 3), t0), Ok(()));
        assert_eq!(r.check(&from(9, 5 + REPLAY_WINDOW), t0), Ok(()));
        assert_eq!(r.check(&from(9, 5), t0), Err(Refused::Replayed));
        assert_eq!(r.check(&from(9, 6), t0), Ok(()));
        // Another sender (the peer restarted) has its own numbers.
        assert_eq!(r.check(&from(10, 1), t0), Ok(()));
        // A sender silent for twice MAX_AGE is forgotten: its datagrams are too old by then.
        let later = t0 + MAX_AGE * 2;
        assert_eq!(r.check(&from(10, 2), later), Ok(()));
        assert_eq!(r.senders.len(), 1);
        assert_ne!(sender_id(), sender_id());
    }

    #[test]
    fn short_keys_are_refused() {
        assert!(Key::new(&[7; 31]).is_err());
        let dir = std::env::temp_dir().join(format!("balancer-sync-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (path, other) = (dir.join("key"), dir.join("other"));
        std::fs::write(&path, format!("  {}\n", "k".repeat(32))).unwrap();
        std::fs::write(&other, "o".repeat(40)).unwrap();
        let mut sync = FlowSync {
            listen: "10.0.0.1:7471".parse().unwrap(),
            peers: vec!["10.0.0.2:7471".parse().unwrap()],
            key_file: path.clone(),
            accept_key_files: vec![other.clone()],
        };
        let keys = Keys::load(&sync).unwrap();
        assert_eq!(keys.accept.len(), 1);
        std::fs::write(&other, "short\n").unwrap();
        let e = format!("{:#}", Keys::load(&sync).unwrap_err());
        assert!(
            e.contains("sync.accept_key_files") && e.contains("5 bytes"),
            "{e}"
        );
        sync.accept_key_files.clear();
        std::fs::write(&path, "short\n").unwrap();
        let e = format!("{:#}", Keys::load(&sync).unwrap_err());
        assert!(e.contains("sync.key_file") && e.contains("5 bytes"), "{e}");
        std::fs::remove_dir_all(dir).ok();
    }

    /// A rollout: a datagram sealed with the new key opens where it is accepted, and only
    /// there; what else is wrong with it is still found.
    #[test]
    fn accepted_keys_open_what_the_sealing_key_does_not() {
        let (old, new) = (key(1), key(2));
        let rolling = Keys {
            seal: old.clone(),
            accept: vec![key(3), new.clone()],
        };
        let plain = Keys {
            seal: old.clone(),
            accept: Vec::new(),
        };
        let sent = batch(1, 1_000_000, 2);
        let by_new = seal(&new, &sent);
        assert_eq!(rolling.open(&by_new, 1_000_000), Ok(batch(1, 1_000_000, 2)));
        assert_eq!(plain.open(&by_new, 1_000_000), Err(Refused::Tag));
        assert_eq!(plain.open(&seal(&old, &sent), 1_000_000), Ok(sent));
        assert_eq!(
            rolling.open(&by_new, 1_000_000 + 30_001),
            Err(Refused::Stale(30_001))
        );
        assert_eq!(
            rolling.open(&seal(&key(4), &batch(1, 5, 1)), 5),
            Err(Refused::Tag)
        );
    }

    #[test]
    fn ring_events_name_both_ends_and_the_backend() {
        let (client, family) = addr_words("10.9.0.2".parse().unwrap());
        let (vip, _) = addr_words("192.0.2.60".parse().unwrap());
        let (backend, _) = addr_words("10.4.0.13".parse().unwrap());
        let mut e = FlowEvent {
            key: FlowKey {
                src: client,
                dst: vip,
                sport: 40001u16.to_be(),
                dport: 8000u16.to_be(),
                proto: IPPROTO_TCP,
                family,
                _pad: [0; 2],
            },
            nat_addr: backend,
            nat_port: 8000u16.to_be(),
            kind: FLOW_EVENT_CLOSE,
            _pad: 0,
            epoch: 77,
        };
        // SAFETY: plain integers, read back as bytes.
        let bytes = |e: &FlowEvent| unsafe {
            std::slice::from_raw_parts((e as *const FlowEvent).cast::<u8>(), size_of::<FlowEvent>())
                .to_vec()
        };
        let close = Event {
            kind: Kind::Close,
            client: "10.9.0.2:40001".parse().unwrap(),
            vip: "192.0.2.60:8000".parse().unwrap(),
            backend: "10.4.0.13:8000".parse().unwrap(),
        };
        assert_eq!(Event::from_ring(&bytes(&e)), Some((close, 77)));
        e.kind = FLOW_EVENT_ALIVE;
        assert_eq!(
            Event::from_ring(&bytes(&e)).map(|(e, _)| e.kind),
            Some(Kind::Alive)
        );
        assert_eq!(Event::from_ring(&bytes(&e)[..63]), None);
        e.kind = 9;
        assert_eq!(Event::from_ring(&bytes(&e)), None);
        e.kind = FLOW_EVENT_OPEN;
        e.key.family = 0;
        assert_eq!(Event::from_ring(&bytes(&e)), None);
    }

    /// Any batch a gateway may send: any sender, numbers and time, hello or not, up to one
    /// more event than allowed, each kind, clients, VIPs and servers of either family.
    fn any_batch() -> impl proptest::strategy::Strategy<Value = Batch> {
        use proptest::prelude::*;
        let addr = prop_oneof![
            (any::<[u8; 4]>(), any::<u16>()).prop_map(|(a, p)| SocketAddr::from((a, p))),
            (any::<[u8; 16]>(), any::<u16>()).prop_map(|(a, p)| SocketAddr::from((a, p))),
        ];
        let kind = proptest::sample::select(&[Kind::Open, Kind::Close, Kind::Alive][..]);
        let event =
            (kind, addr.clone(), addr.clone(), addr).prop_map(|(kind, client, vip, backend)| {
                Event {
                    kind,
                    client,
                    vip,
                    backend,
                }
            });
        (
            any::<u64>(),
            any::<u64>(),
            0..u64::MAX / 2,
            any::<bool>(),
            proptest::collection::vec(event, 0..=MAX_EVENTS + 1),
            proptest::option::of((any::<u64>(), any::<u64>())),
        )
            .prop_map(|(sender, seq, sent_ms, hello, events, dumped)| Batch {
                sender,
                seq,
                sent_ms,
                hello,
                events,
                dumped: dumped.map(|(to, flows)| Dumped { to, flows }),
            })
    }

    proptest::proptest! {
        /// Every batch opens as it was sealed, within the limits: too many events, or a time
        /// too far from the receiver's clock, refused for that. Any bit flipped is refused,
        /// and a body cut or altered then signed again opens to something or is refused,
        /// never a panic; nor do any bytes read from the ring.
        #[test]
        fn batches_open_as_sealed_within_the_limits(
            b in any_batch(),
            skew in -40_000i64..40_000,
            flip in proptest::num::usize::ANY,
            (cut, at, byte) in (proptest::num::usize::ANY, proptest::num::usize::ANY, proptest::num::u8::ANY),
            ring in proptest::collection::vec(proptest::num::u8::ANY, 0..128),
        ) {
            let body = body(&b);
            let mut datagram = signed(body.clone());
            let now = b.sent_ms.saturating_add_signed(skew);
            let opened = open(&key(1), &datagram, now);
            let n = b.events.len();
            let skewed = i128::from(now) - i128::from(b.sent_ms);
            if datagram.len() > MAX_DATAGRAM_BYTES {
                proptest::prop_assert_eq!(opened, Err(Refused::Long));
            } else if n > MAX_EVENTS {
                proptest::prop_assert_eq!(opened, Err(Refused::TooMany(n)));
            } else if skewed.unsigned_abs() > MAX_AGE.as_millis() {
                proptest::prop_assert_eq!(opened, Err(Refused::Stale(skewed)));
            } else {
                proptest::prop_assert_eq!(opened, Ok(b));
            }
            let bit = flip % (datagram.len() * 8);
            datagram[bit / 8] ^= 1 << (bit % 8);
            proptest::prop_assert!(open(&key(1), &datagram, now).is_err());
            let mut altered = body;
            altered.truncate(1 + cut % altered.len());
            let i = at % altered.len();
            altered[i] = byte;
            let _ = open(&key(1), &signed(altered), now);
            let _ = Event::from_ring(&ring);
        }
    }
}
