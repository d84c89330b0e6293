//! What an inference server's Prometheus exposition says about its load: pure parsing, no I/O.
//!
//! The six dialects of the design brief (section 5), each detected from its metric names.
//! Names as checked against the servers' own sources:
//! - vLLM, `vllm/v1/metrics/loggers.py`: gauges `vllm:num_requests_running`,
//!   `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` ("1 means 100 percent usage"; it
//!   replaced `vllm:gpu_cache_usage_perc`, deprecated in 0.9), histogram
//!   `vllm:time_to_first_token_seconds`; labels `model_name`, `engine` (one label set per
//!   engine core when several run in one server).
//! - SGLang, `python/sglang/srt/metrics/collector.py` and its production-metrics docs: gauges
//!   `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage` (used / total
//!   tokens of the KV pool), histogram `sglang:time_to_first_token_seconds`; labels
//!   `model_name` and, by version, `tp_rank`, `dp_rank`, `pp_rank`, `engine_type`. By default
//!   only the first attention-TP rank of each data-parallel rank publishes.
//! - TGI, the router's `metrics::gauge!` calls: `tgi_batch_current_size`, `tgi_queue_size`; no
//!   KV gauge, no TTFT histogram. Its exporter renders a gauge only once it has been set, so a
//!   server that has not batched anything yet may lack them (then: "tgi: no ...").
//! - llama.cpp, `tools/server/server-task.cpp` (the sdist built on this machine): gauges
//!   `llamacpp:requests_processing`, `llamacpp:requests_deferred`, no labels, no KV gauge
//!   (older builds had `llamacpp:kv_cache_usage_ratio`; not read), no TTFT histogram.
//! - TensorRT-LLM, `tensorrt_llm/metrics/collector.py`: gauges `trtllm_num_requests_running`,
//!   `trtllm_num_requests_waiting`, `trtllm_kv_cache_utilization` (used / max blocks),
//!   histogram `trtllm_time_to_first_token_seconds`. `trtllm-serve` answers `/metrics` with JSON
//!   iteration stats and serves this text on `/prometheus/metrics` (see [`Dialect::metrics_path`]).
//! - Plain: `inference_requests_running`, `inference_requests_waiting`.
//!
//! Progress (`Reading::progress`): a counter that the engine moves at every step, so that a
//! hung engine, whose `/metrics` still answers with the gauges of its last step, can be told
//! from a busy one. Only counters moved per step qualify; a busy server with long streams may
//! finish nothing for minutes, so counters moved at a request's end do not:
//! - vLLM: `vllm:generation_tokens_total`, the tokens each step emitted (`record()` runs once
//!   per batch of engine outputs). A step that only prefills chunks of prompts it does not
//!   finish emits nothing.
//! - SGLang: `sglang:realtime_tokens_total` (by `mode`: decode every iteration, prefill every
//!   batch; older builds only every `decode_log_interval` steps) and
//!   `sglang:cuda_graph_passes_total` (one per forward batch). Its `generation_tokens_total`
//!   moves when a request finishes. Both appear at the first batch.
//! - TGI: `tgi_batch_inference_success` (by `method`), one per successful forward
//!   (`backends/v3/src/backend.rs`); it appears at the first prefill.
//! - llama.cpp: `llamacpp:n_decode_total`, one per `llama_decode()` call. (A hung llama.cpp
//!   loop also stops answering `/metrics`, which is served by the same task queue.)
//! - TensorRT-LLM: none. Its counters, the iteration ones included, move only when a request
//!   finishes (`openai_server.py` drains the stats then).
//! - Plain: none.
//!
//! Nothing is guessed: a missing required signal (running, waiting) is an error, a missing
//! optional one (KV, TTFT) is `None`. A value that is not a finite non-negative number is an
//! error in a required signal; in an optional one it leaves that signal (or that TTFT label
//! set) out, and the reading says why (`Reading::ignored`). Text is parsed with
//! `prometheus-parse` 0.2.5, around two of its gaps:
//! - its name pattern is `\w+`, so it silently drops every sample whose name has a colon,
//!   i.e. all of vLLM, SGLang and llama.cpp: colons in names are swapped for a stand-in
//!   letter before parsing and restored after;
//! - it silently skips lines it cannot read: every line is checked first, and one that is not
//!   a comment or a readable sample fails the whole exposition, as it would in Prometheus.
//!   (Its label reading is naive, e.g. a '}' inside a label value makes the line unreadable:
//!   such an exposition is refused, never half read. Every label set of a metric counts;
//!   TTFT keeps them apart, since each set's counters restart on their own.)
//!
//! Its regexes cost more than the rest of a scrape, so only the lines of the metrics read go
//! through it; the others need only be sample lines by the text format (see [`scan`]).

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    str::FromStr,
};

use prometheus_parse::{LineInfo, Scrape, Value};

/// The metric dialects we understand, detected from metric names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dialect {
    Vllm,
    Sglang,
    Tgi,
    Llamacpp,
    Trtllm,
    Plain,
}

/// What one exposition says about a server's load. `None` = the server does not publish it.
#[derive(Debug, Clone, PartialEq)]
pub struct Reading {
    pub dialect: Dialect,
    pub running: f64,
    pub waiting: f64,
    /// KV-cache memory used, 0..=1.
    pub kv_usage: Option<f64>,
    /// Cumulative TTFT histogram totals, if the dialect has one.
    pub ttft: Option<TtftSeries>,
    /// The dialect's progress counters summed over their label sets: any change means the
    /// engine stepped (or restarted). `None` for a dialect without one, or before its series
    /// appear.
    pub progress: Option<f64>,
    /// The first value of an optional signal (KV, TTFT, progress) that made no sense: that
    /// signal (or that TTFT label set) is left out, and the load the required signals give
    /// still counts.
    pub ignored: Option<DialectError>,
}

/// A TTFT histogram's cumulative `_sum` (seconds) and `_count` for one label set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtftTotals {
    pub sum_s: f64,
    pub count: f64,
}

/// A TTFT histogram's totals per label set (engine, data-parallel rank, model), keyed by the
/// labels other than `le`: each set is a counter of its own and can restart on its own.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TtftSeries(pub BTreeMap<String, TtftTotals>);

#[cfg(test)]
impl TtftSeries {
    /// The totals over every label set.
    pub fn total(&self) -> TtftTotals {
        self.0.values().fold(
            TtftTotals {
                sum_s: 0.0,
                count: 0.0,
            },
            |a, t| TtftTotals {
                sum_s: a.sum_s + t.sum_s,
                count: a.count + t.count,
            },
        )
    }
}

/// Why an exposition gives no reading. Each message is one line.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DialectError {
    #[error("not Prometheus text: empty body")]
    Empty,
    #[error(
        "not Prometheus text: the body is JSON (trtllm-serve answers /metrics with JSON; \
         its Prometheus text is on /prometheus/metrics: set dialect = \"trtllm\")"
    )]
    Json,
    #[error("not Prometheus text: line {line}: {reason}: {excerpt:?}")]
    Syntax {
        line: usize,
        reason: &'static str,
        excerpt: String,
    },
    #[error("not Prometheus text: no samples")]
    NoSamples,
    #[error("no known metric dialect: expected one of {}", expected_names())]
    UnknownDialect,
    #[error("metrics of several dialects ({0}, {1}): set `dialect` to choose one")]
    Ambiguous(Dialect, Dialect),
    #[error("{dialect}: no {metric}")]
    Missing {
        dialect: Dialect,
        metric: &'static str,
    },
    #[error("{dialect}: {metric} = {value}: {why}")]
    BadValue {
        dialect: Dialect,
        metric: String,
        value: f64,
        why: &'static str,
    },
}

/// A KV fraction this far above 1 is taken as 1 (rounding by the server); beyond, an error.
pub const KV_TOLERANCE: f64 = 0.01;

/// The names each dialect is read from.
struct Spec {
    dialect: Dialect,
    /// Any metric name starting with this marks the dialect; `None`: only `running`/`waiting` do.
    prefix: Option<&'static str>,
    running: &'static str,
    waiting: &'static str,
    /// KV-cache fraction gauges, preferred first.
    kv: &'static [&'static str],
    /// TTFT histogram (base name, without `_sum`/`_count`/`_bucket`).
    ttft: Option<&'static str>,
    /// Counters moved at every engine step (see the module's notes on progress).
    progress: &'static [&'static str],
}

