//! The HTTP side: the OpenAI API that clients use, and the metrics port.
//!
//! API port: `POST /v1/completions`, `POST /v1/chat/completions` (OpenAI shapes; `stream`
//! gives server-sent events, one `data:` event per token, a final chunk with
//! `finish_reason`, then `data: [DONE]`), `GET /v1/models`, `GET /health`, and the
//! exposition where the real server puts it (`/metrics`; `/prometheus/metrics` for
//! TensorRT-LLM). Metrics port: the exposition at `/metrics` in every dialect and at the real
//! server's path too, `POST /admin/fault`, `GET /admin/state`.
//!
//! `temperature` is validated and otherwise ignored: the output is a function of the prompt
//! and the seed only.
//!
//! With a name (`--name`), every API response carries it in an `x-backend` header, so that a
//! test behind a load balancer can tell which server answered.
//!
//! With a key (`--api-key`), the `/v1` routes answer 401 to a request without
//! `Authorization: Bearer KEY`, as vLLM's, SGLang's and llama-server's `--api-key` do; the
//! exposition and `/health` stay open.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Request as HttpRequest, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::stream;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc::UnboundedReceiver;

use super::engine::{Event, FinishReason, Request, Sim, Usage};
use super::faults::{Fault, Faults};
use super::metrics::{padded, with_value, Dialect, Identity, State as EngineState};
use super::text::tokenize;

/// What every handler shares.
pub struct App {
    sim: Sim,
    dialect: Dialect,
    identity: Identity,
    /// The `x-backend` header of every API response.
    name: Option<HeaderValue>,
    /// `Bearer KEY`, which the `/v1` routes require when set.
    bearer: Option<String>,
    faults: Mutex<Faults>,
    next_id: AtomicU64,
}

impl App {
    pub fn new(
        sim: Sim,
        dialect: Dialect,
        model: String,
        name: Option<HeaderValue>,
        api_key: Option<String>,
    ) -> Arc<Self> {
        Arc::new(Self {
            bearer: api_key.map(|k| format!("Bearer {k}")),
            sim,
            dialect,
            identity: Identity {
                model,
                pid: std::process::id(),
            },
            name,
            faults: Mutex::new(Faults::default()),
            next_id: AtomicU64::new(1),
        })
    }

    fn faults(&self) -> MutexGuard<'_, Faults> {
        self.faults
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Puts `fault` in force (or, for `exit`, schedules the exit).
    pub fn apply(&self, fault: Fault) {
        if let Fault::Exit { after_ms, code } = fault {
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(after_ms)).await;
                eprintln!("exiting with status {code}: injected fault");
                std::process::exit(code);
            });
            return;
        }
        let freeze = {
            let mut faults = self.faults();
            faults.apply(fault);
            faults.freeze()
        };
        self.sim.engine().set_freeze(freeze);
        self.sim.wake();
    }
}

pub fn api_router(app: Arc<App>) -> Router {
    let metrics_path = app.dialect.metrics_path();
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .layer(middleware::from_fn_with_state(app.clone(), authorized))
        .route("/health", get(health))
        .layer(middleware::from_fn_with_state(app.clone(), status_fault))
        // The exposition is outside the fault layer: status faults are the API's.
        .route(metrics_path, get(metrics))
        .fallback(not_found)
        // Last, so that it covers every route, the fallback and the status faults.
        .layer(middleware::map_response_with_state(
            app.clone(),
            name_header,
        ))
        .with_state(app)
}

/// With `--api-key`, the `/v1` routes only for the key's bearer.
async fn authorized(State(app): State<Arc<App>>, request: HttpRequest, next: Next) -> Response {
    let given = request.headers().get(header::AUTHORIZATION);
    match &app.bearer {
        Some(bearer) if given.is_none_or(|g| g.as_bytes() != bearer.as_bytes()) => error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "a valid API key is required (Authorization: Bearer)",
        ),
        _ => next.run(request).await,
    }
}

