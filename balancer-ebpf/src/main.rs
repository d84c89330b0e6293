//! The XDP data path: parse, VIP lookup, flow-table lookup, Maglev selection on a miss,
//! NAT rewrite (or none, for direct server return), next hop by FIB lookup, forward.
//! Anything that is not plainly ours passes to the stack untouched.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
// For `atomic_xadd`: see `room::note_open`. The BPF object is always built with nightly.
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

mod affinity;
mod icmp;
mod icmp_errors;
mod maps;
mod nat;
mod parse;
mod room;
mod sync;
mod tunnel;

use aya_ebpf::{
    bindings::{
        xdp_action::{XDP_DROP, XDP_PASS},
        xdp_md,
    },
    helpers::bpf_ktime_get_coarse_ns,
    macros::xdp,
    programs::XdpContext,
};
use balancer_common::{
    hash::draws, reply_epoch, sync_epoch, Backend, BackendHop, Counter, FlowEntry, FlowKey, Limit,
    NextHop, ReplyKey, VipInfo, VipKey, ALTERNATES_SIZE, BACKEND_F_DOWN, BACKEND_F_PRESENT,
    FLOW_ACKED, FLOW_EVENT_ALIVE, FLOW_EVENT_CLOSE, FLOW_EVENT_OPEN, FLOW_UNTOLD, IPPROTO_TCP,
    MAGLEV_SIZE, MAX_REPLY_VIPS, VIP_F_DSR, VIP_F_SYNC,
};

