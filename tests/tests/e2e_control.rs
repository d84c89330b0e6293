//! Issue 4, "What it must show, end to end over namespaces with four simulators": the agent's
//! control loop in the gateway topology, with `inference-sim` in each backend (b1 vLLM,
//! b2 SGLang, b3 TensorRT-LLM, b4 llama.cpp metrics) and every figure measured and printed:
//!
//! 1. a server whose queue grows gets weight 0 within one scrape interval plus 100 ms, and
//!    at least 99% of new connections go to the others until it recovers;
//! 2. a killed server is DOWN after `fall` checks, and no new connection reaches it;
//! 3. a server with a long queue whose health checks time out stays UP (weight 0); one whose
//!    engine hangs with a queue goes DOWN, where its metrics have a progress counter;
//! 4. drain under load: 40 streams on one server finish with every token, `drain --wait`
//!    returns after the last one, and no new connection reaches the server meanwhile;
//! 5. `show` agrees with what the simulators report, within one scrape;
//! 6. bad configurations and bad metrics each give a clear message and change nothing.
//!
//! The scenarios share one topology and one agent; before each, the pool is brought back to
//! the same clean state (simulators with their usual arguments and no fault, nothing
//! drained, the base configuration, every server UP and idle), so that none depends on what
//! another left behind. A failed scenario does not stop the others; the test fails at the end
//! with all their errors.
//!
//! Client connections use source ports from 40000 up, each port once: the balancer hashes
//! the 5-tuple, so a run is reproducible, and ports below 32768 would carry affinity hints.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::ops::Range;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, OnceLock};
use std::thread::{self, sleep};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use balancer_agent::control::{PoolView, ServerRow};
use balancer_tests::agent::{agent_binary, Agent, AgentConfig, PoolTls, PoolViewExt};
use balancer_tests::backends::{SimBackends, SimState};
use balancer_tests::sim::client::{self, Item, Stream};
use balancer_tests::sim::tls;
use balancer_tests::topology::{backend_name, Family, Topology, BACKENDS};
use balancer_tests::{check_nothing_remains, serial};
use serde_json::{json, Value};

const SIM: &str = env!("CARGO_BIN_EXE_inference-sim");
const XDP_PASS: &str = env!("CARGO_BIN_EXE_xdp-pass");

const POOL: &str = "chat-v4";
/// Each backend publishes the metrics of a different server: the agent detects each one.
const DIALECTS: [&str; BACKENDS] = ["vllm", "sglang", "trtllm", "llamacpp"];
const SCRAPE_INTERVAL: Duration = Duration::from_millis(500);
/// The agent's own metrics, on the gateway namespace's loopback.
const METRICS_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9477);
const HEALTH_INTERVAL: Duration = Duration::from_millis(500);
const HEALTH_TIMEOUT: Duration = Duration::from_millis(400);
const FALL: u32 = 3;
const RISE: u32 = 2;
/// How long a queued server's progress counter may stand still before it is hung, not busy.
const HUNG_AFTER: Duration = Duration::from_secs(2);
/// Bound on waiting for the pool to settle after a restart, a reload or a reset.
const SETTLE: Duration = Duration::from_secs(20);
/// Pause between two polls of `show` or of a simulator.
const POLL: Duration = Duration::from_millis(10);

type Scenario = fn(&mut Bed) -> Result<()>;

#[test]
fn control_loop_end_to_end() {
    end_to_end(&[
        (
            "1. a queue takes the weight to 0",
            queue_takes_the_weight_to_zero,
        ),
        ("2. a killed server goes DOWN", killed_server_goes_down),
        (
            "2c. a server that wants an API key",
            api_key_servers_need_the_key,
        ),
        ("2d. servers over HTTPS", tls_servers),
        ("3. a busy server stays UP", busy_servers_stay_up),
        ("3b. a hung server goes DOWN", hung_servers_go_down),
        ("4. drain under load", drain_under_load),
        (
            "5. show agrees with the simulators",
            show_agrees_with_the_simulators,
        ),
        (
            "6. bad configs and bad metrics",
            bad_configs_and_bad_metrics,
        ),
    ]);
}

/// Scenario 2c. b2 restarted with an API key (`--api-key`, as vLLM's): its checks are
/// refused (401), though its metrics still scrape, and it goes DOWN; with the key in the
/// pool's `api_key_file`, reloaded, it comes back UP, and the others, which want none, stay
/// UP with the key sent to them too.
fn api_key_servers_need_the_key(bed: &mut Bed) -> Result<()> {
    const VICTIM: usize = 1;
    const KEY: &str = "sk-sim-2c";
    let name = backend_name(VICTIM);
    let mut args = baseline_args(VICTIM);
    args.extend(["--api-key".into(), KEY.into()]);
    bed.sims.restart(VICTIM, &args)?;
    let (shown, _) = bed.wait_show(
        &format!("{name} DOWN without the key"),
        Duration::from_secs(10),
        |pool| Ok(row(pool, VICTIM)?.state == "DOWN"),
    )?;
    let victim = row(&shown, VICTIM)?;
    println!("{name} wants a key: DOWN, health: {}", victim.health);
    ensure!(
        victim.health.contains("401") && victim.scrape_error.is_none(),
        "{name} without the key: health {:?}, scrape error {:?}",
        victim.health,
        victim.scrape_error
    );
    let key_file = bed.topology.dir().join("api.key");
    std::fs::write(&key_file, format!("{KEY}\n"))?;
    let mut keyed = bed.config.clone();
    keyed.pools[0].api_key_file = Some(key_file);
    bed.agent.reload(&keyed)?;
    bed.wait_show(
        "every server UP with the key",
        Duration::from_secs(10),
        |pool| Ok((0..BACKENDS).all(|i| row(pool, i).is_ok_and(|r| r.state == "UP"))),
    )?;
    println!("with the key: every server UP");
    Ok(())
}

/// Scenario 2d. Every simulator restarted as vLLM serving HTTPS (`--ssl-certfile`, and
/// `--ssl-ca-certs` requiring client certificates), with one certificate for the service's
/// name: the plain checks fail and every server goes DOWN, saying why; with the pool's
/// `[pool.tls]` (its CA, the service's name, the agent's certificate) and `/metrics` on the
/// API port, reloaded, every server is UP, checked and scraped over TLS; and clients'
/// completions through the VIP are TLS end to end, the balancer passing it through.
fn tls_servers(bed: &mut Bed) -> Result<()> {
    const SERVICE: &str = "vllm.internal";
    let pki = tls::Pki::new(&bed.topology.dir().join("pki"))?;
    let (server_cert, server_key) = pki.issue("server", &[SERVICE])?;
    let (agent_cert, agent_key) = pki.issue("agent", &["balancer-agent"])?;
    let (client_cert, client_key) = pki.issue("client", &["client"])?;
    let path = |p: &Path| p.display().to_string();
    for i in 0..BACKENDS {
        let args: Vec<String> = vec![
            "--dialect".into(),
            "vllm".into(),
            "--tls-cert".into(),
            path(&server_cert),
            "--tls-key".into(),
            path(&server_key),
            "--tls-client-ca".into(),
            path(&pki.ca_file()),
        ];
        bed.sims.restart(i, &args)?;
    }
    let (shown, _) = bed.wait_show(
        "every server DOWN over plain HTTP",
        Duration::from_secs(10),
        |pool| Ok((0..BACKENDS).all(|i| row(pool, i).is_ok_and(|r| r.state == "DOWN"))),
    )?;
    let health = &row(&shown, 0)?.health;
    println!("over plain HTTP: every server DOWN, health: {health}");
    // What a plain request to a TLS server gets back (OpenSSL servers, vLLM's and
    // llama-server's, close the connection instead).
    ensure!(
        health.contains("invalid HTTP version parsed"),
        "health {health:?}"
    );

    let mut config = bed.config.clone();
    let pool = &mut config.pools[0];
    pool.tls = Some(PoolTls {
        ca_file: pki.ca_file(),
        server_name: Some(SERVICE.into()),
        cert_file: Some(agent_cert),
        key_file: Some(agent_key),
    });
    for server in &mut pool.servers {
        server.metrics_port = server.port;
    }
    bed.agent.reload(&config)?;
    bed.wait_show("every server UP and scraped over HTTPS", SETTLE, |pool| {
        Ok((0..BACKENDS).all(|i| row(pool, i).is_ok_and(healthy)))
    })?;
    println!("with [pool.tls]: every server UP, checked and scraped over HTTPS");

    let vip = Family::V4.vip();
    let client = tls::client_config(&pki.ca_file(), Some((&client_cert, &client_key)))?;
    let body = json!({"prompt": "ping over TLS", "max_tokens": 4}).to_string();
    let ports = bed.ports(8)?;
    let answered = bed.topology.client().enter(|| {
        ports
            .map(|port| {
                let reply = tls::request_from(
                    vip,
                    port,
                    client.clone(),
                    SERVICE,
                    "POST",
                    "/v1/completions",
                    Some(&body),
                )
                .with_context(|| {
                    format!("a completion over TLS through the VIP from port {port}")
                })?;
                ensure!(reply.status() == 200, "port {port}: {reply:?}");
                reply
                    .head
                    .header("x-backend")
                    .map(str::to_owned)
                    .with_context(|| format!("no x-backend in the answer to port {port}"))
            })
            .collect::<Result<Vec<_>>>()
    })?;
    println!("8 completions over TLS through the VIP, answered by {answered:?}");
    Ok(())
}

