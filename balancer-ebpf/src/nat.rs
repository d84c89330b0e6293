//! Address translation and transmission. Checksums are updated incrementally (RFC 1624):
//! recomputing them would mean reading the whole payload.

use core::{ffi::c_void, mem::size_of};

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup as FibParams,
        xdp_action::{XDP_DROP, XDP_PASS, XDP_TX},
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
    },
    helpers::bpf_fib_lookup,
    programs::XdpContext,
};
use balancer_common::{csum, Counter, NextHop, FAMILY_V4};

use crate::{
    maps::{count, EGRESS, EGRESS_FRAGS},
    parse::{multi_buffer, Packet},
    tunnel,
};

/// A tunnel VIP's outer header (`VIP_F_TUNNEL`) for packets to `dst`: `mask` all ones
/// (`VipInfo::tunnel_mask`), the source `src`. Zero `mask` for other VIPs. The FIB question
/// and the MTU allow for the header by arithmetic on `mask` rather than by a branch: the
/// verifier walks the paths after a branch once per outcome wherever the outcome is tested
/// again, and the forward path has no room for a third walk beside NAT's and DSR's.
#[derive(Clone, Copy)]
pub struct Outer<'a> {
    pub mask: u32,
    pub src: &'a [u32; 4],
    pub dst: &'a [u32; 4],
}

impl Outer<'_> {
    /// `plain`, or for a tunnel `tunnel`, without a branch.
    #[inline(always)]
    fn pick(&self, plain: u32, tunnel: u32) -> u32 {
        (plain & !self.mask) | (tunnel & self.mask)
    }
}

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// Offsets within the headers.
const V4_CHECK: usize = 10;
const V4_SRC: usize = 12;
const V4_DST: usize = 16;
const V4_TTL: usize = 8;
const V6_HOP_LIMIT: usize = 7;
const V6_SRC: usize = 8;
const V6_DST: usize = 24;
const TCP_SPORT: usize = 0;
const TCP_DPORT: usize = 2;
const TCP_CHECK: usize = 16;

/// A checked pointer into the packet. The parser already checked these bounds, but the
/// verifier tracks packet pointers per access, so each access checks again.
#[inline(always)]
fn at<T>(ctx: &XdpContext, off: usize) -> Result<*mut T, ()> {
    let start = ctx.data();
    if start + off + size_of::<T>() > ctx.data_end() {
        return Err(());
    }
    Ok((start + off) as *mut T)
}

#[inline(always)]
pub fn get<T: Copy>(ctx: &XdpContext, off: usize) -> Result<T, ()> {
    // SAFETY: bounds checked by `at`; packet data has no alignment guarantee.
    at::<T>(ctx, off).map(|p| unsafe { core::ptr::read_unaligned(p) })
}

#[inline(always)]
pub fn put<T>(ctx: &XdpContext, off: usize, v: T) -> Result<(), ()> {
    // SAFETY: as in `get`.
    at::<T>(ctx, off).map(|p| unsafe { core::ptr::write_unaligned(p, v) })
}

/// Replaces an address (at `addr_off` in the IP header) and a port (at `port_off` in the
/// TCP header), fixing the IPv4 header checksum and the TCP checksum.
#[inline(always)]
fn rewrite(
    ctx: &XdpContext,
    pkt: &Packet,
    addr_off: (usize, usize),
    port_off: usize,
    addr: &[u32; 4],
    port: u16,
) -> Result<(), ()> {
    let check_off = pkt.l4 + TCP_CHECK;
    let mut tcp_check: u16 = get(ctx, check_off)?;
    if pkt.key.family == FAMILY_V4 {
        let off = pkt.l3 + addr_off.0;
        let old: u32 = get(ctx, off)?;
        let ip_check: u16 = get(ctx, pkt.l3 + V4_CHECK)?;
        put(
            ctx,
            pkt.l3 + V4_CHECK,
            csum::replace4(ip_check, old, addr[0]),
        )?;
        tcp_check = csum::replace4(tcp_check, old, addr[0]);
        put(ctx, off, addr[0])?;
    } else {
        let off = pkt.l3 + addr_off.1;
        let old: [u32; 4] = get(ctx, off)?;
        tcp_check = csum::replace16(tcp_check, &old, addr);
        put(ctx, off, *addr)?;
    }
    let poff = pkt.l4 + port_off;
    let old_port: u16 = get(ctx, poff)?;
    tcp_check = csum::replace2(tcp_check, old_port, port);
    put(ctx, poff, port)?;
    put(ctx, check_off, tcp_check)
}

/// Client -> VIP becomes client -> backend.
#[inline(always)]
pub fn rewrite_dst(ctx: &XdpContext, pkt: &Packet, addr: &[u32; 4], port: u16) -> Result<(), ()> {
    rewrite(ctx, pkt, (V4_DST, V6_DST), TCP_DPORT, addr, port)
}

