//! `balancer-agent run`: load, fill the maps, attach, then keep them current: scrapes,
//! counter folds and health checks each on their own schedule, the control socket, and
//! signals (SIGHUP, or `reload` over the socket, reloads the configuration; SIGINT and
//! SIGTERM detach and exit, or with `agent.pin_dir` leave the program attached for the next
//! agent).

use std::{
    collections::HashMap,
    future::Future,
    os::unix::fs::{FileTypeExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use anyhow::{anyhow, bail, Context, Result};
use futures_util::future::join_all;
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::{TcpListener, UdpSocket, UnixListener, UnixStream},
    signal::unix::{signal, SignalKind},
    sync::{mpsc, oneshot},
    task::{self, spawn_blocking, JoinSet},
    time::{sleep, timeout, Instant},
};
use tracing::{debug, error, info, warn};

use crate::{
    access::{self, Tls},
    config::{Config, Pool, MIN_SYNC_IDLE_TIMEOUT_S},
    control::{Request, Response},
    controller::{Controller, Handled},
    dataplane::{interface_index, Dataplane},
    exporter,
    health::{Checker, Waited},
    pins::Pins,
    route::{NotDirect, Routes},
    scrape::{ScrapeError, Scraper, DEFAULT_MAX_METRICS_BYTES},
    sweep, sync,
};

type Shared = Arc<Mutex<Controller>>;
/// Where the control socket hands a `reload` to the main loop, with where its answer goes.
type Reloads = mpsc::Sender<oneshot::Sender<Response>>;

fn lock(c: &Shared) -> MutexGuard<'_, Controller> {
    // A panic while holding the lock leaves consistent state behind: every update is a
    // plain assignment of finished values.
    c.lock().unwrap_or_else(|p| p.into_inner())
}

