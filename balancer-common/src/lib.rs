//! Types that cross the kernel/user boundary, map sizes, and the pure logic that the XDP
//! program and the agent must compute identically.
//!
//! Every map value is `#[repr(C)]` with explicit padding so that its layout is the same on
//! both sides and no uninitialised byte reaches the kernel. Addresses are kept exactly as they
//! appear on the wire (network byte order) in four 32-bit words; IPv4 uses word 0 and leaves
//! the rest zero, so one key type serves both families.
#![no_std]

pub mod csum;
pub mod hash;
pub mod hint;

/// Address families as stored in keys (not the kernel's AF_* numbers: a byte is enough).
pub const FAMILY_V4: u8 = 4;
pub const FAMILY_V6: u8 = 6;
pub const IPPROTO_TCP: u8 = 6;

/// Maximum number of VIPs (pools).
pub const MAX_VIPS: u32 = 64;
/// Backend ids are indices into the backends array; id 0 is reserved and never routed.
pub const MAX_BACKENDS: u32 = 4096;
/// Interfaces the program may be attached to, and so send frames out of (`EGRESS`).
pub const MAX_INTERFACES: u32 = 64;
/// Slots per Maglev table: prime, and at least 100 slots per backend for pools of up to 163
/// servers (Cilium's default size).
pub const MAGLEV_SIZE: u32 = 16381;
/// Each VIP owns two tables; the agent fills the idle one and then flips
/// [`VipInfo::table`], so a new flow never sees a half-written table.
pub const MAGLEV_TABLES: u32 = MAX_VIPS * 2;
/// Slots per VIP of its alternates table: every server that may take a connection
/// (saturated or not; not DOWN or draining), by configured weight. A SYN whose Maglev pick
/// has no room draws two alternates there and takes the roomiest. Separate from the Maglev
/// table because that one holds only unsaturated servers, which in a burst can be a single
/// one: its alternates would be itself. Prime; a second chance needs less resolution.
pub const ALTERNATES_SIZE: u32 = 1021;
pub const ALTERNATES_SLOTS: u32 = MAX_VIPS * ALTERNATES_SIZE;
/// Default number of flow-table entries, one per connection.
pub const DEFAULT_FLOW_ENTRIES: u32 = 1 << 18;
/// The meaning of the maps an agent pins (`agent.pin_dir`): bumped whenever a pinned map's
/// layout or meaning changes, so that an agent never takes over maps it would misread.
pub const PIN_LAYOUT: u32 = 2;
/// Default idle timeout of a flow.
pub const DEFAULT_IDLE_TIMEOUT_S: u32 = 600;

/// An address as keys store it: network-order bytes in four words, IPv4 in word 0.
pub fn addr_words(ip: core::net::IpAddr) -> ([u32; 4], u8) {
    let mut w = [0u32; 4];
    match ip {
        core::net::IpAddr::V4(a) => {
            w[0] = u32::from_ne_bytes(a.octets());
            (w, FAMILY_V4)
        }
        core::net::IpAddr::V6(a) => {
            let o = a.octets();
            for (i, word) in w.iter_mut().enumerate() {
                *word = u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]]);
            }
            (w, FAMILY_V6)
        }
    }
}

/// The address `addr_words` stored, if `family` is one of ours.
pub fn words_addr(words: [u32; 4], family: u8) -> Option<core::net::IpAddr> {
    match family {
        FAMILY_V4 => Some(core::net::Ipv4Addr::from(words[0].to_ne_bytes()).into()),
        FAMILY_V6 => {
            let mut o = [0u8; 16];
            for (i, word) in words.iter().enumerate() {
                o[4 * i..4 * i + 4].copy_from_slice(&word.to_ne_bytes());
            }
            Some(core::net::Ipv6Addr::from(o).into())
        }
        _ => None,
    }
}

/// A VIP as the program looks it up: destination address, port and protocol.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct VipKey {
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    pub family: u8,
}

/// Per-VIP configuration written by the agent.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct VipInfo {
    /// Index of the VIP, used for per-VIP state.
    pub vip_id: u32,
    /// Active Maglev table, in `0..MAGLEV_TABLES`; slot `s` lives at `table * MAGLEV_SIZE + s`.
    pub table: u32,
    pub idle_timeout_s: u32,
    /// Number of backends with weight > 0; zero means every new flow is dropped.
    pub live_backends: u32,
    /// Prefix hints (`hint`): SYNs from source ports in `[hint_start, hint_start +
    /// hint_span)` select through `BUCKETS`; `hint_buckets == 0` turns hints off.
    pub hint_start: u16,
    pub hint_span: u16,
    pub hint_buckets: u16,
    /// `VIP_F_*` bits.
    pub flags: u16,
    /// With `VIP_F_TUNNEL`, the source address of the outer header: an address of this
    /// gateway that the backends route back to (their ICMP errors about the tunnel come
    /// here) and accept tunnelled packets from.
    pub tunnel_src: [u32; 4],
    /// All ones with `VIP_F_TUNNEL`, else zero: the program selects a tunnel's values with
    /// it by arithmetic (see the program's `nat::Outer`).
    pub tunnel_mask: u32,
}

