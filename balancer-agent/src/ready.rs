//! Whether this gateway should take traffic yet (`balancer-agent ready`, `GET /ready`): for
//! a router's health check or a routing daemon (ECMP behind BGP, say) that announces the
//! VIPs. An agent that just started is attached and forwarding at once, but its weights are
//! the configured ones until every server is scraped and checked, and behind ECMP a gateway
//! back from a reboot knows none of its peers' streams until they have sent them (`[sync]`):
//! a stream the router moves to it before then reaches another server and is reset.
//!
//! Ready once every pool's servers have each been scraped (well or not) and have each
//! passed a check, been found busy, or gone DOWN (a dead server is known dead: it takes no
//! connection once traffic comes; the failures that take it DOWN are still `fall` in a
//! row), and every peer has said it sent all its live flows, is silent
//! (not heard within [`SILENT_AFTER`] of this agent's hello, or lost since: nothing to wait
//! for), or has its datagrams refused; a peer that is heard but whose end never comes (an
//! agent from before this news, a walk of its table that failed) is given up on after
//! [`FLOWS_WAIT`]. Once ready, ready until the agent stops: a reload that adds a server, or
//! a peer lost later, must not take every gateway out of the routes at once.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{
    control::{PeerRow, PeerState},
    sync::{FLOWS_WAIT, SILENT_AFTER},
};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Readiness {
    pub ready: bool,
    /// What it waits for (none once ready).
    pub waiting: Vec<String>,
    /// What it went ahead without, and what it learned from its peers.
    pub notes: Vec<String>,
}

/// How far a pool's servers are since the agent started.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolStart {
    pub pool: String,
    pub servers: usize,
    /// Servers with no scrape done yet, good or failed.
    pub unscraped: usize,
    /// Servers with no health check done yet, good or failed.
    pub unchecked: usize,
    /// Servers whose checks all failed so far, not yet DOWN.
    pub failing: usize,
}