pub async fn run(config_path: &Path) -> Result<()> {
    // Before anything else: a SIGHUP that arrives early must reload, not kill us.
    let mut hup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;

    let config = Config::load(config_path)?;
    // Before any map is written: with pins, the maps are the running program's, and a start
    // refused for a typo must leave them as they are.
    require_interfaces(&config)?;
    for warning in foreign_tunnel_sources(&config) {
        warn!("{warning}");
    }
    let access = access::load(&config)?;
    // Both listeners before the program is attached: a port that is taken must fail the
    // start, not leave a program attached behind.
    let metrics = match config.agent.metrics_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("agent.metrics_listen: binding {addr}"))?,
        ),
        None => None,
    };
    let sharing = match &config.sync {
        Some(s) => {
            let keys = sync::Keys::load(s)?;
            let socket = bind_sync_socket(s.listen)
                .with_context(|| format!("sync.listen: binding {}", s.listen))?;
            Some((Arc::new(socket), keys, s.peers.clone()))
        }
        None => None,
    };
    let socket_path = config.agent.control_socket.clone();
    let listener = bind_control_socket(&socket_path)?;
    let routes = Routes::new()?;
    let entries = config.agent.flow_table_entries;
    let pins = match &config.agent.pin_dir {
        Some(dir) => Some(Pins::open(dir, entries)?),
        None => None,
    };
    let mut dp = Dataplane::load(entries, pins)?;
    dp.set_xdp_mode(config.agent.xdp_mode);
    let interfaces = config.agent.interfaces.clone();
    let attach = |dp: &mut Dataplane| {
        let attached = (dp.attach(&interfaces)).and_then(|()| dp.detach_unlisted_pins(&interfaces));
        if attached.is_err() {
            dp.abandon();
        }
        attached
    };
    // Maps an earlier agent pinned are what its program forwards with: the interfaces first,
    // so that a start refused by one (held by another program, no native XDP) leaves them
    // as they were. New maps first: a program attached to empty maps would pass VIP traffic
    // to the stack.
    let took_over = dp.took_over_maps();
    if took_over {
        attach(&mut dp)?;
    }
    let mut controller = Controller::new(config.clone(), dp)?;
    if !took_over {
        attach(controller.dataplane())?;
    }
    controller.set_access(access);
    // Before any task runs: `ready` must see the peers from the first.
    let sharing = sharing.map(|(socket, keys, peers)| {
        let stats = Arc::new(sync::Stats::new(&peers));
        controller.share_stats(stats.clone());
        (socket, keys, peers, stats)
    });
    let ctl = Arc::new(Mutex::new(controller));
    info!(
        pools = config.pool.len(),
        interfaces = ?interfaces,
        socket = %socket_path.display(),
        "ready"
    );

    let flows_id = lock(&ctl).dataplane().flows_id();
    let mut tasks = Tasks::default();
    tasks.spawn("sweeps", sweep_loop(ctl.clone(), flows_id));
    tasks.spawn("scrapes", scrape_loop(ctl.clone()));
    tasks.spawn("folds", fold_loop(ctl.clone()));
    tasks.spawn("relinks", relink_loop(ctl.clone()));
    tasks.spawn("health checks", health_loop(ctl.clone(), routes));
    if let Some(listener) = metrics {
        tasks.spawn("metrics endpoint", export(listener, ctl.clone()));
    }
    let mut sharing_with = None;
    if let Some((socket, keys, peers, stats)) = sharing {
        let (ring, flows_id) = {
            let mut c = lock(&ctl);
            let dp = c.dataplane();
            (dp.take_flow_events(), dp.flows_id())
        };
        let sender = Arc::new(sync::Sender::new(socket, peers.clone(), keys, stats));
        sharing_with = Some(sender.clone());
        if let Some(ring) = ring {
            tasks.spawn("sync sends", sync::send_loop(ring, sender.clone()));
        }
        let c = ctl.clone();
        let apply = move |events: &[sync::Event]| lock(&c).adopt_flows(events);
        let receive = sync::receive_loop(sender.clone(), flows_id, apply);
        tasks.spawn("sync receives", receive);
        tasks.spawn("sync heartbeats", sync::heartbeat_loop(sender));
        info!(peers = ?peers, "sharing flows with the other gateways");
    } else if let Some(ring) = lock(&ctl).dataplane().take_flow_events() {
        tasks.spawn("flow report discards", sync::discard_loop(ring));
    }
    let reloader = Reloader {
        path: config_path.to_owned(),
        ctl: ctl.clone(),
        sender: sharing_with,
    };
    // `reload` over the control socket is done here, as SIGHUP is: never two at once, and a
    // panic in one stops the agent as a task's does.
    let (reloads, mut asked) = mpsc::channel::<oneshot::Sender<Response>>(4);
    tasks.spawn("control socket", serve(listener, ctl.clone(), reloads));
    let failed = loop {
        tokio::select! {
            _ = hup.recv() => match reloader.reload_caught() {
                // Logged either way; nobody waits for the answer.
                Ok(_) => {}
                Err(panic) => break Some(panic),
            },
            Some(answer) = asked.recv() => {
                let (response, panic) = match reloader.reload_caught() {
                    Ok(Ok(done)) => (
                        Response::Reloaded {
                            pools: done.pools,
                            warnings: done.warnings,
                        },
                        None,
                    ),
                    Ok(Err(e)) => (error(format!("{RELOAD_FAILED}: {e:#}")), None),
                    Err(panic) => (
                        error(format!("{panic}: the agent stops; what it had applied stays")),
                        Some(panic),
                    ),
                };
                let _ = answer.send(response);
                if panic.is_some() {
                    break panic;
                }
            }
            _ = int.recv() => break None,
            _ = term.recv() => break None,
            ended = tasks.first_to_end() => break Some(ended),
        }
    };
    tasks.set.abort_all();
    // Reloads asked meanwhile are not done; their clients are told so before the runtime
    // goes, with a turn for the answers to be written.
    asked.close();
    while let Ok(answer) = asked.try_recv() {
        let _ = answer.send(error("the agent is stopping: nothing was reloaded".into()));
    }
    tokio::task::yield_now().await;
    std::fs::remove_file(&socket_path).ok();
    let stopped = lock(&ctl).dataplane().stop();
    if let Some(failure) = failed {
        // Ended, not carried on without it: frozen states or weights would go unnoticed,
        // and a supervisor restarts an agent that exits (with `pin_dir`, breaking nothing).
        // The failure is the news; one stopping the data path is said with it.
        match stopped {
            Ok(()) => bail!("{failure}; the agent stopped"),
            Err(e) => bail!("{failure}; the agent stopped, and stopping failed: {e:#}"),
        }
    }
    stopped?;
    info!("stopped");
    Ok(())
}

