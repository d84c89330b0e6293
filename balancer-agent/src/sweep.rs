//! Reclaiming the flow table. A connection's entry stays after its end (its last
//! packets still need translating), and so does a handshake's that never completed; the LRU
//! evicts only when it is full, and by recency. At a high rate of new connections the
//! entries of ended ones, touched last, would push out those of open connections that were
//! quiet for a while (a long generation that is not streamed sends nothing for minutes), whose
//! packets then go untranslated or to another server. The agent deletes such entries once
//! they have been quiet for [`QUIET`], so that new connections take their place rather than a
//! live one's.

use std::{collections::HashMap, time::Duration};

use anyhow::{Context, Result};
use aya::maps::{HashMap as BpfHashMap, Map, MapData, MapError};
use aya_obj::generated::BPF_NOEXIST;
use balancer_common::{FlowEntry, FlowKey};

use crate::{dataplane::monotonic_ns, map_ops};

/// How long an ended connection's or an unanswered handshake's entry is kept after its last
/// packet: longer than a retransmitted FIN or SYN takes (a client's third SYN comes 3 s after
/// its first).
pub const QUIET: Duration = Duration::from_secs(10);

/// A sweep every `EVERY`, or 50 times as long as the last one took if that is longer: a
/// table that takes a while to walk costs 2% of a core at most (a million entries, walked in
/// about 0.7 s, every 35 s).
const EVERY: Duration = Duration::from_secs(5);

/// What one sweep found and deleted.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Entries in the table when it was walked, the deleted ones included.
    pub entries: u64,
    /// Entries of connections that ended (see `FlowEntry::closed`).
    pub ended: u64,
    /// Entries of handshakes that never completed, per backend id, whose close no one had
    /// counted: the program counted them opened, so the agent counts them closed.
    pub unanswered: HashMap<u32, u64>,
}

impl Swept {
    pub fn unanswered_total(&self) -> u64 {
        self.unanswered.values().sum()
    }
}

/// When to sweep again after a sweep that took `took`.
pub fn pause(took: Duration) -> Duration {
    EVERY.max(took * 50)
}

/// Deletes from the flow table with map id `flows_id` the entries quiet for longer than
/// `quiet` that ended or never had their handshake acknowledged. Walks the whole table (in
/// batches) and then deletes one entry a system call: run it on a blocking thread, without
/// the controller's lock.
pub fn sweep(flows_id: u32, quiet: Duration) -> Result<Swept> {
    let mut table = Reclaimer::open(flows_id, quiet)?;
    let mut found = Vec::new();
    let mut entries = 0;
    map_ops::for_each(flows_id, |key: FlowKey, entry: FlowEntry| {
        entries += 1;
        if table.reclaimable(&entry) {
            found.push(key);
        }
        std::ops::ControlFlow::Continue(())
    })
    .context("walking the flow table")?;
    let mut swept = Swept {
        entries,
        ..Swept::default()
    };
    for key in found {
        // Looked at again just before: since the walk, a SYN may have placed a new connection
        // on the same tuple, or a packet revived a handshake. Not taken, then: a packet that
        // came while it was out would be placed anew.
        if !table
            .entries
            .get(&key, 0)
            .is_ok_and(|e| table.reclaimable(&e))
        {
            continue;
        }
        let Some(entry) = table.reclaim(&key)? else {
            continue;
        };
        if entry.closed != 0 {
            swept.ended += 1;
        } else if entry.close_claim == 0 {
            *swept.unanswered.entry(entry.backend_id).or_default() += 1;
        }
    }
    Ok(swept)
}

/// The flow table, to delete quiet entries from as of when it was opened.
pub struct Reclaimer {
    entries: BpfHashMap<MapData, FlowKey, FlowEntry>,
    taken: map_ops::Hash<FlowKey, FlowEntry>,
    now: u64,
    quiet: u64,
}

impl Reclaimer {
    /// The flow table with map id `flows_id`, whose entries quiet for longer than `quiet`
    /// that ended or never had their handshake acknowledged may go.
    pub fn open(flows_id: u32, quiet: Duration) -> Result<Self> {
        let map = MapData::from_id(flows_id).context("opening the flow table")?;
        Ok(Reclaimer {
            entries: BpfHashMap::try_from(Map::LruHashMap(map))
                .context("opening the flow table")?,
            taken: map_ops::Hash::open(flows_id).context("opening the flow table")?,
            now: monotonic_ns(),
            quiet: quiet.as_nanos() as u64,
        })
    }

    fn reclaimable(&self, e: &FlowEntry) -> bool {
        (e.closed != 0 || e.acked == 0) && self.now.saturating_sub(e.last_seen_ns) > self.quiet
    }

    /// Deletes `key`'s entry if it may go, and returns it. Taken, then looked at: an entry
    /// the program wrote since the caller looked (a SYN placed a new connection on the
    /// tuple) is put back at once, unless a packet placed the flow again meanwhile, rather
    /// than deleted with the one that could go (its connection's packets would be placed
    /// anew: another server, perhaps). Taking also reads the close's claim as it was
    /// deleted, so that a close the program claimed in between is not counted twice.
    pub fn reclaim(&mut self, key: &FlowKey) -> Result<Option<FlowEntry>> {
        let Some(entry) = self.taken.take(key)? else {
            return Ok(None);
        };
        if self.reclaimable(&entry) {
            return Ok(Some(entry));
        }
        match self.entries.insert(key, entry, u64::from(BPF_NOEXIST)) {
            Ok(()) => Ok(None),
            // The program's own entry for the flow, newer still, stays.
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {
                Ok(None)
            }
            Err(e) => Err(e).context("putting a flow entry back"),
        }
    }
}
