//! The backend's half of `forwarding = "tunnel"`: takes the outer header off the IPIP and
//! IP6IP6 packets a gateway in `DECAP_PEERS` sends, so that the stack receives the client's
//! packet, to the VIP, as the client sent it. For backends whose kernel has no `ipip` or
//! `ip6tnl` module, and to spare the tunnel device's trip through the stack. Anything else
//! passes untouched.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

use core::mem::size_of;

use aya_ebpf::{
    bindings::xdp_action::XDP_PASS,
    helpers::bpf_xdp_adjust_head,
    macros::{map, xdp},
    maps::{HashMap, PerCpuArray},
    programs::XdpContext,
};
use balancer_common::{
    csum, DecapCounter, TunnelPeer, FAMILY_V4, FAMILY_V6, IPPROTO_IPIP, IPPROTO_IPV6,
    MAX_TUNNEL_PEERS,
};

/// Gateways (the outer source address) whose tunnelled packets are taken apart. Written
/// once by `balancer-agent decap` before it attaches.
#[map]
static DECAP_PEERS: HashMap<TunnelPeer, u8> = HashMap::with_max_entries(MAX_TUNNEL_PEERS, 0);

/// One per-CPU count per `DecapCounter`.
#[map]
static DECAP_COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(DecapCounter::COUNT, 0);

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const V4_HLEN: usize = 20;
const V6_HLEN: usize = 40;

/// Multi-buffer aware (`xdp.frags`): it reads and moves only headers, in the first buffer.
#[xdp(frags)]
pub fn decap(ctx: XdpContext) -> u32 {
    count(DecapCounter::Packets);
    count(match strip(&ctx) {
        Ok(()) => DecapCounter::Decapsulated,
        Err(why) => why,
    });
    XDP_PASS
}

#[inline(always)]
fn count(c: DecapCounter) {
    if let Some(n) = DECAP_COUNTERS.get_ptr_mut(c as u32) {
        // SAFETY: this CPU's slot; nothing else writes it while the program runs here.
        unsafe { *n += 1 };
    }
}

#[inline(always)]
fn load<T: Copy>(ctx: &XdpContext, off: usize) -> Result<T, DecapCounter> {
    if ctx.data() + off + size_of::<T>() > ctx.data_end() {
        return Err(DecapCounter::PassMalformed);
    }
    // SAFETY: in bounds, checked above; packet data has no alignment guarantee.
    Ok(unsafe { core::ptr::read_unaligned((ctx.data() + off) as *const T) })
}

#[inline(always)]
fn store<T>(ctx: &XdpContext, off: usize, v: T) -> Result<(), DecapCounter> {
    if ctx.data() + off + size_of::<T>() > ctx.data_end() {
        return Err(DecapCounter::PassMalformed);
    }
    // SAFETY: as in `load`.
    unsafe { core::ptr::write_unaligned((ctx.data() + off) as *mut T, v) };
    Ok(())
}

/// Takes the outer header off a peer's tunnelled packet, or says why not. Untagged frames
/// only: a tunnel that arrives on a VLAN goes to its VLAN device, where the kernel's own
/// tunnel device can take it.
#[inline(always)]
fn strip(ctx: &XdpContext) -> Result<(), DecapCounter> {
    let proto = u16::from_be(load(ctx, 12).map_err(|_| DecapCounter::PassNotTunnel)?);
    let (outer, family, addr) = match proto {
        ETH_P_IP => {
            let hdr: [u32; V4_HLEN / 4] =
                load(ctx, ETH_HLEN).map_err(|_| DecapCounter::PassNotTunnel)?;
            let bytes = hdr[0].to_ne_bytes();
            let more = hdr[1].to_ne_bytes();
            let proto = hdr[2].to_ne_bytes()[1];
            // No options, not a fragment: the gateway's outer header has neither (it sets
            // don't-fragment), so such a packet is someone else's.
            if bytes[0] != 0x45 || proto != IPPROTO_IPIP || (more[2] & 0x3f) | more[3] != 0 {
                return Err(DecapCounter::PassNotTunnel);
            }
            let mut sum = 0;
            let mut i = 0;
            while i < hdr.len() {
                sum += csum::halves(hdr[i]);
                i += 1;
            }
            if csum::finish(sum) != 0 {
                return Err(DecapCounter::PassMalformed);
            }
            (V4_HLEN, FAMILY_V4, [hdr[3], 0, 0, 0])
        }
        ETH_P_IPV6 => {
            let next: u8 = load(ctx, ETH_HLEN + 6).map_err(|_| DecapCounter::PassNotTunnel)?;
            if next != IPPROTO_IPV6 {
                return Err(DecapCounter::PassNotTunnel);
            }
            (V6_HLEN, FAMILY_V6, load::<[u32; 4]>(ctx, ETH_HLEN + 8)?)
        }
        _ => return Err(DecapCounter::PassNotTunnel),
    };
    let peer = TunnelPeer {
        addr,
        family,
        _pad: [0; 3],
    };
    // SAFETY: a lookup whose value is not kept.
    if unsafe { DECAP_PEERS.get(peer) }.is_none() {
        return Err(DecapCounter::PassNotPeer);
    }
    // The inner packet is of the outer's family: IPv4 in IPv4, IPv6 in IPv6.
    let version: u8 = load(ctx, ETH_HLEN + outer)?;
    if version >> 4 != family {
        return Err(DecapCounter::PassMalformed);
    }
    // The MAC addresses move up to just before the inner packet, then the frame starts
    // there.
    let macs: [u8; 12] = load(ctx, 0)?;
    let ether_type = if family == FAMILY_V4 {
        ETH_P_IP
    } else {
        ETH_P_IPV6
    };
    store(ctx, outer, macs)?;
    store(ctx, outer + 12, ether_type.to_be())?;
    // SAFETY: a helper call on this program's own context; the frame is longer than
    // `outer` (the inner packet's first byte was read above).
    if unsafe { bpf_xdp_adjust_head(ctx.ctx, outer as i32) } != 0 {
        return Err(DecapCounter::PassMalformed);
    }
    Ok(())
}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

#[cfg(not(target_arch = "bpf"))]
fn main() {}