/// The agent's loops, by name. Each runs as long as the agent does.
#[derive(Default)]
struct Tasks {
    set: JoinSet<()>,
    names: HashMap<task::Id, &'static str>,
}

impl Tasks {
    fn spawn(&mut self, name: &'static str, task: impl Future<Output = ()> + Send + 'static) {
        let id = self.set.spawn(task).id();
        self.names.insert(id, name);
    }

    /// What went wrong with the first task to end: any that ends, returning or panicking
    /// (its message went to the log as it did), has stopped doing its part. With none,
    /// never.
    async fn first_to_end(&mut self) -> String {
        let (id, how) = match self.set.join_next_with_id().await {
            Some(Ok((id, ()))) => (id, "ended".to_owned()),
            Some(Err(e)) => (e.id(), format!("failed ({e})")),
            None => std::future::pending().await,
        };
        let name = self.names.get(&id).copied().unwrap_or("one");
        format!("the agent's {name} task {how}")
    }
}

/// What to say of each pool whose `tunnel_source` is not an address of this host (nothing
/// can bind it): its servers' ICMP errors about the tunnel would go elsewhere. Said, not
/// refused: the address may come later (a failover daemon's, say).
pub fn foreign_tunnel_sources(config: &Config) -> Vec<String> {
    config
        .pool
        .iter()
        .filter_map(|p| {
            let source = p.tunnel_source?;
            let error = std::net::UdpSocket::bind((source, 0)).err()?;
            Some(format!(
                "pool {}: tunnel_source {source} is not an address of this host ({error}): \
                 the servers' answers about the tunnel would not come here",
                p.name
            ))
        })
        .collect()
}

/// Every interface the configuration names exists: checked before anything is applied, so
/// that a typo changes nothing.
pub fn require_interfaces(config: &Config) -> Result<()> {
    for name in &config.agent.interfaces {
        interface_index(name)?;
    }
    Ok(())
}

/// What a reload reads and changes: the file the agent started with, the controller, and
/// with `[sync]` the sender whose keys it replaces. SIGHUP and `reload` both go through it,
/// in the agent's main loop.
struct Reloader {
    path: PathBuf,
    ctl: Shared,
    sender: Option<Arc<sync::Sender>>,
}

/// A reload that went through: the pools in place, and what it could not change.
struct Reloaded {
    pools: usize,
    warnings: Vec<String>,
}

impl Reloader {
    /// [`Reloader::reload`], or what panicked in it.
    fn reload_caught(&self) -> Result<Result<Reloaded>, String> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.reload()))
            .map_err(|_| "a reload panicked".to_owned())
    }

    /// Reloads, and logs how it went.
    fn reload(&self) -> Result<Reloaded> {
        let outcome = reload(&self.path, &self.ctl, self.sender.as_deref());
        match &outcome {
            Ok(done) => {
                for w in &done.warnings {
                    warn!("{w}");
                }
                info!(pools = done.pools, "config reloaded");
            }
            Err(e) => error!("{RELOAD_FAILED}: {e:#}"),
        }
        outcome
    }
}

/// An error answer.
fn error(message: String) -> Response {
    Response::Error { message }
}

/// How a refused reload is said, in the log and to `reload`.
const RELOAD_FAILED: &str = "reload failed, keeping the running configuration";

