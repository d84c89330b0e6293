//! From a configuration to the contents of the maps: stable ids for VIPs and backends, and
//! one Maglev table per VIP. Pure code; `dataplane` writes the result.

use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use balancer_common::{
    addr_words, hint::HintRange, words_addr, Backend, Replies, ReplyKey, VipKey, ALTERNATES_SIZE,
    BACKEND_F_DOWN, BACKEND_F_DRAINING, BACKEND_F_PRESENT, BACKEND_F_RETIRED, IPPROTO_TCP,
    MAGLEV_SIZE, MAX_BACKENDS, MAX_REPLY_VIPS, MAX_VIPS,
};

use crate::{
    config::{Config, Forwarding, Pool},
    maglev::{build_table, MaglevBackend},
};

/// What the maps should hold for one VIP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VipPlan {
    pub pool: String,
    pub vip_id: u32,
    pub key: VipKey,
    pub idle_timeout_s: u32,
    /// Backends with weight > 0.
    pub live_backends: u32,
    /// `MAGLEV_SIZE` backend ids.
    pub table: Vec<u32>,
    /// `ALTERNATES_SIZE` backend ids: every eligible server, by configured weight.
    pub alternates: Vec<u32>,
    /// Each configured server's id, in configuration order.
    pub members: Vec<(SocketAddr, u32)>,
    pub hint: Option<HintRange>,
    /// Its flows are shared with other gateways (`[sync]`).
    pub shared: bool,
    /// How packets reach the backends; with DSR and tunnels no reply comes back.
    pub forwarding: Forwarding,
    /// A tunnel's outer source (`Pool::tunnel_source`), as the program spells addresses.
    pub tunnel_src: [u32; 4],
}

/// What the maps should hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub vips: Vec<VipPlan>,
    /// Every configured backend, by id.
    pub backends: Vec<(u32, Backend)>,
    /// Ids of servers that left the configuration: no new flow may pick them.
    pub retired: Vec<u32>,
    /// Retired ids whose flows have all timed out: free again.
    pub released: Vec<u32>,
    /// Every backend address whose replies are ours, with the VIPs it serves: those of its
    /// pools, then those of pools it left while their flows may still be open.
    pub replies: Vec<(ReplyKey, Replies)>,
}

/// What the control loop decided, by pool name and server: weights that override the
/// configured ones, and the servers that may take no connection at all (DOWN, draining),
/// not even as an alternate. A server named by neither gets its configured weight.
#[derive(Debug, Clone, Default)]
pub struct Weights {
    decided: HashMap<(String, SocketAddr), u32>,
    ineligible: HashSet<(String, SocketAddr)>,
    /// `BACKEND_F_*` state flags, for a later agent.
    flags: HashMap<(String, SocketAddr), u8>,
}

impl Weights {
    pub fn new() -> Self {
        Self::default()
    }

    /// The weight of `server` of `pool` in the Maglev table.
    pub fn insert(&mut self, server: (String, SocketAddr), weight: u32) {
        self.decided.insert(server, weight);
    }

    /// `server` of `pool` is in neither table.
    pub fn exclude(&mut self, server: (String, SocketAddr)) {
        self.ineligible.insert(server);
    }

    /// `server` of `pool` is drained: in neither table, and marked so in `BACKENDS`.
    pub fn drain(&mut self, server: (String, SocketAddr)) {
        self.out(server, BACKEND_F_DRAINING);
    }

    /// `server` of `pool` is DOWN: in neither table, and marked so in `BACKENDS`.
    pub fn down(&mut self, server: (String, SocketAddr)) {
        self.out(server, BACKEND_F_DOWN);
    }

    fn out(&mut self, server: (String, SocketAddr), flag: u8) {
        self.insert(server.clone(), 0);
        self.exclude(server.clone());
        *self.flags.entry(server).or_insert(0) |= flag;
    }
}

/// What [`Ids::recover`] reads back from pinned maps.
pub struct Recovered {
    pub ids: Ids,
    /// Servers the earlier agent was draining.
    pub draining: Vec<(String, SocketAddr)>,
    /// Servers the earlier agent had found DOWN.
    pub down: Vec<(String, SocketAddr)>,
}

