//! The agent's picture of every server, and what it does with it: scrapes and health checks
//! come in, weights go out to the maps. Time-critical I/O (scrapes, checks) happens outside;
//! this holds the state and the decisions, behind one lock taken for short moments.

use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use balancer_common::{
    addr_words, BackendStats, Counter, FlowKey, VipInfo, VipKey, BUDGET_UNKNOWN, IPPROTO_TCP,
};
use tracing::{info, warn};

use crate::{
    access::{Access, ApiKey, Tls},
    affinity::{self, Load, Member, PoolAffinity},
    config::{Config, Forwarding, Pool},
    control::{BucketRow, BucketsView, DrainStatus, PoolView, Response, ServerRow},
    dataplane::{Dataplane, FlowCensus, LoadCounts},
    dialect::{recent_ttft_ms, Dialect, DialectError, Reading, TtftSeries},
    health::{Outcome, Track, Transition, Waited},
    plan::{Ids, Recovered, Weights},
    policy::{decide, worth_applying, Decision, ServerView, State, Thresholds},
    ready::{self, PoolStart, Readiness},
    sync,
};

/// A server is identified by its pool and its API address.
pub type ServerKey = (String, SocketAddr);

/// What `ready` waits for while the gateway is withdrawn.
const WITHDRAWN: &str = "`balancer-agent restore` (withdrawn by the operator)";

/// Metrics older than this many scrape intervals are stale.
const STALE_INTERVALS: u32 = 3;

/// For `drain --wait` on a DSR pool (or of a DOWN server), a connection whose client sent
/// nothing for this long is no longer open on the server: a stream's client acknowledges its
/// tokens as they come, and servers close idle kept-alive connections sooner (uvicorn, under
/// vLLM and SGLang, after 5 s).
pub const DSR_QUIET: Duration = Duration::from_secs(10);

struct Server {
    id: u32,
    metrics: SocketAddr,
    dialect: Option<Dialect>,
    track: Track,
    draining: bool,
    /// When the drain began: a drain is over only after a scrape taken later says so.
    drain_started: Option<Instant>,
    reading: Option<Reading>,
    /// When the request of the last good scrape was sent.
    reading_at: Option<Instant>,
    ttft_ms: Option<f64>,
    /// When `ttft_ms` was last observed: a TTFT that nothing renews ages out, or a server
    /// saturated by TTFT would never get the request that shows it recovered.
    ttft_at: Option<Instant>,
    last_ttft: Option<TtftSeries>,
    /// Counters when the last good scrape was sent, and now.
    at_scrape: BackendStats,
    /// The program's spill counts when the last good scrape was sent: its budget's base.
    counts_at_scrape: Option<LoadCounts>,
    now: BackendStats,
    now_at: Instant,
    new_per_s: f64,
    decision: Decision,
    scrape_error: Option<String>,
    health: String,
    /// A health check's result came, good or not.
    checked: bool,
    /// A check passed, or found it busy: it is alive, whatever comes next.
    answered: bool,
    model: Option<String>,
    /// The most requests it was seen running: its slots, when the pool does not say.
    max_running: f64,
    /// Its dialect's progress counter, and when it last moved.
    progress: Option<Progress>,
    /// A server that was saturated takes no hinted connection until then, so that a bucket
    /// does not flap between its home and an alternate at the threshold.
    spill_hold_until: Option<Instant>,
}

impl Server {
    /// Takes the TTFT totals of a good scrape sent `at`: the mean TTFT of the requests that
    /// got their first token since the last good scrape, if that one is at most `life` old.
    /// After a longer gap (the scrapes between failed) the difference would average the
    /// whole gap, mostly requests long past, so this scrape only starts the series again.
    fn observe_ttft(&mut self, ttft: Option<&TtftSeries>, at: Instant, life: Duration) {
        let recent = self
            .reading_at
            .is_some_and(|last| at.saturating_duration_since(last) <= life);
        if let Some(ms) = recent
            .then(|| recent_ttft_ms(self.last_ttft.as_ref(), ttft))
            .flatten()
        {
            self.ttft_ms = Some(ms);
            self.ttft_at = Some(at);
        }
        // A label set this scrape left out (a NaN, say) keeps its last totals: when it comes
        // back, what it observed since is counted, not all it ever observed.
        self.last_ttft = match (self.last_ttft.take(), ttft) {
            (Some(mut last), Some(cur)) => {
                last.0.extend(cur.0.iter().map(|(k, v)| (k.clone(), *v)));
                Some(last)
            }
            (last, cur) => cur.cloned().or(last),
        };
    }

    /// A server new to the agent: UP, with its configured weight until the policy decides.
    fn new(id: u32, pool: &Pool, s: &crate::config::Server, now: Instant) -> Self {
        Server {
            id,
            metrics: SocketAddr::new(s.address, s.metrics_port),
            dialect: s.dialect.or(pool.dialect),
            track: Track::default(),
            draining: false,
            drain_started: None,
            reading: None,
            reading_at: None,
            ttft_ms: None,
            ttft_at: None,
            last_ttft: None,
            at_scrape: BackendStats::default(),
            counts_at_scrape: None,
            now: BackendStats::default(),
            now_at: now,
            new_per_s: 0.0,
            decision: Decision {
                weight: s.weight,
                saturated: false,
                fail_open: false,
                reason: "configured weight, no metrics yet".into(),
            },
            scrape_error: None,
            health: "not checked yet".into(),
            checked: false,
            answered: false,
            model: pool.model.clone(),
            max_running: 0.0,
            progress: None,
            spill_hold_until: None,
        }
    }

    /// DOWN before DRAINING: a drained server that fails its checks is shown and exported
    /// DOWN, where an alert on DOWN sees it; its drain goes on all the same.
    fn state(&self) -> State {
        if self.track.down {
            State::Down
        } else if self.draining {
            State::Draining
        } else {
            State::Up
        }
    }

    /// No good scrape within `stale_after` of `now`: its last numbers say nothing any more.
    fn stale(&self, now: Instant, stale_after: Duration) -> bool {
        self.reading_at
            .is_none_or(|t| now.duration_since(t) > stale_after)
    }

    /// Connections the program opened to it since the last good scrape, less those closed:
    /// load that scrape could not see.
    fn fresh_flows(&self) -> u64 {
        let opened = self
            .now
            .flows_opened
            .saturating_sub(self.at_scrape.flows_opened);
        let closed = self
            .now
            .flows_closed
            .saturating_sub(self.at_scrape.flows_closed);
        opened.saturating_sub(closed)
    }
}

/// What a scrape task needs to know about one server.
pub struct ScrapeTarget {
    pub key: ServerKey,
    /// Its id when the scrape was sent: `stats` and `counts` are that id's.
    pub id: u32,
    pub metrics: SocketAddr,
    pub dialect: Option<Dialect>,
    pub sent_at: Instant,
    pub stats: BackendStats,
    pub counts: Option<LoadCounts>,
    /// The pool's `api_key_file`, read: llama-server wants it on `/metrics` too.
    pub api_key: Option<ApiKey>,
    /// The pool's `[pool.tls]`, loaded.
    pub tls: Option<Tls>,
}

/// What a health task needs to know about one server.
pub struct HealthTarget {
    pub key: ServerKey,
    pub model: Option<String>,
    /// The pool's `api_key_file`, read.
    pub api_key: Option<ApiKey>,
    /// The pool's `[pool.tls]`, loaded.
    pub tls: Option<Tls>,
    /// In a pool with direct server return (`dsr` or `tunnel`): what the gateway's route to
    /// the server must be (`Routes::direct`).
    pub direct: Option<crate::route::Path>,
}

