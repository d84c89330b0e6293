//! inference-sim on loopback, through its public interface: the OpenAI API read as a client
//! reads it, the exposition of every dialect read with the agent's parser, and every fault
//! as a client sees it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use balancer_tests::sim::client::{self, chunk_text, is_timeout, Item, Stream};
use balancer_tests::sim::launch::SimServer;
use balancer_tests::sim::tls;
use prometheus_parse::{Scrape, Value as Sample};
use serde_json::{json, Value};

const SIM: &str = env!("CARGO_BIN_EXE_inference-sim");

fn start(dir: &tempfile::TempDir, name: &str, args: &[&str]) -> SimServer {
    SimServer::start(Path::new(SIM), &dir.path().join(name), args).unwrap()
}

/// `n` distinct words starting with `tag`: a prompt of `n` tokens.
fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn completion(prompt: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": true,
        "temperature": 0.7,
    })
}

fn error_message(reply: &client::Reply) -> String {
    let body = reply.json().unwrap();
    assert!(body["error"]["type"].is_string(), "{body}");
    body["error"]["message"].as_str().unwrap().to_owned()
}

/// Splits a stream into its chunks and whether it ended with `[DONE]`.
fn chunks(items: &[Item]) -> (Vec<&Value>, bool) {
    let data = items
        .iter()
        .filter_map(|item| match item {
            Item::Chunk { data, .. } => Some(data),
            Item::Done { .. } => None,
        })
        .collect();
    (data, matches!(items.last(), Some(Item::Done { .. })))
}

fn at(item: &Item) -> Instant {
    match item {
        Item::Chunk { at, .. } | Item::Done { at } => *at,
    }
}

#[test]
fn completions_stream_token_by_token_and_end_with_done() {
    let dir = tempfile::tempdir().unwrap();
    let sim = start(&dir, "log", &[]);
    let prompt = words("w", 30);
    let mut request = completion(&prompt, 80, true);
    request["model"] = json!("sim-model");
    let opened = Instant::now();
    let items = Stream::open(sim.api, "/v1/completions", &request)
        .unwrap()
        .collect()
        .unwrap();
    let (data, done) = chunks(&items);
    assert!(done, "no [DONE]");
    assert_eq!(data.len(), 81, "80 tokens and a final chunk");
    for chunk in &data[..80] {
        assert_eq!(chunk["object"], "text_completion");
        assert_eq!(chunk["model"], "sim-model");
        assert_eq!(chunk["choices"][0]["finish_reason"], Value::Null);
        assert!(chunk_text(chunk).unwrap().starts_with(' '), "{chunk}");
    }
    assert_eq!(data[80]["choices"][0]["finish_reason"], "length");
    // 80 decode steps of 15.25 ms: the first token comes after one step, the last after 80
    // (1.2 s); a buffering server would deliver them together.
    let first = at(&items[0]) - opened;
    let last = at(&items[79]) - opened;
    assert!(
        last > Duration::from_millis(1000) && first * 4 < last,
        "first {first:?}, last {last:?}"
    );

    // The same prompt without streaming: the same text, and the usage.
    let reply = client::post(sim.api, "/v1/completions", &completion(&prompt, 80, false)).unwrap();
    assert_eq!(reply.status(), 200, "{}", reply.body);
    let body = reply.json().unwrap();
    let streamed: String = data[..80].iter().map(|c| chunk_text(c).unwrap()).collect();
    assert_eq!(body["choices"][0]["text"], streamed.as_str());
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 30, "completion_tokens": 80, "total_tokens": 110,
               "prompt_tokens_details": {"cached_tokens": 16}})
    );
}

