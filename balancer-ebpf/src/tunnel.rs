//! The outer header of a tunnel VIP's packets (`VIP_F_TUNNEL`): IPv4 in IPv4 (RFC 2003) or
//! IPv6 in IPv6 (RFC 2473), from the VIP's `tunnel_src` to the backend, which may be any
//! number of routers away. The backend takes the header off (its kernel's `ipip` or
//! `ip6tnl` device, or `balancer-agent decap`) and finds the client's packet as the client
//! sent it.

use aya_ebpf::{helpers::bpf_xdp_adjust_head, programs::XdpContext};
use balancer_common::{
    csum, tunnel_flow_label, Counter, NextHop, FAMILY_V4, IPPROTO_IPIP, IPPROTO_IPV6,
};

use crate::{
    icmp::{sum, V4_HLEN},
    nat::{get, put},
    parse::{Packet, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IPV6_HLEN},
};

/// The outer header's TTL or hop limit: it starts a journey of its own (the inner one's
/// was decremented for this hop and is left alone inside the tunnel).
const OUTER_TTL: u8 = 64;

/// The outer header's TOS or traffic class: the inner packet's DSCP, and no ECN capability
/// (RFC 6040's compatibility mode), so that a router on the way drops rather than marks
/// congestion on the outer header, which `decap` does not carry over to the inner one.
#[inline(always)]
fn outer_tos(inner: u8) -> u8 {
    inner & 0xfc
}

/// Bytes the outer header adds to a packet of `family`.
#[inline(always)]
pub fn overhead(family: u8) -> u16 {
    if family == FAMILY_V4 {
        V4_HLEN as u16
    } else {
        IPV6_HLEN as u16
    }
}

/// The outer header's protocol for a packet of `family`.
#[inline(always)]
pub fn protocol(family: u8) -> u8 {
    if family == FAMILY_V4 {
        IPPROTO_IPIP
    } else {
        IPPROTO_IPV6
    }
}

/// Grows the untagged frame of `pkt` by the outer header from `src` to `dst`, and writes that
/// header and the Ethernet header to `hop`. The inner packet is not moved: it stays where it
/// is in memory, the frame now starts earlier.
#[inline(always)]
pub fn encapsulate(
    ctx: &XdpContext,
    pkt: &Packet,
    hop: &NextHop,
    (src, dst): (&[u32; 4], &[u32; 4]),
) -> Result<(), Counter> {
    let v4 = pkt.key.family == FAMILY_V4;
    let grow = usize::from(overhead(pkt.key.family));
    // SAFETY: a helper call on this program's own context.
    if unsafe { bpf_xdp_adjust_head(ctx.ctx, -(grow as i32)) } != 0 {
        return Err(Counter::DropTunnelHeadroom);
    }
    // The parser checked the inner headers' bounds before the frame grew, so no check below
    // fails; one that did would leave a half-built frame, which is dropped.
    let built = if v4 {
        outer_v4(ctx, pkt, (src[0], dst[0]))
    } else {
        outer_v6(ctx, pkt, (src, dst))
    };
    built
        .and_then(|()| put(ctx, 0, hop.dmac))
        .and_then(|()| put(ctx, 6, hop.smac))
        .and_then(|()| put(ctx, 12, if v4 { ETH_P_IP } else { ETH_P_IPV6 }.to_be()))
        .map_err(|()| Counter::PassMalformed)
}

#[inline(always)]
fn outer_v4(ctx: &XdpContext, pkt: &Packet, (src, dst): (u32, u32)) -> Result<(), ()> {
    let ip = ETH_HLEN;
    let inner = ip + V4_HLEN;
    let total = pkt.len.checked_add(V4_HLEN as u16).ok_or(())?;
    // Don't-fragment always: every outer packet shares its addresses and protocol, so the
    // clients' identifications could collide in a reassembly on the way; a packet that
    // needs fragmenting is answered (or dropped) here instead. The identification is the
    // inner packet's, as good as any on a packet never fragmented (RFC 6864).
    let id: u16 = get(ctx, inner + 4)?;
    put(
        ctx,
        ip,
        u32::to_be(0x4500_0000 | u32::from(outer_tos(pkt.tos)) << 16 | u32::from(total)),
    )?;
    put(ctx, ip + 4, id)?;
    put(ctx, ip + 6, 0x4000u16.to_be())?;
    put(
        ctx,
        ip + 8,
        u16::from_be_bytes([OUTER_TTL, IPPROTO_IPIP]).to_be(),
    )?;
    put(ctx, ip + 10, 0u16)?;
    put(ctx, ip + 12, src)?;
    put(ctx, ip + 16, dst)?;
    put(
        ctx,
        ip + 10,
        csum::finish(sum::<{ V4_HLEN / 4 }>(ctx, ip, 0)?),
    )
}

#[inline(always)]
fn outer_v6(ctx: &XdpContext, pkt: &Packet, (src, dst): (&[u32; 4], &[u32; 4])) -> Result<(), ()> {
    let ip = ETH_HLEN;
    let label = tunnel_flow_label(&pkt.key);
    let class = u32::from(outer_tos(pkt.tos)) << 20;
    put(ctx, ip, u32::to_be(0x6000_0000 | class | label))?;
    put(ctx, ip + 4, pkt.len.to_be())?;
    put(
        ctx,
        ip + 6,
        u16::from_be_bytes([IPPROTO_IPV6, OUTER_TTL]).to_be(),
    )?;
    put(ctx, ip + 8, *src)?;
    put(ctx, ip + 24, *dst)
}