pub struct Controller {
    config: Config,
    ids: Ids,
    dp: Dataplane,
    servers: HashMap<ServerKey, Server>,
    /// Weights in the maps now, per pool in configuration order.
    applied: HashMap<String, Vec<u32>>,
    /// The last write of the weights failed: the next refresh writes them whatever changed,
    /// or a drain or DOWN that failed to reach the maps would stay unwritten while the
    /// weights it decided look applied.
    write_failed: bool,
    /// Prefix-hint buckets of the pools that take hints, and each pool's VIP id.
    affinity: HashMap<String, PoolAffinity>,
    vip_ids: HashMap<String, u32>,
    /// What sharing flows with other gateways did, when `[sync]` is on.
    sync_stats: Option<Arc<sync::Stats>>,
    /// Drain statuses' counts of open connections, shared between the pollers.
    census: Arc<FlowCensus>,
    /// How to reach each pool's servers (`api_key_file`, `[pool.tls]`), as read at the start
    /// or the last reload.
    access: HashMap<String, Access>,
    /// Flow-table entries the sweeps deleted (`sweep.rs`): of connections that ended, and of
    /// handshakes never completed.
    reclaimed: [u64; 2],
    /// Entries in the flow table at the last sweep's walk.
    flow_entries: Option<u64>,
    /// Once ready, the answer then, for the rest of the run (`ready.rs`).
    ready: Option<Readiness>,
    /// The operator took the gateway out of the routes (`withdraw`): not ready until
    /// `restore`, whatever else.
    withdrawn: bool,
}

impl Controller {
    /// Fills the maps with the configured weights; the first scrapes refine them. A start
    /// that fails here leaves the interfaces as the agent found them (`Dataplane::abandon`:
    /// over pinned maps, `run` attaches first).
    pub fn new(config: Config, mut dp: Dataplane) -> Result<Self> {
        // Flows in pinned maps name the ids an earlier agent gave, and the servers it was
        // draining or had found DOWN must not take a connection in between.
        let now = Instant::now();
        let first = (|| {
            let inherited = dp.inherited()?;
            let mut recovered = match &inherited {
                Some(old) => {
                    let vips: Vec<_> = old.vips.iter().map(|(k, v)| (*k, v.vip_id)).collect();
                    Ids::recover(&config, &vips, &old.backends, now)
                }
                None => Recovered {
                    ids: Ids::default(),
                    draining: Vec::new(),
                    down: Vec::new(),
                },
            };
            let mut weights = Weights::new();
            for server in &recovered.draining {
                weights.drain(server.clone());
            }
            for server in &recovered.down {
                weights.down(server.clone());
            }
            let plan = recovered.ids.plan(&config, &weights, now)?;
            dp.apply(&plan)?;
            anyhow::Ok((inherited, recovered, plan))
        })();
        let (inherited, recovered, plan) = match first {
            Ok(first) => first,
            Err(e) => {
                dp.abandon();
                return Err(e);
            }
        };
        let Recovered {
            ids,
            draining,
            down,
        } = recovered;
        let census = Arc::new(FlowCensus::new(dp.flows_id()));
        let mut c = Controller {
            config: Config {
                pool: Vec::new(),
                ..config.clone()
            },
            ids,
            dp,
            servers: HashMap::new(),
            applied: HashMap::new(),
            write_failed: false,
            census,
            access: HashMap::new(),
            reclaimed: [0; 2],
            flow_entries: None,
            affinity: HashMap::new(),
            vip_ids: HashMap::new(),
            sync_stats: None,
            ready: None,
            withdrawn: false,
        };
        c.adopt(config, &plan, &HashSet::new());
        let states =
            (draining.into_iter().map(|k| (k, false))).chain(down.into_iter().map(|k| (k, true)));
        for (key, is_down) in states {
            let Some(s) = c.servers.get_mut(&key) else {
                continue;
            };
            let what = if is_down {
                // Until `rise` checks pass, as if this agent had seen it fail.
                s.track.down = true;
                "DOWN"
            } else {
                s.draining = true;
                s.drain_started = Some(now);
                "draining"
            };
            s.decision.weight = 0;
            s.decision.reason = format!("{what}, as the previous agent left it");
            info!(pool = %key.0, server = %key.1, "{what}, as the previous agent left it");
        }
        if let Some(old) = &inherited {
            if let Err(e) = c.adopt_buckets(now, &old.vips) {
                c.dp.abandon();
                return Err(e);
            }
        }
        c.refresh_affinity();
        Ok(c)
    }