use affinity::Hinted;
use icmp_errors::Back;
use maps::{
    allowed, count, count_vip_drop, ALTERNATES, BACKENDS, BACKEND_STATS, FLOWS, HOPS, MAGLEV,
    REPLIES, VIPS,
};
use nat::{NoHop, Outer};
use parse::{Packet, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

const NS_PER_S: u64 = 1_000_000_000;

/// What [`tcp`] returns for a packet that is not TCP: no XDP verdict has this value.
const NOT_TCP: u32 = u32::MAX;

/// TCP and everything else in two BPF subprograms, each with a stack frame of its own: the
/// verifier bounds the frames of a chain of calls together, and one frame would not hold
/// both paths' variables. Multi-buffer aware (`xdp.frags`), so that drivers run it natively
/// on interfaces with jumbo frames: it reads and rewrites only headers, which are in the
/// first buffer, and takes lengths from the whole frame (see `parse`).
#[xdp(frags)]
pub fn balancer(ctx: XdpContext) -> u32 {
    count(Counter::Packets);
    match tcp(ctx.ctx) {
        NOT_TCP => icmp_error(ctx.ctx),
        verdict => verdict,
    }
}

/// The TCP path, or `NOT_TCP`.
#[inline(never)]
fn tcp(ctx: *mut xdp_md) -> u32 {
    let ctx = &XdpContext::new(ctx);
    match parse::parse(ctx) {
        Ok(pkt) => route(ctx, &pkt),
        Err(Counter::PassNotTcp) => NOT_TCP,
        Err(reason) => {
            count(reason);
            XDP_PASS
        }
    }
}

/// A packet that is not TCP: an ICMP error about one of our flows' packets, from a router
/// beyond the gateway, goes on to the end that sent the packet, translated back (see
/// `icmp_errors`); anything else to the stack.
#[inline(never)]
fn icmp_error(ctx: *mut xdp_md) -> u32 {
    let ctx = &XdpContext::new(ctx);
    let Some(quoted) = icmp_errors::parse(ctx) else {
        count(Counter::PassNotTcp);
        return XDP_PASS;
    };
    let quoted = &quoted;
    let pkt = &quoted.pkt;
    let Some(vip) = VIPS.get_ptr(vip_of(pkt)) else {
        // About a client's packet, sent to the client: the stack routes it there once its
        // quote is what the client sent.
        let Some((vip, ..)) = replied_flow(pkt) else {
            count(Counter::PassNotTcp);
            return XDP_PASS;
        };
        if icmp_errors::translate(ctx, quoted, &vip.addr, vip.port, Back::ToClient).is_err() {
            count(Counter::PassMalformed);
            return XDP_PASS;
        }
        count(Counter::IcmpToClient);
        return XDP_PASS;
    };
    let Some(entry) = FLOWS.get_ptr_mut(pkt.key) else {
        count(Counter::PassNotTcp);
        return XDP_PASS;
    };
    if pkt.ttl <= 1 {
        count(Counter::PassTtlExceeded);
        return XDP_PASS;
    }
    // SAFETY: pointers from successful lookups, valid for this run; fields written whole.
    let (vip, entry) = (unsafe { &*vip }, unsafe { &mut *entry });
    let dsr = vip.flags & VIP_F_DSR != 0;
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    let outer = outer(vip, &entry.nat_addr);
    let backend = (entry.backend_id, &entry.nat_addr, entry.nat_port);
    let hop = to_backend(ctx, pkt, &mut entry.to_backend, backend, now, (dsr, &outer));
    let (addr, port) = (&entry.nat_addr, entry.nat_port);
    if !dsr && icmp_errors::translate(ctx, quoted, addr, port, Back::ToBackend).is_err() {
        count(Counter::PassMalformed);
        return XDP_PASS;
    }
    count(Counter::IcmpToBackend);
    nat::send(ctx, pkt, hop, dsr, &outer)
}

/// The outer header of `vip`'s packets to the backend at `addr`: a tunnel VIP's, or none.
#[inline(always)]
fn outer<'a>(vip: &'a VipInfo, addr: &'a [u32; 4]) -> Outer<'a> {
    Outer {
        mask: vip.tunnel_mask,
        src: &vip.tunnel_src,
        dst: addr,
    }
}

/// The VIP a packet (or the flow an ICMP error quotes) is sent to, as `VIPS` keys it.
#[inline(always)]
fn vip_of(pkt: &Packet) -> VipKey {
    VipKey {
        addr: pkt.key.dst,
        port: pkt.key.dport,
        proto: IPPROTO_TCP,
        family: pkt.key.family,
    }
}

#[inline(always)]
fn route(ctx: &XdpContext, pkt: &Packet) -> u32 {
    if let Some(vip) = VIPS.get_ptr(vip_of(pkt)) {
        // SAFETY: a pointer from a successful lookup is valid for this program run. Read in
        // place, not copied (the TCP path has no stack to spare): should the agent rewrite
        // this VIP and then another while this run reads it, the kernel may hand this
        // element to the second, and the packet goes by a mix of their settings, as a copy
        // taken mid-rewrite would. The agent rewrites a VIP at most once a scrape round.
        let vip = unsafe { &*vip };
        let verdict = forward(ctx, pkt, vip);
        if verdict == XDP_DROP {
            count_vip_drop(vip.vip_id);
        }
        return verdict;
    }
    if let Some((vip, flow, entry, now)) = replied_flow(pkt) {
        // SAFETY: valid for this run; fields are written whole.
        return reply(ctx, pkt, &vip, &flow, unsafe { &mut *entry }, now);
    }
    count(Counter::PassNotOurs);
    XDP_PASS
}

/// The flow a packet from a backend belongs to (a reply, or what an ICMP error quotes as
/// one), with its VIP, and the time it was looked up at. A client may reuse its port for
/// another VIP the same backend serves while the first connection's entry lingers, closed
/// or idle: the live flow is the packet's, and with none live, the one heard from last (a
/// FIN's answer, or the last ACK of a closed flow, still needs the VIP).
#[inline(always)]
fn replied_flow(pkt: &Packet) -> Option<(VipKey, FlowKey, *mut FlowEntry, u64)> {
    let from = ReplyKey {
        addr: pkt.key.src,
        port: pkt.key.sport,
        family: pkt.key.family,
        _pad: 0,
    };
    let replies = REPLIES.get_ptr(from)?;
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    let mut ended = None;
    let mut last_seen = 0;
    let mut i = 0;
    while i < MAX_REPLY_VIPS {
        // SAFETY: a pointer from a successful lookup, valid for this program run; the agent
        // replaces values whole.
        let vip = unsafe { (*replies).vips[i] };
        if vip.family == 0 {
            break;
        }
        if let Some((flow, entry)) = flow_of_reply(pkt, &vip) {
            // SAFETY: valid for this run.
            let e = unsafe { &*entry };
            if e.live_at(now) {
                return Some((vip, flow, entry, now));
            }
            if ended.is_none() || e.last_seen_ns > last_seen {
                ended = Some(vip);
                last_seen = e.last_seen_ns;
            }
        }
        i += 1;
    }
    let vip = ended?;
    let (flow, entry) = flow_of_reply(pkt, &vip)?;
    Some((vip, flow, entry, now))
}

/// The flow `pkt`, from a backend, answers if it was sent to `vip`: its key and entry, when
/// that flow exists and names this backend.
#[inline(always)]
fn flow_of_reply(pkt: &Packet, vip: &VipKey) -> Option<(FlowKey, *mut FlowEntry)> {
    let flow = FlowKey {
        src: pkt.key.dst,
        dst: vip.addr,
        sport: pkt.key.dport,
        dport: vip.port,
        proto: pkt.key.proto,
        family: pkt.key.family,
        _pad: [0; 2],
    };
    let entry = FLOWS.get_ptr_mut(flow)?;
    // SAFETY: valid for this program run.
    let e = unsafe { &*entry };
    (e.nat_port == pkt.key.sport && same_addr(&e.nat_addr, &pkt.key.src)).then_some((flow, entry))
}

/// Word by word: a slice comparison would call `memcmp`, which BPF does not have.
#[inline(always)]
fn same_addr(a: &[u32; 4], b: &[u32; 4]) -> bool {
    a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3]
}

