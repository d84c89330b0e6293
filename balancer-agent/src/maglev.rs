//! Weighted Maglev lookup table.
//!
//! Maglev hashing (Eisenbud et al., "Maglev: A Fast and Reliable Software
//! Network Load Balancer", NSDI 2016) gives every load balancer host the same
//! flow-to-backend table without coordination, and keeps it stable under
//! change: removing one of N backends moves only about 1/N of the slots (the
//! ones it owned, plus a little churn), so most flows keep their backend.
//! Weights use Katran's filling, where a backend takes a slot in a round only
//! when its accumulated weight reaches the maximum weight, so slot shares
//! track weight shares.
//!
//! The table size must be prime: each backend walks the table with a skip in
//! `1..size`, and only a prime size guarantees every skip visits every slot,
//! so the filling always terminates with a full table. It should also be far
//! larger than the backend count (the paper suggests over 100x), or slot
//! shares stray from weight shares.
//!
//! Permutations come from FNV-1a 64 over the backend key, with two fixed
//! seeds, rather than Rust's std hasher, whose output may change between
//! releases: every host and every agent version must build the same table.
//! Changing the hash or its seeds reshuffles every table.

/// One backend as Maglev sees it.
pub struct MaglevBackend<'a> {
    /// Stable backend id written into the table (never 0: id 0 is reserved and means "no backend").
    pub id: u32,
    /// Stable identity used to derive the backend's permutation, e.g. "10.4.0.11:8000".
    /// The same key must give the same permutation on every host and every run.
    /// Keys must be unique: backends sharing a key share a permutation and
    /// fight over the same slots (the table is still full and deterministic,
    /// but disruption on change is no longer minimal).
    pub key: &'a str,
    /// Relative weight; 0 means the backend owns no slot.
    pub weight: u32,
}

/// Seed for the offset hash: the standard FNV-1a 64 offset basis.
const OFFSET_SEED: u64 = 0xcbf2_9ce4_8422_2325;
/// Seed for the skip hash: any fixed value other than `OFFSET_SEED`.
const SKIP_SEED: u64 = 0x8422_2325_cbf2_9ce4;

