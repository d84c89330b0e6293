//! Bucket homes balanced by popularity. Rendezvous hashing spreads buckets evenly, not
//! traffic: a few popular prefixes (the head of a Zipf distribution) may all hash to one
//! server, which then spills most of their connections while the other servers' caches
//! hold no hinted prefix at all. So the agent counts every bucket's hinted connections
//! (decayed over minutes) and places the buckets from the most popular down. A bucket stays
//! with its current home while that server's share of the hinted traffic, with the bucket,
//! stays within `home_load_bound` (and a quarter) times its fair, weighted share; otherwise
//! it moves to the server then least loaded relative to its share (on a tie the current
//! home, then its rendezvous order): greedy largest-first placement, bounded so that homes move
//! when the traffic moved, not with every count. Quiet buckets, and every bucket until enough
//! connections have been seen, keep their plain rendezvous home, the one every gateway
//! computes from the configuration alone; after that, while too few connections are counted
//! to balance on, every home stays as it is. The balanced homes of several gateways agree as
//! far as the traffic they see agrees, and where they differ a prefix is warm on two servers.
//! Pure code.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use crate::affinity::Member;

/// The decay time of the counts: a connection counts `exp(-age / MEMORY)`.
pub const MEMORY: Duration = Duration::from_secs(120);
/// Hinted connections (decayed) the pool must have seen before homes are balanced: fewer
/// say too little about which buckets are popular.
pub const EVIDENCE: f64 = 64.0;
/// A bucket with less than this (decayed) is quiet: it keeps its rendezvous home.
pub const QUIET: f64 = 0.5;
/// A home keeps its bucket while its load stays within the bound times this.
const KEEP: f64 = 1.25;

/// Every bucket's hinted connections, older ones decayed.
#[derive(Debug, Clone)]
pub struct Popularity {
    counts: Vec<f64>,
    at: Option<Instant>,
}

impl Popularity {
    pub fn new(buckets: u16) -> Self {
        Popularity {
            counts: vec![0.0; usize::from(buckets)],
            at: None,
        }
    }

    /// Adds the hinted connections of every bucket since the last call. The first call only
    /// sets the clock: its counts may hold connections of long ago.
    pub fn add(&mut self, now: Instant, new: impl IntoIterator<Item = u64>) {
        let Some(at) = self.at.replace(now) else {
            return;
        };
        let decay = (-now.duration_since(at).as_secs_f64() / MEMORY.as_secs_f64()).exp();
        for (count, n) in self.counts.iter_mut().zip(new) {
            *count = *count * decay + n as f64;
        }
    }

    pub fn counts(&self) -> &[f64] {
        &self.counts
    }
}

/// A bucket whose home moved to balance the load.
#[derive(Debug, Clone, PartialEq)]
pub struct Move {
    pub bucket: u16,
    pub from: u32,
    pub to: u32,
    /// The bucket's share of the pool's hinted connections.
    pub share: f64,
}

/// Every bucket's home: `rankings[b]` holds bucket b's eligible servers in rendezvous order
/// (best first), `counts` the buckets' popularity, `current` the homes so far. A `bound` of
/// 0 turns balancing off: every home is the rendezvous home.
pub fn place(
    rankings: &[Vec<u32>],
    members: &[Member],
    counts: &[f64],
    current: &[u32],
    bound: f64,
) -> Vec<u32> {
    let mut homes: Vec<u32> = rankings
        .iter()
        .map(|r| r.first().copied().unwrap_or(0))
        .collect();
    let total: f64 = counts.iter().sum();
    let weight_sum: f64 = members.iter().map(|m| f64::from(m.weight)).sum();
    if bound == 0.0 || weight_sum == 0.0 {
        return homes;
    }
    // Too little evidence to balance on: the homes stand as they are, so that a pool whose
    // traffic hovers about the threshold does not move its homes to and fro.
    let balancing = total >= EVIDENCE;
    let cap: HashMap<u32, f64> = members
        .iter()
        .map(|m| (m.id, bound * total * f64::from(m.weight) / weight_sum))
        .collect();
    let mut load: HashMap<u32, f64> = HashMap::new();
    let mut order: Vec<usize> = (0..homes.len().min(counts.len()))
        .filter(|&b| counts[b] >= QUIET)
        .collect();
    order.sort_by(|&a, &b| counts[b].total_cmp(&counts[a]).then(a.cmp(&b)));
    for b in order {
        let n = counts[b];
        // The server's load with the bucket, relative to its cap.
        let with = |id: &u32| {
            let cap = cap.get(id).copied().unwrap_or(0.0);
            (load.get(id).copied().unwrap_or(0.0) + n) / cap
        };
        // The current home, or where rendezvous hashing sends a bucket whose home left: a
        // balanced pool moves only the buckets of a removed server, to their next server.
        let incumbent = (current.get(b))
            .filter(|id| rankings[b].contains(id))
            .or(rankings[b].first());
        let kept = incumbent.filter(|id| !balancing || with(id) <= KEEP);
        // `min_by` keeps the first of equals: the incumbent, then the rendezvous order. So a
        // bucket too popular for any server stays where it is (and spills).
        let home = kept.or_else(|| {
            (incumbent.into_iter().chain(&rankings[b])).min_by(|x, y| with(x).total_cmp(&with(y)))
        });
        if let Some(&home) = home {
            *load.entry(home).or_default() += n;
            homes[b] = home;
        }
    }
    homes
}

