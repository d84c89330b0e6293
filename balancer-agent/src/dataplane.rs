//! The loaded XDP program and its maps: load, attach, write a plan, read the counters.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    mem::size_of,
    ops::ControlFlow,
    os::fd::{AsFd, AsRawFd},
    ptr::NonNull,
    sync::{
        atomic::{AtomicU64, Ordering},
        PoisonError,
    },
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{
        Array, DevMapHash, HashMap as BpfHashMap, Map, MapData, MapError, PerCpuArray,
        PerCpuValues, RingBuf,
    },
    programs::{
        links::{FdLink, PinnedLink},
        xdp::{XdpLink, XdpLinkId},
        ProgramError, Xdp, XdpMode,
    },
    Ebpf, EbpfLoader,
};
use aya_obj::generated::BPF_NOEXIST;
use balancer_common::{
    bucket_slot, hint::HintRange, sync_epoch, Allowance, Backend, BackendLoad, BackendStats,
    Bucket, BucketStats, Counter, FlowEntry, FlowKey, Limit, NextHop, Replies, ReplyKey, VipInfo,
    VipKey, ALTERNATES_SIZE, ALTERNATES_SLOTS, BACKEND_F_RETIRED, BUCKET_SLOTS, FLOW_ACKED,
    LOAD_F_HELD, MAGLEV_SIZE, MAGLEV_TABLES, MAX_BACKENDS, VIP_F_DSR, VIP_F_SYNC, VIP_F_TUNNEL,
};
use tracing::{info, warn};

use crate::{
    config,
    control::InterfaceRow,
    map_ops, objects,
    pins::Pins,
    plan::Plan,
    sync::Kind,
    xdp_features::{self, Netdev},
};

/// A `BPF_F_MMAPABLE` array of u64 slots mapped into our memory, so that a table of
/// thousands of slots is written with stores instead of a syscall per slot.
struct MappedSlots {
    ptr: NonNull<u64>,
    len: usize,
    // Keeps the map alive as long as the mapping.
    _map: MapData,
}

impl MappedSlots {
    fn new(map: Map, name: &str, len: u32) -> Result<Self> {
        let Map::Array(data) = map else {
            bail!("{name} is not an array map");
        };
        let len = len as usize;
        let bytes = len * std::mem::size_of::<u64>();
        // SAFETY: mapping a BPF array fd read-write, shared, for its exact size; checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                data.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("mmap of the {name} map"));
        }
        Ok(MappedSlots {
            ptr: NonNull::new(ptr.cast()).context("mmap returned null")?,
            len,
            _map: data,
        })
    }

    /// The slots as counters the program updates under us: atomics, so that every read is
    /// a real load.
    fn shared(&self) -> &[AtomicU64] {
        // SAFETY: as in `table`; AtomicU64 has the layout of u64, and the kernel's writes
        // to these slots are single aligned stores or atomic adds.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<AtomicU64>(), self.len) }
    }

    /// Slots `index * size ..` of `size` slots.
    fn table(&mut self, index: u32, size: u32) -> &mut [u64] {
        let start = (index * size) as usize;
        // SAFETY: the mapping covers `len` u64s; the slice below is bounds-checked against
        // it. The program only reads these maps, and the agent is their only writer.
        let all = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) };
        &mut all[start..start + size as usize]
    }
}

impl Drop for MappedSlots {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `new` mapped.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len * 8) };
    }
}

// SAFETY: the mapping is plain shared memory owned by this struct.
unsafe impl Send for MappedSlots {}

/// u64 slots per `BackendLoad` and per `BucketStats` in their mapped arrays.
const LOAD_SLOTS: u32 = (size_of::<BackendLoad>() / 8) as u32;
const BUCKET_STAT_SLOTS: u32 = (size_of::<BucketStats>() / 8) as u32;

/// Writes `ids` into `slots`, touching only the slots that change.
fn write_table(slots: &mut [u64], ids: &[u32]) {
    for (slot, id) in slots.iter_mut().zip(ids) {
        if *slot != u64::from(*id) {
            *slot = u64::from(*id);
        }
    }
}

/// Every CPU's allowance under every `Limit` (see [`Dataplane::allowances`]).
pub struct Allowances(PerCpuArray<MapData, Allowance>);

impl Allowances {
    /// Gives every CPU its whole allowance again, as after a quiet second.
    pub fn refill(&mut self) -> Result<()> {
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
        for limit in 0..Limit::COUNT {
            // Zero is full: the credit earned since time 0 is capped at a burst.
            let full = PerCpuValues::try_from(vec![Allowance::default(); cpus])?;
            self.0.set(limit, full, 0)?;
        }
        Ok(())
    }
}

/// The program's shared counts of one backend's connections (`OPENS`, `CLOSES`) at one
/// moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadCounts {
    pub opened: u64,
    pub closed: u64,
}

/// The ids an earlier agent wrote into maps it pinned.
pub struct Inherited {
    /// Each VIP and what its entry held.
    pub vips: Vec<(VipKey, VipInfo)>,
    /// Every backend entry in use, by id.
    pub backends: Vec<(u32, Backend)>,
}

pub struct Dataplane {
    ebpf: Ebpf,
    vips: BpfHashMap<MapData, VipKey, VipInfo>,
    backends: Array<MapData, Backend>,
    maglev: MappedSlots,
    alternates: MappedSlots,
    counters: PerCpuArray<MapData, u64>,
    vip_drops: PerCpuArray<MapData, u64>,
    backend_stats: PerCpuArray<MapData, BackendStats>,
    flows: BpfHashMap<MapData, FlowKey, FlowEntry>,
    /// The flow table's id, for a handle of its own (`sync::live_flows`).
    flows_id: u32,
    replies: BpfHashMap<MapData, ReplyKey, Replies>,
    /// The interfaces the program may send frames out of.
    egress: DevMapHash<MapData>,
    /// Those of them whose driver transmits frames in several buffers (`EGRESS_FRAGS`).
    egress_frags: DevMapHash<MapData>,
    /// What [`Dataplane::note_multi_buffer`] last said of each interface index.
    multi_buffer: HashMap<u32, bool>,
    /// Asking the kernel for drivers' XDP features failed last time (said once a streak).
    multi_buffer_failing: bool,
    /// The socket that asks the kernel which drivers transmit frames in several buffers,
    /// kept between the relinks' questions (once a second); made again after a failure.
    netdev: Option<Netdev>,
    buckets: Array<MapData, Bucket>,
    /// `BackendLoad` per backend: three slots each.
    load: MappedSlots,
    opens: MappedSlots,
    closes: MappedSlots,
    /// `BucketStats` per bucket slot: `BUCKET_STAT_SLOTS` slots each.
    bucket_stats: MappedSlots,
    /// The program's reports of shared flows, until the sync sender takes it.
    flow_events: Option<RingBuf<MapData>>,
    /// Per backend id: connections this gateway opened whose close a peer reported (or that
    /// a peer's new connection on the tuple replaced), which the program never counted.
    /// Agent memory: a takeover starts it afresh.
    closed_elsewhere: HashMap<u32, u64>,
    /// What each VIP id's entry holds now, and under which key.
    installed: HashMap<u32, (VipKey, VipInfo)>,
    /// What `REPLIES` holds now.
    installed_replies: HashMap<ReplyKey, Replies>,
    links: BTreeMap<String, Attached>,
    /// Attached interfaces found gone by [`Dataplane::relink`], said once.
    gone: BTreeSet<String>,
    /// Interfaces [`Dataplane::relink`] found created again and has not attached to yet,
    /// with their new index.
    relinking: BTreeMap<String, u32>,
    /// `agent.xdp_mode`.
    xdp_mode: config::XdpMode,
    /// Interfaces whose pinned link this agent took over from an earlier one.
    taken_over: HashSet<String>,
    /// Where maps and links are pinned, if they are (`agent.pin_dir`).
    pins: Option<Pins>,
    /// The maps came from an earlier agent's pins.
    inherited: bool,
    /// What `EGRESS` and `EGRESS_FRAGS` held when the maps were opened: a start that fails
    /// puts them back.
    egress_at_load: HashSet<u32>,
    egress_frags_at_load: HashSet<u32>,
}