/// Backend -> client becomes VIP -> client.
#[inline(always)]
pub fn rewrite_src(ctx: &XdpContext, pkt: &Packet, addr: &[u32; 4], port: u16) -> Result<(), ()> {
    rewrite(ctx, pkt, (V4_SRC, V6_SRC), TCP_SPORT, addr, port)
}

/// Why a packet has no next hop to be sent to: the counter that says so, and for a packet
/// longer than the egress MTU (`PassTooBig`, `DropDsrTooBig`, `DropTunnelTooBig`), that MTU
/// (for a tunnel, less the outer header).
#[derive(Clone, Copy)]
pub struct NoHop {
    pub why: Counter,
    pub mtu: u16,
}

impl From<Counter> for NoHop {
    fn from(why: Counter) -> Self {
        NoHop { why, mtu: 0 }
    }
}

/// A FIB answer: the next hop, and whether it is the destination itself on one of our links
/// (no router in between).
pub struct Route {
    pub hop: NextHop,
    pub on_link: bool,
}

/// The FIB's next hop for `src -> dst`, or why there is none to use: the neighbour's MAC is
/// not known yet (the stack resolves it, and sends the packet on), or no forwarding answer.
/// With `dsr`, the packet still goes to the VIP, so `dst` must be the next hop itself (on a
/// link of ours: a router would send the frame back to the VIP), and none of the reasons is
/// one the stack could help with: they are drop reasons. Through a tunnel (`outer`), the
/// question is the outer header's (from its source, longer by it), routers are fine, and the
/// MTU in the answer is what is left for the packet inside.
#[inline(always)]
pub fn next_hop(
    ctx: &XdpContext,
    pkt: &Packet,
    (src, dst): (&[u32; 4], &[u32; 4]),
    ports: (u16, u16),
    dsr: bool,
    outer: &Outer,
) -> Result<Route, NoHop> {
    // SAFETY: a plain C struct of integers and unions of integers; all zeroes is valid.
    let mut p: FibParams = unsafe { core::mem::zeroed() };
    let added = tunnel::overhead(pkt.key.family) & outer.mask as u16;
    p.l4_protocol = outer.pick(
        u32::from(pkt.key.proto),
        u32::from(tunnel::protocol(pkt.key.family)),
    ) as u8;
    p.sport = outer.pick(u32::from(ports.0), 0) as u16;
    p.dport = outer.pick(u32::from(ports.1), 0) as u16;
    p.__bindgen_anon_1.tot_len = pkt.len.saturating_add(added);
    p.ifindex = ctx.ingress_ifindex() as u32;
    if pkt.key.family == FAMILY_V4 {
        p.family = AF_INET;
        p.__bindgen_anon_2.tos = pkt.tos;
        p.__bindgen_anon_3.ipv4_src = outer.pick(src[0], outer.src[0]);
        p.__bindgen_anon_4.ipv4_dst = dst[0];
    } else {
        p.family = AF_INET6;
        p.__bindgen_anon_3.ipv6_src = [
            outer.pick(src[0], outer.src[0]),
            outer.pick(src[1], outer.src[1]),
            outer.pick(src[2], outer.src[2]),
            outer.pick(src[3], outer.src[3]),
        ];
        p.__bindgen_anon_4.ipv6_dst = *dst;
    }
    let asked = p.family;
    count(Counter::FibLookup);
    // SAFETY: `p` is a valid, fully initialised parameter block of the size we pass.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.ctx as *mut c_void,
            &mut p,
            size_of::<FibParams>() as i32,
            0,
        )
    };
    // Once it has a route, the FIB writes the route's gateway, if it has one, over the
    // destination (and an IPv6 gateway of an IPv4 route over the family), before it looks
    // for the neighbour.
    let resolved = rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS);
    let routed = resolved || rc == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH);
    // SAFETY: plain integers, written by the kernel or by us above.
    let (to, via) = unsafe {
        if pkt.key.family == FAMILY_V4 {
            ([dst[0], 0, 0, 0], [p.__bindgen_anon_4.ipv4_dst, 0, 0, 0])
        } else {
            (*dst, p.__bindgen_anon_4.ipv6_dst)
        }
    };
    let on_link = routed
        && p.family == asked
        && to[0] == via[0]
        && to[1] == via[1]
        && to[2] == via[2]
        && to[3] == via[3];
    if dsr && routed && !on_link && outer.mask == 0 {
        return Err(Counter::DropDsrRouted.into());
    }
    // SAFETY: a u16 either way. On success the kernel (5.12 on) writes the egress MTU over
    // `tot_len`; an older one leaves the length it checked, a smaller bound that still
    // holds. On FRAG_NEEDED it is the MTU.
    let mtu = unsafe { p.__bindgen_anon_1.mtu_result }.saturating_sub(added);
    if resolved && p.ifindex != 0 {
        Ok(Route {
            hop: NextHop {
                ifindex: p.ifindex,
                epoch: 0,
                dmac: p.dmac,
                smac: p.smac,
                mtu,
                _pad: 0,
            },
            on_link,
        })
    } else if rc == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        Err(reason(
            dsr,
            outer,
            [
                Counter::PassNoNeigh,
                Counter::DropDsrNoNeigh,
                Counter::DropTunnelNoNeigh,
            ],
        )
        .into())
    } else if rc == i64::from(BPF_FIB_LKUP_RET_FRAG_NEEDED) {
        Err(NoHop {
            why: reason(
                dsr,
                outer,
                [
                    Counter::PassTooBig,
                    Counter::DropDsrTooBig,
                    Counter::DropTunnelTooBig,
                ],
            ),
            mtu,
        })
    } else {
        Err(reason(
            dsr,
            outer,
            [
                Counter::PassFibOther,
                Counter::DropDsrFibOther,
                Counter::DropTunnelFibOther,
            ],
        )
        .into())
    }
}

