//! Every map of the program, one commented declaration each. The agent owns the
//! configuration's maps; the program writes only the flow table, its caches (`HOPS`,
//! `ALLOWANCES`), its counts (`COUNTERS`, `VIP_DROPS`, `BACKEND_STATS`, `OPENS`, `CLOSES`,
//! `BUCKET_STATS`) and the ring of shared flows (`FLOW_EVENTS`).

use aya_ebpf::{
    bindings::BPF_F_MMAPABLE,
    macros::map,
    maps::{Array, DevMapHash, HashMap, LruHashMap, PerCpuArray, RingBuf},
};
use balancer_common::{
    Allowance, Backend, BackendHop, BackendLoad, BackendStats, Bucket, BucketStats, Counter,
    FlowEntry, FlowKey, Limit, Replies, ReplyKey, VipInfo, VipKey, ALTERNATES_SLOTS, BUCKET_SLOTS,
    COUNTER_SLOTS, DEFAULT_FLOW_ENTRIES, FLOW_EVENTS_BYTES, MAGLEV_SIZE, MAGLEV_TABLES,
    MAX_BACKENDS, MAX_INTERFACES, MAX_VIPS,
};

/// VIP (address, port, protocol) -> its configuration. Traffic to anything else is not ours.
#[map]
pub static VIPS: HashMap<VipKey, VipInfo> = HashMap::with_max_entries(MAX_VIPS, 0);

/// Backend id -> address and port. Id 0 is reserved and never routed.
#[map]
pub static BACKENDS: Array<Backend> = Array::with_max_entries(MAX_BACKENDS, 0);

/// Maglev tables: `MAGLEV_TABLES` tables of `MAGLEV_SIZE` backend ids, two per VIP so the
/// agent can fill one while the other serves, then flip `VipInfo::table`. Mappable, so the
/// agent writes a table with memory stores rather than one syscall per slot; slots are u64
/// because a mappable array lays its elements out 8 bytes apart anyway.
#[map]
pub static MAGLEV: Array<u64> =
    Array::with_max_entries(MAGLEV_TABLES * MAGLEV_SIZE, BPF_F_MMAPABLE);

/// Alternates tables: `ALTERNATES_SIZE` backend ids per VIP (`vip_id * ALTERNATES_SIZE`),
/// every server that may take a connection by configured weight, saturated or not. Written
/// in place by the agent (mappable, like `MAGLEV`) when a server comes, goes, fails or drains:
/// a SYN that reads it mid-write gets an old or a new id, and an alternate is only taken when
/// it is present and has room.
#[map]
pub static ALTERNATES: Array<u64> = Array::with_max_entries(ALTERNATES_SLOTS, BPF_F_MMAPABLE);

/// Connection tracking: one entry per connection, keyed as the client sends (client -> VIP),
/// naming the backend; replies find it through `REPLIES`. One LRU shared by all CPUs, since
/// the two directions of a flow may be processed on different CPUs (and NICs). The agent
/// sizes it at load time.
#[map]
pub static FLOWS: LruHashMap<FlowKey, FlowEntry> =
    LruHashMap::with_max_entries(DEFAULT_FLOW_ENTRIES, 0);

/// Backend id -> the next hop towards it that a flow found on this CPU, for the other flows
/// to the same backend (`BackendHop`): most SYNs skip the FIB lookup, which costs about as
/// much as the rest of their work, and so do long flows once a second. Per CPU, so that no
/// writer races a reader.
#[map]
pub static HOPS: PerCpuArray<BackendHop> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// The interfaces the program is attached to (ifindex -> itself), the only ones it sends a
/// frame out of other than the one it came in on: another interface's driver may not
/// transmit frames from XDP (veth without XDP on its peer, drivers that set up their XDP
/// transmit rings only with a program of their own) and would drop them uncounted. A next
/// hop out of any other goes to the stack (`pass_egress`), or for DSR is dropped
/// (`drop_dsr_egress`). Written by the agent before it attaches to an interface.
#[map]
pub static EGRESS: DevMapHash = DevMapHash::with_max_entries(MAX_INTERFACES, 0);

/// The interfaces of `EGRESS` whose driver transmits frames in several buffers redirected
/// to it (`NETDEV_XDP_ACT_NDO_XMIT_SG`, which the agent reads from the kernel), the map a
/// frame in several buffers is redirected through. The kernel drops such a frame redirected
/// to any other, uncounted, after the program returned: towards one, it goes to the stack
/// (`pass_egress`), or for DSR is dropped (`drop_dsr_egress`).
#[map]
pub static EGRESS_FRAGS: DevMapHash = DevMapHash::with_max_entries(MAX_INTERFACES, 0);