    /// The hint buckets an earlier agent left, for pools whose hint range is unchanged:
    /// homes stay where the prefixes are cached.
    fn adopt_buckets(&mut self, now: Instant, old: &[(VipKey, VipInfo)]) -> Result<()> {
        for (pool, aff) in self.affinity.iter_mut() {
            let Some(&vip_id) = self.vip_ids.get(pool) else {
                continue;
            };
            let range = aff.range;
            let same = old.iter().any(|(_, v)| {
                v.vip_id == vip_id
                    && (v.hint_start, v.hint_span, v.hint_buckets)
                        == (range.start, range.span, range.buckets)
            });
            if !same {
                continue;
            }
            let mut written = Vec::new();
            let mut stats = Vec::new();
            for b in 0..range.buckets {
                written.push(self.dp.bucket(vip_id, b)?);
                stats.push(self.dp.bucket_stats(vip_id, b)?);
            }
            aff.adopt(now, &written, &stats);
            let moved = written.iter().filter(|w| w.ids[0] != 0).count();
            info!(pool = %pool, buckets = moved, "took over the hint buckets' homes and alternates");
        }
        Ok(())
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn dataplane(&mut self) -> &mut Dataplane {
        &mut self.dp
    }

    /// Takes a new configuration: servers that stay keep their state (drain, health,
    /// metrics); new ones start UP with their configured weight in a new pool, DOWN until a
    /// good check in one that runs ([`Controller::joining`]).
    /// A configuration whose maps cannot be written is not taken: the running one's ids are
    /// kept and its plan is written again over whatever part of the new one got in.
    pub fn reconfigure(&mut self, config: Config) -> Result<()> {
        let joining = self.joining(&config);
        let mut weights = self.current_weights(&config);
        for key in &joining {
            weights.down(key.clone());
        }
        let running = self.ids.clone();
        let plan = self.ids.plan(&config, &weights, Instant::now())?;
        if let Err(e) = self.dp.apply(&plan) {
            self.ids = running;
            self.refresh(true);
            return Err(e);
        }
        self.adopt(config, &plan, &joining);
        // New configured weights reach the maps now, not at the next fold.
        self.refresh(true);
        Ok(())
    }

    /// The servers `config` adds to pools that run now (the same name, or the same VIP and
    /// port under another name): they wait for a good check ([`Track::unproven`]). A pool
    /// new to the agent, as every pool at its start, routes at once: it has no traffic yet
    /// to lose, and no other server to send it to.
    fn joining(&self, config: &Config) -> HashSet<ServerKey> {
        let mut joining = HashSet::new();
        for p in &config.pool {
            let running = self
                .config
                .pool
                .iter()
                .find(|o| o.name == p.name || (o.vip, o.port) == (p.vip, p.port));
            let Some(running) = running else {
                continue;
            };
            let addr = |s: &crate::config::Server| SocketAddr::new(s.address, s.port);
            let had: HashSet<SocketAddr> = running.server.iter().map(addr).collect();
            for s in &p.server {
                if !had.contains(&addr(s)) {
                    joining.insert((p.name.clone(), addr(s)));
                }
            }
        }
        joining
    }

    fn adopt(&mut self, config: Config, plan: &crate::plan::Plan, joining: &HashSet<ServerKey>) {
        let now = Instant::now();
        let mut servers = HashMap::new();
        self.applied.clear();
        // A model the old file named is dropped with its name; one found on the server stays.
        let named: HashSet<String> = (self.config.pool.iter())
            .filter(|p| p.model.is_some())
            .map(|p| p.name.clone())
            .collect();
        for (pool, vip) in config.pool.iter().zip(&plan.vips) {
            let mut applied = Vec::new();
            for (s, (addr, id)) in pool.server.iter().zip(&vip.members) {
                let key = (pool.name.clone(), *addr);
                let old = self.servers.remove(&key).filter(|o| o.id == *id);
                let server = match old {
                    Some(mut o) => {
                        o.metrics = SocketAddr::new(s.address, s.metrics_port);
                        o.dialect = s.dialect.or(pool.dialect);
                        let found = o.model.filter(|_| !named.contains(&pool.name));
                        o.model = pool.model.clone().or(found);
                        o
                    }
                    None => {
                        let mut new = Server::new(*id, pool, s, now);
                        if joining.contains(&key) {
                            new.track = Track::unproven();
                            new.decision.weight = 0;
                            new.decision.reason = "down".into();
                            new.health = "new: waiting for its first good check".into();
                        }
                        // Counts from before (pinned maps an earlier agent kept, or an id
                        // that served another server) are where its rates start, not
                        // connections it just opened.
                        if let Ok(stats) = self.dp.backend_stats(*id) {
                            (new.now, new.at_scrape) = (stats, stats);
                        }
                        new
                    }
                };
                applied.push(server.decision.weight);
                servers.insert(key, server);
            }
            self.applied.insert(pool.name.clone(), applied);
        }
        self.servers = servers;
        // A pool keeps its buckets' state across reloads unless its hint range changed.
        let mut affinity = HashMap::new();
        for (pool, vip) in config.pool.iter().zip(&plan.vips) {
            if let Some(range) = vip.hint {
                let kept = self
                    .affinity
                    .remove(&pool.name)
                    .filter(|a| a.range == range);
                affinity.insert(
                    pool.name.clone(),
                    kept.unwrap_or_else(|| PoolAffinity::new(range)),
                );
            }
        }
        self.affinity = affinity;
        self.vip_ids = plan
            .vips
            .iter()
            .map(|v| (v.pool.clone(), v.vip_id))
            .collect();
        self.config = config;
    }

    fn current_weights(&self, config: &Config) -> Weights {
        table_weights(config, &self.servers)
    }

    pub fn scrape_interval(&self) -> Duration {
        Duration::from_millis(self.config.agent.scrape_interval_ms)
    }

    /// How old a server's metrics may be before they say nothing any more: its numbers, a
    /// TTFT, and the scrape a TTFT difference starts from.
    fn stale_after(&self) -> Duration {
        self.scrape_interval() * STALE_INTERVALS
    }

    /// Counters are folded into the picture this often between scrapes, so that a burst of
    /// new connections weighs before the next scrape shows it.
    pub fn fold_interval(&self) -> Duration {
        (self.scrape_interval() / 4).clamp(Duration::from_millis(25), Duration::from_millis(250))
    }

    pub fn health_interval(&self) -> Duration {
        Duration::from_millis(self.config.agent.health_interval_ms)
    }

    pub fn scrape_targets(&mut self) -> Vec<ScrapeTarget> {
        let now = Instant::now();
        let mut targets = Vec::new();
        for (key, s) in &self.servers {
            let Access { api_key, tls } = self.access(&key.0);
            targets.push(ScrapeTarget {
                key: key.clone(),
                id: s.id,
                metrics: s.metrics,
                dialect: s.dialect,
                sent_at: now,
                stats: self.dp.backend_stats(s.id).unwrap_or(s.now),
                counts: self.dp.load_counts(s.id).ok(),
                api_key,
                tls,
            });
        }
        targets
    }

    /// Takes the results of one round of scrapes, then decides.
    pub fn scraped(
        &mut self,
        results: Vec<(ScrapeTarget, Result<Reading, crate::scrape::ScrapeError>)>,
    ) {
        let ttft_life = self.stale_after();
        for (target, result) in results {
            // Removed by a reload meanwhile, or removed and added again under a new id, whose
            // counters the scrape's baseline is not.
            let Some(s) = (self.servers.get_mut(&target.key)).filter(|s| s.id == target.id) else {
                continue;
            };
            match result {
                Ok(reading) => {
                    s.observe_ttft(reading.ttft.as_ref(), target.sent_at, ttft_life);
                    let before = s.reading.as_ref().and_then(|r| r.ignored.as_ref());
                    let new = |w: &&DialectError| !before.is_some_and(|b| b.same_fault(w));
                    if let Some(why) = reading.ignored.as_ref().filter(new) {
                        warn!(pool = %target.key.0, server = %target.key.1, "signal left out: {why}");
                    }
                    s.max_running = s.max_running.max(reading.running);
                    let idle = reading.running == 0.0 && reading.waiting == 0.0;
                    s.progress =
                        Progress::observe(s.progress, reading.progress, idle, target.sent_at);
                    s.reading = Some(reading);
                    s.reading_at = Some(target.sent_at);
                    s.at_scrape = target.stats;
                    s.counts_at_scrape = target.counts;
                    s.scrape_error = None;
                }
                Err(e) => {
                    if s.scrape_error.as_deref() != Some(&e.to_string()) {
                        warn!(pool = %target.key.0, server = %target.key.1, "scrape failed: {e}");
                    }
                    s.scrape_error = Some(e.to_string());
                }
            }
        }
        self.fold();
    }

    /// Reads the program's per-backend counters and decides again.
    pub fn fold(&mut self) {
        let now = Instant::now();
        let ttft_life = self.stale_after();
        for s in self.servers.values_mut() {
            if s.ttft_at.is_some_and(|t| now.duration_since(t) > ttft_life) {
                s.ttft_ms = None;
                s.ttft_at = None;
            }
            if let Ok(stats) = self.dp.backend_stats(s.id) {
                let dt = now.duration_since(s.now_at).as_secs_f64();
                if dt > 0.0 {
                    let opened = stats.flows_opened.saturating_sub(s.now.flows_opened);
                    s.new_per_s = opened as f64 / dt;
                }
                s.now = stats;
                s.now_at = now;
            }
        }
        self.refresh(false);
    }

    /// Recomputes every pool's weights; writes the maps when they changed enough, or always
    /// with `force` (a state change must not wait for hysteresis).
    fn refresh(&mut self, force: bool) {
        let force = force || self.write_failed;
        let now = Instant::now();
        let stale_after = self.stale_after();
        let hung_after = Duration::from_millis(self.config.agent.hung_after_ms);
        let mut changed = false;
        for pool in &self.config.pool {
            let keys: Vec<ServerKey> = pool
                .server
                .iter()
                .map(|s| (pool.name.clone(), SocketAddr::new(s.address, s.port)))
                .collect();
            let views: Vec<ServerView> = pool
                .server
                .iter()
                .zip(&keys)
                .map(|(cfg, key)| {
                    let s = &self.servers[key];
                    ServerView {
                        // Draining first here (`state` puts DOWN first, for operators): a
                        // drained server takes nothing, fail-open included.
                        state: if s.draining {
                            State::Draining
                        } else {
                            s.state()
                        },
                        configured: cfg.weight,
                        running: s.reading.as_ref().map(|r| r.running),
                        waiting: s.reading.as_ref().map(|r| r.waiting),
                        kv_usage: s.reading.as_ref().and_then(|r| r.kv_usage),
                        ttft_ms: s.ttft_ms,
                        stale: s.stale(now, stale_after),
                        fresh_flows: s.fresh_flows(),
                        hung: s.progress.and_then(|p| p.still_for(hung_after)).is_some(),
                    }
                })
                .collect();
            let decisions = decide(&views, &thresholds(pool));
            let new: Vec<u32> = decisions.iter().map(|d| d.weight).collect();
            let old = self.applied.get(&pool.name).cloned().unwrap_or_default();
            let apply = force || worth_applying(&old, &new);
            for (key, d) in keys.iter().zip(decisions) {
                let s = self.servers.get_mut(key).expect("server of the pool");
                if apply && (s.decision.weight == 0) != (d.weight == 0) {
                    info!(
                        pool = %key.0,
                        server = %key.1,
                        weight = d.weight,
                        "{}",
                        if d.weight == 0 { format!("takes no new connections: {}", d.reason) } else { format!("takes new connections again: {}", d.reason) }
                    );
                }
                if apply {
                    s.decision = d;
                } else {
                    // Keep the applied weight, but show the current reasoning.
                    s.decision.reason = d.reason;
                    s.decision.saturated = d.saturated;
                    s.decision.fail_open = d.fail_open;
                }
            }
            // Forced means a state changed (DOWN, UP, drain, reload): the alternates table must
            // follow even when the weights did not, e.g. a saturated server (weight 0) going
            // DOWN must leave it.
            if apply && (force || old != new) {
                self.applied.insert(pool.name.clone(), new);
                changed = true;
            }
        }
        if changed {
            let weights = self.current_weights(&self.config);
            let result = self
                .ids
                .plan(&self.config, &weights, Instant::now())
                .and_then(|plan| self.dp.apply(&plan));
            match &result {
                // Once per failing streak: it is retried at every fold.
                Err(e) if !self.write_failed => {
                    warn!("writing new weights failed, retrying at every fold: {e:#}")
                }
                Err(_) => {}
                Ok(()) if self.write_failed => info!("new weights written after failures"),
                Ok(()) => {}
            }
            self.write_failed = result.is_err();
        }
        self.refresh_affinity();
    }

    /// Spill budgets of every server, which the program's hint spill and Maglev second draw
    /// both read, then the candidates of every hint bucket.
    fn refresh_affinity(&mut self) {
        let now = Instant::now();
        let hold = self.scrape_interval() * 2;
        let idle = self.scrape_interval() * 30;
        let stale_after = self.stale_after();
        for pool in &self.config.pool {
            let mut members = Vec::new();
            let mut loads = Vec::new();
            let mut names = HashMap::new();
            for cfg in &pool.server {
                let addr = SocketAddr::new(cfg.address, cfg.port);
                let Some(s) = self.servers.get_mut(&(pool.name.clone(), addr)) else {
                    continue;
                };
                names.insert(s.id, addr);
                let up = s.state() == State::Up;
                if up && cfg.weight > 0 {
                    members.push(Member {
                        id: s.id,
                        key: addr.to_string(),
                        weight: cfg.weight,
                    });
                }
                let saturated = !up || s.decision.saturated;
                if saturated {
                    s.spill_hold_until = Some(now + hold);
                }
                let held = s.spill_hold_until.is_some_and(|t| now < t);
                let running = s.reading.as_ref().map_or(0.0, |r| r.running);
                let waiting = s.reading.as_ref().map_or(0.0, |r| r.waiting);
                let slots = pool.slots.unwrap_or(s.max_running.max(1.0) as u32);
                let fresh = s.fresh_flows();
                let stale = s.stale(now, stale_after);
                let budget = if !held && stale {
                    None
                } else {
                    let b = pool.spill_waiting;
                    Some(affinity::budget(held, slots, running, waiting, b))
                };
                // The program counts the connections opened and closed since the scrape the
                // budget comes from; without one, since now.
                let since = match s.counts_at_scrape.filter(|_| !stale) {
                    Some(c) => Ok(c),
                    None => self.dp.load_counts(s.id),
                };
                let written = since.and_then(|c| {
                    let b = budget.unwrap_or(BUDGET_UNKNOWN);
                    self.dp.set_load(s.id, b, held, c)
                });
                if let Err(e) = written {
                    warn!("writing a spill budget failed: {e:#}");
                }
                let why = if saturated {
                    s.decision.reason.clone()
                } else if held {
                    "recovering from saturation".into()
                } else {
                    format!("no free slot (running {running:.0} of {slots}, waiting {waiting:.0}, {fresh} new)")
                };
                loads.push(Load {
                    id: s.id,
                    saturated,
                    budget,
                    running: s.reading.as_ref().map(|r| r.running),
                    waiting: s.reading.as_ref().map(|r| r.waiting),
                    ttft_ms: s.ttft_ms,
                    why,
                });
            }
            let (Some(aff), Some(&vip_id)) = (
                self.affinity.get_mut(&pool.name),
                self.vip_ids.get(&pool.name),
            ) else {
                continue;
            };
            let stats: Vec<_> = (0..aff.range.buckets)
                .map(|b| self.dp.bucket_stats(vip_id, b).unwrap_or_default())
                .collect();
            let update = aff.update(now, &members, &loads, &stats, idle, pool.home_load_bound);
            let name = |id: u32| {
                names
                    .get(&id)
                    .map_or_else(|| format!("id {id}"), |a| a.to_string())
            };
            for m in &update.moves {
                info!(
                    pool = %pool.name,
                    "bucket {}: home moves from {} to {} to balance the hinted load (the bucket has {:.1}% of it, home_load_bound {})",
                    m.bucket,
                    name(m.from),
                    name(m.to),
                    m.share * 100.0,
                    pool.home_load_bound,
                );
            }
            for spill in &update.spills {
                info!(
                    pool = %pool.name,
                    "bucket {}: spill from {} to {}: {}",
                    spill.bucket,
                    name(spill.from),
                    name(spill.to),
                    spill.why
                );
            }
            for sp in &update.spilled {
                let mut to: Vec<String> = sp
                    .to_warm
                    .iter()
                    .map(|(id, k)| format!("{k} to {}", name(*id)))
                    .collect();
                if sp.by_weight > 0 {
                    to.push(format!(
                        "{} by weight (no alternate had room)",
                        sp.by_weight
                    ));
                }
                info!(
                    pool = %pool.name,
                    "bucket {}: {} connections spilled from {}: {}",
                    sp.bucket,
                    sp.count,
                    name(sp.home),
                    to.join(", ")
                );
            }
            for (bucket, candidates) in &update.write {
                if let Err(e) = self.dp.set_bucket(vip_id, *bucket, candidates) {
                    // Written again at the next fold, or the bucket would keep candidates
                    // that may have gone DOWN until they changed again.
                    if let Some(a) = self.affinity.get_mut(&pool.name) {
                        a.unwritten(*bucket);
                    }
                    warn!(
                        "writing bucket {bucket} of pool {} failed, retrying at the next fold: {e:#}",
                        pool.name
                    );
                }
            }
        }
    }

    pub fn health_targets(&self) -> Vec<HealthTarget> {
        let direct: HashMap<&str, crate::route::Path> = self
            .config
            .pool
            .iter()
            .filter_map(|p| {
                let path = match (p.forwarding, p.tunnel_source) {
                    (Forwarding::Dsr, _) => crate::route::Path::OnLink,
                    (Forwarding::Tunnel, Some(source)) => crate::route::Path::Tunnel { source },
                    _ => return None,
                };
                Some((p.name.as_str(), path))
            })
            .collect();
        self.servers
            .iter()
            .map(|(key, s)| {
                let Access { api_key, tls } = self.access(&key.0);
                HealthTarget {
                    key: key.clone(),
                    model: s.model.clone(),
                    api_key,
                    tls,
                    direct: direct.get(key.0.as_str()).copied(),
                }
            })
            .collect()
    }

    /// Takes one round of health-check results (with the model each server was asked for).
    pub fn checked(&mut self, results: Vec<(ServerKey, Option<String>, Result<()>)>) {
        let (fall, rise) = (self.config.agent.fall, self.config.agent.rise);
        let hung_after = Duration::from_millis(self.config.agent.hung_after_ms);
        let now = Instant::now();
        let stale_after = self.stale_after();
        let slots_of: HashMap<&str, Option<u32>> = self
            .config
            .pool
            .iter()
            .map(|p| (p.name.as_str(), p.slots))
            .collect();
        let named: HashSet<&str> = self
            .config
            .pool
            .iter()
            .filter(|p| p.model.is_some())
            .map(|p| p.name.as_str())
            .collect();
        let mut transitions = false;
        for (key, model, result) in results {
            let Some(&slots) = slots_of.get(key.0.as_str()) else {
                continue;
            };
            let Some(s) = self.servers.get_mut(&key) else {
                continue;
            };
            if s.model.is_none() {
                s.model = model;
            }
            let fresh = (!s.stale(now, stale_after))
                .then_some(s.reading.as_ref())
                .flatten();
            let queued = fresh.is_some_and(|r| queueing(r, slots, s.max_running));
            let hung = s.progress.and_then(|p| p.still_for(hung_after));
            let outcome = match &result {
                Ok(()) => Outcome::Ok,
                Err(e) if queued && hung.is_none() && Waited::explains(e) => Outcome::Busy,
                Err(_) => Outcome::Failed,
            };
            // A model the agent found on the server itself is asked for again after a failed
            // check: the server may have been redeployed under another name, and every check
            // for the old one would fail.
            if outcome == Outcome::Failed && !named.contains(key.0.as_str()) {
                s.model = None;
            }
            s.checked = true;
            s.answered |= outcome != Outcome::Failed;
            s.health = match (&result, outcome, hung) {
                (Ok(()), _, _) => "ok".into(),
                (Err(e), Outcome::Busy, _) => format!("busy (queue or every slot taken): {e:#}"),
                (Err(e), _, Some(still)) if queued && Waited::explains(e) => format!(
                    "failed: hung (a queue, and no progress for {:.0} s): {e:#}",
                    still.as_secs_f64()
                ),
                (Err(e), _, _) => format!("failed: {e:#}"),
            };
            let unproven = s.track.is_unproven();
            let transition = s.track.record(outcome, fall, rise);
            if outcome == Outcome::Ok && s.track.down {
                // `show` prints "is DOWN: <health>": say why a good check leaves it DOWN.
                s.health = format!("ok, {} of {rise} good checks to come back", s.track.oks());
            }
            match transition {
                Some(Transition::WentDown) => {
                    transitions = true;
                    // The program places anew a SYN that finds an entry naming a DOWN server
                    // (a retransmission it never answered, or a reused port), once `refresh`
                    // below has written the flag.
                    warn!(pool = %key.0, server = %key.1, "DOWN after {fall} failed checks: {}", s.health);
                }
                Some(Transition::CameUp) if unproven => {
                    transitions = true;
                    info!(pool = %key.0, server = %key.1, "UP: new, and its first check passed");
                }
                Some(Transition::CameUp) => {
                    transitions = true;
                    info!(pool = %key.0, server = %key.1, "UP after {rise} good checks");
                }
                None => {}
            }
        }
        if transitions {
            self.refresh(true);
        }
    }

    fn find(&self, pool: &str, server: &str) -> Result<ServerKey> {
        let Some(p) = self.config.pool.iter().find(|p| p.name == pool) else {
            bail!("no pool named {pool:?}");
        };
        let Some((ip, port)) = server_arg(server) else {
            bail!("{server:?} is not an address, nor ADDRESS:PORT");
        };
        let matches: Vec<ServerKey> = p
            .server
            .iter()
            .map(|s| SocketAddr::new(s.address, s.port))
            .filter(|a| a.ip() == ip && port.is_none_or(|p| p == a.port()))
            .map(|a| (pool.to_owned(), a))
            .collect();
        match matches.len() {
            1 => Ok(matches[0].clone()),
            0 => bail!("pool {pool} has no server {server}"),
            _ => bail!("{server} is ambiguous in pool {pool}: give the port too"),
        }
    }

    pub fn drain(&mut self, pool: &str, server: &str, on: bool) -> Result<String> {
        let key = self.find(pool, server)?;
        let s = self.servers.get_mut(&key).expect("found");
        if s.draining == on {
            return Ok(format!(
                "{} is already {}",
                key.1,
                if on { "draining" } else { "not draining" }
            ));
        }
        s.draining = on;
        info!(pool = %key.0, server = %key.1, "{}", if on { "draining" } else { "drain cancelled" });
        self.refresh(true);
        // Once the maps send it nothing new: a walk of the flow table begun earlier could miss
        // a connection placed on it meanwhile.
        let s = self.servers.get_mut(&key).expect("found");
        s.drain_started = on.then(Instant::now);
        let down = s.track.down;
        Ok(format!(
            "{} {}",
            key.1,
            match (on, down) {
                (true, _) if self.write_failed => {
                    "is draining, but writing the maps failed (the agent's log says why): they \
                     send it new connections until a retry at a later update succeeds"
                }
                (true, _) => "is draining: no new connections, established ones finish",
                (false, _) if self.write_failed => {
                    "is no longer draining, but writing the maps failed (the agent's log says \
                     why): it takes new connections once a retry at a later update succeeds"
                }
                (false, false) => "takes new connections again",
                (false, true) => {
                    "is no longer draining, and is DOWN: it takes new connections once its \
                     health checks pass (or while its pool fails open to DOWN servers)"
                }
            }
        ))
    }

    /// What `drain --wait` asks about a server, but for the count of its open connections,
    /// which takes a walk of the whole flow table: [`DrainQuestion::answer`] does that
    /// without the controller's lock.
    pub fn drain_status(&self, pool: &str, server: &str) -> Result<DrainQuestion> {
        let key = self.find(pool, server)?;
        let s = &self.servers[&key];
        // With direct server return the gateway never sees the server close a connection
        // (a kept-alive one it times out, say), so one whose client has been quiet that long
        // counts as closed; a request it waits on shows in the server's own counts. So too
        // on a DOWN server: one whose host died answers no FIN, and a client's FIN only
        // half-closes, so its connections would count until their idle timeout.
        let direct = self
            .config
            .pool
            .iter()
            .any(|p| p.name == key.0 && p.forwarding.direct());
        let quiet_ends = direct || s.track.down;
        let scraped_since = match (s.drain_started, s.reading_at) {
            (Some(start), Some(at)) => at >= start,
            _ => false,
        };
        // Scrapes failing since: what it ran then is no evidence of what it runs now (a
        // request a kept-alive connection sent later, say).
        let fresh = !s.stale(Instant::now(), self.stale_after());
        let reading = s.reading.as_ref().filter(|_| scraped_since && fresh);
        Ok(DrainQuestion {
            census: self.census.clone(),
            id: s.id,
            quiet: quiet_ends.then_some(DSR_QUIET),
            since: s.drain_started,
            status: DrainStatus {
                draining: s.draining,
                running: reading.map(|r| r.running),
                waiting: reading.map(|r| r.waiting),
                flows: 0,
                down: s.track.down,
                scrape_error: s.scrape_error.clone(),
                metrics_lost: s.scrape_error.is_some() || !fresh,
            },
        })
    }

    pub fn show(&self, pool: &str) -> Result<PoolView> {
        let Some(p) = self.config.pool.iter().find(|p| p.name == pool) else {
            bail!(
                "no pool named {pool:?} (pools: {})",
                self.config
                    .pool
                    .iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        };
        let now = Instant::now();
        let stale_after = self.stale_after();
        let servers = p
            .server
            .iter()
            .map(|cfg| {
                let addr = SocketAddr::new(cfg.address, cfg.port);
                let s = &self.servers[&(p.name.clone(), addr)];
                ServerRow {
                    stale: s.stale(now, stale_after),
                    server: addr.to_string(),
                    running: s.reading.as_ref().map(|r| r.running),
                    waiting: s.reading.as_ref().map(|r| r.waiting),
                    kv_mem: s.reading.as_ref().and_then(|r| r.kv_usage),
                    ttft_ms: s.ttft_ms,
                    state: state_name(s.state()).into(),
                    weight: s.decision.weight,
                    flows: s.now.flows_opened.saturating_sub(s.now.flows_closed),
                    new_per_s: s.new_per_s,
                    reason: s.decision.reason.clone(),
                    dialect: s
                        .reading
                        .as_ref()
                        .map(|r| format!("{:?}", r.dialect).to_lowercase()),
                    metrics_age_ms: s
                        .reading_at
                        .map(|t| now.duration_since(t).as_millis() as u64),
                    scrape_error: s.scrape_error.clone(),
                    health: s.health.clone(),
                    saturated: s.decision.saturated,
                    fail_open: s.decision.fail_open,
                    flows_opened: s.now.flows_opened,
                    flows_closed: s.now.flows_closed,
                }
            })
            .collect();
        let dropped = match self.vip_ids.get(&p.name) {
            Some(&vip_id) => self.dp.vip_drops(vip_id)?,
            None => 0,
        };
        Ok(PoolView {
            pool: p.name.clone(),
            vip: SocketAddr::new(p.vip, p.port).to_string(),
            forwarding: p.forwarding,
            servers,
            dropped,
        })
    }

    /// The pool's hint buckets in use.
    pub fn buckets(&self, pool: &str) -> Result<BucketsView> {
        let Some(aff) = self.affinity.get(pool) else {
            if self.config.pool.iter().any(|p| p.name == pool) {
                bail!("pool {pool} takes no hints (hint_ports = \"off\")");
            }
            bail!("no pool named {pool:?}");
        };
        let names: HashMap<u32, String> = (self.servers.iter())
            .filter(|((p, _), _)| p == pool)
            .map(|((_, addr), s)| (s.id, addr.to_string()))
            .collect();
        let name = |id: u32| names.get(&id).cloned().unwrap_or_else(|| "-".into());
        Ok(BucketsView {
            pool: pool.to_owned(),
            buckets: aff
                .active()
                .into_iter()
                .map(|a| BucketRow {
                    bucket: a.bucket,
                    hinted: a.hinted,
                    home: name(a.home),
                    rendezvous_home: name(a.rendezvous),
                    warm: a.warm.into_iter().map(name).collect(),
                })
                .collect(),
        })
    }

    pub fn counters(&self) -> Result<Vec<(String, u64)>> {
        Ok(self
            .dp
            .counters()?
            .into_iter()
            .map(|(c, v): (Counter, u64)| (c.name().to_owned(), v))
            .collect())
    }

    /// Counts of the sharing of flows with other gateways; empty without `[sync]`.
    pub fn sync_counters(&self) -> Vec<(String, u64)> {
        self.sync_stats
            .as_ref()
            .map(|s| s.counters())
            .unwrap_or_default()
    }

    /// Takes what a sweep of the flow table deleted: the closes of the handshakes that never
    /// completed, and of connections it took out while the program placed their flow again,
    /// are counted, as the program counts a connection's close.
    pub fn reclaimed(&mut self, swept: &crate::sweep::Swept) {
        for (&id, &n) in swept.unanswered.iter().chain(&swept.replaced) {
            self.dp.count_closes(id, n);
        }
        self.reclaimed[0] += swept.ended;
        self.reclaimed[1] += swept.unanswered_total();
        self.flow_entries = Some(swept.entries);
    }

    /// The sweeps' counts, by name.
    pub fn reclaimed_counters(&self) -> Vec<(String, u64)> {
        vec![
            ("flows_reclaimed_ended".into(), self.reclaimed[0]),
            ("flows_reclaimed_unanswered".into(), self.reclaimed[1]),
        ]
    }

    /// How to reach the pools' servers from now on ([`crate::access::load`]).
    pub fn set_access(&mut self, access: HashMap<String, Access>) {
        self.access = access;
    }

    /// How to reach pool `name`'s servers.
    fn access(&self, name: &str) -> Access {
        self.access.get(name).cloned().unwrap_or_default()
    }

    pub fn share_stats(&mut self, stats: Arc<sync::Stats>) {
        self.sync_stats = Some(stats);
    }

    /// Writes what other gateways reported of their flows into the flow table, for the VIPs
    /// and servers this agent has. Returns how many it wrote and how many named a VIP or a
    /// server it does not have (or a client of the other family).
    pub fn adopt_flows(&mut self, events: &[sync::Event]) -> (u64, u64) {
        let (mut applied, mut unknown) = (0, 0);
        for e in events {
            let pool = self
                .config
                .pool
                .iter()
                .find(|p| SocketAddr::new(p.vip, p.port) == e.vip);
            let found = pool.and_then(|p| {
                let server = self.servers.get(&(p.name.clone(), e.backend))?;
                Some((p.idle_timeout_s, server.id))
            });
            let (client, family) = addr_words(e.client.ip());
            let (vip, vip_family) = addr_words(e.vip.ip());
            let (backend, _) = addr_words(e.backend.ip());
            let Some((idle, id)) = found.filter(|_| family == vip_family) else {
                unknown += 1;
                continue;
            };
            let key = FlowKey {
                src: client,
                dst: vip,
                sport: e.client.port().to_be(),
                dport: e.vip.port().to_be(),
                proto: IPPROTO_TCP,
                family,
                _pad: [0; 2],
            };
            let target = (id, backend, e.backend.port().to_be());
            match self.dp.adopt_flow(&key, target, idle, e.kind) {
                Ok(_) => applied += 1,
                Err(err) => warn!("{err:#}"),
            }
        }
        (applied, unknown)
    }

    /// Whether the gateway should take traffic: not until its start is complete, then until
    /// the agent stops, but while the operator has it withdrawn.
    pub fn readiness(&mut self) -> Readiness {
        let mut r = self.started();
        if self.withdrawn {
            r.ready = false;
            r.waiting.insert(0, WITHDRAWN.into());
        }
        r
    }

    /// Whether the start is complete (`ready.rs`); once it is, for the rest of the run.
    fn started(&mut self) -> Readiness {
        if let Some(ready) = &self.ready {
            return ready.clone();
        }
        let pools: Vec<PoolStart> = (self.config.pool.iter())
            .map(|p| {
                let servers = || {
                    p.server.iter().filter_map(|s| {
                        let api = SocketAddr::new(s.address, s.port);
                        self.servers.get(&(p.name.clone(), api))
                    })
                };
                PoolStart {
                    pool: p.name.clone(),
                    servers: p.server.len(),
                    unscraped: servers()
                        .filter(|s| s.reading_at.is_none() && s.scrape_error.is_none())
                        .count(),
                    unchecked: servers().filter(|s| !s.checked).count(),
                    failing: servers()
                        .filter(|s| s.checked && !s.answered && !s.track.down)
                        .count(),
                }
            })
            .collect();
        let now = Instant::now();
        let (peers, asked) = match &self.sync_stats {
            Some(s) => (s.peers.rows(now), s.asked.get().copied()),
            None => (Vec::new(), None),
        };
        let since_asked = asked.map(|at| now.saturating_duration_since(at));
        let r = ready::assess(&pools, &peers, since_asked);
        if r.ready {
            if self.withdrawn {
                info!(notes = ?r.notes, "ready to take traffic, but withdrawn by the operator");
            } else {
                info!(notes = ?r.notes, "ready to take traffic");
            }
            self.ready = Some(r.clone());
        }
        r
    }

    /// Everything the agent's metrics endpoint reports, now.
    pub fn snapshot(&mut self) -> crate::exporter::Snapshot {
        crate::exporter::Snapshot {
            ready: self.readiness().ready,
            hints: self.pool_hints(),
            counters: self.counters().unwrap_or_default(),
            reclaimed: self.reclaimed_counters(),
            sync: self.sync_counters(),
            peers: self
                .sync_stats
                .as_ref()
                .map(|s| s.peers.rows(Instant::now()))
                .unwrap_or_default(),
            flow_table: self
                .flow_entries
                .map(|n| (n, self.config.agent.flow_table_entries)),
            pools: self.show_all(),
        }
    }

    /// The hinted connections of every pool that takes hints, in the file's order.
    fn pool_hints(&self) -> Vec<crate::exporter::PoolHints> {
        let mut all = Vec::new();
        for pool in &self.config.pool {
            let (Some(aff), Some(&vip_id)) =
                (self.affinity.get(&pool.name), self.vip_ids.get(&pool.name))
            else {
                continue;
            };
            let mut h = crate::exporter::PoolHints {
                pool: pool.name.clone(),
                ..Default::default()
            };
            for b in 0..aff.range.buckets {
                let s = self.dp.bucket_stats(vip_id, b).unwrap_or_default();
                h.hinted += s.hinted;
                h.spilled += s.spilled;
                h.home += s.picks[0];
            }
            all.push(h);
        }
        all
    }

    /// Every pool as `show` tells it, in the file's order.
    fn show_all(&self) -> Vec<PoolView> {
        self.config
            .pool
            .iter()
            .filter_map(|p| self.show(&p.name).ok())
            .collect()
    }

    /// Answers one control-socket request, or says what to ask the flow table for it.
    pub fn handle(&mut self, request: crate::control::Request) -> Handled {
        use crate::control::Request::*;
        let result = match request {
            Show { pool } => self.show(&pool).map(Response::Pool),
            ShowAll => Ok(Response::Pools {
                pools: self.show_all(),
            }),
            Drain { pool, server } => self
                .drain(&pool, &server, true)
                .map(|message| Response::Done { message }),
            Undrain { pool, server } => self
                .drain(&pool, &server, false)
                .map(|message| Response::Done { message }),
            DrainStatus { pool, server } => match self.drain_status(&pool, &server) {
                Ok(question) => return Handled::Walk(question),
                Err(e) => Err(e),
            },
            Counters => self.counters().map(|mut counters| {
                counters.extend(self.reclaimed_counters());
                counters.extend(self.sync_counters());
                Response::Counters { counters }
            }),
            Buckets { pool } => self.buckets(&pool).map(Response::Buckets),
            Peers => match &self.sync_stats {
                Some(stats) => Ok(Response::Peers {
                    peers: stats.peers.rows(Instant::now()),
                }),
                None => Err(anyhow::anyhow!(
                    "this agent shares flows with no other gateway ([sync] is not configured)"
                )),
            },
            Interfaces => Ok(Response::Interfaces {
                interfaces: self.dp.interfaces(),
            }),
            Ready => Ok(Response::Ready(self.readiness())),
            Withdraw | Restore => {
                let withdraw = matches!(request, Withdraw);
                let message = match (self.withdrawn, withdraw) {
                    (true, true) => "already withdrawn: `balancer-agent restore` takes it back",
                    (false, false) => "not withdrawn",
                    (false, true) => {
                        warn!(
                            "withdrawn by the operator: not ready until `balancer-agent restore`"
                        );
                        "withdrawn: `ready` and GET /ready say no, so that the routers take this \
                         gateway out; forwarding, checks and flow sharing go on"
                    }
                    (true, false) => {
                        info!("restored by the operator");
                        "restored: `ready` and GET /ready say as they did before `withdraw`"
                    }
                };
                self.withdrawn = withdraw;
                Ok(Response::Done {
                    message: message.into(),
                })
            }
            // It reads the file the agent started with: `run` answers it.
            Reload => Err(anyhow::anyhow!(
                "a reload is the running agent's to answer, not its controller's"
            )),
            Hint { pool } => match self.config.pool.iter().find(|p| p.name == pool) {
                None => Err(anyhow::anyhow!("no pool named {pool:?}")),
                Some(p) => match p.hint_range() {
                    None => Err(anyhow::anyhow!(
                        "pool {pool} takes no hints (hint_ports = \"off\")"
                    )),
                    Some(r) => Ok(Response::Hint {
                        start: r.start,
                        span: r.span,
                        buckets: r.buckets,
                    }),
                },
            },
        };
        Handled::Now(result.unwrap_or_else(|e| Response::Error {
            message: format!("{e:#}"),
        }))
    }
}

/// What [`Controller::handle`] makes of a request.
pub enum Handled {
    Now(Response),
    /// A drain status that still needs the server's open connections counted.
    Walk(DrainQuestion),
}

/// A drain status but for its count of open connections (see [`Controller::drain_status`]).
pub struct DrainQuestion {
    census: Arc<FlowCensus>,
    id: u32,
    quiet: Option<Duration>,
    /// When the drain began: only a walk begun since counts.
    since: Option<Instant>,
    status: DrainStatus,
}

impl DrainQuestion {
    /// The status, with the connections to the server that the flow table holds open. Waits
    /// for a walk of the whole table (shared, see [`FlowCensus`]): call it on a blocking
    /// thread, without the controller's lock.
    pub fn answer(self) -> Response {
        match self.census.open_on(self.id, self.quiet, self.since) {
            Ok(flows) => Response::DrainStatus(DrainStatus {
                flows,
                ..self.status
            }),
            Err(e) => Response::Error {
                message: format!("counting open flows: {e:#}"),
            },
        }
    }
}

/// A dialect's progress counter (`Reading::progress`): since when scrapes have found it
/// standing still while the server had work, and the last scrape that found it so.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Progress {
    value: f64,
    moved_at: Instant,
    seen_at: Instant,
    /// The last reading showed nothing running or waiting.
    idle: bool,
}

impl Progress {
    /// `last`, after a scrape sent at `at` read `value` from a server `idle` or not. Any
    /// change is a move, a counter that went back (a restart) too; so is a first value, since
    /// nothing says how long it had stood; and so are an idle reading and the first with work
    /// after one, since an engine with nothing to do makes no progress and is not hung (and
    /// the work may have come just before this scrape, however long after the idle one). A
    /// dialect without the counter, or a server not publishing it, has none.
    fn observe(
        last: Option<Progress>,
        value: Option<f64>,
        idle: bool,
        at: Instant,
    ) -> Option<Progress> {
        let value = value?;
        Some(match last {
            Some(p) if p.value == value && !idle && !p.idle => Progress { seen_at: at, ..p },
            _ => Progress {
                value,
                moved_at: at,
                seen_at: at,
                idle,
            },
        })
    }

