//! ICMP errors about our flows' packets, from routers beyond the gateway: "fragmentation
//! needed" (IPv4) or "packet too big" (IPv6) from a narrower link on the way, or
//! "destination unreachable". Each quotes the packet as the gateway translated it, so the
//! end that sent it would not find its connection in it, and without the smaller path MTU a
//! stream whose segments do not fit the narrow link stalls.
//!
//! - About a reply, from a router between the gateway and the client: sent to the VIP
//!   (the reply's source). It goes to the flow's backend translated back as the reply was
//!   before the gateway translated it (VIP to backend in the error's destination and the
//!   quoted source, the VIP's port to the backend's in the quoted source port); for a DSR
//!   VIP unchanged, since the backend holds the VIP and sent the reply as it is quoted.
//! - About a client's packet, from a router between the gateway and the server: sent to the
//!   client. Its quote goes back to what the client sent (the backend's address and port in
//!   the quoted destination become the VIP's), and the stack routes it on to the client as
//!   before.
//!
//! Errors about anything else go to the stack as before.

use aya_ebpf::programs::XdpContext;
use balancer_common::{csum, FlowKey, FAMILY_V4, FAMILY_V6, IPPROTO_TCP};

use crate::{
    icmp::{ICMP_HLEN, IPPROTO_ICMP, IPPROTO_ICMPV6, QUOTED_L4, V4_HLEN},
    nat::{get, put},
    parse::{frame_len, load, Packet, ETH_P_IP, ETH_P_IPV6, IPV6_HLEN},
};

const TCP_CHECK: usize = 16;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PACKET_TOO_BIG: u8 = 2;

/// An ICMP error that quotes a TCP packet from the address it is sent to: the packet as the
/// rest of the program needs it (`l3` the error's IP header, `l4` its ICMP header; the key
/// that of a packet answering the quoted one, so that it is looked up as such packets are:
/// for a reply quoted (VIP -> client), the client's flow to the VIP; for a client's packet
/// quoted (client -> backend), the backend's reply), and where the quoted IP and TCP headers
/// are.
pub struct Quoted {
    pub pkt: Packet,
    inner_l3: usize,
    inner_l4: usize,
}

/// The ICMP error this frame carries, if it is one about a TCP packet from the address it is
/// sent to. Only for frames the parser found not to be TCP.
#[inline(always)]
pub fn parse(ctx: &XdpContext) -> Option<Quoted> {
    let (proto, l3, vlan) = crate::parse::network(ctx).ok()?;
    match proto {
        ETH_P_IP => parse_v4(ctx, l3, vlan),
        ETH_P_IPV6 => parse_v6(ctx, l3, vlan),
        _ => None,
    }
}

#[inline(always)]
fn parse_v4(ctx: &XdpContext, l3: usize, vlan: bool) -> Option<Quoted> {
    let hdr: [u8; V4_HLEN] = load(ctx, l3).ok()?;
    // No options, not a fragment, ICMP.
    if hdr[0] != 0x45
        || hdr[9] != IPPROTO_ICMP
        || u16::from_be_bytes([hdr[6], hdr[7]]) & 0x3fff != 0
    {
        return None;
    }
    let len = u16::from_be_bytes([hdr[2], hdr[3]]);
    let icmp = l3 + V4_HLEN;
    let inner_l3 = icmp + ICMP_HLEN;
    let inner_l4 = inner_l3 + V4_HLEN;
    if usize::from(len) < inner_l4 + QUOTED_L4 - l3 || l3 + usize::from(len) > frame_len(ctx) {
        return None;
    }
    let kind: u8 = load(ctx, icmp).ok()?;
    let inner: [u8; V4_HLEN] = load(ctx, inner_l3).ok()?;
    if kind != ICMP_DEST_UNREACH || inner[0] != 0x45 || inner[9] != IPPROTO_TCP {
        return None;
    }
    let word = |b: &[u8; V4_HLEN], at: usize| {
        [
            u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]),
            0,
            0,
            0,
        ]
    };
    let (to, from, quoted_to) = (word(&hdr, 16), word(&inner, 12), word(&inner, 16));
    // About a packet from the address the error is sent to: the VIP, or a client.
    if to[0] != from[0] {
        return None;
    }
    let ports: [u16; 2] = load(ctx, inner_l4).ok()?;
    let key = answer_key(from, quoted_to, ports, FAMILY_V4);
    let ip = (hdr[8], hdr[1], hdr[6] & 0x40 != 0, len);
    Some(quoted(l3, vlan, key, ip, inner_l3))
}

#[inline(always)]
fn parse_v6(ctx: &XdpContext, l3: usize, vlan: bool) -> Option<Quoted> {
    let head: [u8; 8] = load(ctx, l3).ok()?;
    // ICMPv6 right after the header: extension headers are not walked, as for TCP.
    if head[0] >> 4 != 6 || head[6] != IPPROTO_ICMPV6 {
        return None;
    }
    let payload = usize::from(u16::from_be_bytes([head[4], head[5]]));
    let icmp = l3 + IPV6_HLEN;
    let inner_l3 = icmp + ICMP_HLEN;
    let inner_l4 = inner_l3 + IPV6_HLEN;
    if payload < inner_l4 + QUOTED_L4 - icmp || icmp + payload > frame_len(ctx) {
        return None;
    }
    let kind: u8 = load(ctx, icmp).ok()?;
    let inner: [u8; 8] = load(ctx, inner_l3).ok()?;
    if (kind != ICMPV6_DEST_UNREACH && kind != ICMPV6_PACKET_TOO_BIG)
        || inner[0] >> 4 != 6
        || inner[6] != IPPROTO_TCP
    {
        return None;
    }
    let to: [u32; 4] = load(ctx, l3 + 24).ok()?;
    let from: [u32; 4] = load(ctx, inner_l3 + 8).ok()?;
    let quoted_to: [u32; 4] = load(ctx, inner_l3 + 24).ok()?;
    if to[0] != from[0] || to[1] != from[1] || to[2] != from[2] || to[3] != from[3] {
        return None;
    }
    let ports: [u16; 2] = load(ctx, inner_l4).ok()?;
    let key = answer_key(from, quoted_to, ports, FAMILY_V6);
    let len = (IPV6_HLEN + payload).min(usize::from(u16::MAX)) as u16;
    Some(quoted(l3, vlan, key, (head[7], 0, true, len), inner_l3))
}