/// The agent shares this VIP's flows with other gateways (`[sync]`): the program reports
/// each new flow once the client's first ACK follows its SYN, each close and, while a flow
/// lives, a keepalive in `FLOW_EVENTS`.
pub const VIP_F_SYNC: u16 = 1;

/// Direct server return: the program leaves the client's packets as they are (addresses,
/// ports, checksums) and only hands them to the backend's MAC, so the backend must be on a
/// link of this gateway, hold the VIP on a loopback and listen on the VIP's port. It answers
/// the client directly: its replies never come back through here.
pub const VIP_F_DSR: u16 = 2;

/// Direct server return through a tunnel, always with `VIP_F_DSR`: the program leaves the
/// client's packet as it is (but for its TTL) and puts it inside an outer IPv4 (IPIP) or
/// IPv6 (IP6IP6) header from `tunnel_src` to the backend, which may be any number of routers
/// away. The backend takes the outer header off, holds the VIP and listens on the VIP's
/// port, and answers the client directly.
pub const VIP_F_TUNNEL: u16 = 4;

/// IP protocol numbers of the outer header's payload: IPv4 in IPv4 (RFC 2003), IPv6 in
/// IPv6 (RFC 2473).
pub const IPPROTO_IPIP: u8 = 4;
pub const IPPROTO_IPV6: u8 = 41;

/// The flow label of a tunnelled IPv6 packet's outer header (RFC 6438): one per connection
/// (its client's port and the last 32 bits of its address, as the packet carries them), so
/// that routers that spread flows over paths by the label spread the tunnel's, whose outer
/// addresses are all alike.
#[inline(always)]
pub fn tunnel_flow_label(key: &FlowKey) -> u32 {
    let word = key.src[3];
    (word ^ word >> 12 ^ u32::from(key.sport) << 4) & 0xf_ffff
}

/// The servers of one hint bucket: `ids[0]` is the home, the rest warm alternates that
/// already hold the prefix; 0 marks an empty place.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Bucket {
    pub ids: [u32; hint::BUCKET_CANDIDATES],
}

/// How many more new connections a backend may take before it counts as past its spill
/// threshold: the agent writes `budget`, from a scrape, together with the values
/// `OPENS[id]` and `CLOSES[id]` had when that scrape's request was sent, and the program compares the connections opened and not
/// closed since with the budget. Negative: past the threshold by that many requests
/// (queued beyond it), so that among servers that are all past it the least loaded still
/// shows.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct BackendLoad {
    pub opened_base: u64,
    pub closed_base: u64,
    pub budget: i32,
    /// `LOAD_F_*`. Was padding: 0 in the maps of an agent from before it.
    pub flags: u32,
}

/// `BackendLoad::flags`: the backend is saturated (queue, TTFT or KV) or not UP, or was so in
/// the last two scrape intervals (`budget` is then at most 0). Connections that close on it give no room back until the
/// agent says otherwise: a closed stream frees a slot, not the latency or memory that made
/// it saturated.
pub const LOAD_F_HELD: u32 = 1;

/// The budget of a backend whose load is unknown (no fresh metrics): it is never past its
/// threshold, so nothing spills away from it, and never taken as an alternate or a spill
/// target, since nothing says it has room.
pub const BUDGET_UNKNOWN: i32 = i32::MIN;

/// Per hint bucket and CPU: hinted SYNs, how many spilled, and which candidate took each.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct BucketStats {
    pub hinted: u64,
    pub spilled: u64,
    pub picks: [u64; hint::BUCKET_CANDIDATES],
}

/// Buckets of all VIPs: VIP `v`'s bucket `b` is at [`bucket_slot`]`(v, b)`.
pub const BUCKET_SLOTS: u32 = MAX_VIPS * hint::MAX_HINT_BUCKETS as u32;

/// Where VIP `vip_id`'s bucket `bucket` lies in `BUCKETS` and `BUCKET_STATS`, if within
/// [`BUCKET_SLOTS`].
#[inline(always)]
pub fn bucket_slot(vip_id: u32, bucket: u32) -> Option<u32> {
    let slot = vip_id * hint::MAX_HINT_BUCKETS as u32 + bucket;
    (slot < BUCKET_SLOTS).then_some(slot)
}

/// A backend server, indexed by its id in the backends array.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Backend {
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
    pub family: u8,
    /// `BACKEND_F_*` bits.
    pub flags: u8,
    /// The VIP of the pool this backend serves (a server in two pools has two ids). The
    /// program does not read it: an agent that takes over pinned maps recovers its ids from
    /// it.
    pub vip_id: u32,
}

/// The slot holds a configured backend. Entries of removed servers keep this bit until no
/// flow can refer to them any more, so that established flows keep their backend.
pub const BACKEND_F_PRESENT: u8 = 1;
/// The flags below are for an agent that takes over pinned maps; the program reads only
/// `BACKEND_F_DOWN`. The operator drains this backend (it has no slot in any table): it
/// stays drained.
pub const BACKEND_F_DRAINING: u8 = 2;
/// Its health checks failed (no slot in any table): it stays DOWN until checks pass. A SYN
/// that finds an entry naming it is placed anew.
pub const BACKEND_F_DOWN: u8 = 4;
/// Removed from the configuration (not present), its id in quarantine while its flows may
/// be open: the id is not given to another server before then.
pub const BACKEND_F_RETIRED: u8 = 8;