/// Where a client's packet goes: backend id, address and port, and the next hop there.
type Target = (u32, [u32; 4], u16, Result<NextHop, NoHop>);

/// Client -> VIP: follow the flow's entry, or pick a backend for a new flow.
#[inline(always)]
fn forward(ctx: &XdpContext, pkt: &Packet, vip: &VipInfo) -> u32 {
    if pkt.ttl <= 1 {
        count(Counter::PassTtlExceeded);
        return XDP_PASS;
    }
    // Coarse (a tick): every use of the time is about seconds, and it saves a clock-source
    // read per packet.
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    let syn = pkt.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    let dsr = vip.flags & VIP_F_DSR != 0;

    let mut target = None;
    if let Some(entry) = FLOWS.get_ptr_mut(pkt.key) {
        // SAFETY: valid for this run; fields are written whole.
        let entry = unsafe { &mut *entry };
        if entry.expired_at(now) {
            count(Counter::FlowExpired);
            close_replaced(entry);
        } else if syn && (entry.closed != 0 || down(entry.backend_id)) {
            // A SYN on a closed flow's tuple, or on one whose server failed its checks: a
            // new connection (a dead server answers nothing, not even the challenge ACK
            // whose RST would close the entry, and the client's retries would keep it).
            count(Counter::FlowReopened);
            close_replaced(entry);
        } else {
            // Saturating: the other direction, on another CPU, may have stored a time later
            // than `now` since it was read.
            if now.saturating_sub(entry.last_seen_ns) > NS_PER_S {
                entry.last_seen_ns = now;
                sync::keepalive(&pkt.key, entry, now);
            }
            if entry.acked == 0 && !syn && pkt.tcp_flags & TCP_ACK != 0 {
                let mut acked = FLOW_ACKED;
                // Shared once the handshake goes on: a flood of spoofed SYNs stays here, and
                // one of forged SYN and ACK pairs is bounded by the allowance.
                if entry.synced != 0 && entry.closed == 0 {
                    if !allowed(Limit::NewFlowReports, now) {
                        count(Counter::SyncOpenLimited);
                        entry.synced = sync::overdue(now, entry.idle_timeout_s);
                        acked |= FLOW_UNTOLD;
                    } else if sync::report(&pkt.key, entry, FLOW_EVENT_OPEN, now) {
                        entry.synced = sync_epoch(now);
                    } else {
                        acked |= FLOW_UNTOLD;
                    }
                }
                entry.acked = acked;
            }
            note_fin(pkt, &pkt.key, entry, now, dsr);
            let backend = (entry.backend_id, &entry.nat_addr, entry.nat_port);
            let via = (dsr, &outer(vip, &entry.nat_addr));
            let hop = to_backend(ctx, pkt, &mut entry.to_backend, backend, now, via);
            target = Some((entry.backend_id, entry.nat_addr, entry.nat_port, hop));
        }
    }
    let (backend_id, addr, port, hop) = match target {
        Some(t) => t,
        None => match new_flow(ctx, pkt, vip, syn, now, dsr) {
            Ok(t) => t,
            Err(reason) => {
                count(reason);
                return XDP_DROP;
            }
        },
    };
    if let Some(verdict) = answer_too_big(ctx, pkt, &hop) {
        return verdict;
    }
    if let Some(stats) = BACKEND_STATS.get_ptr_mut(backend_id) {
        // SAFETY: per-CPU value, no other writer.
        unsafe {
            (*stats).packets += 1;
            (*stats).bytes += u64::from(pkt.len);
        }
    }
    count(Counter::Forward);
    if !dsr && nat::rewrite_dst(ctx, pkt, &addr, port).is_err() {
        // The bounds were checked by the parser; this cannot happen, but the verifier needs
        // the check and a packet we cannot rewrite must not be forwarded half-done.
        count(Counter::PassMalformed);
        return XDP_PASS;
    }
    nat::send(ctx, pkt, hop, dsr, &outer(vip, &addr))
}