/// Which of `[nat, dsr, tunnel]` is the reason for a VIP's packet that cannot be sent from
/// here. A translated packet is the stack's to route; one still addressed to the VIP is
/// not, so the others are drop reasons, each counted apart. Only on paths that end.
#[inline(always)]
pub fn reason(dsr: bool, outer: &Outer, [nat, direct, tunnel]: [Counter; 3]) -> Counter {
    match (dsr, outer.mask != 0) {
        (false, _) => nat,
        (true, false) => direct,
        (true, true) => tunnel,
    }
}

/// Whether a frame may leave through `ifindex`: the interface it came in on, or one the
/// program is attached to (`EGRESS`).
#[inline(always)]
pub fn can_send(ctx: &XdpContext, ifindex: u32) -> bool {
    ifindex == ctx.ingress_ifindex() as u32 || EGRESS.get(ifindex).is_some()
}

/// Sends the packet to `hop`: out of a NIC, or through the stack when there is no next hop
/// to use (`Err`: why), the frame is VLAN-tagged, or the next hop is out of an interface the
/// program is not attached to. With `dsr` the packet is still addressed to the VIP, which
/// the stack would not send to the backend: dropped instead. A tunnel VIP's goes inside its
/// `outer` header.
#[inline(always)]
pub fn send(
    ctx: &XdpContext,
    pkt: &Packet,
    hop: Result<NextHop, NoHop>,
    dsr: bool,
    outer: &Outer,
) -> u32 {
    let undeliverable = if dsr { XDP_DROP } else { XDP_PASS };
    if pkt.vlan {
        count(reason(
            dsr,
            outer,
            [
                Counter::PassVlan,
                Counter::DropDsrVlan,
                Counter::DropTunnelVlan,
            ],
        ));
        return undeliverable;
    }
    let hop = match hop {
        Ok(hop) => hop,
        Err(no) => {
            count(no.why);
            return undeliverable;
        }
    };
    // The target first: a frame that is not sent must reach the stack with our MAC and its
    // TTL, or the stack would not take it. The redirect only takes effect on return.
    let (action, sent) = if hop.ifindex == ctx.ingress_ifindex() as u32 {
        (XDP_TX, Counter::Tx)
    } else {
        // A frame in several buffers only to a driver that transmits those.
        let redirected = if multi_buffer(ctx) {
            EGRESS_FRAGS.redirect(hop.ifindex, 0)
        } else {
            EGRESS.redirect(hop.ifindex, 0)
        };
        match redirected {
            Ok(action) => (action, Counter::Redirect),
            Err(_) => {
                count(reason(
                    dsr,
                    outer,
                    [
                        Counter::PassEgress,
                        Counter::DropDsrEgress,
                        Counter::DropTunnelEgress,
                    ],
                ));
                return undeliverable;
            }
        }
    };
    // We are the router now, so the TTL is ours to decrement (the stack does it for the
    // packets we pass). The parser refused TTL <= 1.
    if decrement_ttl(ctx, pkt).is_err() {
        count(Counter::PassMalformed);
        return XDP_PASS;
    }
    if outer.mask != 0 {
        if let Err(why) = tunnel::encapsulate(ctx, pkt, &hop, (outer.src, outer.dst)) {
            count(why);
            return XDP_DROP;
        }
        count(Counter::Encapsulated);
    } else if put(ctx, 0, hop.dmac).is_err() || put(ctx, 6, hop.smac).is_err() {
        count(Counter::PassMalformed);
        return XDP_PASS;
    }
    count(sent);
    action
}

#[inline(always)]
fn decrement_ttl(ctx: &XdpContext, pkt: &Packet) -> Result<(), ()> {
    if pkt.key.family == FAMILY_V4 {
        // TTL shares a 16-bit checksum word with the protocol byte.
        let off = pkt.l3 + V4_TTL;
        let old: u16 = get(ctx, off)?;
        let mut bytes = old.to_ne_bytes();
        bytes[0] = bytes[0].wrapping_sub(1);
        let new = u16::from_ne_bytes(bytes);
        let check: u16 = get(ctx, pkt.l3 + V4_CHECK)?;
        put(ctx, pkt.l3 + V4_CHECK, csum::replace2(check, old, new))?;
        put(ctx, off, new)
    } else {
        put(ctx, pkt.l3 + V6_HOP_LIMIT, pkt.ttl - 1)
    }
}