/// A flow as the client sends it (client -> VIP): the flow table's key. A reply finds it
/// through [`Replies`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct FlowKey {
    pub src: [u32; 4],
    pub dst: [u32; 4],
    /// Network byte order.
    pub sport: u16,
    /// Network byte order.
    pub dport: u16,
    pub proto: u8,
    pub family: u8,
    pub _pad: [u8; 2],
}

/// Flow-table value: the client's packets get their destination rewritten to
/// `nat_addr:nat_port` (the backend), and the backend's replies from there are this flow's.
/// For a DSR VIP (`VIP_F_DSR`) the packets keep their destination and go to the MAC of
/// `nat_addr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FlowEntry {
    pub nat_addr: [u32; 4],
    /// Network byte order.
    pub nat_port: u16,
    /// Set once the flow ended (a RST, or the server's FIN; see `note_fin` in the program),
    /// so the close is counted once and a later SYN on the same tuple starts a new flow.
    /// Written as a whole byte so concurrent writers of `acked` cannot clobber it.
    pub closed: u8,
    /// `FLOW_ACKED` once the client acknowledged (its first packet after the SYN with ACK
    /// set): the flow is then reported to other gateways and kept alive there (`[sync]`);
    /// until then nothing but a SYN reached the backend. With `FLOW_UNTOLD` while the other
    /// gateways have not been told of it.
    pub acked: u8,
    pub backend_id: u32,
    pub idle_timeout_s: u32,
    /// For a flow shared with other gateways: when it was last reported to them, in units of
    /// 2^30 ns of `bpf_ktime_get_coarse_ns` (about a second); 0 for a flow not shared.
    pub synced: u32,
    /// `bpf_ktime_get_coarse_ns` (CLOCK_MONOTONIC_COARSE) of the last packet in either
    /// direction, refreshed at most once per second to keep the shared cache line quiet.
    pub last_seen_ns: u64,
    /// Where the client's packets go next (towards the backend), and the replies.
    pub to_backend: NextHop,
    pub to_client: NextHop,
    /// Swapped to 1 by the packet that ends the flow (see `closed`), atomically: when both
    /// ends close at once, their
    /// packets can meet `closed == 0` on two CPUs, and only the one that swaps a 0 out counts
    /// the close. A u64 because the bpf target swaps 64 bits at its base instruction set.
    pub close_claim: u64,
}

/// `FlowEntry::acked`: the client acknowledged the handshake.
pub const FLOW_ACKED: u8 = 1;
/// `FlowEntry::acked`, with `FLOW_ACKED`: a shared flow whose report did not go out (past
/// the allowance, or the ring full), so the other gateways have not heard of it; its close is
/// not reported either, so that forged handshakes and their ends buy no report past the
/// allowance. Cleared by the keepalive that reports it, or by a peer's report of it.
pub const FLOW_UNTOLD: u8 = 2;

impl FlowEntry {
    /// Idle past its timeout at `now` (the clock of `last_seen_ns`). `last_seen_ns` is
    /// refreshed once a second, so it may be up to a second older than the last packet: the
    /// timeout counts from a second after it, so that no flow expires early.
    #[inline(always)]
    pub fn expired_at(&self, now: u64) -> bool {
        let idle = (u64::from(self.idle_timeout_s) + 1) * 1_000_000_000;
        // Saturating: another CPU may have stored a later time than `now`.
        now.saturating_sub(self.last_seen_ns) > idle
    }

    /// Neither closed nor idle past its timeout at `now`.
    #[inline(always)]
    pub fn live_at(&self, now: u64) -> bool {
        self.closed == 0 && !self.expired_at(now)
    }
}

/// `now` (ns of `bpf_ktime_get_coarse_ns`, CLOCK_MONOTONIC_COARSE) in the units of
/// `FlowEntry::synced` and `FlowEvent::epoch`, 2^30 ns (about a second); never 0, which
/// means "not shared".
#[inline(always)]
pub fn sync_epoch(now: u64) -> u32 {
    let e = (now >> 30) as u32;
    if e == 0 {
        1
    } else {
        e
    }
}

/// The epoch (2^30 ns) of a flow's cached next hop towards its client, whose port is
/// `client_port` (as stored): the program's clock shifted by up to an epoch by the port, so
/// that the answers of many flows do not all go stale at once (every flow's next reply
/// would look its next hop up in the same instant, once a second). Each still lasts one
/// epoch. The way to a server on one of our links needs no such shift: flows to it share
/// its answer (`BackendHop`), one lookup an epoch and CPU; flows to a server behind a router
/// still look up in the same instant.
#[inline(always)]
pub fn reply_epoch(now: u64, client_port: u16) -> u32 {
    ((now + (u64::from(client_port) << 14)) >> 30) as u32
}

