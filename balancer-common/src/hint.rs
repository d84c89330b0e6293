//! Prefix hints through the client's TCP source port: a public protocol that client authors
//! code against (`docs/affinity.md`), so it is written once here and pinned by the vectors
//! in `hint-vectors.json`, which the Rust and Python clients both check.
//!
//! A client wanting affinity for a prompt prefix P computes `h = FNV-1a 64(P as UTF-8)`,
//! `bucket = h mod B`, and binds its socket to a source port p in `[start, start + span)`
//! with `(p - start) mod B == bucket`. The XDP program decodes the bucket from the SYN.

/// Default hint range: below Linux's ephemeral range (32768-60999), so that ordinary
/// connections never carry a hint by accident.
pub const DEFAULT_HINT_START: u16 = 16384;
pub const DEFAULT_HINT_SPAN: u16 = 16384;
pub const DEFAULT_HINT_BUCKETS: u16 = 256;
/// Upper bound on buckets per VIP: sizes the bucket map.
pub const MAX_HINT_BUCKETS: u16 = 1024;
/// A bucket's home and up to three warm alternates.
pub const BUCKET_CANDIDATES: usize = 4;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a, 64 bits.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = FNV_OFFSET;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// A VIP's hint port range and bucket count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HintRange {
    pub start: u16,
    pub span: u16,
    pub buckets: u16,
}

/// Why a hint range is unusable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HintRangeError {
    NoBuckets,
    TooManyBuckets,
    /// Fewer ports than buckets: some buckets would have no port.
    SpanBelowBuckets,
    /// `start + span` is past port 65535.
    PastLastPort,
    /// Port 0 cannot be bound.
    StartsAtZero,
}

impl HintRangeError {
    pub const fn message(self) -> &'static str {
        match self {
            HintRangeError::NoBuckets => "hint_buckets must be at least 1",
            HintRangeError::TooManyBuckets => "hint_buckets is above the maximum of 1024",
            HintRangeError::SpanBelowBuckets => {
                "the hint port range holds fewer ports than there are buckets"
            }
            HintRangeError::PastLastPort => "the hint port range goes past port 65535",
            HintRangeError::StartsAtZero => "the hint port range cannot start at port 0",
        }
    }
}

impl HintRange {
    pub const DEFAULT: HintRange = HintRange {
        start: DEFAULT_HINT_START,
        span: DEFAULT_HINT_SPAN,
        buckets: DEFAULT_HINT_BUCKETS,
    };

    pub fn new(start: u16, span: u16, buckets: u16) -> Result<Self, HintRangeError> {
        Self::check_buckets(buckets)?;
        if start == 0 {
            return Err(HintRangeError::StartsAtZero);
        }
        if span < buckets {
            return Err(HintRangeError::SpanBelowBuckets);
        }
        if u32::from(start) + u32::from(span) > 65536 {
            return Err(HintRangeError::PastLastPort);
        }
        Ok(HintRange {
            start,
            span,
            buckets,
        })
    }

    /// Whether a range may have `buckets` buckets, whatever its ports.
    pub fn check_buckets(buckets: u16) -> Result<(), HintRangeError> {
        match buckets {
            0 => Err(HintRangeError::NoBuckets),
            b if b > MAX_HINT_BUCKETS => Err(HintRangeError::TooManyBuckets),
            _ => Ok(()),
        }
    }

    /// The bucket a source port hints, or None for an ordinary port.
    pub fn bucket_of_port(&self, port: u16) -> Option<u16> {
        let offset = port.checked_sub(self.start)?;
        (offset < self.span).then(|| offset % self.buckets)
    }

    /// The bucket of a prefix.
    pub fn bucket_of_prefix(&self, prefix: &[u8]) -> u16 {
        (fnv1a64(prefix) % u64::from(self.buckets)) as u16
    }

    /// The source ports that carry `bucket`, lowest first.
    pub fn ports(&self, bucket: u16) -> impl Iterator<Item = u16> {
        let (start, span, step) = (
            u32::from(self.start),
            u32::from(self.span),
            u32::from(self.buckets),
        );
        (u32::from(bucket)..span)
            .step_by(step as usize)
            .map(move |offset| (start + offset) as u16)
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::vec::Vec;

    #[test]
    fn fnv1a64_matches_the_published_vectors() {
        // From the FNV reference test suite.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn ports_and_buckets_agree() {
        let r = HintRange::DEFAULT;
        for bucket in [0, 1, 17, 255] {
            let ports: Vec<u16> = r.ports(bucket).collect();
            assert_eq!(ports.len(), 64, "64 ports per bucket by default");
            assert_eq!(ports[0], 16384 + bucket);
            for p in ports {
                assert_eq!(r.bucket_of_port(p), Some(bucket));
            }
        }
        assert_eq!(r.bucket_of_port(16383), None);
        assert_eq!(r.bucket_of_port(32768), None);
        assert_eq!(r.bucket_of_port(40000), None);
    }

    #[test]
    fn uneven_spans_still_cover_every_bucket() {
        let r = HintRange::new(20000, 1000, 300).unwrap();
        assert_eq!(r.ports(299).collect::<Vec<_>>(), [20299, 20599, 20899]);
        assert_eq!(r.ports(100).count(), 3);
        assert_eq!(r.ports(0).count(), 4);
        let last = HintRange::new(65000, 536, 8).unwrap();
        assert_eq!(last.ports(7).last(), Some(65535));
    }

    #[test]
    fn bad_ranges_are_refused() {
        assert_eq!(
            HintRange::new(16384, 16384, 0),
            Err(HintRangeError::NoBuckets)
        );
        assert_eq!(
            HintRange::new(16384, 100, 256),
            Err(HintRangeError::SpanBelowBuckets)
        );
        assert_eq!(
            HintRange::new(60000, 6000, 256),
            Err(HintRangeError::PastLastPort)
        );
        assert_eq!(
            HintRange::new(0, 1000, 10),
            Err(HintRangeError::StartsAtZero)
        );
        assert_eq!(
            HintRange::new(1000, 5000, 2000),
            Err(HintRangeError::TooManyBuckets)
        );
    }
}