    /// How long scrapes found the counter standing still with work to do, once that is
    /// longer than `hung_after`: measured between scrapes, so that a long scrape interval
    /// alone never makes a hang.
    fn still_for(self, hung_after: Duration) -> Option<Duration> {
        Some(self.seen_at.saturating_duration_since(self.moved_at))
            .filter(|still| *still > hung_after)
    }
}

/// Whether a fresh reading shows a server whose health check would wait: a queue of any
/// length, or every slot taken (`slots` configured, else the most it was seen running). A
/// check that then times out, or is answered 429 or 503, counts as busy, not failed. Any
/// fresh reading is evidence, even when a scrape failed since: an overloaded server's
/// `/metrics` may time out too. A server that died with a queue keeps its last reading
/// until it goes stale (three scrape intervals), and must not stay UP on it longer.
fn queueing(r: &Reading, slots: Option<u32>, max_running: f64) -> bool {
    let full = match slots {
        Some(n) => r.running >= f64::from(n),
        None => max_running > 0.0 && r.running >= max_running,
    };
    r.waiting > 0.0 || full
}

fn thresholds(pool: &Pool) -> Thresholds {
    Thresholds {
        spill_waiting: f64::from(pool.spill_waiting),
        spill_ttft_ms: f64::from(pool.spill_ttft_ms),
        kv_high: pool.kv_high,
    }
}

/// The Maglev weights of `config`'s servers that the agent knows: the policy's decisions,
/// all on one scale (a server never scraped has its stale share of the median, not its
/// configured weight, which is on another scale), none for a drained or DOWN server. A
/// server new to the agent gets its configured weight from the plan.
fn table_weights(config: &Config, servers: &HashMap<ServerKey, Server>) -> Weights {
    let mut w = Weights::new();
    for pool in &config.pool {
        for s in &pool.server {
            let key = (pool.name.clone(), SocketAddr::new(s.address, s.port));
            if let Some(server) = servers.get(&key) {
                w.insert(key.clone(), server.decision.weight);
                // Last: a drained or DOWN server has no slot whatever its last decision, but
                // for a DOWN one the policy opened a pool of DOWN servers to: that one is
                // routed to as if UP (the program places anew a SYN naming a DOWN server).
                if server.draining {
                    w.drain(key.clone());
                }
                if server.track.down && (server.draining || server.decision.weight == 0) {
                    w.down(key);
                }
            }
        }
    }
    w
}

/// A server as the CLI names it: `ADDRESS:PORT` (`[ADDRESS]:PORT` for IPv6), or an address,
/// in brackets or not, for any port. Parsed, so that any spelling of an address names it
/// (`FD00:4:0::11` is `fd00:4::11`).
fn server_arg(server: &str) -> Option<(IpAddr, Option<u16>)> {
    if let Ok(a) = server.parse::<SocketAddr>() {
        return Some((a.ip(), Some(a.port())));
    }
    let bare = server
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .unwrap_or(server);
    bare.parse().ok().map(|ip| (ip, None))
}

pub fn state_name(s: State) -> &'static str {
    match s {
        State::Up => "UP",
        State::Down => "DOWN",
        State::Draining => "DRAINING",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{dialect::TtftTotals, route::NotDirect};

    /// Any queue, or every slot taken, is a reason for a check to wait; the spill threshold
    /// is not.
    #[test]
    fn a_check_waits_behind_any_queue_or_a_full_batch() {
        let reading = |running: f64, waiting: f64| Reading {
            dialect: crate::dialect::Dialect::Plain,
            running,
            waiting,
            kv_usage: None,
            ttft: None,
            progress: None,
            ignored: None,
        };
        assert!(queueing(&reading(3.0, 1.0), Some(8), 0.0));
        assert!(queueing(&reading(0.0, 0.5), None, 0.0));
        assert!(queueing(&reading(8.0, 0.0), Some(8), 0.0));
        assert!(queueing(&reading(6.0, 0.0), None, 6.0));
        assert!(!queueing(&reading(7.0, 0.0), Some(8), 0.0));
        assert!(!queueing(&reading(5.0, 0.0), None, 6.0));
        // Nothing learned yet: no slot count to be full against.
        assert!(!queueing(&reading(5.0, 0.0), None, 0.0));
    }

    /// A counter that scrapes find standing still, with work to do, for longer than
    /// `hung_after` is a hung engine; any move, back or forth, or an idle reading restarts
    /// the clock, and a server without the counter is never hung.
    #[test]
    fn progress_standing_still_is_a_hang() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let hung_after = s(30);
        let busy = |last, value, at| Progress::observe(last, value, false, at);
        let first = busy(None, Some(100.0), t0).unwrap();
        assert_eq!(first.moved_at, t0, "a first value counts as a move");
        let at_30 = busy(Some(first), Some(100.0), t0 + s(30)).unwrap();
        assert_eq!(at_30.moved_at, t0);
        assert_eq!(at_30.still_for(hung_after), None);
        let at_31 = busy(Some(at_30), Some(100.0), t0 + s(31)).unwrap();
        assert_eq!(at_31.still_for(hung_after), Some(s(31)));
        for moved in [101.0, 3.0] {
            let p = busy(Some(at_31), Some(moved), t0 + s(40)).unwrap();
            assert_eq!(p.still_for(hung_after), None, "{moved}");
            let p = busy(Some(p), Some(moved), t0 + s(71)).unwrap();
            assert_eq!(p.still_for(hung_after), Some(s(31)), "{moved}");
        }
        assert_eq!(busy(Some(at_31), None, t0 + s(40)), None);
        // Idle for an hour, then work, seen first 40 s later (the scrapes between failed):
        // the clock starts at the first reading with work, not at the last idle one.
        let idle = Progress::observe(Some(first), Some(100.0), true, t0 + s(3600)).unwrap();
        let working = busy(Some(idle), Some(100.0), t0 + s(3640)).unwrap();
        assert_eq!(working.still_for(hung_after), None);
        let working = busy(Some(working), Some(100.0), t0 + s(3670)).unwrap();
        assert_eq!(working.still_for(hung_after), None);
        let working = busy(Some(working), Some(100.0), t0 + s(3671)).unwrap();
        assert_eq!(working.still_for(hung_after), Some(s(31)));
        // Only scrapes count: however late the check, a counter last read a moment after it
        // moved has not been seen standing still.
        assert_eq!(first.still_for(hung_after), None);
    }