/// The program's link on an interface, and the index the interface had then: an interface
/// deleted and created again under its name has another, and not the program.
struct Attached {
    link: XdpLinkId,
    ifindex: u32,
    /// In generic mode (`None`: not known, a link taken over whose mode the kernel did not
    /// say; counted as native).
    generic: Option<bool>,
}

/// The index of interface `name` (of `agent.interfaces`) in the agent's network namespace.
pub fn interface_index(name: &str) -> Result<u32> {
    let c = std::ffi::CString::new(name).context("interface name")?;
    // SAFETY: a NUL-terminated string that outlives the call.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => bail!("agent.interfaces: no interface named {name:?}"),
        index => Ok(index),
    }
}

fn take(ebpf: &mut Ebpf, name: &str) -> Result<Map> {
    ebpf.take_map(name)
        .ok_or_else(|| anyhow!("the program has no map {name}"))
}

impl Dataplane {
    /// Loads the program and creates its maps (the flow table with `flow_entries` entries),
    /// or, with `pins` holding an earlier agent's maps, opens those.
    pub fn load(flow_entries: u32, pins: Option<Pins>) -> Result<Self> {
        let inherited = match &pins {
            Some(p) => p.inherited()?,
            None => false,
        };
        let paths = pins.as_ref().map(Pins::map_paths).unwrap_or_default();
        let mut loader = EbpfLoader::new();
        loader.map_max_entries("FLOWS", flow_entries);
        for (name, path) in &paths {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader
            .load(objects::BALANCER)
            .context("loading the XDP object")?;
        let prog: &mut Xdp = ebpf
            .program_mut("balancer")
            .context("the object has no program `balancer`")?
            .try_into()?;
        prog.load().context("the kernel refused the XDP program")?;
        let vips = BpfHashMap::try_from(take(&mut ebpf, "VIPS")?)?;
        let backends = Array::try_from(take(&mut ebpf, "BACKENDS")?)?;
        let maglev = MappedSlots::new(
            take(&mut ebpf, "MAGLEV")?,
            "MAGLEV",
            MAGLEV_TABLES * MAGLEV_SIZE,
        )?;
        let alternates = MappedSlots::new(
            take(&mut ebpf, "ALTERNATES")?,
            "ALTERNATES",
            ALTERNATES_SLOTS,
        )?;
        let counters = PerCpuArray::try_from(take(&mut ebpf, "COUNTERS")?)?;
        let vip_drops = PerCpuArray::try_from(take(&mut ebpf, "VIP_DROPS")?)?;
        let backend_stats = PerCpuArray::try_from(take(&mut ebpf, "BACKEND_STATS")?)?;
        let flows = take(&mut ebpf, "FLOWS")?;
        let flows_id = match &flows {
            Map::LruHashMap(data) => data.info()?.id(),
            _ => bail!("FLOWS is not an LRU hash map"),
        };
        let flows = BpfHashMap::try_from(flows)?;
        let replies = BpfHashMap::try_from(take(&mut ebpf, "REPLIES")?)?;
        let egress = DevMapHash::try_from(take(&mut ebpf, "EGRESS")?)?;
        let egress_at_load = egress.keys().filter_map(Result::ok).collect();
        let egress_frags = DevMapHash::try_from(take(&mut ebpf, "EGRESS_FRAGS")?)?;
        let egress_frags_at_load = egress_frags.keys().filter_map(Result::ok).collect();
        let buckets = Array::try_from(take(&mut ebpf, "BUCKETS")?)?;
        let load = MappedSlots::new(take(&mut ebpf, "LOAD")?, "LOAD", MAX_BACKENDS * LOAD_SLOTS)?;
        let opens = MappedSlots::new(take(&mut ebpf, "OPENS")?, "OPENS", MAX_BACKENDS)?;
        let closes = MappedSlots::new(take(&mut ebpf, "CLOSES")?, "CLOSES", MAX_BACKENDS)?;
        let bucket_stats = MappedSlots::new(
            take(&mut ebpf, "BUCKET_STATS")?,
            "BUCKET_STATS",
            BUCKET_SLOTS * BUCKET_STAT_SLOTS,
        )?;
        let flow_events = Some(RingBuf::try_from(take(&mut ebpf, "FLOW_EVENTS")?)?);
        let mut dp = Dataplane {
            ebpf,
            vips,
            backends,
            maglev,
            alternates,
            counters,
            vip_drops,
            backend_stats,
            flows,
            flows_id,
            replies,
            egress,
            egress_frags,
            multi_buffer: HashMap::new(),
            multi_buffer_failing: false,
            netdev: None,
            buckets,
            load,
            opens,
            closes,
            bucket_stats,
            flow_events,
            closed_elsewhere: HashMap::new(),
            installed: HashMap::new(),
            installed_replies: HashMap::new(),
            links: BTreeMap::new(),
            gone: BTreeSet::new(),
            relinking: BTreeMap::new(),
            xdp_mode: config::XdpMode::Auto,
            taken_over: HashSet::new(),
            pins,
            inherited,
            egress_at_load,
            egress_frags_at_load,
        };
        if inherited {
            // The next plan flips each VIP to the table the program is not reading.
            for item in dp.vips.iter() {
                let (key, info) = item.context("reading the pinned VIPs")?;
                dp.installed.insert(info.vip_id, (key, info));
            }
            // Entries the first plan lacks are stale: replies of retired servers' flows are
            // in the plan, from the recovered quarantine.
            for item in dp.replies.iter() {
                let (from, vips) = item.context("reading the pinned replies")?;
                dp.installed_replies.insert(from, vips);
            }
            if let Some(p) = &dp.pins {
                info!(dir = %p.dir().display(), vips = dp.installed.len(), "took over the pinned maps");
            }
        }
        Ok(dp)
    }

    /// What an earlier agent left in the pinned maps. None when the maps are new.
    pub fn inherited(&self) -> Result<Option<Inherited>> {
        if !self.inherited {
            return Ok(None);
        }
        let vips = self.installed.values().copied().collect();
        let mut backends = Vec::new();
        for id in 1..MAX_BACKENDS {
            let b = self
                .backends
                .get(&id, 0)
                .context("reading the pinned backends")?;
            if b != Backend::default() {
                backends.push((id, b));
            }
        }
        Ok(Some(Inherited { vips, backends }))
    }

    /// The program itself, for attaching elsewhere or for BPF_PROG_TEST_RUN.
    pub fn program(&mut self) -> &mut Xdp {
        self.ebpf
            .program_mut("balancer")
            .and_then(|p| p.try_into().ok())
            .expect("checked at load")
    }

    /// Makes the maps hold `plan`. New flows see either the old or the new table of a VIP,
    /// never a mix: backends are written first, then the VIP's idle table, then the VIP entry
    /// flips to it in one map update. Established flows follow their flow entries and are
    /// not touched.
    pub fn apply(&mut self, plan: &Plan) -> Result<()> {
        // Free again; an id reused by this very plan is written just below.
        for id in &plan.released {
            self.backends
                .set(*id, Backend::default(), 0)
                .with_context(|| format!("releasing backend {id}"))?;
        }
        for (id, backend) in &plan.backends {
            self.backends
                .set(*id, backend, 0)
                .with_context(|| format!("writing backend {id}"))?;
        }
        // Before any table names a backend, so that its first reply is recognised.
        for (from, vips) in &plan.replies {
            if self.installed_replies.get(from) != Some(vips) {
                self.replies
                    .insert(from, vips, 0)
                    .context("writing the VIPs a backend replies for")?;
                self.installed_replies.insert(*from, *vips);
            }
        }
        // VIPs that leave the map go first: it holds at most `MAX_VIPS`, as many as a plan,
        // so the plan's new keys always fit. A key is removed only when no VIP of the plan
        // has it: a pool renamed, or two pools that swap VIPs, hand a key to another id.
        let keys: HashSet<VipKey> = plan.vips.iter().map(|v| v.key).collect();
        let leaving: HashSet<VipKey> = self
            .installed
            .values()
            .map(|(key, _)| *key)
            .filter(|key| !keys.contains(key))
            .collect();
        for key in leaving {
            self.vips.remove(&key).context("removing a VIP")?;
        }
        self.installed
            .retain(|id, _| plan.vips.iter().any(|v| v.vip_id == *id));
        for vip in &plan.vips {
            let installed = self.installed.get(&vip.vip_id).copied();
            let active = installed.map(|(_, info)| info.table);
            let unchanged = active.is_some_and(|t| {
                self.maglev
                    .table(t, MAGLEV_SIZE)
                    .iter()
                    .zip(&vip.table)
                    .all(|(slot, id)| *slot == u64::from(*id))
            });
            // Alternates are written in place: see `ALTERNATES` in the program's maps.
            write_table(
                self.alternates.table(vip.vip_id, ALTERNATES_SIZE),
                &vip.alternates,
            );
            let table = match active {
                Some(t) if unchanged => t,
                // The other table of this VIP's pair.
                Some(t) => t ^ 1,
                None => vip.vip_id * 2,
            };
            if !unchanged {
                write_table(self.maglev.table(table, MAGLEV_SIZE), &vip.table);
            }
            let hint = vip.hint.unwrap_or(HintRange {
                start: 0,
                span: 0,
                buckets: 0,
            });
            let info = VipInfo {
                vip_id: vip.vip_id,
                table,
                idle_timeout_s: vip.idle_timeout_s,
                live_backends: vip.live_backends,
                hint_start: hint.start,
                hint_span: hint.span,
                hint_buckets: hint.buckets,
                flags: if vip.shared { VIP_F_SYNC } else { 0 }
                    | match vip.forwarding {
                        config::Forwarding::Nat => 0,
                        config::Forwarding::Dsr => VIP_F_DSR,
                        config::Forwarding::Tunnel => VIP_F_DSR | VIP_F_TUNNEL,
                    },
                tunnel_src: vip.tunnel_src,
                tunnel_mask: if vip.forwarding == config::Forwarding::Tunnel {
                    u32::MAX
                } else {
                    0
                },
            };
            if installed.is_none_or(|(key, _)| key != vip.key) {
                // The id's count was another VIP's, or the VIP is new to the map (an agent
                // that takes the maps over keeps the count of every VIP they had).
                let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
                self.vip_drops
                    .set(vip.vip_id, PerCpuValues::try_from(vec![0u64; cpus])?, 0)
                    .with_context(|| format!("zeroing the drop count of pool {}", vip.pool))?;
            }
            if installed != Some((vip.key, info)) {
                self.vips
                    .insert(vip.key, info, 0)
                    .with_context(|| format!("writing the VIP of pool {}", vip.pool))?;
                self.installed.insert(vip.vip_id, (vip.key, info));
            }
        }
        // After the flips no table names a retired backend. Its established flows keep
        // their cached address; its counters stay until the id is reused. The entry keeps
        // its address and VIP, marked retired, for an agent that takes these maps over.
        for id in &plan.retired {
            let mut b = self.backends.get(id, 0).unwrap_or_default();
            b.flags = BACKEND_F_RETIRED;
            self.backends
                .set(*id, b, 0)
                .with_context(|| format!("retiring backend {id}"))?;
        }
        let stale: Vec<ReplyKey> = self
            .installed_replies
            .keys()
            .filter(|k| !plan.replies.iter().any(|(from, _)| from == *k))
            .copied()
            .collect();
        for from in stale {
            self.replies
                .remove(&from)
                .context("removing a backend's replies")?;
            self.installed_replies.remove(&from);
        }
        Ok(())
    }

    /// Attaches to exactly `interfaces`: new ones are attached, others detached.
    pub fn attach(&mut self, interfaces: &[String]) -> Result<()> {
        self.attach_more(interfaces)?;
        self.keep_only(interfaces)
    }

    /// Attaches to those of `interfaces` the program is not on yet, and leaves the others
    /// as they are: the first half of a change of interfaces, which `keep_only` with the
    /// old list undoes. Native mode first; generic (skb) mode when the driver has no XDP
    /// support. With pins, an interface whose link an earlier agent pinned gets this program
    /// swapped into that link, and a new link is pinned.
    pub fn attach_more(&mut self, interfaces: &[String]) -> Result<()> {
        // Before the program runs anywhere: its redirects may go to these.
        self.allow_egress(interfaces)?;
        for name in interfaces {
            let ifindex = interface_index(name)?;
            // The name may be another interface's now (deleted and created again, or renamed
            // and replaced): the link we have, and its pin, are the old interface's. The
            // link stays listed until a new one replaces it, so that a failed attach is
            // retried.
            let replaced = match self.links.get(name) {
                Some(a) if a.ifindex == ifindex => continue,
                Some(_) => true,
                None => false,
            };
            let pinned = self.pins.as_ref().map(|p| p.link(name));
            let link = match pinned.filter(|p| p.exists()) {
                Some(_) if replaced => {
                    if let Some(pins) = &self.pins {
                        pins.unpin_link(name)?;
                    }
                    self.attach_new(name)?
                }
                Some(pin) => match self.take_over(&pin) {
                    Ok(link) => {
                        info!(interface = %name, "took over the pinned link");
                        self.taken_over.insert(name.clone());
                        let generic = xdp_features::attached_generic(ifindex)
                            .inspect_err(|e| warn!(interface = %name, "its link's XDP mode: {e:#}; counted as native"));
                        (link, generic.ok().flatten())
                    }
                    Err(e) if defunct(&e) => {
                        // Its interface went away since: the link is of no use any more.
                        warn!(interface = %name, "the pinned link {} is defunct ({e:#}); attaching anew", pin.display());
                        if let Some(pins) = &self.pins {
                            pins.unpin_link(name)?;
                        }
                        self.attach_new(name)?
                    }
                    // Anything else leaves the link, and the program in it, as it is.
                    Err(e) => {
                        return Err(
                            e.context(format!("taking over the link pinned at {}", pin.display()))
                        )
                    }
                },
                None => self.attach_new(name)?,
            };
            let (link, generic) = link;
            let attached = Attached {
                link,
                ifindex,
                generic,
            };
            if let Some(old) = self.links.insert(name.clone(), attached) {
                // Defunct with its deleted interface, or still on a renamed one, which the
                // configuration no longer names: either way it goes.
                self.program().detach(old.link).ok();
            }
        }
        Ok(())
    }

    /// Attaches again to the interfaces that were deleted and created again under their
    /// names since the program was attached (a veth or VLAN set up again, a bond rebuilt, a
    /// driver reloaded): the kernel detached it from the old ones, and traffic to the VIPs
    /// on the new ones would go to the stack. One that is gone waits for its return.
    pub fn relink(&mut self) -> Result<()> {
        let mut present = Vec::new();
        let mut indexes = Vec::new();
        let mut moved = Vec::new();
        for (name, a) in &self.links {
            match interface_index(name) {
                Ok(index) => {
                    present.push(name.clone());
                    // One created again is asked about once it is in `EGRESS` again.
                    if index == a.ifindex {
                        indexes.push((name.clone(), index));
                    } else {
                        moved.push((name.clone(), index));
                    }
                    if self.gone.remove(name) {
                        info!(interface = %name, "the interface is back");
                    }
                }
                Err(_) => {
                    if self.gone.insert(name.clone()) {
                        warn!(interface = %name, "the interface is gone; the program goes back on it when it returns");
                    }
                }
            }
        }
        self.note_multi_buffer(&indexes);
        if moved.is_empty() {
            return Ok(());
        }
        // Each on its own, so that one that keeps failing does not hold the others back.
        let mut failed = Vec::new();
        for (name, index) in moved {
            // Said once for each new interface, however many tries it takes.
            if self.relinking.insert(name.clone(), index) != Some(index) {
                warn!(interface = %name, index, "the interface was created again; attaching anew");
            }
            match self.attach_more(std::slice::from_ref(&name)) {
                Ok(()) => {
                    self.relinking.remove(&name);
                }
                Err(e) => failed.push(format!("{name}: {e:#}")),
            }
        }
        self.set_egress(&present)?;
        if !failed.is_empty() {
            bail!("{}", failed.join("; "));
        }
        Ok(())
    }

    /// Detaches from every interface not in `interfaces`, and sends out of those only.
    pub fn keep_only(&mut self, interfaces: &[String]) -> Result<()> {
        let stale: Vec<String> = self
            .links
            .keys()
            .filter(|n| !interfaces.contains(n))
            .cloned()
            .collect();
        // Each on its own: one that cannot be left does not keep the others attached.
        let failed: Vec<String> = (stale.iter())
            .filter_map(|name| self.detach_one(name).err())
            .map(|e| format!("{e:#}"))
            .collect();
        self.set_egress(interfaces)?;
        if !failed.is_empty() {
            bail!("{}", failed.join("; "));
        }
        Ok(())
    }

    /// The interfaces the program is attached to, as `balancer-agent interfaces` shows them.
    pub fn interfaces(&self) -> Vec<InterfaceRow> {
        let row = |(name, a): (&String, &Attached)| {
            let state = if self.gone.contains(name) {
                "gone"
            } else if self.relinking.contains_key(name) {
                "created again"
            } else {
                "attached"
            };
            InterfaceRow {
                interface: name.clone(),
                ifindex: a.ifindex,
                mode: match a.generic {
                    Some(true) => "generic",
                    Some(false) => "native",
                    None => "unknown",
                }
                .into(),
                taken_over: self.taken_over.contains(name),
                mtu: interface_mtu(name),
                multi_buffer_tx: self.egress_frags.get(a.ifindex, 0).is_ok(),
                state: state.into(),
            }
        };
        self.links.iter().map(row).collect()
    }

    /// Makes `interfaces` the only ones the program sends frames out of, other than the one
    /// a frame came in on (`EGRESS`).
    pub fn set_egress(&mut self, interfaces: &[String]) -> Result<()> {
        let wanted = self.allow_egress(interfaces)?;
        // `EGRESS_FRAGS` first: it never holds an interface `EGRESS` does not.
        self.multi_buffer.retain(|i, _| wanted.contains(i));
        egress_only(&mut self.egress_frags, &wanted)?;
        egress_only(&mut self.egress, &wanted)
    }

    /// Lets the program send out of `interfaces`, besides those it may already; returns
    /// their indexes.
    fn allow_egress(&mut self, interfaces: &[String]) -> Result<HashSet<u32>> {
        let mut indexes = HashSet::new();
        let mut named = Vec::new();
        for name in interfaces {
            let index = interface_index(name)?;
            indexes.insert(index);
            named.push((name.clone(), index));
            self.egress
                .insert(index, index, None, 0)
                .with_context(|| format!("letting the program send out of {name}"))?;
        }
        self.note_multi_buffer(&named);
        Ok(indexes)
    }

    /// Records which of `interfaces` (name, index) a frame in several buffers may be
    /// redirected to (`EGRESS_FRAGS`): those whose driver transmits such frames, as the
    /// kernel says now (veth does once its peer has an XDP program, and other drivers may
    /// change with their settings, so [`Dataplane::relink`] asks again every second), and
    /// every one where the program runs only in generic mode, whose redirects go through the
    /// stack's queues. Where the kernel cannot say (before 6.3), none is, and jumbo frames
    /// towards them take the stack. An interface whose answer fails keeps its entry.
    fn note_multi_buffer(&mut self, interfaces: &[(String, u32)]) {
        if interfaces.is_empty() {
            return;
        }
        // Before the first attach, the configured mode, unless an earlier agent's links
        // run (in the mode they had); a link whose mode is not known counts as native,
        // which only costs speed where assuming generic could lose frames.
        let generic_only = match self.links.is_empty() {
            true => self.xdp_mode == config::XdpMode::Generic && !self.inherited,
            false => self.links.values().all(|a| a.generic == Some(true)),
        };
        // `None`: no need to ask. The socket asked last time, kept unless something failed.
        let mut netdev = (!generic_only).then(|| self.netdev.take().map_or_else(Netdev::open, Ok));
        let mut failed = None;
        for (name, index) in interfaces {
            let takes = match &mut netdev {
                None => Ok(true),
                Some(Ok(netdev)) => netdev.transmits_multi_buffer(*index),
                Some(Err(e)) => Err(anyhow!("{e:#}")),
            };
            let written = takes.and_then(|takes| {
                let has = self.egress_frags.get(*index, 0).is_ok();
                match (takes, has) {
                    (true, false) => self.egress_frags.insert(*index, *index, None, 0)?,
                    (false, true) => self.egress_frags.remove(*index)?,
                    _ => {}
                }
                Ok(takes)
            });
            let takes = match written {
                Ok(takes) => takes,
                Err(e) => {
                    failed.get_or_insert(e.context(format!("interface {name}")));
                    continue;
                }
            };
            let before = self.multi_buffer.insert(*index, takes);
            match (takes, before) {
                (_, Some(b)) if b == takes => {}
                (true, None) if generic_only => {}
                (true, _) if generic_only => {
                    info!(interface = %name, "the program runs in generic mode everywhere, whose redirects take frames in several buffers: jumbo frames towards it are redirected")
                }
                (true, _) => {
                    info!(interface = %name, "its driver transmits frames in several buffers from XDP: jumbo frames towards it are redirected")
                }
                (false, Some(_)) => {
                    warn!(interface = %name, "frames in several buffers are no longer redirected to it (its driver does not transmit them from XDP, or the kernel cannot say): jumbo frames towards it take the stack")
                }
                (false, None) if interface_mtu(name).is_some_and(|mtu| mtu > 1500) => {
                    warn!(interface = %name, "its driver does not transmit frames in several buffers from XDP (NETDEV_XDP_ACT_NDO_XMIT_SG), or the kernel cannot say: jumbo frames towards it take the stack")
                }
                (false, None) => {}
            }
        }
        match failed {
            None => {
                self.multi_buffer_failing = false;
                self.netdev = netdev.and_then(Result::ok);
            }
            Some(e) => {
                if !std::mem::replace(&mut self.multi_buffer_failing, true) {
                    warn!("asking the kernel which drivers transmit frames in several buffers from XDP: {e:#}; asked again every second");
                }
            }
        }
    }

    /// A new link on interface `name`, and whether it is in generic mode.
    fn attach_new(&mut self, name: &str) -> Result<(XdpLinkId, Option<bool>)> {
        let pin = self.pins.as_ref().map(|p| p.link(name));
        let mut generic = false;
        let attached = match self.xdp_mode {
            config::XdpMode::Native => match self.program().attach(name, XdpMode::Driver) {
                Ok(link) => Ok(link),
                Err(e) => {
                    let hint = mtu_hint(name, &e, ", or use agent.xdp_mode = \"generic\"");
                    Err(anyhow::Error::from(e).context(format!(
                        "attaching to {name} in native mode (agent.xdp_mode){hint}"
                    )))
                }
            },
            config::XdpMode::Generic => {
                generic = true;
                self.attach_generic(name, None)
            }
            config::XdpMode::Auto => match self.program().attach(name, XdpMode::Driver) {
                Ok(link) => Ok(link),
                Err(native) => {
                    generic = true;
                    self.attach_generic(name, Some(native))
                }
            },
        };
        let mut link = attached.map_err(|e| held_elsewhere(name, e))?;
        let prog = self.program();
        if let Some(pin) = pin {
            // Pinning needs the link's fd out of the program's keeping; it goes back in
            // through `attach_to_link`, which swaps in the program it already runs.
            let fd = FdLink::try_from(prog.take_link(link)?)
                .context("pinning needs a bpf_link (kernel 5.9 or later)")?;
            let pinned = fd
                .pin(&pin)
                .with_context(|| format!("pinning the link of {name} at {}", pin.display()))?;
            link = prog.attach_to_link(XdpLink::try_from(FdLink::from(pinned))?)?;
        }
        info!(interface = %name, "attached");
        // This agent's own link, whatever was on the interface's name before.
        self.taken_over.remove(name);
        Ok((link, Some(generic)))
    }

    /// Attaches in generic mode; `native` says why native mode was not used, if it was
    /// tried. (The kernel does no GRO where a generic program runs: it sees the frames as
    /// they came.)
    fn attach_generic(&mut self, name: &str, native: Option<ProgramError>) -> Result<XdpLinkId> {
        let why = native.map(|e| {
            let hint = mtu_hint(name, &e, "");
            format!(" (native mode failed: {:#}{hint})", anyhow::Error::from(e))
        });
        let link = self.program().attach(name, XdpMode::Skb).with_context(|| {
            format!(
                "attaching to {name} in generic mode{}",
                why.clone().unwrap_or_default()
            )
        })?;
        match why {
            Some(why) => {
                warn!(interface = %name, "native XDP unavailable{why}; attached in generic mode")
            }
            None => info!(interface = %name, "generic mode (agent.xdp_mode)"),
        }
        Ok(link)
    }

    /// How the program is attached to interfaces from now on (`agent.xdp_mode`).
    pub fn set_xdp_mode(&mut self, mode: config::XdpMode) {
        self.xdp_mode = mode;
    }

    /// Swaps this program into the XDP link pinned at `pin`, atomically: the interface
    /// never runs without a program.
    fn take_over(&mut self, pin: &std::path::Path) -> Result<XdpLinkId> {
        let fd = FdLink::from(PinnedLink::from_pin(pin)?);
        let link = XdpLink::try_from(fd)?;
        Ok(self.program().attach_to_link(link)?)
    }

    /// Pinned interfaces that the configuration no longer lists: detached, so that a
    /// restart with fewer interfaces does not leave the program on the others.
    pub fn detach_unlisted_pins(&mut self, interfaces: &[String]) -> Result<()> {
        let Some(pins) = &self.pins else {
            return Ok(());
        };
        for name in pins.linked()? {
            if !interfaces.contains(&name) && !self.links.contains_key(&name) {
                pins.unpin_link(&name)?;
                info!(interface = %name, "detached (no longer configured)");
            }
        }
        Ok(())
    }

    /// On the way out: with pins, everything stays as it is for the next agent; without,
    /// the program leaves every interface.
    pub fn stop(&mut self) -> Result<()> {
        match &self.pins {
            Some(p) => {
                info!(dir = %p.dir().display(), interfaces = self.links.len(), "left attached, pinned for the next agent");
                Ok(())
            }
            None => self.detach_all(),
        }
    }

    /// Whether the maps are an earlier agent's, in use by the links it pinned.
    pub fn took_over_maps(&self) -> bool {
        self.inherited
    }

    /// After a start that failed: the links this agent made leave again; those it took
    /// over stay, with their connections and the program now in them, and `EGRESS` and
    /// `EGRESS_FRAGS` hold what they held before.
    pub fn abandon(&mut self) {
        let made: Vec<String> = self
            .links
            .keys()
            .filter(|n| !self.taken_over.contains(*n))
            .cloned()
            .collect();
        for name in made {
            if let Err(e) = self.detach_one(&name) {
                warn!(interface = %name, "{e:#}");
            }
        }
        // `EGRESS_FRAGS` within `EGRESS` all along: taken out of first, put back into last
        // where `EGRESS` holds the interface.
        let frags: HashSet<u32> = (self.egress_frags_at_load)
            .intersection(&self.egress_at_load)
            .copied()
            .collect();
        let mut restored = egress_only(&mut self.egress_frags, &frags);
        restored = restored.and(egress_only(&mut self.egress, &self.egress_at_load));
        // What the start took out (an interface the new file no longer lists), where it is
        // still there to put back.
        for &index in &self.egress_at_load {
            if self.egress.get(index, 0).is_err() {
                let put = (self.egress.insert(index, index, None, 0))
                    .with_context(|| format!("putting interface {index} back into EGRESS"));
                restored = restored.and(put);
            }
        }
        for &index in frags.iter().filter(|&&i| self.egress.get(i, 0).is_ok()) {
            let put = (self.egress_frags.insert(index, index, None, 0))
                .with_context(|| format!("putting interface {index} back into EGRESS_FRAGS"));
            restored = restored.and(put);
        }
        if let Err(e) = restored {
            warn!("{e:#}");
        }
    }

    pub fn detach_all(&mut self) -> Result<()> {
        let names: Vec<String> = self.links.keys().cloned().collect();
        for name in names {
            self.detach_one(&name)?;
        }
        Ok(())
    }

    fn detach_one(&mut self, name: &str) -> Result<()> {
        self.taken_over.remove(name);
        self.gone.remove(name);
        self.relinking.remove(name);
        if let Some(Attached { link, .. }) = self.links.remove(name) {
            // Unpinned first: the link goes when its last reference, ours, does.
            if let Some(pins) = &self.pins {
                pins.unpin_link(name)?;
            }
            self.program()
                .detach(link)
                .with_context(|| format!("detaching from {name}"))?;
            info!(interface = %name, "detached");
        }
        Ok(())
    }

    /// The program's counters, summed over CPUs.
    pub fn counters(&self) -> Result<Vec<(Counter, u64)>> {
        Counter::ALL
            .iter()
            .map(|c| {
                let values: PerCpuValues<u64> = self.counters.get(&(*c as u32), 0)?;
                Ok((*c, values.iter().sum()))
            })
            .collect()
    }

    /// The client packets to VIP `vip_id` the program dropped, summed over CPUs, since the
    /// VIP took that id.
    pub fn vip_drops(&self, vip_id: u32) -> Result<u64> {
        let values: PerCpuValues<u64> = self.vip_drops.get(&vip_id, 0)?;
        Ok(values.iter().sum())
    }

    /// One backend's counters, summed over CPUs.
    pub fn backend_stats(&self, id: u32) -> Result<BackendStats> {
        let values = self.backend_stats.get(&id, 0)?;
        let elsewhere = self.closed_elsewhere.get(&id).copied().unwrap_or(0);
        let sum = values
            .iter()
            .fold(BackendStats::default(), |a, v| BackendStats {
                flows_opened: a.flows_opened + v.flows_opened,
                flows_closed: a.flows_closed + v.flows_closed,
                packets: a.packets + v.packets,
                bytes: a.bytes + v.bytes,
            });
        Ok(BackendStats {
            flows_closed: sum.flows_closed + elsewhere,
            ..sum
        })
    }

    /// A handle of its own on the program's allowances (`ALLOWANCES`), independent of this
    /// one: for benchmarks that time an allowed path (a shared flow's report) at rates far
    /// past the allowance, refilling it between packets.
    pub fn allowances(&self) -> Result<Allowances> {
        let id = match self.ebpf.map("ALLOWANCES") {
            Some(Map::PerCpuArray(data)) => data.info()?.id(),
            _ => bail!("the program has no per-CPU array ALLOWANCES"),
        };
        let data = MapData::from_id(id).context("opening ALLOWANCES")?;
        Ok(Allowances(PerCpuArray::try_from(Map::PerCpuArray(data))?))
    }

    /// The flow table itself, for tools that inspect it and for benchmarks that fill it.
    pub fn flow_table(&mut self) -> &mut BpfHashMap<MapData, FlowKey, FlowEntry> {
        &mut self.flows
    }

    /// Writes the candidates of bucket `bucket` of VIP `vip_id`.
    pub fn set_bucket(&mut self, vip_id: u32, bucket: u16, candidates: &Bucket) -> Result<()> {
        self.buckets
            .set(slot(vip_id, bucket)?, candidates, 0)
            .with_context(|| format!("writing bucket {bucket} of VIP {vip_id}"))
    }

    /// The candidates of bucket `bucket` of VIP `vip_id`, as last written.
    pub fn bucket(&self, vip_id: u32, bucket: u16) -> Result<Bucket> {
        self.buckets
            .get(&slot(vip_id, bucket)?, 0)
            .with_context(|| format!("reading bucket {bucket} of VIP {vip_id}"))
    }

    /// Hinted SYNs, spills and picks of one bucket so far, summed over CPUs.
    pub fn bucket_stats(&self, vip_id: u32, bucket: u16) -> Result<BucketStats> {
        let start = (slot(vip_id, bucket)? * BUCKET_STAT_SLOTS) as usize;
        let v = self
            .bucket_stats
            .shared()
            .get(start..start + BUCKET_STAT_SLOTS as usize)
            .context("bucket out of range")?;
        let at = |i: usize| v[i].load(Ordering::Relaxed);
        Ok(BucketStats {
            hinted: at(0),
            spilled: at(1),
            picks: std::array::from_fn(|p| at(2 + p)),
        })
    }

    /// Lets backend `id` take `budget` more new connections before it counts as past its
    /// spill threshold, counted from now.
    pub fn set_budget(&mut self, id: u32, budget: i32) -> Result<()> {
        let since = self.load_counts(id)?;
        self.set_load(id, budget, false, since)
    }

    /// The program's shared counts of the connections it opened and closed to backend `id`
    /// (`OPENS`, `CLOSES`), from which it counts a budget's room down and up.
    pub fn load_counts(&self, id: u32) -> Result<LoadCounts> {
        let i = id as usize;
        let (opens, closes) = (self.opens.shared(), self.closes.shared());
        let (Some(opened), Some(closed)) = (opens.get(i), closes.get(i)) else {
            bail!("backend id {id} out of range");
        };
        Ok(LoadCounts {
            opened: opened.load(Ordering::Relaxed),
            closed: closed.load(Ordering::Relaxed),
        })
    }

    /// Lets backend `id` take `budget` more new connections, less those opened since the
    /// counts were `since`, plus those closed since unless `held` (`LOAD_F_HELD`): a budget
    /// from a scrape is given the counts of when its request was sent, so the program counts
    /// everything after it once, connections opened and closed alike.
    ///
    /// Three stores, not one atomic update: a SYN on another CPU in between sees an old
    /// budget with new counts or the reverse, a room off by the connections of one scrape
    /// interval, once.
    pub fn set_load(&mut self, id: u32, budget: i32, held: bool, since: LoadCounts) -> Result<()> {
        let i = id as usize;
        if i >= MAX_BACKENDS as usize {
            bail!("backend id {id} out of range");
        }
        let load = &self.load.shared()[i * LOAD_SLOTS as usize..][..LOAD_SLOTS as usize];
        load[0].store(since.opened, Ordering::Relaxed);
        load[1].store(since.closed, Ordering::Relaxed);
        // `budget` and `flags` share the third slot, budget in the low half (little-endian).
        let flags = if held { LOAD_F_HELD } else { 0 };
        load[2].store(
            u64::from(budget as u32) | u64::from(flags) << 32,
            Ordering::Relaxed,
        );
        Ok(())
    }

    /// The flow table's map id.
    pub fn flows_id(&self) -> u32 {
        self.flows_id
    }

    /// The ring of the program's reports of shared flows (`sync.rs`), once.
    pub fn take_flow_events(&mut self) -> Option<RingBuf<MapData>> {
        self.flow_events.take()
    }

    /// Writes what another gateway reported of one of its flows (`sync.rs`) for the
    /// backend `id` at `addr:port` (network order):
    ///
    /// - **Open** (placed by its SYN): the entry names that backend from now on, whatever
    ///   this gateway had for the tuple (a new connection reusing it).
    /// - **Alive** (a keepalive, or a flow placed without its SYN, a guess): an entry is
    ///   written only where this gateway has none for the tuple or only an expired one; one
    ///   naming that backend has its time refreshed if this gateway has not seen its packets
    ///   lately; a live entry naming another backend, or a closed one, stays as it is.
    /// - **Close**: a live entry naming that backend is marked closed, so that a SYN reusing
    ///   the tuple is balanced anew.
    ///
    /// An entry written here has its `close_claim` taken: a gateway counts the connections
    /// it opened, and their closes, only once. When a peer reports the close of one this
    /// gateway opened, or an open replaces one, its close is counted here by the agent.
    /// Returns whether anything was written.
    pub fn adopt_flow(
        &mut self,
        key: &FlowKey,
        backend: (u32, [u32; 4], u16),
        idle_timeout_s: u32,
        kind: Kind,
    ) -> Result<bool> {
        let current = self.flows.get(key, 0).ok();
        self.adopt_flow_over(key, backend, idle_timeout_s, kind, current)
    }

    /// [`Dataplane::adopt_flow`] decided on `current`, the table's entry for the tuple as
    /// read a moment before: where there was none, an entry the program has inserted since
    /// (a SYN that came here meanwhile) is not overwritten.
    pub fn adopt_flow_over(
        &mut self,
        key: &FlowKey,
        (id, addr, port): (u32, [u32; 4], u16),
        idle_timeout_s: u32,
        kind: Kind,
        current: Option<FlowEntry>,
    ) -> Result<bool> {
        let now = monotonic_ns();
        let synced = sync_epoch(now);
        let same =
            current.filter(|e| e.backend_id == id && e.nat_addr == addr && e.nat_port == port);
        let live = current.filter(|e| e.live_at(now));
        let adopted = FlowEntry {
            nat_addr: addr,
            nat_port: port,
            closed: 0,
            acked: FLOW_ACKED,
            backend_id: id,
            idle_timeout_s,
            synced,
            last_seen_ns: now,
            to_backend: NextHop::default(),
            to_client: NextHop::default(),
            close_claim: 1,
        };
        // The program writes entries in place while this read-modify-write runs: an entry
        // whose packets come here is left alone (it is fresh), so that neither side's write
        // is lost. Its own packets refresh it more often than any report would.
        let quiet = |e: &FlowEntry| now.saturating_sub(e.last_seen_ns) > 2_000_000_000;
        // A flow a peer reports is one the peers know of: its close is theirs to hear too.
        let refreshed = |e: FlowEntry| FlowEntry {
            last_seen_ns: now,
            synced,
            acked: FLOW_ACKED,
            ..e
        };
        let entry = match kind {
            Kind::Open => match same {
                Some(e) if e.closed == 0 && !quiet(&e) => return Ok(false),
                Some(e) if e.closed == 0 => refreshed(e),
                _ => self.replacing(current, adopted),
            },
            Kind::Alive => match (same, live) {
                (Some(e), Some(_)) if quiet(&e) => refreshed(e),
                (_, Some(_)) => return Ok(false),
                // Closed here, and reported alive by a peer that has not seen the close yet.
                (Some(e), None) if e.closed != 0 => return Ok(false),
                _ => self.replacing(current, adopted),
            },
            Kind::Close => match same.filter(|e| e.closed == 0) {
                Some(e) => {
                    if e.close_claim == 0 {
                        self.count_closes(id, 1);
                    }
                    FlowEntry {
                        closed: 1,
                        close_claim: 1,
                        ..e
                    }
                }
                // Closed here already, unknown, or known with another backend.
                None => return Ok(false),
            },
        };
        let flags = if current.is_none() {
            u64::from(BPF_NOEXIST)
        } else {
            0
        };
        match self.flows.insert(key, entry, flags) {
            Ok(()) => Ok(true),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {
                Ok(false)
            }
            Err(e) => Err(e).context("writing a shared flow"),
        }
    }

    /// `adopted`, over `current`: a connection this gateway opened and did not see close
    /// (live, expired, or its server DOWN) is gone, and its close is counted, as the program
    /// counts it when it places a flow over such an entry itself.
    fn replacing(&mut self, current: Option<FlowEntry>, adopted: FlowEntry) -> FlowEntry {
        if let Some(e) = current.filter(|e| e.close_claim == 0) {
            self.count_closes(e.backend_id, 1);
        }
        adopted
    }

    /// Counts the closes of `n` connections to `id` that this gateway opened and will not see
    /// close (a peer reported or replaced them, or the sweep deleted their unanswered
    /// handshakes, or took them out while the program placed their flow again): where the
    /// program would have (`CLOSES`, for the spill room), and in the agent's own count, added
    /// to the program's in [`Dataplane::backend_stats`].
    pub fn count_closes(&mut self, id: u32, n: u64) {
        if let Some(c) = self.closes.shared().get(id as usize) {
            c.fetch_add(n, Ordering::Relaxed);
        }
        *self.closed_elsewhere.entry(id).or_default() += n;
    }

    /// [`live_flows`] in this agent's flow table.
    pub fn live_flows(
        &self,
        ids: &HashSet<u32>,
        quiet: Option<Duration>,
    ) -> Result<HashMap<u32, u64>> {
        live_flows(self.flows_id(), ids, quiet)
    }
}

/// Takes out of `egress` (`EGRESS` or `EGRESS_FRAGS`) every interface not in `keep`; each
/// is tried, the first failure is the answer.
fn egress_only(egress: &mut DevMapHash<MapData>, keep: &HashSet<u32>) -> Result<()> {
    let stale: Vec<u32> = (egress.keys().filter_map(Result::ok))
        .filter(|i| !keep.contains(i))
        .collect();
    let mut failed = Ok(());
    for index in stale {
        let removed = (egress.remove(index))
            .with_context(|| format!("removing interface {index} from a device map"));
        failed = failed.and(removed);
    }
    failed
}

/// What to say after native XDP on interface `name` was refused with `e`, when the kernel
/// refused the program for the frames (EINVAL, ERANGE, EOPNOTSUPP) and the interface has jumbo
/// frames, the likely reason: the program takes a frame in several buffers (`xdp.frags`),
/// but a driver without multi-buffer XDP (ixgbe, for one) hands it only frames that fit in
/// one. `or` is another way out, if any. Nothing otherwise.
fn mtu_hint(name: &str, e: &ProgramError, or: &str) -> String {
    let errno = std::iter::successors(Some(e as &dyn std::error::Error), |e| e.source())
        .find_map(|e| e.downcast_ref::<std::io::Error>()?.raw_os_error());
    if !matches!(errno, Some(libc::EINVAL | libc::ERANGE | libc::EOPNOTSUPP)) {
        return String::new();
    }
    match interface_mtu(name) {
        Some(mtu) if mtu > 1500 => format!(
            "; its MTU is {mtu}, and a driver without multi-buffer XDP support runs XDP \
             programs natively only up to an MTU of 3000 to 3500 or so (the program supports \
             multi-buffer frames; the driver or kernel may not): lower the MTU{or}"
        ),
        _ => String::new(),
    }
}

/// The MTU of interface `name`, if it can be read.
fn interface_mtu(name: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/sys/class/net/{name}/mtu"))
        .ok()
        .and_then(|m| m.trim().parse().ok())
}

/// `e`, from attaching to interface `name`, saying what to do when the kernel refused
/// because the interface has an XDP program already (EEXIST, EBUSY): most likely a link an
/// earlier agent pinned, which an agent with another `pin_dir`, or none, does not know of.
fn held_elsewhere(name: &str, e: anyhow::Error) -> anyhow::Error {
    if !os_error(&e, &[libc::EEXIST, libc::EBUSY]) {
        return e;
    }
    e.context(format!(
        "{name} has an XDP program already: another tool's, or one an earlier agent left \
         pinned (if agent.pin_dir changed or was removed since, `balancer-agent detach \
         --config` with the file that pinned it takes it off)"
    ))
}

/// The kernel's answer for a link whose interface is gone (`ENOLINK`).
fn defunct(e: &anyhow::Error) -> bool {
    os_error(e, &[libc::ENOLINK])
}

/// Whether a system call behind `e` failed with one of `codes` (aya keeps the io error in
/// the chain).
fn os_error(e: &anyhow::Error, codes: &[i32]) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::raw_os_error)
            .is_some_and(|code| codes.contains(&code))
    })
}