/// A FIB answer kept in a flow entry: a lookup costs more than the rest of an established
/// packet's work (about 220 ns for IPv4 and 450 ns for IPv6 on the benchmark machine), and
/// the answer for one flow's direction rarely changes. Good for the 2^30 ns "epoch" it was
/// looked up in (about a second); `ifindex == 0` means nothing is cached.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct NextHop {
    pub ifindex: u32,
    /// `bpf_ktime_get_coarse_ns() >> 30` when looked up (`reply_epoch` towards a client).
    pub epoch: u32,
    pub dmac: [u8; 6],
    pub smac: [u8; 6],
    /// The egress MTU the FIB reported (or, from a kernel that reports none, the IP length
    /// it checked): a longer packet is looked up again, so that one past the MTU is answered
    /// "too big" (by the program where it may not be fragmented, see `icmp.rs`; else by the
    /// stack it passes to).
    pub mtu: u16,
    pub _pad: u16,
}

/// The next hop towards one backend (`HOPS`, per CPU), for all its flows: a packet whose flow
/// has no answer of this epoch (a SYN, or a long flow's first packet of a new epoch) takes it
/// instead of a FIB lookup while it is from the same epoch, was asked from the same ingress
/// interface and still names the backend's address. Only an answer whose next hop is the
/// backend itself, on one of our links, is kept: that answer is the same whichever client
/// asks, where a route through a router may depend on the flow (multipath) or the source.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct BackendHop {
    /// The backend's address the answer is for (the agent may give the id to another).
    pub addr: [u32; 4],
    pub ingress: u32,
    pub hop: NextHop,
}

/// Rate limits, per CPU (`ALLOWANCES`): what the program sends unasked, when a flood of
/// forged packets could make it send one thing per packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// ICMP "too big" answers, at the rate and burst Linux allows its own ICMP errors
    /// (`net.ipv4.icmp_msgs_per_sec`, `icmp_msgs_burst`), though per CPU here where Linux's
    /// limit is for the whole host. An answer is shorter than the packet it answers, but
    /// would go to whatever source the packet names; a sender doing path MTU discovery needs
    /// one per connection.
    TooBigAnswers,
    /// Reports of new flows to the other gateways: opens (`FLOW_EVENT_OPEN`, at the first
    /// acknowledgment after a SYN) and flows placed without their SYN (guesses,
    /// `FLOW_EVENT_ALIVE`). Forged packets, two per open or one per guess, would otherwise
    /// fill `FLOW_EVENTS` and the peers' flow tables and crowd out the reports of real
    /// connections. A flow past the allowance is reported at its next packet a second or
    /// more later, with the keepalives, which a forged one never has.
    NewFlowReports,
}

impl Limit {
    pub const COUNT: u32 = Limit::NewFlowReports as u32 + 1;

    /// (per second, burst).
    pub const fn rate(self) -> (u64, u64) {
        match self {
            Limit::TooBigAnswers => (1000, 50),
            Limit::NewFlowReports => (1000, 1000),
        }
    }
}

/// One CPU's allowance under a [`Limit`]: a token bucket kept as time. `credit_ns` is the
/// time earned, at most a burst's worth, and each use spends `1e9 / per second` ns of it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Allowance {
    pub credit_ns: u64,
    /// `bpf_ktime_get_coarse_ns` when the credit was last brought up to date.
    pub last_ns: u64,
}

impl Allowance {
    /// Brings the credit up to `now` and spends one use's worth if there is one.
    #[inline(always)]
    pub fn take(&mut self, limit: Limit, now: u64) -> bool {
        let (per_s, burst) = limit.rate();
        let cost = 1_000_000_000 / per_s;
        let earned = now.saturating_sub(self.last_ns);
        self.last_ns = self.last_ns.max(now);
        let credit = self.credit_ns.saturating_add(earned).min(burst * cost);
        if credit >= cost {
            self.credit_ns = credit - cost;
            true
        } else {
            self.credit_ns = credit;
            false
        }
    }
}

/// What the program reports of a shared flow (`VIP_F_SYNC`) in `FLOW_EVENTS`: the agent
/// sends it to the other gateways, whose agents write the same entry into their flow tables,
/// so that the flow keeps its backend when its packets arrive there instead.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FlowEvent {
    pub key: FlowKey,
    /// The backend, as in the flow's entry.
    pub nat_addr: [u32; 4],
    /// Network byte order.
    pub nat_port: u16,
    /// `FLOW_EVENT_*`.
    pub kind: u8,
    pub _pad: u8,
    /// When it was reported, in the units of `FlowEntry::synced`: the agent drops what a
    /// ring kept while no agent drained it, rather than send it as news.
    pub epoch: u32,
}

/// A new flow, placed by its SYN, now that the client's first ACK has followed: it replaces
/// whatever another gateway's entry for the tuple says (a new connection reusing it).
pub const FLOW_EVENT_OPEN: u8 = 1;
/// The flow ended (see `FlowEntry::closed`).
pub const FLOW_EVENT_CLOSE: u8 = 2;
/// A live flow reported again before other gateways' entries could expire, or a flow this
/// gateway placed without seeing its SYN (a guess): it only fills a place where another
/// gateway has no live entry for the tuple.
pub const FLOW_EVENT_ALIVE: u8 = 3;
/// Size of the `FLOW_EVENTS` ring: about 14,000 events (64 bytes and an 8-byte header each),
/// several seconds of new connections at the gateway benchmark's rate, for an agent that
/// drains it every few milliseconds.
pub const FLOW_EVENTS_BYTES: u32 = 1 << 20;

/// A backend as its replies name it: source address and port.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ReplyKey {
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
    pub family: u8,
    pub _pad: u8,
}