#[test]
fn chat_streams_deltas_with_the_role_first_and_usage_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let sim = start(&dir, "log", &["--time-scale", "5"]);
    let request = json!({
        "model": "sim-model",
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
        "max_completion_tokens": 5, "stream": true, "ignore_eos": true,
        "stream_options": {"include_usage": true},
    });
    let items = Stream::open(sim.api, "/v1/chat/completions", &request)
        .unwrap()
        .collect()
        .unwrap();
    let (data, done) = chunks(&items);
    assert!(done);
    assert_eq!(data[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(data[0]["object"], "chat.completion.chunk");
    let tokens: Vec<&str> = data[1..6].iter().map(|c| chunk_text(c).unwrap()).collect();
    assert!(tokens.iter().all(|t| t.len() > 1), "{tokens:?}");
    assert_eq!(data[6]["choices"][0]["finish_reason"], "length");
    assert_eq!(data[6]["choices"][0]["delta"], json!({}));
    // "system: be brief" and "user: hello there": 6 tokens.
    assert_eq!(data[7]["usage"]["prompt_tokens"], 6);
    assert_eq!(data[7]["usage"]["completion_tokens"], 5);
    assert_eq!(data.len(), 8);

    // Without ignore_eos, the answer ends by itself, the same way every time.
    let ask = json!({"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 1000});
    let first = client::post(sim.api, "/v1/chat/completions", &ask).unwrap();
    let second = client::post(sim.api, "/v1/chat/completions", &ask).unwrap();
    let (first, second) = (first.json().unwrap(), second.json().unwrap());
    assert_eq!(first["object"], "chat.completion");
    assert_eq!(first["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        first["choices"][0]["message"],
        second["choices"][0]["message"]
    );
    let n = first["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((8..=256).contains(&n), "{n}");

    let models = client::get(sim.api, "/v1/models").unwrap().json().unwrap();
    assert_eq!(models["data"][0]["id"], "sim-model");
    let health = client::get(sim.api, "/health").unwrap();
    assert_eq!(health.status(), 200);
}

#[test]
fn listens_on_every_address_with_metrics_beside_each() {
    let dir = tempfile::tempdir().unwrap();
    let sim = start(
        &dir,
        "log",
        &["--listen", "127.0.0.1:0", "--listen", "[::1]:0"],
    );
    let output = sim.process.output();
    let listeners: Vec<SocketAddr> = output
        .lines()
        .filter_map(|l| l.strip_prefix("listening on ")?.split(' ').next())
        .map(|a| a.parse().unwrap())
        .collect();
    assert_eq!(listeners.len(), 4, "{output}");
    assert_eq!(
        listeners.iter().filter(|a| a.is_ipv6()).count(),
        2,
        "{output}"
    );
    for addr in &listeners[..2] {
        assert_eq!(client::get(*addr, "/health").unwrap().status(), 200);
    }
    for addr in &listeners[2..] {
        assert_eq!(client::get(*addr, "/metrics").unwrap().status(), 200);
        assert_eq!(client::get(*addr, "/admin/state").unwrap().status(), 200);
    }
}

/// With `--tls-cert` and `--tls-client-ca`, the API answers only over TLS and only a client
/// with a certificate from that CA; the admin port stays plain.
#[test]
fn https_with_client_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let pki = tls::Pki::new(&dir.path().join("pki")).unwrap();
    let (cert, key) = pki.issue("server", &["127.0.0.1"]).unwrap();
    let (client_cert, client_key) = pki.issue("client", &["client"]).unwrap();
    let ca = pki.ca_file();
    let arg = |p: &Path| p.display().to_string();
    let (cert, key, ca_arg) = (arg(&cert), arg(&key), arg(&ca));
    let sim = start(
        &dir,
        "log",
        &[
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-client-ca",
            &ca_arg,
        ],
    );
    let request = |identity: Option<(&Path, &Path)>| {
        let config = tls::client_config(&ca, identity).unwrap();
        tls::request_from(sim.api, 0, config, "127.0.0.1", "GET", "/metrics", None)
    };
    let reply = request(Some((&client_cert, &client_key))).unwrap();
    assert_eq!(reply.status(), 200);
    assert!(
        reply.body.contains("vllm:num_requests_running"),
        "{}",
        reply.body
    );
    let refused = request(None).unwrap_err();
    assert!(
        format!("{refused:#}").contains("CertificateRequired"),
        "{refused:#}"
    );
    assert!(
        client::get(sim.api, "/health").is_err(),
        "plain HTTP to the TLS API"
    );
    assert_eq!(
        client::get(sim.metrics, "/admin/state").unwrap().status(),
        200
    );
}

#[test]
fn malformed_requests_get_400_while_other_streams_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let sim = start(&dir, "log", &["--kv-tokens", "4096"]);
    let mut stream = Stream::open(
        sim.api,
        "/v1/completions",
        &completion(&words("s", 10), 60, true),
    )
    .unwrap();
    assert!(matches!(
        stream.next_item().unwrap(),
        Some(Item::Chunk { .. })
    ));

    let bad: Vec<(&str, String, &str)> = vec![
        (
            "/v1/completions",
            "{not json".into(),
            "invalid request body",
        ),
        ("/v1/completions", r#"{"max_tokens": 3}"#.into(), "prompt"),
        (
            "/v1/completions",
            r#"{"prompt": "a", "max_tokens": "x"}"#.into(),
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "a", "max_tokens": -1}"#.into(),
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "a", "max_tokens": 0}"#.into(),
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"prompt": ["a", "b"]}"#.into(),
            "one prompt",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "a", "temperature": 5}"#.into(),
            "temperature",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "a", "n": 2}"#.into(),
            "n = 1",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": []}"#.into(),
            "messages",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user"}]}"#.into(),
            "invalid",
        ),
        (
            "/v1/completions",
            json!({"prompt": words("big", 4000), "max_tokens": 200}).to_string(),
            "maximum context length is 4096 tokens",
        ),
    ];
    for (path, body, expected) in &bad {
        let reply = client::request(sim.api, "POST", path, Some(body)).unwrap();
        assert_eq!(reply.status(), 400, "{body}: {}", reply.body);
        let message = error_message(&reply);
        assert!(message.contains(expected), "{body}: {message}");
        assert_eq!(
            reply.json().unwrap()["error"]["type"],
            "invalid_request_error"
        );
    }
    let reply = client::post(
        sim.api,
        "/v1/completions",
        &json!({"model": "gpt-4", "prompt": "a"}),
    )
    .unwrap();
    assert_eq!(reply.status(), 404);
    assert!(error_message(&reply).contains("`gpt-4` does not exist"));
    let garbage = client::raw(sim.api, b"\x00\x01 nonsense\r\n\r\n").unwrap();
    assert!(garbage.starts_with("HTTP/1.1 400"), "{garbage}");
    let wrong_method = client::get(sim.api, "/v1/completions").unwrap();
    assert_eq!(wrong_method.status(), 405);

    // Nothing refused was queued, and the stream went on through all of it.
    let state = sim.state().unwrap();
    assert_eq!(
        (state["running"].as_u64(), state["waiting"].as_u64()),
        (Some(1), Some(0))
    );
    let mut rest = vec![];
    while let Some(item) = stream.next_item().unwrap() {
        rest.push(item);
    }
    let (data, done) = chunks(&rest);
    assert!(done);
    assert_eq!(data.len(), 60, "59 more tokens and the final chunk");
}

