//! The policy: what the agent knows about a pool's servers in, Maglev weights out.
//!
//! Pure code (no I/O, no clock, no kernel), so every rule is tested here; `docs/policy.md`
//! explains the same rules for operators, with the design brief's worked example.
//!
//! For each pool, every tick:
//!
//! 1. **Ineligible** servers get weight 0: DOWN (health checks failed), DRAINING (operator),
//!    and configured weight 0. Nothing, not even fail-open, gives them weight.
//! 2. **Saturated** servers get weight 0: effective waiting at or above `spill_waiting`,
//!    recent TTFT at or above `spill_ttft_ms`, or KV-memory use at or above `kv_high`.
//!    Saturation is judged only on fresh metrics, and only on the signals the server publishes.
//! 3. **Everyone else** gets a weight that falls with load and KV use:
//!
//!    ```text
//!    load      = running + WAITING_COST * waiting          (fresh flows folded in, see below)
//!    headroom  = 1 - kv_usage / kv_high                    (1 when no KV gauge)
//!    score     = configured * headroom / (1 + load)
//!    weight    = max(1, round(MAX_WEIGHT * score / max score in the pool))
//!    ```
//!
//!    `1 / (1 + load)` is the share of the server a new request gets if it joins the batch
//!    (itself plus `load` others); `headroom` is the part of the KV budget still free for its
//!    prompt and answer. Weights are relative: the best server gets [`MAX_WEIGHT`], the rest
//!    their proportion of it, never 0.
//! 4. **Fresh flows** (connections opened since the metrics were taken) are requests the last
//!    scrape could not see. On a server that showed waiting > 0 (no free slot) they count as
//!    waiting; otherwise as running. Either way a burst lowers the weight before the next
//!    scrape, and on a queueing server it can push waiting over `spill_waiting`.
//! 5. **Stale** servers (no successful scrape for 3 intervals, or never scraped) are not
//!    judged on old numbers: they are never saturated, and get [`STALE_TRUST`] times the score
//!    of the median fresh, unsaturated server with their configured weight; with no such
//!    server, their configured weight. Liveness is the health checks' business.
//! 6. **Fail-open**: when every eligible server is saturated, all of them get weight,
//!    `configured / (1 + load)`, instead of refusing all new connections: the overflow is
//!    shared so that queues grow evenly.
//!
//! [`worth_applying`] decides whether new weights differ enough from the applied ones to
//! rewrite the Maglev table (hysteresis).

use std::fmt;

/// Weight of the best server of a pool; the others get their proportion of it. 10,000 gives
/// a resolution of 0.01% of the best server, finer than the Maglev table (16381 slots)
/// can express, and stays far below the builder's limit of 1,000,000 per server.
pub const MAX_WEIGHT: u32 = 10_000;

/// How many running requests one waiting request counts as in the load. A queued request
/// will take a batch slot as soon as one frees, and until then every new request queues
/// behind it: it costs a newcomer more than a request already running. Only matters when
/// `spill_waiting` > 1; with the default of 1 any queue saturates the server.
pub const WAITING_COST: f64 = 2.0;

/// A stale server gets this fraction of a typical (median) fresh server's score: we do not
/// know its load, so it gets some traffic, less than the servers we can see.
pub const STALE_TRUST: f64 = 0.5;

/// Hysteresis: a server's share of a pool must move by more than this fraction of its old
/// share ...
pub const HYSTERESIS_RELATIVE: f64 = 0.10;
/// ... and by more than this absolute share (0.1% of the pool's new connections, about 16
/// slots of a 16381-slot table) before the table is rewritten.
pub const HYSTERESIS_ABSOLUTE: f64 = 0.001;

/// Thresholds from the configuration: reaching any of them saturates a server.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// Waiting requests (fresh flows included, see the module doc) at or above this: saturated.
    pub spill_waiting: f64,
    /// Recent time to first token, in milliseconds, at or above this: saturated.
    pub spill_ttft_ms: f64,
    /// KV-cache memory in use, as a fraction of the total, at or above this: saturated.
    pub kv_high: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            spill_waiting: 1.0,
            spill_ttft_ms: 500.0,
            kv_high: 0.95,
        }
    }
}