/// Applies a new configuration to new flows; established flows keep their backends. With
/// `[sync]` (`sender`), the key files are read again.
fn reload(path: &Path, ctl: &Shared, sender: Option<&sync::Sender>) -> Result<Reloaded> {
    let mut new = Config::load(path)?;
    require_interfaces(&new)?;
    let access = access::load(&new)?;
    let mut c = lock(ctl);
    let file_shares = new.sync.is_some();
    let mut warnings = keep_restart_only(&mut new, c.config())?;
    // The keys change now (a rollout goes through reloads).
    let keys = match (&new.sync, sender) {
        (Some(next), Some(sender)) if file_shares => Some((sender, sync::Keys::load(next)?)),
        _ => None,
    };
    for pool in &new.pool {
        // By VIP (its open connections) and by name (its servers keep their ids, and the next
        // hops their flows cached, which are of the old mode's shape).
        let same = |p: &&Pool| (p.vip, p.port) == (pool.vip, pool.port) || p.name == pool.name;
        // Refused whole, not kept as it was: the file's servers may fit only the new mode.
        if c.config()
            .pool
            .iter()
            .filter(same)
            .any(|old| old.forwarding != pool.forwarding)
        {
            bail!(
                "pool {}: forwarding changes only when the agent restarts (it would cut the \
                 pool's open connections)",
                pool.name
            );
        }
    }
    warnings.extend(foreign_tunnel_sources(&new));
    let pools = new.pool.len();
    let interfaces = new.agent.interfaces.clone();
    let running = c.config().agent.interfaces.clone();
    // New interfaces first, the old ones kept: a failure leaves the program where it was,
    // and the running configuration whole.
    let applied = c
        .dataplane()
        .attach_more(&interfaces)
        .and_then(|()| c.reconfigure(new));
    if let Err(e) = applied {
        if let Err(undo) = c.dataplane().keep_only(&running) {
            warn!("leaving the interfaces the failed reload attached to: {undo:#}");
        }
        return Err(e);
    }
    // The new configuration is live: an interface that cannot be left is the one thing
    // that did not go through, not a failed reload.
    if let Err(e) = c.dataplane().keep_only(&interfaces) {
        warnings.push(format!(
            "leaving the interfaces the configuration no longer lists: {e:#}"
        ));
    }
    if let Some((sender, keys)) = keys {
        sender.set_keys(keys);
    }
    c.set_access(access);
    Ok(Reloaded { pools, warnings })
}

/// What a reload that changes `agent.KEY` is told, while the agent pins (`pinned`) or not.
fn restart_only(key: &str, pinned: bool) -> String {
    match key {
        // The next agent would meet the pinned flow table, or the pinned links, and refuse.
        "flow_table_entries" | "pin_dir" if pinned => format!(
            "agent.{key} changes only when the agent restarts, after `balancer-agent detach \
             --config` with the running file (which ends the open connections): the pinned \
             maps and links stay as they are"
        ),
        _ => format!("agent.{key} changes only when the agent restarts"),
    }
}

/// Puts back in `new` what only a restart changes, as `running` has it, and returns a
/// warning for each: the running configuration then says what is in effect, and the next
/// reload warns again. Refuses pools too short-lived for the `[sync]` that stays on, which
/// the file, without the section, was not checked against.
fn keep_restart_only(new: &mut Config, running: &Config) -> Result<Vec<String>> {
    let mut warnings = Vec::new();
    let (next, now) = (&mut new.agent, &running.agent);
    let pinned = now.pin_dir.is_some();
    macro_rules! keep {
        ($key:ident) => {
            if next.$key != now.$key {
                warnings.push(restart_only(stringify!($key), pinned));
                next.$key = now.$key.clone();
            }
        };
    }
    keep!(flow_table_entries);
    keep!(control_socket);
    keep!(metrics_listen);
    keep!(pin_dir);
    keep!(xdp_mode);
    match (&mut new.sync, &running.sync) {
        (Some(next), Some(now)) => {
            if !next.same_peering(now) {
                warnings
                    .push("sync.listen and sync.peers change only when the agent restarts".into());
                next.listen = now.listen;
                next.peers = now.peers.clone();
            }
        }
        (next, now) => {
            if *next != *now {
                warnings.push("[sync] starts or stops only when the agent restarts".into());
                next.clone_from(now);
            }
        }
    }
    if new.sync.is_some() {
        let min = MIN_SYNC_IDLE_TIMEOUT_S;
        if let Some(p) = new.pool.iter().find(|p| p.idle_timeout_s < min) {
            bail!(
                "pool {}: idle_timeout_s must be at least {min} s while [sync] runs (it stops \
                 only when the agent restarts)",
                p.name
            );
        }
    }
    Ok(warnings)
}