/// A server's identity: the same server in two pools gets two ids, so that its per-pool
/// counters stay apart.
type ServerKey = (String, IpAddr, u16);

/// A retired id, when it may be reused, and whose replies may still arrive for which VIP.
type Quarantined = (u32, Instant, Option<(ReplyKey, VipKey)>);

/// Hands out ids that stay the same across reloads, and reuses an id only after every flow
/// that could still name it has timed out, so that per-backend counters never mix two
/// servers.
#[derive(Clone)]
pub struct Ids {
    backends: HashMap<ServerKey, u32>,
    vips: HashMap<String, u32>,
    /// Ids no longer configured, when they may be reused, and (while its pool's VIP stays)
    /// the server's address and that VIP: its open flows' replies are still ours.
    quarantine: Vec<Quarantined>,
    next_backend: u32,
    /// The longest idle timeout of any configuration planned so far: flows keep the timeout
    /// they were placed with, so a reload that shortens it does not shorten their life.
    longest_idle_s: u32,
}

impl Default for Ids {
    fn default() -> Self {
        Ids {
            backends: HashMap::new(),
            vips: HashMap::new(),
            quarantine: Vec::new(),
            // Id 0 is reserved: a zeroed Maglev slot means "no backend".
            next_backend: 1,
            longest_idle_s: 0,
        }
    }
}

impl Ids {
    /// The ids an earlier agent gave, read back from the maps it pinned (`VIPS` and
    /// `BACKENDS`): flows in the flow table name them, so they must not change hands. A
    /// pool is found by its VIP, a backend by its VIP, address and port; a backend whose
    /// pool is no longer configured keeps its id under a name no pool has, so that the first
    /// plan retires it like any removed server. Retired ids go back into quarantine, held
    /// from `now` as if retired then.
    pub fn recover(
        config: &Config,
        vips: &[(VipKey, u32)],
        backends: &[(u32, Backend)],
        now: Instant,
    ) -> Recovered {
        let mut ids = Ids::default();
        let mut draining = Vec::new();
        let mut down = Vec::new();
        // Configured pools by the id of their VIP.
        let mut pools = HashMap::new();
        for pool in &config.pool {
            let key = vip_key(pool);
            if let Some((_, vip_id)) = vips.iter().find(|(k, _)| *k == key) {
                ids.vips.insert(pool.name.clone(), *vip_id);
                pools.insert(*vip_id, (pool.name.clone(), key));
            }
        }
        for (id, b) in backends {
            let Some(address) = words_addr(b.addr, b.family) else {
                continue;
            };
            if *id == 0 || *id >= MAX_BACKENDS {
                continue;
            }
            let port = u16::from_be(b.port);
            if b.flags & BACKEND_F_RETIRED != 0 {
                let from = (pools.get(&b.vip_id)).map(|(_, key)| (reply_key(address, port), *key));
                ids.quarantine.push((*id, now + hold(config, 0), from));
            } else if b.flags & BACKEND_F_PRESENT != 0 {
                let pool = pools
                    .get(&b.vip_id)
                    .map(|(name, _)| name.clone())
                    .unwrap_or_else(|| format!("\0gone VIP {}", b.vip_id));
                let server = (pool.clone(), SocketAddr::new(address, port));
                if b.flags & BACKEND_F_DRAINING != 0 {
                    draining.push(server.clone());
                }
                if b.flags & BACKEND_F_DOWN != 0 {
                    down.push(server);
                }
                ids.backends.insert((pool, address, port), *id);
            } else {
                continue;
            }
            ids.next_backend = ids.next_backend.max(id + 1);
        }
        Recovered {
            ids,
            draining,
            down,
        }
    }