/// Scenario 2 as a crash under load: the server dies while it queues.
#[test]
fn killed_while_queueing() {
    end_to_end(&[(
        "2b. a server killed while it queues goes DOWN",
        killed_while_queueing_goes_down,
    )]);
}

/// Runs `scenarios` on one topology and one agent, each from a clean pool; fails at the end
/// if any failed, and checks that nothing remains.
fn end_to_end(scenarios: &[(&str, Scenario)]) {
    let _serial = serial();
    let agent = agent_binary().unwrap();
    let started = Instant::now();
    let mut topology = Topology::build_bare().unwrap();
    topology.attach_xdp_pass(Path::new(XDP_PASS)).unwrap();
    println!("topology ready in {:?}", started.elapsed());
    // Panicking with the topology alive makes it print every process's log.
    if let Err(e) = run(&topology, &agent, scenarios) {
        panic!("{e:?}");
    }
    drop(topology);
    check_nothing_remains().unwrap();
    println!("total {:.1} s", started.elapsed().as_secs_f64());
}

fn run(topology: &Topology, agent: &Path, scenarios: &[(&str, Scenario)]) -> Result<()> {
    let args: Vec<Vec<String>> = (0..BACKENDS).map(baseline_args).collect();
    let sims = SimBackends::start(topology, Path::new(SIM), &args)?;
    let config = base_config(topology);
    let agent = Agent::start(topology, agent, &config)?;
    let mut bed = Bed {
        topology,
        sims,
        agent,
        config,
        next_port: FIRST_PORT,
    };
    let mut failed = Vec::new();
    for &(name, scenario) in scenarios {
        bed.reset()
            .with_context(|| format!("bringing the pool back to a clean state before {name}"))?;
        println!("\n=== {name}");
        let started = Instant::now();
        match scenario(&mut bed) {
            Ok(()) => println!("=== {name}: passed in {:.1} s", secs(started.elapsed())),
            Err(e) => {
                println!("=== {name}: FAILED: {e:#}");
                failed.push(format!("{name}: {e:?}"));
            }
        }
    }
    bed.agent.stop()?;
    ensure!(
        failed.is_empty(),
        "{} of {} scenarios failed:\n{}",
        failed.len(),
        scenarios.len(),
        failed.join("\n\n")
    );
    Ok(())
}

/// Every backend's simulator arguments between scenarios: its dialect, default capacity.
fn baseline_args(i: usize) -> Vec<String> {
    vec!["--dialect".into(), DIALECTS[i].into()]
}

/// [`baseline_args`] and a batch of at most `max_running` sequences, for a queue that forms
/// under a few streams.
fn small_batch_args(i: usize, max_running: usize) -> Vec<String> {
    let mut args = baseline_args(i);
    args.extend(["--max-running".into(), max_running.to_string()]);
    args
}

/// The IPv4 pool over the four backends, equal weights, fast scrapes and checks.
fn base_config(topology: &Topology) -> AgentConfig {
    let mut config = AgentConfig::gateway(topology, [100; BACKENDS]);
    config.pools.retain(|pool| pool.name == POOL);
    let agent = &mut config.agent;
    agent.scrape_interval_ms = Some(millis(SCRAPE_INTERVAL));
    agent.health_interval_ms = Some(millis(HEALTH_INTERVAL));
    agent.health_timeout_ms = Some(millis(HEALTH_TIMEOUT));
    agent.fall = Some(FALL);
    agent.rise = Some(RISE);
    agent.hung_after_ms = Some(millis(HUNG_AFTER));
    agent.metrics_listen = Some(METRICS_LISTEN);
    config
}

fn millis(d: Duration) -> u64 {
    d.as_millis().try_into().expect("short durations")
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Backend `i`'s address, as the CLI takes it.
fn address(i: usize) -> IpAddr {
    Family::V4.backend(i)
}

fn row(pool: &PoolView, i: usize) -> Result<&ServerRow> {
    pool.server(address(i))
}

/// Scraped recently enough to be fresh, UP, taking connections.
fn healthy(row: &ServerRow) -> bool {
    row.state == "UP"
        && row.weight > 0
        && row.scrape_error.is_none()
        && row
            .metrics_age_ms
            .is_some_and(|age| age <= 2 * millis(SCRAPE_INTERVAL))
}

const FIRST_PORT: u16 = 40000;
const LAST_PORT: u16 = 60999;

/// What the scenarios share.
struct Bed<'t> {
    topology: &'t Topology,
    sims: SimBackends<'t>,
    agent: Agent<'t>,
    /// The configuration between scenarios.
    config: AgentConfig,
    next_port: u16,
}

impl Bed<'_> {
    /// `n` source ports never used before in this run.
    fn ports(&mut self, n: u16) -> Result<Range<u16>> {
        let start = self.next_port;
        let end = start
            .checked_add(n)
            .filter(|&end| end <= LAST_PORT)
            .context("out of client source ports")?;
        self.next_port = end;
        Ok(start..end)
    }

    fn show(&self) -> Result<PoolView> {
        self.agent.show(POOL)
    }

    /// Polls `show` until `pred` holds; returns that answer and when it arrived.
    fn wait_show(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&PoolView) -> Result<bool>,
    ) -> Result<(PoolView, Instant)> {
        self.agent.wait_show(POOL, what, (timeout, POLL), pred)
    }

    /// Brings the pool back to the state every scenario starts from: simulators with their
    /// baseline arguments and no fault, nothing drained, the base configuration, every
    /// server UP, freshly scraped, taking connections, and idle.
    fn reset(&mut self) -> Result<()> {
        for i in 0..BACKENDS {
            let baseline = baseline_args(i);
            if self.sims.args(i) == Some(&baseline[..]) {
                self.sims.fault(i, &json!({"kind": "none"}))?;
            } else {
                self.sims.restart(i, &baseline)?;
            }
            self.agent
                .cli(&["undrain", POOL, &address(i).to_string()])?;
        }
        self.agent.reload(&self.config)?;
        let deadline = Instant::now() + SETTLE;
        loop {
            let pool = self.show()?;
            let states = (0..BACKENDS)
                .map(|i| self.sims.state(i))
                .collect::<Result<Vec<_>>>()?;
            let idle = states.iter().all(|s| s.running == 0 && s.waiting == 0);
            if idle
                && pool
                    .servers
                    .iter()
                    .all(|s| healthy(s) && s.waiting == Some(0.0))
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("not clean within {SETTLE:?}: {pool:#?}\nsimulators: {states:#?}");
            }
            sleep(POLL);
        }
    }

    /// Waits until the agent has scraped backend `i` since its (re)start and sees it idle.
    fn wait_scraped(&self, i: usize) -> Result<()> {
        self.wait_show(
            &format!("{} scraped after its restart", backend_name(i)),
            SETTLE,
            |pool| {
                let row = row(pool, i)?;
                Ok(healthy(row) && row.running == Some(0.0) && row.waiting == Some(0.0))
            },
        )
        .map(drop)
    }

    /// One short completion through the VIP from each of `ports`, one after the other; every
    /// one must succeed. Returns how many each backend answered.
    fn spread(&self, ports: Range<u16>) -> Result<BTreeMap<String, usize>> {
        let vip = Family::V4.vip();
        let body = json!({"prompt": "ping", "max_tokens": 1}).to_string();
        self.topology.client().enter(|| {
            let mut counts = BTreeMap::new();
            for port in ports {
                let reply = client::request_from(vip, port, "POST", "/v1/completions", Some(&body))
                    .with_context(|| format!("a completion through the VIP from port {port}"))?;
                ensure!(
                    reply.status() == 200,
                    "a completion from port {port} answered {}: {}",
                    reply.status(),
                    reply.body
                );
                let backend = reply
                    .head
                    .header("x-backend")
                    .with_context(|| format!("no x-backend in the answer to port {port}"))?;
                *counts.entry(backend.to_owned()).or_insert(0) += 1;
            }
            Ok(counts)
        })
    }

    /// `n` streams of `tokens` tokens straight to backend `i`, from inside its namespace.
    fn direct_streams(&self, i: usize, n: usize, tokens: u32) -> Result<Vec<Stream>> {
        let api = self.sims.api(i);
        self.topology.backend(i).enter(|| {
            (0..n)
                .map(|k| {
                    Stream::open(api, "/v1/completions", &long_stream(k, tokens))
                        .with_context(|| format!("stream {k} to {api}"))
                })
                .collect()
        })
    }

    /// One stream of `tokens` tokens through the VIP from each of `ports`.
    fn vip_streams(&self, ports: Range<u16>, tokens: u32) -> Result<Vec<Stream>> {
        let vip = Family::V4.vip();
        self.topology.client().enter(|| {
            ports
                .enumerate()
                .map(|(k, port)| {
                    Stream::open_from(vip, port, "/v1/completions", &long_stream(k, tokens))
                        .with_context(|| format!("a stream through the VIP from port {port}"))
                })
                .collect()
        })
    }

    /// The agent's log from byte `from`.
    fn log_since(&self, from: u64) -> String {
        let log = self.agent.log();
        log.get(usize::try_from(from).unwrap_or(usize::MAX)..)
            .unwrap_or_default()
            .to_owned()
    }
}