/// Bucket `bucket` of VIP `vip_id` in `BUCKETS` and `BUCKET_STATS`, as the program finds it.
fn slot(vip_id: u32, bucket: u16) -> Result<u32> {
    bucket_slot(vip_id, u32::from(bucket))
        .with_context(|| format!("bucket {bucket} of VIP {vip_id} is out of range"))
}

/// Connections still open on each of `ids` in the flow table `flows_id` (a map id): entries
/// not ended (`FlowEntry::closed`) and not idle past their timeout, nor, with `quiet`, for
/// longer than that. Walks the whole table (in batches, [`map_ops`]: well under a second a million
/// entries), so it is for occasional questions (has a drained server's last stream ended?),
/// asked without the controller's lock.
pub fn live_flows(
    flows_id: u32,
    ids: &HashSet<u32>,
    quiet: Option<Duration>,
) -> Result<HashMap<u32, u64>> {
    count_live(flows_id, |id| ids.contains(&id), quiet)
}

/// [`live_flows`] on the servers whose id `counted` takes.
fn count_live(
    flows_id: u32,
    counted: impl Fn(u32) -> bool,
    quiet: Option<Duration>,
) -> Result<HashMap<u32, u64>> {
    let now = monotonic_ns();
    let heard = |e: &FlowEntry| {
        quiet.is_none_or(|q| now.saturating_sub(e.last_seen_ns) <= q.as_nanos() as u64)
    };
    let mut live = HashMap::new();
    map_ops::for_each(flows_id, |_: FlowKey, e: FlowEntry| {
        if counted(e.backend_id) && e.live_at(now) && heard(&e) {
            *live.entry(e.backend_id).or_insert(0) += 1;
        }
        ControlFlow::Continue(())
    })
    .context("walking the flow table")?;
    Ok(live)
}