/// How many pools one backend address may serve at once.
pub const MAX_REPLY_VIPS: usize = 4;

/// The VIPs a backend serves: a reply from it to `client:port` belongs to the flow
/// `client:port -> VIP` of one of them, whose entry names this backend. So one flow-table
/// entry serves both directions, and a packet from anywhere else never touches the flow
/// table. Unused places have `family == 0`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Replies {
    pub vips: [VipKey; MAX_REPLY_VIPS],
}

/// Per-backend counters, per CPU; the agent sums them across CPUs.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct BackendStats {
    pub flows_opened: u64,
    pub flows_closed: u64,
    pub packets: u64,
    pub bytes: u64,
}

/// Why the program returned what it returned; one per-CPU counter each.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Every packet the program saw.
    Packets = 0,
    PassNotIp,
    PassNotTcp,
    /// Shorter than the headers it announces.
    PassTruncated,
    /// Header fields that make no sense (IHL < 5, data offset < 5, lengths that disagree).
    PassMalformed,
    PassIpOptions,
    PassFragment,
    PassIpv6ExtHeader,
    /// TCP that is neither for a VIP nor the reply of a flow of ours.
    PassNotOurs,
    /// TTL or hop limit would reach zero: the stack sends the ICMP error.
    PassTtlExceeded,
    /// The VIP has no backend with weight > 0.
    DropNoBackend,
    /// The Maglev slot named a backend that is not present (a table/backends race).
    DropBadBackend,
    FlowNewSyn,
    /// A non-SYN packet without an entry (entry evicted, or another gateway's flow).
    FlowNewMidstream,
    /// An entry past its idle timeout was replaced.
    FlowExpired,
    /// A SYN reused the tuple of a closed flow, or of one whose backend is DOWN.
    FlowReopened,
    /// The flow table refused an insert; the packet is still forwarded.
    FlowInsertFailed,
    Forward,
    Return,
    Tx,
    Redirect,
    /// Rewritten, then passed to the stack because the next hop's MAC is not known yet.
    PassNoNeigh,
    /// Rewritten, then passed to the stack because the FIB gave no forwarding answer.
    PassFibOther,
    /// Rewritten, then passed to the stack: longer than the egress MTU, and an IPv4 packet
    /// that may be fragmented (the stack fragments it), or longer than its ingress interface
    /// carries (a local sender's segmentation offload over veth: the stack splits it).
    /// Others are answered here (`TooBigAnswered`); VLAN-tagged ones count `PassVlan`.
    PassTooBig,
    /// Rewritten, then passed to the stack: a VLAN-tagged frame leaves through a VLAN
    /// device, which XDP cannot transmit on, so the stack forwards it.
    PassVlan,
    /// A hinted SYN went to its bucket's home.
    HintHome,
    /// A hinted SYN spilled to a warm alternate: the home was past its threshold.
    HintWarm,
    /// A hinted SYN found its home and alternates all past their thresholds (or no
    /// candidates yet) and took the Maglev pick.
    HintMaglev,
    /// A new SYN's Maglev pick had no room (no free slot before a request would wait) and
    /// one of the flow's two draws from the VIP's alternates had more: it went there.
    MaglevSecond,
    /// A flow event for other gateways (`VIP_F_SYNC`) found `FLOW_EVENTS` full (no agent
    /// draining it): those gateways will not know the flow.
    SyncLost,
    /// A packet for a DSR VIP (`VIP_F_DSR`) whose backend the FIB reaches through a router,
    /// not on a link of ours: sent on, the frame would come back to the VIP.
    DropDsrRouted,
    /// A packet for a DSR VIP whose backend's MAC is not known yet. Unlike a translated
    /// packet it cannot go to the stack (it is still addressed to the VIP); the agent's
    /// scrapes and health checks keep the backends' neighbour entries resolved.
    DropDsrNoNeigh,
    /// A packet for a DSR VIP longer than the MTU towards the backend that may be
    /// fragmented (IPv4 without don't-fragment), which XDP cannot do; others are answered
    /// (`TooBigAnswered`).
    DropDsrTooBig,
    /// A packet for a DSR VIP for which the FIB gave no forwarding answer.
    DropDsrFibOther,
    /// A VLAN-tagged packet for a DSR VIP: XDP cannot transmit on a VLAN device and the
    /// stack cannot forward a packet still addressed to the VIP.
    DropDsrVlan,
    /// A FIB lookup (`bpf_fib_lookup`): the first packet of a flow's direction in each epoch
    /// that neither its flow's cached answer nor its backend's (`HOPS`) serves.
    FibLookup,
    /// Rewritten, then passed to the stack: the next hop is out of an interface the program
    /// is not attached to (not in `EGRESS`), whose driver may not transmit a frame from XDP.
    PassEgress,
    /// A packet for a DSR VIP whose next hop is out of an interface the program is not
    /// attached to.
    DropDsrEgress,
    /// Longer than the MTU towards its next hop and not to be fragmented (IPv4 with
    /// don't-fragment, or IPv6): answered with the ICMP "fragmentation needed" or "packet
    /// too big" that quotes it as its sender sent it, out of the interface it came in on.
    TooBigAnswered,
    /// Such an answer could not be built once the frame had grown for it (the kernel gave
    /// less room than it said): dropped.
    DropTooBigAnswer,
    /// Such a packet, dropped unanswered: this CPU had used its allowance of answers
    /// (`Limit::TooBigAnswers`).
    DropTooBigLimited,
    /// A flow placed without its SYN that was not reported to the other gateways: this CPU
    /// had used its allowance of new flows' reports (`Limit::NewFlowReports`).
    SyncGuessLimited,
    /// A flow's open (its first acknowledgment after the SYN) that was not reported to the
    /// other gateways at once, for the same reason.
    SyncOpenLimited,
    /// An ICMP error about a flow's reply ("fragmentation needed", "packet too big",
    /// "destination unreachable"), sent to the VIP by a router on the client's side: sent on
    /// to the flow's backend, translated back as the reply was before (`icmp_errors.rs`).
    IcmpToBackend,
    /// An ICMP error about a client's packet, sent to the client by a router between the
    /// gateway and the flow's backend: its quote translated back to what the client sent
    /// (to the VIP), then to the stack, which routes it on to the client.
    IcmpToClient,
    /// A packet for a tunnel VIP (`VIP_F_TUNNEL`) sent to its backend inside an outer header.
    Encapsulated,
    /// A packet for a tunnel VIP whose next hop's MAC is not known yet: as for DSR, the
    /// stack cannot take it (it is addressed to the VIP), and the agent's checks and scrapes
    /// keep the next hop resolved.
    DropTunnelNoNeigh,
    /// A packet for a tunnel VIP longer, with the outer header, than the MTU towards the
    /// backend, that may be fragmented (IPv4 without don't-fragment); others are answered
    /// (`TooBigAnswered`) with the MTU less the outer header.
    DropTunnelTooBig,
    /// A packet for a tunnel VIP for which the FIB gave no forwarding answer.
    DropTunnelFibOther,
    /// A VLAN-tagged packet for a tunnel VIP: XDP cannot transmit on a VLAN device.
    DropTunnelVlan,
    /// A packet for a tunnel VIP whose next hop is out of an interface the program is not
    /// attached to.
    DropTunnelEgress,
    /// A packet for a tunnel VIP that the driver left no room in front of for the outer
    /// header.
    DropTunnelHeadroom,
}