/// Scrapes every server concurrently, once per interval, and hands the results over. The
/// scrapers (one for plain HTTP, one per pool with `[pool.tls]`) live across rounds so that
/// their connections to the servers stay open.
async fn scrape_loop(ctl: Shared) {
    let mut scrapers: Vec<Scraper> = Vec::new();
    let mut failing = false;
    loop {
        let (targets, interval, limit) = {
            let mut c = lock(&ctl);
            let limit = Duration::from_millis(c.config().agent.scrape_timeout_ms());
            (c.scrape_targets(), c.scrape_interval(), limit)
        };
        let next = Instant::now() + interval;
        // Those of another timeout, or of settings a reload replaced, go with their
        // connections.
        scrapers
            .retain(|s| s.timeout() == limit && targets.iter().any(|t| t.tls.as_ref() == s.tls()));
        for t in &targets {
            if scrapers.iter().all(|s| s.tls() != t.tls.as_ref()) {
                match Scraper::new(limit, DEFAULT_MAX_METRICS_BYTES, t.tls.as_ref()) {
                    Ok(s) => scrapers.push(s),
                    // Its servers' scrapes fail, saying why: `show` has the reason.
                    Err(e) if !std::mem::replace(&mut failing, true) => {
                        warn!(pool = %t.key.0, "cannot build the scrapes' HTTP client: {e:#}")
                    }
                    Err(_) => {}
                }
            }
        }
        if targets
            .iter()
            .all(|t| scrapers.iter().any(|s| s.tls() == t.tls.as_ref()))
        {
            failing = false;
        }
        let results = join_all(targets.into_iter().map(|t| {
            let scraper = scrapers.iter().find(|s| s.tls() == t.tls.as_ref());
            async move {
                let r = match scraper {
                    Some(s) => s.scrape(t.metrics, t.dialect, t.api_key.as_ref()).await,
                    None => Err(ScrapeError::Http {
                        addr: t.metrics,
                        reason: "the agent could not build its HTTP client (see its log)".into(),
                    }),
                };
                (t, r)
            }
        }))
        .await;
        lock(&ctl).scraped(results);
        tokio::time::sleep_until(next).await;
    }
}

/// Folds the program's flow counters into the picture between scrapes; looks whether the
/// gateway is ready yet, so that the log says when it is, asked or not.
async fn fold_loop(ctl: Shared) {
    loop {
        let interval = lock(&ctl).fold_interval();
        sleep(interval).await;
        let mut c = lock(&ctl);
        c.fold();
        c.readiness();
    }
}

/// How often the agent looks for interfaces created again under a configured name.
const RELINK_INTERVAL: Duration = Duration::from_secs(1);

/// Puts the program back on interfaces deleted and created again (`Dataplane::relink`).
async fn relink_loop(ctl: Shared) {
    let mut failing = false;
    loop {
        sleep(RELINK_INTERVAL).await;
        match lock(&ctl).dataplane().relink() {
            Ok(()) => failing = false,
            // Once per failing streak: it is tried again every interval.
            Err(e) if !failing => {
                failing = true;
                warn!("attaching to an interface created again failed, retrying: {e:#}");
            }
            Err(_) => {}
        }
    }
}

/// One-token completions to every server, on their own schedule; for a DSR pool's server,
/// first the kernel's route to it (see `route`).
async fn health_loop(ctl: Shared, routes: Routes) {
    let mut failing = false;
    loop {
        let (targets, interval, timeout_ms, attached) = {
            let c = lock(&ctl);
            (
                c.health_targets(),
                c.health_interval(),
                c.config().agent.health_timeout_ms,
                c.config().agent.interfaces.clone(),
            )
        };
        let next = Instant::now() + interval;
        // One checker for plain HTTP, one per pool with `[pool.tls]`.
        let mut checkers: Vec<(Option<Tls>, Option<Checker>)> = Vec::new();
        for t in &targets {
            if checkers.iter().all(|(tls, _)| *tls != t.tls) {
                let checker = Checker::new(Duration::from_millis(timeout_ms), t.tls.as_ref())
                    .map_err(|e| {
                        if !std::mem::replace(&mut failing, true) {
                            warn!(pool = %t.key.0, "cannot build the health checks' HTTP client: {e:#}");
                        }
                    })
                    .ok();
                checkers.push((t.tls.clone(), checker));
            }
        }
        if checkers.iter().all(|(_, c)| c.is_some()) {
            failing = false;
        }
        let checks = targets.into_iter().map(|t| {
            let checker = checkers
                .iter()
                .find(|(tls, _)| *tls == t.tls)
                .and_then(|(_, c)| c.as_ref());
            let (routes, attached) = (&routes, &attached);
            async move {
                // Failed, not skipped: a server nobody checks must not stay UP.
                let Some(checker) = checker else {
                    let e = anyhow!("the agent could not build its HTTP client (see its log)");
                    return (t.key, None, Err(e));
                };
                let api = t.key.1;
                let limit = Duration::from_millis(timeout_ms);
                let result = async {
                    if let Some(path) = t.direct {
                        match routes.direct(api, attached, path).await {
                            Err(e) if e.is::<NotDirect>() => return Err(e),
                            // Our failure, not the server's: the program still
                            // refuses what does not suit (`drop_dsr_routed`,
                            // `drop_dsr_egress`, `drop_tunnel_egress`).
                            Err(e) => warn!(
                                server = %api,
                                "checking without its route, which the kernel did not give: {e:#}"
                            ),
                            Ok(()) => {}
                        }
                    }
                    let key = t.api_key.as_ref();
                    let model = match t.model {
                        Some(m) => m,
                        None => checker.discover_model(api, key).await?,
                    };
                    checker.check(api, &model, key).await?;
                    Ok::<_, anyhow::Error>(model)
                };
                // The whole check, model discovery included, within the timeout.
                match timeout(limit, result).await {
                    Ok(Ok(model)) => (t.key, Some(model), Ok(())),
                    Ok(Err(e)) => (t.key, None, Err(e)),
                    Err(_) => (t.key, None, Err(Waited::Timeout(timeout_ms).into())),
                }
            }
        });
        let results = join_all(checks).await;
        lock(&ctl).checked(results);
        tokio::time::sleep_until(next).await;
    }
}