/// The ICMP answer's verdict when `hop` says `pkt` is too big for its next hop and it gets
/// one (see `icmp`); the frame is then the answer.
#[inline(always)]
fn answer_too_big(ctx: &XdpContext, pkt: &Packet, hop: &Result<NextHop, NoHop>) -> Option<u32> {
    let mtu = match hop {
        Err(no) if too_big(no) && icmp::answers(ctx, pkt) => no.mtu,
        _ => return None,
    };
    // SAFETY: reads the clock; no arguments.
    if !allowed(Limit::TooBigAnswers, unsafe { bpf_ktime_get_coarse_ns() }) {
        count(Counter::DropTooBigLimited);
        return Some(XDP_DROP);
    }
    let verdict = icmp::too_big(ctx, pkt, mtu)?;
    count(if verdict == XDP_DROP {
        Counter::DropTooBigAnswer
    } else {
        Counter::TooBigAnswered
    });
    Some(verdict)
}

/// Whether `no` says the packet is longer than the MTU towards its next hop.
#[inline(always)]
fn too_big(no: &NoHop) -> bool {
    matches!(
        no.why,
        Counter::PassTooBig | Counter::DropDsrTooBig | Counter::DropTunnelTooBig
    )
}

/// The next hop of a flow's replies: the answer cached in its entry while it is from this
/// flow's epoch (about a second, shifted by the client's port: `reply_epoch`), else a fresh
/// FIB lookup, kept for the next packets. A stale answer lives a second at most: a changed
/// route or neighbour MAC takes effect by then. Only usable answers are cached.
#[inline(always)]
fn to_client(
    ctx: &XdpContext,
    pkt: &Packet,
    cache: &mut NextHop,
    now: u64,
    ends: (&[u32; 4], &[u32; 4]),
    ports: (u16, u16),
) -> Result<NextHop, NoHop> {
    let epoch = reply_epoch(now, pkt.key.dport);
    if fresh(cache, epoch, pkt) {
        return Ok(*cache);
    }
    let hop = nat::next_hop(ctx, pkt, ends, ports, false, &no_tunnel(ends.0))
        .map(|r| NextHop { epoch, ..r.hop });
    *cache = hop.unwrap_or_default();
    hop
}