fn fnv1a64(seed: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(seed, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Whether `n` is prime; callers check a configured table size with this
/// before calling [`build_table`].
pub fn is_prime(n: u32) -> bool {
    n >= 2
        && (2..)
            .take_while(|d| d <= &(n / d))
            .all(|d| !n.is_multiple_of(d))
}

/// Builds a table of `size` slots (size must be prime, e.g. 16381) naming backend ids.
/// Every slot names a backend with weight > 0; if no backend has weight > 0 every slot is 0.
/// Deterministic: the same input (in any order of `backends`) gives the same table.
///
/// If `size` is not prime (a caller bug: check with [`is_prime`]), debug builds
/// panic and release builds return an all-zero table.
pub fn build_table(backends: &[MaglevBackend<'_>], size: u32) -> Vec<u32> {
    let prime = is_prime(size);
    debug_assert!(prime, "maglev table size {size} is not prime");
    let mut table = vec![0u32; size as usize];

    let mut live: Vec<&MaglevBackend<'_>> = backends.iter().filter(|b| b.weight > 0).collect();
    if !prime || live.is_empty() {
        return table;
    }
    debug_assert!(
        live.iter().all(|b| b.id != 0),
        "maglev backend id 0 is reserved"
    );
    live.sort_by(|a, b| (a.key, a.id).cmp(&(b.key, b.id)));
    let max_weight = live.iter().map(|b| u64::from(b.weight)).max().unwrap_or(1);

    let size = u64::from(size);
    struct Walk {
        id: u32,
        weight: u64,
        /// Next slot to try in this backend's permutation.
        pos: u64,
        skip: u64,
        /// Accumulated weight not yet spent on a slot; always < max_weight between rounds.
        credit: u64,
    }
    let mut walks: Vec<Walk> = live
        .iter()
        .map(|b| Walk {
            id: b.id,
            weight: u64::from(b.weight),
            pos: fnv1a64(OFFSET_SEED, b.key.as_bytes()) % size,
            skip: fnv1a64(SKIP_SEED, b.key.as_bytes()) % (size - 1) + 1,
            credit: 0,
        })
        .collect();

    let mut filled = 0u64;
    loop {
        for w in &mut walks {
            w.credit += w.weight;
            if w.credit < max_weight {
                continue;
            }
            w.credit -= max_weight;
            // Terminates: the table has an empty slot and, size being prime,
            // the walk visits every slot within `size` steps.
            while table[w.pos as usize] != 0 {
                w.pos = (w.pos + w.skip) % size;
            }
            table[w.pos as usize] = w.id;
            w.pos = (w.pos + w.skip) % size;
            filled += 1;
            if filled == size {
                return table;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZE: u32 = 16381;

    fn keys(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("10.4.0.{}:8000", i + 11)).collect()
    }

    /// Backends with ids 1..=n, keys from `keys`, and the given weights.
    fn backends<'a>(keys: &'a [String], weights: &[u32]) -> Vec<MaglevBackend<'a>> {
        keys.iter()
            .zip(weights)
            .enumerate()
            .map(|(i, (key, &weight))| MaglevBackend {
                id: i as u32 + 1,
                key,
                weight,
            })
            .collect()
    }

    fn count(table: &[u32], id: u32) -> usize {
        table.iter().filter(|&&s| s == id).count()
    }

    #[test]
    fn primes() {
        let primes: Vec<u32> = (0..30).filter(|&n| is_prime(n)).collect();
        assert_eq!(primes, [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]);
        assert!(is_prime(16381) && is_prime(65537) && is_prime(u32::MAX - 4));
        assert!(!is_prime(16383) && !is_prime(65536) && !is_prime(u32::MAX));
    }

    #[test]
    fn shares_track_weights() {
        let weight_sets: [&[u32]; 4] = [&[1; 4], &[1; 10], &[100, 50, 25, 25], &[1, 1, 1, 97]];
        let mut worst = 0f64;
        for weights in weight_sets {
            let keys = keys(weights.len());
            let bs = backends(&keys, weights);
            let table = build_table(&bs, SIZE);
            let total: u32 = weights.iter().sum();
            for b in &bs {
                let share = count(&table, b.id) as f64 / f64::from(SIZE);
                let want = f64::from(b.weight) / f64::from(total);
                let dev = (share - want).abs();
                worst = worst.max(dev);
                assert!(
                    dev <= 0.01,
                    "weights {weights:?}: id {} share {share:.4}, want {want:.4}",
                    b.id
                );
            }
        }
        eprintln!("worst share deviation: {:.4}%", worst * 100.0);
    }

    #[test]
    fn removing_one_backend_moves_about_one_nth() {
        let mut worst = 0f64;
        for n in [4, 8, 16] {
            let keys = keys(n);
            let all = backends(&keys, &vec![1; n]);
            let before = build_table(&all, SIZE);
            for removed in 0..n {
                let mut rest = backends(&keys, &vec![1; n]);
                rest.remove(removed);
                let after = build_table(&rest, SIZE);
                let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
                let frac = moved as f64 / f64::from(SIZE);
                worst = worst.max(frac - 1.0 / n as f64);
                assert!(
                    frac <= 1.0 / n as f64 + 0.01,
                    "n={n}, removed index {removed}: moved {frac:.4}"
                );
            }
        }
        eprintln!("worst moved fraction above 1/N: {:.4}%", worst * 100.0);
    }

    #[test]
    fn zero_weight_owns_nothing() {
        let keys = keys(3);
        let bs = backends(&keys, &[5, 0, 5]);
        let table = build_table(&bs, SIZE);
        assert_eq!(count(&table, 2), 0);
        assert_eq!(count(&table, 1) + count(&table, 3), SIZE as usize);

        let table = build_table(&backends(&keys, &[0, 0, 0]), SIZE);
        assert_eq!(table, vec![0; SIZE as usize]);
        assert_eq!(build_table(&[], 13), vec![0; 13]);
    }

    #[test]
    fn deterministic_and_order_independent() {
        let keys = keys(8);
        let weights = [3, 1, 4, 1, 5, 9, 2, 6];
        let bs = backends(&keys, &weights);
        let table = build_table(&bs, SIZE);
        assert_eq!(table, build_table(&bs, SIZE));

        // Every rotation of the reversed order, so both "first" and "last" positions move.
        let mut shuffled = backends(&keys, &weights);
        shuffled.reverse();
        for _ in 0..shuffled.len() {
            shuffled.rotate_left(1);
            assert_eq!(table, build_table(&shuffled, SIZE));
        }
    }

    #[test]
    fn every_slot_names_a_live_backend() {
        let keys = keys(5);
        let bs = backends(&keys, &[7, 0, 1, 3, 0]);
        let table = build_table(&bs, SIZE);
        assert!(
            table.iter().all(|s| [1, 3, 4].contains(s)),
            "slot names a dead or unknown id"
        );
        // Each live backend gets at least one slot.
        assert!([1, 3, 4].iter().all(|&id| count(&table, id) > 0));
    }

    #[test]
    fn known_answer() {
        // Pins the hash (FNV-1a 64, both seeds) and the filling algorithm: if this
        // fails, tables differ from those of already-deployed agents, so a change
        // must be deliberate. The expected table was also reproduced by an
        // independent Python implementation of this module's algorithm.
        let bs = [
            MaglevBackend {
                id: 1,
                key: "a",
                weight: 1,
            },
            MaglevBackend {
                id: 2,
                key: "b",
                weight: 1,
            },
            MaglevBackend {
                id: 3,
                key: "c",
                weight: 1,
            },
        ];
        // Published FNV-1a 64 test vector, so OFFSET_SEED is the standard basis.
        assert_eq!(fnv1a64(OFFSET_SEED, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(
            build_table(&bs, 13),
            [1, 3, 1, 3, 2, 1, 1, 3, 2, 3, 2, 1, 2]
        );
    }
}