const SPECS: [Spec; 6] = [
    Spec {
        dialect: Dialect::Vllm,
        prefix: Some("vllm:"),
        running: "vllm:num_requests_running",
        waiting: "vllm:num_requests_waiting",
        kv: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
        ttft: Some("vllm:time_to_first_token_seconds"),
        progress: &["vllm:generation_tokens_total"],
    },
    Spec {
        dialect: Dialect::Sglang,
        prefix: Some("sglang:"),
        running: "sglang:num_running_reqs",
        waiting: "sglang:num_queue_reqs",
        kv: &["sglang:token_usage"],
        ttft: Some("sglang:time_to_first_token_seconds"),
        progress: &[
            "sglang:realtime_tokens_total",
            "sglang:cuda_graph_passes_total",
        ],
    },
    Spec {
        dialect: Dialect::Tgi,
        prefix: Some("tgi_"),
        running: "tgi_batch_current_size",
        waiting: "tgi_queue_size",
        kv: &[],
        ttft: None,
        progress: &["tgi_batch_inference_success"],
    },
    Spec {
        dialect: Dialect::Llamacpp,
        prefix: Some("llamacpp:"),
        running: "llamacpp:requests_processing",
        waiting: "llamacpp:requests_deferred",
        kv: &[],
        ttft: None,
        progress: &["llamacpp:n_decode_total"],
    },
    Spec {
        dialect: Dialect::Trtllm,
        prefix: Some("trtllm_"),
        running: "trtllm_num_requests_running",
        waiting: "trtllm_num_requests_waiting",
        kv: &["trtllm_kv_cache_utilization"],
        ttft: Some("trtllm_time_to_first_token_seconds"),
        progress: &[],
    },
    // "inference_" is too generic a prefix to claim a server: only the two names count.
    Spec {
        dialect: Dialect::Plain,
        prefix: None,
        running: "inference_requests_running",
        waiting: "inference_requests_waiting",
        kv: &[],
        ttft: None,
        progress: &[],
    },
];

impl Spec {
    /// Whether a sample of this name shows the server speaks this dialect.
    fn marked_by(&self, name: &str) -> bool {
        match self.prefix {
            Some(p) => name.starts_with(p),
            None => name == self.running || name == self.waiting,
        }
    }

    /// Whether [`read`] looks at samples of this name.
    fn reads(&self, name: &str) -> bool {
        name == self.running
            || name == self.waiting
            || self.kv.contains(&name)
            || self.progress.contains(&name)
            || self.ttft.is_some_and(|family| {
                name.strip_prefix(family)
                    .is_some_and(|s| matches!(s, "_sum" | "_count" | "_bucket"))
            })
    }

    /// Whether a `# TYPE` line of this name changes how read samples are grouped:
    /// prometheus-parse keys a type by the name, and a histogram's by `name_bucket`.
    fn typed_by(&self, name: &str) -> bool {
        self.reads(name) || self.ttft == Some(name)
    }

    /// The TTFT family, if this is its `_bucket` name.
    fn ttft_bucket(&self, name: &str) -> Option<&'static str> {
        let family = self.ttft?;
        (name.strip_prefix(family)? == "_bucket").then_some(family)
    }
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

    /// The name used in the configuration and in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Vllm => "vllm",
            Dialect::Sglang => "sglang",
            Dialect::Tgi => "tgi",
            Dialect::Llamacpp => "llamacpp",
            Dialect::Trtllm => "trtllm",
            Dialect::Plain => "plain",
        }
    }

    /// Where a server of this dialect publishes Prometheus text. All on `/metrics` except
    /// `trtllm-serve`, whose `/metrics` is JSON (its `openai_server.py` mounts the Prometheus
    /// app on `/prometheus/metrics`).
    pub fn metrics_path(self) -> &'static str {
        match self {
            Dialect::Trtllm => "/prometheus/metrics",
            _ => "/metrics",
        }
    }

    fn spec(self) -> &'static Spec {
        SPECS
            .iter()
            .find(|s| s.dialect == self)
            .expect("every dialect has a spec")
    }
}

impl fmt::Display for Dialect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Dialect {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Dialect::ALL
            .into_iter()
            .find(|d| d.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Dialect::ALL.iter().map(|d| d.as_str()).collect();
                format!("unknown dialect {s:?} (one of {})", names.join(", "))
            })
    }
}

impl DialectError {
    /// The same fault in the same metric, whatever the value: a gauge that stays out of
    /// range while it moves is one fault, logged once.
    pub fn same_fault(&self, other: &Self) -> bool {
        match (self, other) {
            (
                DialectError::BadValue {
                    dialect: a,
                    metric: m,
                    why: w,
                    ..
                },
                DialectError::BadValue {
                    dialect: b,
                    metric: n,
                    why: x,
                    ..
                },
            ) => (a, m, w) == (b, n, x),
            _ => self == other,
        }
    }
}

fn expected_names() -> String {
    let names: Vec<_> = SPECS.iter().map(|s| s.running).collect();
    names.join(", ")
}

/// Parses a Prometheus text exposition. `forced` skips detection.
pub fn parse(body: &str, forced: Option<Dialect>) -> Result<Reading, DialectError> {
    parse_lines(body, forced, true)
}

/// [`parse`]; `only_read: false` hands every line to prometheus-parse, the reference the
/// filter is tested against.
fn parse_lines(
    body: &str,
    forced: Option<Dialect>,
    only_read: bool,
) -> Result<Reading, DialectError> {
    let specs = match forced {
        Some(d) => std::slice::from_ref(d.spec()),
        None => &SPECS[..],
    };
    let exposition = scan(body, specs, only_read)?;
    let dialect = match forced {
        Some(d) => d,
        None => detect(specs, &exposition.marks)?,
    };
    read(dialect.spec(), &exposition.samples)
}

/// Mean TTFT in ms over the observations between two readings; None when nothing was
/// observed in between. A label set whose counters went backwards restarted (one engine of
/// several, or the whole server) and is left out; one that is new since `prev` started
/// since, so all it observed is recent.
pub fn recent_ttft_ms(prev: Option<&TtftSeries>, cur: Option<&TtftSeries>) -> Option<f64> {
    let (prev, cur) = (prev?, cur?);
    let mut observations = 0.0;
    let mut seconds = 0.0;
    for (labels, now) in &cur.0 {
        let before = prev.0.get(labels).copied().unwrap_or(TtftTotals {
            sum_s: 0.0,
            count: 0.0,
        });
        let (n, s) = (now.count - before.count, now.sum_s - before.sum_s);
        // Comparisons are false for NaN, so a NaN leaves its set out too.
        if n >= 0.0 && s >= 0.0 {
            observations += n;
            seconds += s;
        }
    }
    if observations > 0.0 {
        Some(seconds / observations * 1000.0).filter(|ms| ms.is_finite())
    } else {
        None
    }
}

/// Stands in for ':' in metric names while prometheus-parse reads them: a letter (so `\w`
/// matches it) that no valid metric name can contain (they are ASCII).
const COLON: char = 'ː'; // U+02D0 MODIFIER LETTER TRIANGULAR COLON

/// Every sample of the exposition, by metric name (colons restored).
type Samples = HashMap<String, Vec<prometheus_parse::Sample>>;

struct Exposition {
    /// The samples of the metrics some spec reads (all of them, unfiltered).
    samples: Samples,
    /// Per spec: whether some sample's name marks its dialect.
    marks: Vec<bool>,
}

/// A line for prometheus-parse.
struct Kept<'a> {
    /// 1-based, for messages.
    number: usize,
    line: &'a str,
    /// The line as prometheus-parse is given it ([`for_parser`]).
    text: String,
    sample: bool,
    /// The TTFT family, for a line of its buckets.
    bucket_of: Option<&'static str>,
}

/// Checks every line, and reads those of the metrics the `specs` read.
///
/// A sample line of another metric only has to be a sample line by the text format (a name,
/// a label set whose quoted values may hold anything, a number): that still refuses HTML, JSON
/// and a body cut short, but a line prometheus-parse could not read (a '}' in a label value,
/// e.g. an HTTP route template) in a metric nobody reads does not take the server out.
fn scan(body: &str, specs: &[Spec], only_read: bool) -> Result<Exposition, DialectError> {
    let text = body.trim_start_matches('\u{feff}');
    if text.trim().is_empty() {
        return Err(DialectError::Empty);
    }
    if text.trim_start().starts_with(['{', '[']) {
        return Err(DialectError::Json);
    }
    let mut marks = vec![false; specs.len()];
    let mut kept: Vec<Kept> = Vec::new();
    let mut unread_samples = false;
    // A histogram or summary TYPE line was kept.
    let mut grouped = false;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if t.is_empty() {
            continue;
        }
        let sample = (!t.starts_with('#')).then(|| split_name(t));
        let (keep, bucket_of) = match sample {
            Some((name, _)) => classify(specs, &mut marks, name),
            // HELP and other comments change nothing prometheus-parse gives, and nor, as far
            // as `read` can tell, does a counter, gauge or untyped TYPE line, unless it undoes
            // a histogram or summary one.
            None => match type_line(t) {
                Some((name, kind)) if specs.iter().any(|s| s.typed_by(name)) => {
                    let scalar = matches!(kind, "counter" | "gauge" | "untyped");
                    grouped |= !scalar;
                    (grouped, None)
                }
                _ => (false, None),
            },
        };
        let (keep, bucket_of) = if only_read {
            (keep, bucket_of)
        } else {
            (true, None)
        };
        // TTFT buckets are most of the lines kept, yet only read when `_count` is missing
        // (see ttft_totals): checked as unread ones, read (and checked) only then.
        if let Some((name, rest)) = sample.filter(|_| !keep || bucket_of.is_some()) {
            if let Err(reason) = check_unread(name, rest) {
                // An earlier line may be bad too: the first one is the one to name.
                let earlier = kept.iter().filter(|k| k.bucket_of.is_none());
                return Err(first_bad(earlier).unwrap_or_else(|| syntax(i + 1, line, reason)));
            }
            unread_samples |= !keep;
        }
        if keep {
            kept.push(Kept {
                number: i + 1,
                line,
                text: for_parser(line),
                sample: sample.is_some(),
                bucket_of,
            });
        }
    }
    let mut samples = read_lines(kept.iter().filter(|k| k.bucket_of.is_none()))?;
    let count_missing = specs.iter().filter_map(|s| s.ttft).any(|f| {
        kept.iter().any(|k| k.bucket_of == Some(f))
            && scalars(&samples, &format!("{f}_count")).is_empty()
    });
    if count_missing {
        samples = read_lines(kept.iter())?;
    }
    if samples.is_empty() && !unread_samples {
        return Err(DialectError::NoSamples);
    }
    Ok(Exposition { samples, marks })
}