/// A streamed completion of exactly `tokens` tokens.
fn long_stream(k: usize, tokens: u32) -> Value {
    json!({
        "prompt": format!("stream number {k} of the control loop test"),
        "max_tokens": tokens, "stream": true, "ignore_eos": true,
    })
}

/// How many of `counts` went to backend `i`.
fn count(counts: &BTreeMap<String, usize>, i: usize) -> usize {
    counts.get(&backend_name(i)).copied().unwrap_or(0)
}

/// Scenario 1. b1 is restarted with room for 4 sequences and gets 6 streams straight from its
/// own namespace: 4 run, 2 wait. A thread polls the simulator's own state as fast as it
/// answers; the latency is from the first answer with waiting > 0 to the first `show` with
/// weight 0. Then 300 new connections through the VIP while the queue lasts, then the load
/// goes and b1 takes connections again.
fn queue_takes_the_weight_to_zero(bed: &mut Bed) -> Result<()> {
    const VICTIM: usize = 0;
    const MAX_RUNNING: usize = 4;
    const STREAMS: usize = 6;
    const NEW_CONNECTIONS: u16 = 300;
    let bound = SCRAPE_INTERVAL + Duration::from_millis(100);
    let name = backend_name(VICTIM);

    bed.sims
        .restart(VICTIM, &small_batch_args(VICTIM, MAX_RUNNING))?;
    bed.wait_scraped(VICTIM)?;
    // Part of the measured latency: the reply to a `show` only exists once it returns.
    let asked = Instant::now();
    bed.show()?;
    let show_takes = asked.elapsed();

    let ns = bed.topology.backend(VICTIM);
    let metrics = bed.sims.metrics(VICTIM);
    let (streams, queued_at, zero_at, shown) = thread::scope(|scope| -> Result<_> {
        let (ready, polling) = mpsc::channel();
        let watcher =
            scope.spawn(move || ns.enter(|| first_queue(metrics, &ready, Duration::from_secs(10))));
        // Only once the watcher has seen the queue empty: its first sighting is then the
        // queue's start, to within one poll.
        polling
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| anyhow!("the queue watcher did not start"))?;
        let streams = bed.direct_streams(VICTIM, STREAMS, 3000)?;
        let (shown, zero_at) = bed.wait_show(
            &format!("{name}'s weight at 0"),
            Duration::from_secs(5),
            |pool| Ok(row(pool, VICTIM)?.weight == 0),
        )?;
        let queued_at = watcher
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        Ok((streams, queued_at, zero_at, shown))
    })?;
    let victim = row(&shown, VICTIM)?;
    // When the scrape that saw the queue went out, at the latest: the answer's age is from
    // the agent's clock when it answered, before `show` returned. So the CLI's own time and
    // the polls between `show`s are not counted against the agent.
    let age = Duration::from_millis(
        victim
            .metrics_age_ms
            .context("weight 0 shown without a scrape")?,
    );
    let latency = zero_at
        .checked_sub(age)
        .unwrap_or(zero_at)
        .saturating_duration_since(queued_at);
    println!(
        "{name} (max-running {MAX_RUNNING}, {STREAMS} streams): weight 0 decided at a scrape \
         sent {:.0} ms after its queue appeared (bound {:.0} ms), shown {:.0} ms after it \
         (one show takes {:.0} ms); reason: {}",
        ms(latency),
        ms(bound),
        ms(zero_at.saturating_duration_since(queued_at)),
        ms(show_takes),
        victim.reason
    );
    ensure!(
        latency <= bound,
        "{name}'s weight reached 0 at a scrape sent {latency:?} after its queue appeared, \
         over {bound:?}"
    );

    let ports = bed.ports(NEW_CONNECTIONS)?;
    let started = Instant::now();
    let counts = bed.spread(ports)?;
    let state = bed.sims.state(VICTIM)?;
    let after = bed.show()?;
    println!(
        "{NEW_CONNECTIONS} new connections in {:.1} s while {name} queued: {counts:?}; \
         {name} then: running {}, waiting {}, weight {}",
        secs(started.elapsed()),
        state.running,
        state.waiting,
        row(&after, VICTIM)?.weight
    );
    ensure!(
        state.waiting > 0 && row(&after, VICTIM)?.weight == 0,
        "{name}'s queue was gone before the connections were all made, so they prove nothing"
    );
    let strays = count(&counts, VICTIM);
    ensure!(
        strays * 100 <= usize::from(NEW_CONNECTIONS),
        "{strays} of {NEW_CONNECTIONS} new connections went to {name} while it queued"
    );

    let removed = Instant::now();
    drop(streams);
    // Idle, not only weighted: a server weighted again while its slots are still busy has
    // no spill budget yet, and new connections go to the others with room.
    let (shown, back_at) = bed.wait_show(
        &format!("{name} idle and taking connections after its load went"),
        Duration::from_secs(10),
        |pool| {
            let r = row(pool, VICTIM)?;
            Ok(r.weight > 0 && r.running == Some(0.0) && r.waiting == Some(0.0))
        },
    )?;
    let ports = bed.ports(100)?;
    let counts = bed.spread(ports)?;
    println!(
        "load removed: {name}'s weight {} after {:.0} ms ({}); then 100 new connections: \
         {counts:?}",
        row(&shown, VICTIM)?.weight,
        ms(back_at - removed),
        row(&shown, VICTIM)?.reason
    );
    ensure!(
        count(&counts, VICTIM) > 0,
        "{name} took none of 100 new connections after it recovered"
    );
    Ok(())
}

/// Polls `/admin/state` at `metrics` (call it inside the backend's namespace), says on
/// `ready` once it has seen no queue, and returns when it first sees one.
fn first_queue(
    metrics: std::net::SocketAddr,
    ready: &mpsc::Sender<()>,
    timeout: Duration,
) -> Result<Instant> {
    let deadline = Instant::now() + timeout;
    let mut told = false;
    loop {
        let state: SimState = client::get(metrics, "/admin/state")?
            .json()
            .and_then(|v| serde_json::from_value(v).context("unexpected /admin/state"))?;
        let at = Instant::now();
        if state.waiting > 0 {
            ensure!(told, "a queue before any load: {state:?}");
            return Ok(at);
        }
        if !told {
            told = true;
            // The receiver only goes away when the scenario failed; nothing to tell then.
            ready.send(()).ok();
        }
        ensure!(at < deadline, "no queue within {timeout:?}");
        sleep(Duration::from_millis(1));
    }
}

