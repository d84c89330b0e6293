//! Prefix affinity: a SYN whose source port lies in the VIP's hint range names a bucket; the
//! bucket's home takes it unless the home is past its spill threshold, then the warm
//! alternate with the most room does. The agent decides homes, alternates and budgets; the
//! program only counts, so the decision stays correct between two of the agent's updates.

use balancer_common::{bucket_slot, Counter, VipInfo};

use crate::{
    maps::{count, BUCKETS, BUCKET_STATS},
    parse::Packet,
    room::{room, shared_add},
};

/// The bucket a packet hints, if its VIP takes hints and its source port is in the range.
#[inline(always)]
pub fn bucket(vip: &VipInfo, pkt: &Packet) -> Option<u32> {
    if vip.hint_buckets == 0 {
        return None;
    }
    let offset = u16::from_be(pkt.key.sport).checked_sub(vip.hint_start)?;
    if offset >= vip.hint_span {
        return None;
    }
    Some(u32::from(offset % vip.hint_buckets))
}

/// What a hint bucket says about a connection.
pub enum Hinted {
    /// The home (place 0) or a warm alternate (place 1..) takes it; for a SYN, the bucket's
    /// slot and the place, to [`record`] once the SYN is known to go out.
    Take {
        id: u32,
        counted: Option<(u32, usize)>,
    },
    /// A SYN whose home and warm alternates are all past their threshold: the weighted pick
    /// decides, unless the home has at least as much room. `slot` is the bucket's, for
    /// [`record`].
    Full { home: u32, room: i64, slot: u32 },
}

/// What the bucket of a hinted connection says, or None to use the Maglev pick. SYNs may
/// spill; a mid-stream packet without an entry goes to the home, where its SYN most likely
/// went.
#[inline(always)]
pub fn pick(vip: &VipInfo, bucket: u32, syn: bool) -> Option<Hinted> {
    let slot = bucket_slot(vip.vip_id, bucket)?;
    let candidates = BUCKETS.get(slot)?.ids;
    let home = candidates[0];
    if home == 0 {
        return None;
    }
    if !syn {
        return Some(Hinted::Take {
            id: home,
            counted: None,
        });
    }
    // A home whose load is unknown keeps its SYNs: nothing says it is full.
    let home_room = match room(home) {
        Some(r) if r <= 0 => r,
        _ => {
            return Some(Hinted::Take {
                id: home,
                counted: Some((slot, 0)),
            })
        }
    };
    let mut best_room = 0;
    let mut chosen = 0;
    let mut i = 1;
    while i < candidates.len() {
        let id = candidates[i];
        if id != 0 {
            if let Some(r) = room(id).filter(|r| *r > best_room) {
                best_room = r;
                chosen = i;
            }
        }
        i += 1;
    }
    if chosen == 0 {
        return Some(Hinted::Full {
            home,
            room: home_room,
            slot,
        });
    }
    Some(Hinted::Take {
        id: candidates[chosen],
        counted: Some((slot, chosen)),
    })
}

/// Counts a hinted SYN in its bucket's statistics and the counters: which candidate took it
/// (0: the home), or None when the weighted pick did.
#[inline(always)]
pub fn record(slot: u32, place: Option<usize>) {
    if let Some(stats) = BUCKET_STATS.get_ptr_mut(slot) {
        // SAFETY: a valid value of the map for this program run; every field is a u64.
        unsafe {
            shared_add(&raw mut (*stats).hinted);
            if place != Some(0) {
                shared_add(&raw mut (*stats).spilled);
            }
            if let Some(pick) = place.and_then(|i| (*stats).picks.get_mut(i)) {
                shared_add(pick);
            }
        }
    }
    count(match place {
        Some(0) => Counter::HintHome,
        Some(_) => Counter::HintWarm,
        None => Counter::HintMaglev,
    });
}