/// Reads an exposition with prometheus-parse, the agent's parser. Its name pattern is `\w+`,
/// which leaves out the colons that vLLM, SGLang and llama.cpp put in their names (legal in
/// Prometheus metric names): without this mapping it would silently drop those lines.
fn parse(text: &str) -> Scrape {
    let lines = text.lines().map(|line| {
        let mapped = match line.strip_prefix("# ") {
            Some(comment) => {
                let mut parts = comment.splitn(3, ' ');
                let (keyword, name, rest) = (
                    parts.next().unwrap(),
                    parts.next().unwrap_or(""),
                    parts.next(),
                );
                format!(
                    "# {keyword} {}{}",
                    name.replace(':', "__colon__"),
                    rest.map(|r| format!(" {r}")).unwrap_or_default()
                )
            }
            None => {
                let end = line.find(['{', ' ']).unwrap_or(line.len());
                format!("{}{}", line[..end].replace(':', "__colon__"), &line[end..])
            }
        };
        Ok(mapped)
    });
    let mut scrape = Scrape::parse(lines).unwrap();
    for sample in &mut scrape.samples {
        sample.metric = sample.metric.replace("__colon__", ":");
    }
    scrape
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Per dialect: every family it publishes, with its type and label names.
fn expected(dialect: &str) -> Vec<(&'static str, Kind, &'static [&'static str])> {
    use Kind::*;
    const VLLM: &[&str] = &["engine", "model_name"];
    const SGLANG_SCHEDULER: &[&str] = &["engine_type", "model_name", "pp_rank", "tp_rank"];
    const SGLANG_TOKENIZER: &[&str] = &["model_name"];
    const SGLANG_MODE: &[&str] = &["engine_type", "mode", "model_name", "pp_rank", "tp_rank"];
    const TRTLLM: &[&str] = &["engine_type", "model_name"];
    const TRTLLM_GAUGE: &[&str] = &["engine_type", "model_name", "pid"];
    const NONE: &[&str] = &[];
    match dialect {
        "vllm" => vec![
            ("vllm:num_requests_running", Gauge, VLLM),
            ("vllm:num_requests_waiting", Gauge, VLLM),
            ("vllm:kv_cache_usage_perc", Gauge, VLLM),
            ("vllm:prefix_cache_queries_total", Counter, VLLM),
            ("vllm:prefix_cache_hits_total", Counter, VLLM),
            ("vllm:num_preemptions_total", Counter, VLLM),
            ("vllm:prompt_tokens_total", Counter, VLLM),
            ("vllm:generation_tokens_total", Counter, VLLM),
            (
                "vllm:request_success_total",
                Counter,
                &["engine", "finished_reason", "model_name"],
            ),
            ("vllm:time_to_first_token_seconds", Histogram, VLLM),
            ("vllm:e2e_request_latency_seconds", Histogram, VLLM),
            ("vllm:request_queue_time_seconds", Histogram, VLLM),
        ],
        "sglang" => vec![
            ("sglang:num_running_reqs", Gauge, SGLANG_SCHEDULER),
            ("sglang:num_used_tokens", Gauge, SGLANG_SCHEDULER),
            ("sglang:token_usage", Gauge, SGLANG_SCHEDULER),
            ("sglang:num_queue_reqs", Gauge, SGLANG_SCHEDULER),
            ("sglang:cache_hit_rate", Gauge, SGLANG_SCHEDULER),
            ("sglang:max_total_num_tokens", Gauge, SGLANG_SCHEDULER),
            ("sglang:realtime_tokens_total", Counter, SGLANG_MODE),
            ("sglang:prompt_tokens_total", Counter, SGLANG_TOKENIZER),
            ("sglang:generation_tokens_total", Counter, SGLANG_TOKENIZER),
            ("sglang:cached_tokens_total", Counter, SGLANG_TOKENIZER),
            ("sglang:num_requests_total", Counter, SGLANG_TOKENIZER),
            (
                "sglang:time_to_first_token_seconds",
                Histogram,
                SGLANG_TOKENIZER,
            ),
            (
                "sglang:e2e_request_latency_seconds",
                Histogram,
                SGLANG_TOKENIZER,
            ),
        ],
        "tgi" => vec![
            ("tgi_batch_current_size", Gauge, NONE),
            ("tgi_queue_size", Gauge, NONE),
            ("tgi_batch_current_max_tokens", Gauge, NONE),
            ("tgi_request_count", Counter, NONE),
            ("tgi_request_success", Counter, NONE),
            ("tgi_batch_inference_count", Counter, &["method"]),
            ("tgi_batch_inference_success", Counter, &["method"]),
            ("tgi_request_duration", Histogram, NONE),
            ("tgi_request_queue_duration", Histogram, NONE),
        ],
        "llamacpp" => vec![
            ("llamacpp:prompt_tokens_total", Counter, NONE),
            ("llamacpp:prompt_tokens_cached_total", Counter, NONE),
            ("llamacpp:prompt_seconds_total", Counter, NONE),
            ("llamacpp:tokens_predicted_total", Counter, NONE),
            ("llamacpp:tokens_predicted_seconds_total", Counter, NONE),
            ("llamacpp:n_decode_total", Counter, NONE),
            ("llamacpp:n_tokens_max", Counter, NONE),
            ("llamacpp:spec_decode_num_draft_tokens_total", Counter, NONE),
            (
                "llamacpp:spec_decode_num_accepted_tokens_total",
                Counter,
                NONE,
            ),
            ("llamacpp:spec_decode_num_drafts_total", Counter, NONE),
            ("llamacpp:prompt_tokens_seconds", Gauge, NONE),
            ("llamacpp:predicted_tokens_seconds", Gauge, NONE),
            ("llamacpp:requests_processing", Gauge, NONE),
            ("llamacpp:requests_deferred", Gauge, NONE),
            ("llamacpp:n_busy_slots_per_decode", Gauge, NONE),
        ],
        "trtllm" => vec![
            ("trtllm_num_requests_running", Gauge, TRTLLM_GAUGE),
            ("trtllm_num_requests_waiting", Gauge, TRTLLM_GAUGE),
            ("trtllm_kv_cache_utilization", Gauge, TRTLLM_GAUGE),
            ("trtllm_kv_cache_hit_rate", Gauge, TRTLLM_GAUGE),
            (
                "trtllm_request_success_total",
                Counter,
                &["engine_type", "finished_reason", "model_name"],
            ),
            ("trtllm_prompt_tokens_total", Counter, TRTLLM),
            ("trtllm_generation_tokens_total", Counter, TRTLLM),
            ("trtllm_time_to_first_token_seconds", Histogram, TRTLLM),
            ("trtllm_e2e_request_latency_seconds", Histogram, TRTLLM),
            ("trtllm_request_queue_time_seconds", Histogram, TRTLLM),
        ],
        "plain" => vec![
            ("inference_requests_running", Gauge, NONE),
            ("inference_requests_waiting", Gauge, NONE),
        ],
        _ => unreachable!(),
    }
}

/// The value of a family's series whose `key` label is `value`.
fn by_label(scrape: &Scrape, name: &str, key: &str, value: &str) -> f64 {
    one(scrape, name, |s| s.labels.get(key) == Some(value))
}

/// The one value of a family with no or fixed labels.
fn value(scrape: &Scrape, name: &str) -> f64 {
    one(scrape, name, |_| true)
}

fn one(scrape: &Scrape, name: &str, wanted: impl Fn(&&prometheus_parse::Sample) -> bool) -> f64 {
    let values: Vec<f64> = scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(wanted)
        .map(|s| match &s.value {
            Sample::Counter(v) | Sample::Gauge(v) | Sample::Untyped(v) => *v,
            other => panic!("{name} is {other:?}"),
        })
        .collect();
    assert_eq!(values.len(), 1, "{name}: {values:?}");
    values[0]
}

/// Families in the raw text (histograms by their own name), with their `# TYPE`.
fn declared_types(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let (name, kind) = l.split_once(' ').unwrap();
            (name.to_owned(), kind.to_owned())
        })
        .collect()
}

