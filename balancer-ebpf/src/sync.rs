//! Flows shared with other gateways (`VIP_F_SYNC`): the program reports them in
//! `FLOW_EVENTS` and the agent sends them on, so that a flow whose packets move to another
//! gateway (a failover behind ECMP) finds its entry there. A report is best effort: a full
//! ring loses it (counted), and a flow that lives on is reported again at its next keepalive.

use aya_ebpf::bindings::BPF_RB_NO_WAKEUP;
use balancer_common::{Counter, FlowEntry, FlowEvent, FlowKey, FLOW_EVENT_OPEN};

use crate::maps::{count, FLOW_EVENTS};

/// `now` in the units of `FlowEntry::synced` (2^30 ns), never 0, which means "not shared".
#[inline(always)]
pub fn epoch(now: u64) -> u32 {
    let e = (now >> 30) as u32;
    if e == 0 {
        1
    } else {
        e
    }
}

#[inline(always)]
pub fn report(key: &FlowKey, entry: &FlowEntry, kind: u8) {
    let event = FlowEvent {
        key: *key,
        nat_addr: entry.nat_addr,
        nat_port: entry.nat_port,
        kind,
        _pad: 0,
    };
    if FLOW_EVENTS
        .output::<FlowEvent>(&event, u64::from(BPF_RB_NO_WAKEUP))
        .is_err()
    {
        count(Counter::SyncLost);
    }
}

/// A shared flow that is still alive is reported again once half its idle timeout has
/// passed since the last report, so that other gateways' entries do not expire while its
/// packets come here. Called at most once a second per flow (with `last_seen_ns`).
#[inline(always)]
pub fn keepalive(key: &FlowKey, entry: &mut FlowEntry, now: u64) {
    if entry.synced == 0 {
        return;
    }
    let e = epoch(now);
    let half = entry.idle_timeout_s / 2;
    if e.wrapping_sub(entry.synced) >= if half == 0 { 1 } else { half } {
        entry.synced = e;
        report(key, entry, FLOW_EVENT_OPEN);
    }
}