/// Scenario 2. b2's simulator is killed (SIGKILL); the agent must take it DOWN after `fall`
/// failed checks, no sooner, and then no new connection may reach it: every one of 200 must
/// succeed on the others. Then it comes back, UP after `rise` good checks.
fn killed_server_goes_down(bed: &mut Bed) -> Result<()> {
    const VICTIM: usize = 1;
    const NEW_CONNECTIONS: u16 = 200;
    let name = backend_name(VICTIM);
    let addr = address(VICTIM).to_string();

    let mark = bed.agent.log_len();
    let killed_at = Instant::now();
    bed.sims.kill(VICTIM)?;
    let (shown, down_at) = bed.wait_show(
        &format!("{name} DOWN after it was killed"),
        Duration::from_secs(10),
        |pool| Ok(row(pool, VICTIM)?.state == "DOWN"),
    )?;
    let took = down_at - killed_at;
    let line = bed
        .agent
        .wait_for_log(mark, Duration::from_secs(2), |line| {
            line.contains("DOWN after") && line.contains(&addr)
        })?;
    let victim = row(&shown, VICTIM)?;
    println!(
        "{name} killed: DOWN shown after {:.0} ms (fall {FALL} x health interval {:.0} ms); \
         weight {}, health: {}\n  agent: {}",
        ms(took),
        ms(HEALTH_INTERVAL),
        victim.weight,
        victim.health,
        line.trim()
    );
    ensure!(
        line.contains(&format!("DOWN after {FALL} failed checks")),
        "unexpected: {line}"
    );
    ensure!(victim.weight == 0, "DOWN with weight {}", victim.weight);
    // The third failed check comes 2 intervals after the first, which comes at most one
    // interval after the kill, or fails at the kill if it was under way then; allow one
    // check's duration on either side.
    let earliest = HEALTH_INTERVAL * (FALL - 1) - HEALTH_TIMEOUT;
    let latest = HEALTH_INTERVAL * FALL + HEALTH_TIMEOUT + Duration::from_millis(300);
    ensure!(
        (earliest..=latest).contains(&took),
        "DOWN {took:?} after the kill, outside {earliest:?}..={latest:?}"
    );

    // A connection sent to b2 now would be refused, and fail this.
    let ports = bed.ports(NEW_CONNECTIONS)?;
    let counts = bed.spread(ports)?;
    println!("{NEW_CONNECTIONS} new connections after DOWN, all answered: {counts:?}");
    ensure!(
        count(&counts, VICTIM) == 0,
        "{name} answered while dead? {counts:?}"
    );
    // Drained while DOWN, it is still shown DOWN (where an alert on DOWN sees it), and
    // undrained, it is not said to take connections.
    bed.agent.cli(&["drain", POOL, &addr])?;
    let state = row(&bed.show()?, VICTIM)?.state.clone();
    let undrained = bed.agent.cli(&["undrain", POOL, &addr])?;
    ensure!(
        state == "DOWN" && undrained.contains("is DOWN"),
        "{name} DOWN and drained: shown {state}; undrain said {undrained:?}"
    );

    // Back under another model name: the pool names none, so the agent asks the server
    // again rather than check for the old one, which would fail for good.
    let mark = bed.agent.log_len();
    let restarted = Instant::now();
    let mut renamed = baseline_args(VICTIM);
    renamed.extend(["--model".into(), "sim-model-v2".into()]);
    bed.sims.restart(VICTIM, &renamed)?;
    let (_, up_at) = bed.wait_show(
        &format!("{name} UP after its restart under another model name"),
        Duration::from_secs(10),
        |pool| {
            let row = row(pool, VICTIM)?;
            Ok(row.state == "UP" && row.weight > 0)
        },
    )?;
    let line = bed
        .agent
        .wait_for_log(mark, Duration::from_secs(2), |line| {
            line.contains("UP after") && line.contains(&addr)
        })?;
    println!(
        "{name} restarted: UP and weighted after {:.0} ms\n  agent: {}",
        ms(up_at - restarted),
        line.trim()
    );
    ensure!(
        line.contains(&format!("UP after {RISE} good checks")),
        "unexpected: {line}"
    );
    Ok(())
}

/// Scenario 2b. b2 is restarted with room for 2 sequences and given 4 streams (a queue of 2,
/// so its weight is 0), then killed. Its last good scrape shows that queue, but every scrape
/// since fails: a failed check must count as a failure, not as busy, once the queue it
/// would excuse is no longer seen. Allowed: the time for that reading to go stale (3 scrape
/// intervals) and then `fall` checks.
fn killed_while_queueing_goes_down(bed: &mut Bed) -> Result<()> {
    const VICTIM: usize = 1;
    let name = backend_name(VICTIM);

    bed.sims.restart(VICTIM, &small_batch_args(VICTIM, 2))?;
    bed.wait_scraped(VICTIM)?;
    let streams = bed.direct_streams(VICTIM, 4, 3000)?;
    bed.wait_show(
        &format!("{name} saturated by its queue"),
        Duration::from_secs(5),
        |pool| {
            let row = row(pool, VICTIM)?;
            Ok(row.weight == 0 && row.waiting.is_some_and(|w| w >= 2.0))
        },
    )?;
    let killed_at = Instant::now();
    bed.sims.kill(VICTIM)?;
    let latest = SCRAPE_INTERVAL * 3 + HEALTH_INTERVAL * FALL + HEALTH_TIMEOUT;
    let outcome = bed.wait_show(
        &format!("{name} DOWN after it was killed with a queue"),
        latest + Duration::from_secs(2),
        |pool| Ok(row(pool, VICTIM)?.state == "DOWN"),
    );
    drop(streams);
    let (shown, down_at) = outcome?;
    let took = down_at - killed_at;
    println!(
        "{name} killed with a queue: DOWN shown after {:.0} ms (allowed {:.0} ms); health: {}",
        ms(took),
        ms(latest),
        row(&shown, VICTIM)?.health
    );
    ensure!(
        took <= latest,
        "DOWN only {took:?} after the kill, over {latest:?}"
    );
    Ok(())
}

/// Restarts each of `victims` with room for 2 sequences, sets `fault` on it once scraped,
/// and gives it 4 streams of `tokens` tokens: 2 run, 2 wait. Returns the streams and when
/// the first was opened.
fn queue_on(
    bed: &mut Bed,
    victims: &[usize],
    tokens: u32,
    fault: Option<Value>,
) -> Result<(Vec<Stream>, Instant)> {
    for &i in victims {
        bed.sims.restart(i, &small_batch_args(i, 2))?;
    }
    for &i in victims {
        bed.wait_scraped(i)?;
        // One answer first, as from any server in service: SGLang and TGI create their
        // progress counters at the first batch.
        let api = bed.sims.api(i);
        let reply = bed.topology.backend(i).enter(|| {
            client::post(
                api,
                "/v1/completions",
                &json!({"prompt": "warm up", "max_tokens": 2}),
            )
        })?;
        ensure!(reply.status() == 200, "{}: {}", backend_name(i), reply.body);
    }
    // Each fault right before the streams: a hung server without its queue is simply dead.
    for &i in victims {
        if let Some(fault) = &fault {
            bed.sims.fault(i, fault)?;
        }
    }
    let opened = Instant::now();
    let mut streams = Vec::new();
    for &i in victims {
        streams.extend(bed.direct_streams(i, 4, tokens)?);
    }
    Ok((streams, opened))
}

/// Scenario 3. Every backend, one dialect each, is restarted with room for 2 sequences and
/// given 4 long streams: 2 run and generate, 2 wait, and every health check queues behind
/// them and times out. Watched for three times `fall` x health interval (longer than
/// `hung_after`), each must stay UP throughout, no check counted as a hang while they keep
/// coming and timing out (busy): since its progress counter moves (vLLM, SGLang, llama.cpp), or
/// since it has none (TensorRT-LLM). (With the whole pool saturated, each keeps a weight:
/// the policy fails open, policy.md; scenario 1 shows a queue taking a weight to 0.)
fn busy_servers_stay_up(bed: &mut Bed) -> Result<()> {
    let victims: Vec<usize> = (0..BACKENDS).collect();
    let watch = HEALTH_INTERVAL * FALL * 3;
    ensure!(
        watch > HUNG_AFTER + SCRAPE_INTERVAL,
        "the watch must outlast hung_after"
    );

    let (streams, _) = queue_on(bed, &victims, 3000, None)?;
    let (shown, _) = bed.wait_show(
        "every server saturated, with a check that timed out counted as busy",
        Duration::from_secs(10),
        |pool| {
            victims.iter().try_fold(true, |all, &i| {
                Ok(all && row(pool, i)?.health.starts_with("busy"))
            })
        },
    )?;
    for &i in &victims {
        let row = row(&shown, i)?;
        println!(
            "{}: {}; health: {}",
            backend_name(i),
            row.reason,
            row.health
        );
    }

    let mark = bed.agent.log_len();
    let checks_before = victims
        .iter()
        .map(|&i| Ok(bed.sims.state(i)?.requests_received))
        .collect::<Result<Vec<_>>>()?;
    let started = Instant::now();
    let (mut polls, mut busy) = (0, 0);
    while started.elapsed() < watch {
        let pool = bed.show()?;
        for &i in &victims {
            let row = row(&pool, i)?;
            // A check may fail on its own merits now and then (a scrape late on this busy
            // machine leaves no fresh queue to excuse it), but never as a hang.
            ensure!(
                row.state == "UP" && !row.health.contains("hung"),
                "{} after {:?} of timed-out checks: {row:#?}",
                backend_name(i),
                started.elapsed()
            );
            busy += usize::from(row.health.starts_with("busy"));
        }
        polls += 1;
        sleep(Duration::from_millis(100));
    }
    let rows = polls * victims.len();
    println!("health busy in {busy} of {rows} rows polled");
    ensure!(busy * 2 > rows, "busy in only {busy} of {rows} rows");
    let pool = bed.show()?;
    for (&i, before) in victims.iter().zip(checks_before) {
        let state = bed.sims.state(i)?;
        let checks = state.requests_received - before;
        println!(
            "{} ({}) UP and busy for {:.1} s ({polls} polls of show; fall {FALL} x \
             interval {:.0} ms = {:.1} s, hung_after {:.1} s) while {checks} health checks \
             queued and timed out; simulator: running {}, waiting {}; health: {}",
            backend_name(i),
            DIALECTS[i],
            secs(started.elapsed()),
            ms(HEALTH_INTERVAL),
            secs(HEALTH_INTERVAL * FALL),
            secs(HUNG_AFTER),
            state.running,
            state.waiting,
            row(&pool, i)?.health
        );
        ensure!(
            checks > u64::from(FALL),
            "only {checks} health checks reached {}: too few to have taken it DOWN",
            backend_name(i)
        );
    }
    let log = bed.log_since(mark);
    let down = log.lines().find(|line| line.contains("DOWN after"));
    ensure!(
        down.is_none(),
        "the agent took a busy server DOWN: {down:?}"
    );
    drop(streams);
    Ok(())
}