/// The socket peers' flows arrive on and ours leave from. Its receive buffer holds a burst
/// of a peer's datagrams (a few hundred after a busy 10 ms) while the agent is busy.
fn bind_sync_socket(listen: std::net::SocketAddr) -> Result<UdpSocket> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(listen), Type::DGRAM, None)?;
    // The kernel caps it at net.core.rmem_max; what it grants is enough either way.
    socket.set_recv_buffer_size(4 << 20).ok();
    socket.bind(&listen.into())?;
    socket.set_nonblocking(true)?;
    Ok(UdpSocket::from_std(socket.into())?)
}

/// Binds the control socket, readable and writable by its owner only.
fn bind_control_socket(path: &Path) -> Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            bail!("another agent is listening on {}", path.display());
        }
        // A stale socket of an agent that died is ours to replace; anything else is not.
        if !meta.file_type().is_socket() {
            bail!(
                "{} exists and is not a socket: control_socket must name a path of its own",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("removing the stale socket {}", path.display()))?;
    }
    let listener =
        UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("restricting {}", path.display()))?;
    Ok(listener)
}

/// Answers the control socket's clients; a `reload` is handed to the main loop (`reloads`,
/// with where its answer goes).
async fn serve(listener: UnixListener, ctl: Shared, reloads: Reloads) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(answer(stream, ctl.clone(), reloads.clone()));
            }
            Err(e) => {
                warn!("control socket: {e}");
                sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Serves the agent's own metrics, `GET /metrics`, and whether the gateway should take
/// traffic yet, `GET /ready` (200, or 503 with what it waits for), until the agent stops.
async fn export(listener: TcpListener, ctl: Shared) {
    use axum::{http::header::CONTENT_TYPE, http::StatusCode, response::IntoResponse};
    let metrics = ctl.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let snapshot = lock(&metrics).snapshot();
                async move {
                    match exporter::render(snapshot) {
                        Ok(text) => {
                            ([(CONTENT_TYPE, exporter::CONTENT_TYPE)], text).into_response()
                        }
                        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
                    }
                }
            }),
        )
        .route(
            "/ready",
            axum::routing::get(move || {
                let r = lock(&ctl).readiness();
                let (status, head, lines) = match r.ready {
                    true => (StatusCode::OK, "ready", r.notes),
                    false => (StatusCode::SERVICE_UNAVAILABLE, "not ready", r.waiting),
                };
                let body = std::iter::once(head.to_owned())
                    .chain(lines)
                    .map(|l| l + "\n")
                    .collect::<String>();
                async move { (status, body) }
            }),
        );
    exporter::serve(listener, app, exporter::Limits::DEFAULT).await;
}

