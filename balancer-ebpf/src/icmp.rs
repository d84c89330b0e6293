//! "Too big" answers. A packet longer than the MTU towards its next hop, that may not be
//! fragmented (don't-fragment set, or IPv6), is answered here with the ICMP error path MTU
//! discovery needs, instead of reaching the stack translated: the stack's error would quote
//! the translated addresses, which the sender has no connection for, so it would never learn
//! the smaller MTU. The answer quotes the packet as the sender sent it, comes from the
//! address it was sent to, and goes back out of the interface it came in on.

use core::ffi::c_void;

use aya_ebpf::{
    bindings::{bpf_check_mtu_ret::BPF_MTU_CHK_RET_SUCCESS, xdp_action::XDP_TX},
    helpers::{bpf_check_mtu, bpf_xdp_adjust_head, bpf_xdp_adjust_tail},
    programs::XdpContext,
};
use balancer_common::{csum, FAMILY_V4};

use crate::{
    nat::{get, put},
    parse::{frame_len, Packet, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IPV6_HLEN},
};

pub const V4_HLEN: usize = 20;
pub const ICMP_HLEN: usize = 8;
/// What is quoted of the packet past its IP header: the TCP ports and sequence number, by
/// which the sender's stack finds its connection (8 bytes, as RFC 792 asks for IPv4).
pub const QUOTED_L4: usize = 8;
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_ICMPV6: u8 = 58;
const ANSWER_TTL: u8 = 64;

/// Whether `pkt`, too big for an MTU, gets an answer rather than the stack: not a VLAN
/// frame (it would have to leave through the VLAN device), not an IPv4 packet that may be
/// fragmented (the stack fragments it on), and not one longer than the interface it came
/// in on carries: that one was coalesced by the stack (GRO, which a program attached in
/// generic mode sees), and the stack splits it again on the way out.
#[inline(always)]
pub fn answers(ctx: &XdpContext, pkt: &Packet) -> bool {
    if pkt.vlan || (pkt.key.family == FAMILY_V4 && !pkt.df) {
        return false;
    }
    // In: the packet's L3 length (the helper would take the first buffer's length for 0,
    // short of a multi-buffer frame's); out: the ingress MTU, unused. Interface 0: the
    // ingress.
    let mut mtu = u32::from(pkt.len);
    // SAFETY: a helper call on this program's own context, with a valid pointer.
    let fits = unsafe { bpf_check_mtu(ctx.ctx as *mut c_void, 0, &mut mtu, 0, 0) };
    fits == i64::from(BPF_MTU_CHK_RET_SUCCESS)
}

/// Turns the frame into the ICMP "fragmentation needed" (IPv4) or "packet too big" (IPv6)
/// answer to `pkt` for `mtu`, and returns its verdict. `None` when the frame could not grow,
/// left as it was; the packet then takes the path it would have without an answer.
#[inline(always)]
pub fn too_big(ctx: &XdpContext, pkt: &Packet, mtu: u16) -> Option<u32> {
    let v4 = pkt.key.family == FAMILY_V4;
    let (ip_hlen, quoted) = if v4 {
        (V4_HLEN, V4_HLEN + QUOTED_L4)
    } else {
        (IPV6_HLEN, IPV6_HLEN + QUOTED_L4)
    };
    let grow = ip_hlen + ICMP_HLEN;
    // SAFETY: a helper call on this program's own context.
    if unsafe { bpf_xdp_adjust_head(ctx.ctx, -(grow as i32)) } != 0 {
        return None;
    }
    // Old frame from `grow` on: its Ethernet header, then the packet that is quoted, which
    // is already where the answer quotes it. The parser checked that the IP header and 20
    // bytes of TCP were there, so nothing below can be out of bounds; a check that fails
    // anyway drops the half-built frame.
    let built = if v4 {
        build_v4(ctx, grow, mtu)
    } else {
        build_v6(ctx, grow, mtu)
    };
    let len = ETH_HLEN + grow + quoted;
    // From the helper (every buffer): the verifier allows no arithmetic on the end pointer.
    let trim = frame_len(ctx) as i32 - len as i32;
    // SAFETY: as above; the frame is at least `len` long, so this only shrinks it.
    if built.is_err() || unsafe { bpf_xdp_adjust_tail(ctx.ctx, -trim) } != 0 {
        return Some(aya_ebpf::bindings::xdp_action::XDP_DROP);
    }
    Some(XDP_TX)
}

/// Ethernet header of the answer: back to the MAC the packet came from. In pieces that fit
/// in registers: the main path leaves this one almost no stack.
#[inline(always)]
fn ethernet(ctx: &XdpContext, old: usize, proto: u16) -> Result<(), ()> {
    let (dst_hi, dst_lo): (u32, u16) = (get(ctx, old)?, get(ctx, old + 4)?);
    let (src_hi, src_lo): (u16, u32) = (get(ctx, old + 6)?, get(ctx, old + 8)?);
    put(ctx, 0, src_hi)?;
    put(ctx, 2, src_lo)?;
    put(ctx, 6, dst_hi)?;
    put(ctx, 10, dst_lo)?;
    put(ctx, 12, proto.to_be())
}