/// Scenario 3b. b1 (vLLM), b2 (SGLang) and b4 (llama.cpp) are restarted with room for 2
/// sequences, made to hang before the first token (an engine that no longer steps, while
/// its `/metrics` still answers with the same queue), and given 4 streams: 2 hold their
/// slots without a token, 2 wait. Their progress counters stand still, so once `hung_after`
/// has passed their timed-out checks are failures: each must be DOWN within `hung_after`, a
/// scrape, `fall` checks and a timeout. (TensorRT-LLM publishes no such counter: a hung one
/// stays UP with weight 0, as in scenario 3.)
fn hung_servers_go_down(bed: &mut Bed) -> Result<()> {
    let victims = [0, 1, 3];
    let hang = json!({"kind": "hang_before_first_token"});
    let (streams, hung_at) = queue_on(bed, &victims, 100, Some(hang))?;
    // The last idle scrape starts the clock, a scrape must see it past HUNG_AFTER, then
    // `fall` checks fail.
    let latest = HUNG_AFTER + SCRAPE_INTERVAL * 2 + HEALTH_INTERVAL * (FALL + 1) + HEALTH_TIMEOUT;
    let outcome = bed.wait_show(
        "every hung server DOWN",
        latest + Duration::from_secs(2),
        |pool| {
            victims
                .iter()
                .try_fold(true, |all, &i| Ok(all && row(pool, i)?.state == "DOWN"))
        },
    );
    let (shown, down_at) = outcome?;
    let took = down_at - hung_at;
    for &i in &victims {
        println!(
            "{} ({}) hung with a queue: DOWN shown after {:.0} ms (allowed {:.0} ms); \
             health: {}",
            backend_name(i),
            DIALECTS[i],
            ms(took),
            ms(latest),
            row(&shown, i)?.health
        );
        ensure!(
            row(&shown, i)?.health.contains("hung"),
            "{} DOWN, but not for a hang: {}",
            backend_name(i),
            row(&shown, i)?.health
        );
    }
    ensure!(
        took <= latest,
        "DOWN only {took:?} after the hang, over {latest:?}"
    );
    for &i in &victims {
        bed.sims.fault(i, &json!({"kind": "none"}))?;
    }
    drop(streams);
    Ok(())
}

/// How one stream of scenario 4 ended.
struct StreamEnd {
    backend: String,
    tokens: u32,
    finish_reason: Option<String>,
    /// When `[DONE]` arrived; the connection closes right after.
    done_at: Option<Instant>,
}

/// Reads `stream` to its end, then closes it (so that the balancer sees the connection go).
fn read_to_end(mut stream: Stream) -> Result<StreamEnd> {
    let backend = stream.head.header("x-backend").unwrap_or("?").to_owned();
    let mut end = StreamEnd {
        backend,
        tokens: 0,
        finish_reason: None,
        done_at: None,
    };
    while let Some(item) = stream.next_item()? {
        match item {
            Item::Chunk { data, .. } => match data["choices"][0]["finish_reason"].as_str() {
                None => end.tokens += 1,
                Some(reason) => end.finish_reason = Some(reason.to_owned()),
            },
            Item::Done { at } => end.done_at = Some(at),
        }
    }
    drop(stream);
    Ok(end)
}

/// Scenario 4. Every new connection is steered to b4 (the others configured to weight 0), 40
/// streams of 500 tokens open through the VIP, and the weights are restored. Then
/// `balancer-agent drain chat-v4 10.4.0.14 --wait`, and 100 new connections while the
/// streams run: none may reach b4, every stream must end with all its tokens and `[DONE]`,
/// and `--wait` must return after the last one ended, within a few seconds.
fn drain_under_load(bed: &mut Bed) -> Result<()> {
    const VICTIM: usize = 3;
    const STREAMS: u16 = 40;
    // About 12 s: the drain and the 100 connections after it take about 4 s on an idle
    // machine, and the streams must outlast them on a loaded one too.
    const TOKENS: u32 = 500;
    const NEW_CONNECTIONS: u16 = 100;
    let name = backend_name(VICTIM);
    let addr = address(VICTIM).to_string();

    let mut steer = bed.config.clone();
    for i in (0..BACKENDS).filter(|&i| i != VICTIM) {
        steer.set_weight(i, 0);
    }
    bed.agent.reload(&steer)?;
    bed.wait_show(&format!("only {name} weighted"), SETTLE, |pool| {
        Ok((0..BACKENDS).all(|i| row(pool, i).is_ok_and(|r| (r.weight > 0) == (i == VICTIM))))
    })?;
    let stream_ports = bed.ports(STREAMS)?;
    let streams = bed.vip_streams(stream_ports, TOKENS)?;
    bed.agent.reload(&bed.config)?;
    bed.wait_show("every server weighted again", SETTLE, |pool| {
        Ok(pool.servers.iter().all(|s| s.weight > 0))
    })?;
    let opened = Instant::now();

    let mut wait = Stamped::spawn(
        bed.agent
            .cli_command(&["drain", POOL, &addr, "--wait", "--timeout", "60"]),
        &bed.topology.dir().join("drain-wait.log"),
    )?;
    let (draining_at, line) = wait.line(Duration::from_secs(10))?;
    ensure!(line.contains("is draining"), "drain said: {line}");
    let ports = bed.ports(NEW_CONNECTIONS)?;
    let (ends, counts, spread_done) = thread::scope(|scope| -> Result<_> {
        let readers: Vec<_> = streams
            .into_iter()
            .map(|stream| scope.spawn(move || read_to_end(stream)))
            .collect();
        let counts = bed.spread(ports);
        let spread_done = Instant::now();
        let ends = readers
            .into_iter()
            .map(|reader| {
                reader
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((ends, counts?, spread_done))
    })?;
    let mut progress = Vec::new();
    let returned_at = loop {
        let (at, line) = wait.line(Duration::from_secs(30))?;
        if line.starts_with("drained") {
            break at;
        }
        progress.push(line);
    };
    let status = wait.finish(Duration::from_secs(5))?;
    ensure!(status.success(), "drain --wait exited with {status}");

    let on_victim = ends.iter().filter(|e| e.backend == name).count();
    let complete = ends
        .iter()
        .filter(|e| {
            e.tokens == TOKENS
                && e.finish_reason.as_deref() == Some("length")
                && e.done_at.is_some()
        })
        .count();
    let first_end = ends.iter().filter_map(|e| e.done_at).min();
    let last_end = ends.iter().filter_map(|e| e.done_at).max();
    let (Some(first_end), Some(last_end)) = (first_end, last_end) else {
        bail!("no stream ended with [DONE]");
    };
    let since = |t: Instant| secs(t.saturating_duration_since(opened));
    println!(
        "{STREAMS} streams through the VIP, {on_victim} on {name}, {complete} complete \
         ({TOKENS} tokens, finish_reason length, [DONE]); from the weights' restoration: \
         drain at +{:.2} s, streams ended +{:.2}..+{:.2} s, drain --wait returned at +{:.2} s \
         ({:.0} ms after the last stream)\n  drain --wait said: {progress:?}\n  \
         {NEW_CONNECTIONS} new connections during the drain (done at +{:.2} s): {counts:?}",
        since(draining_at),
        since(first_end),
        since(last_end),
        since(returned_at),
        ms(returned_at.saturating_duration_since(last_end)),
        since(spread_done),
    );
    ensure!(
        on_victim == usize::from(STREAMS),
        "only {on_victim} of {STREAMS} streams went to {name}"
    );
    ensure!(
        complete == usize::from(STREAMS),
        "{} of {STREAMS} streams did not get every token and [DONE]: {:?}",
        usize::from(STREAMS) - complete,
        ends.iter()
            .map(|e| (e.tokens, e.finish_reason.clone(), e.done_at.is_some()))
            .collect::<Vec<_>>()
    );
    ensure!(
        first_end > draining_at && spread_done < last_end,
        "the streams were not running throughout the drain, so it was not under load"
    );
    ensure!(
        count(&counts, VICTIM) == 0,
        "{} new connections reached {name} while it drained: {counts:?}",
        count(&counts, VICTIM)
    );
    ensure!(
        returned_at > last_end,
        "drain --wait returned {:?} before the last stream ended",
        last_end - returned_at
    );
    ensure!(
        returned_at - last_end <= Duration::from_secs(3),
        "drain --wait returned {:?} after the last stream ended",
        returned_at - last_end
    );
    let state = bed.sims.state(VICTIM)?;
    ensure!(state.running == 0, "{name} still runs {}", state.running);
    Ok(())
}

/// A CLI run whose output lines are stamped as they arrive, for when ordering matters to
/// within less than a poll. Killed if still running when dropped.
struct Stamped {
    child: Child,
    lines: mpsc::Receiver<(Instant, String)>,
}

impl Stamped {
    /// Starts `cmd`; its stderr goes to `log`.
    fn spawn(mut cmd: Command, log: &Path) -> Result<Self> {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log)?)
            .spawn()
            .with_context(|| format!("starting {cmd:?}"))?;
        let stdout = child.stdout.take().context("piped stdout")?;
        let (send, lines) = mpsc::channel();
        // Ends when the process does (end of its stdout).
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if send.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        Ok(Self { child, lines })
    }

    /// The next line and when it came.
    fn line(&self, timeout: Duration) -> Result<(Instant, String)> {
        self.lines
            .recv_timeout(timeout)
            .map_err(|e| anyhow!("no more output within {timeout:?}: {e}"))
    }

    /// Waits for the exit.
    fn finish(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            ensure!(Instant::now() < deadline, "still running after {timeout:?}");
            sleep(POLL);
        }
    }
}