/// Marks the dialects a sample name shows; whether some spec reads it, and the TTFT family
/// if it is one's bucket.
fn classify(specs: &[Spec], marks: &mut [bool], name: &str) -> (bool, Option<&'static str>) {
    let (mut reads, mut bucket_of) = (false, None);
    for (mark, spec) in marks.iter_mut().zip(specs) {
        if spec.marked_by(name) {
            *mark = true;
        } else if spec.prefix.is_some() {
            // It reads only names with its prefix (see spec_names_have_their_prefix).
            continue;
        }
        if spec.reads(name) {
            reads = true;
            bucket_of = bucket_of.or(spec.ttft_bucket(name));
        }
    }
    (reads, bucket_of)
}

/// What prometheus-parse reads of these lines, refusing the lines it would skip.
fn read_lines<'a>(
    lines: impl Iterator<Item = &'a Kept<'a>> + Clone,
) -> Result<Samples, DialectError> {
    let scrape = Scrape::parse(lines.clone().map(|k| Ok(k.text.clone())))
        .map_err(|_| DialectError::NoSamples)?;
    // Each sample line it reads is one value (or one bucket or quantile of one), so fewer
    // values than lines means it skipped some: only then is each line checked (the check
    // runs its regexes again), to find the first culprit.
    let values: usize = scrape
        .samples
        .iter()
        .map(|s| match &s.value {
            Value::Histogram(b) => b.len(),
            Value::Summary(q) => q.len(),
            _ => 1,
        })
        .sum();
    if values < lines.clone().filter(|k| k.sample).count() {
        if let Some(e) = first_bad(lines) {
            return Err(e);
        }
        // Else it dropped a bucket without `le` or the like, as it always has.
    }
    let mut by_name = Samples::new();
    for s in scrape.samples {
        by_name
            .entry(s.metric.replace(COLON, ":"))
            .or_default()
            .push(s);
    }
    Ok(by_name)
}

/// The first of these lines prometheus-parse would not read as it is meant.
fn first_bad<'a>(mut lines: impl Iterator<Item = &'a Kept<'a>>) -> Option<DialectError> {
    lines.find_map(|k| {
        check_line(&k.text)
            .err()
            .map(|reason| syntax(k.number, k.line, reason))
    })
}

fn syntax(number: usize, line: &str, reason: &'static str) -> DialectError {
    DialectError::Syntax {
        line: number,
        reason,
        excerpt: excerpt(line),
    }
}

/// A line prometheus-parse will read as it is meant: blank, a comment, or a sample whose
/// value is a number. Anything else it would skip without a word.
fn check_line(line: &str) -> Result<(), &'static str> {
    let t = line.trim();
    if t.is_empty() || t.starts_with('#') {
        return Ok(());
    }
    match LineInfo::parse(t) {
        LineInfo::Sample { value, .. } if is_number(value) => Ok(()),
        LineInfo::Sample { .. } => Err("the value is not a number"),
        _ => Err("not a sample"),
    }
}

/// prometheus-parse's own reading of a value: "NaN" in any case, else Rust's f64.
fn is_number(value: &str) -> bool {
    value.eq_ignore_ascii_case("nan") || value.parse::<f64>().is_ok()
}

/// A sample line by the text format: a name, maybe a label set, a number (then anything, as
/// prometheus-parse allows). The reasons are those of [`check_line`].
fn check_unread(name: &str, mut rest: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("not a sample");
    }
    if let Some(labels) = rest.strip_prefix('{') {
        rest = after_labels(labels).ok_or("not a sample")?;
    }
    if !rest.starts_with(char::is_whitespace) {
        return Err("not a sample");
    }
    match rest.split_whitespace().next() {
        Some(value) if is_number(value) => Ok(()),
        Some(_) => Err("the value is not a number"),
        None => Err("not a sample"),
    }
}

/// What follows the '}' closing a label set (`s` starts after its '{'), quotes and escapes
/// minded; None if it is never closed.
fn after_labels(s: &str) -> Option<&str> {
    // Without escapes, a '}' is outside quotes after an even number of them: the common case.
    let first = s.find('}')?;
    let inside = &s[..first];
    if !inside.contains('\\') && inside.bytes().filter(|&b| b == b'"').count() % 2 == 0 {
        return Some(&s[first + 1..]);
    }
    let (mut quoted, mut escaped) = (false, false);
    for (i, b) in s.bytes().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            b'}' if !quoted => return Some(&s[i + 1..]),
            _ => {}
        }
    }
    None
}

/// The metric name and type of a `# TYPE` line (loosely: keeping one too many is harmless).
fn type_line(t: &str) -> Option<(&str, &str)> {
    let rest = t.strip_prefix('#')?.trim_start().strip_prefix("TYPE")?;
    let (name, rest) = split_name(rest.trim_start());
    Some((name, split_name(rest.trim_start()).0))
}

/// A kept line as prometheus-parse reads it as meant: ':' replaced in the metric name of a
/// sample line or of a `# HELP`/`# TYPE` line, and a sample's label set rewritten by
/// [`labels_for_parser`] (an empty one dropped: prometheus-parse does not read `name{} 1`).
/// A label set that is not one by the text format is left for prometheus-parse to read as
/// it does (see [`first_bad`]).
fn for_parser(line: &str) -> String {
    let rest = line.trim_start();
    let name_at = match rest.strip_prefix('#') {
        // "#", spaces, keyword, spaces, name, rest.
        Some(after_hash) => {
            let after_sp1 = after_hash.trim_start();
            let kw_len = after_sp1
                .find(char::is_whitespace)
                .unwrap_or(after_sp1.len());
            let (kw, after_kw) = after_sp1.split_at(kw_len);
            if kw != "HELP" && kw != "TYPE" {
                return line.to_string();
            }
            line.len() - after_kw.trim_start().len()
        }
        None => line.len() - rest.len(),
    };
    let (name, tail) = split_name(&line[name_at..]);
    let mut out = String::with_capacity(line.len() + 8);
    out.push_str(&line[..name_at]);
    for (i, part) in name.split(':').enumerate() {
        if i > 0 {
            out.push(COLON);
        }
        out.push_str(part);
    }
    let labels = tail.strip_prefix('{').filter(|_| !rest.starts_with('#'));
    // An empty set followed by the name's continuation (`a{}_ 1`) is not a sample: dropped,
    // it would join the two into a name that is one (`a_ 1`).
    let joins = |(labels, after): &(String, &str)| {
        labels.is_empty() && !after.starts_with(char::is_whitespace)
    };
    match labels.and_then(labels_for_parser).filter(|l| !joins(l)) {
        Some((labels, after)) => {
            if !labels.is_empty() {
                out.push('{');
                out.push_str(&labels);
                out.push('}');
            }
            out.push_str(after);
        }
        None => out.push_str(tail),
    }
    out
}

/// A sample's label set (`s` starts after its '{') for prometheus-parse, and what follows
/// its '}'; None if it is not a label set by the text format (`name="value"` pairs, commas
/// between, `\\`, `\"` and `\n` escapes). prometheus-parse splits pairs at every ',' and '='
/// and ends the set at the first '}', quoted or not: so each value is unescaped, then those
/// characters, '"', '\\', '%' and line breaks in it are percent-encoded. Distinct values stay
/// distinct (the agent only compares them, as a series' key, see [`series_key`]) and numbers
/// (`le`) stay as they are. Spaces between pairs go.
fn labels_for_parser(s: &str) -> Option<(String, &str)> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s.trim_start();
    loop {
        if let Some(after) = rest.strip_prefix('}') {
            return Some((out, after));
        }
        let name_len = rest
            .bytes()
            .position(|b| !(b.is_ascii_alphanumeric() || b == b'_'))
            .unwrap_or(rest.len());
        let (name, after) = rest.split_at(name_len);
        if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
            return None;
        }
        let value = after
            .trim_start()
            .strip_prefix('=')?
            .trim_start()
            .strip_prefix('"')?;
        if !out.is_empty() {
            out.push(',');
        }
        out.push_str(name);
        out.push_str("=\"");
        let mut chars = value.char_indices();
        let end = loop {
            let c = match chars.next()? {
                (i, '"') => break i + 1,
                (_, '\\') => match chars.next()?.1 {
                    'n' => '\n',
                    c @ ('\\' | '"') => c,
                    // Not an escape: Prometheus keeps both characters.
                    c => {
                        percent_encode('\\', &mut out);
                        c
                    }
                },
                (_, c) => c,
            };
            percent_encode(c, &mut out);
        };
        out.push('"');
        rest = value[end..].trim_start();
        if let Some(after_comma) = rest.strip_prefix(',') {
            rest = after_comma.trim_start();
        } else if !rest.starts_with('}') {
            return None;
        }
    }
}

