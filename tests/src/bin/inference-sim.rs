//! inference-sim: an inference server without a model, for tests, the demo and benchmarks.
//! See `balancer_tests::sim` for the model it simulates.

use std::collections::BTreeSet;
use std::future::IntoFuture;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use axum::http::HeaderValue;
use balancer_tests::sim::api::{api_router, metrics_router, App};
use balancer_tests::sim::engine::{Config, Engine, Sim};
use balancer_tests::sim::faults::Fault;
use balancer_tests::sim::metrics::Dialect;
use balancer_tests::sim::tls;
use clap::Parser;
use tokio::task::JoinSet;

#[derive(Parser)]
#[command(
    about = "Simulated LLM inference server: OpenAI API, continuous batching, KV and prefix \
             cache, real servers' metrics",
    long_about = "Simulated LLM inference server: the OpenAI completions and chat API with \
                  streaming, a continuous-batching engine with a paged KV cache and a prefix \
                  cache, and the metrics of a real server (vLLM, SGLang, TGI, llama.cpp, \
                  TensorRT-LLM, or plain).\n\nA prompt token is a whitespace-separated word. \
                  The answer is drawn from a small vocabulary, determined by the prompt and \
                  --seed.\n\nFaults (--fault, or POST /admin/fault on the metrics port with \
                  {\"kind\": KIND, ...}): hang_before_first_token, \
                  stall_mid_stream[:after_tokens=N], status_500, status_503, \
                  close_mid_stream[:after_tokens=N], slow_metrics[:delay_ms=N], \
                  garbage_metrics, metrics_nan, metrics_negative, metrics_huge[:bytes=N], \
                  exit[:after_ms=N,code=N], none."
)]
struct Args {
    /// API address and port; repeat for several (e.g. an IPv4 and an IPv6 one).
    #[arg(long = "listen", default_value = "127.0.0.1:8000")]
    listen: Vec<SocketAddr>,
    /// Port of /metrics and /admin, on every address of --listen (0: any free port).
    #[arg(long, default_value_t = 8001)]
    metrics_port: u16,
    /// Whose metrics to publish.
    #[arg(long, value_enum, default_value_t = Dialect::Vllm)]
    dialect: Dialect,
    /// The served model name.
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// This server's name, sent in an `x-backend` header on every API response.
    #[arg(long)]
    name: Option<String>,
    /// Most sequences in a batch (vLLM --max-num-seqs, llama.cpp -np).
    #[arg(long, default_value_t = Config::default().max_running)]
    max_running: usize,
    /// KV cache capacity in tokens (blocks of 16); prompt + max_tokens beyond it is refused.
    #[arg(long, default_value_t = Config::default().kv_tokens)]
    kv_tokens: usize,
    /// Prefill speed, uncached prompt tokens per second.
    #[arg(long, default_value_t = Config::default().prefill_tokens_per_s)]
    prefill_tokens_per_s: f64,
    /// Decode step time of an empty batch, milliseconds.
    #[arg(long, default_value_t = Config::default().decode_step.as_secs_f64() * 1e3)]
    decode_step_ms: f64,
    /// What each running sequence adds to a decode step, milliseconds.
    #[arg(long, default_value_t = Config::default().decode_step_per_seq.as_secs_f64() * 1e3)]
    decode_step_per_seq_ms: f64,
    /// Speed-up of simulated time: 10 runs ten times faster.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Seed of the generated text.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The `/v1` routes answer 401 without `Authorization: Bearer KEY` (vLLM's --api-key).
    #[arg(long)]
    api_key: Option<String>,
    /// Serve the API (and the /metrics it serves) over HTTPS with this certificate (PEM), as
    /// vLLM's --ssl-certfile; the admin port stays plain HTTP.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM), as vLLM's --ssl-keyfile.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (PEM), as vLLM's --ssl-ca-certs with
    /// --ssl-cert-reqs 2.
    #[arg(long, requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// A fault in force from the start: KIND[:KEY=VALUE,...]; repeat for several.
    #[arg(long = "fault", value_parser = Fault::parse_cli)]
    faults: Vec<Fault>,
}

fn millis(ms: f64, what: &str) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(ms / 1e3).with_context(|| format!("--{what}: bad duration {ms}"))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = Config {
        max_running: args.max_running,
        kv_tokens: args.kv_tokens,
        prefill_tokens_per_s: args.prefill_tokens_per_s,
        decode_step: millis(args.decode_step_ms, "decode-step-ms")?,
        decode_step_per_seq: millis(args.decode_step_per_seq_ms, "decode-step-per-seq-ms")?,
        time_scale: args.time_scale,
        seed: args.seed,
    };
    let engine = Engine::new(config, args.dialect.buckets()).map_err(anyhow::Error::msg)?;
    let name = args
        .name
        .map(|name| HeaderValue::try_from(name).context("--name: not a valid header value"))
        .transpose()?;
    let app = App::new(
        Sim::start(engine),
        args.dialect,
        args.model,
        name,
        args.api_key,
    );
    for fault in args.faults {
        app.apply(fault);
    }

    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(Arc::new(
            tls::server_config(cert, key, args.tls_client_ca.as_deref()).context("--tls-cert")?,
        )),
        _ => None,
    };
    if tls.is_some() {
        eprintln!("the API over HTTPS");
    }
    let mut servers = JoinSet::new();
    let mut api = Vec::new();
    for addr in &args.listen {
        api.push(bind(*addr).await?);
    }
    let ips: BTreeSet<IpAddr> = args.listen.iter().map(SocketAddr::ip).collect();
    let mut metrics = Vec::new();
    for ip in ips {
        metrics.push(bind(SocketAddr::new(ip, args.metrics_port)).await?);
    }
    for (listeners, router, role, tls) in [
        (api, api_router(app.clone()), "api", tls),
        (metrics, metrics_router(app.clone()), "metrics", None),
    ] {
        for listener in listeners {
            // The line `SimServer::spawn` reads the address from.
            eprintln!("listening on {} ({role})", listener.local_addr()?);
            match &tls {
                Some(config) => servers.spawn(tls::serve(listener, router.clone(), config.clone())),
                None => servers.spawn(axum::serve(listener, router.clone()).into_future()),
            };
        }
    }
    eprintln!("ready");
    // axum::serve only returns on a listener failure; one dead listener is a dead server.
    match servers.join_next().await {
        Some(result) => result?.context("serving")?,
        None => unreachable!("at least one listener is required"),
    }
    bail!("a listener stopped")
}

async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))
}