/// The buckets in use whose home changed from one server that is still eligible to another:
/// the moves balancing made (a quiet bucket just follows rendezvous hashing).
pub fn moves(before: &[u32], after: &[u32], members: &[Member], counts: &[f64]) -> Vec<Move> {
    let total: f64 = counts.iter().sum();
    let member = |id: u32| members.iter().any(|m| m.id == id);
    before
        .iter()
        .zip(after)
        .enumerate()
        .filter(|(b, (from, to))| {
            from != to && member(**from) && **to != 0 && counts.get(*b) >= Some(&QUIET)
        })
        .map(|(b, (&from, &to))| Move {
            bucket: b as u16,
            from,
            to,
            share: counts.get(b).map_or(0.0, |n| n / total.max(1.0)),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::affinity::{ranking, tests::members};

    fn rankings(buckets: u16, m: &[Member]) -> Vec<Vec<u32>> {
        (0..buckets).map(|b| ranking(b, m)).collect()
    }

    /// Buckets of `m` whose rendezvous home is `id`, in order.
    fn homed_on(r: &[Vec<u32>], id: u32) -> Vec<usize> {
        (0..r.len()).filter(|&b| r[b][0] == id).collect()
    }

    #[test]
    fn a_zipf_head_on_one_server_is_spread() {
        let m = members(4);
        let r = rankings(256, &m);
        let plain = place(&r, &m, &[0.0; 256], &[], 1.25);
        // The benchmark's misfortune: the four most popular prefixes share a rendezvous home.
        let on_one = homed_on(&r, 1);
        let mut counts = vec![0.0; 256];
        for (b, n) in on_one.iter().zip([148.0, 77.0, 46.0, 41.0]) {
            counts[*b] = n;
        }
        let other = homed_on(&r, 2)[0];
        counts[other] = 20.0;
        let homes = place(&r, &m, &counts, &plain, 1.25);
        let total: f64 = counts.iter().sum();
        let mut load = [0.0; 5];
        for (b, n) in counts.iter().enumerate() {
            load[homes[b] as usize] += n;
        }
        // The head keeps its home, alone. No other server carries more than its bound, with
        // the slack a current home keeps its buckets in.
        assert_eq!(homes[on_one[0]], 1);
        assert_eq!(load[1], 148.0);
        for l in &load[2..] {
            assert!(*l <= KEEP * 1.25 * total / 4.0, "{load:?}");
        }
        assert!(
            load[2..].iter().all(|l| *l > 0.0),
            "every server is home to some: {load:?}"
        );
        for &b in &on_one[1..4] {
            assert_ne!(homes[b], 1);
        }
        // Quiet buckets keep their rendezvous home.
        for b in (0..256).filter(|b| counts[*b] == 0.0) {
            assert_eq!(homes[b], r[b][0]);
        }
    }

    #[test]
    fn balanced_traffic_and_little_evidence_keep_rendezvous_homes() {
        let m = members(4);
        let r = rankings(256, &m);
        let plain: Vec<u32> = r.iter().map(|x| x[0]).collect();
        // Eight equally popular buckets on each server: nothing moves.
        let mut counts = vec![0.0; 256];
        for id in 1..=4 {
            for b in homed_on(&r, id).into_iter().take(8) {
                counts[b] = 10.0 + f64::from(id) * 0.5;
            }
        }
        assert_eq!(place(&r, &m, &counts, &plain, 1.25), plain);
        // Everything on one server, but fewer connections than EVIDENCE: nothing moves.
        let mut few = vec![0.0; 256];
        for b in homed_on(&r, 3).into_iter().take(6) {
            few[b] = 10.0;
        }
        assert_eq!(place(&r, &m, &few, &plain, 1.25), plain);
        // The same with more evidence moves some; turned off, none.
        let many: Vec<f64> = few.iter().map(|n| n * 2.0).collect();
        let balanced = place(&r, &m, &many, &plain, 1.25);
        assert_ne!(balanced, plain);
        assert_eq!(place(&r, &m, &many, &plain, 0.0), plain);
        // When the evidence fades again, the balanced homes stay.
        assert_eq!(place(&r, &m, &few, &balanced, 1.25), balanced);
    }

    #[test]
    fn homes_stay_while_within_the_slack_and_follow_weights() {
        let mut m = members(2);
        let r = rankings(64, &m);
        let (a, b) = (homed_on(&r, 1), homed_on(&r, 2));
        let mut counts = vec![0.0; 64];
        // 55% on server 1: within 1.25 x 50%, so the current homes stand.
        counts[a[0]] = 55.0;
        counts[b[0]] = 45.0;
        let plain: Vec<u32> = r.iter().map(|x| x[0]).collect();
        assert_eq!(place(&r, &m, &counts, &plain, 1.25), plain);
        // Server 2 weighs three times server 1: its cap is 1.25 x 75 = 93.75 of 100, server 1's
        // 31.25; server 1's 55 move to server 2 (the only other), server 2 then carries all.
        m[1].weight = 300;
        let homes = place(&r, &m, &counts, &plain, 1.25);
        assert_eq!((homes[a[0]], homes[b[0]]), (2, 2));
        // One bucket too popular for either server stays where it is, on either.
        let head = vec![100.0; 1];
        for current in [1, 2] {
            let m = members(2);
            assert_eq!(place(&r[..1], &m, &head, &[current], 1.25), [current]);
        }
        // A home that left the pool is replaced however the counts lie.
        let one = vec![m[0].clone()];
        let r1 = rankings(64, &one);
        assert!(place(&r1, &one, &counts, &homes, 1.25)
            .iter()
            .all(|h| *h == 1));
    }

    #[test]
    fn a_removed_servers_buckets_go_to_their_next_rendezvous_server_when_balanced() {
        let m = members(4);
        let r = rankings(256, &m);
        let counts = vec![1.0; 256];
        let before = place(&r, &m, &counts, &[], 1.25);
        assert!(before.iter().zip(&r).all(|(h, x)| *h == x[0]));
        let rest = &m[1..];
        let after = place(&rankings(256, rest), rest, &counts, &before, 1.25);
        for b in 0..256 {
            let next = if r[b][0] == 1 { r[b][1] } else { r[b][0] };
            assert_eq!(after[b], next, "bucket {b}");
        }
    }

    #[test]
    fn counts_decay_and_the_first_call_is_a_baseline() {
        let mut p = Popularity::new(2);
        let t = Instant::now();
        p.add(t, [1000, 1000]);
        assert_eq!(p.counts(), &[0.0, 0.0]);
        p.add(t + Duration::from_secs(1), [10, 0]);
        assert_eq!(p.counts(), &[10.0, 0.0]);
        p.add(t + Duration::from_secs(1) + MEMORY, [0, 4]);
        let c = p.counts();
        assert!(
            (c[0] - 10.0 / std::f64::consts::E).abs() < 1e-9 && c[1] == 4.0,
            "{c:?}"
        );
    }

    #[test]
    fn moves_name_only_balancing() {
        let m = members(3);
        // Bucket 2 is quiet: it only follows rendezvous hashing.
        let counts = [30.0, 10.0, 0.0];
        let mv = moves(&[1, 2, 3], &[2, 2, 1], &m, &counts);
        assert_eq!(
            mv,
            vec![Move {
                bucket: 0,
                from: 1,
                to: 2,
                share: 0.75
            }]
        );
        // A home that left the pool is not a balancing move.
        assert!(moves(&[4], &[1], &m, &[5.0]).is_empty());
    }
}
