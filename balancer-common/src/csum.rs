//! Incremental Internet checksum updates (RFC 1624, eqn. 3: `HC' = ~(~HC + ~m + m')`).
//!
//! All values are the raw 16- or 32-bit words as loaded from packet memory in host order:
//! the one's-complement sum does not care about byte order as long as the checksum field and
//! the data are read and written the same way, which is why no byte swapping appears here.

#[inline(always)]
fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// The two 16-bit halves of `w`, added: its share of a one's-complement sum.
#[inline(always)]
pub fn halves(w: u32) -> u32 {
    (w & 0xffff) + (w >> 16)
}

/// The checksum field for a one's-complement sum of 16-bit words (as loaded, see above)
/// computed from scratch, over a header built whole.
#[inline(always)]
pub fn finish(sum: u32) -> u16 {
    !fold(sum)
}

/// The checksum after a 16-bit field changed from `old` to `new`.
#[inline(always)]
pub fn replace2(check: u16, old: u16, new: u16) -> u16 {
    !fold(u32::from(!check) + u32::from(!old) + u32::from(new))
}

/// The checksum after a 32-bit field changed from `old` to `new`.
#[inline(always)]
pub fn replace4(check: u16, old: u32, new: u32) -> u16 {
    !fold(u32::from(!check) + halves(!old) + halves(new))
}

/// The checksum after a 128-bit field (an IPv6 address) changed from `old` to `new`.
#[inline(always)]
pub fn replace16(check: u16, old: &[u32; 4], new: &[u32; 4]) -> u16 {
    let mut sum = u32::from(!check);
    let mut i = 0;
    while i < 4 {
        sum += halves(!old[i]) + halves(new[i]);
        i += 1;
    }
    !fold(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checksum from scratch over big-endian 16-bit words, as a receiver would verify it.
    fn full(words: &[u16]) -> u16 {
        let mut sum: u32 = 0;
        for w in words {
            sum += u32::from(*w);
        }
        !fold(sum)
    }

    #[test]
    fn incremental_matches_recomputation() {
        let mut data: [u16; 8] = [0x4500, 0x0034, 0x1c46, 0x4000, 0x4006, 0, 0xac10, 0x0a63];
        let check = full(&data);
        // Change a 16-bit word.
        let old = data[2];
        data[2] = 0xbeef;
        let check = replace2(check, old, data[2]);
        assert_eq!(check, full(&data));
        // Change a 32-bit word (two 16-bit words, as an IPv4 address).
        let old = (u32::from(data[6]) << 16) | u32::from(data[7]);
        data[6] = 0x0a04;
        data[7] = 0x000b;
        let new = (u32::from(data[6]) << 16) | u32::from(data[7]);
        assert_eq!(replace4(check, old, new), full(&data));
    }

    #[test]
    fn replace16_matches_four_replace4() {
        let old = [0x2001_0db8, 0, 0, 0x60];
        let new = [0xfd00_0004, 0, 0, 0x11];
        let mut c = 0x1234;
        for i in 0..4 {
            c = replace4(c, old[i], new[i]);
        }
        assert_eq!(replace16(0x1234, &old, &new), c);
    }
}