/// The error at `l3` whose quoted IP header is at `inner_l3`, about the flow `key`, with
/// its own (TTL, TOS, may not be fragmented, length).
#[inline(always)]
fn quoted(
    l3: usize,
    vlan: bool,
    key: FlowKey,
    (ttl, tos, df, len): (u8, u8, bool, u16),
    inner_l3: usize,
) -> Quoted {
    let inner_l4 = inner_l3
        + if key.family == FAMILY_V4 {
            V4_HLEN
        } else {
            IPV6_HLEN
        };
    Quoted {
        pkt: Packet {
            l3,
            l4: inner_l3 - ICMP_HLEN,
            key,
            tcp_flags: 0,
            ttl,
            tos,
            df,
            len,
            vlan,
        },
        inner_l3,
        inner_l4,
    }
}

/// The key of a packet answering the quoted `from:ports[0] -> to:ports[1]`.
#[inline(always)]
fn answer_key(from: [u32; 4], to: [u32; 4], ports: [u16; 2], family: u8) -> FlowKey {
    FlowKey {
        src: to,
        dst: from,
        sport: ports[1],
        dport: ports[0],
        proto: IPPROTO_TCP,
        family,
        _pad: [0; 2],
    }
}

/// Which side of the gateway an error goes on to, and so which end of the quoted packet the
/// gateway's translation is undone at.
#[derive(Clone, Copy, PartialEq)]
pub enum Back {
    /// An error about a reply, quoted from the VIP: to the backend, whose address goes into
    /// the error's destination and the quoted source, and its port into the quoted source
    /// port.
    ToBackend,
    /// An error about a client's packet, quoted as sent to the backend: to the client, with
    /// the VIP's address and port in the quoted destination, as the client sent it. The
    /// error's own addresses stay.
    ToClient,
}

/// Rewrites the error as `back` says, with `addr:port`, and every checksum that covers what
/// changed follows (RFC 1624): the error's IPv4 header, the quoted IPv4 header, the quoted
/// TCP checksum where the router quoted that far, and the ICMP checksum over all of these
/// (over the error's destination too, for ICMPv6).
#[inline(always)]
pub fn translate(
    ctx: &XdpContext,
    q: &Quoted,
    addr: &[u32; 4],
    port: u16,
    back: Back,
) -> Result<(), ()> {
    let pkt = &q.pkt;
    let outer = back == Back::ToBackend;
    // Offsets of the quoted address (IPv4, IPv6) and port that change.
    let (at4, at6, port_at) = if outer { (12, 8, 0) } else { (16, 24, 2) };
    let check_off = pkt.l4 + 2;
    let mut check: u16 = get(ctx, check_off)?;
    let port_off = q.inner_l4 + port_at;
    let old_port: u16 = get(ctx, port_off)?;
    // Within the error, not the frame's padding.
    let tcp_check_off = q.inner_l4 + TCP_CHECK;
    let quoted_check = tcp_check_off + 2 <= pkt.l3 + usize::from(pkt.len);
    let tcp_check: Option<u16> = if quoted_check {
        Some(get(ctx, tcp_check_off)?)
    } else {
        None
    };
    let new_tcp_check = if pkt.key.family == FAMILY_V4 {
        let old: u32 = get(ctx, q.inner_l3 + at4)?;
        if outer {
            let ip_check: u16 = get(ctx, pkt.l3 + 10)?;
            put(ctx, pkt.l3 + 10, csum::replace4(ip_check, old, addr[0]))?;
            put(ctx, pkt.l3 + 16, addr[0])?;
        }
        let inner_check: u16 = get(ctx, q.inner_l3 + 10)?;
        let new_inner_check = csum::replace4(inner_check, old, addr[0]);
        put(ctx, q.inner_l3 + 10, new_inner_check)?;
        put(ctx, q.inner_l3 + at4, addr[0])?;
        check = csum::replace4(check, old, addr[0]);
        check = csum::replace2(check, inner_check, new_inner_check);
        tcp_check.map(|c| csum::replace4(c, old, addr[0]))
    } else {
        let old: [u32; 4] = get(ctx, q.inner_l3 + at6)?;
        if outer {
            // The pseudo-header's destination.
            put(ctx, pkt.l3 + 24, *addr)?;
            check = csum::replace16(check, &old, addr);
        }
        put(ctx, q.inner_l3 + at6, *addr)?;
        check = csum::replace16(check, &old, addr);
        tcp_check.map(|c| csum::replace16(c, &old, addr))
    };
    if let (Some(old), Some(new)) = (tcp_check, new_tcp_check) {
        let new = csum::replace2(new, old_port, port);
        put(ctx, tcp_check_off, new)?;
        check = csum::replace2(check, old, new);
    }
    put(ctx, port_off, port)?;
    check = csum::replace2(check, old_port, port);
    put(ctx, check_off, check)
}
