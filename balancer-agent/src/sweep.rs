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
    /// Entries of connections taken out while the program placed their flow again (see
    /// [`Reclaimed::Replaced`]), or that could not be put back, per backend id, whose close
    /// no one had counted: no entry will see their end, so the agent counts them closed.
    pub replaced: HashMap<u32, u64>,
    /// Why a deletion failed, if one did: the sweep stopped there (the next one goes on),
    /// and what it did before is counted.
    pub failed: Option<String>,
}

impl Swept {
    pub fn unanswered_total(&self) -> u64 {
        self.unanswered.values().sum()
    }

    fn note(&mut self, reclaimed: Reclaimed) {
        let count = |closes: &mut HashMap<u32, u64>, e: FlowEntry| {
            if e.close_claim == 0 {
                *closes.entry(e.backend_id).or_default() += 1;
            }
        };
        match reclaimed {
            Reclaimed::Deleted(e) if e.closed != 0 => self.ended += 1,
            Reclaimed::Deleted(e) => count(&mut self.unanswered, e),
            Reclaimed::Replaced(e) => count(&mut self.replaced, e),
            // Its open is closed as a replaced one's: no entry will see its end.
            Reclaimed::Lost(e, why) => {
                count(&mut self.replaced, e);
                self.failed = Some(format!("putting a flow entry back: {why}"));
            }
            Reclaimed::Gone | Reclaimed::PutBack => {}
        }
    }
}

/// When to sweep again after a sweep that took `took`.
pub fn pause(took: Duration) -> Duration {
    EVERY.max(took * 50)
}

/// Deletes from the flow table with map id `flows_id` the entries quiet for longer than
/// `quiet` that ended or never had their handshake acknowledged. Walks the whole table (in
/// batches) and then looks at each such entry again and takes it, two system calls an entry:
/// run it on a blocking thread, without the controller's lock.
pub fn sweep(flows_id: u32, quiet: Duration) -> Result<Swept> {
    let mut table = Reclaimer::open(flows_id, quiet)?;
    let mut found = Vec::new();
    let mut entries = 0;
    table
        .taken
        .for_each(|key, entry| {
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
        match table.reclaim(&key) {
            Ok(reclaimed) => swept.note(reclaimed),
            Err(e) => swept.failed = Some(format!("{e:#}")),
        }
        if swept.failed.is_some() {
            break;
        }
    }
    Ok(swept)
}

/// What [`Reclaimer::reclaim`] did with an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reclaimed {
    /// There was none.
    Gone,
    /// Deleted: it could go.
    Deleted(FlowEntry),
    /// Taken and put back: the program wrote a new connection into it since it was looked at.
    PutBack,
    /// Taken, not put back: the program placed the flow again while it was out (its packet
    /// found no entry), and that entry stays.
    Replaced(FlowEntry),
    /// Taken, and putting it back failed, for this reason: its connection is gone from the
    /// table (its next packet is placed anew).
    Lost(FlowEntry, String),
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

    /// Deletes `key`'s entry if it may go. Taken, then looked at: an entry the program
    /// rewrote since the caller looked (a SYN placed a new connection on the tuple) is put
    /// back at once, rather than deleted with the one that could go (its connection's packets
    /// would be placed anew: another server, perhaps). That narrows the window a separate
    /// look and delete leave to the taking itself; a program that writes into the entry in
    /// place while it is taken (it found it just before) writes into the copy that goes.
    pub fn reclaim(&mut self, key: &FlowKey) -> Result<Reclaimed> {
        let Some(entry) = self.taken.take(key)? else {
            return Ok(Reclaimed::Gone);
        };
        if self.reclaimable(&entry) {
            return Ok(Reclaimed::Deleted(entry));
        }
        Ok(match self.put_back(key, entry) {
            Ok(true) => Reclaimed::PutBack,
            Ok(false) => Reclaimed::Replaced(entry),
            Err(e) => Reclaimed::Lost(entry, format!("{e:#}")),
        })
    }

    /// Writes `entry` for `key` if there is none; whether it did (else the program's own
    /// entry for the flow, newer still, stays).
    pub fn put_back(&mut self, key: &FlowKey, entry: FlowEntry) -> Result<bool> {
        match self.entries.insert(key, entry, u64::from(BPF_NOEXIST)) {
            Ok(()) => Ok(true),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {
                Ok(false)
            }
            Err(e) => Err(e).context("putting a flow entry back"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Closes are counted once, where no one counted them: an unanswered handshake's, and
    /// that of a connection taken out while the program placed its flow again.
    #[test]
    fn what_was_taken_is_counted_where_its_close_was_not() {
        let entry = |closed, close_claim| FlowEntry {
            backend_id: 7,
            closed,
            close_claim,
            ..FlowEntry::default()
        };
        let mut swept = Swept::default();
        for r in [
            Reclaimed::Deleted(entry(1, 1)),
            Reclaimed::Deleted(entry(0, 0)),
            Reclaimed::Deleted(entry(0, 1)),
            Reclaimed::Replaced(entry(0, 0)),
            Reclaimed::Replaced(entry(1, 1)),
            Reclaimed::PutBack,
            Reclaimed::Gone,
            Reclaimed::Lost(entry(0, 0), "no memory".into()),
        ] {
            swept.note(r);
        }
        assert_eq!(
            swept,
            Swept {
                ended: 1,
                unanswered: [(7, 1)].into(),
                replaced: [(7, 2)].into(),
                failed: Some("putting a flow entry back: no memory".into()),
                ..Swept::default()
            }
        );
    }
}