/// A cached answer usable for `pkt` in `epoch`.
#[inline(always)]
fn fresh(hop: &NextHop, epoch: u32, pkt: &Packet) -> bool {
    hop.ifindex != 0 && hop.epoch == epoch && pkt.len <= hop.mtu
}

/// The next hop of a flow's packets towards its backend (id, address, port): the answer
/// cached in the flow's entry (`cache`) while it is from this epoch, else the one another
/// flow to the backend found on this CPU in this epoch, if it came in on the same interface
/// and the backend is on one of our links (see `BackendHop`), else a FIB lookup, kept for
/// both. So a new flow's SYN, and a long flow's first packet of a new epoch, mostly skip the
/// lookup. Only usable answers are cached, so a DSR flow's cache holds a backend on our link.
/// A tunnel VIP's (`via.1`) is the outer header's next hop.
#[inline(always)]
fn to_backend(
    ctx: &XdpContext,
    pkt: &Packet,
    cache: &mut NextHop,
    (id, addr, port): (u32, &[u32; 4], u16),
    now: u64,
    (dsr, outer): (bool, &Outer),
) -> Result<NextHop, NoHop> {
    let epoch = (now >> 30) as u32;
    if fresh(cache, epoch, pkt) {
        return Ok(*cache);
    }
    let ingress = ctx.ingress_ifindex() as u32;
    let shared = HOPS.get_ptr_mut(id);
    if let Some(c) = shared {
        // SAFETY: this CPU's value; nothing else writes it while this program runs here.
        let c = unsafe { &*c };
        if c.ingress == ingress && same_addr(&c.addr, addr) && fresh(&c.hop, epoch, pkt) {
            *cache = c.hop;
            return Ok(c.hop);
        }
    }
    let ports = (pkt.key.sport, port);
    let route = nat::next_hop(ctx, pkt, (&pkt.key.src, addr), ports, dsr, outer);
    *cache = match &route {
        Ok(r) => NextHop { epoch, ..r.hop },
        Err(_) => NextHop::default(),
    };
    let on_link = matches!(route, Ok(nat::Route { on_link: true, .. }));
    if let (Some(c), true) = (shared, on_link) {
        // SAFETY: as above.
        unsafe {
            *c = BackendHop {
                addr: *addr,
                ingress,
                hop: *cache,
            }
        };
    }
    route.map(|_| *cache)
}