/// Where the start stands with `pools` and `peers` as they are, `since_asked` after this
/// agent first asked its peers for their flows (none: not yet).
pub fn assess(pools: &[PoolStart], peers: &[PeerRow], since_asked: Option<Duration>) -> Readiness {
    let mut waiting = Vec::new();
    let mut notes = Vec::new();
    for p in pools {
        for (n, what) in [
            (p.unscraped, "not scraped yet"),
            (p.unchecked, "not health-checked yet"),
            (p.failing, "failing their checks, not DOWN yet"),
        ] {
            if n > 0 {
                waiting.push(format!(
                    "pool {}: {n} of {} servers {what}",
                    p.pool, p.servers
                ));
            }
        }
    }
    for peer in peers {
        let name = &peer.peer;
        if let Some(flows) = peer.flows_at_start {
            notes.push(format!("{name}: sent its {flows} live flows"));
            continue;
        }
        let Some(since) = since_asked else {
            waiting.push(format!("{name}: not asked for its flows yet"));
            continue;
        };
        let why = match peer.state {
            PeerState::Up if since >= FLOWS_WAIT => {
                notes.push(format!(
                    "{name}: gave up waiting for the end of its flows after {} s (an agent \
                     older than `ready` never says it): those it sent are known here",
                    FLOWS_WAIT.as_secs()
                ));
                continue;
            }
            PeerState::Up => "its flows are coming",
            PeerState::Silent if since < SILENT_AFTER => "not heard yet",
            PeerState::Silent if peer.heard_ms_ago.is_some() => {
                notes.push(format!(
                    "{name}: lost before it said it sent all its flows: those it sent are \
                     known here"
                ));
                continue;
            }
            PeerState::Silent => {
                notes.push(format!(
                    "{name}: not heard from: its flows are not known here"
                ));
                continue;
            }
            PeerState::Refused => {
                let problem = peer
                    .problem
                    .as_deref()
                    .unwrap_or("its datagrams are refused");
                notes.push(format!("{name}: {problem}: its flows are not known here"));
                continue;
            }
        };
        waiting.push(format!("{name}: {why}"));
    }
    Readiness {
        ready: waiting.is_empty(),
        waiting,
        notes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(state: PeerState, flows_at_start: Option<u64>) -> PeerRow {
        PeerRow {
            peer: "10.4.0.2:7471".into(),
            state,
            heard_ms_ago: (state == PeerState::Up).then_some(300),
            events_in: 0,
            refused: 0,
            send_errors: 0,
            restarts: 0,
            problem: (state == PeerState::Refused)
                .then(|| "its datagrams are refused: its tag does not match".into()),
            flows_at_start,
        }
    }

    fn pool(unscraped: usize, unchecked: usize) -> PoolStart {
        PoolStart {
            pool: "chat".into(),
            servers: 4,
            unscraped,
            unchecked,
            failing: 0,
        }
    }

    #[test]
    fn waits_for_every_server_and_every_peer_that_can_answer() {
        let s = |secs| Some(Duration::from_secs(secs));
        // (pool, peer, seconds since the agent asked for the peers' flows) -> what it waits
        // for; ready when nothing.
        let cases = [
            (pool(0, 0), None, 0, vec![]),
            (
                pool(1, 4),
                None,
                0,
                vec![
                    "pool chat: 1 of 4 servers not scraped yet",
                    "pool chat: 4 of 4 servers not health-checked yet",
                ],
            ),
            (
                pool(0, 2),
                None,
                600,
                vec!["pool chat: 2 of 4 servers not health-checked yet"],
            ),
            (
                PoolStart {
                    failing: 1,
                    ..pool(0, 0)
                },
                None,
                0,
                vec!["pool chat: 1 of 4 servers failing their checks, not DOWN yet"],
            ),
            (pool(0, 0), Some(peer(PeerState::Up, Some(1204))), 1, vec![]),
            (
                pool(0, 0),
                Some(peer(PeerState::Up, None)),
                1,
                vec!["10.4.0.2:7471: its flows are coming"],
            ),
            (
                pool(0, 0),
                Some(peer(PeerState::Up, None)),
                119,
                vec!["10.4.0.2:7471: its flows are coming"],
            ),
            (pool(0, 0), Some(peer(PeerState::Up, None)), 120, vec![]),
            // Silent: nothing from it yet, then nothing to wait for; the end that came
            // counts even once it is silent.
            (
                pool(0, 0),
                Some(peer(PeerState::Silent, None)),
                3,
                vec!["10.4.0.2:7471: not heard yet"],
            ),
            (pool(0, 0), Some(peer(PeerState::Silent, None)), 4, vec![]),
            (
                pool(0, 0),
                Some(peer(PeerState::Silent, Some(0))),
                0,
                vec![],
            ),
            (pool(0, 0), Some(peer(PeerState::Refused, None)), 0, vec![]),
            // Silent or refused long after: nothing to wait for either.
            (pool(0, 0), Some(peer(PeerState::Silent, None)), 600, vec![]),
            (
                pool(0, 0),
                Some(peer(PeerState::Refused, None)),
                600,
                vec![],
            ),
        ];
        for (i, (pool, peer, since, want)) in cases.into_iter().enumerate() {
            let peers: Vec<PeerRow> = peer.into_iter().collect();
            let r = assess(&[pool], &peers, s(since));
            assert_eq!(r.waiting, want, "case {i}");
            assert_eq!(r.ready, want.is_empty(), "case {i}");
        }
        // Before its hello every peer is waited for, whatever it looks like; without peers
        // only the servers count.
        let r = assess(&[pool(0, 0)], &[peer(PeerState::Refused, None)], None);
        assert_eq!(r.waiting, ["10.4.0.2:7471: not asked for its flows yet"]);
        assert!(assess(&[pool(0, 0)], &[], None).ready);
    }

    #[test]
    fn says_what_it_went_ahead_without() {
        let notes = |peer: PeerRow, since| {
            assess(&[pool(0, 0)], &[peer], Some(Duration::from_secs(since))).notes
        };
        assert_eq!(
            notes(peer(PeerState::Up, Some(1204)), 1),
            ["10.4.0.2:7471: sent its 1204 live flows"]
        );
        assert_eq!(
            notes(peer(PeerState::Silent, None), 600),
            ["10.4.0.2:7471: not heard from: its flows are not known here"]
        );
        let lost = PeerRow {
            heard_ms_ago: Some(4000),
            ..peer(PeerState::Silent, None)
        };
        assert_eq!(
            notes(lost, 10),
            [
                "10.4.0.2:7471: lost before it said it sent all its flows: those it sent are \
              known here"
            ]
        );
        assert_eq!(
            notes(peer(PeerState::Refused, None), 1),
            [
                "10.4.0.2:7471: its datagrams are refused: its tag does not match: its flows are \
              not known here"
            ]
        );
        assert!(notes(peer(PeerState::Up, None), 120)[0].contains("gave up waiting"));
    }
}