#[test]
fn every_dialect_publishes_the_real_servers_names_types_and_labels() {
    let dir = tempfile::tempdir().unwrap();
    let preamble = words("pre", 64);
    for dialect in ["vllm", "sglang", "tgi", "llamacpp", "trtllm", "plain"] {
        let sim = start(
            &dir,
            dialect,
            &[
                "--dialect",
                dialect,
                "--model",
                "org/model-7b",
                "--time-scale",
                "4",
            ],
        );
        // Two requests sharing 64 prompt tokens (4 blocks), then one that keeps running.
        for question in ["a", "b"] {
            let prompt = format!("{preamble} {question}1 {question}2");
            let reply = client::post(
                sim.api,
                "/v1/completions",
                &json!({"prompt": prompt, "max_tokens": 5, "ignore_eos": true}),
            )
            .unwrap();
            assert_eq!(reply.status(), 200, "{}", reply.body);
        }
        let mut running = Stream::open(
            sim.api,
            "/v1/completions",
            &completion(&words("long", 10), 400, true),
        )
        .unwrap();
        running.next_item().unwrap();

        let text = sim.scrape().unwrap();
        let state = sim.state().unwrap();
        let scrape = parse(&text);
        let want = expected(dialect);

        // Exactly the expected families, each with its type...
        let declared = declared_types(&text);
        let want_types: BTreeMap<String, String> = want
            .iter()
            .map(|(name, kind, _)| {
                let kind = match kind {
                    Kind::Counter => "counter",
                    Kind::Gauge => "gauge",
                    Kind::Histogram => "histogram",
                };
                (name.to_string(), kind.to_owned())
            })
            .collect();
        assert_eq!(declared, want_types, "{dialect}:\n{text}");
        // ...that the parser reads as that type, with the real server's labels.
        for (name, kind, labels) in &want {
            let samples: Vec<_> = scrape
                .samples
                .iter()
                .filter(|s| s.metric == *name)
                .collect();
            assert!(!samples.is_empty(), "{dialect}: {name} not parsed:\n{text}");
            for sample in samples {
                let parsed = match sample.value {
                    Sample::Counter(_) => Kind::Counter,
                    Sample::Gauge(_) => Kind::Gauge,
                    Sample::Histogram(_) => Kind::Histogram,
                    ref other => panic!("{dialect}: {name} parsed as {other:?}"),
                };
                assert_eq!(parsed, *kind, "{dialect}: {name}");
                let keys: BTreeSet<&str> = sample.labels.keys().map(String::as_str).collect();
                assert_eq!(keys, labels.iter().copied().collect(), "{dialect}: {name}");
                for (key, value) in sample.labels.iter() {
                    let fixed = match key.as_str() {
                        "model_name" if dialect == "trtllm" => "undefined",
                        "model_name" => "org/model-7b",
                        "engine" | "tp_rank" | "pp_rank" => "0",
                        "engine_type" if dialect == "sglang" => "unified",
                        "engine_type" => "undefined",
                        "pid" => &sim.process.pid().to_string(),
                        "finished_reason" | "mode" | "method" => continue,
                        other => panic!("{dialect}: unexpected label {other}"),
                    };
                    assert_eq!(value, fixed, "{dialect}: {name} {key}");
                }
                if let Sample::Histogram(buckets) = &sample.value {
                    let counts: Vec<f64> = buckets.iter().map(|b| b.count).collect();
                    assert!(
                        counts.windows(2).all(|w| w[0] <= w[1]),
                        "{name}: {counts:?}"
                    );
                    assert!(buckets.iter().any(|b| b.less_than.is_infinite()));
                }
            }
        }

        // The gauges agree with the engine's own picture: one running, none waiting.
        assert_eq!(
            (state["running"].as_u64(), state["waiting"].as_u64()),
            (Some(1), Some(0))
        );
        let (running_name, waiting_name) = match dialect {
            "vllm" => ("vllm:num_requests_running", "vllm:num_requests_waiting"),
            "sglang" => ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
            "tgi" => ("tgi_batch_current_size", "tgi_queue_size"),
            "llamacpp" => ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
            "trtllm" => ("trtllm_num_requests_running", "trtllm_num_requests_waiting"),
            _ => ("inference_requests_running", "inference_requests_waiting"),
        };
        assert_eq!(value(&scrape, running_name), 1.0, "{dialect}");
        assert_eq!(value(&scrape, waiting_name), 0.0, "{dialect}");
        let kv = state["kv_usage"].as_f64().unwrap();
        assert!(kv > 0.0, "{state}");
        // KV memory, TTFT and prefix reuse where the real server shows them.
        let ttft_count = |name: &str| value(&scrape, &format!("{name}_count"));
        match dialect {
            "vllm" => {
                assert!((value(&scrape, "vllm:kv_cache_usage_perc") - kv).abs() < 0.01);
                assert_eq!(ttft_count("vllm:time_to_first_token_seconds"), 3.0);
                assert_eq!(value(&scrape, "vllm:prefix_cache_hits_total"), 64.0);
                assert_eq!(value(&scrape, "vllm:prefix_cache_queries_total"), 142.0);
            }
            "sglang" => {
                assert!((value(&scrape, "sglang:token_usage") - kv).abs() < 0.01);
                assert_eq!(ttft_count("sglang:time_to_first_token_seconds"), 3.0);
                assert_eq!(value(&scrape, "sglang:cached_tokens_total"), 64.0);
                // Tokens of the two finished requests only, as SGLang counts them; the
                // scheduler's per-iteration counter has the running stream's too.
                assert_eq!(value(&scrape, "sglang:generation_tokens_total"), 10.0);
                let decoded = by_label(&scrape, "sglang:realtime_tokens_total", "mode", "decode");
                assert!(decoded > 10.0, "{decoded}");
            }
            "trtllm" => {
                assert!((value(&scrape, "trtllm_kv_cache_utilization") - kv).abs() < 0.01);
                assert_eq!(ttft_count("trtllm_time_to_first_token_seconds"), 3.0);
                assert_eq!(value(&scrape, "trtllm_generation_tokens_total"), 10.0);
            }
            "llamacpp" => {
                assert_eq!(value(&scrape, "llamacpp:prompt_tokens_cached_total"), 64.0);
                // 66 + 2 + 10 computed: the second prompt's 64 cached tokens were not.
                assert_eq!(value(&scrape, "llamacpp:prompt_tokens_total"), 78.0);
            }
            "tgi" => {
                assert_eq!(value(&scrape, "tgi_request_success"), 2.0);
                // A request alone in its batch: its first token from a prefill pass, each
                // other one from a decode pass (the running stream's may not have come yet).
                let passes =
                    |method| by_label(&scrape, "tgi_batch_inference_success", "method", method);
                let (prefills, decodes) = (passes("prefill"), passes("decode"));
                assert!(prefills >= 3.0 && decodes >= 8.0, "{prefills} {decodes}");
            }
            _ => {}
        }
        // The API port serves it too, where the real server does, and so does the metrics
        // port, for a scraper that asks there.
        let path = if dialect == "trtllm" {
            "/prometheus/metrics"
        } else {
            "/metrics"
        };
        for addr in [sim.api, sim.metrics] {
            let reply = client::get(addr, path).unwrap();
            assert_eq!(reply.status(), 200, "{dialect} {addr}{path}");
            assert_eq!(
                declared_types(&reply.body),
                want_types,
                "{dialect} {addr}{path}"
            );
        }
    }
}