async fn name_header(State(app): State<Arc<App>>, mut response: Response) -> Response {
    if let Some(name) = &app.name {
        response.headers_mut().insert("x-backend", name.clone());
    }
    response
}

pub fn metrics_router(app: Arc<App>) -> Router {
    let mut router = Router::new().route("/metrics", get(metrics));
    // A scraper that knows the dialect may ask at the real server's path.
    if app.dialect.metrics_path() != "/metrics" {
        router = router.route(app.dialect.metrics_path(), get(metrics));
    }
    router
        .route("/admin/fault", post(set_fault))
        .route("/admin/state", get(state))
        .fallback(not_found)
        .with_state(app)
}

/// An OpenAI-style error.
fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = json!({
        "error": {
            "message": message.into(),
            "type": kind,
            "param": null,
            "code": status.as_u16(),
        }
    });
    json_response(status, &body)
}

fn bad_request(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

fn json_response(status: StatusCode, body: &serde_json::Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn not_found() -> Response {
    error(StatusCode::NOT_FOUND, "not_found_error", "no such route")
}

async fn status_fault(State(app): State<Arc<App>>, request: HttpRequest, next: Next) -> Response {
    let fault = app.faults().request;
    match fault {
        Some(Fault::Status500) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal server error (injected fault status_500)",
        ),
        Some(Fault::Status503) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "service unavailable (injected fault status_503)",
        ),
        _ => next.run(request).await,
    }
}

async fn health() -> Response {
    json_response(StatusCode::OK, &json!({"status": "ok"}))
}