    /// Only a wait may be a queue: a refused connection, an HTTP error, a wrong answer or a
    /// route the gateway cannot use fail the check whatever the server's queue.
    #[test]
    fn only_a_wait_may_be_busy() {
        let routed = anyhow::Error::new(NotDirect::Routed {
            to: "10.4.0.12".parse().unwrap(),
            router: "10.4.0.13".into(),
            dev: String::new(),
        })
        .context("health check");
        assert!(!Waited::explains(&routed));
        let refused =
            anyhow::Error::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(!Waited::explains(&refused));
        let error = anyhow::anyhow!("POST http://10.4.0.12:8000/v1/completions: HTTP 500");
        assert!(!Waited::explains(&error));
        let slow = anyhow::Error::new(Waited::Timeout(2000));
        assert!(Waited::explains(&slow), "a slow answer may be a queue");
        let full = anyhow::Error::new(Waited::Overloaded(reqwest::StatusCode::SERVICE_UNAVAILABLE))
            .context("POST http://10.4.0.12:8000/v1/completions");
        assert!(Waited::explains(&full));
        assert_eq!(
            format!("{full:#}"),
            "POST http://10.4.0.12:8000/v1/completions: HTTP 503 Service Unavailable"
        );
    }

    #[test]
    fn servers_are_named_in_any_spelling() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(server_arg("10.4.0.11"), Some((ip("10.4.0.11"), None)));
        assert_eq!(
            server_arg("10.4.0.11:8001"),
            Some((ip("10.4.0.11"), Some(8001)))
        );
        for spelling in ["fd00:4::11", "FD00:4:0::11", "[fd00:4::11]"] {
            assert_eq!(
                server_arg(spelling),
                Some((ip("fd00:4::11"), None)),
                "{spelling}"
            );
        }
        assert_eq!(
            server_arg("[FD00:4::11]:8000"),
            Some((ip("fd00:4::11"), Some(8000)))
        );
        for bad in [
            "",
            "b1",
            "10.4.0",
            "10.4.0.11:port",
            "[10.4.0.11",
            "fd00:4::11:99999",
        ] {
            assert_eq!(server_arg(bad), None, "{bad}");
        }
    }

    /// The server of a pool of one, new at `t0`.
    fn one_server(t0: Instant) -> Server {
        let text = "[agent]\ninterfaces = [\"eth0\"]\n[[pool]]\nname = \"p\"\nvip = \"192.0.2.60\"\nport = 8000\n\
            [[pool.server]]\naddress = \"10.4.0.11\"\nport = 8000\nmetrics_port = 8001\n";
        let config = Config::parse(std::path::Path::new("t.toml"), text).unwrap();
        Server::new(1, &config.pool[0], &config.pool[0].server[0], t0)
    }

    /// A scrape's TTFT is the mean over the requests since the last good scrape, and only
    /// when that one is recent: after a gap of failed scrapes the next good one starts the
    /// series again rather than averaging the gap.
    #[test]
    fn ttft_is_not_averaged_over_a_gap_in_scrapes() {
        let t0 = Instant::now();
        let mut s = one_server(t0);
        let totals = |sum_s: f64, count: f64| {
            TtftSeries([("".to_string(), TtftTotals { sum_s, count })].into())
        };
        let life = Duration::from_secs(6);
        // A good scrape: remembered as the reading of its time, as `scraped` does.
        let scrape = |s: &mut Server, series: &TtftSeries, secs: u64| {
            let at = t0 + Duration::from_secs(secs);
            s.observe_ttft(Some(series), at, life);
            s.reading_at = Some(at);
        };
        scrape(&mut s, &totals(10.0, 100.0), 0);
        assert_eq!(s.ttft_ms, None, "one scrape has no difference");
        scrape(&mut s, &totals(12.0, 110.0), 2);
        assert_eq!(s.ttft_ms.map(f64::round), Some(200.0));
        // The scrapes between 2 s and 62 s failed; ten requests came in at 3 s each.
        scrape(&mut s, &totals(42.0, 120.0), 62);
        assert_eq!(s.ttft_at, Some(t0 + Duration::from_secs(2)), "not renewed");
        scrape(&mut s, &totals(42.5, 121.0), 64);
        assert_eq!(s.ttft_ms.map(f64::round), Some(500.0));
        assert_eq!(s.ttft_at, Some(t0 + Duration::from_secs(64)));
    }

    /// One engine's TTFT left out of a scrape (its sum was NaN) and back in the next: what it
    /// observed in between counts, not its whole life.
    #[test]
    fn a_label_set_left_out_once_is_compared_with_its_last_totals() {
        let t0 = Instant::now();
        let mut s = one_server(t0);
        let engines = |sets: &[(&str, f64, f64)]| {
            TtftSeries(
                sets.iter()
                    .map(|&(e, sum_s, count)| (e.to_string(), TtftTotals { sum_s, count }))
                    .collect(),
            )
        };
        let life = Duration::from_secs(6);
        for (secs, series) in [
            (0, engines(&[("0", 500.0, 10000.0), ("1", 10.0, 100.0)])),
            (2, engines(&[("1", 10.0, 100.0)])),
            (4, engines(&[("0", 500.0, 10000.0), ("1", 13.6, 104.0)])),
        ] {
            let at = t0 + Duration::from_secs(secs);
            s.observe_ttft(Some(&series), at, life);
            s.reading_at = Some(at);
        }
        assert_eq!(s.ttft_ms.map(f64::round), Some(900.0));
    }

    /// A server whose metrics never came in gets the share the policy gave it (half the
    /// median server's), not its configured weight beside the others' decided ones, which
    /// are on another scale: 100 against 10000 would give it 1% of the table.
    #[test]
    fn a_server_never_scraped_gets_its_decided_share() {
        let text = "[agent]\ninterfaces = [\"eth0\"]\n[[pool]]\nname = \"p\"\nvip = \"192.0.2.60\"\nport = 8000\n\
            [[pool.server]]\naddress = \"10.4.0.11\"\nport = 8000\nmetrics_port = 8001\n\
            [[pool.server]]\naddress = \"10.4.0.12\"\nport = 8000\nmetrics_port = 8001\n";
        let config = Config::parse(std::path::Path::new("t.toml"), text).unwrap();
        let now = Instant::now();
        let pool = &config.pool[0];
        let mut servers = HashMap::new();
        for (i, (s, weight)) in pool.server.iter().zip([10_000, 5_000]).enumerate() {
            let mut server = Server::new(i as u32 + 1, pool, s, now);
            server.decision.weight = weight;
            if i == 0 {
                server.reading = Some(Reading {
                    dialect: Dialect::Vllm,
                    running: 1.0,
                    waiting: 0.0,
                    kv_usage: None,
                    ttft: None,
                    progress: None,
                    ignored: None,
                });
            }
            servers.insert(
                ("p".to_string(), SocketAddr::new(s.address, s.port)),
                server,
            );
        }
        let weights = table_weights(&config, &servers);
        let plan = crate::plan::Ids::default()
            .plan(&config, &weights, now)
            .unwrap();
        let table = &plan.vips[0].table;
        let never = plan.vips[0].members[1].1;
        let share = table.iter().filter(|id| **id == never).count() as f64 / table.len() as f64;
        assert!((0.30..0.37).contains(&share), "share {share}");
    }
}