    /// Assigns ids for `config` and computes the maps' contents. Fails, changing nothing,
    /// when the ids run out.
    pub fn plan(&mut self, config: &Config, weights: &Weights, now: Instant) -> Result<Plan> {
        let (quarantine, released): (Vec<Quarantined>, Vec<Quarantined>) = self
            .quarantine
            .iter()
            .partition(|(_, until, _)| *until > now);
        let mut next = Ids {
            backends: HashMap::new(),
            vips: HashMap::new(),
            quarantine,
            next_backend: self.next_backend,
            longest_idle_s: longest_idle_s(config).max(self.longest_idle_s),
        };
        let mut used_vips: Vec<u32> = config
            .pool
            .iter()
            .filter_map(|p| self.vips.get(&p.name).copied())
            .collect();
        let mut plan = Plan {
            vips: Vec::new(),
            backends: Vec::new(),
            retired: Vec::new(),
            released: released.iter().map(|(id, _, _)| *id).collect(),
            replies: Vec::new(),
        };
        for pool in &config.pool {
            let vip_id = match self.vips.get(&pool.name) {
                Some(&id) => id,
                None => {
                    let Some(id) = (0..MAX_VIPS).find(|id| !used_vips.contains(id)) else {
                        bail!("no free VIP slot for pool {}", pool.name);
                    };
                    used_vips.push(id);
                    id
                }
            };
            next.vips.insert(pool.name.clone(), vip_id);
            let mut members = Vec::new();
            let mut keys = Vec::new();
            // Configured weights of the servers that may take connections at all.
            let mut alternates = Vec::new();
            for s in &pool.server {
                let key = (pool.name.clone(), s.address, s.port);
                let id = match self.backends.get(&key) {
                    Some(&id) => id,
                    None => next.fresh_backend_id(&self.backends)?,
                };
                next.backends.insert(key, id);
                let (addr, family) = addr_words(s.address);
                let server = (pool.name.clone(), SocketAddr::new(s.address, s.port));
                let state = weights.flags.get(&server).copied().unwrap_or(0);
                plan.backends.push((
                    id,
                    Backend {
                        addr,
                        port: s.port.to_be(),
                        family,
                        flags: BACKEND_F_PRESENT | state,
                        vip_id,
                    },
                ));
                let addr = server.1;
                keys.push((id, addr.to_string()));
                let weight = weights.decided.get(&server).copied().unwrap_or(s.weight);
                let eligible = if weights.ineligible.contains(&server) {
                    0
                } else {
                    s.weight
                };
                members.push((id, weight, addr));
                alternates.push(eligible);
            }
            let table = |weights: &mut dyn Iterator<Item = u32>, size| {
                let backends: Vec<MaglevBackend<'_>> = keys
                    .iter()
                    .zip(weights)
                    .map(|((id, key), weight)| MaglevBackend {
                        id: *id,
                        key,
                        weight,
                    })
                    .collect();
                build_table(&backends, size)
            };
            plan.vips.push(VipPlan {
                pool: pool.name.clone(),
                vip_id,
                key: vip_key(pool),
                idle_timeout_s: pool.idle_timeout_s,
                live_backends: members.iter().filter(|(_, w, _)| *w > 0).count() as u32,
                table: table(&mut members.iter().map(|(_, w, _)| *w), MAGLEV_SIZE),
                alternates: table(&mut alternates.into_iter(), ALTERNATES_SIZE),
                members: members.iter().map(|(id, _, addr)| (*addr, *id)).collect(),
                hint: pool.hint_range(),
                shared: config.sync.is_some(),
                forwarding: pool.forwarding,
                tunnel_src: pool.tunnel_source.map_or([0; 4], |a| addr_words(a).0),
            });
        }
        for (key, id) in &self.backends {
            if !next.backends.contains_key(key) {
                plan.retired.push(*id);
                let (pool, address, port) = key;
                let vip = plan.vips.iter().find(|v| v.pool == *pool).map(|v| v.key);
                let from = vip.map(|vip| (reply_key(*address, *port), vip));
                next.quarantine
                    .push((*id, now + hold(config, self.longest_idle_s), from));
            }
        }
        plan.retired.sort_unstable();
        plan.replies = replies(&plan.vips, &next.quarantine);
        *self = next;
        Ok(plan)
    }