fn stream(sim: &SimServer, max_tokens: u32) -> Stream {
    Stream::open(
        sim.api,
        "/v1/completions",
        &completion(&words("f", 8), max_tokens, true),
    )
    .unwrap()
}

fn tokens_until_quiet(stream: &mut Stream, quiet: Duration) -> usize {
    stream.set_timeout(quiet).unwrap();
    let mut n = 0;
    loop {
        match stream.next_item() {
            Ok(Some(Item::Chunk { .. })) => n += 1,
            Ok(other) => panic!("stream ended: {other:?}"),
            Err(e) if is_timeout(&e) => return n,
            Err(e) => panic!("{e:#}"),
        }
    }
}

fn finish(mut stream: Stream) -> usize {
    stream.set_timeout(client::TIMEOUT).unwrap();
    let mut rest = vec![];
    while let Some(item) = stream.next_item().unwrap() {
        rest.push(item);
    }
    let (data, done) = chunks(&rest);
    assert!(done, "no [DONE]");
    data.len() - 1
}

#[test]
fn faults_are_seen_by_clients_and_cleared() {
    let dir = tempfile::tempdir().unwrap();
    let sim = start(&dir, "log", &["--time-scale", "5"]);
    let quiet = Duration::from_millis(800);

    // Hang: accepted and counted running, but no token until the fault is lifted.
    sim.fault(&json!({"kind": "hang_before_first_token"}))
        .unwrap();
    let mut hung = stream(&sim, 10);
    assert_eq!(tokens_until_quiet(&mut hung, quiet), 0);
    assert_eq!(sim.state().unwrap()["running"], 1);
    sim.fault(&json!({"kind": "none"})).unwrap();
    assert_eq!(finish(hung), 10);

    // Stall: three tokens, then nothing until lifted.
    sim.fault(&json!({"kind": "stall_mid_stream", "after_tokens": 3}))
        .unwrap();
    let mut stalled = stream(&sim, 10);
    assert_eq!(tokens_until_quiet(&mut stalled, quiet), 3);
    sim.fault(&json!({"kind": "none"})).unwrap();
    assert_eq!(finish(stalled), 7);

    // Error statuses on the whole API, but not on the metrics.
    for (kind, status) in [("status_500", 500), ("status_503", 503)] {
        sim.fault(&json!({ "kind": kind })).unwrap();
        let reply = client::post(sim.api, "/v1/completions", &completion("x", 3, false)).unwrap();
        assert_eq!(reply.status(), status, "{}", reply.body);
        assert!(error_message(&reply).contains(kind));
        assert_eq!(client::get(sim.api, "/health").unwrap().status(), status);
        assert_eq!(client::get(sim.api, "/metrics").unwrap().status(), 200);
    }

    // Closed mid-stream: two tokens, then the connection drops without [DONE].
    sim.fault(&json!({"kind": "close_mid_stream", "after_tokens": 2}))
        .unwrap();
    let mut closed = stream(&sim, 10);
    let mut got = 0;
    let end = loop {
        match closed.next_item() {
            Ok(Some(Item::Chunk { .. })) => got += 1,
            other => break other,
        }
    };
    assert_eq!(got, 2);
    let err = end.expect_err("the connection should break, not end");
    assert!(format!("{err:#}").contains("closed inside"), "{err:#}");
    let whole = client::post(sim.api, "/v1/completions", &completion("x", 5, false));
    assert!(whole.is_err(), "a broken non-streamed answer: {whole:?}");

    // Slow metrics: the scrape waits, the API does not.
    sim.fault(&json!({"kind": "slow_metrics", "delay_ms": 1500}))
        .unwrap();
    let scraper = {
        let metrics = sim.metrics;
        thread::spawn(move || {
            let asked = Instant::now();
            let reply = client::get(metrics, "/metrics").unwrap();
            (asked.elapsed(), reply.status())
        })
    };
    thread::sleep(Duration::from_millis(100));
    let asked = Instant::now();
    assert_eq!(client::get(sim.api, "/health").unwrap().status(), 200);
    assert!(asked.elapsed() < Duration::from_millis(500));
    let (took, status) = scraper.join().unwrap();
    assert_eq!(status, 200);
    assert!(took >= Duration::from_millis(1500), "{took:?}");

    // Garbage metrics: 200, but nothing a parser can use.
    sim.fault(&json!({"kind": "garbage_metrics"})).unwrap();
    let garbage = sim.scrape().unwrap();
    assert!(parse(&garbage).samples.is_empty(), "{garbage}");
    assert!(!garbage.contains("vllm:"));

    // And back to normal; the request fault group was cleared along with the metrics one.
    sim.fault(&json!({"kind": "none"})).unwrap();
    assert!(!parse(&sim.scrape().unwrap()).samples.is_empty());
    let reply = client::post(sim.api, "/v1/completions", &completion("x", 3, false)).unwrap();
    assert_eq!(reply.status(), 200);
    let state = sim.state().unwrap();
    assert_eq!(state["faults"], json!({"request": null, "metrics": null}));
    assert_eq!(state["running"], 0);

    let bad = client::post(sim.metrics, "/admin/fault", &json!({"kind": "explode"})).unwrap();
    assert_eq!(bad.status(), 400);
}

