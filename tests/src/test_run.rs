//! The namespace that BPF_PROG_TEST_RUN tests and benchmarks run the program in: a gateway's
//! two links and the neighbours it forwards to, so that the program's FIB lookups have
//! answers. No packet is ever sent: test runs hand frames to the program directly.

use anyhow::{ensure, Result};

use crate::netns::Netns;

/// The gateway's client-side link (10.9.0.1/24, fd00:9::1/64) and its peer.
pub const MAC_G0: [u8; 6] = [0x02, 0, 0, 0, 0x09, 0x01];
pub const MAC_C0: [u8; 6] = [0x02, 0, 0, 0, 0x09, 0x02];
/// The gateway's server-side link (10.4.0.1/24, fd00:4::1/64) and its peer.
pub const MAC_G1: [u8; 6] = [0x02, 0, 0, 0, 0x04, 0x01];
pub const MAC_S0: [u8; 6] = [0x02, 0, 0, 0, 0x04, 0x02];

fn mac(m: [u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// A namespace `name` with veth pairs g0-c0 and g1-s0 (MACs above, both ends up), the
/// gateway's addresses on g0 and g1, forwarding on, and a permanent neighbour entry for each
/// of `neighbours` (address, MAC, device).
pub fn gateway_links(name: &str, neighbours: &[(&str, [u8; 6], &str)]) -> Result<Netns> {
    let ns = Netns::create(name)?;
    for (a, ma, b, mb) in [("g0", MAC_G0, "c0", MAC_C0), ("g1", MAC_G1, "s0", MAC_S0)] {
        let (ma, mb) = (mac(ma), mac(mb));
        ns.ip(&[
            "link", "add", a, "address", &ma, "type", "veth", "peer", "name", b, "address", &mb,
        ])?;
        ns.ip(&["link", "set", a, "up"])?;
        ns.ip(&["link", "set", b, "up"])?;
    }
    for (addr, dev) in [
        ("10.9.0.1/24", "g0"),
        ("10.4.0.1/24", "g1"),
        ("fd00:9::1/64", "g0"),
        ("fd00:4::1/64", "g1"),
    ] {
        let mut args = vec!["addr", "add", addr, "dev", dev];
        if addr.contains(':') {
            args.push("nodad");
        }
        ns.ip(&args)?;
    }
    for &(addr, m, dev) in neighbours {
        let m = mac(m);
        ns.ip(&[
            "neigh",
            "replace",
            addr,
            "lladdr",
            &m,
            "dev",
            dev,
            "nud",
            "permanent",
        ])?;
    }
    ns.sysctl("net.ipv4.ip_forward", "1")?;
    ns.sysctl("net.ipv6.conf.all.forwarding", "1")?;
    Ok(ns)
}

/// The index of interface `name` in the current namespace.
pub fn ifindex(name: &str) -> Result<u32> {
    let c = std::ffi::CString::new(name)?;
    // SAFETY: a NUL-terminated string that outlives the call.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    ensure!(i != 0, "no interface {name}");
    Ok(i)
}