/// Deletes the flow table's ended and unanswered entries once quiet (`sweep.rs`), on a
/// blocking thread and without the controller's lock but to count what it deleted.
async fn sweep_loop(ctl: Shared, flows_id: u32) {
    let mut failing = false;
    loop {
        let started = std::time::Instant::now();
        match spawn_blocking(move || sweep::sweep(flows_id, sweep::QUIET)).await {
            Ok(Ok(swept)) => {
                let replaced: u64 = swept.replaced.values().sum();
                debug!(ended = swept.ended, unanswered = swept.unanswered_total(), replaced, took = ?started.elapsed(), "flow table swept");
                lock(&ctl).reclaimed(&swept);
                match &swept.failed {
                    None => failing = false,
                    Some(e) if !failing => {
                        failing = true;
                        warn!("deleting from the flow table failed, retrying: {e}");
                    }
                    Some(_) => {}
                }
            }
            // Once per failing streak: it is tried again at every sweep.
            Ok(Err(e)) if !failing => {
                failing = true;
                warn!("sweeping the flow table failed, retrying: {e:#}");
            }
            Ok(Err(_)) => {}
            // A panic is the agent's to stop on, as any task's (see `Tasks`).
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => warn!("sweeping the flow table: {e}"),
        }
        tokio::time::sleep(sweep::pause(started.elapsed())).await;
    }
}

