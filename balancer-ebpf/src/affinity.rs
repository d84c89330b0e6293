//! Prefix affinity: a SYN whose source port lies in the VIP's hint range names a bucket; the
//! bucket's home takes it unless the home is past its spill threshold, then the warm
//! alternate with the most room does. The agent decides homes, alternates and budgets; the
//! program only counts, so the decision stays correct between two of the agent's updates.

use balancer_common::{hint::MAX_HINT_BUCKETS, Counter, VipInfo, BUCKET_SLOTS};

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

/// The backend for a hinted connection, or None to use the Maglev pick. SYNs may spill;
/// a mid-stream packet without an entry goes to the home, where its SYN most likely went.
#[inline(always)]
pub fn pick(vip: &VipInfo, bucket: u32, syn: bool) -> Option<u32> {
    let slot = vip.vip_id * MAX_HINT_BUCKETS as u32 + bucket;
    if slot >= BUCKET_SLOTS {
        return None;
    }
    let candidates = BUCKETS.get(slot)?.ids;
    let home = candidates[0];
    if home == 0 {
        return None;
    }
    if !syn {
        return Some(home);
    }
    let stats = BUCKET_STATS.get_ptr_mut(slot);
    let mut chosen = None;
    // A home whose load is unknown keeps its SYNs: nothing says it is full.
    if room(home).is_none_or(|r| r > 0) {
        chosen = Some(0);
    } else {
        let mut best_room = 0;
        let mut i = 1;
        while i < candidates.len() {
            let id = candidates[i];
            if id != 0 {
                let r = room(id).unwrap_or(0);
                if r > best_room {
                    best_room = r;
                    chosen = Some(i);
                }
            }
            i += 1;
        }
    }
    if let Some(stats) = stats {
        // SAFETY: a valid value of the map for this program run; every field is a u64.
        unsafe {
            shared_add(&raw mut (*stats).hinted);
            match chosen {
                Some(i) => {
                    if i != 0 {
                        shared_add(&raw mut (*stats).spilled);
                    }
                    if let Some(pick) = (*stats).picks.get_mut(i) {
                        shared_add(pick);
                    }
                }
                None => shared_add(&raw mut (*stats).spilled),
            }
        }
    }
    match chosen {
        Some(0) => {
            count(Counter::HintHome);
            Some(home)
        }
        Some(i) => {
            count(Counter::HintWarm);
            Some(candidates[i])
        }
        None => {
            count(Counter::HintMaglev);
            None
        }
    }
}