#[inline(always)]
fn build_v4(ctx: &XdpContext, grow: usize, mtu: u16) -> Result<(), ()> {
    let ip = ETH_HLEN;
    let icmp = ip + V4_HLEN;
    let quoted = ETH_HLEN + grow;
    ethernet(ctx, grow, ETH_P_IP)?;
    let sender: u32 = get(ctx, quoted + 12)?;
    let to: u32 = get(ctx, quoted + 16)?;
    let total = (V4_HLEN + ICMP_HLEN + V4_HLEN + QUOTED_L4) as u16;
    // Version and IHL, TOS, total length; id, flags and fragment offset all 0.
    put(ctx, ip, u32::to_be(0x4500_0000 | u32::from(total)))?;
    put(ctx, ip + 4, 0u32)?;
    put(
        ctx,
        ip + 8,
        u16::from_be_bytes([ANSWER_TTL, IPPROTO_ICMP]).to_be(),
    )?;
    put(ctx, ip + 10, 0u16)?;
    put(ctx, ip + 12, to)?;
    put(ctx, ip + 16, sender)?;
    put(
        ctx,
        ip + 10,
        csum::finish(sum::<{ V4_HLEN / 4 }>(ctx, ip, 0)?),
    )?;
    // Destination unreachable, fragmentation needed; the next hop's MTU in the low half.
    put(ctx, icmp, u16::from_be_bytes([3, 4]).to_be())?;
    put(ctx, icmp + 2, 0u32)?;
    put(ctx, icmp + 6, mtu.to_be())?;
    const WORDS: usize = (ICMP_HLEN + V4_HLEN + QUOTED_L4) / 4;
    put(ctx, icmp + 2, csum::finish(sum::<WORDS>(ctx, icmp, 0)?))
}

#[inline(always)]
fn build_v6(ctx: &XdpContext, grow: usize, mtu: u16) -> Result<(), ()> {
    let ip = ETH_HLEN;
    let icmp = ip + IPV6_HLEN;
    let quoted = ETH_HLEN + grow;
    ethernet(ctx, grow, ETH_P_IPV6)?;
    let payload = (ICMP_HLEN + IPV6_HLEN + QUOTED_L4) as u16;
    put(ctx, ip, 0x6000_0000u32.to_be())?;
    put(ctx, ip + 4, payload.to_be())?;
    put(
        ctx,
        ip + 6,
        u16::from_be_bytes([IPPROTO_ICMPV6, ANSWER_TTL]).to_be(),
    )?;
    // Source: where the packet was going; destination: its sender. In 64-bit halves.
    let to: u64 = get(ctx, quoted + 24)?;
    put(ctx, ip + 8, to)?;
    let to: u64 = get(ctx, quoted + 32)?;
    put(ctx, ip + 16, to)?;
    let sender: u64 = get(ctx, quoted + 8)?;
    put(ctx, ip + 24, sender)?;
    let sender: u64 = get(ctx, quoted + 16)?;
    put(ctx, ip + 32, sender)?;
    // Packet too big: code 0, then the MTU as 32 bits.
    put(ctx, icmp, u16::from_be_bytes([2, 0]).to_be())?;
    put(ctx, icmp + 2, 0u16)?;
    put(ctx, icmp + 4, u32::from(mtu).to_be())?;
    // The pseudo-header: both addresses (32 bytes from `ip + 8`), the length and the next
    // header, each as a 32-bit big-endian word.
    let pseudo = sum::<8>(ctx, ip + 8, 0)?
        + u32::from(payload.to_be())
        + u32::from(u16::from(IPPROTO_ICMPV6).to_be());
    const WORDS: usize = (ICMP_HLEN + IPV6_HLEN + QUOTED_L4) / 4;
    put(
        ctx,
        icmp + 2,
        csum::finish(sum::<WORDS>(ctx, icmp, pseudo)?),
    )
}

/// `start` plus the one's-complement sum of the `N` 32-bit words of the frame from `off`
/// (as 16-bit halves). One bounds check for all of them: per-word checks in a loop are
/// rewritten by LLVM into arithmetic on the end pointer, which the verifier refuses.
#[inline(always)]
pub fn sum<const N: usize>(ctx: &XdpContext, off: usize, start: u32) -> Result<u32, ()> {
    let first = ctx.data() + off;
    if first + 4 * N > ctx.data_end() {
        return Err(());
    }
    let mut total = start;
    let mut i = 0;
    while i < N {
        // SAFETY: within the bounds checked above; no alignment guarantee.
        let w = unsafe { core::ptr::read_unaligned((first + 4 * i) as *const u32) };
        total += csum::halves(w);
        i += 1;
    }
    Ok(total)
}
