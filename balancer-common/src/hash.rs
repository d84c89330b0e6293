//! The flow hash that indexes Maglev tables. The XDP program computes it per new flow; the
//! agent and the tests compute it to predict where a flow lands, so it lives here once.

use crate::{FlowKey, ALTERNATES_SIZE, MAGLEV_SIZE};

const K: u64 = 0x9e37_79b9_7f4a_7c15;

#[inline(always)]
fn mix(h: u64, w: u32) -> u64 {
    let h = (h ^ u64::from(w)).wrapping_mul(K);
    h ^ (h >> 32)
}

/// Hash of a flow's 5-tuple (client address and port, VIP address and port, protocol).
/// Words are taken as they sit in memory, so kernel and user space agree on little-endian
/// hosts (the only BPF target we build, `bpfel`).
#[inline(always)]
pub fn flow_hash(k: &FlowKey) -> u32 {
    hash64(k) as u32
}

/// Where a new flow draws: its slot in the VIP's Maglev table, and two slots in the VIP's
/// alternates table for a SYN whose pick has no room. From one 64-bit hash: the low half
/// for the pick, the high half for the alternates, which fmix64 leaves independent.
#[inline(always)]
pub fn draws(k: &FlowKey) -> (u32, [u32; 2]) {
    let h = hash64(k);
    let hi = (h >> 32) as u32;
    (
        (h as u32) % MAGLEV_SIZE,
        [
            hi % ALTERNATES_SIZE,
            (hi / ALTERNATES_SIZE) % ALTERNATES_SIZE,
        ],
    )
}

#[inline(always)]
fn hash64(k: &FlowKey) -> u64 {
    let mut h: u64 = 0;
    let mut i = 0;
    while i < 4 {
        h = mix(h, k.src[i]);
        h = mix(h, k.dst[i]);
        i += 1;
    }
    h = mix(h, u32::from(k.sport) | (u32::from(k.dport) << 16));
    h = mix(h, u32::from(k.proto) | (u32::from(k.family) << 8));
    // fmix64 from MurmurHash3: full avalanche so that `hash % table_size` is uniform.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FAMILY_V4, IPPROTO_TCP};

    fn key(sport: u16) -> FlowKey {
        FlowKey {
            src: [u32::from_ne_bytes([10, 9, 0, 2]), 0, 0, 0],
            dst: [u32::from_ne_bytes([192, 0, 2, 60]), 0, 0, 0],
            sport: sport.to_be(),
            dport: 8000u16.to_be(),
            proto: IPPROTO_TCP,
            family: FAMILY_V4,
            _pad: [0; 2],
        }
    }

    #[test]
    fn known_answer() {
        // Pins the function: the kernel side is compiled from the same code, and a change
        // here moves every flow of a running fleet of gateways during an upgrade.
        assert_eq!(flow_hash(&key(40000)), 0x5156_b786);
    }

    #[test]
    fn spreads_ports_evenly() {
        let mut buckets = [0u32; 16];
        for p in 0..16_000u16 {
            buckets[(flow_hash(&key(40000 + p)) % 16) as usize] += 1;
        }
        for b in buckets {
            assert!((900..1100).contains(&b), "{buckets:?}");
        }
    }

    #[test]
    fn draws_are_independent_of_each_other() {
        // Reduced to 4 servers' worth of slots, every combination of pick and alternates
        // is about equally common: a backend's flows that need alternates do not all see
        // the same ones.
        let mut seen = [[[0u32; 4]; 4]; 4];
        for p in 0..64_000u16 {
            let k = key(1000 + p);
            let (pick, [a, b]) = draws(&k);
            assert_eq!(pick, flow_hash(&k) % MAGLEV_SIZE);
            seen[(pick % 4) as usize][(a % 4) as usize][(b % 4) as usize] += 1;
        }
        for n in seen.iter().flatten().flatten() {
            assert!((850..1150).contains(n), "{seen:?}");
        }
    }
}
