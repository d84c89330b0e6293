//! A backend for the end-to-end tests: answers who it is, and streams server-sent events the
//! way an inference server streams tokens, so that a test can see a long-lived flow survive
//! changes on the balancer.

use std::convert::Infallible;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use axum::extract::{Query, State};
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use clap::Parser;
use futures_util::stream;
use serde::{Deserialize, Serialize};
use tokio::task::JoinSet;
use tokio::time::{sleep_until, Instant};

const MAX_EVENTS: u32 = 100_000;
const MAX_INTERVAL_MS: u64 = 60_000;
const MAX_BYTES: usize = 16 << 20;

#[derive(Parser)]
#[command(about = "HTTP/1.1 backend that streams server-sent events")]
struct Args {
    /// Address and port to listen on; repeat for several (e.g. an IPv4 and an IPv6 one).
    #[arg(long = "listen", required = true)]
    listen: Vec<SocketAddr>,
    /// Backend identity, returned by `GET /` and carried in every event.
    #[arg(long)]
    name: String,
}

#[derive(Deserialize)]
struct StreamQuery {
    events: u32,
    interval_ms: u64,
}

#[derive(Deserialize)]
struct BytesQuery {
    n: usize,
}

#[derive(Serialize)]
struct Token<'a> {
    backend: &'a str,
    seq: u32,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let name = Arc::<str>::from(args.name);
    let backend = HeaderValue::from_str(&name).context("--name must be a valid header value")?;
    let app = Router::new()
        .route("/", get(identity))
        .route("/stream", get(events))
        .route("/length", post(length))
        .route("/bytes", get(bytes))
        .with_state(name)
        .layer(axum::middleware::map_response(
            move |mut response: Response| {
                let backend = backend.clone();
                async move {
                    response
                        .headers_mut()
                        .insert(HeaderName::from_static("x-backend"), backend);
                    response
                }
            },
        ));

    let mut listeners = Vec::new();
    for addr in &args.listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        listeners.push(listener);
    }
    let mut servers = JoinSet::new();
    for listener in listeners {
        eprintln!("listening on {}", listener.local_addr()?);
        servers.spawn(axum::serve(listener, app.clone()).into_future());
    }
    // axum::serve only returns on a listener failure; one dead listener is a dead backend.
    match servers.join_next().await {
        Some(result) => result?.context("serving")?,
        None => unreachable!("at least one listener is required"),
    }
    bail!("a listener stopped")
}

async fn identity(State(name): State<Arc<str>>) -> String {
    format!("{name}\n")
}

/// How many bytes the request's body had: an upload through the balancer arrived whole.
async fn length(body: axum::body::Bytes) -> String {
    format!("{}\n", body.len())
}

/// `n` bytes: a download of full-size segments.
async fn bytes(Query(query): Query<BytesQuery>) -> Result<String, (StatusCode, String)> {
    if query.n > MAX_BYTES {
        return Err((
            StatusCode::BAD_REQUEST,
            format!("n must be <= {MAX_BYTES}\n"),
        ));
    }
    Ok("x".repeat(query.n))
}

async fn events(
    State(name): State<Arc<str>>,
    Query(query): Query<StreamQuery>,
) -> Result<Response, (StatusCode, String)> {
    if query.events > MAX_EVENTS || query.interval_ms > MAX_INTERVAL_MS {
        return Err((
            StatusCode::BAD_REQUEST,
            format!("events must be <= {MAX_EVENTS} and interval_ms <= {MAX_INTERVAL_MS}\n"),
        ));
    }
    let interval = Duration::from_millis(query.interval_ms);
    let start = Instant::now();
    // Deadlines from the start rather than sleeps between events, so the pace does not drift.
    let tokens = stream::unfold(0u32, move |seq| {
        let name = name.clone();
        async move {
            if seq > query.events {
                return None;
            }
            // [DONE] follows the last token at once, as an inference server's does.
            if seq < query.events {
                sleep_until(start + interval * seq).await;
            }
            let event = if seq == query.events {
                Event::default().data("[DONE]")
            } else {
                let token = Token {
                    backend: &name,
                    seq,
                };
                Event::default().data(serde_json::to_string(&token).expect("plain struct"))
            };
            Some((Ok::<_, Infallible>(event), seq + 1))
        }
    });
    let mut response = Sse::new(tokens).into_response();
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    Ok(response)
}
