//! Flows shared with other gateways (`VIP_F_SYNC`): the program reports them in
//! `FLOW_EVENTS` and the agent sends them on, so that a flow whose packets move to another
//! gateway (a failover behind ECMP) finds its entry there. A report is best effort: a full
//! ring loses it (counted), and a flow that lives on is reported again at its next keepalive.

use aya_ebpf::bindings::BPF_RB_NO_WAKEUP;
use balancer_common::{
    sync_epoch, Counter, FlowEntry, FlowEvent, FlowKey, FLOW_ACKED, FLOW_EVENT_ALIVE,
};

use crate::{
    maps::{count, FLOW_EVENTS},
    NS_PER_S,
};

/// Reports the flow `key` with `entry`'s backend; false when the ring had no room.
#[inline(always)]
pub fn report(key: &FlowKey, entry: &FlowEntry, kind: u8, now: u64) -> bool {
    let event = FlowEvent {
        key: *key,
        nat_addr: entry.nat_addr,
        nat_port: entry.nat_port,
        kind,
        _pad: 0,
        epoch: sync_epoch(now),
    };
    let sent = FLOW_EVENTS
        .output::<FlowEvent>(&event, u64::from(BPF_RB_NO_WAKEUP))
        .is_ok();
    if !sent {
        count(Counter::SyncLost);
    }
    sent
}

/// A shared flow that is still alive is reported again once a third of its idle timeout has
/// passed since the last report that got through, so that other gateways' entries do not
/// expire while its packets come here, even with one report lost. Called at most once a
/// second per flow (with `last_seen_ns`). A flow whose client never acknowledged is not
/// reported: repeated forged SYNs would otherwise buy a report each.
#[inline(always)]
pub fn keepalive(key: &FlowKey, entry: &mut FlowEntry, now: u64) {
    if entry.synced == 0 || entry.acked == 0 {
        return;
    }
    let e = sync_epoch(now);
    if e.wrapping_sub(entry.synced) >= every(entry.idle_timeout_s)
        && report(key, entry, FLOW_EVENT_ALIVE, now)
    {
        entry.synced = e;
        entry.acked = FLOW_ACKED;
    }
}

/// Epochs between keepalives: a third of the idle timeout, at least one.
#[inline(always)]
fn every(idle_timeout_s: u32) -> u32 {
    let every = (u64::from(idle_timeout_s) * NS_PER_S / 3) >> 30;
    if every == 0 {
        1
    } else {
        every as u32
    }
}

/// A `FlowEntry::synced` that makes the flow's next keepalive check report it: a report
/// that was due and did not go out.
#[inline(always)]
pub fn overdue(now: u64, idle_timeout_s: u32) -> u32 {
    let e = sync_epoch(now).wrapping_sub(every(idle_timeout_s));
    // 0 means "not shared"; epoch 1 is as old as a clock this young has.
    if e == 0 {
        1
    } else {
        e
    }
}
