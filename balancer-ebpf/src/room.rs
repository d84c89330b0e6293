//! How many more new connections each backend may take before it is past its threshold:
//! the agent's budget from the last scrape, corrected by the connections opened and closed
//! since, which every CPU counts in shared counters. Both the hint spill and the Maglev
//! second draw decide on it, so the picture is never older than the last packet.

use balancer_common::{BUDGET_UNKNOWN, LOAD_F_HELD};

use crate::maps::{CLOSES, LOAD, OPENS};

/// New connections `id` may still take before it is past its threshold (<= 0: past it, by
/// as many requests as it is below zero): the agent's budget, less what opened since, plus
/// what closed since unless the backend is held (`LOAD_F_HELD`). None when its load is
/// unknown (`BUDGET_UNKNOWN`).
#[inline(always)]
pub fn room(id: u32) -> Option<i64> {
    // An id out of range has no load to know.
    let (Some(load), Some(opens), Some(closes)) = (LOAD.get(id), OPENS.get(id), CLOSES.get(id))
    else {
        return None;
    };
    if load.budget == BUDGET_UNKNOWN {
        return None;
    }
    let opened = opens.wrapping_sub(load.opened_base) as i64;
    let closed = if load.flags & LOAD_F_HELD != 0 {
        0
    } else {
        closes.wrapping_sub(load.closed_base) as i64
    };
    Some(i64::from(load.budget) - opened + closed)
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

/// Swaps 1 into `*p` atomically (BPF_XCHG): true for the one caller that found 0.
#[inline(always)]
pub fn claim(p: *mut u64) -> bool {
    // SAFETY: a valid, aligned u64 in a map's value area for this program run.
    #[cfg(target_arch = "bpf")]
    unsafe {
        core::intrinsics::atomic_xchg::<u64, { core::intrinsics::AtomicOrdering::Relaxed }>(p, 1)
            == 0
    }
    // Host builds exist only so that the workspace's clippy and tests compile this crate.
    #[cfg(not(target_arch = "bpf"))]
    unsafe {
        core::mem::replace(&mut *p, 1) == 0
    }
}

/// An atomic add (BPF_ATOMIC_ADD): the bpf target offers no `AtomicU64::fetch_add` (it has
/// no compare-and-swap) but the instruction itself has existed since the first eBPF.
#[inline(always)]
pub fn shared_add(p: *mut u64) {
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