impl Drop for Stamped {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.child.kill().ok();
        }
        self.child.wait().ok();
    }
}

/// One sighting of a simulator's own state.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    running: u64,
    waiting: u64,
    kv: f64,
}

/// Polls backend `i`'s `/admin/state` every 20 ms until it has seen the state at `until`,
/// once that is set (or a minute has passed).
fn sample(bed: &Bed, i: usize, until: &OnceLock<Instant>) -> Result<Vec<Sample>> {
    let metrics = bed.sims.metrics(i);
    bed.topology.backend(i).enter(|| {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut samples = Vec::new();
        loop {
            let state: SimState =
                serde_json::from_value(client::get(metrics, "/admin/state")?.json()?)?;
            let at = Instant::now();
            samples.push(Sample {
                at,
                running: state.running,
                waiting: state.waiting,
                kv: state.kv_usage,
            });
            if until.get().is_some_and(|&until| at >= until) || at >= deadline {
                return Ok(samples);
            }
            sleep(Duration::from_millis(20));
        }
    })
}

/// Scenario 5. Streams straight to each backend (b2 restarted with room for 3, so that 2 of
/// its 5 wait), health checks paused so that their one-token requests do not come and go
/// between two sightings. Every 300 ms `show` is compared with the simulators' own state:
/// each server's running, waiting and KV use must be values the simulator had at the time of
/// the scrape `show` reports (its `metrics_age_ms`, which must be under one scrape interval
/// plus the scrape's own time); llama.cpp publishes no KV gauge, so `show` must have none.
/// The agent's own metrics endpoint (`GET /metrics`, OpenMetrics text) reports every
/// server UP with the load `show` saw: `load[i]` requests running and waiting.
fn metrics_agree(bed: &Bed, load: &[usize; BACKENDS]) -> Result<()> {
    let reply = bed
        .topology
        .gw()
        .enter(|| client::get(METRICS_LISTEN, "/metrics"))?;
    let content_type = reply
        .head
        .headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        .map(|(_, v)| v.as_str());
    ensure!(
        reply.head.status == 200
            && content_type.is_some_and(|t| t.starts_with("application/openmetrics-text")),
        "GET /metrics: {} {content_type:?}",
        reply.head.status
    );
    let scrape = prometheus_parse::Scrape::parse(reply.body.lines().map(|l| Ok(l.to_owned())))
        .context("parsing the agent's metrics")?;
    let value = |name: &str, server: &str| -> Option<f64> {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name && s.labels.get("server") == Some(server))
            .and_then(|s| match s.value {
                prometheus_parse::Value::Gauge(v) | prometheus_parse::Value::Untyped(v) => Some(v),
                _ => None,
            })
    };
    for (i, &n) in load.iter().enumerate() {
        let server = format!("{}:8000", address(i));
        let busy = value("balancer_server_running", &server).unwrap_or(0.0)
            + value("balancer_server_waiting", &server).unwrap_or(0.0);
        ensure!(
            busy == n as f64,
            "{server}: running + waiting {busy} in /metrics, {n} in show"
        );
        // Every state has a sample: UP's must be 1.
        let up = scrape.samples.iter().any(|s| {
            s.metric == "balancer_server_state"
                && s.labels.get("server") == Some(server.as_str())
                && s.labels.get("state") == Some("UP")
                && matches!(s.value, prometheus_parse::Value::Gauge(v) if v == 1.0)
        });
        ensure!(up, "{server} is not UP in /metrics");
    }
    let packets = scrape.samples.iter().any(|s| {
        s.metric == "balancer_xdp_events_total" && s.labels.get("event") == Some("packets")
    });
    ensure!(packets, "no packet counter in /metrics");
    println!(
        "/metrics: {} samples, load per server as in show",
        scrape.samples.len()
    );
    Ok(())
}

