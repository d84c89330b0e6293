//! Header parsing. Every read is bounds-checked against `data_end`; anything this program
//! does not fully understand is reported as a pass reason so that the caller leaves the
//! packet untouched.
//!
//! A frame may come in several buffers (XDP multi-buffer, for MTUs past a page: the program
//! is loaded as `xdp.frags`). `data..data_end` is then only the first buffer, which holds
//! the headers; the lengths in them are checked against the whole frame's ([`frame_len`]).

use core::mem::size_of;

use aya_ebpf::{helpers::bpf_xdp_get_buff_len, programs::XdpContext};
use balancer_common::{Counter, FlowKey, FAMILY_V4, FAMILY_V6, IPPROTO_TCP};

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
pub const IPV6_HLEN: usize = 40;
const TCP_HLEN: usize = 20;

/// What the rest of the program needs to know about a TCP packet.
pub struct Packet {
    /// Offsets of the IP and TCP headers from the start of the frame.
    pub l3: usize,
    pub l4: usize,
    pub key: FlowKey,
    pub tcp_flags: u8,
    pub ttl: u8,
    /// IPv4's TOS, IPv6's traffic class.
    pub tos: u8,
    /// May not be fragmented on the way: IPv4 with don't-fragment set, and all of IPv6.
    pub df: bool,
    /// Length of the IP packet (header and payload), host order.
    pub len: u16,
    pub vlan: bool,
}

#[inline(always)]
pub fn load<T: Copy>(ctx: &XdpContext, off: usize) -> Result<T, Counter> {
    let start = ctx.data();
    if start + off + size_of::<T>() > ctx.data_end() {
        return Err(Counter::PassTruncated);
    }
    // SAFETY: in bounds, checked above; packet data has no alignment guarantee.
    Ok(unsafe { core::ptr::read_unaligned((start + off) as *const T) })
}

/// The whole frame's length, every buffer of it.
#[inline(always)]
pub fn frame_len(ctx: &XdpContext) -> usize {
    // SAFETY: a helper call on this program's own context.
    unsafe { bpf_xdp_get_buff_len(ctx.ctx) as usize }
}

/// Whether the frame came in several buffers.
#[inline(always)]
pub fn multi_buffer(ctx: &XdpContext) -> bool {
    frame_len(ctx) > ctx.data_end() - ctx.data()
}

#[inline(always)]
fn load_be16(ctx: &XdpContext, off: usize) -> Result<u16, Counter> {
    load::<u16>(ctx, off).map(u16::from_be)
}

/// The EtherType past the VLAN tags, where the network header starts, and whether the frame
/// is tagged.
#[inline(always)]
pub fn network(ctx: &XdpContext) -> Result<(u16, usize, bool), Counter> {
    let mut proto = load_be16(ctx, 12)?;
    let mut l3 = ETH_HLEN;
    let mut vlan = false;
    // At most two tags (802.1ad outer, 802.1Q inner); a bounded loop the verifier accepts.
    for _ in 0..2 {
        if proto == ETH_P_8021Q || proto == ETH_P_8021AD {
            proto = load_be16(ctx, l3 + 2)?;
            l3 += 4;
            vlan = true;
        }
    }
    Ok((proto, l3, vlan))
}

#[inline(always)]
pub fn parse(ctx: &XdpContext) -> Result<Packet, Counter> {
    let (proto, l3, vlan) = network(ctx)?;
    let frame_len = frame_len(ctx);
    match proto {
        ETH_P_IP => parse_v4(ctx, l3, frame_len, vlan),
        ETH_P_IPV6 => parse_v6(ctx, l3, frame_len, vlan),
        _ => Err(Counter::PassNotIp),
    }
}