/// How long a census of open connections answers drain statuses after its walk ended, at
/// least: longer when the walk took longer, so that pollers of a table that takes seconds to
/// walk keep a walker busy half the time at most.
pub const CENSUS_REUSE: Duration = Duration::from_secs(1);

/// The drain statuses' walks of the flow table, shared: one walk at a time counts every
/// server's open connections, and a question asked while it runs, or within
/// [`CENSUS_REUSE`] (or the walk's own length) of its end, takes its counts. However many
/// `drain --wait` poll, each every 250 ms, the table is walked about once a second, and a
/// table that takes longer to walk than a poll interval is not walked by every poll at once.
pub struct FlowCensus {
    flows_id: u32,
    /// The last census of each kind (`quiet`), and the lock walkers queue on.
    last: std::sync::Mutex<Vec<Census>>,
}

struct Census {
    quiet: Option<Duration>,
    /// When its walk began: a connection opened before then may have been passed over.
    started: Instant,
    ended: Instant,
    reuse: Duration,
    live: HashMap<u32, u64>,
}

impl FlowCensus {
    pub fn new(flows_id: u32) -> Self {
        FlowCensus {
            flows_id,
            last: Default::default(),
        }
    }

    /// The connections open on `id` ([`live_flows`] with `quiet`), from a census no older
    /// than the question, or than [`CENSUS_REUSE`], whose walk began at `since` or later (a
    /// drain's start: a walk begun before may have passed over a connection opened just
    /// before the drain). Blocks for a walk: call it on a blocking thread, without the
    /// controller's lock.
    pub fn open_on(&self, id: u32, quiet: Option<Duration>, since: Option<Instant>) -> Result<u64> {
        let asked = Instant::now();
        // Held across the walk: a question asked meanwhile waits for it instead of walking
        // the table beside it.
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let recent = |c: &&Census| {
            c.quiet == quiet
                && asked <= c.ended + c.reuse
                && since.is_none_or(|since| c.started >= since)
        };
        if let Some(c) = last.iter().find(recent) {
            return Ok(c.live.get(&id).copied().unwrap_or(0));
        }
        let started = Instant::now();
        let live = count_live(self.flows_id, |_| true, quiet)?;
        let open = live.get(&id).copied().unwrap_or(0);
        last.retain(|c| c.quiet != quiet);
        let ended = Instant::now();
        last.push(Census {
            quiet,
            started,
            ended,
            reuse: CENSUS_REUSE.max(ended - asked),
            live,
        });
        Ok(open)
    }
}

/// CLOCK_MONOTONIC_COARSE, the clock of `bpf_ktime_get_coarse_ns`: what flow entries' times
/// are in. The program reads the coarse clock (it lags CLOCK_MONOTONIC by a tick at most)
/// to spare every packet a clock-source read; every use of it is about seconds.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use aya::sys::SyscallError;

    use super::*;

    fn refused(errno: i32) -> ProgramError {
        ProgramError::SyscallError(SyscallError {
            call: "bpf_link_create",
            io_error: std::io::Error::from_raw_os_error(errno),
        })
    }

    #[test]
    fn the_mtu_hint_is_for_a_refusal_about_the_frames_past_1500() {
        // `lo` has an MTU of 65536.
        let hint = mtu_hint("lo", &refused(libc::EINVAL), ", or use generic mode");
        assert!(
            hint.contains("its MTU is 65536")
                && hint.ends_with("lower the MTU, or use generic mode"),
            "{hint}"
        );
        assert!(mtu_hint("lo", &refused(libc::EOPNOTSUPP), "").contains("multi-buffer"));
        assert_eq!(mtu_hint("lo", &refused(libc::EBUSY), ""), "");
        assert_eq!(mtu_hint("no-such-if", &refused(libc::EINVAL), ""), "");
    }
}