/// A server's state. Saturation is not a state: it is a weight of 0 while it lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum State {
    /// Health checks pass.
    Up,
    /// Health checks failed `fall` times in a row.
    Down,
    /// The operator drains it: no new connections, established ones untouched.
    Draining,
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            State::Up => "UP",
            State::Down => "DOWN",
            State::Draining => "DRAINING",
        })
    }
}

/// What the agent knows about one server at a tick.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerView {
    pub state: State,
    /// The configured weight (relative; 0 = never send).
    pub configured: u32,
    /// From the last successful scrape; None until the first one, or when the server does not
    /// publish the signal. Values that are not finite or are negative are ignored like None.
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    /// Fraction 0..1 of the KV-cache memory in use.
    pub kv_usage: Option<f64>,
    /// Recent time to first token in milliseconds (None until observed).
    pub ttft_ms: Option<f64>,
    /// Metrics older than 3 scrape intervals (or never scraped).
    pub stale: bool,
    /// Connections the XDP program opened to this server since the metrics were taken: they
    /// are running or waiting on it now even though the last scrape could not see them.
    pub fresh_flows: u64,
    /// Its engine holds a queue and makes no progress: its metrics answer, its model does
    /// not, so no fail-open may send it connections.
    pub hung: bool,
}

/// The policy's verdict on one server.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Relative Maglev weight, 0..=[`MAX_WEIGHT`].
    pub weight: u32,
    /// A threshold is reached (fresh metrics only). A server chosen by fail-open is still
    /// saturated.
    pub saturated: bool,
    /// It has its weight only because no server of its pool could take a connection
    /// otherwise: every one saturated, or DOWN (see [`decide`]).
    pub fail_open: bool,
    /// Why the weight is what it is, for logs and `show`.
    pub reason: String,
}

/// A signal the policy may use: published, finite, not negative.
fn signal(v: Option<f64>) -> Option<f64> {
    v.filter(|x| x.is_finite() && *x >= 0.0)
}

/// Trims a float for messages: "3", "0.97", "910".
fn num(x: f64) -> String {
    let s = format!("{x:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

/// A fresh server's signals with its fresh flows folded in.
#[derive(Debug, Clone, Copy)]
struct Picture {
    running: Option<f64>,
    waiting: Option<f64>,
    kv: Option<f64>,
    ttft: Option<f64>,
    /// Fresh flows counted as running (when the server had no queue) ...
    new_running: f64,
    /// ... or as waiting (when it had one).
    new_waiting: f64,
}

impl Picture {
    fn of(s: &ServerView) -> Picture {
        let running = signal(s.running);
        let waiting = signal(s.waiting);
        let fresh = s.fresh_flows as f64;
        let queueing = waiting.is_some_and(|w| w > 0.0);
        Picture {
            running,
            waiting,
            kv: signal(s.kv_usage),
            ttft: signal(s.ttft_ms),
            new_running: if queueing { 0.0 } else { fresh },
            new_waiting: if queueing { fresh } else { 0.0 },
        }
    }

    /// Waiting including fresh flows counted as waiting (None if the server publishes none).
    fn waiting(&self) -> Option<f64> {
        self.waiting.map(|w| w + self.new_waiting)
    }

    /// Running including fresh flows counted as running.
    fn running(&self) -> f64 {
        self.running.unwrap_or(0.0) + self.new_running
    }

    fn load(&self) -> f64 {
        self.running() + WAITING_COST * self.waiting().unwrap_or(0.0)
    }

    fn headroom(&self, t: &Thresholds) -> f64 {
        match self.kv {
            Some(kv) if t.kv_high > 0.0 => (1.0 - kv / t.kv_high).clamp(0.0, 1.0),
            Some(_) => 0.0,
            None => 1.0,
        }
    }

    /// Score per unit of configured weight.
    fn unit_score(&self, t: &Thresholds) -> f64 {
        self.headroom(t) / (1.0 + self.load())
    }

    /// The thresholds reached, as reasons; empty when not saturated.
    fn saturation(&self, t: &Thresholds) -> Vec<String> {
        let mut why = Vec::new();
        if let Some(w) = self.waiting() {
            if w >= t.spill_waiting {
                let new = if self.new_waiting > 0.0 {
                    format!(
                        " ({} + {} new)",
                        num(w - self.new_waiting),
                        num(self.new_waiting)
                    )
                } else {
                    String::new()
                };
                why.push(format!(
                    "waiting {}{new} >= {}",
                    num(w),
                    num(t.spill_waiting)
                ));
            }
        }
        if let Some(ttft) = self.ttft {
            if ttft >= t.spill_ttft_ms {
                why.push(format!(
                    "ttft {}ms >= {}ms",
                    num(ttft.round()),
                    num(t.spill_ttft_ms)
                ));
            }
        }
        if let Some(kv) = self.kv {
            if kv >= t.kv_high {
                why.push(format!("kv {} >= {}", num(kv), num(t.kv_high)));
            }
        }
        why
    }

    /// Why an unsaturated server has its weight: "load 16 (14 running + 2 new), kv headroom 36%".
    fn explain(&self, t: &Thresholds) -> String {
        let mut parts = Vec::new();
        if let Some(r) = self.running {
            parts.push(format!("{} running", num(r)));
        }
        if self.new_running > 0.0 {
            parts.push(format!("{} new", num(self.new_running)));
        }
        if let Some(w) = self.waiting() {
            if w > 0.0 {
                parts.push(format!("{} x {} waiting", num(WAITING_COST), num(w)));
            }
        }
        let mut s = format!("load {}", num(self.load()));
        if !parts.is_empty() {
            s += &format!(" ({})", parts.join(" + "));
        }
        match self.kv {
            Some(_) => s += &format!(", kv headroom {:.0}%", self.headroom(t) * 100.0),
            None => s += ", no kv gauge",
        }
        s
    }
}

/// Scales positive scores to weights: the largest gets [`MAX_WEIGHT`], every other at least 1.
fn scale(scores: &[Option<f64>]) -> Vec<u32> {
    let top = scores.iter().flatten().copied().fold(0.0_f64, f64::max);
    scores
        .iter()
        .map(|s| match s {
            None => 0,
            Some(s) if top > 0.0 && s.is_finite() => {
                ((f64::from(MAX_WEIGHT) * s / top).round() as u32).clamp(1, MAX_WEIGHT)
            }
            Some(_) => 1,
        })
        .collect()
}

fn median(mut xs: Vec<f64>) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    Some(if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    })
}

