//! Prefix affinity: a SYN whose source port lies in the VIP's hint range names a bucket; the
//! bucket's home takes it unless the home is past its spill threshold, then the warm
//! alternate with the most room does. The agent decides homes, alternates and budgets; the
//! program only counts, so the decision stays correct between two of the agent's updates.

use balancer_common::{hint::MAX_HINT_BUCKETS, Counter, VipInfo, BUCKET_SLOTS};

use crate::{
    maps::{count, BUCKETS, BUCKET_STATS, CLOSES, LOAD, OPENS},
    parse::Packet,
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

/// New connections `id` may still take before it is past its threshold (<= 0: past it):
/// the agent's budget, less what opened since, plus what closed since.
#[inline(always)]
fn room(id: u32) -> i64 {
    let (Some(load), Some(opens), Some(closes)) = (LOAD.get(id), OPENS.get(id), CLOSES.get(id))
    else {
        return 0;
    };
    let opened = opens.wrapping_sub(load.opened_base) as i64;
    let closed = closes.wrapping_sub(load.closed_base) as i64;
    i64::from(load.budget) - opened + closed
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
    if room(home) > 0 {
        chosen = Some(0);
    } else {
        let mut best_room = 0;
        let mut i = 1;
        while i < candidates.len() {
            let id = candidates[i];
            if id != 0 {
                let r = room(id);
                if r > best_room {
                    best_room = r;
                    chosen = Some(i);
                }
            }
            i += 1;
        }
    }
    if let Some(stats) = stats {
        // SAFETY: per-CPU value, no other writer.
        unsafe {
            (*stats).hinted += 1;
            match chosen {
                Some(0) => {}
                Some(i) => {
                    (*stats).spilled += 1;
                    (*stats).picks[i] += 1;
                }
                None => (*stats).spilled += 1,
            }
            if chosen == Some(0) {
                (*stats).picks[0] += 1;
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

/// Counts a new connection to `id` where every CPU's spill decisions see it.
#[inline(always)]
pub fn note_open(id: u32) {
    if let Some(p) = OPENS.get_ptr_mut(id) {
        shared_add(p);
    }
}

/// Counts a closed connection to `id`, likewise.
#[inline(always)]
pub fn note_close(id: u32) {
    if let Some(p) = CLOSES.get_ptr_mut(id) {
        shared_add(p);
    }
}

/// An atomic add (BPF_ATOMIC_ADD): the bpf target offers no `AtomicU64::fetch_add` (it has
/// no compare-and-swap) but the instruction itself has existed since the first eBPF.
#[inline(always)]
fn shared_add(p: *mut u64) {
    // SAFETY: a valid, aligned u64 in a map's value area for this program run; the old value
    // is not used, which lets LLVM emit the plain atomic add.
    #[cfg(target_arch = "bpf")]
    unsafe {
        core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
            p, 1,
        );
    }
    // Host builds exist only so that the workspace's clippy and tests compile this crate.
    #[cfg(not(target_arch = "bpf"))]
    unsafe {
        *p += 1;
    }
}
