//! Prefix affinity, the agent's half: each hint bucket's home by rendezvous hashing, the
//! warm alternates a bucket spills to, and each server's spill budget. The XDP program does
//! the per-connection part (`balancer-ebpf/src/affinity.rs`). Pure code.

use std::time::{Duration, Instant};

use balancer_common::{
    hint::{fnv1a64, HintRange, BUCKET_CANDIDATES},
    Bucket, BucketStats,
};

use crate::homes::{self, Move, Popularity};

/// A server that may be a bucket's home: UP, not draining, configured weight > 0.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    pub id: u32,
    /// Stable identity, e.g. "10.4.0.11:8000": the same on every gateway.
    pub key: String,
    pub weight: u32,
}

/// Weighted rendezvous (highest random weight) hashing: every server draws a score per
/// bucket and the highest wins. Removing a server moves only the buckets it won; adding one
/// takes only the buckets it now wins. Scores are `-weight / ln(u)` with `u` uniform in
/// (0, 1), which makes a server's share proportional to its weight.
pub fn home(bucket: u16, members: &[Member]) -> Option<u32> {
    ranking(bucket, members).first().copied()
}

/// Every eligible server in the bucket's rendezvous order, the home first: where the bucket
/// goes when the servers before it are taken (see `homes`).
pub fn ranking(bucket: u16, members: &[Member]) -> Vec<u32> {
    let mut scored: Vec<(f64, u32)> = members
        .iter()
        .filter(|m| m.weight > 0)
        .map(|m| (score(bucket, m), m.id))
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    scored.into_iter().map(|(_, id)| id).collect()
}