    /// `old` holds the ids of the previous configuration: those not kept are retired, so
    /// none of them is free yet.
    fn fresh_backend_id(&mut self, old: &HashMap<ServerKey, u32>) -> Result<u32> {
        if self.next_backend < MAX_BACKENDS {
            self.next_backend += 1;
            return Ok(self.next_backend - 1);
        }
        // Reuse the lowest id that is neither configured nor in quarantine.
        let taken: Vec<u32> = self
            .backends
            .values()
            .chain(old.values())
            .copied()
            .chain(self.quarantine.iter().map(|(id, _, _)| *id))
            .collect();
        match (1..MAX_BACKENDS).find(|id| !taken.contains(id)) {
            Some(id) => Ok(id),
            None => bail!(
                "all {} backend ids are in use or in quarantine",
                MAX_BACKENDS - 1
            ),
        }
    }
}

/// The VIP of `pool` as the program looks it up.
fn vip_key(pool: &Pool) -> VipKey {
    let (addr, family) = addr_words(pool.vip);
    VipKey {
        addr,
        port: pool.port.to_be(),
        proto: IPPROTO_TCP,
        family,
    }
}

/// How long a retired id stays in quarantine: flows may name it until the longest idle
/// timeout they may have (`config`'s, or `earlier_s` of a configuration before it) has
/// passed since their last packet, which for an idle flow is before now.
fn hold(config: &Config, earlier_s: u32) -> Duration {
    let longest = longest_idle_s(config).max(earlier_s);
    Duration::from_secs(u64::from(longest) + 60)
}

fn longest_idle_s(config: &Config) -> u32 {
    config
        .pool
        .iter()
        .map(|p| p.idle_timeout_s)
        .max()
        .unwrap_or(0)
}

fn reply_key(address: IpAddr, port: u16) -> ReplyKey {
    let (addr, family) = addr_words(address);
    ReplyKey {
        addr,
        port: port.to_be(),
        family,
        _pad: 0,
    }
}