/// Slots of the counters map: room for counters to come, so that a new one does not change
/// the shape of a pinned map (which would stop an agent upgrade from taking it over).
pub const COUNTER_SLOTS: u32 = 64;
const _: () = assert!(Counter::COUNT <= COUNTER_SLOTS);

impl Counter {
    pub const COUNT: u32 = Counter::DropTunnelHeadroom as u32 + 1;

    pub const ALL: [Counter; Counter::COUNT as usize] = [
        Counter::Packets,
        Counter::PassNotIp,
        Counter::PassNotTcp,
        Counter::PassTruncated,
        Counter::PassMalformed,
        Counter::PassIpOptions,
        Counter::PassFragment,
        Counter::PassIpv6ExtHeader,
        Counter::PassNotOurs,
        Counter::PassTtlExceeded,
        Counter::DropNoBackend,
        Counter::DropBadBackend,
        Counter::FlowNewSyn,
        Counter::FlowNewMidstream,
        Counter::FlowExpired,
        Counter::FlowReopened,
        Counter::FlowInsertFailed,
        Counter::Forward,
        Counter::Return,
        Counter::Tx,
        Counter::Redirect,
        Counter::PassNoNeigh,
        Counter::PassFibOther,
        Counter::PassTooBig,
        Counter::PassVlan,
        Counter::HintHome,
        Counter::HintWarm,
        Counter::HintMaglev,
        Counter::MaglevSecond,
        Counter::SyncLost,
        Counter::DropDsrRouted,
        Counter::DropDsrNoNeigh,
        Counter::DropDsrTooBig,
        Counter::DropDsrFibOther,
        Counter::DropDsrVlan,
        Counter::FibLookup,
        Counter::PassEgress,
        Counter::DropDsrEgress,
        Counter::TooBigAnswered,
        Counter::DropTooBigAnswer,
        Counter::DropTooBigLimited,
        Counter::SyncGuessLimited,
        Counter::SyncOpenLimited,
        Counter::IcmpToBackend,
        Counter::IcmpToClient,
        Counter::Encapsulated,
        Counter::DropTunnelNoNeigh,
        Counter::DropTunnelTooBig,
        Counter::DropTunnelFibOther,
        Counter::DropTunnelVlan,
        Counter::DropTunnelEgress,
        Counter::DropTunnelHeadroom,
    ];