fn score(bucket: u16, m: &Member) -> f64 {
    let mut h =
        fnv1a64(m.key.as_bytes()) ^ (u64::from(bucket) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    // fmix64 (MurmurHash3): FNV's low bits alone are too regular for a uniform draw.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -f64::from(m.weight) / u.ln()
}

/// New connections a server may take before a new request would have to wait for
/// `spill_waiting` others, as the scrape saw it: its free slots, less what is already
/// waiting (the program counts from there: less what opened since, plus what closed).
/// Negative when more than that already wait: by how many, so that the program can still
/// tell the least loaded of servers that are all past the threshold. At
/// most zero when the server is held (saturated on its queue, TTFT or KV, or not UP, in the
/// last two scrape intervals): it then counts as full, no better than a server with no free
/// slot and no worse than one with a queue. A free slot starts a request at once while TTFT is a lagging signal, and a server
/// whose KV memory holds back admissions shows it in its own waiting count. The agent writes
/// such a budget held (`LOAD_F_HELD`), so that connections closing on the server before the
/// next budget do not give it room.
pub fn budget(saturated: bool, slots: u32, running: f64, waiting: f64, spill_waiting: u32) -> i32 {
    let room = f64::from(slots) + f64::from(spill_waiting) - 1.0 - running - waiting;
    // BUDGET_UNKNOWN is i32::MIN: a real budget never reaches it.
    let room = room
        .floor()
        .clamp(f64::from(i32::MIN + 1), f64::from(i32::MAX)) as i32;
    if saturated {
        room.min(0)
    } else {
        room
    }
}

/// What a bucket's spill decision needs to know about a server.
#[derive(Debug, Clone, PartialEq)]
pub struct Load {
    pub id: u32,
    pub saturated: bool,
    /// None when the server's load is unknown (stale metrics).
    pub budget: Option<i32>,
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    pub ttft_ms: Option<f64>,
    /// Why the server takes no more hinted connections, for the spill log line.
    pub why: String,
}

/// TTFT for ranking alternates: a server that has not shown one yet ranks after every
/// server that has, unless it is idle (then nothing is slow on it).
fn ttft_rank(l: &Load) -> f64 {
    match l.ttft_ms {
        Some(ms) => ms,
        None if l.running == Some(0.0) && l.waiting == Some(0.0) => 0.0,
        None => f64::INFINITY,
    }
}

/// A spill decision, logged as one line.
#[derive(Debug, Clone, PartialEq)]
pub struct Spill {
    pub bucket: u16,
    pub from: u32,
    pub to: u32,
    pub why: String,
}

#[derive(Debug, Clone, PartialEq)]
struct Warm {
    id: u32,
    last_used: Instant,
}

#[derive(Debug, Clone, Default)]
struct BucketState {
    warm: Vec<Warm>,
    /// Alternates that were warm before: they may still hold the prefix.
    former: Vec<u32>,
    last_hinted: Option<Instant>,
    seen: BucketStats,
    written: Option<Bucket>,
}

impl BucketState {
    /// `id` served the bucket (as home or alternate) and may still hold its prefix: first
    /// among the former alternates.
    fn remember(&mut self, id: u32) {
        self.former.retain(|f| *f != id);
        self.former.insert(0, id);
        self.former.truncate(BUCKET_CANDIDATES);
    }
}

/// One pool's buckets.
pub struct PoolAffinity {
    pub range: HintRange,
    buckets: Vec<BucketState>,
    homes: Vec<u32>,
    members: Vec<Member>,
    /// Every bucket's servers in rendezvous order, for these members.
    rankings: Vec<Vec<u32>>,
    popularity: Popularity,
    /// Until when quiet buckets keep the homes taken over from an earlier agent (see
    /// [`PoolAffinity::adopt`]).
    adopted_until: Option<Instant>,
    /// Whether the buckets' `seen` hold the statistics as the maps had them. They are
    /// cumulative and outlive a pool's state here (a hint range changed by a reload, a VIP
    /// id another pool had): the first update takes them as where counting starts, not as
    /// connections just made.
    primed: bool,
}

/// A bucket in use, for the operator.
#[derive(Debug, Clone, PartialEq)]
pub struct Active {
    pub bucket: u16,
    /// Hinted connections, decayed over minutes (see `homes`).
    pub hinted: f64,
    pub home: u32,
    /// The home rendezvous hashing alone gives, which load balancing may have moved.
    pub rendezvous: u32,
    pub warm: Vec<u32>,
}

/// What changed in one update.
#[derive(Debug, Default)]
pub struct Update {
    /// Buckets whose candidates must be written.
    pub write: Vec<(u16, Bucket)>,
    /// Alternates added because a home was past its threshold.
    pub spills: Vec<Spill>,
    /// Hinted connections that spilled since the last update.
    pub spilled: Vec<Spilled>,
    /// Homes moved to balance the hinted load.
    pub moves: Vec<Move>,
}

/// How many hinted connections of a bucket spilled since the last update, and where to.
#[derive(Debug, Clone, PartialEq)]
pub struct Spilled {
    pub bucket: u16,
    pub home: u32,
    pub count: u64,
    /// Per warm alternate.
    pub to_warm: Vec<(u32, u64)>,
    /// To the weighted (Maglev) pick, because no alternate had room.
    pub by_weight: u64,
}

impl PoolAffinity {
    pub fn new(range: HintRange) -> Self {
        PoolAffinity {
            range,
            buckets: vec![BucketState::default(); usize::from(range.buckets)],
            homes: Vec::new(),
            members: Vec::new(),
            rankings: Vec::new(),
            popularity: Popularity::new(range.buckets),
            adopted_until: None,
            primed: false,
        }
    }

    /// Bucket `bucket`'s candidates did not reach the map: the next update writes them
    /// again, whether or not they changed.
    pub fn unwritten(&mut self, bucket: u16) {
        if let Some(state) = self.buckets.get_mut(usize::from(bucket)) {
            state.written = None;
        }
    }

    /// Takes the candidates an earlier agent left in the pinned maps (`written`, and the
    /// statistics so far, per bucket) as its own: homes stay where the prefixes are cached
    /// and the alternates stay warm, instead of every bucket starting again from its
    /// rendezvous home. The popularity that placed them is not in the maps, so for as long
    /// as popularity remembers (`homes::MEMORY`) a bucket keeps its home even while quiet;
    /// the buckets in use are placed by the usual rules, their homes the incumbents.
    pub fn adopt(&mut self, now: Instant, written: &[Bucket], stats: &[BucketStats]) {
        self.homes = written.iter().map(|w| w.ids[0]).collect();
        self.adopted_until = Some(now + homes::MEMORY);
        self.primed = true;
        for ((state, w), seen) in self.buckets.iter_mut().zip(written).zip(stats) {
            state.warm = (w.ids[1..].iter())
                .filter(|id| **id != 0)
                .map(|&id| Warm { id, last_used: now })
                .collect();
            state.written = Some(*w);
            state.seen = *seen;
        }
    }

    /// The current home of every bucket (0 where no server is eligible).
    pub fn homes(&self) -> &[u32] {
        &self.homes
    }

    /// The buckets that carried hinted connections lately or have warm alternates, most
    /// popular first.
    pub fn active(&self) -> Vec<Active> {
        let counts = self.popularity.counts();
        let mut active: Vec<Active> = (self.buckets.iter().enumerate())
            .filter(|(b, s)| counts[*b] >= homes::QUIET || !s.warm.is_empty())
            .map(|(b, s)| Active {
                bucket: b as u16,
                hinted: counts[b],
                home: self.homes.get(b).copied().unwrap_or(0),
                rendezvous: self
                    .rankings
                    .get(b)
                    .and_then(|r| r.first())
                    .copied()
                    .unwrap_or(0),
                warm: s.warm.iter().map(|w| w.id).collect(),
            })
            .collect();
        active.sort_by(|a, b| b.hinted.total_cmp(&a.hinted).then(a.bucket.cmp(&b.bucket)));
        active
    }

    /// One round: new bucket statistics and server loads in, candidates to write out.
    /// A bucket is active while hinted connections arrived within `idle`; an alternate
    /// nobody used for `idle` is dropped. Homes are balanced within `home_bound` (0: plain
    /// rendezvous homes).
    pub fn update(
        &mut self,
        now: Instant,
        members: &[Member],
        loads: &[Load],
        stats: &[BucketStats],
        idle: Duration,
        home_bound: f64,
    ) -> Update {
        if self.members != members || self.rankings.is_empty() {
            self.members = members.to_vec();
            self.rankings = (0..self.range.buckets)
                .map(|b| ranking(b, members))
                .collect();
        }
        if !self.primed {
            for (state, seen) in self.buckets.iter_mut().zip(stats) {
                state.seen = *seen;
            }
            self.primed = true;
        }
        let hinted = |b: usize| stats.get(b).map_or(0, |s| s.hinted);
        self.popularity.add(
            now,
            (self.buckets.iter().enumerate()).map(|(b, s)| hinted(b).saturating_sub(s.seen.hinted)),
        );
        let counts = self.popularity.counts();
        let mut homes = homes::place(&self.rankings, members, counts, &self.homes, home_bound);
        if self.adopted_until.is_some_and(|t| now < t) {
            for (b, home) in homes.iter_mut().enumerate() {
                let adopted = self.homes.get(b).copied().unwrap_or(0);
                if counts[b] < homes::QUIET && adopted != 0 && self.rankings[b].contains(&adopted) {
                    *home = adopted;
                }
            }
        }
        // With balancing off, a change of homes is rendezvous hashing's, not a move.
        let mut out = Update::default();
        if home_bound > 0.0 {
            out.moves = homes::moves(&self.homes, &homes, members, counts);
        }
        for m in &out.moves {
            // The old home still holds the prefix: preferred, among otherwise equal
            // alternates, when the bucket spills.
            self.buckets[usize::from(m.bucket)].remember(m.from);
        }
        self.homes = homes;
        let load = |id: u32| loads.iter().find(|l| l.id == id);
        let eligible = |id: u32| members.iter().any(|m| m.id == id && m.weight > 0);
        for (b, state) in self.buckets.iter_mut().enumerate() {
            let bucket = b as u16;
            let home = self.homes[b];
            let current = stats.get(b).copied().unwrap_or_default();
            let previous = std::mem::replace(&mut state.seen, current);
            if current.hinted > previous.hinted {
                state.last_hinted = Some(now);
            }
            // The places of the last written candidates tell which alternates were used.
            if let Some(written) = state.written {
                let mut to_warm = Vec::new();
                for place in 1..BUCKET_CANDIDATES {
                    let used = current.picks[place].saturating_sub(previous.picks[place]);
                    if used > 0 {
                        let id = written.ids[place];
                        if let Some(w) = state.warm.iter_mut().find(|w| w.id == id) {
                            w.last_used = now;
                        }
                        to_warm.push((id, used));
                    }
                }
                let spilled = current.spilled.saturating_sub(previous.spilled);
                if spilled > 0 {
                    let warm: u64 = to_warm.iter().map(|(_, n)| n).sum();
                    out.spilled.push(Spilled {
                        bucket,
                        home: written.ids[0],
                        count: spilled,
                        to_warm,
                        by_weight: spilled.saturating_sub(warm),
                    });
                }
            }
            let (warm, gone): (Vec<Warm>, Vec<Warm>) = state.warm.drain(..).partition(|w| {
                w.id != home && eligible(w.id) && now.duration_since(w.last_used) < idle
            });
            state.warm = warm;
            for w in gone {
                state.remember(w.id);
            }
            let active = state
                .last_hinted
                .is_some_and(|t| now.duration_since(t) < idle);
            let has_room = |l: &Load| l.budget.is_some_and(|b| b > 0);
            let home_full = load(home).is_none_or(|l| l.budget.is_some_and(|b| b <= 0));
            let warm_room = state.warm.iter().any(|w| load(w.id).is_some_and(has_room));
            if home != 0
                && active
                && home_full
                && !warm_room
                && state.warm.len() < BUCKET_CANDIDATES - 1
            {
                let taken: Vec<u32> = std::iter::once(home)
                    .chain(state.warm.iter().map(|w| w.id))
                    .collect();
                let best = loads
                    .iter()
                    .filter(|l| eligible(l.id) && !taken.contains(&l.id) && has_room(l))
                    .min_by(|a, b| {
                        let queued = |l: &Load| l.waiting.unwrap_or(0.0) > 0.0;
                        queued(a)
                            .cmp(&queued(b))
                            .then(ttft_rank(a).total_cmp(&ttft_rank(b)))
                            .then(
                                (!state.former.contains(&a.id)).cmp(&!state.former.contains(&b.id)),
                            )
                            .then(b.budget.cmp(&a.budget))
                            .then(a.id.cmp(&b.id))
                    });
                if let Some(best) = best {
                    state.warm.push(Warm {
                        id: best.id,
                        last_used: now,
                    });
                    out.spills.push(Spill {
                        bucket,
                        from: home,
                        to: best.id,
                        why: load(home).map_or_else(|| "no load known".into(), |l| l.why.clone()),
                    });
                }
            }
            let mut ids = [0u32; BUCKET_CANDIDATES];
            ids[0] = home;
            for (place, w) in ids[1..].iter_mut().zip(&state.warm) {
                *place = w.id;
            }
            let candidates = Bucket { ids };
            if state.written != Some(candidates) {
                state.written = Some(candidates);
                out.write.push((bucket, candidates));
            }
        }
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Servers 1..=n of equal weight, 10.4.0.11:8000 and on.
    pub(crate) fn members(n: u32) -> Vec<Member> {
        (1..=n)
            .map(|i| Member {
                id: i,
                key: format!("10.4.0.{}:8000", 10 + i),
                weight: 100,
            })
            .collect()
    }

    fn load(id: u32, budget: i32, waiting: f64, ttft: f64) -> Load {
        Load {
            id,
            saturated: budget <= 0,
            budget: Some(budget),
            running: Some(1.0),
            waiting: Some(waiting),
            ttft_ms: Some(ttft),
            why: format!("server {id} full"),
        }
    }

    #[test]
    fn adopted_homes_and_alternates_stay() {
        let m = members(4);
        let range = HintRange {
            start: 16384,
            span: 16384,
            buckets: 8,
        };
        let now = Instant::now();
        // Every bucket's home moved off its rendezvous home, with one warm alternate.
        let written: Vec<Bucket> = (0..8u16)
            .map(|b| {
                let ranked = ranking(b, &m);
                Bucket {
                    ids: [ranked[1], ranked[2], 0, 0],
                }
            })
            .collect();
        let stats: Vec<BucketStats> = (0..8)
            .map(|_| BucketStats {
                hinted: 1000,
                spilled: 100,
                picks: [900, 100, 0, 0],
            })
            .collect();
        let mut a = PoolAffinity::new(range);
        a.adopt(now, &written, &stats);
        let loads: Vec<Load> = (1..=4).map(|id| load(id, 4, 0.0, 100.0)).collect();
        let idle = Duration::from_secs(30);
        let later = now + Duration::from_secs(1);
        let update = a.update(later, &m, &loads, &stats, idle, 1.25);
        assert!(
            update.write.is_empty(),
            "nothing to rewrite: {:?}",
            update.write
        );
        assert!(
            update.spilled.is_empty(),
            "no spill since: {:?}",
            update.spilled
        );
        assert!(update.moves.is_empty());
        for (b, w) in written.iter().enumerate() {
            assert_eq!(a.homes()[b], w.ids[0]);
        }
        // A write that failed is done again at the next update, and only that one.
        a.unwritten(3);
        let update = a.update(later, &m, &loads, &stats, idle, 1.25);
        assert_eq!(update.write, [(3, written[3])]);
        // Without adoption every bucket would be back on its rendezvous home, as the quiet
        // ones are once popularity has forgotten.
        let mut fresh = PoolAffinity::new(range);
        fresh.update(later, &m, &loads, &stats, idle, 1.25);
        assert!((0..8).all(|b| fresh.homes()[b] != written[b].ids[0]));
        a.update(now + homes::MEMORY, &m, &loads, &stats, idle, 1.25);
        assert_eq!(a.homes(), fresh.homes());
    }

    #[test]
    fn rendezvous_moves_only_the_removed_servers_buckets() {
        for n in [2u32, 4, 8] {
            let all = members(n);
            let before: Vec<u32> = (0..256).map(|b| home(b, &all).unwrap()).collect();
            for gone in 1..=n {
                let rest: Vec<Member> = all.iter().filter(|m| m.id != gone).cloned().collect();
                for b in 0..256u16 {
                    let after = home(b, &rest).unwrap();
                    if before[b as usize] != gone {
                        assert_eq!(after, before[b as usize], "bucket {b} moved without cause");
                    } else {
                        assert_ne!(after, gone);
                    }
                }
            }
        }
    }

    #[test]
    fn homes_spread_by_weight() {
        let mut m = members(4);
        m[3].weight = 300; // half of the total
        let mut count = [0u32; 5];
        for b in 0..1024u16 {
            count[home(b, &m).unwrap() as usize] += 1;
        }
        assert!((440..=584).contains(&count[4]), "{count:?}");
        for c in &count[1..4] {
            assert!((130..=215).contains(c), "{count:?}");
        }
        m[3].weight = 0;
        assert!((0..64u16).all(|b| home(b, &m) != Some(4)));
        assert_eq!(home(0, &[]), None);
    }

    #[test]
    fn budget_is_free_slots_before_a_request_would_wait() {
        assert_eq!(budget(false, 8, 5.0, 0.0, 1), 3);
        assert_eq!(budget(false, 8, 8.0, 0.0, 1), 0);
        assert_eq!(
            budget(false, 8, 8.0, 0.0, 3),
            2,
            "spill_waiting 3 allows two queued"
        );
        assert_eq!(
            budget(false, 8, 8.0, 5.0, 3),
            -3,
            "past the threshold by three"
        );
        assert_eq!(budget(false, 8, 6.5, 0.0, 1), 1, "a half is not a slot");
        assert_eq!(budget(true, 8, 0.0, 0.0, 1), 0, "saturated by TTFT or KV");
        assert_eq!(budget(true, 8, 8.0, 4.0, 1), -4, "saturated and queued");
        assert_eq!(budget(false, 8, 1e12, 0.0, 1), i32::MIN + 1);
        assert!(budget(true, 8, 1e12, f64::NAN, 1) > balancer_common::BUDGET_UNKNOWN);
    }

    fn stats(hinted: u64, spilled: u64, picks: [u64; 4]) -> BucketStats {
        BucketStats {
            hinted,
            spilled,
            picks,
        }
    }

    /// The brief's worked example: the home is past its threshold, the next connection of
    /// the bucket must find the server with no queue and the lowest TTFT warm.
    #[test]
    fn a_full_home_gets_the_best_alternate_then_returns() {
        let m = members(4);
        let mut a = PoolAffinity::new(HintRange::DEFAULT);
        let t0 = Instant::now();
        let idle = Duration::from_secs(60);
        let b = (0..256u16).find(|b| home(*b, &m) == Some(2)).unwrap();
        let mut s = vec![BucketStats::default(); 256];
        let healthy = [
            load(1, 3, 0.0, 240.0),
            load(2, 4, 0.0, 200.0),
            load(3, 5, 0.0, 180.0),
            load(4, 6, 0.0, 300.0),
        ];
        let first = a.update(t0, &m, &healthy, &s, idle, 1.25);
        assert_eq!(
            first.write.len(),
            256,
            "every bucket gets its home at first"
        );
        assert!(first.spills.is_empty());
        // One hinted connection reaches the home: the bucket is active.
        s[b as usize] = stats(1, 0, [1, 0, 0, 0]);
        let busy = [
            load(1, 3, 0.0, 240.0),
            load(2, 0, 3.0, 910.0),
            load(3, 5, 0.0, 180.0),
            load(4, 0, 2.0, 300.0),
        ];
        let u = a.update(t0 + Duration::from_secs(1), &m, &busy, &s, idle, 1.25);
        assert_eq!(
            u.spills,
            vec![Spill {
                bucket: b,
                from: 2,
                to: 3,
                why: "server 2 full".into()
            }]
        );
        assert_eq!(u.write, vec![(b, Bucket { ids: [2, 3, 0, 0] })]);
        // Home and one alternate both hold the prefix now; nothing changes while it serves.
        s[b as usize] = stats(3, 2, [1, 2, 0, 0]);
        let u = a.update(t0 + Duration::from_secs(2), &m, &busy, &s, idle, 1.25);
        assert!(u.write.is_empty() && u.spills.is_empty());
        assert_eq!(
            u.spilled,
            vec![Spilled {
                bucket: b,
                home: 2,
                count: 2,
                to_warm: vec![(3, 2)],
                by_weight: 0
            }]
        );
        // The home recovers: it takes the bucket back, the alternate stays warm a while,
        // then goes.
        s[b as usize] = stats(6, 2, [4, 2, 0, 0]);
        let u = a.update(t0 + Duration::from_secs(3), &m, &healthy, &s, idle, 1.25);
        assert!(u.write.is_empty());
        let u = a.update(t0 + Duration::from_secs(70), &m, &healthy, &s, idle, 1.25);
        assert_eq!(u.write, vec![(b, Bucket { ids: [2, 0, 0, 0] })]);
    }

    #[test]
    fn an_unknown_ttft_ranks_after_known_ones_unless_idle() {
        let known = load(1, 5, 0.0, 900.0);
        let mut busy_unknown = load(2, 5, 0.0, 0.0);
        busy_unknown.ttft_ms = None;
        assert!(ttft_rank(&known) < ttft_rank(&busy_unknown));
        let mut idle = busy_unknown.clone();
        idle.running = Some(0.0);
        assert!(ttft_rank(&idle) < ttft_rank(&known));
    }

    /// The buckets (of 256) whose rendezvous home is `id`.
    fn homed_on(id: u32, m: &[Member]) -> Vec<usize> {
        (0..256)
            .filter(|b| home(*b as u16, m) == Some(id))
            .collect()
    }

    /// Four popular buckets share a rendezvous home: once enough connections are counted,
    /// some move, the moves are reported and written, the old home is the first spill
    /// choice, and the operator's view names where each came from.
    #[test]
    fn popular_buckets_on_one_home_are_spread() {
        let m = members(4);
        let mut a = PoolAffinity::new(HintRange::DEFAULT);
        let t0 = Instant::now();
        let idle = Duration::from_secs(60);
        let on_one = homed_on(1, &m);
        let healthy: Vec<Load> = (1..=4).map(|id| load(id, 5, 0.0, 100.0)).collect();
        let mut s = vec![BucketStats::default(); 256];
        a.update(t0, &m, &healthy, &s, idle, 1.25);
        for (b, n) in on_one.iter().zip([40, 30, 20, 10]) {
            s[*b] = stats(n, 0, [n, 0, 0, 0]);
        }
        let u = a.update(t0 + Duration::from_secs(1), &m, &healthy, &s, idle, 1.25);
        let moved: Vec<u16> = u.moves.iter().map(|mv| mv.bucket).collect();
        assert!(
            !moved.is_empty()
                && moved
                    .iter()
                    .all(|b| on_one[1..4].contains(&usize::from(*b)))
        );
        for mv in &u.moves {
            assert_eq!(mv.from, 1);
            let written = u.write.iter().find(|(b, _)| *b == mv.bucket).unwrap().1;
            assert_eq!(written.ids[0], mv.to);
            assert_eq!(a.buckets[usize::from(mv.bucket)].former, vec![1]);
        }
        let active = a.active();
        assert_eq!(active.len(), 4);
        assert_eq!((active[0].bucket, active[0].home), (on_one[0] as u16, 1));
        assert!(active.iter().all(|x| x.rendezvous == 1));
        assert_eq!(active.iter().filter(|x| x.home != 1).count(), moved.len());
        // Nothing new: the homes stand.
        let u = a.update(t0 + Duration::from_secs(2), &m, &healthy, &s, idle, 1.25);
        assert!(u.moves.is_empty() && u.write.is_empty());
        // Balancing off: back to the rendezvous homes.
        let u = a.update(t0 + Duration::from_secs(3), &m, &healthy, &s, idle, 0.0);
        assert_eq!(u.write.len(), moved.len());
        assert!(a
            .homes()
            .iter()
            .enumerate()
            .all(|(b, h)| home(b as u16, &m) == Some(*h)));
    }

    /// Statistics the maps held before this pool's first update (another range's, another
    /// pool's on the same VIP id) are history: a bucket they counted is not in use, and gets
    /// no alternate when its home is full; connections after them count.
    #[test]
    fn counts_from_before_the_first_update_are_history() {
        let m = members(4);
        let mut a = PoolAffinity::new(HintRange::DEFAULT);
        let t0 = Instant::now();
        let idle = Duration::from_secs(60);
        let on_one = &homed_on(1, &m)[..2];
        let mut loads: Vec<Load> = (2..=4).map(|id| load(id, 5, 0.0, 100.0)).collect();
        loads.push(load(1, 0, 1.0, 0.0));
        let mut s = vec![BucketStats::default(); 256];
        for b in on_one {
            s[*b] = stats(10, 0, [10, 0, 0, 0]);
        }
        let u = a.update(t0, &m, &loads, &s, idle, 0.0);
        assert!(u.spills.is_empty(), "{:?}", u.spills);
        s[on_one[1]] = stats(11, 0, [11, 0, 0, 0]);
        let u = a.update(t0 + Duration::from_secs(1), &m, &loads, &s, idle, 0.0);
        let spilled: Vec<u16> = u.spills.iter().map(|x| x.bucket).collect();
        assert_eq!(spilled, [on_one[1] as u16]);
    }

    #[test]
    fn quiet_buckets_and_ineligible_servers_get_no_alternates() {
        let m = members(3);
        let mut a = PoolAffinity::new(HintRange::new(20000, 64, 4).unwrap());
        let t0 = Instant::now();
        let idle = Duration::from_secs(60);
        let mut s = vec![BucketStats::default(); 4];
        let all_full = [
            load(1, 0, 1.0, 0.0),
            load(2, 0, 1.0, 0.0),
            load(3, 0, 1.0, 0.0),
        ];
        a.update(t0, &m, &all_full, &s, idle, 1.25);
        // No hinted traffic: nothing to spill, however full the homes.
        let u = a.update(t0, &m, &all_full, &s, idle, 1.25);
        assert!(u.spills.is_empty());
        // Active, but every other server is full too: the program falls back to Maglev.
        s[0] = stats(1, 1, [0, 0, 0, 0]);
        let u = a.update(t0, &m, &all_full, &s, idle, 1.25);
        assert!(u.spills.is_empty());
        assert_eq!(u.spilled.len(), 1);
        // A drained server (not a member) is never an alternate, and loses its homes.
        let home0 = a.homes()[0];
        let rest: Vec<Member> = m.iter().filter(|x| x.id != home0).cloned().collect();
        let open: Vec<Load> = [1, 2, 3]
            .iter()
            .map(|id| load(*id, if *id == home0 { 9 } else { 0 }, 0.0, 0.0))
            .collect();
        let u = a.update(t0, &rest, &open, &s, idle, 1.25);
        assert!(u.spills.iter().all(|s| s.to != home0));
        assert!(a.homes().iter().all(|h| *h != home0));
    }
}