fn show_agrees_with_the_simulators(bed: &mut Bed) -> Result<()> {
    const LOAD: [usize; BACKENDS] = [2, 5, 4, 1];
    const QUEUED: usize = 1;
    const SHOWS: usize = 5;
    let freshness = SCRAPE_INTERVAL + Duration::from_millis(200);

    bed.sims.restart(QUEUED, &small_batch_args(QUEUED, 3))?;
    let mut quiet = bed.config.clone();
    quiet.agent.health_interval_ms = Some(60_000);
    bed.agent.reload(&quiet)?;
    wait_checks_paused(bed)?;
    bed.wait_scraped(QUEUED)?;

    let mut streams = Vec::new();
    for (i, &n) in LOAD.iter().enumerate() {
        streams.extend(bed.direct_streams(i, n, 3000)?);
    }
    bed.wait_show(
        "every server's load scraped",
        Duration::from_secs(5),
        |pool| {
            Ok((0..BACKENDS).all(|i| {
                row(pool, i).is_ok_and(|r| {
                    r.running.unwrap_or(0.0) + r.waiting.unwrap_or(0.0) == LOAD[i] as f64
                })
            }))
        },
    )?;
    metrics_agree(bed, &LOAD)?;

    let until = OnceLock::new();
    let (samples, shows) = thread::scope(|scope| -> Result<_> {
        let samplers: Vec<_> = (0..BACKENDS)
            .map(|i| {
                let (bed, until) = (&*bed, &until);
                scope.spawn(move || sample(bed, i, until))
            })
            .collect();
        let shows = (|| -> Result<Vec<_>> {
            let mut shows = Vec::new();
            for n in 0..SHOWS {
                // The first show waits until any scrape it may report came after the
                // samplers' first sighting; the others are spread out.
                sleep(if n == 0 {
                    freshness + Duration::from_millis(100)
                } else {
                    Duration::from_millis(300)
                });
                let before = Instant::now();
                let pool = bed.show()?;
                shows.push((before, Instant::now(), pool));
            }
            Ok(shows)
        })();
        // The scrape a show reports was sent before the show answered, and answered within
        // the scrape timeout (at most the interval): the samplers must see past that.
        let last = shows.as_ref().ok().and_then(|shows| shows.last());
        until
            .set(last.map_or_else(Instant::now, |(_, after, _)| *after + SCRAPE_INTERVAL))
            .ok();
        let samples = samplers
            .into_iter()
            .map(|s| {
                s.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((samples, shows?))
    })?;

    let table = bed.agent.cli(&["show", "pool", POOL])?;
    println!("{}", table.trim_end());
    let header: Vec<&str> = table
        .lines()
        .nth(1)
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    ensure!(
        header.starts_with(&["server", "running", "waiting", "kv-mem", "ttft-ms", "state"]),
        "show's columns: {header:?}"
    );

    let mut mismatches = Vec::new();
    for (n, (before, after, pool)) in shows.iter().enumerate() {
        for i in 0..BACKENDS {
            let row = row(pool, i)?;
            let Some(age) = row.metrics_age_ms.map(Duration::from_millis) else {
                bail!("{} never scraped: {row:?}", backend_name(i));
            };
            // The scrape was sent `age` before the agent answered, which was between `before`
            // and `after`, and the simulator answered it within the scrape timeout. The load
            // is steady (running and waiting constant, KV use only growing), so what it
            // answered lies between its last sighting before that span and the first after.
            let from = before.checked_sub(age).unwrap_or(*before);
            let to = *after - age + SCRAPE_INTERVAL;
            let first = samples[i].iter().rposition(|s| s.at <= from);
            let last = samples[i].iter().position(|s| s.at >= to);
            let (Some(first), Some(last)) = (first, last) else {
                bail!(
                    "no sighting of {} before and after its scrape",
                    backend_name(i)
                );
            };
            let seen = &samples[i][first..=last];
            let range = |f: &dyn Fn(&Sample) -> f64| {
                let values = seen.iter().map(f);
                (
                    values.clone().fold(f64::INFINITY, f64::min),
                    values.fold(f64::NEG_INFINITY, f64::max),
                )
            };
            let running = range(&|s| s.running as f64);
            let waiting = range(&|s| s.waiting as f64);
            let kv = range(&|s| s.kv);
            let within = |v: Option<f64>, (lo, hi): (f64, f64)| {
                v.is_some_and(|v| v >= lo - 1e-9 && v <= hi + 1e-9)
            };
            let kv_ok = if DIALECTS[i] == "llamacpp" {
                row.kv_mem.is_none()
            } else {
                within(row.kv_mem, kv)
            };
            let ok = age <= freshness
                && within(row.running, running)
                && within(row.waiting, waiting)
                && kv_ok
                && row.dialect.as_deref() == Some(DIALECTS[i]);
            let line = format!(
                "show {n}, {} ({}): show running {:?} waiting {:?} kv {:?} age {} ms | \
                 simulator running {}..{} waiting {}..{} kv {:.5}..{:.5} ({} sightings)",
                backend_name(i),
                row.dialect.as_deref().unwrap_or("-"),
                row.running,
                row.waiting,
                row.kv_mem,
                age.as_millis(),
                running.0,
                running.1,
                waiting.0,
                waiting.1,
                kv.0,
                kv.1,
                seen.len()
            );
            if n == SHOWS - 1 || !ok {
                println!("{line}");
            }
            if !ok {
                mismatches.push(line);
            }
        }
    }
    drop(streams);
    ensure!(
        mismatches.is_empty(),
        "show disagrees with the simulators:\n{}",
        mismatches.join("\n")
    );
    println!(
        "{SHOWS} shows x {BACKENDS} servers agree with the simulators (scrapes at most {:.0} ms \
         old)",
        ms(freshness)
    );
    Ok(())
}

/// After a reload that spaces health checks a minute apart, waits until the round that was
/// already scheduled has gone by: b1 then sees no check for longer than an old interval and
/// a check's timeout.
fn wait_checks_paused(bed: &Bed) -> Result<()> {
    let quiet_for = HEALTH_INTERVAL + HEALTH_TIMEOUT + Duration::from_millis(200);
    let deadline = Instant::now() + SETTLE;
    let mut last = bed.sims.state(0)?.requests_received;
    let mut since = Instant::now();
    while since.elapsed() < quiet_for {
        ensure!(Instant::now() < deadline, "health checks did not pause");
        sleep(Duration::from_millis(50));
        let now = bed.sims.state(0)?.requests_received;
        if now != last {
            (last, since) = (now, Instant::now());
        }
    }
    Ok(())
}

/// A reload that adds an interface another XDP program holds, and drops b1's weight to 0:
/// the attach fails, saying why, and nothing of the file is applied (b1 keeps its weight),
/// nor left behind (the program is not on the new interface it could take, and still on the
/// gateway's two).
fn refused_whole_when_an_interface_is_taken(bed: &mut Bed) -> Result<()> {
    let gw = bed.topology.gw();
    gw.ip(&["link", "add", "gx", "type", "veth", "peer", "name", "gy"])?;
    // Deleted whatever happens, or the next case's `link add` fails and hides this failure.
    let result = taken_interface_reload(bed);
    bed.topology.gw().ip(&["link", "del", "gx"])?;
    result
}

fn taken_interface_reload(bed: &mut Bed) -> Result<()> {
    let gw = bed.topology.gw();
    gw.ip(&["link", "set", "gx", "up"])?;
    gw.ip(&["link", "set", "gy", "up"])?;
    let mut holder = gw.command(XDP_PASS);
    holder.arg("gx");
    let log = bed.topology.dir().join("gx-xdp-pass.log");
    let mut holder = balancer_tests::process::Process::spawn("xdp-pass on gx", holder, &log)?;
    holder.wait_for_line(0, Duration::from_secs(10), |line| line.trim() == "attached")?;
    let before = bed.show()?;
    let mut taken = bed.config.clone();
    taken
        .agent
        .interfaces
        .extend(["gy".to_owned(), "gx".to_owned()]);
    taken.set_weight(0, 0);
    let line = bed.agent.reload_text(&taken.to_toml()?)?;
    println!("  a reload onto a taken interface: {line}");
    let after = bed.show()?;
    let attached = bed.topology.gateway_xdp()?;
    // Attached first (the list's order), then left when gx failed.
    let on_gy = gw.ip(&["-d", "link", "show", "dev", "gy"])?.contains("xdp");
    holder.stop(Duration::from_secs(5))?;
    ensure!(
        line.contains("reload failed, keeping the running configuration")
            && line.contains("gx has an XDP program already"),
        "a reload onto a taken interface: {line}"
    );
    ensure!(
        shape(&after) == shape(&before),
        "the failed reload was applied: {:?} -> {:?}",
        shape(&before),
        shape(&after)
    );
    ensure!(
        attached.len() == 2 && !on_gy,
        "the failed reload left the program on {attached:?}, or on gy ({on_gy})"
    );
    Ok(())
}

/// An interface of the configuration deleted and created again under its name (a veth set
/// up again, a bond rebuilt) gets the program back without a reload: the kernel took it off
/// with the old one.
fn an_interface_created_again_gets_the_program_back(bed: &mut Bed) -> Result<()> {
    let gw = bed.topology.gw();
    let pair = ["link", "add", "gx", "type", "veth", "peer", "name", "gy"];
    gw.ip(&pair)?;
    gw.ip(&["link", "set", "gx", "up"])?;
    let mut with_gx = bed.config.clone();
    with_gx.agent.interfaces.push("gx".to_owned());
    bed.agent.reload(&with_gx)?;
    let on = |dev: &str| -> Result<bool> {
        Ok(gw.ip(&["-d", "link", "show", "dev", dev])?.contains("xdp"))
    };
    let result = (|| {
        ensure!(on("gx")?, "a reload adding gx did not attach to it");
        let mark = bed.agent.log().len() as u64;
        gw.ip(&["link", "del", "gx"])?;
        // Gone until the agent has looked: it waits for the interface's return.
        bed.agent
            .wait_for_log(mark, Duration::from_secs(10), |line| {
                line.contains("the interface is gone")
            })
            .context("gx deleted")?;
        gw.ip(&pair)?;
        gw.ip(&["link", "set", "gx", "up"])?;
        let start = Instant::now();
        while !on("gx")? {
            ensure!(
                start.elapsed() < Duration::from_secs(10),
                "gx created again has no program after 10 s: {}",
                bed.log_since(mark)
            );
            std::thread::sleep(POLL);
        }
        println!(
            "  gx deleted and created again: attached again in {:?}",
            start.elapsed()
        );
        let log = bed.log_since(mark);
        ensure!(
            log.contains("the interface is gone")
                && log.contains("the interface was created again"),
            "the agent did not say what happened to gx: {log}"
        );
        // Renamed and replaced: the program follows the name and leaves the renamed one.
        gw.ip(&["link", "set", "gx", "down"])?;
        gw.ip(&["link", "set", "gx", "name", "gz"])?;
        gw.ip(&["link", "add", "gx", "type", "veth", "peer", "name", "gw"])?;
        gw.ip(&["link", "set", "gx", "up"])?;
        let start = Instant::now();
        while !on("gx")? || on("gz")? {
            ensure!(
                start.elapsed() < Duration::from_secs(10),
                "after gx was renamed gz and replaced: on gx {}, on gz {}: {}",
                on("gx")?,
                on("gz")?,
                bed.log_since(mark)
            );
            std::thread::sleep(POLL);
        }
        println!(
            "  gx renamed and replaced: on the new gx, off the old one in {:?}",
            start.elapsed()
        );
        let attached = bed.topology.gateway_xdp()?;
        ensure!(
            attached.len() == 2,
            "the gateway's interfaces: {attached:?}"
        );
        Ok(())
    })();
    let config = bed.config.clone();
    let back = bed.agent.reload(&config);
    for dev in ["gx", "gz"] {
        // Deleting one end of a pair deletes both; either may be gone already.
        gw.ip(&["link", "del", dev]).ok();
    }
    result.and(back)
}

/// (server, state, whether it takes connections): what a configuration decides.
fn shape(pool: &PoolView) -> Vec<(String, String, bool)> {
    pool.servers
        .iter()
        .map(|s| (s.server.clone(), s.state.clone(), s.weight > 0))
        .collect()
}

/// Scenario 6. A table of configurations, each with one key of a wrong type or value, sent
/// with SIGHUP or `balancer-agent reload` in turn: each must be refused with a `reload
/// failed` line naming that key (in the log, or from the CLI, which fails), and leave the
/// pool as it was, still balancing over all four. A reload of a key only a restart changes
/// goes through with a warning that says so. Then bad metrics from b1 (garbage,
/// NaN, a negative count, a 10 MB body): each must show as b1's `scrape_error` with a clear
/// reason, and change nothing else: b1 keeps its last good reading, stays UP and weighted,
/// the others are untouched.
fn bad_configs_and_bad_metrics(bed: &mut Bed) -> Result<()> {
    use toml::Value as T;
    let good = toml::Value::try_from(&bed.config).context("the base config as TOML")?;
    let s = |v: &str| T::String(v.into());
    // (table, key, bad value); `table` is `agent`, `pool` or `server` (the first of each).
    let cases: Vec<(&str, &str, T)> = vec![
        ("agent", "scrape_interval_ms", s("fast")),
        ("agent", "scrape_interval_ms", T::Integer(50)),
        ("agent", "scrape_timeout_ms", T::Integer(5000)),
        ("agent", "health_interval_ms", T::Integer(-5)),
        ("agent", "health_timeout_ms", T::Integer(0)),
        ("agent", "fall", T::Integer(0)),
        ("agent", "rise", s("2")),
        ("agent", "scrape_intervall_ms", T::Integer(500)),
        ("pool", "spill_waiting", T::Integer(0)),
        ("pool", "spill_ttft_ms", T::Float(0.5)),
        ("pool", "kv_high", T::Float(1.5)),
        ("pool", "kv_high", s("high")),
        ("pool", "dialect", s("openai")),
        ("pool", "model", s("")),
        ("server", "weight", T::Integer(-1)),
        ("server", "port", T::Integer(70000)),
        ("server", "address", s("10.4.0")),
    ];
    let before = bed.show()?;
    let ports = bed.ports(200)?;
    let counts_before = bed.spread(ports)?;
    println!(
        "{} bad configurations, sent with SIGHUP and `reload` in turn (before: {:?}, 200 new connections {counts_before:?}):",
        cases.len(),
        shape(&before)
            .iter()
            .map(|(server, state, _)| format!("{server} {state}"))
            .collect::<Vec<_>>()
    );
    let mut wrong = Vec::new();
    for (k, (table, key, value)) in cases.iter().enumerate() {
        let mut bad = good.clone();
        let target = match *table {
            "agent" => bad.get_mut("agent"),
            "pool" => bad.get_mut("pool").and_then(|p| p.get_mut(0)),
            _ => bad
                .get_mut("pool")
                .and_then(|p| p.get_mut(0))
                .and_then(|p| p.get_mut("server"))
                .and_then(|s| s.get_mut(0)),
        };
        let target = target
            .and_then(T::as_table_mut)
            .with_context(|| format!("no [{table}] in the base config"))?;
        target.insert((*key).to_owned(), value.clone());
        let text = toml::to_string(&bad)?;
        let (channel, line) = if k % 2 == 0 {
            ("SIGHUP", bed.agent.reload_text(&text)?)
        } else {
            match bed.agent.reload_cli(&text)? {
                (false, said) => ("reload", said),
                (true, said) => ("reload", format!("the CLI succeeded: {said}")),
            }
        };
        let message = line
            .split_once("reload failed, keeping the running configuration: ")
            .map(|(_, message)| message);
        // The message names the key as `key` or `section.key`, e.g. `pool[0].kv_high`.
        let named = message
            .and_then(|m| m.split('`').nth(1))
            .is_some_and(|k| k == *key || k.ends_with(&format!(".{key}")));
        println!(
            "  {key} = {value} ({channel}): {}",
            message
                .unwrap_or(&format!("NOT REFUSED: {line}"))
                .trim_end()
        );
        let after = bed.show()?;
        if message.is_none() || !named || shape(&after) != shape(&before) {
            wrong.push(format!(
                "{key} = {value} ({channel}): {line}\n  pool after: {:?}",
                shape(&after)
            ));
        }
    }
    let mut moved = bed.config.clone();
    moved.agent.metrics_listen = Some(SocketAddr::new(METRICS_LISTEN.ip(), 9478));
    let (ok, said) = bed.agent.reload_cli(&moved.to_toml()?)?;
    println!("  a reload that moves metrics_listen: {}", said.trim_end());
    let warned = "warning: agent.metrics_listen changes only when the agent restarts";
    ensure!(
        ok && said.contains(warned) && said.contains("reloaded: "),
        "`reload` of a restart-only key: {said}"
    );
    bed.agent.reload(&bed.config)?;
    refused_whole_when_an_interface_is_taken(bed)?;
    an_interface_created_again_gets_the_program_back(bed)?;
    let ports = bed.ports(200)?;
    let counts = bed.spread(ports)?;
    println!("after them, 200 new connections: {counts:?}");
    ensure!(
        wrong.is_empty(),
        "bad configurations not refused cleanly:\n{}",
        wrong.join("\n")
    );
    ensure!(
        (0..BACKENDS).all(|i| count(&counts, i) > 0),
        "not every server takes connections after the bad reloads: {counts:?}"
    );

    const VICTIM: usize = 0;
    let name = backend_name(VICTIM);
    let metrics = bed.sims.metrics(VICTIM).to_string();
    for (kind, reason) in [
        ("garbage_metrics", "not Prometheus text"),
        (
            "metrics_nan",
            "vllm:num_requests_running = NaN: not a number",
        ),
        (
            "metrics_negative",
            "vllm:num_requests_waiting = -1: negative",
        ),
        ("metrics_huge", "metrics body larger than"),
    ] {
        let good_row = row(&bed.show()?, VICTIM)?.clone();
        let mark = bed.agent.log_len();
        let faulted = Instant::now();
        bed.sims.fault(VICTIM, &json!({ "kind": kind }))?;
        let (_, seen_at) = bed.wait_show(
            &format!("{name}'s scrape error for {kind}"),
            SCRAPE_INTERVAL * 4,
            |pool| Ok(row(pool, VICTIM)?.scrape_error.is_some()),
        )?;
        // Then one more scrape interval, so that at least two bad answers came in.
        let (pool, shown_at) = bed.wait_show(
            &format!("{name}'s scrape error for {kind}, a scrape interval on"),
            SCRAPE_INTERVAL * 4,
            |pool| {
                let row = row(pool, VICTIM)?;
                Ok(row.scrape_error.is_none()
                    || row
                        .metrics_age_ms
                        .is_some_and(|age| age >= millis(SCRAPE_INTERVAL) + 100))
            },
        )?;
        let victim = row(&pool, VICTIM)?;
        let error = victim.scrape_error.clone().unwrap_or_default();
        let age = Duration::from_millis(victim.metrics_age_ms.unwrap_or(0));
        let logged = bed
            .log_since(mark)
            .contains(&format!("scrape failed: {error}"));
        println!(
            "  {kind}: after {:.0} ms: {error:?}; {name} keeps running {:?} waiting {:?} kv \
             {:?} (scraped {} ms ago), {} weight {}; logged: {logged}",
            ms(seen_at - faulted),
            victim.running,
            victim.waiting,
            victim.kv_mem,
            age.as_millis(),
            victim.state,
            victim.weight
        );
        ensure!(
            error.contains(reason) && error.contains(&metrics),
            "{kind}: the scrape error does not say {reason:?} about {metrics}: {error:?}"
        );
        ensure!(logged, "{kind}: the agent did not log the failed scrape");
        // Nothing of the bad answers was taken: the reading is older than the fault (less
        // the time show took: a bad answer's reading would be younger than a scrape
        // interval, the fault two back), and it still steers.
        ensure!(
            age + Duration::from_millis(250) >= shown_at.saturating_duration_since(faulted)
                && victim.waiting == Some(0.0)
                && victim.running.is_some_and(|r| r.is_finite() && r >= 0.0)
                && victim.kv_mem.is_some_and(|kv| (0.0..=1.0).contains(&kv))
                && victim.state == "UP"
                && victim.weight > 0,
            "{kind} changed {name}'s picture: before {good_row:#?}\nafter {victim:#?}"
        );
        for i in (0..BACKENDS).filter(|&i| i != VICTIM) {
            let other = row(&pool, i)?;
            ensure!(
                other.scrape_error.is_none() && other.state == "UP" && other.weight > 0,
                "{kind} on {name} touched {}: {other:#?}",
                backend_name(i)
            );
        }
        let ports = bed.ports(60)?;
        let counts = bed.spread(ports)?;
        ensure!(
            count(&counts, VICTIM) > 0,
            "{name} took none of 60 new connections with {kind}: {counts:?}"
        );
        bed.sims.fault(VICTIM, &json!({"kind": "none"}))?;
        let cleared = Instant::now();
        let (_, back_at) = bed.wait_show(
            &format!("{name}'s scrapes after {kind} was cleared"),
            SCRAPE_INTERVAL * 4,
            |pool| Ok(row(pool, VICTIM)?.scrape_error.is_none()),
        )?;
        println!(
            "    60 new connections meanwhile: {counts:?}; scrapes good again {:.0} ms after \
             the fault was cleared",
            ms(back_at - cleared)
        );
    }
    Ok(())
}