/// `c`, percent-encoded if prometheus-parse would misread it in a label value.
fn percent_encode(c: char, out: &mut String) {
    match c {
        '%' | ',' | '=' | '}' | '"' | '\\' | '\n' | '\r' => {
            out.push_str(&format!("%{:02X}", u32::from(c)));
        }
        c => out.push(c),
    }
}

/// A metric name (`[a-zA-Z0-9_:]*`) at the start of `s`, and the rest.
fn split_name(s: &str) -> (&str, &str) {
    const IN_NAME: [bool; 256] = {
        let mut t = [false; 256];
        let mut b = 0;
        while b < 256 {
            let c = b as u8;
            t[b] = c.is_ascii_alphanumeric() || c == b'_' || c == b':';
            b += 1;
        }
        t
    };
    let n = s
        .bytes()
        .position(|b| !IN_NAME[b as usize])
        .unwrap_or(s.len());
    s.split_at(n)
}

fn excerpt(line: &str) -> String {
    const MAX: usize = 60;
    let t = line.trim();
    match t.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}...", &t[..i]),
        None => t.to_string(),
    }
}

/// The one dialect whose names appear; none or several is an error.
fn detect(specs: &[Spec], marks: &[bool]) -> Result<Dialect, DialectError> {
    let mut found: Option<Dialect> = None;
    for (spec, _) in specs.iter().zip(marks).filter(|(_, &marked)| marked) {
        if let Some(first) = found {
            return Err(DialectError::Ambiguous(first, spec.dialect));
        }
        found = Some(spec.dialect);
    }
    found.ok_or(DialectError::UnknownDialect)
}

fn read(spec: &Spec, samples: &Samples) -> Result<Reading, DialectError> {
    let d = spec.dialect;
    // Several label sets (engines, data-parallel ranks, models) are parts of one server: the
    // requests add up.
    let running = sum(d, spec.running, required(d, spec.running, samples)?)?;
    let waiting = sum(d, spec.waiting, required(d, spec.waiting, samples)?)?;
    // A bad value in an optional signal costs that signal, not the scrape: the queue the
    // required ones show is what keeps a server from overheating.
    let mut ignored = None;
    let kv_usage = kv_usage(d, spec, samples).unwrap_or_else(|e| {
        ignored = Some(e);
        None
    });
    let ttft = spec
        .ttft
        .and_then(|family| ttft_series(d, family, samples, &mut ignored));
    let progress = progress(d, spec, samples).unwrap_or_else(|e| {
        ignored = ignored.take().or(Some(e));
        None
    });
    Ok(Reading {
        dialect: d,
        running,
        waiting,
        kv_usage,
        ttft,
        progress,
        ignored,
    })
}

/// The sum of every present progress counter; `None` when none is present yet.
fn progress(d: Dialect, spec: &Spec, samples: &Samples) -> Result<Option<f64>, DialectError> {
    let mut total = None;
    for &name in spec.progress {
        let values = scalars(samples, name);
        if !values.is_empty() {
            let t = total.unwrap_or(0.0) + sum(d, name, values)?;
            // Finite sums of two counters can add up to infinity too.
            check(d, name, t)?;
            total = Some(t);
        }
    }
    Ok(total)
}

fn kv_usage(d: Dialect, spec: &Spec, samples: &Samples) -> Result<Option<f64>, DialectError> {
    let Some((name, values)) = spec
        .kv
        .iter()
        .map(|&name| (name, scalars(samples, name)))
        .find(|(_, values)| !values.is_empty())
    else {
        return Ok(None);
    };
    // Each engine has its own KV cache, and the fullest one is what saturates first (it
    // starts preempting or queueing), so the server's figure is the maximum, not a sum or a
    // mean.
    let mut max = 0.0_f64;
    for v in values {
        check(d, name, v)?;
        if v > 1.0 + KV_TOLERANCE {
            return Err(bad(d, name, v, "a fraction above 1"));
        }
        max = max.max(v);
    }
    Ok(Some(max.min(1.0)))
}

fn required(d: Dialect, name: &'static str, samples: &Samples) -> Result<Vec<f64>, DialectError> {
    let values = scalars(samples, name);
    if values.is_empty() {
        return Err(DialectError::Missing {
            dialect: d,
            metric: name,
        });
    }
    Ok(values)
}

/// The values of a counter, gauge or untyped metric, one per label set.
fn scalars(samples: &Samples, name: &str) -> Vec<f64> {
    samples
        .get(name)
        .into_iter()
        .flatten()
        .filter_map(|s| scalar(&s.value))
        .collect()
}

/// A sample's value when it is one number: a counter, gauge or untyped sample.
fn scalar(value: &Value) -> Option<f64> {
    match *value {
        Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => Some(v),
        Value::Histogram(_) | Value::Summary(_) => None,
    }
}

fn sum(d: Dialect, name: &str, values: Vec<f64>) -> Result<f64, DialectError> {
    let mut total = 0.0;
    for v in values {
        check(d, name, v)?;
        total += v;
    }
    // Finite values can add up to infinity (two label sets of 1e308).
    check(d, name, total)?;
    Ok(total)
}

fn check(d: Dialect, name: &str, v: f64) -> Result<(), DialectError> {
    if v.is_nan() {
        Err(bad(d, name, v, "not a number"))
    } else if v.is_infinite() {
        Err(bad(d, name, v, "infinite"))
    } else if v < 0.0 {
        Err(bad(d, name, v, "negative"))
    } else {
        Ok(())
    }
}

fn bad(dialect: Dialect, metric: &str, value: f64, why: &'static str) -> DialectError {
    DialectError::BadValue {
        dialect,
        metric: metric.to_string(),
        value,
        why,
    }
}

/// A histogram's totals per label set. prometheus-parse 0.2.5 groups the `_bucket` lines of
/// a `# TYPE ... histogram` into one `Value::Histogram` per label set (bucket counts only, no
/// sum), and leaves `_sum` and `_count` as separate untyped samples; without the TYPE line
/// the buckets stay untyped `_bucket` samples. So: the sum from `_sum`, the count from
/// `_count`, or failing that from the `+Inf` buckets in either form; a label set needs both.
/// A label set with a value that is not a finite non-negative number is left out, and the
/// first such fault kept in `ignored` (if none is there yet).
fn ttft_series(
    d: Dialect,
    family: &str,
    samples: &Samples,
    ignored: &mut Option<DialectError>,
) -> Option<TtftSeries> {
    let sum_name = format!("{family}_sum");
    let count_name = format!("{family}_count");
    let sums = labelled(samples, &sum_name);
    let mut counts = labelled(samples, &count_name);
    let mut count_metric = count_name;
    if counts.is_empty() {
        counts = inf_buckets(samples, family);
        count_metric = format!("{family}_bucket{{le=\"+Inf\"}}");
    }
    let mut series = BTreeMap::new();
    for (labels, sum_s) in sums {
        let Some(&count) = counts.get(&labels) else {
            continue;
        };
        match check(d, &sum_name, sum_s).and_then(|()| check(d, &count_metric, count)) {
            Ok(()) => {
                series.insert(labels, TtftTotals { sum_s, count });
            }
            Err(e) => {
                ignored.get_or_insert(e);
            }
        }
    }
    (!series.is_empty()).then_some(TtftSeries(series))
}

/// A label set as a key: its pairs other than `le`, sorted.
fn series_key(labels: &prometheus_parse::Labels) -> String {
    let pairs: BTreeMap<_, _> = labels.iter().filter(|(k, _)| *k != "le").collect();
    let pairs: Vec<String> = pairs
        .into_iter()
        .map(|(k, v)| format!("{k}={v:?}"))
        .collect();
    pairs.join(",")
}

/// The values of a counter, gauge or untyped metric by label set.
fn labelled(samples: &Samples, name: &str) -> BTreeMap<String, f64> {
    samples
        .get(name)
        .into_iter()
        .flatten()
        .filter_map(|s| Some((series_key(&s.labels), scalar(&s.value)?)))
        .collect()
}