/// Picks a backend (hint bucket, Maglev, alternates) and records the flow, with the next
/// hop towards the backend.
#[inline(always)]
fn new_flow(
    ctx: &XdpContext,
    pkt: &Packet,
    vip: &VipInfo,
    syn: bool,
    now: u64,
    dsr: bool,
) -> Result<Target, Counter> {
    if vip.live_backends == 0 {
        return Err(Counter::DropNoBackend);
    }
    // A hinted SYN's bucket slot and place (None: the weighted pick), and whether an
    // alternate took it from its Maglev pick: counted once it is known to go out.
    let mut hinted = None;
    let mut second = false;
    let id = match affinity::bucket(vip, pkt).and_then(|b| affinity::pick(vip, b, syn)) {
        Some(Hinted::Take { id, counted }) if present(id).is_some() => {
            hinted = counted.map(|(slot, place)| (slot, Some(place)));
            id
        }
        Some(Hinted::Full {
            home,
            room: home_room,
            slot,
        }) => {
            // Every candidate of the bucket is past its threshold: the home, which holds the
            // prefix, unless the weighted choice has more room.
            let pick = maglev(vip, &pkt.key, syn)?;
            let home_wins = pick.room.is_some_and(|r| home_room >= r) && present(home).is_some();
            hinted = Some((slot, home_wins.then_some(0)));
            second = pick.second && !home_wins;
            if home_wins {
                home
            } else {
                pick.id
            }
        }
        other => {
            // No hint, or one naming a server no longer configured: the weighted pick.
            if let Some(Hinted::Take {
                counted: Some((slot, _)),
                ..
            }) = other
            {
                hinted = Some((slot, None));
            }
            let pick = maglev(vip, &pkt.key, syn)?;
            second = pick.second;
            pick.id
        }
    };
    let backend = present(id).ok_or(Counter::DropBadBackend)?;
    let mut entry = FlowEntry {
        nat_addr: backend.addr,
        nat_port: backend.port,
        closed: 0,
        acked: u8::from(!syn && pkt.tcp_flags & TCP_ACK != 0),
        backend_id: id,
        idle_timeout_s: vip.idle_timeout_s,
        synced: if vip.flags & VIP_F_SYNC != 0 {
            sync_epoch(now)
        } else {
            0
        },
        last_seen_ns: now,
        to_backend: NextHop::default(),
        to_client: NextHop::default(),
        close_claim: 0,
    };
    let to = (id, &backend.addr, backend.port);
    let outer = outer(vip, &backend.addr);
    let hop = to_backend(ctx, pkt, &mut entry.to_backend, to, now, (dsr, &outer));
    if dsr {
        // Not delivered, so not a flow: nothing recorded, nothing counted as opened, and the
        // client's next try is placed anew.
        if pkt.vlan {
            return Err(nat::reason(
                dsr,
                &outer,
                [
                    Counter::PassVlan,
                    Counter::DropDsrVlan,
                    Counter::DropTunnelVlan,
                ],
            ));
        }
        match hop {
            Ok(h) if !nat::can_send(ctx, h.ifindex) => {
                return Err(nat::reason(
                    dsr,
                    &outer,
                    [
                        Counter::PassEgress,
                        Counter::DropDsrEgress,
                        Counter::DropTunnelEgress,
                    ],
                ))
            }
            Ok(_) => {}
            // Answered with the ICMP "too big" (`answer_too_big`), and not recorded either.
            Err(no) if too_big(&no) && icmp::answers(ctx, pkt) => {
                return Ok((id, backend.addr, backend.port, hop))
            }
            Err(no) => return Err(no.why),
        }
    }
    if let Some((slot, place)) = hinted {
        affinity::record(slot, place);
    }
    if second {
        count(Counter::MaglevSecond);
    }
    // The end of a connection whose entry is gone (expired, evicted), a FIN or RST: recorded
    // closed, so that the backend's last answers are still translated, but neither counted
    // opened nor, later, closed.
    let ending = !syn && ends(pkt, true);
    if ending {
        entry.closed = 1;
        entry.close_claim = 1;
    }
    if FLOWS.insert(pkt.key, entry, 0).is_err() {
        // Forwarded, but not a flow: no entry will count its close, so its open is not
        // counted either, and its next packet is placed anew. An entry this one was to
        // replace (closed, idle, or naming a DOWN server) goes too, or that packet would
        // follow it to its old server.
        count(Counter::FlowInsertFailed);
        // By reference, as below.
        #[allow(clippy::needless_borrows_for_generic_args)]
        let _ = FLOWS.remove(&pkt.key);
        return Ok((id, backend.addr, backend.port, hop));
    }
    count(if syn {
        Counter::FlowNewSyn
    } else {
        Counter::FlowNewMidstream
    });
    if ending {
        return Ok((id, backend.addr, backend.port, hop));
    }
    // A flow placed without its SYN is a guess (another gateway's flow, its entry lost):
    // shared at once, but never over an entry that another gateway has. Past this CPU's
    // allowance of such reports, it is shared at its next packet a second or more later, as
    // a keepalive is, which a forged packet never has.
    if entry.synced != 0 && !syn {
        let limited = !allowed(Limit::NewFlowReports, now);
        if limited {
            count(Counter::SyncGuessLimited);
        }
        if limited || !sync::report(&pkt.key, &entry, FLOW_EVENT_ALIVE, now) {
            // By reference: by value, the key is copied onto a stack that has no room left
            // for it here (LLVM refuses the frame).
            #[allow(clippy::needless_borrows_for_generic_args)]
            if let Some(e) = FLOWS.get_ptr_mut(&pkt.key) {
                // SAFETY: valid for this run; the fields are written whole.
                unsafe {
                    if limited {
                        (*e).synced = sync::overdue(now, entry.idle_timeout_s);
                    }
                    if entry.acked != 0 {
                        (*e).acked = FLOW_ACKED | FLOW_UNTOLD;
                    }
                }
            }
        }
    }
    if let Some(stats) = BACKEND_STATS.get_ptr_mut(id) {
        // SAFETY: per-CPU value, no other writer.
        unsafe { (*stats).flows_opened += 1 };
    }
    room::note_open(id);
    Ok((id, backend.addr, backend.port, hop))
}