    /// Stable snake_case name, used in the agent's metrics and CLI.
    pub const fn name(self) -> &'static str {
        match self {
            Counter::Packets => "packets",
            Counter::PassNotIp => "pass_not_ip",
            Counter::PassNotTcp => "pass_not_tcp",
            Counter::PassTruncated => "pass_truncated",
            Counter::PassMalformed => "pass_malformed",
            Counter::PassIpOptions => "pass_ip_options",
            Counter::PassFragment => "pass_fragment",
            Counter::PassIpv6ExtHeader => "pass_ipv6_ext_header",
            Counter::PassNotOurs => "pass_not_ours",
            Counter::PassTtlExceeded => "pass_ttl_exceeded",
            Counter::DropNoBackend => "drop_no_backend",
            Counter::DropBadBackend => "drop_bad_backend",
            Counter::FlowNewSyn => "flow_new_syn",
            Counter::FlowNewMidstream => "flow_new_midstream",
            Counter::FlowExpired => "flow_expired",
            Counter::FlowReopened => "flow_reopened",
            Counter::FlowInsertFailed => "flow_insert_failed",
            Counter::Forward => "forward",
            Counter::Return => "return",
            Counter::Tx => "xdp_tx",
            Counter::Redirect => "xdp_redirect",
            Counter::PassNoNeigh => "pass_no_neigh",
            Counter::PassFibOther => "pass_fib_other",
            Counter::PassTooBig => "pass_too_big",
            Counter::PassVlan => "pass_vlan",
            Counter::HintHome => "hint_home",
            Counter::HintWarm => "hint_warm",
            Counter::HintMaglev => "hint_maglev",
            Counter::MaglevSecond => "maglev_second",
            Counter::SyncLost => "sync_lost",
            Counter::DropDsrRouted => "drop_dsr_routed",
            Counter::DropDsrNoNeigh => "drop_dsr_no_neigh",
            Counter::DropDsrTooBig => "drop_dsr_too_big",
            Counter::DropDsrFibOther => "drop_dsr_fib_other",
            Counter::DropDsrVlan => "drop_dsr_vlan",
            Counter::FibLookup => "fib_lookup",
            Counter::PassEgress => "pass_egress",
            Counter::DropDsrEgress => "drop_dsr_egress",
            Counter::TooBigAnswered => "too_big_answered",
            Counter::DropTooBigAnswer => "drop_too_big_answer",
            Counter::DropTooBigLimited => "drop_too_big_limited",
            Counter::SyncGuessLimited => "sync_guess_limited",
            Counter::SyncOpenLimited => "sync_open_limited",
            Counter::IcmpToBackend => "icmp_to_backend",
            Counter::IcmpToClient => "icmp_to_client",
            Counter::Encapsulated => "encapsulated",
            Counter::DropTunnelNoNeigh => "drop_tunnel_no_neigh",
            Counter::DropTunnelTooBig => "drop_tunnel_too_big",
            Counter::DropTunnelFibOther => "drop_tunnel_fib_other",
            Counter::DropTunnelVlan => "drop_tunnel_vlan",
            Counter::DropTunnelEgress => "drop_tunnel_egress",
            Counter::DropTunnelHeadroom => "drop_tunnel_headroom",
        }
    }
}

/// A gateway that the decapsulating program (`decap`, on a backend) takes tunnelled packets
/// from: the outer source address, as `VipInfo::tunnel_src` of that gateway's VIPs.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct TunnelPeer {
    pub addr: [u32; 4],
    pub family: u8,
    pub _pad: [u8; 3],
}

/// Most gateways a backend's `decap` program takes packets from.
pub const MAX_TUNNEL_PEERS: u32 = 64;

/// What the decapsulating program did with each packet; one per-CPU counter each.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecapCounter {
    Packets = 0,
    /// An IPIP or IP6IP6 packet from a peer: its outer header taken off, the inner packet
    /// passed to the stack.
    Decapsulated,
    /// Not IPIP or IP6IP6 (or an outer header with options, a fragment, extension headers):
    /// passed untouched.
    PassNotTunnel,
    /// A tunnelled packet from a source not in `DECAP_PEERS`: passed untouched (the kernel
    /// drops it, or a tunnel device of its own takes it).
    PassNotPeer,
    /// Shorter than its headers say, or an inner packet of the other family: passed
    /// untouched.
    PassMalformed,
}

impl DecapCounter {
    pub const COUNT: u32 = DecapCounter::PassMalformed as u32 + 1;

    pub const ALL: [DecapCounter; DecapCounter::COUNT as usize] = [
        DecapCounter::Packets,
        DecapCounter::Decapsulated,
        DecapCounter::PassNotTunnel,
        DecapCounter::PassNotPeer,
        DecapCounter::PassMalformed,
    ];