fn inf_buckets(samples: &Samples, family: &str) -> BTreeMap<String, f64> {
    let grouped = samples.get(family).into_iter().flatten().filter_map(|s| {
        let Value::Histogram(buckets) = &s.value else {
            return None;
        };
        buckets
            .iter()
            .find(|b| b.less_than == f64::INFINITY)
            .map(|b| (series_key(&s.labels), b.count))
    });
    let loose = samples
        .get(&format!("{family}_bucket"))
        .into_iter()
        .flatten()
        .filter(|s| {
            s.labels
                .get("le")
                .is_some_and(|le| le.parse::<f64>() == Ok(f64::INFINITY))
        })
        .filter_map(|s| Some((series_key(&s.labels), scalar(&s.value)?)));
    grouped.chain(loose).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM 0.10-style V1 server with two engine cores (data parallel), as prometheus_client
    /// prints it: HELP/TYPE lines, `_created` samples, process and python metrics around.
    const VLLM_TWO_ENGINES: &str = r#"# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12934.0
python_gc_objects_collected_total{generation="1"} 1771.0
python_gc_objects_collected_total{generation="2"} 1123.0
# HELP python_info Python platform information
# TYPE python_info gauge
python_info{implementation="CPython",major="3",minor="12",patchlevel="3",version="3.12.3"} 1.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.823571968e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use vllm:kv_cache_usage_perc instead.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.1
vllm:gpu_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.1
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.4211
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.8125
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 183224.0
vllm:prompt_tokens_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 171102.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 201334.0
vllm:generation_tokens_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 198810.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7528427346414855e+09
vllm:prompt_tokens_created{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7528427346415e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 90.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 6.5
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.04",model_name="meta-llama/Llama-3.1-8B-Instruct"} 20.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="2560.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 60.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 60.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 60.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.5
# HELP vllm:time_to_first_token_seconds_created Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds_created gauge
vllm:time_to_first_token_seconds_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7528427346418e+09
vllm:time_to_first_token_seconds_created{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7528427346419e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="27689",prefix_caching_hash_algo="builtin",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 1804.0
"#;

    /// vLLM 0.6 (V0): no engine label, the old KV gauge only.
    const VLLM_V0: &str = r#"# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="/models/llama-2-7b"} 3.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="/models/llama-2-7b"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="/models/llama-2-7b"} 1.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="/models/llama-2-7b"} 0.25
# HELP vllm:cpu_cache_usage_perc CPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:cpu_cache_usage_perc gauge
vllm:cpu_cache_usage_perc{model_name="/models/llama-2-7b"} 0.0
"#;

    /// SGLang, as in its production-metrics docs (`_sum` before the buckets).
    const SGLANG: &str = r#"# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.557572e+06
# HELP sglang:realtime_tokens_total Total number of tokens processed (updated on each log interval).
# TYPE sglang:realtime_tokens_total counter
sglang:realtime_tokens_total{mode="prefill_compute",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.1e+06
sglang:realtime_tokens_total{mode="prefill_cache",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0e+06
sglang:realtime_tokens_total{mode="decode",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.6e+06
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.007507552643049313
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.3518979474117756e+06
sglang:time_to_first_token_seconds_bucket{le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
sglang:time_to_first_token_seconds_bucket{le="0.04",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
sglang:time_to_first_token_seconds_bucket{le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.632e+06
sglang:time_to_first_token_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.632e+06
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 162.0
# HELP sglang:num_used_tokens The number of used tokens
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 123859.0
# HELP sglang:gen_throughput The generate throughput (token/s)
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="meta-llama/Llama-3.1-8B-Instruct"} 86.50814177726902
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2826.0
"#;

    /// TGI's router (metrics-exporter-prometheus): no colons, no labels on the gauges.
    const TGI: &str = r#"# HELP tgi_request_count Total number of requests received
# TYPE tgi_request_count counter
tgi_request_count 412
# HELP tgi_request_success Number of successful requests
# TYPE tgi_request_success counter
tgi_request_success 401
# HELP tgi_batch_inference_success Number of successful inferences
# TYPE tgi_batch_inference_success counter
tgi_batch_inference_success{method="prefill"} 415
tgi_batch_inference_success{method="decode"} 90211
# HELP tgi_queue_size Current queue size
# TYPE tgi_queue_size gauge
tgi_queue_size 6
# HELP tgi_batch_current_size Current batch size
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 32
# HELP tgi_batch_current_max_tokens Maximum tokens for the current batch
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 18432
# HELP tgi_request_duration Total time spent processing the request (e2e latency)
# TYPE tgi_request_duration histogram
tgi_request_duration_bucket{le="0.01"} 0
tgi_request_duration_bucket{le="1"} 12
tgi_request_duration_bucket{le="+Inf"} 401
tgi_request_duration_sum 2405.1123
tgi_request_duration_count 401
"#;

    /// llama.cpp's server-task.cpp, verbatim format (no labels; C++ stream formatting).
    const LLAMACPP: &str = "\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 4211
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 1.23457e+06
# HELP llamacpp:prompt_seconds_total Total time spent processing prompts
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 3.712
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 9102
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 13231
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 1134.4
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 98.7
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 3.5
";

    /// trtllm-serve's /prometheus/metrics (prometheus_client in multiprocess mode, plus the
    /// FastAPI instrumentator's http metrics).
    const TRTLLM: &str = r#"# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/v1/chat/completions",method="POST",status="200"} 96.0
# HELP trtllm_time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE trtllm_time_to_first_token_seconds histogram
trtllm_time_to_first_token_seconds_sum{engine_type="undefined",model_name="undefined"} 24.0
trtllm_time_to_first_token_seconds_bucket{engine_type="undefined",le="0.001",model_name="undefined"} 0.0
trtllm_time_to_first_token_seconds_bucket{engine_type="undefined",le="0.25",model_name="undefined"} 80.0
trtllm_time_to_first_token_seconds_bucket{engine_type="undefined",le="+Inf",model_name="undefined"} 96.0
trtllm_time_to_first_token_seconds_count{engine_type="undefined",model_name="undefined"} 96.0
# HELP trtllm_kv_cache_utilization KV cache utilization
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{engine_type="undefined",model_name="undefined"} 0.55
# HELP trtllm_num_requests_running Number of active requests
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{engine_type="undefined",model_name="undefined"} 12.0
# HELP trtllm_num_requests_waiting Number of queued requests
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{engine_type="undefined",model_name="undefined"} 0.0
"#;

    const PLAIN: &str = "\
# HELP inference_requests_running Requests being generated.
# TYPE inference_requests_running gauge
inference_requests_running 2
# HELP inference_requests_waiting Requests queued.
# TYPE inference_requests_waiting gauge
inference_requests_waiting 0
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
";

    fn ok(body: &str) -> Reading {
        parse(body, None).unwrap_or_else(|e| panic!("{e}"))
    }

    fn err(body: &str) -> DialectError {
        parse(body, None).expect_err("should not parse")
    }

    #[test]
    fn prometheus_parse_drops_colon_names_by_itself() {
        // The reason for for_parser's colons: if this starts failing, the crate was fixed.
        let raw = "# TYPE vllm:x gauge\nvllm:x 1\nplain_y 2\n";
        let s = Scrape::parse(raw.lines().map(|l| Ok(l.to_string()))).unwrap();
        let names: Vec<_> = s.samples.iter().map(|s| s.metric.as_str()).collect();
        assert_eq!(names, ["plain_y"]);
        assert!(COLON.is_alphabetic() && !COLON.is_ascii());
    }

    #[test]
    fn vllm_several_engines() {
        let r = ok(VLLM_TWO_ENGINES);
        assert_eq!(r.dialect, Dialect::Vllm);
        assert_eq!(r.running, 12.0); // 7 + 5
        assert_eq!(r.waiting, 2.0);
        // The fuller engine, and the new gauge rather than the deprecated one.
        assert_eq!(r.kv_usage, Some(0.8125));
        assert_eq!(r.progress, Some(201334.0 + 198810.0));
        assert_eq!(
            r.ttft.map(|t| t.total()),
            Some(TtftTotals {
                sum_s: 10.0,
                count: 160.0
            })
        );
    }

    #[test]
    fn vllm_v0_old_kv_gauge_no_ttft() {
        let r = ok(VLLM_V0);
        assert_eq!(r.dialect, Dialect::Vllm);
        assert_eq!((r.running, r.waiting), (3.0, 1.0));
        assert_eq!(r.kv_usage, Some(0.25));
        assert_eq!(r.ttft, None);
        assert_eq!(r.progress, None);
    }

    #[test]
    fn sglang() {
        let r = ok(SGLANG);
        assert_eq!(r.dialect, Dialect::Sglang);
        assert_eq!((r.running, r.waiting), (162.0, 2826.0));
        assert_eq!(r.kv_usage, Some(0.28));
        // Every mode of the per-step counter; not generation_tokens_total, moved at the end.
        assert_eq!(r.progress, Some(5.1e6 + 3.0e6 + 7.6e6));
        let t = r.ttft.unwrap().total();
        assert_eq!(t.count, 7.632e6);
        assert!((t.sum_s - 2.3518979474117756e6).abs() < 1e-6);
    }

    #[test]
    fn tgi() {
        let r = ok(TGI);
        assert_eq!(
            r,
            Reading {
                dialect: Dialect::Tgi,
                running: 32.0,
                waiting: 6.0,
                kv_usage: None,
                ttft: None,
                progress: Some(415.0 + 90211.0),
                ignored: None
            }
        );
    }

    #[test]
    fn llamacpp() {
        let r = ok(LLAMACPP);
        assert_eq!(
            r,
            Reading {
                dialect: Dialect::Llamacpp,
                running: 4.0,
                waiting: 3.0,
                kv_usage: None,
                ttft: None,
                progress: Some(13231.0),
                ignored: None
            }
        );
    }

    #[test]
    fn trtllm() {
        let r = ok(TRTLLM);
        assert_eq!(r.dialect, Dialect::Trtllm);
        assert_eq!((r.running, r.waiting), (12.0, 0.0));
        assert_eq!(r.kv_usage, Some(0.55));
        assert_eq!(
            r.progress, None,
            "its counters move only when a request ends"
        );
        assert_eq!(
            r.ttft.map(|t| t.total()),
            Some(TtftTotals {
                sum_s: 24.0,
                count: 96.0
            })
        );
    }

    #[test]
    fn plain() {
        let r = ok(PLAIN);
        assert_eq!(
            r,
            Reading {
                dialect: Dialect::Plain,
                running: 2.0,
                waiting: 0.0,
                kv_usage: None,
                ttft: None,
                progress: None,
                ignored: None
            }
        );
    }

    #[test]
    fn progress_before_its_series_appear_and_when_bad() {
        // TGI and SGLang create the series at the first batch: no progress signal yet.
        let fresh = TGI.replace(
            "tgi_batch_inference_success{method=\"",
            "tgi_other{method=\"",
        );
        assert_eq!(ok(&fresh).progress, None);
        // One of SGLang's two counters is enough.
        let graphs = SGLANG.replace(
            "sglang:realtime_tokens_total{mode=\"decode\",",
            "sglang:cuda_graph_passes_total{mode=\"decode_cuda_graph\",",
        );
        assert_eq!(ok(&graphs).progress, Some(5.1e6 + 3.0e6 + 7.6e6));
        // A bad value costs the signal, not the reading.
        for bad in ["NaN", "-1", "+Inf"] {
            let body = LLAMACPP.replace(
                "llamacpp:n_decode_total 13231",
                &format!("llamacpp:n_decode_total {bad}"),
            );
            let r = ok(&body);
            assert_eq!(
                (r.running, r.waiting, r.progress),
                (4.0, 3.0, None),
                "{bad}"
            );
            assert!(
                matches!(&r.ignored, Some(DialectError::BadValue { metric, .. }) if metric == "llamacpp:n_decode_total"),
                "{bad}: {:?}",
                r.ignored
            );
        }
    }

    #[test]
    fn crlf_bom_indent_and_empty_label_set() {
        let body = "\u{feff}# TYPE llamacpp:requests_processing gauge\r\n  llamacpp:requests_processing{} 1\r\nllamacpp:requests_deferred 2 1700000000000\r\n";
        let r = ok(body);
        assert_eq!((r.running, r.waiting), (1.0, 2.0));
    }

    #[test]
    fn forced_dialect() {
        // Forcing the right one reads it; forcing another says what is missing.
        assert_eq!(
            parse(SGLANG, Some(Dialect::Sglang)).unwrap().dialect,
            Dialect::Sglang
        );
        assert_eq!(
            parse(SGLANG, Some(Dialect::Vllm)).unwrap_err().to_string(),
            "vllm: no vllm:num_requests_running"
        );
        // Forcing settles a body that speaks two dialects.
        let both = format!("{VLLM_V0}{PLAIN}");
        assert_eq!(
            err(&both),
            DialectError::Ambiguous(Dialect::Vllm, Dialect::Plain)
        );
        let r = parse(&both, Some(Dialect::Plain)).unwrap();
        assert_eq!((r.dialect, r.running), (Dialect::Plain, 2.0));
        let r = parse(&both, Some(Dialect::Vllm)).unwrap();
        assert_eq!((r.dialect, r.running), (Dialect::Vllm, 3.0));
    }

    #[test]
    fn missing_required_metric() {
        let body: String = VLLM_V0
            .lines()
            .filter(|l| !l.contains("vllm:num_requests_waiting"))
            .map(|l| format!("{l}\n"))
            .collect();
        let e = err(&body);
        assert_eq!(e.to_string(), "vllm: no vllm:num_requests_waiting");
        // Declared but without a sample is missing too.
        let e = err("# HELP tgi_queue_size Current queue size\n# TYPE tgi_queue_size gauge\ntgi_batch_current_size 1\n");
        assert_eq!(e.to_string(), "tgi: no tgi_queue_size");
    }

    #[test]
    fn no_known_dialect() {
        let e = err("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3\n");
        assert_eq!(e, DialectError::UnknownDialect);
        let msg = e.to_string();
        assert!(msg.starts_with("no known metric dialect: expected one of vllm:num_requests_running, sglang:num_running_reqs,"), "{msg}");
        assert!(msg.contains("inference_requests_running"), "{msg}");
    }

    #[test]
    fn empty_and_comment_only_bodies() {
        assert_eq!(err(""), DialectError::Empty);
        assert_eq!(err(" \n\r\n\t\n"), DialectError::Empty);
        assert_eq!(
            err("# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"),
            DialectError::NoSamples
        );
        assert_eq!(
            DialectError::NoSamples.to_string(),
            "not Prometheus text: no samples"
        );
    }

    #[test]
    fn garbage() {
        let html = "<!DOCTYPE html>\n<html><body><h1>404 Not Found</h1></body></html>\n";
        let e = err(html);
        assert_eq!(
            e.to_string(),
            "not Prometheus text: line 1: not a sample: \"<!DOCTYPE html>\""
        );
        let e = err("hello world\n");
        assert_eq!(
            e.to_string(),
            "not Prometheus text: line 1: the value is not a number: \"hello world\""
        );
        assert_eq!(
            err("{\"iter\": 12, \"numActiveRequests\": 3}"),
            DialectError::Json
        );
        assert_eq!(err("[{\"iter\": 12}]"), DialectError::Json);
        // A good exposition with one bad line is bad as a whole (as in Prometheus).
        let e = err(&format!("{PLAIN}inference_requests_waiting three\n"));
        assert!(
            matches!(
                e,
                DialectError::Syntax {
                    line: 10,
                    reason: "the value is not a number",
                    ..
                }
            ),
            "{e}"
        );
        // Long lines are cut in the message.
        let long = format!("{}\n", "x".repeat(500));
        let msg = err(&long).to_string();
        assert!(msg.len() < 140 && msg.ends_with("...\""), "{msg}");
    }

    #[test]
    fn truncated_body() {
        // Cut in a name, in the labels, or right after the name: the last line is not a sample.
        let cut_at = |needle: &str, extra: usize| {
            let i = VLLM_TWO_ENGINES.find(needle).unwrap() + extra;
            VLLM_TWO_ENGINES[..i].to_string()
        };
        for body in [
            cut_at("vllm:num_requests_waiting{engine=\"1\"", 20),
            cut_at("vllm:num_requests_waiting{engine=\"1\"", 40),
            cut_at("vllm:num_requests_waiting{engine=\"1\"", 25),
        ] {
            let e = err(&body);
            assert!(matches!(e, DialectError::Syntax { .. }), "{body:?}: {e}");
            let msg = e.to_string();
            assert!(msg.contains("vllm:num_requests_wa"), "{msg}");
        }
    }

    #[test]
    fn bad_values() {
        let plain = |running: &str| {
            format!("inference_requests_running {running}\ninference_requests_waiting 0\n")
        };
        for (v, why) in [
            ("NaN", "not a number"),
            ("nan", "not a number"),
            ("+Inf", "infinite"),
            ("-Inf", "infinite"),
            ("-1", "negative"),
        ] {
            match err(&plain(v)) {
                DialectError::BadValue {
                    dialect: Dialect::Plain,
                    metric,
                    why: w,
                    ..
                } => {
                    assert_eq!((metric.as_str(), w), ("inference_requests_running", why));
                }
                e => panic!("{v}: {e}"),
            }
        }
        assert_eq!(
            err(&plain("-1")).to_string(),
            "plain: inference_requests_running = -1: negative"
        );
        let overflowing = "inference_requests_running{a=\"1\"} 1e308\n\
                           inference_requests_running{a=\"2\"} 1e308\n\
                           inference_requests_waiting 0\n";
        assert_eq!(
            err(overflowing).to_string(),
            "plain: inference_requests_running = inf: infinite"
        );
        assert_eq!(
            err(&plain("NaN")).to_string(),
            "plain: inference_requests_running = NaN: not a number"
        );
        // Optional signals are checked as strictly as required ones, but a bad one is left
        // out (and said so), not the whole reading.
        let kv_nan = VLLM_V0.replace(
            "usage_perc{model_name=\"/models/llama-2-7b\"} 0.25",
            "usage_perc{model_name=\"/models/llama-2-7b\"} NaN",
        );
        let r = ok(&kv_nan);
        assert_eq!((r.running, r.waiting, r.kv_usage), (3.0, 1.0, None));
        assert_eq!(
            r.ignored.unwrap().to_string(),
            "vllm: vllm:gpu_cache_usage_perc = NaN: not a number"
        );
        let ttft_neg = TRTLLM.replace("} 24.0", "} -24.0");
        let r = ok(&ttft_neg);
        assert_eq!((r.running, r.kv_usage, r.ttft), (12.0, Some(0.55), None));
        assert_eq!(
            r.ignored.unwrap().to_string(),
            "trtllm: trtllm_time_to_first_token_seconds_sum = -24: negative"
        );
        assert_eq!(ok(TRTLLM).ignored, None);
        // One engine's bad TTFT leaves that engine out, not the other.
        let r = ok(&VLLM_TWO_ENGINES.replace("} 6.5", "} NaN"));
        let engines: Vec<_> = r.ttft.unwrap().0.into_iter().collect();
        assert_eq!(engines.len(), 1, "{engines:?}");
        assert!(engines[0].0.contains("engine=\"1\""), "{engines:?}");
        assert_eq!(
            engines[0].1,
            TtftTotals {
                sum_s: 3.5,
                count: 60.0
            }
        );
        assert!(r
            .ignored
            .unwrap()
            .to_string()
            .ends_with("= NaN: not a number"));
        // A value that moves while it stays wrong is one fault.
        let fault = |v: &str| err(&plain(v));
        assert!(fault("-1").same_fault(&fault("-2")));
        assert!(!fault("-1").same_fault(&fault("NaN")));
        assert!(!fault("-1").same_fault(&DialectError::NoSamples));
        // A bad value in an unrelated metric is none of our business.
        let other = format!("{PLAIN}some_ratio NaN\nsome_other -3\n");
        assert_eq!(ok(&other).running, 2.0);
    }

    #[test]
    fn kv_above_one() {
        let kv = |v: &str| TRTLLM.replace("} 0.55", &format!("}} {v}"));
        let ignored = |body: &str| {
            let r = ok(body);
            assert_eq!(r.kv_usage, None);
            r.ignored.unwrap().to_string()
        };
        assert_eq!(
            ignored(&kv("1.5")),
            "trtllm: trtllm_kv_cache_utilization = 1.5: a fraction above 1"
        );
        // A percentage where a fraction belongs is refused, not divided by 100.
        assert!(ignored(&kv("55")).ends_with("= 55: a fraction above 1"));
        // Rounding just above 1 is 1.
        assert_eq!(ok(&kv("1.004")).kv_usage, Some(1.0));
        assert_eq!(ok(&kv("1")).kv_usage, Some(1.0));
        assert_eq!(ok(&kv("0")).kv_usage, Some(0.0));
    }

    #[test]
    fn ttft_histogram_in_other_shapes() {
        // No TYPE line: the buckets stay loose `_bucket` samples; `_sum`/`_count` still count.
        let untyped: String = TRTLLM
            .lines()
            .filter(|l| !l.starts_with("# TYPE trtllm_time_to_first_token_seconds"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(
            ok(&untyped).ttft.map(|t| t.total()),
            Some(TtftTotals {
                sum_s: 24.0,
                count: 96.0
            })
        );
        // No `_count`: the +Inf bucket is the count, typed or not.
        let no_count = |body: &str| -> String {
            body.lines()
                .filter(|l| !l.contains("_seconds_count"))
                .map(|l| format!("{l}\n"))
                .collect()
        };
        assert_eq!(ok(&no_count(TRTLLM)).ttft.unwrap().total().count, 96.0);
        assert_eq!(ok(&no_count(&untyped)).ttft.unwrap().total().count, 96.0);
        assert_eq!(
            ok(&no_count(VLLM_TWO_ENGINES)).ttft.unwrap().total().count,
            160.0
        );
        // No `_sum`: no mean can be had.
        let no_sum: String = TRTLLM
            .lines()
            .filter(|l| !l.contains("_seconds_sum"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(ok(&no_sum).ttft, None);
    }

    #[test]
    fn ttft_delta() {
        let series = |sets: &[(&str, f64, f64)]| {
            Some(TtftSeries(
                sets.iter()
                    .map(|&(k, sum_s, count)| (k.to_string(), TtftTotals { sum_s, count }))
                    .collect(),
            ))
        };
        let t = |sum_s, count| series(&[("", sum_s, count)]);
        let ms = |prev: Option<TtftSeries>, cur: Option<TtftSeries>| {
            recent_ttft_ms(prev.as_ref(), cur.as_ref())
        };
        // 10 new observations taking 2.5 s in all: 250 ms each.
        assert_eq!(ms(t(10.0, 100.0), t(12.5, 110.0)), Some(250.0));
        // Nothing observed in between.
        assert_eq!(ms(t(10.0, 100.0), t(10.0, 100.0)), None);
        // Counters went backwards: the server restarted.
        assert_eq!(ms(t(10.0, 100.0), t(0.5, 3.0)), None);
        assert_eq!(ms(t(10.0, 100.0), t(9.0, 120.0)), None);
        // Nothing to compare with.
        assert_eq!(ms(None, t(1.0, 1.0)), None);
        assert_eq!(ms(t(1.0, 1.0), None), None);
        assert_eq!(ms(t(f64::NAN, 1.0), t(2.0, 2.0)), None);
        // One engine of two restarted: the other's 250 ms, not the totals' 1.7 s over one
        // observation.
        let before = series(&[("e0", 1.0, 10.0), ("e1", 10.0, 100.0)]);
        let after = series(&[("e0", 0.2, 1.0), ("e1", 12.5, 110.0)]);
        assert_eq!(ms(before.clone(), after), Some(250.0));
        // A label set new since: all it observed is recent.
        let after = series(&[("e0", 1.0, 10.0), ("e1", 10.0, 100.0), ("e2", 0.9, 3.0)]);
        assert_eq!(ms(before, after), Some(300.0));
        // Through parse: two scrapes of one vLLM server, with four more observations on
        // engine 0 taking 1.2 s...
        let engine0 = "_count{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 100.0";
        let before = ok(VLLM_TWO_ENGINES).ttft;
        let after = ok(&VLLM_TWO_ENGINES
            .replace(engine0, &engine0.replace("100.0", "104.0"))
            .replace("} 6.5", "} 7.7"))
        .ttft;
        let got = ms(before.clone(), after).unwrap();
        assert!((got - 300.0).abs() < 1e-9, "{got}");
        // ... or with engine 1 restarted meanwhile, which counts for nothing.
        let after = ok(&VLLM_TWO_ENGINES
            .replace(engine0, &engine0.replace("100.0", "104.0"))
            .replace("} 6.5", "} 7.7")
            .replace("} 3.5", "} 0.1")
            .replace(
                "_count{engine=\"1\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 60.0",
                "_count{engine=\"1\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 1.0",
            ))
        .ttft;
        let got = ms(before, after).unwrap();
        assert!((got - 300.0).abs() < 1e-9, "{got}");
    }

    #[test]
    fn dialect_names() {
        for d in Dialect::ALL {
            assert_eq!(d.as_str().parse::<Dialect>(), Ok(d));
            assert_eq!(d.to_string(), d.as_str());
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{d}\""));
            assert_eq!(serde_json::from_str::<Dialect>(&json).unwrap(), d);
        }
        assert!("vLLM".parse::<Dialect>().is_err());
        assert_eq!(Dialect::Trtllm.metrics_path(), "/prometheus/metrics");
        assert_eq!(Dialect::Vllm.metrics_path(), "/metrics");
    }

    #[test]
    fn filtered_parse_reads_as_the_whole_exposition() {
        // Every fixture, and the TTFT shapes where the buckets are needed, read the same
        // whether prometheus-parse sees every line or only those of the metrics read.
        let without = |body: &str, needle: &str| -> String {
            body.lines()
                .filter(|l| !l.contains(needle))
                .map(|l| format!("{l}\n"))
                .collect()
        };
        let fixtures = [
            VLLM_TWO_ENGINES,
            VLLM_V0,
            SGLANG,
            TGI,
            LLAMACPP,
            TRTLLM,
            PLAIN,
        ];
        for body in fixtures {
            assert!(parse(body, None).is_ok(), "{body}");
        }
        let mut bodies: Vec<String> = fixtures.map(String::from).to_vec();
        for body in [VLLM_TWO_ENGINES, SGLANG, TRTLLM] {
            let untyped = without(body, "# TYPE ");
            bodies.push(without(body, "_seconds_count"));
            bodies.push(without(&untyped, "_seconds_count"));
            bodies.push(untyped);
        }
        bodies.push(format!("{VLLM_V0}{PLAIN}"));
        // A TYPE line that makes a summary, alone and undone by a later one.
        let summary = "# TYPE inference_requests_running summary\n";
        let gauge = "# TYPE inference_requests_running gauge\n";
        let running =
            "inference_requests_running{quantile=\"0.5\"} 2\ninference_requests_waiting 0\n";
        assert!(matches!(
            parse(&format!("{summary}{running}"), None),
            Err(DialectError::Missing { .. })
        ));
        assert_eq!(ok(&format!("{summary}{gauge}{running}")).running, 2.0);
        bodies.push(format!("{summary}{running}"));
        bodies.push(format!("{summary}{gauge}{running}"));
        // A bucket without `le`, which prometheus-parse drops without a word (it always has).
        bodies.push(format!(
            "{}trtllm_time_to_first_token_seconds_bucket{{model_name=\"x\"}} 5\n",
            without(TRTLLM, "_seconds_count")
        ));
        for body in &bodies {
            for forced in [None].into_iter().chain(Dialect::ALL.map(Some)) {
                assert_eq!(
                    parse_lines(body, forced, true),
                    parse_lines(body, forced, false),
                    "{forced:?}\n{body}"
                );
            }
        }
    }

    #[test]
    fn spec_names_have_their_prefix() {
        for spec in &SPECS {
            let Some(prefix) = spec.prefix else { continue };
            let ttft = spec.ttft.iter().map(|f| format!("{f}_bucket"));
            for name in [spec.running, spec.waiting]
                .into_iter()
                .chain(spec.kv.iter().copied())
                .chain(spec.progress.iter().copied())
                .map(String::from)
                .chain(ttft)
            {
                assert!(name.starts_with(prefix), "{name}");
                assert!(spec.reads(&name), "{name}");
            }
        }
    }

    #[test]
    fn filter_leaves_out_what_is_not_read() {
        let read: Vec<String> = scan(VLLM_TWO_ENGINES, &SPECS, true)
            .unwrap()
            .samples
            .into_keys()
            .collect();
        let mut read: Vec<&str> = read.iter().map(String::as_str).collect();
        read.sort();
        // The buckets too: `_count` is there.
        assert_eq!(
            read,
            [
                "vllm:generation_tokens_total",
                "vllm:gpu_cache_usage_perc",
                "vllm:kv_cache_usage_perc",
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:time_to_first_token_seconds_count",
                "vllm:time_to_first_token_seconds_sum",
            ]
        );
    }

    #[test]
    fn unread_lines_need_only_be_samples() {
        // prometheus-parse alone cannot read these (a '}' in a label value), Prometheus can;
        // read or not, they do no harm.
        for line in [
            r#"http_requests_total{handler="/v1/models/{model_id}",method="GET"} 3"#,
            r#"odd{a="q\"}",b="\\"} 1 1700000000000"#,
        ] {
            let body = format!("{PLAIN}{line}\n");
            assert_eq!(ok(&body).running, 2.0, "{line}");
            assert_eq!(
                parse_lines(&body, None, false).unwrap(),
                ok(&body),
                "{line}"
            );
        }
        // Still refused: not a sample line at all (garbage, a body cut short), or no number.
        for (line, why) in [
            (r#"some_metric{a="1"#, "not a sample"),
            (r#"some_metric{a="}"#, "not a sample"),
            ("some_metric", "not a sample"),
            ("some_metric   ", "not a sample"),
            ("some_metric{a=\"1\"}1", "not a sample"),
            ("some_metric 1,5", "the value is not a number"),
            (":", "not a sample"),
        ] {
            match err(&format!("{PLAIN}{line}\n")) {
                DialectError::Syntax {
                    line: 10, reason, ..
                } => assert_eq!(reason, why, "{line}"),
                e => panic!("{line}: {e}"),
            }
        }
        // In a metric that is read, a label set that is not one is prometheus-parse's to
        // read: refused where it would skip the line.
        let e = err(&PLAIN.replace(
            "inference_requests_running 2",
            r#"inference_requests_running{a="1" 2"#,
        ));
        assert!(matches!(e, DialectError::Syntax { line: 3, .. }), "{e}");
        // The first bad line is named, read or not.
        let e = err(&format!(
            "{}<html>\n",
            PLAIN.replace(
                "inference_requests_running 2",
                r#"inference_requests_running{a="1" 2"#
            )
        ));
        assert!(matches!(e, DialectError::Syntax { line: 3, .. }), "{e}");
        // TTFT buckets are read only without `_count`, and held to prometheus-parse only then.
        let odd_bucket = TRTLLM.replace(
            r#"bucket{engine_type="undefined",le="0.25""#,
            r#"bucket{engine_type="}"x,le="0.25""#,
        );
        assert_eq!(ok(&odd_bucket).ttft.unwrap().total().count, 96.0);
        let no_count: String = odd_bucket
            .lines()
            .filter(|l| !l.contains("_seconds_count"))
            .map(|l| format!("{l}\n"))
            .collect();
        let e = err(&no_count);
        assert!(matches!(e, DialectError::Syntax { line: 8, .. }), "{e}");
    }

    #[test]
    fn label_values_read_as_meant() {
        // Two engines whose label values differ after a ',' (and '=', '}', escapes): two
        // series, where prometheus-parse alone would read one label set twice.
        for (a, b) in [
            ("0,a", "0,b"),
            ("x=1", "x=2"),
            ("{0}", "{1}"),
            (r#"q\"a"#, r#"q\\a"#),
            ("a%2C", "a,"),
            ("0", "0 "),
        ] {
            let body = VLLM_TWO_ENGINES
                .replace(r#"engine="0""#, &format!("engine=\"{a}\""))
                .replace(r#"engine="1""#, &format!("engine=\"{b}\""));
            let r = ok(&body);
            assert_eq!(r.running, ok(VLLM_TWO_ENGINES).running, "{a} {b}");
            let series = r.ttft.unwrap();
            assert_eq!(series.0.len(), 2, "{a} {b}: {series:?}");
            let totals = |s: &TtftSeries| {
                let mut t: Vec<_> = s.0.values().map(|t| (t.sum_s, t.count)).collect();
                t.sort_by(|a, b| a.partial_cmp(b).unwrap());
                t
            };
            assert_eq!(totals(&series), totals(&ok(VLLM_TWO_ENGINES).ttft.unwrap()));
        }
        // Spaces between pairs, a trailing comma, a '}' in a read metric's label value.
        for labels in [
            r#"{a="1", b="2"}"#,
            r#"{ a = "1" ,}"#,
            r#"{route="/v1/{id}"}"#,
        ] {
            let body = PLAIN.replace(
                "inference_requests_running 2",
                &format!("inference_requests_running{labels} 2"),
            );
            assert_eq!(ok(&body).running, 2.0, "{labels}");
        }
        assert_eq!(
            labels_for_parser(r#"b="x,y=z}", le="+Inf" } 3"#),
            Some((r#"b="x%2Cy%3Dz%7D",le="+Inf""#.to_string(), " 3"))
        );
        assert_eq!(
            labels_for_parser(r#"a="\"\\\n\d%"} 1"#),
            Some((r#"a="%22%5C%0A%5Cd%25""#.to_string(), " 1"))
        );
        for not_labels in [
            r#"a=1}"#,
            r#"a="1" b="2"}"#,
            r#"1a="1"}"#,
            r#"a="1",,}"#,
            r#"a="1"#,
        ] {
            assert_eq!(labels_for_parser(not_labels), None, "{not_labels}");
        }
        // An empty set goes; not when the name goes on after it, which is no sample.
        assert_eq!(for_parser("a{} 1"), "a 1");
        assert_eq!(for_parser("a{}_ NaN"), "a{}_ NaN");
        let joined = PLAIN.replace(
            "inference_requests_running 2",
            "inference{}_requests_running 2",
        );
        assert!(matches!(
            parse_lines(&joined, None, false),
            Err(DialectError::Syntax {
                line: _,
                reason: "not a sample",
                ..
            })
        ));
    }

    /// One change to an exposition: what a broken, truncated or hostile server might send.
    #[derive(Debug, Clone)]
    enum Edit {
        /// The value of line `at` (modulo the lines) replaced.
        Value(usize, &'static str),
        Drop(usize),
        Repeat(usize),
        /// Line `at` cut after `keep` characters.
        Cut(usize, usize),
        /// A line inserted before line `at`.
        Insert(usize, String),
    }

    const ODD_VALUES: [&str; 12] = [
        "NaN", "+Inf", "-Inf", "-1", "1e308", "0x10", "", "1.5e", "2", "0", "-0", "1e-320",
    ];

    fn edit() -> impl proptest::strategy::Strategy<Value = Edit> {
        use proptest::prelude::*;
        let at = 0..200usize;
        prop_oneof![
            (at.clone(), proptest::sample::select(&ODD_VALUES[..]))
                .prop_map(|(at, v)| Edit::Value(at, v)),
            at.clone().prop_map(Edit::Drop),
            at.clone().prop_map(Edit::Repeat),
            (at.clone(), 0..80usize).prop_map(|(at, keep)| Edit::Cut(at, keep)),
            (at, "[# a-z_:{}=\"0-9.\\ ]{0,40}").prop_map(|(at, l)| Edit::Insert(at, l)),
        ]
    }

    fn apply(body: &str, edits: &[Edit]) -> String {
        let mut lines: Vec<String> = body.lines().map(String::from).collect();
        for e in edits {
            if lines.is_empty() {
                break;
            }
            let n = lines.len();
            match e {
                Edit::Value(at, v) => {
                    let l = &mut lines[at % n];
                    if let Some(space) = l.rfind(' ') {
                        l.truncate(space + 1);
                        l.push_str(v);
                    }
                }
                Edit::Drop(at) => {
                    lines.remove(at % n);
                }
                Edit::Repeat(at) => lines.insert(at % n, lines[at % n].clone()),
                Edit::Cut(at, keep) => {
                    let l = &mut lines[at % n];
                    let cut: String = l.chars().take(*keep).collect();
                    *l = cut;
                }
                Edit::Insert(at, line) => lines.insert(at % n, line.clone()),
            }
        }
        lines.iter().map(|l| format!("{l}\n")).collect()
    }

    proptest::proptest! {
        /// Whatever a server sends, a reading is sane or there is none, and reading only the
        /// lines of the metrics read gives what reading every line gives wherever the whole
        /// exposition reads at all.
        #[test]
        fn broken_expositions_read_sanely_or_not_at_all(
            fixture in 0..7usize,
            edits in proptest::collection::vec(edit(), 0..6),
        ) {
            let fixtures = [VLLM_TWO_ENGINES, VLLM_V0, SGLANG, TGI, LLAMACPP, TRTLLM, PLAIN];
            let body = apply(fixtures[fixture], &edits);
            let filtered = parse_lines(&body, None, true);
            if let Ok(r) = &filtered {
                let sane = |v: f64| v.is_finite() && v >= 0.0;
                proptest::prop_assert!(sane(r.running) && sane(r.waiting), "{r:?}");
                proptest::prop_assert!(r.kv_usage.is_none_or(|k| (0.0..=1.0).contains(&k)), "{r:?}");
                proptest::prop_assert!(r.progress.is_none_or(sane), "{r:?}");
                for t in r.ttft.iter().flat_map(|t| t.0.values()) {
                    proptest::prop_assert!(sane(t.sum_s) && sane(t.count), "{r:?}");
                }
            }
            let whole = parse_lines(&body, None, false);
            if whole.is_ok() {
                // As text: a value left out for being NaN is not equal to itself.
                let (filtered, whole) = (format!("{filtered:?}"), format!("{whole:?}"));
                proptest::prop_assert_eq!(filtered, whole, "{}", body);
            }
        }
    }
}