/// The weighted pick for a flow without a usable hint. A SYN whose pick has no room looks
/// at two alternates of the VIP (servers that may take connections, by configured weight)
/// and takes the one with the most room, if it has more than the pick: choices on the
/// program's own counts keep a burst from piling onto whichever server the weights favoured
/// at the last scrape, and when every server is past its threshold they still join the
/// shortest of three queues. Anything else keeps the pick, the one every gateway and every
/// restart agree on, and so does a SYN while its pick has room: a flow whose entry is lost
/// most likely finds its backend again.
#[inline(always)]
fn maglev(vip: &VipInfo, key: &FlowKey, syn: bool) -> Result<Pick, Counter> {
    let (slot, alternates) = draws(key);
    let id = match MAGLEV.get(vip.table * MAGLEV_SIZE + slot) {
        Some(&id) if id != 0 => id as u32,
        _ => return Err(Counter::DropNoBackend),
    };
    let first = |room| Pick {
        id,
        room,
        second: false,
    };
    if !syn {
        return Ok(first(None));
    }
    // Unknown load: nothing says the pick is full, nor that an alternate has room.
    let mut best = match room::room(id) {
        None => return Ok(first(None)),
        Some(r) if r > 0 => return Ok(first(Some(r))),
        Some(r) => r,
    };
    let mut chosen = id;
    let base = vip.vip_id * ALTERNATES_SIZE;
    let mut i = 0;
    while i < alternates.len() {
        if let Some(&alt) = ALTERNATES.get(base + alternates[i]) {
            let alt = alt as u32;
            if alt != 0 && alt != chosen && present(alt).is_some() {
                if let Some(r) = room::room(alt).filter(|r| *r > best) {
                    best = r;
                    chosen = alt;
                }
            }
        }
        i += 1;
    }
    Ok(Pick {
        id: chosen,
        room: Some(best),
        second: chosen != id,
    })
}

/// [`maglev`]'s choice: the backend, for a SYN its room (None: unknown), and whether an
/// alternate took it from the first draw.
struct Pick {
    id: u32,
    room: Option<i64>,
    second: bool,
}

/// Whether the agent marked backend `id` DOWN (its health checks failed).
#[inline(always)]
fn down(id: u32) -> bool {
    BACKENDS
        .get(id)
        .is_some_and(|b| b.flags & BACKEND_F_DOWN != 0)
}

/// The backend `id` names, if it is configured.
#[inline(always)]
fn present(id: u32) -> Option<Backend> {
    match BACKENDS.get(id) {
        Some(b) if b.flags & BACKEND_F_PRESENT != 0 => Some(*b),
        _ => None,
    }
}