/// Backend (address, port) -> the VIPs it serves. A packet from a backend is a reply of ours
/// if the flow `its destination -> one of these VIPs` names that backend; a packet from
/// anywhere else is not ours without a look at the flow table.
#[map]
pub static REPLIES: HashMap<ReplyKey, Replies> = HashMap::with_max_entries(MAX_BACKENDS, 0);

/// Per CPU and `Limit`: what it may still send unasked (`Allowance`).
#[map]
pub static ALLOWANCES: PerCpuArray<Allowance> = PerCpuArray::with_max_entries(Limit::COUNT, 0);

/// One counter per verdict and per pass or drop reason (`Counter`), per CPU.
#[map]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

/// Client packets to each VIP (by `VipInfo::vip_id`) that the program dropped, whatever the
/// reason (`COUNTERS` says which), per CPU: which pool a rise of `drop_*` is about.
#[map]
pub static VIP_DROPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(MAX_VIPS, 0);

/// Flows opened and closed, packets and bytes, per backend id and per CPU: the agent's fresh
/// picture of load between two scrapes of the servers' metrics.
#[map]
pub static BACKEND_STATS: PerCpuArray<BackendStats> =
    PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// Prefix-hint buckets of every VIP: home and warm alternates, written by the agent.
#[map]
pub static BUCKETS: Array<Bucket> = Array::with_max_entries(BUCKET_SLOTS, 0);

/// New connections each backend may still take before it is past its spill threshold,
/// written by the agent every time it folds in fresh metrics. This map and the next three are
/// mappable: the agent reads and writes them with memory accesses, not a syscall per value,
/// several times per scrape interval for every server and bucket.
#[map]
pub static LOAD: Array<BackendLoad> = Array::with_max_entries(MAX_BACKENDS, BPF_F_MMAPABLE);

/// New connections per backend, shared by all CPUs (atomic adds), so that a spill decision
/// on one CPU sees the connections opened on the others since the agent's last `LOAD`.
#[map]
pub static OPENS: Array<u64> = Array::with_max_entries(MAX_BACKENDS, BPF_F_MMAPABLE);

/// Connections closed (see `FlowEntry::closed`) per backend, shared like `OPENS`: a connection that
/// ended gives its room back before the agent's next update.
#[map]
pub static CLOSES: Array<u64> = Array::with_max_entries(MAX_BACKENDS, BPF_F_MMAPABLE);

/// Per hint bucket: hinted SYNs, spills, and picks per candidate place (atomic adds: SYNs
/// only, so sharing the line across CPUs is cheap); the agent reads them to log spills and to
/// drop alternates nobody uses any more.
#[map]
pub static BUCKET_STATS: Array<BucketStats> = Array::with_max_entries(BUCKET_SLOTS, BPF_F_MMAPABLE);

/// New flows, closes and keepalives of the VIPs whose agent shares their flows with other
/// gateways (`VIP_F_SYNC`), as `FlowEvent`s. Written without a wakeup: the agent drains it on
/// a short timer, which costs a SYN less than waking a reader for every event would.
#[map]
pub static FLOW_EVENTS: RingBuf = RingBuf::with_byte_size(FLOW_EVENTS_BYTES, 0);

#[inline(always)]
pub fn count(c: Counter) {
    if let Some(v) = COUNTERS.get_ptr_mut(c as u32) {
        // SAFETY: per-CPU value; nothing else writes it while this program runs on this CPU.
        unsafe { *v += 1 };
    }
}

/// One more client packet to VIP `vip_id` dropped.
#[inline(always)]
pub fn count_vip_drop(vip_id: u32) {
    if let Some(v) = VIP_DROPS.get_ptr_mut(vip_id) {
        // SAFETY: per-CPU value; nothing else writes it while this program runs on this CPU.
        unsafe { *v += 1 };
    }
}

/// Whether this CPU may do what `limit` limits once more, now.
#[inline(always)]
pub fn allowed(limit: Limit, now: u64) -> bool {
    match ALLOWANCES.get_ptr_mut(limit as u32) {
        // SAFETY: per-CPU value; nothing else writes it while this program runs on this CPU.
        Some(a) => unsafe { (*a).take(limit, now) },
        None => false,
    }
}