/// One request, one response; a client that sends nothing sensible gets an error, and a
/// slow one is dropped.
async fn answer(stream: UnixStream, ctl: Shared, reloads: Reloads) {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    // Requests are small; a bounded read keeps a misbehaving client from costing memory.
    let mut reader = BufReader::new(read).take(64 * 1024);
    let response = match timeout(Duration::from_secs(5), reader.read_line(&mut line)).await {
        Ok(Ok(_)) => match serde_json::from_str::<Request>(&line) {
            Ok(Request::Reload) => {
                let (tx, rx) = oneshot::channel();
                let asked = reloads.send(tx).await.is_ok();
                match rx.await {
                    Ok(response) if asked => response,
                    _ => error("the agent is stopping: nothing was reloaded".into()),
                }
            }
            Ok(request) => {
                // Bound to a name: the lock is released before a walk of the flow table.
                let handled = lock(&ctl).handle(request);
                match handled {
                    Handled::Now(response) => response,
                    Handled::Walk(question) => spawn_blocking(move || question.answer())
                        .await
                        .unwrap_or_else(|e| error(format!("counting open flows: {e}"))),
                }
            }
            Err(e) => error(format!("bad request: {e}")),
        },
        Ok(Err(e)) => error(format!("bad request: {e}")),
        Err(_) => return,
    };
    if let Ok(mut text) = serde_json::to_string(&response) {
        text.push('\n');
        write.write_all(text.as_bytes()).await.ok();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(agent: &str, sync: bool, idle_timeout_s: u32) -> Config {
        let sync = if sync {
            "[sync]\nlisten = \"10.0.0.1:7471\"\npeers = [\"10.0.0.2:7471\"]\n\
             key_file = \"/etc/balancer/sync.key\"\n"
        } else {
            ""
        };
        let text = format!(
            "[agent]\ninterfaces = [\"eth0\"]\n{agent}\n{sync}[[pool]]\nname = \"p\"\n\
             vip = \"192.0.2.60\"\nport = 8000\nidle_timeout_s = {idle_timeout_s}\n\
             [[pool.server]]\naddress = \"10.4.0.11\"\nport = 8000\nmetrics_port = 8001\n"
        );
        Config::parse(Path::new("t.toml"), &text).unwrap()
    }

    /// What a reload cannot change stays as it runs, so the next reload warns again and the
    /// running configuration is what is in effect.
    #[test]
    fn restart_only_keys_stay_as_they_run() {
        let running = config(
            "flow_table_entries = 100000\npin_dir = \"/sys/fs/bpf/a\"",
            true,
            600,
        );
        let mut new = config(
            "flow_table_entries = 200000\npin_dir = \"/sys/fs/bpf/b\"\n\
             control_socket = \"/run/other.sock\"\nmetrics_listen = \"127.0.0.1:9477\"\n\
             scrape_interval_ms = 500",
            false,
            600,
        );
        let warnings = keep_restart_only(&mut new, &running).unwrap();
        let said = |key: &str| warnings.iter().any(|w| w.contains(key));
        for key in [
            "flow_table_entries",
            "pin_dir",
            "control_socket",
            "metrics_listen",
            "[sync]",
        ] {
            assert!(said(key), "no warning about {key}: {warnings:?}");
        }
        assert_eq!(warnings.len(), 5, "{warnings:?}");
        assert_eq!(new.agent.flow_table_entries, 100000);
        assert_eq!(new.agent.pin_dir, running.agent.pin_dir);
        assert_eq!(new.agent.control_socket, running.agent.control_socket);
        assert_eq!(new.agent.metrics_listen, None);
        assert_eq!(new.sync, running.sync, "[sync] stops only at a restart");
        // What a reload does change, changes.
        assert_eq!(new.agent.scrape_interval_ms, 500);
        // Sharing starts only at a restart too.
        let mut new = config("", true, 600);
        keep_restart_only(&mut new, &config("", false, 600)).unwrap();
        assert_eq!(new.sync, None);
        // Nothing to say when nothing of the kind changed.
        let same = keep_restart_only(&mut running.clone(), &running).unwrap();
        assert!(same.is_empty(), "{same:?}");
    }

    /// With pins, a restart alone would be refused (the pinned flow table keeps its size;
    /// the pinned links hold the interfaces): the warning says what comes first.
    #[test]
    fn restart_only_warnings_say_when_detach_comes_first() {
        for key in ["flow_table_entries", "pin_dir"] {
            assert!(restart_only(key, true).contains("balancer-agent detach"));
            assert!(!restart_only(key, false).contains("detach"));
        }
        assert!(!restart_only("xdp_mode", true).contains("detach"));
    }

    /// A task that panics or ends stops the agent, named; having none left does not.
    #[tokio::test]
    async fn a_task_that_panics_or_ends_is_noticed_by_name() {
        let within = |d| Duration::from_millis(d);
        let mut tasks = Tasks::default();
        tasks.spawn("health checks", std::future::pending());
        tasks.spawn("folds", async { panic!("the fold loop fell over") });
        let said = tokio::time::timeout(within(5000), tasks.first_to_end())
            .await
            .expect("the panic went unnoticed");
        assert!(
            said.starts_with("the agent's folds task failed ("),
            "{said}"
        );
        assert!(said.contains("panicked"), "{said}");
        tasks.spawn("sync heartbeats", async {});
        let said = tokio::time::timeout(within(5000), tasks.first_to_end())
            .await
            .expect("the end went unnoticed");
        assert_eq!(said, "the agent's sync heartbeats task ended");
        let running = tokio::time::timeout(within(200), tasks.first_to_end());
        assert!(
            running.await.is_err(),
            "a task that runs on taken for ended"
        );
        let mut none = Tasks::default();
        let idle = tokio::time::timeout(within(200), none.first_to_end());
        assert!(idle.await.is_err(), "no task taken for one that ended");
    }

    /// A file without `[sync]` may have idle timeouts too short for the sharing that stays on.
    #[test]
    fn short_idle_timeouts_refused_while_sharing_runs() {
        let running = config("", true, 600);
        let e = keep_restart_only(&mut config("", false, 5), &running).unwrap_err();
        assert!(
            e.to_string().contains("at least 10 s while [sync] runs"),
            "{e}"
        );
        keep_restart_only(&mut config("", false, 10), &running).unwrap();
        keep_restart_only(&mut config("", false, 5), &config("", false, 600)).unwrap();
    }

    /// A tunnel's source that no socket can bind is said, naming the pool; an address of
    /// the host is not (the loopback's, which every host has, stands in for one here).
    #[test]
    fn a_tunnel_source_of_another_host_is_said() {
        let mut c = config("", false, 600);
        assert!(foreign_tunnel_sources(&c).is_empty());
        c.pool[0].tunnel_source = Some("127.0.0.1".parse().unwrap());
        assert!(foreign_tunnel_sources(&c).is_empty());
        c.pool[0].tunnel_source = Some("192.0.2.99".parse().unwrap());
        let said = foreign_tunnel_sources(&c);
        assert_eq!(said.len(), 1);
        assert!(
            said[0].starts_with("pool p: tunnel_source 192.0.2.99 is not an address of this host"),
            "{said:?}"
        );
    }
}