/// Weights for one pool, one [`Decision`] per server, in order. See the module doc for the
/// rules; `docs/policy.md` for the reasons.
pub fn decide(servers: &[ServerView], t: &Thresholds) -> Vec<Decision> {
    let pics: Vec<Picture> = servers.iter().map(Picture::of).collect();
    let mut out: Vec<Decision> = Vec::with_capacity(servers.len());
    // Score per server (None: weight 0), filled below.
    let mut scores: Vec<Option<f64>> = vec![None; servers.len()];
    let mut saturated_fresh = Vec::new();
    let mut stale = Vec::new();
    let mut fresh_units = Vec::new();

    for (i, (s, p)) in servers.iter().zip(&pics).enumerate() {
        let (saturated, reason) = match s.state {
            State::Down => (false, "down".to_string()),
            State::Draining => (false, "draining".to_string()),
            State::Up if s.configured == 0 => (false, "configured weight 0".to_string()),
            State::Up if s.stale => {
                stale.push(i);
                (false, String::new())
            }
            State::Up => {
                let why = p.saturation(t);
                if why.is_empty() {
                    let unit = p.unit_score(t);
                    fresh_units.push(unit);
                    scores[i] = Some(f64::from(s.configured) * unit);
                    (false, p.explain(t))
                } else {
                    saturated_fresh.push(i);
                    (true, why.join(", "))
                }
            }
        };
        out.push(Decision {
            weight: 0,
            saturated,
            fail_open: false,
            reason,
        });
    }

    // Stale servers: half a typical fresh server, or their configured weight when no fresh
    // unsaturated server is there to compare with.
    let typical = median(fresh_units);
    for &i in &stale {
        let configured = f64::from(servers[i].configured);
        scores[i] = Some(configured * STALE_TRUST * typical.unwrap_or(1.0));
        out[i].reason = match typical {
            Some(_) => format!(
                "stale metrics: {}% of the median server",
                num(STALE_TRUST * 100.0)
            ),
            None => "stale metrics: configured weight".to_string(),
        };
    }

    // Fail-open's score: the configured weight shared by load alone.
    let by_load = |i: usize| f64::from(servers[i].configured) / (1.0 + pics[i].load());
    if scores.iter().all(Option::is_none) && !saturated_fresh.is_empty() {
        // Every eligible server is saturated: share the overflow by load, so that the queues
        // grow evenly. A single "least loaded" winner would take every new connection until
        // the next scrape, and be the most loaded by then. KV headroom is gone or beside the
        // point here, so only the load counts.
        for &i in &saturated_fresh {
            scores[i] = Some(by_load(i));
            out[i].fail_open = true;
            out[i].reason = format!("fail-open: shared by load ({})", out[i].reason);
        }
    }

    if scores.iter().all(Option::is_none) {
        // No server may take a connection but DOWN ones whose metrics still come: their
        // processes answer, and a mistake they share (an API key changed on the servers
        // first, a `model` they no longer serve) is likelier than all of them broken at
        // once. Dropping every new connection fails every client; the servers may well
        // serve them. Shared by load, as above. One whose metrics fail too is most likely
        // gone, and one whose engine is hung answers no request either: both stay out.
        for (i, s) in servers.iter().enumerate() {
            if s.state == State::Down && s.configured > 0 && !s.stale && !s.hung {
                scores[i] = Some(by_load(i));
                out[i].fail_open = true;
                out[i].reason = "fail-open: every server DOWN, its metrics answer".into();
            }
        }
    }

    for (d, w) in out.iter_mut().zip(scale(&scores)) {
        d.weight = w;
    }
    out
}