    /// Stable snake_case name, as the CLI prints it.
    pub const fn name(self) -> &'static str {
        match self {
            DecapCounter::Packets => "packets",
            DecapCounter::Decapsulated => "decapsulated",
            DecapCounter::PassNotTunnel => "pass_not_tunnel",
            DecapCounter::PassNotPeer => "pass_not_peer",
            DecapCounter::PassMalformed => "pass_malformed",
        }
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are repr(C), made only of integers, with explicit padding fields,
    // so every bit pattern is valid and no byte is uninitialised.
    unsafe impl aya::Pod for super::VipKey {}
    unsafe impl aya::Pod for super::VipInfo {}
    unsafe impl aya::Pod for super::TunnelPeer {}
    unsafe impl aya::Pod for super::Backend {}
    unsafe impl aya::Pod for super::FlowKey {}
    unsafe impl aya::Pod for super::FlowEntry {}
    unsafe impl aya::Pod for super::ReplyKey {}
    unsafe impl aya::Pod for super::Replies {}
    unsafe impl aya::Pod for super::BackendStats {}
    unsafe impl aya::Pod for super::Bucket {}
    unsafe impl aya::Pod for super::BackendLoad {}
    unsafe impl aya::Pod for super::BucketStats {}
    unsafe impl aya::Pod for super::FlowEvent {}
    unsafe impl aya::Pod for super::Allowance {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    /// Each port's epoch lasts 2^30 ns, as the unshifted one does; over the ports, the
    /// changes spread across the whole epoch instead of one instant.
    #[test]
    fn reply_epochs_last_an_epoch_and_change_at_spread_instants() {
        const EPOCH: u64 = 1 << 30;
        let start = 1000 * EPOCH;
        let mut changes = [0u64; 66];
        for (i, port) in (0..=u16::MAX).step_by(997).enumerate() {
            // The one instant in this epoch at which the port's epoch changes.
            let at = (start..start + EPOCH)
                .step_by(1 << 14)
                .find(|&t| reply_epoch(t, port) != reply_epoch(t - (1 << 14), port))
                .expect("a change within an epoch");
            assert_eq!(reply_epoch(at + EPOCH - 1, port), reply_epoch(at, port));
            assert_eq!(reply_epoch(at + EPOCH, port), reply_epoch(at, port) + 1);
            changes[i] = at - start;
        }
        changes.sort_unstable();
        let widest_gap = changes.windows(2).map(|w| w[1] - w[0]).max().unwrap();
        assert!(changes[changes.len() - 1] - changes[0] > EPOCH / 10 * 9);
        assert!(widest_gap < EPOCH / 50, "{widest_gap}");
    }

    #[test]
    fn allowances_are_token_buckets() {
        const MS: u64 = 1_000_000;
        let now = 3_600_000 * MS;
        for limit in [Limit::TooBigAnswers, Limit::NewFlowReports] {
            let (per_s, burst) = limit.rate();
            let cost = 1000 * MS / per_s;
            let mut a = Allowance::default();
            let take = |a: &mut Allowance, n: u64, at: u64| {
                (0..n).filter(|_| a.take(limit, at)).count() as u64
            };
            // A CPU's first use finds a full burst.
            assert_eq!(take(&mut a, burst + 10, now), burst, "{limit:?}");
            // Then one per 1 / per_s.
            assert!(!a.take(limit, now + cost / 2));
            assert!(a.take(limit, now + cost));
            assert!(!a.take(limit, now + cost));
            assert_eq!(take(&mut a, 100, now + 11 * cost), 10, "{limit:?}");
            // Idle for long: the burst again, no more.
            let later = now + 3600 * 1000 * MS;
            assert_eq!(take(&mut a, burst + 10, later), burst, "{limit:?}");
            // A time from before the last (read before an interrupt that used some) earns
            // nothing, and does not move the clock back.
            assert!(!a.take(limit, now));
            assert!(!a.take(limit, later));
        }
    }

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<VipKey>(), 20);
        assert_eq!(size_of::<VipInfo>(), 44);
        assert_eq!(size_of::<TunnelPeer>(), 20);
        assert_eq!(size_of::<Bucket>(), 16);
        assert_eq!(size_of::<BackendLoad>(), 24);
        assert_eq!(size_of::<BucketStats>(), 48);
        assert_eq!(size_of::<Backend>(), 24);
        assert_eq!(size_of::<FlowKey>(), 40);
        assert_eq!(size_of::<FlowEntry>(), 96);
        assert_eq!(size_of::<NextHop>(), 24);
        assert_eq!(size_of::<Allowance>(), 16);
        assert_eq!(size_of::<BackendHop>(), 44);
        assert_eq!(size_of::<ReplyKey>(), 20);
        assert_eq!(size_of::<Replies>(), 80);
        assert_eq!(size_of::<BackendStats>(), 32);
        assert_eq!(size_of::<FlowEvent>(), 64);
    }

    /// A flow's time lags its last packet by up to a second (refreshed once a second): it
    /// expires a second past its timeout, never before its timeout since its last packet;
    /// and a time stored later than `now` (another CPU) is not idle at all.
    #[test]
    fn a_flow_expires_a_second_past_its_timeout() {
        const S: u64 = 1_000_000_000;
        let entry = |closed| FlowEntry {
            idle_timeout_s: 2,
            last_seen_ns: 100 * S,
            closed,
            ..Default::default()
        };
        let open = entry(0);
        for (now, expired) in [
            (50 * S, false),
            (102 * S, false),
            (103 * S, false),
            (103 * S + 1, true),
        ] {
            assert_eq!(open.expired_at(now), expired, "{now}");
            assert_eq!(open.live_at(now), !expired, "{now}");
        }
        assert!(!entry(1).live_at(100 * S));
    }

    #[test]
    fn addresses_come_back_from_their_words() {
        for ip in ["192.0.2.60", "10.4.0.11", "2001:db8::60", "fd00:4::11"] {
            let ip: core::net::IpAddr = ip.parse().unwrap();
            let (words, family) = addr_words(ip);
            assert_eq!(words_addr(words, family), Some(ip));
        }
        assert_eq!(words_addr([1, 0, 0, 0], 0), None);
    }

    #[test]
    fn counters_are_listed_once_in_order() {
        for (i, c) in Counter::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i);
        }
    }
}
