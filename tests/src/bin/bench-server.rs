//! A light, fast HTTP/1.1 backend for the benchmarks (issue 8): what a gateway benchmark
//! needs behind it, and enough of an inference server's surface for the agent to scrape and
//! health-check it, on as many addresses as it is given.
//!
//! - `GET /`: the server's name (`--name`), a few bytes; with `Connection: close` from the
//!   client the server closes first, so the client keeps no TIME_WAIT.
//! - `GET /bulk?bytes=N`: N bytes (default: until the client goes away) in 64 KiB chunks.
//! - `GET /metrics`: a fixed exposition, the text of `--metrics-file` (default: the plain
//!   dialect of an idle server).
//! - `GET /v1/models`, `POST /v1/completions`: a model and a one-token answer, for the
//!   agent's health checks.
//! - `GET /stats`: how many `/metrics` and `/v1/completions` requests this process has
//!   answered, on all its addresses (the agent-cost benchmark counts scrapes and health
//!   checks with it).
//!
//! The same routes over HTTPS on the `--tls-listen` addresses, with `--tls-cert` and
//! `--tls-key`.

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context};
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use balancer_tests::sim::tls;
use clap::Parser;
use futures_util::stream;
use serde::Deserialize;
use tokio::task::JoinSet;

const CHUNK: usize = 64 * 1024;
const IDLE_METRICS: &str = "# TYPE inference_requests_running gauge\n\
inference_requests_running 0\n\
# TYPE inference_requests_waiting gauge\n\
inference_requests_waiting 0\n";

#[derive(Parser)]
#[command(about = "Light HTTP/1.1 backend for the benchmarks")]
struct Args {
    /// Address and port to listen on; repeat for several.
    #[arg(long = "listen", required = true)]
    listen: Vec<SocketAddr>,
    /// Returned by `GET /` and in an `x-backend` header.
    #[arg(long, default_value = "bench")]
    name: String,
    /// File whose text `GET /metrics` serves.
    #[arg(long)]
    metrics_file: Option<PathBuf>,
    /// Address and port to serve HTTPS on; repeat for several.
    #[arg(long = "tls-listen", requires = "tls_cert")]
    tls_listen: Vec<SocketAddr>,
    /// The HTTPS listeners' certificate (PEM).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

struct App {
    name: String,
    metrics: Bytes,
    chunk: Bytes,
    scrapes: AtomicU64,
    completions: AtomicU64,
}

#[derive(Deserialize)]
struct BulkQuery {
    bytes: Option<u64>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let metrics = match &args.metrics_file {
        Some(path) => {
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
        }
        None => IDLE_METRICS.to_owned(),
    };
    let backend = HeaderValue::from_str(&args.name).context("--name must be a header value")?;
    let app = Arc::new(App {
        name: format!("{}\n", args.name),
        metrics: Bytes::from(metrics),
        chunk: Bytes::from(vec![b'x'; CHUNK]),
        scrapes: AtomicU64::new(0),
        completions: AtomicU64::new(0),
    });
    let router = Router::new()
        .route("/", get(identity))
        .route("/bulk", get(bulk))
        .route("/metrics", get(metrics_text))
        .route("/health", get(|| async { "ok\n" }))
        .route("/stats", get(stats))
        .route("/v1/models", get(models))
        .route(
            "/v1/completions",
            post(|State(app): State<Arc<App>>| async move {
                app.completions.fetch_add(1, Ordering::Relaxed);
                completion()
            }),
        )
        .with_state(app)
        .layer(axum::middleware::map_response(
            move |mut response: Response| {
                let backend = backend.clone();
                async move {
                    response.headers_mut().insert("x-backend", backend);
                    response
                }
            },
        ));
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(Arc::new(
            tls::server_config(cert, key, None).context("--tls-cert")?,
        )),
        _ => None,
    };
    let mut listeners = Vec::new();
    let plain = args.listen.iter().map(|a| (a, None));
    for (addr, tls) in plain.chain(args.tls_listen.iter().map(|a| (a, tls.clone()))) {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        listeners.push((listener, tls));
    }
    eprintln!("listening on {} addresses", listeners.len());
    let mut servers = JoinSet::new();
    for (listener, tls) in listeners {
        match tls {
            Some(config) => servers.spawn(tls::serve(listener, router.clone(), config)),
            None => servers.spawn(axum::serve(listener, router.clone()).into_future()),
        };
    }
    if let Some(result) = servers.join_next().await {
        result?.context("serving")?;
    }
    bail!("a listener stopped")
}

async fn identity(State(app): State<Arc<App>>) -> String {
    app.name.clone()
}

async fn stats(State(app): State<Arc<App>>) -> String {
    format!(
        "{{\"metrics_requests\":{},\"completions\":{}}}\n",
        app.scrapes.load(Ordering::Relaxed),
        app.completions.load(Ordering::Relaxed)
    )
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    app.scrapes.fetch_add(1, Ordering::Relaxed);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.clone(),
    )
        .into_response()
}

async fn bulk(State(app): State<Arc<App>>, Query(query): Query<BulkQuery>) -> Response {
    let total = query.bytes.unwrap_or(u64::MAX);
    let chunk = app.chunk.clone();
    let body = stream::unfold(0u64, move |sent| {
        let chunk = chunk.clone();
        async move {
            if sent >= total {
                return None;
            }
            let n = usize::try_from((total - sent).min(CHUNK as u64)).expect("at most a chunk");
            Some((
                Ok::<_, std::convert::Infallible>(chunk.slice(..n)),
                sent + n as u64,
            ))
        }
    });
    let mut response = Body::from_stream(body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    response
}

async fn models() -> Response {
    json(r#"{"object":"list","data":[{"id":"bench-model","object":"model","owned_by":"bench"}]}"#)
}

fn completion() -> Response {
    json(
        r#"{"id":"cmpl-bench","object":"text_completion","model":"bench-model","choices":[{"index":0,"text":"ok","finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#,
    )
}

fn json(body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}