/// True when `new` differs from `old` enough to rewrite the Maglev table (hysteresis):
/// a different number of servers, any weight crossing between zero and non-zero, or any
/// server whose share of the pool (its weight over the sum) moves by more than
/// [`HYSTERESIS_RELATIVE`] of its old share and more than [`HYSTERESIS_ABSOLUTE`].
/// Shares, not raw weights, because weights are relative: doubling every weight changes
/// nothing.
pub fn worth_applying(old: &[u32], new: &[u32]) -> bool {
    if old.len() != new.len() {
        return true;
    }
    if old.iter().zip(new).any(|(o, n)| (*o == 0) != (*n == 0)) {
        return true;
    }
    let sum = |ws: &[u32]| ws.iter().map(|&w| f64::from(w)).sum::<f64>();
    let (old_sum, new_sum) = (sum(old), sum(new));
    if old_sum == 0.0 || new_sum == 0.0 {
        // Both all zero (a crossing was caught above).
        return false;
    }
    old.iter().zip(new).any(|(&o, &n)| {
        let (o, n) = (f64::from(o) / old_sum, f64::from(n) / new_sum);
        let moved = (n - o).abs();
        moved > HYSTERESIS_RELATIVE * o && moved > HYSTERESIS_ABSOLUTE
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(running: f64, waiting: f64, kv: Option<f64>, ttft: Option<f64>) -> ServerView {
        ServerView {
            state: State::Up,
            configured: 100,
            running: Some(running),
            waiting: Some(waiting),
            kv_usage: kv,
            ttft_ms: ttft,
            stale: false,
            fresh_flows: 0,
            hung: false,
        }
    }

    fn idle() -> ServerView {
        up(0.0, 0.0, Some(0.1), Some(100.0))
    }

    fn weights(servers: &[ServerView], t: &Thresholds) -> Vec<u32> {
        decide(servers, t).iter().map(|d| d.weight).collect()
    }

    /// The design brief's table: 10.4.0.11-14.
    fn brief() -> Vec<ServerView> {
        let mut draining = up(0.0, 0.0, Some(0.03), None);
        draining.state = State::Draining;
        vec![
            up(14.0, 0.0, Some(0.61), Some(240.0)),
            up(16.0, 3.0, Some(0.88), Some(910.0)),
            up(9.0, 0.0, Some(0.44), Some(180.0)),
            draining,
        ]
    }

    #[test]
    fn brief_worked_example() {
        let d = decide(&brief(), &Thresholds::default());
        let w: Vec<u32> = d.iter().map(|d| d.weight).collect();
        assert_eq!(w[1], 0, "{d:?}");
        assert_eq!(w[3], 0, "{d:?}");
        assert!(w[2] > w[0] && w[0] > 0, "{d:?}");
        // The numbers docs/policy.md shows.
        assert_eq!(w, [4444, 0, 10000, 0]);
        assert!(d[1].saturated && !d[0].saturated && !d[2].saturated && !d[3].saturated);
        assert_eq!(d[1].reason, "waiting 3 >= 1, ttft 910ms >= 500ms");
        assert_eq!(d[3].reason, "draining");
        assert_eq!(d[0].reason, "load 14 (14 running), kv headroom 36%");
    }

    #[test]
    fn waiting_alone_saturates() {
        let t = Thresholds::default();
        let d = decide(&[up(1.0, 1.0, Some(0.1), Some(100.0)), idle()], &t);
        assert_eq!((d[0].weight, d[0].saturated), (0, true));
        assert_eq!(d[0].reason, "waiting 1 >= 1");
        assert!(d[1].weight > 0);
        // Just below a raised threshold: not saturated, but weighted down.
        let t = Thresholds {
            spill_waiting: 4.0,
            ..t
        };
        let d = decide(&[up(1.0, 3.0, Some(0.1), Some(100.0)), idle()], &t);
        assert!(!d[0].saturated && d[0].weight > 0 && d[0].weight < d[1].weight);
    }

    #[test]
    fn ttft_alone_saturates() {
        let t = Thresholds::default();
        let d = decide(&[up(1.0, 0.0, Some(0.1), Some(500.0)), idle()], &t);
        assert_eq!((d[0].weight, d[0].saturated), (0, true));
        assert_eq!(d[0].reason, "ttft 500ms >= 500ms");
        let d = decide(&[up(1.0, 0.0, Some(0.1), Some(499.0)), idle()], &t);
        assert!(!d[0].saturated && d[0].weight > 0);
    }

    #[test]
    fn kv_alone_saturates() {
        let t = Thresholds::default();
        let d = decide(&[up(1.0, 0.0, Some(0.97), Some(100.0)), idle()], &t);
        assert_eq!((d[0].weight, d[0].saturated), (0, true));
        assert_eq!(d[0].reason, "kv 0.97 >= 0.95");
        // At the threshold exactly.
        let d = decide(&[up(1.0, 0.0, Some(0.95), None), idle()], &t);
        assert!(d[0].saturated && d[0].weight == 0, "{d:?}");
        // Just below: never 0 for an unsaturated server, however small its headroom.
        let d = decide(&[up(1.0, 0.0, Some(0.9499), Some(100.0)), idle()], &t);
        assert!(!d[0].saturated && d[0].weight >= 1);
    }

    #[test]
    fn configured_zero_and_down_get_nothing() {
        let t = Thresholds::default();
        let mut zero = idle();
        zero.configured = 0;
        let mut down = idle();
        down.state = State::Down;
        let d = decide(&[zero, down, up(30.0, 0.0, Some(0.9), None)], &t);
        assert_eq!(d[0].weight, 0);
        assert_eq!(d[0].reason, "configured weight 0");
        assert_eq!(d[1].weight, 0);
        assert_eq!(d[1].reason, "down");
        assert_eq!(d[2].weight, MAX_WEIGHT);
    }

    #[test]
    fn weights_follow_configured_and_stay_in_range() {
        let t = Thresholds::default();
        let mut big = idle();
        big.configured = 300;
        let w = weights(&[idle(), big.clone()], &t);
        assert_eq!(w, [3333, 10000]);
        // Extreme configured weights: the small one still gets at least 1.
        big.configured = 1_000_000;
        let mut small = up(50.0, 0.0, Some(0.94), None);
        small.configured = 1;
        let w = weights(&[small, big], &t);
        assert_eq!(w, [1, MAX_WEIGHT]);
        assert!(decide(&[], &t).is_empty());
    }

    #[test]
    fn all_saturated_fails_open_shared_by_load() {
        let t = Thresholds::default();
        // Loads 10 + 2x3 = 16, 12 + 2x1 = 14, 2 + 2x5 = 12: shares 1/17 : 1/15 : 1/13.
        let servers = [
            up(10.0, 3.0, Some(0.5), Some(900.0)),
            up(12.0, 1.0, Some(0.9), Some(2000.0)),
            up(2.0, 5.0, Some(0.2), Some(600.0)),
        ];
        let d = decide(&servers, &t);
        assert_eq!(
            d.iter().map(|d| d.weight).collect::<Vec<_>>(),
            [7647, 8667, MAX_WEIGHT]
        );
        assert!(d.iter().all(|d| d.saturated));
        assert!(
            d.iter()
                .all(|d| d.reason.starts_with("fail-open: shared by load (waiting")),
            "{d:?}"
        );
        // Saturated by KV only (no headroom at all): still shared by load.
        let servers = [
            up(4.0, 0.0, Some(0.99), Some(100.0)),
            up(9.0, 0.0, Some(0.96), Some(100.0)),
        ];
        assert_eq!(weights(&servers, &t), [MAX_WEIGHT, 5000]);
    }

    #[test]
    fn fail_open_ties_share_by_configured_weight() {
        let t = Thresholds::default();
        let mut b = up(5.0, 2.0, Some(0.5), Some(800.0));
        b.configured = 50;
        let servers = [
            up(5.0, 2.0, Some(0.5), Some(800.0)),
            b,
            up(5.0, 4.0, None, None),
        ];
        // Loads 9, 9, 13: configured weight times 1 / (1 + load).
        assert_eq!(weights(&servers, &t), [MAX_WEIGHT, 5000, 7143]);
    }

    #[test]
    fn fail_open_never_picks_down_or_draining() {
        let t = Thresholds::default();
        let mut down = idle();
        down.state = State::Down;
        let mut draining = idle();
        draining.state = State::Draining;
        let mut zero = idle();
        zero.configured = 0;
        let servers = [down, draining, zero, up(9.0, 7.0, Some(0.5), Some(3000.0))];
        assert_eq!(weights(&servers, &t), [0, 0, 0, MAX_WEIGHT]);
    }

    #[test]
    fn no_eligible_server_means_all_zero() {
        let t = Thresholds::default();
        // DOWN with failing metrics too (gone, most likely), and draining.
        let servers: Vec<ServerView> = (0..4)
            .map(|i| {
                let mut s = idle();
                s.state = if i % 2 == 0 {
                    State::Down
                } else {
                    State::Draining
                };
                s.stale = true;
                s
            })
            .collect();
        assert_eq!(weights(&servers, &t), [0, 0, 0, 0]);
        let mut all_down = brief();
        for s in &mut all_down {
            s.state = State::Down;
            s.stale = true;
        }
        let d = decide(&all_down, &t);
        assert!(d.iter().all(|d| d.weight == 0 && d.reason == "down"));
    }

    /// Every server DOWN while their metrics come (checks failing on a mistake they share):
    /// those whose metrics answer share the connections by load, rather than every new
    /// connection dropped; configured 0, draining, hung and DOWN ones with failing metrics
    /// stay out, and a single server that may take connections ends it.
    #[test]
    fn every_server_down_with_metrics_fails_open() {
        let t = Thresholds::default();
        let down = |running: f64| {
            let mut s = up(running, 0.0, Some(0.1), None);
            s.state = State::Down;
            s
        };
        let mut gone = down(0.0);
        gone.stale = true;
        let mut zero = down(0.0);
        zero.configured = 0;
        let mut draining = idle();
        draining.state = State::Draining;
        let mut hung = down(4.0);
        hung.hung = true;
        let servers = [down(0.0), down(3.0), gone, zero, draining, hung];
        let d = decide(&servers, &t);
        assert_eq!(
            d.iter().map(|d| d.weight).collect::<Vec<_>>(),
            [MAX_WEIGHT, 2500, 0, 0, 0, 0]
        );
        assert_eq!(
            d[0].reason,
            "fail-open: every server DOWN, its metrics answer"
        );
        assert!(d[0].fail_open && d[1].fail_open && !d[2].fail_open);
        assert_eq!(d[2].reason, "down");
        // One UP server, even saturated, takes them all.
        let servers = [down(0.0), up(9.0, 7.0, None, None)];
        assert_eq!(weights(&servers, &t), [0, MAX_WEIGHT]);
        let mut stale_up = idle();
        stale_up.stale = true;
        assert_eq!(weights(&[down(0.0), stale_up], &t), [0, MAX_WEIGHT]);
    }

    #[test]
    fn stale_servers_get_half_the_median_and_are_never_saturated() {
        let t = Thresholds::default();
        // Old numbers say saturated; they are stale, so they do not count.
        let mut stale = up(40.0, 20.0, Some(0.99), Some(5000.0));
        stale.stale = true;
        let a = up(0.0, 0.0, None, None); // unit score 1
        let b = up(1.0, 0.0, None, None); // 1/2
        let c = up(3.0, 0.0, None, None); // 1/4
        let d = decide(&[a, b, c, stale.clone()], &t);
        assert!(!d[3].saturated);
        // Median unit score 1/2, times STALE_TRUST: 1/4 of the best server.
        assert_eq!(d[3].weight, 2500, "{d:?}");
        assert_eq!(d[3].reason, "stale metrics: 50% of the median server");
        // A saturated fresh server is not part of the median.
        let sat = up(0.0, 9.0, None, None);
        let d = decide(&[up(1.0, 0.0, None, None), sat, stale.clone()], &t);
        assert_eq!(
            (d[0].weight, d[1].weight, d[2].weight),
            (MAX_WEIGHT, 0, 5000)
        );
        // Every server stale (e.g. before the first scrape): configured weights.
        let mut other = stale.clone();
        other.configured = 300;
        let d = decide(&[stale.clone(), other], &t);
        assert_eq!(
            d.iter().map(|d| d.weight).collect::<Vec<_>>(),
            [3333, 10000]
        );
        assert_eq!(d[0].reason, "stale metrics: configured weight");
        // Stale but never scraped at all: same.
        let mut never = ServerView {
            running: None,
            waiting: None,
            kv_usage: None,
            ttft_ms: None,
            ..stale.clone()
        };
        never.fresh_flows = 7;
        assert_eq!(weights(&[never], &t), [MAX_WEIGHT]);
        // The rest saturated: no fail-open, the stale server takes the traffic.
        let d = decide(&[up(0.0, 9.0, None, None), stale], &t);
        assert_eq!(d[0].weight, 0);
        assert!(!d[0].reason.contains("fail-open"));
        assert_eq!(d[1].weight, MAX_WEIGHT);
    }

    #[test]
    fn fresh_flows_lower_a_weight_before_the_next_scrape() {
        let t = Thresholds::default();
        let mut burst = up(4.0, 0.0, Some(0.3), Some(100.0));
        let other = up(4.0, 0.0, Some(0.3), Some(100.0));
        let before = weights(&[burst.clone(), other.clone()], &t);
        assert_eq!(before, [MAX_WEIGHT, MAX_WEIGHT]);
        burst.fresh_flows = 5;
        let d = decide(&[burst, other], &t);
        // load 9 instead of 4: 5/10 of the other's weight.
        assert_eq!((d[0].weight, d[1].weight), (5000, MAX_WEIGHT));
        assert_eq!(d[0].reason, "load 9 (4 running + 5 new), kv headroom 68%");
        // On a server that already queues, fresh flows count as waiting and can saturate it.
        let t = Thresholds {
            spill_waiting: 4.0,
            ..t
        };
        let mut queueing = up(4.0, 2.0, None, None);
        assert!(!decide(std::slice::from_ref(&queueing), &t)[0].saturated);
        queueing.fresh_flows = 2;
        let d = decide(&[queueing, idle()], &t);
        assert!(d[0].saturated, "{d:?}");
        assert_eq!(d[0].reason, "waiting 4 (2 + 2 new) >= 4");
    }

    #[test]
    fn missing_signals_are_not_invented() {
        let t = Thresholds::default();
        // No KV gauge, no TTFT (TGI, llama.cpp): judged on running and waiting only.
        let bare = up(4.0, 0.0, None, None);
        let d = decide(&[bare.clone(), up(4.0, 0.0, Some(0.0), Some(100.0))], &t);
        assert!(!d[0].saturated);
        assert_eq!(d[0].weight, d[1].weight);
        assert_eq!(d[0].reason, "load 4 (4 running), no kv gauge");
        // No waiting either: a queue we cannot see does not saturate it.
        let mut blind = bare.clone();
        blind.waiting = None;
        assert_eq!(weights(&[blind], &t), [MAX_WEIGHT]);
        // Garbage that slipped through is ignored, not guessed at.
        let mut nan = bare;
        nan.kv_usage = Some(f64::NAN);
        nan.ttft_ms = Some(-3.0);
        nan.waiting = Some(f64::INFINITY);
        let d = decide(&[nan, up(4.0, 0.0, None, None)], &t);
        assert!(!d[0].saturated);
        assert_eq!(d[0].weight, d[1].weight);
        // Fail-open shares by load only: a missing TTFT neither favours nor penalises.
        // Loads 4, 3, 5.
        let servers = [
            up(2.0, 1.0, None, None),
            up(1.0, 1.0, None, Some(600.0)),
            up(3.0, 1.0, None, Some(550.0)),
        ];
        assert_eq!(weights(&servers, &t), [8000, MAX_WEIGHT, 6667]);
    }

    #[test]
    fn more_load_never_raises_a_weight() {
        let t = Thresholds {
            spill_waiting: 3.0,
            ..Thresholds::default()
        };
        let runnings = [0.0, 1.0, 2.0, 5.0, 10.0, 40.0];
        let waitings = [0.0, 1.0, 2.0, 3.0, 6.0];
        let kvs = [None, Some(0.0), Some(0.3), Some(0.6), Some(0.9), Some(0.96)];
        let ttfts = [None, Some(100.0), Some(499.0), Some(500.0), Some(2000.0)];
        let freshes = [0, 1, 4];
        // Neighbours: one calm, one saturated, so fail-open and scaling are both exercised.
        let neighbour_sets = [
            vec![up(5.0, 0.0, Some(0.5), Some(200.0))],
            vec![up(5.0, 4.0, Some(0.5), Some(700.0))],
            vec![],
        ];
        let weight = |s: ServerView, n: &[ServerView]| {
            let mut pool = vec![s];
            pool.extend_from_slice(n);
            decide(&pool, &t)[0].weight
        };
        let mut checked = 0;
        for n in &neighbour_sets {
            for &r in &runnings {
                for &w in &waitings {
                    for &kv in &kvs {
                        for &ttft in &ttfts {
                            for &f in &freshes {
                                let mut s = up(r, w, kv, ttft);
                                s.fresh_flows = f;
                                let base = weight(s.clone(), n);
                                let mut more = Vec::new();
                                let mut m = s.clone();
                                m.running = Some(r + 1.0);
                                more.push(m);
                                let mut m = s.clone();
                                m.waiting = Some(w + 1.0);
                                more.push(m);
                                // (None to Some is not "more": a signal appearing.)
                                if let Some(kv) = kv {
                                    let mut m = s.clone();
                                    m.kv_usage = Some(kv + 0.05);
                                    more.push(m);
                                }
                                if let Some(ttft) = ttft {
                                    let mut m = s.clone();
                                    m.ttft_ms = Some(ttft + 300.0);
                                    more.push(m);
                                }
                                let mut m = s.clone();
                                m.fresh_flows = f + 1;
                                more.push(m);
                                for m in more {
                                    let after = weight(m.clone(), n);
                                    assert!(
                                        after <= base,
                                        "{s:?} -> {m:?} with {n:?}: {base} -> {after}"
                                    );
                                    checked += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 10_000);
    }

    #[test]
    fn hysteresis() {
        // Small change: no rewrite.
        assert!(!worth_applying(&[10000, 4444, 0], &[10000, 4600, 0]));
        // Scaling every weight changes no share.
        assert!(!worth_applying(&[10000, 5000], &[2000, 1000]));
        // Zero crossing, either way, however small.
        assert!(worth_applying(&[10000, 1, 0], &[10000, 1, 1]));
        assert!(worth_applying(&[10000, 5000], &[10000, 0]));
        // Large change.
        assert!(worth_applying(&[10000, 4444], &[10000, 8000]));
        // A server leaves or joins.
        assert!(worth_applying(&[10000, 4444], &[10000, 4444, 10000]));
        assert!(worth_applying(&[10000, 4444], &[10000]));
        assert!(worth_applying(&[5000, 5000], &[5000, 5000, 0]));
        // Tiny shares moving a lot relatively but under 0.1% absolutely: no rewrite.
        assert!(!worth_applying(&[10000, 1], &[10000, 3]));
        // All zero stays all zero.
        assert!(!worth_applying(&[0, 0], &[0, 0]));
        assert!(!worth_applying(&[], &[]));
    }

    #[test]
    fn state_serializes_upper_case() {
        let json = serde_json::to_string(&[State::Up, State::Down, State::Draining]).unwrap();
        assert_eq!(json, r#"["UP","DOWN","DRAINING"]"#);
        assert_eq!(State::Draining.to_string(), "DRAINING");
    }
}