#[inline(always)]
fn parse_v4(ctx: &XdpContext, l3: usize, frame_len: usize, vlan: bool) -> Result<Packet, Counter> {
    let hdr: [u8; 20] = load(ctx, l3)?;
    if hdr[0] >> 4 != 4 {
        return Err(Counter::PassMalformed);
    }
    let ihl = usize::from(hdr[0] & 0x0f) * 4;
    if ihl < 20 {
        return Err(Counter::PassMalformed);
    }
    if ihl > 20 {
        return Err(Counter::PassIpOptions);
    }
    let tot_len = u16::from_be_bytes([hdr[2], hdr[3]]);
    // Shorter than its own header: the TCP length below would wrap.
    if usize::from(tot_len) < ihl {
        return Err(Counter::PassMalformed);
    }
    if l3 + usize::from(tot_len) > frame_len {
        return Err(Counter::PassTruncated);
    }
    if (u16::from_be_bytes([hdr[6], hdr[7]]) & 0x3fff) != 0 {
        return Err(Counter::PassFragment);
    }
    if hdr[9] != IPPROTO_TCP {
        return Err(Counter::PassNotTcp);
    }
    let l4 = l3 + 20;
    let (sport, dport, flags) = parse_tcp(ctx, l4, usize::from(tot_len) - 20)?;
    Ok(Packet {
        l3,
        l4,
        key: FlowKey {
            src: [
                u32::from_ne_bytes([hdr[12], hdr[13], hdr[14], hdr[15]]),
                0,
                0,
                0,
            ],
            dst: [
                u32::from_ne_bytes([hdr[16], hdr[17], hdr[18], hdr[19]]),
                0,
                0,
                0,
            ],
            sport,
            dport,
            proto: IPPROTO_TCP,
            family: FAMILY_V4,
            _pad: [0; 2],
        },
        tcp_flags: flags,
        ttl: hdr[8],
        tos: hdr[1],
        df: hdr[6] & 0x40 != 0,
        len: tot_len,
        vlan,
    })
}

#[inline(always)]
fn parse_v6(ctx: &XdpContext, l3: usize, frame_len: usize, vlan: bool) -> Result<Packet, Counter> {
    let head: [u8; 8] = load(ctx, l3)?;
    if head[0] >> 4 != 6 {
        return Err(Counter::PassMalformed);
    }
    let src: [u32; 4] = load(ctx, l3 + 8)?;
    let dst: [u32; 4] = load(ctx, l3 + 24)?;
    let payload = usize::from(u16::from_be_bytes([head[4], head[5]]));
    if l3 + IPV6_HLEN + payload > frame_len {
        return Err(Counter::PassTruncated);
    }
    match head[6] {
        IPPROTO_TCP => {}
        // Hop-by-hop, routing, fragment, ESP, AH, destination options, mobility, HIP, shim6,
        // and the experimental values: headers we would have to walk, so we do not.
        0 | 43 | 44 | 50 | 51 | 60 | 135 | 139 | 140 | 253 | 254 => {
            return Err(Counter::PassIpv6ExtHeader)
        }
        _ => return Err(Counter::PassNotTcp),
    }
    let l4 = l3 + IPV6_HLEN;
    let (sport, dport, flags) = parse_tcp(ctx, l4, payload)?;
    let len = IPV6_HLEN + payload;
    Ok(Packet {
        l3,
        l4,
        key: FlowKey {
            src,
            dst,
            sport,
            dport,
            proto: IPPROTO_TCP,
            family: FAMILY_V6,
            _pad: [0; 2],
        },
        tcp_flags: flags,
        ttl: head[7],
        tos: head[0] << 4 | head[1] >> 4,
        df: true,
        // With its header, a payload of near 64 KiB (a coalesced frame, in generic mode)
        // passes 16 bits: saturated rather than wrapped, it is too big for any MTU still.
        len: len.min(usize::from(u16::MAX)) as u16,
        vlan,
    })
}

/// Returns (source port, destination port) in network order, and the flags.
#[inline(always)]
fn parse_tcp(ctx: &XdpContext, l4: usize, l4_len: usize) -> Result<(u16, u16, u8), Counter> {
    let hdr: [u8; TCP_HLEN] = load(ctx, l4)?;
    let doff = usize::from(hdr[12] >> 4) * 4;
    if doff < TCP_HLEN || doff > l4_len {
        return Err(Counter::PassMalformed);
    }
    // The options must be there too, in the first buffer: a frame cut inside them is
    // truncated (a driver that splits a frame puts at least the headers first).
    if l4 + doff > ctx.data_end() - ctx.data() {
        return Err(Counter::PassTruncated);
    }
    Ok((
        u16::from_ne_bytes([hdr[0], hdr[1]]),
        u16::from_ne_bytes([hdr[2], hdr[3]]),
        hdr[13],
    ))
}