/// The `REPLIES` map: each backend address with the VIPs of its pools, then the VIPs of
/// pools it left recently (still configured VIPs only). A server may be in at most
/// `MAX_REPLY_VIPS` pools (the configuration checks it); past that, recently left pools are
/// the ones dropped, their last flows' replies then pass to the stack untranslated. DSR
/// and tunnel pools have no replies here: their servers answer from the VIP, to the client
/// directly.
fn replies(vips: &[VipPlan], quarantine: &[Quarantined]) -> Vec<(ReplyKey, Replies)> {
    let mut by_addr: Vec<(ReplyKey, Vec<VipKey>)> = Vec::new();
    let translated = || vips.iter().filter(|v| !v.forwarding.direct());
    let current = translated().flat_map(|v| {
        v.members
            .iter()
            .map(|(a, _)| (reply_key(a.ip(), a.port()), v.key))
    });
    let recent = quarantine
        .iter()
        .filter_map(|(_, _, from)| *from)
        .filter(|(_, vip)| translated().any(|v| v.key == *vip));
    for (from, vip) in current.chain(recent) {
        match by_addr.iter_mut().find(|(k, _)| *k == from) {
            Some((_, list)) if !list.contains(&vip) => list.push(vip),
            Some(_) => {}
            None => by_addr.push((from, vec![vip])),
        }
    }
    by_addr
        .into_iter()
        .map(|(from, list)| {
            let mut r = Replies::default();
            for (place, vip) in r.vips.iter_mut().zip(list.into_iter().take(MAX_REPLY_VIPS)) {
                *place = vip;
            }
            (from, r)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn config(servers: &[(&str, u32)]) -> Config {
        let mut text = String::from(
            "[agent]\ninterfaces=[\"eth0\"]\n[[pool]]\nname=\"p\"\nvip=\"192.0.2.60\"\nport=8000\n",
        );
        for (addr, weight) in servers {
            text += &format!(
                "[[pool.server]]\naddress=\"{addr}\"\nport=8000\nmetrics_port=8001\nweight={weight}\n"
            );
        }
        Config::parse(Path::new("t.toml"), &text).unwrap()
    }

    fn id_of(plan: &Plan, last_octet: u8) -> u32 {
        plan.backends
            .iter()
            .find(|(_, b)| b.addr[0].to_ne_bytes()[3] == last_octet)
            .unwrap()
            .0
    }

    #[test]
    fn ids_are_stable_across_reloads_and_never_zero() {
        let mut ids = Ids::default();
        let now = Instant::now();
        let a = ids
            .plan(
                &config(&[("10.4.0.11", 100), ("10.4.0.12", 100)]),
                &Weights::new(),
                now,
            )
            .unwrap();
        let b = ids
            .plan(
                &config(&[("10.4.0.12", 50), ("10.4.0.13", 100), ("10.4.0.11", 0)]),
                &Weights::new(),
                now,
            )
            .unwrap();
        assert_eq!(id_of(&a, 11), id_of(&b, 11));
        assert_eq!(id_of(&a, 12), id_of(&b, 12));
        assert!(b.backends.iter().all(|(id, _)| *id != 0));
        assert_eq!(b.vips[0].vip_id, a.vips[0].vip_id);
        assert_eq!(b.vips[0].live_backends, 2);
        assert!(
            !b.vips[0].table.contains(&id_of(&b, 11)),
            "weight 0 owns no slot"
        );
        assert!(!b.vips[0].table.contains(&0));
    }

    #[test]
    fn decided_weights_override_configured_ones() {
        let mut ids = Ids::default();
        let c = config(&[("10.4.0.11", 100), ("10.4.0.12", 100)]);
        let mut w = Weights::new();
        w.insert(("p".into(), "10.4.0.12:8000".parse().unwrap()), 0);
        let plan = ids.plan(&c, &w, Instant::now()).unwrap();
        assert_eq!(plan.vips[0].live_backends, 1);
        assert!(!plan.vips[0].table.contains(&id_of(&plan, 12)));
        assert_eq!(
            plan.vips[0].members[1],
            ("10.4.0.12:8000".parse().unwrap(), id_of(&plan, 12))
        );
    }

    #[test]
    fn alternates_hold_every_eligible_server_by_configured_weight() {
        let c = config(&[("10.4.0.11", 100), ("10.4.0.12", 300), ("10.4.0.13", 100)]);
        let key = |o: u8| ("p".to_string(), SocketAddr::from(([10, 4, 0, o], 8000)));
        let mut w = Weights::new();
        w.insert(key(11), 0); // saturated
        w.insert(key(13), 0);
        w.exclude(key(13)); // DOWN or draining
        let plan = Ids::default().plan(&c, &w, Instant::now()).unwrap();
        let vip = &plan.vips[0];
        let share = |t: &[u32], o: u8| {
            t.iter().filter(|&&id| id == id_of(&plan, o)).count() as f64 / t.len() as f64
        };
        assert_eq!(vip.alternates.len(), ALTERNATES_SIZE as usize);
        assert_eq!(share(&vip.table, 11), 0.0);
        assert!((share(&vip.alternates, 11) - 0.25).abs() < 0.02);
        assert!((share(&vip.alternates, 12) - 0.75).abs() < 0.02);
        assert_eq!(share(&vip.alternates, 13), 0.0);
        assert!(!vip.alternates.contains(&0));
    }

    /// Plans 10.4.0.11 and 10.4.0.12, then `next`, which has no 10.4.0.12: the id it had,
    /// retired, and the second plan.
    fn retire_12(ids: &mut Ids, now: Instant, next: &Config) -> (u32, Plan) {
        let two = config(&[("10.4.0.11", 100), ("10.4.0.12", 100)]);
        let gone = id_of(&ids.plan(&two, &Weights::new(), now).unwrap(), 12);
        let b = ids.plan(next, &Weights::new(), now).unwrap();
        assert_eq!(b.retired, vec![gone]);
        (gone, b)
    }

    #[test]
    fn removed_servers_are_retired_and_their_ids_quarantined() {
        let mut ids = Ids::default();
        let now = Instant::now();
        let (gone, b) = retire_12(&mut ids, now, &config(&[("10.4.0.11", 100)]));
        assert!(!b.vips[0].table.contains(&gone));
        // Coming back later gets a fresh id: flows of the old one may still be counted.
        let c = ids
            .plan(
                &config(&[("10.4.0.11", 100), ("10.4.0.12", 100)]),
                &Weights::new(),
                now,
            )
            .unwrap();
        assert_ne!(id_of(&c, 12), gone);
        assert!(c.retired.is_empty());
    }

    fn reply_vips(plan: &Plan, last_octet: u8) -> Vec<VipKey> {
        plan.replies
            .iter()
            .find(|(k, _)| k.addr[0].to_ne_bytes()[3] == last_octet)
            .map(|(_, r)| r.vips.iter().copied().filter(|v| v.family != 0).collect())
            .unwrap_or_default()
    }

    #[test]
    fn replies_name_the_vip_while_flows_may_be_open() {
        let mut ids = Ids::default();
        let now = Instant::now();
        let two = config(&[("10.4.0.11", 100), ("10.4.0.12", 0)]);
        let a = ids.plan(&two, &Weights::new(), now).unwrap();
        let vip = a.vips[0].key;
        assert_eq!(reply_vips(&a, 11), vec![vip]);
        assert_eq!(reply_vips(&a, 12), vec![vip], "weight 0 still has flows");
        let one = config(&[("10.4.0.11", 100)]);
        let b = ids.plan(&one, &Weights::new(), now).unwrap();
        assert_eq!(reply_vips(&b, 12), vec![vip], "removed, flows still open");
        let hold = Duration::from_secs(600 + 61);
        let c = ids.plan(&one, &Weights::new(), now + hold).unwrap();
        assert!(reply_vips(&c, 12).is_empty(), "every flow has timed out");
        assert_eq!(reply_vips(&c, 11), vec![vip]);
    }

    #[test]
    fn a_server_in_two_pools_replies_for_both_vips() {
        let text = "[agent]\ninterfaces=[\"eth0\"]\n\
            [[pool]]\nname=\"a\"\nvip=\"192.0.2.60\"\nport=8000\n\
            [[pool.server]]\naddress=\"10.4.0.11\"\nport=8000\nmetrics_port=8001\n\
            [[pool]]\nname=\"b\"\nvip=\"192.0.2.61\"\nport=9000\n\
            [[pool.server]]\naddress=\"10.4.0.11\"\nport=8000\nmetrics_port=8001\n";
        let c = Config::parse(Path::new("t.toml"), text).unwrap();
        let plan = Ids::default()
            .plan(&c, &Weights::new(), Instant::now())
            .unwrap();
        assert_eq!(plan.replies.len(), 1);
        assert_eq!(
            reply_vips(&plan, 11),
            vec![plan.vips[0].key, plan.vips[1].key]
        );
    }

    #[test]
    fn dsr_pools_have_no_replies_to_translate() {
        let text = "[agent]\ninterfaces=[\"eth0\"]\n\
            [[pool]]\nname=\"nat\"\nvip=\"192.0.2.60\"\nport=8000\n\
            [[pool.server]]\naddress=\"10.4.0.11\"\nport=8000\nmetrics_port=8001\n\
            [[pool]]\nname=\"dsr\"\nvip=\"192.0.2.61\"\nport=8000\nforwarding=\"dsr\"\n\
            [[pool.server]]\naddress=\"10.4.0.11\"\nport=8000\nmetrics_port=8001\n\
            [[pool.server]]\naddress=\"10.4.0.12\"\nport=8000\nmetrics_port=8001\n\
            [[pool]]\nname=\"tunnel\"\nvip=\"192.0.2.62\"\nport=8000\nforwarding=\"tunnel\"\n\
            tunnel_source=\"10.4.0.1\"\n\
            [[pool.server]]\naddress=\"10.4.0.12\"\nport=8000\nmetrics_port=8001\n\
            [[pool.server]]\naddress=\"10.5.0.14\"\nport=8000\nmetrics_port=8001\n";
        let c = Config::parse(Path::new("t.toml"), text).unwrap();
        let mut ids = Ids::default();
        let now = Instant::now();
        let plan = ids.plan(&c, &Weights::new(), now).unwrap();
        assert_eq!(
            plan.vips
                .iter()
                .map(|v| (v.forwarding, v.tunnel_src))
                .collect::<Vec<_>>(),
            [
                (Forwarding::Nat, [0; 4]),
                (Forwarding::Dsr, [0; 4]),
                (
                    Forwarding::Tunnel,
                    [u32::from_ne_bytes([10, 4, 0, 1]), 0, 0, 0]
                ),
            ]
        );
        assert_eq!(reply_vips(&plan, 11), vec![plan.vips[0].key]);
        assert!(reply_vips(&plan, 12).is_empty());
        // Nor once a server leaves the DSR pool.
        let left = text.replace("address=\"10.4.0.12\"", "address=\"10.4.0.13\"");
        let c = Config::parse(Path::new("t.toml"), &left).unwrap();
        let plan = ids.plan(&c, &Weights::new(), now).unwrap();
        assert!(reply_vips(&plan, 12).is_empty());
    }

    #[test]
    fn a_new_agent_recovers_the_ids_from_the_maps() {
        let two_pools = "[agent]\ninterfaces=[\"eth0\"]\n\
            [[pool]]\nname=\"a\"\nvip=\"192.0.2.60\"\nport=8000\n\
            [[pool.server]]\naddress=\"10.4.0.11\"\nport=8000\nmetrics_port=8001\n\
            [[pool.server]]\naddress=\"10.4.0.12\"\nport=8000\nmetrics_port=8001\n\
            [[pool.server]]\naddress=\"10.4.0.13\"\nport=8080\nmetrics_port=8001\n\
            [[pool]]\nname=\"b\"\nvip=\"192.0.2.61\"\nport=9000\n\
            [[pool.server]]\naddress=\"10.4.0.11\"\nport=8000\nmetrics_port=8001\n";
        let first = Ids::default()
            .plan(
                &Config::parse(Path::new("t.toml"), two_pools).unwrap(),
                &Weights::new(),
                Instant::now(),
            )
            .unwrap();
        let vips: Vec<(VipKey, u32)> = first.vips.iter().map(|v| (v.key, v.vip_id)).collect();
        let ids_of = |plan: &Plan, pool: &str| -> Vec<(SocketAddr, u32)> {
            plan.vips
                .iter()
                .find(|v| v.pool == pool)
                .unwrap()
                .members
                .clone()
        };
        // While no agent ran, pool `b` went away and a renamed `a` lost 10.4.0.12 and
        // gained 10.4.0.14, in another order.
        let now = "[agent]\ninterfaces=[\"eth0\"]\n\
            [[pool]]\nname=\"a2\"\nvip=\"192.0.2.60\"\nport=8000\n\
            [[pool.server]]\naddress=\"10.4.0.14\"\nport=8000\nmetrics_port=8001\n\
            [[pool.server]]\naddress=\"10.4.0.13\"\nport=8080\nmetrics_port=8001\n\
            [[pool.server]]\naddress=\"10.4.0.11\"\nport=8000\nmetrics_port=8001\n";
        let now = Config::parse(Path::new("t.toml"), now).unwrap();
        let mut backends = first.backends.clone();
        let drained = ids_of(&first, "a")[0];
        backends
            .iter_mut()
            .find(|(id, _)| *id == drained.1)
            .unwrap()
            .1
            .flags |= BACKEND_F_DRAINING;
        let Recovered {
            mut ids, draining, ..
        } = Ids::recover(&now, &vips, &backends, Instant::now());
        assert_eq!(draining, vec![("a2".to_string(), drained.0)]);
        let mut weights = Weights::new();
        weights.drain(draining[0].clone());
        let second = ids.plan(&now, &weights, Instant::now()).unwrap();
        let flags = |plan: &Plan, id: u32| {
            plan.backends
                .iter()
                .find(|(i, _)| *i == id)
                .unwrap()
                .1
                .flags
        };
        assert_eq!(
            flags(&second, drained.1),
            BACKEND_F_PRESENT | BACKEND_F_DRAINING
        );
        assert!(!second.vips[0].table.contains(&drained.1));
        let (a, a2) = (ids_of(&first, "a"), ids_of(&second, "a2"));
        assert_eq!(second.vips[0].vip_id, first.vips[0].vip_id);
        assert_eq!(a2[1], a[2], "a server on another port keeps its id");
        assert_eq!(a2[2], a[0]);
        let taken: Vec<u32> = first.backends.iter().map(|(id, _)| *id).collect();
        assert!(!taken.contains(&a2[0].1), "a new server gets a fresh id");
        let mut retired = vec![a[1].1, ids_of(&first, "b")[0].1];
        retired.sort_unstable();
        assert_eq!(second.retired, retired);
        assert_eq!(
            reply_vips(&second, 12),
            vec![first.vips[0].key],
            "a server removed from a pool that stays still gets its flows' replies"
        );
    }

    #[test]
    fn a_new_agent_keeps_retired_ids_in_quarantine_and_down_servers_down() {
        let now = Instant::now();
        let mut old = Ids::default();
        let three = config(&[("10.4.0.11", 100), ("10.4.0.12", 100), ("10.4.0.13", 100)]);
        let a = old.plan(&three, &Weights::new(), now).unwrap();
        let gone = id_of(&a, 13);
        let mut w = Weights::new();
        let sick: (String, SocketAddr) = ("p".into(), "10.4.0.12:8000".parse().unwrap());
        w.down(sick.clone());
        let two = config(&[("10.4.0.11", 100), ("10.4.0.12", 100)]);
        let b = old.plan(&two, &w, now).unwrap();
        assert_eq!(b.retired, vec![gone]);
        // The maps as the dataplane leaves them: the retired entry keeps its address.
        let mut backends = b.backends.clone();
        let mut retired = a.backends.iter().find(|(id, _)| *id == gone).unwrap().1;
        retired.flags = BACKEND_F_RETIRED;
        backends.push((gone, retired));
        let vips = vec![(b.vips[0].key, b.vips[0].vip_id)];
        // The next agent has a new server, which must not get the quarantined id.
        let next = config(&[("10.4.0.11", 100), ("10.4.0.12", 100), ("10.4.0.14", 100)]);
        let Recovered { mut ids, down, .. } = Ids::recover(&next, &vips, &backends, now);
        assert_eq!(down, vec![sick]);
        let c = ids.plan(&next, &Weights::new(), now).unwrap();
        assert_ne!(id_of(&c, 14), gone);
        assert_eq!(
            reply_vips(&c, 13),
            vec![c.vips[0].key],
            "its flows' replies are still ours"
        );
        let hold = Duration::from_secs(600 + 61);
        let later = ids.plan(&next, &Weights::new(), now + hold).unwrap();
        assert_eq!(later.released, vec![gone]);
        assert!(reply_vips(&later, 13).is_empty());
    }

    /// A reload that shortens the idle timeout while it removes a server: the server's flows
    /// keep the timeout they were placed with, and so does the quarantine of its id.
    #[test]
    fn quarantine_outlasts_a_shortened_idle_timeout() {
        let mut ids = Ids::default();
        let now = Instant::now();
        let mut short = config(&[("10.4.0.11", 100)]);
        short.pool[0].idle_timeout_s = 10;
        let (gone, b) = retire_12(&mut ids, now, &short);
        let vip = b.vips[0].key;
        for (after_s, held) in [(71, true), (659, true), (661, false)] {
            let c = ids
                .clone()
                .plan(&short, &Weights::new(), now + Duration::from_secs(after_s))
                .unwrap();
            let released = if held { vec![] } else { vec![gone] };
            assert_eq!(c.released, released, "after {after_s} s");
            assert_eq!(reply_vips(&c, 12) == vec![vip], held, "after {after_s} s");
        }
    }

    #[test]
    fn exhausted_ids_reuse_only_after_quarantine() {
        let mut ids = Ids {
            next_backend: MAX_BACKENDS,
            ..Ids::default()
        };
        let now = Instant::now();
        // All ids but 5 are taken by quarantine.
        ids.quarantine = (1..MAX_BACKENDS)
            .filter(|id| *id != 5)
            .map(|id| (id, now + Duration::from_secs(60), None))
            .collect();
        let a = ids
            .plan(&config(&[("10.4.0.11", 100)]), &Weights::new(), now)
            .unwrap();
        assert_eq!(id_of(&a, 11), 5);
        assert!(ids
            .plan(
                &config(&[("10.4.0.11", 100), ("10.4.0.12", 1)]),
                &Weights::new(),
                now
            )
            .is_err());
        let later = now + Duration::from_secs(61);
        assert!(ids
            .plan(
                &config(&[("10.4.0.11", 100), ("10.4.0.12", 1)]),
                &Weights::new(),
                later
            )
            .is_ok());
    }
}