/// Waits until nothing accepts connections at `addr` any more.
fn wait_closed(addr: SocketAddr, within: Duration) {
    let deadline = Instant::now() + within;
    while client::get(addr, "/health").is_ok() {
        assert!(Instant::now() < deadline, "{addr} still serving");
        thread::sleep(Duration::from_millis(50));
    }
    // The listener closes as the process exits; give the exit a moment to complete.
    thread::sleep(Duration::from_millis(200));
}

#[test]
fn faults_from_the_command_line_and_exit() {
    let dir = tempfile::tempdir().unwrap();
    let unavailable = start(&dir, "503", &["--fault", "status_503"]);
    let reply = client::post(
        unavailable.api,
        "/v1/completions",
        &completion("x", 1, false),
    )
    .unwrap();
    assert_eq!(reply.status(), 503);

    let mut leaving = start(&dir, "exit", &["--fault", "exit:after_ms=300,code=7"]);
    wait_closed(leaving.api, Duration::from_secs(10));
    let status = leaving.process.stop(Duration::from_secs(1)).unwrap();
    assert_eq!(status.code(), Some(7));

    let mut told = start(&dir, "exit-admin", &[]);
    told.fault(&json!({"kind": "exit", "code": 3})).unwrap();
    wait_closed(told.api, Duration::from_secs(10));
    assert_eq!(
        told.process.stop(Duration::from_secs(1)).unwrap().code(),
        Some(3)
    );

    let bad = std::process::Command::new(SIM)
        .args(["--fault", "explode"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("explode"));
}

#[test]
fn a_name_is_on_every_api_answer() {
    let dir = tempfile::tempdir().unwrap();
    let named = start(&dir, "named", &["--name", "b7"]);
    let ok = client::post(named.api, "/v1/completions", &completion("x", 2, false)).unwrap();
    let stream = Stream::open(named.api, "/v1/completions", &completion("x", 2, true)).unwrap();
    let missing = client::get(named.api, "/nowhere").unwrap();
    named.fault(&json!({"kind": "status_503"})).unwrap();
    let refused = client::get(named.api, "/health").unwrap();
    for (what, head, status) in [
        ("completion", &ok.head, 200),
        ("stream", &stream.head, 200),
        ("404", &missing.head, 404),
        ("503 fault", &refused.head, 503),
    ] {
        assert_eq!(head.status, status, "{what}");
        assert_eq!(head.header("x-backend"), Some("b7"), "{what}");
    }
    let anonymous = start(&dir, "anonymous", &[]);
    let reply = client::get(anonymous.api, "/health").unwrap();
    assert_eq!(reply.head.header("x-backend"), None);
}

#[test]
fn metrics_faults_break_the_numbers_or_the_size() {
    let dir = tempfile::tempdir().unwrap();
    let sim = start(&dir, "log", &["--dialect", "sglang"]);
    let clean = sim.scrape().unwrap();

    sim.fault(&json!({"kind": "metrics_nan"})).unwrap();
    let scrape = parse(&sim.scrape().unwrap());
    assert!(value(&scrape, "sglang:num_running_reqs").is_nan());
    assert_eq!(value(&scrape, "sglang:num_queue_reqs"), 0.0);

    sim.fault(&json!({"kind": "metrics_negative"})).unwrap();
    let scrape = parse(&sim.scrape().unwrap());
    assert_eq!(value(&scrape, "sglang:num_running_reqs"), 0.0);
    assert_eq!(value(&scrape, "sglang:num_queue_reqs"), -1.0);

    sim.fault(&json!({"kind": "metrics_huge"})).unwrap();
    let huge = sim.scrape().unwrap();
    assert_eq!(huge.len(), 10_000_000);
    // The exposition, then nothing but comments.
    assert_eq!(parse(&huge).samples.len(), parse(&clean).samples.len());

    sim.fault(&json!({"kind": "none"})).unwrap();
    assert_eq!(sim.scrape().unwrap().len(), clean.len());
}