async fn models(State(app): State<Arc<App>>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": [{
                "id": app.identity.model,
                "object": "model",
                "created": unix_now(),
                "owned_by": "inference-sim",
                "max_model_len": app.sim.engine().config().kv_capacity(),
            }],
        }),
    )
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let fault = app.faults().metrics;
    match fault {
        Some(Fault::SlowMetrics { delay_ms }) => {
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        }
        Some(Fault::GarbageMetrics) => {
            return (
                [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                GARBAGE,
            )
                .into_response();
        }
        _ => {}
    }
    let text = {
        let mut engine = app.sim.engine();
        app.dialect.render(&mut engine, &app.identity)
    };
    let (running, waiting) = app.dialect.load_metrics();
    let text = match fault {
        Some(Fault::MetricsNan) => with_value(&text, running, "NaN"),
        Some(Fault::MetricsNegative) => with_value(&text, waiting, "-1"),
        Some(Fault::MetricsHuge { bytes }) => {
            padded(text, usize::try_from(bytes).unwrap_or(usize::MAX))
        }
        _ => text,
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// What a broken exporter might send: an HTML error page and a torn sample line.
const GARBAGE: &str = "<html><body><h1>502 Bad Gateway</h1></body></html>\n\
                       running{{=\"\n\u{1}\u{2}\u{3} 0x7f # TYPE\n";

async fn set_fault(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let fault: Fault = match serde_json::from_slice(&body) {
        Ok(fault) => fault,
        Err(e) => return bad_request(format!("invalid fault: {e}")),
    };
    app.apply(fault);
    let faults = *app.faults();
    json_response(StatusCode::OK, &json!({ "faults": faults }))
}

async fn state(State(app): State<Arc<App>>) -> Response {
    let state = EngineState::of(app.dialect, &app.sim.engine());
    let faults = *app.faults();
    let mut body = serde_json::to_value(state).expect("plain struct");
    body["faults"] = serde_json::to_value(faults).expect("plain struct");
    json_response(StatusCode::OK, &body)
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Content,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

/// Why a request body is refused (a 400).
struct Invalid(String);

impl Invalid {
    fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

/// A request body, read field by field so that an error names the field. Fields that
/// clients send and this server does not use are ignored.
struct Fields(serde_json::Map<String, serde_json::Value>);

impl Fields {
    fn parse(body: &[u8]) -> Result<Self, Invalid> {
        match serde_json::from_slice(body) {
            Ok(serde_json::Value::Object(map)) => Ok(Self(map)),
            Ok(_) => Err(Invalid::new("the request body must be a JSON object")),
            Err(e) => Err(Invalid::new(format!("invalid request body: {e}"))),
        }
    }

    fn get<T: for<'de> Deserialize<'de>>(&self, name: &str) -> Result<Option<T>, Invalid> {
        match self.0.get(name) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(value) => T::deserialize(value)
                .map(Some)
                .map_err(|e| Invalid::new(format!("invalid `{name}`: {e}"))),
        }
    }

    fn require<T: for<'de> Deserialize<'de>>(&self, name: &str) -> Result<T, Invalid> {
        self.get(name)?
            .ok_or_else(|| Invalid::new(format!("`{name}` is required")))
    }
}

/// The fields both endpoints share.
struct Common {
    model: Option<String>,
    max_tokens: Option<u32>,
    stream: bool,
    include_usage: bool,
    temperature: Option<f64>,
    ignore_eos: bool,
    n: Option<u32>,
}

impl Common {
    fn read(fields: &Fields) -> Result<Self, Invalid> {
        Ok(Self {
            model: fields.get("model")?,
            max_tokens: fields.get("max_tokens")?,
            stream: fields.get("stream")?.unwrap_or(false),
            include_usage: fields
                .get::<StreamOptions>("stream_options")?
                .is_some_and(|o| o.include_usage),
            temperature: fields.get("temperature")?,
            ignore_eos: fields.get("ignore_eos")?.unwrap_or(false),
            n: fields.get("n")?,
        })
    }
}

/// Which endpoint: they differ in the shape of their chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

async fn completions(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let read = || -> Result<(String, Common), Invalid> {
        let fields = Fields::parse(&body)?;
        let prompt = match fields.require("prompt")? {
            Prompt::One(text) => text,
            Prompt::Many(mut texts) if texts.len() == 1 => texts.remove(0),
            Prompt::Many(_) => {
                return Err(Invalid::new(
                    "this server takes exactly one prompt per request",
                ))
            }
        };
        Ok((prompt, Common::read(&fields)?))
    };
    let (prompt, common) = match read() {
        Ok(read) => read,
        Err(invalid) => return bad_request(invalid.0),
    };
    // OpenAI's default for the legacy completions endpoint.
    let max_tokens = common.max_tokens.unwrap_or(16);
    generate(app, Kind::Completion, &prompt, max_tokens, common).await
}

async fn chat_completions(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let read = || -> Result<(String, Option<u32>, Common), Invalid> {
        let fields = Fields::parse(&body)?;
        let messages: Vec<Message> = fields.require("messages")?;
        if messages.is_empty() {
            return Err(Invalid::new("`messages` must not be empty"));
        }
        // A chat template in its simplest form: `role: content` per message, one per line.
        let mut prompt = String::new();
        for message in &messages {
            prompt.push_str(&message.role);
            prompt.push_str(": ");
            match &message.content {
                Content::Text(text) => prompt.push_str(text),
                Content::Parts(parts) => {
                    for part in parts {
                        match (part.kind.as_str(), &part.text) {
                            ("text", Some(text)) => {
                                prompt.push_str(text);
                                prompt.push(' ');
                            }
                            _ => return Err(Invalid::new("only text content parts are supported")),
                        }
                    }
                }
            }
            prompt.push('\n');
        }
        let max_completion_tokens = fields.get("max_completion_tokens")?;
        Ok((prompt, max_completion_tokens, Common::read(&fields)?))
    };
    let (prompt, max_completion_tokens, common) = match read() {
        Ok(read) => read,
        Err(invalid) => return bad_request(invalid.0),
    };
    // vLLM's default: whatever the context leaves.
    let capacity = app.sim.engine().config().kv_capacity();
    let default = capacity.saturating_sub(tokenize(&prompt).len());
    let max_tokens = max_completion_tokens
        .or(common.max_tokens)
        .unwrap_or(u32::try_from(default).unwrap_or(u32::MAX));
    generate(app, Kind::Chat, &prompt, max_tokens, common).await
}

async fn generate(
    app: Arc<App>,
    kind: Kind,
    prompt: &str,
    max_tokens: u32,
    common: Common,
) -> Response {
    if let Some(model) = &common.model {
        if *model != app.identity.model {
            return error(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("The model `{model}` does not exist."),
            );
        }
    }
    if let Some(t) = common.temperature {
        if !(0.0..=2.0).contains(&t) {
            return bad_request(format!("temperature must be between 0 and 2, got {t}"));
        }
    }
    if common.n.is_some_and(|n| n != 1) {
        return bad_request("this server generates one choice per request (n = 1)");
    }
    let request = Request {
        prompt: tokenize(prompt),
        max_tokens,
        ignore_eos: common.ignore_eos,
    };
    let events = match app.sim.submit(request) {
        Ok(events) => events,
        Err(rejection) => return bad_request(rejection.0),
    };
    let close_after = match app.faults().request {
        Some(Fault::CloseMidStream { after_tokens }) => Some(after_tokens),
        _ => None,
    };
    let id = app.next_id.fetch_add(1, Ordering::Relaxed);
    let chunks = Chunks::new(kind, id, &app.identity.model);
    if common.stream {
        sse(events, chunks, common.include_usage, close_after)
    } else {
        whole(events, chunks, close_after).await
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The JSON of one request's stream, pre-rendered around the token text so that a token
/// costs a few string copies.
struct Chunks {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    token_prefix: String,
    token_suffix: &'static str,
}

impl Chunks {
    fn new(kind: Kind, id: u64, model: &str) -> Self {
        let (id, object) = match kind {
            Kind::Completion => (format!("cmpl-{id:016x}"), "text_completion"),
            Kind::Chat => (format!("chatcmpl-{id:016x}"), "chat.completion.chunk"),
        };
        let created = unix_now();
        let model_json = serde_json::to_string(model).expect("a string");
        let choice = match kind {
            Kind::Completion => r#"{"index":0,"text":""#,
            Kind::Chat => r#"{"index":0,"delta":{"content":""#,
        };
        let token_prefix = format!(
            r#"data: {{"id":"{id}","object":"{object}","created":{created},"model":{model_json},"choices":[{choice}"#
        );
        let token_suffix = match kind {
            Kind::Completion => "\",\"logprobs\":null,\"finish_reason\":null}]}\n\n",
            Kind::Chat => "\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n",
        };
        Self {
            kind,
            id,
            created,
            model: model.to_owned(),
            token_prefix,
            token_suffix,
        }
    }

    fn object(&self) -> &'static str {
        match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        }
    }

    fn chunk(&self, choices: serde_json::Value, usage: Option<serde_json::Value>) -> String {
        let mut chunk = json!({
            "id": self.id,
            "object": self.object(),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(usage) = usage {
            chunk["usage"] = usage;
        }
        format!("data: {chunk}\n\n")
    }

    /// Chat streams open with the assistant's role, as OpenAI's and vLLM's do.
    fn role(&self) -> String {
        self.chunk(
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
            None,
        )
    }

    fn token(&self, out: &mut String, word: &str) {
        out.push_str(&self.token_prefix);
        out.push(' ');
        out.push_str(word);
        out.push_str(self.token_suffix);
    }

    fn last(&self, reason: FinishReason) -> String {
        let choice = match self.kind {
            Kind::Completion => {
                json!({"index": 0, "text": "", "logprobs": null, "finish_reason": reason.as_str()})
            }
            Kind::Chat => {
                json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": reason.as_str()})
            }
        };
        self.chunk(json!([choice]), None)
    }

    fn usage(&self, usage: Usage) -> String {
        self.chunk(json!([]), Some(usage_json(usage)))
    }
}

fn usage_json(usage: Usage) -> serde_json::Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    })
}

/// How long an injected close waits, so that the tokens before it leave first.
const CLOSE_GRACE: Duration = Duration::from_millis(20);

struct Streaming {
    events: UnboundedReceiver<Event>,
    chunks: Chunks,
    include_usage: bool,
    close_after: Option<u32>,
    sent: u32,
    batch: Vec<Event>,
    closing: bool,
    done: bool,
}

fn sse(
    events: UnboundedReceiver<Event>,
    chunks: Chunks,
    include_usage: bool,
    close_after: Option<u32>,
) -> Response {
    let state = Streaming {
        events,
        chunks,
        include_usage,
        close_after,
        sent: 0,
        batch: Vec::new(),
        closing: false,
        done: false,
    };
    let body = stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        if st.closing {
            tokio::time::sleep(CLOSE_GRACE).await;
            return Some((Err(io::Error::other("injected fault close_mid_stream")), st));
        }
        // Whatever is pending goes out in one write: a slow reader costs fewer syscalls.
        if st.events.recv_many(&mut st.batch, 256).await == 0 {
            // The engine never drops a live sequence; only a shutdown gets here.
            return Some((Err(io::Error::other("engine stopped")), st));
        }
        let mut out = String::new();
        for event in st.batch.drain(..) {
            match event {
                Event::Token(word) => {
                    if st.close_after.is_some_and(|n| st.sent >= n) {
                        st.closing = true;
                        break;
                    }
                    if st.sent == 0 && st.chunks.kind == Kind::Chat {
                        out.push_str(&st.chunks.role());
                    }
                    st.chunks.token(&mut out, word);
                    st.sent += 1;
                }
                Event::Finished { reason, usage } => {
                    out.push_str(&st.chunks.last(reason));
                    if st.include_usage {
                        out.push_str(&st.chunks.usage(usage));
                    }
                    out.push_str("data: [DONE]\n\n");
                    st.done = true;
                }
            }
        }
        Some((Ok(Bytes::from(out)), st))
    });
    let mut response = Body::from_stream(body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// A response whose connection breaks after the head.
fn broken() -> Response {
    let body = stream::once(async {
        tokio::time::sleep(CLOSE_GRACE).await;
        Err::<Bytes, _>(io::Error::other("injected fault close_mid_stream"))
    });
    Body::from_stream(body).into_response()
}

async fn whole(
    mut events: UnboundedReceiver<Event>,
    chunks: Chunks,
    close_after: Option<u32>,
) -> Response {
    let mut text = String::new();
    let mut sent = 0;
    loop {
        match events.recv().await {
            Some(Event::Token(word)) => {
                if close_after.is_some_and(|n| sent >= n) {
                    return broken();
                }
                text.push(' ');
                text.push_str(word);
                sent += 1;
            }
            Some(Event::Finished { reason, usage }) => {
                let choice = match chunks.kind {
                    Kind::Completion => json!({
                        "index": 0, "text": text, "logprobs": null,
                        "finish_reason": reason.as_str(),
                    }),
                    Kind::Chat => json!({
                        "index": 0, "message": {"role": "assistant", "content": text},
                        "logprobs": null, "finish_reason": reason.as_str(),
                    }),
                };
                let object = match chunks.kind {
                    Kind::Completion => "text_completion",
                    Kind::Chat => "chat.completion",
                };
                let body = json!({
                    "id": chunks.id,
                    "object": object,
                    "created": chunks.created,
                    "model": chunks.model,
                    "choices": [choice],
                    "usage": usage_json(usage),
                });
                return json_response(StatusCode::OK, &body);
            }
            None => {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "engine stopped",
                )
            }
        }
    }
}