/// Backend -> client, a reply of the flow `entry`: make it come from the VIP.
#[inline(always)]
fn reply(
    ctx: &XdpContext,
    pkt: &Packet,
    vip: &VipKey,
    key: &FlowKey,
    entry: &mut FlowEntry,
    now: u64,
) -> u32 {
    if pkt.ttl <= 1 {
        count(Counter::PassTtlExceeded);
        return XDP_PASS;
    }
    // A stream the server sends and the client only acknowledges is alive from both ends.
    // Saturating: another CPU may have stored a later time since `now` was read.
    if now.saturating_sub(entry.last_seen_ns) > NS_PER_S {
        entry.last_seen_ns = now;
        sync::keepalive(key, entry, now);
    }
    note_fin(pkt, key, entry, now, true);
    let ports = (vip.port, pkt.key.dport);
    let ends = (&vip.addr, &pkt.key.dst);
    let hop = to_client(ctx, pkt, &mut entry.to_client, now, ends, ports);
    // Before the rewrite: the answer quotes the reply as the backend sent it.
    if let Some(verdict) = answer_too_big(ctx, pkt, &hop) {
        return verdict;
    }
    count(Counter::Return);
    if nat::rewrite_src(ctx, pkt, &vip.addr, vip.port).is_err() {
        count(Counter::PassMalformed);
        return XDP_PASS;
    }
    nat::send(ctx, pkt, hop, false, &no_tunnel(&vip.addr))
}

/// [`Outer`] of a packet that goes through no tunnel (a reply).
#[inline(always)]
fn no_tunnel(addr: &[u32; 4]) -> Outer<'_> {
    Outer {
        mask: 0,
        src: addr,
        dst: addr,
    }
}

/// A RST from either end closes the flow, and so does a FIN where `fin_ends`: the server's,
/// which has then sent all it will. A client's FIN only half-closes: a client may send its
/// request and shut its side, and the answer can take minutes, which the entry must still
/// translate (and count open). With direct server return the server's packets never come
/// here, and the client's FIN is the end there is to see. Counted once however many arrive.
/// A shared flow's close is reported, so that other gateways rebalance a SYN that reuses its
/// tuple (at worst twice, by a FIN and a RST that meet at once: the report is idempotent);
/// not one never acknowledged, or not yet told of, which they never heard of.
#[inline(always)]
fn note_fin(pkt: &Packet, key: &FlowKey, entry: &mut FlowEntry, now: u64, fin_ends: bool) {
    if ends(pkt, fin_ends) && entry.closed == 0 {
        entry.closed = 1;
        if entry.synced != 0 && entry.acked == FLOW_ACKED {
            sync::report(key, entry, FLOW_EVENT_CLOSE, now);
        }
        if room::claim(&mut entry.close_claim) {
            note_closed(entry.backend_id);
        }
    }
}

/// Whether `pkt` ends its flow: a RST, or a FIN where `fin_ends` (see [`note_fin`]).
#[inline(always)]
fn ends(pkt: &Packet, fin_ends: bool) -> bool {
    let flags = if fin_ends { TCP_FIN | TCP_RST } else { TCP_RST };
    pkt.tcp_flags & flags != 0
}

/// A flow whose entry a new one replaces ended without a FIN or RST seen here (idle past its
/// timeout, or its server DOWN): its server gets the close, once, so that its count of open
/// flows does not keep it forever.
#[inline(always)]
fn close_replaced(entry: &mut FlowEntry) {
    if room::claim(&mut entry.close_claim) {
        note_closed(entry.backend_id);
    }
}

#[inline(always)]
fn note_closed(backend_id: u32) {
    if let Some(stats) = BACKEND_STATS.get_ptr_mut(backend_id) {
        // SAFETY: per-CPU value, no other writer.
        unsafe { (*stats).flows_closed += 1 };
    }
    room::note_close(backend_id);
}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

// bpf_fib_lookup is GPL-only.
#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

#[cfg(not(target_arch = "bpf"))]
fn main() {}
