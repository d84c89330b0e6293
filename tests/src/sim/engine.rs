//! The simulated inference engine: a discrete model of a continuous-batching server.
//!
//! The model, step by step (the [`Engine`] is a plain state machine driven with explicit
//! times; [`Sim`] drives it in real time on a tokio task):
//! - Requests wait in a FIFO queue. Before each step the scheduler admits from the head while
//!   fewer than `max_running` sequences run and the KV cache has room: the head's prompt
//!   blocks (minus the leading blocks found in the prefix cache) plus room for its first
//!   generated token. The head is never overtaken, so a long prompt that does not fit holds
//!   the queue until memory frees (as vLLM's FCFS scheduler does).
//! - Growth: a running sequence takes one more block whenever its next token would not fit.
//!   If no block is free, the most recently admitted sequence is preempted: its blocks are
//!   freed and it goes back to the head of the queue, to recompute its prompt and the tokens
//!   it had generated when readmitted (vLLM's recompute preemption). Streams see a pause, not
//!   a repeat: tokens already sent stay sent.
//! - A step computes the prefill of newly admitted sequences (their uncached tokens, at
//!   `prefill_tokens_per_s`) and one decode token for every other running sequence, and lasts
//!   `prefill tokens / prefill_tokens_per_s + decode_step + decode_step_per_seq * decoders`.
//!   Prefill is not chunked: a long prompt stalls the batch for its whole prefill (as in TGI
//!   or llama.cpp; vLLM's chunked prefill spreads it over several steps). At the end of the
//!   step every sequence in it has one more token: the first one for those just prefilled.
//! - A sequence finishes at `max_tokens` (`length`) or, unless `ignore_eos`, at its natural
//!   length (`stop`, see [`super::text::Generator`]), and releases its blocks; the full
//!   blocks of its prompt stay in the prefix cache until evicted.
//! - A request whose prompt plus `max_tokens` exceeds the whole KV cache is refused at once:
//!   it could never run, and vLLM refuses it the same way (context length).
//! - Time: every duration is divided by `time_scale`, and everything reported (TTFT, queue
//!   time, latency) is in real seconds, as a client or a scraper sees them.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, Notify};

use super::kv::{block_hashes, blocks_for, BlockId, BlockPool, BLOCK_TOKENS};
use super::metrics::{Buckets, Stats};
use super::text::Generator;

/// Capacities and speeds.
#[derive(Debug, Clone)]
pub struct Config {
    /// Most sequences in a batch (vLLM `--max-num-seqs`, llama.cpp `-np`).
    pub max_running: usize,
    /// KV cache capacity in tokens; rounded down to whole blocks.
    pub kv_tokens: usize,
    /// Prefill speed, in uncached prompt tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Decode step time with an empty batch.
    pub decode_step: Duration,
    /// What each sequence in the batch adds to a decode step.
    pub decode_step_per_seq: Duration,
    /// 10 runs everything ten times faster.
    pub time_scale: f64,
    /// Seed of the generated text.
    pub seed: u64,
}

impl Default for Config {
    /// A small model on one accelerator: about 65 tokens/s for a lone stream, 30 tokens/s each
    /// for 64 streams, 8,000 prompt tokens/s.
    fn default() -> Self {
        Self {
            max_running: 64,
            kv_tokens: 65_536,
            prefill_tokens_per_s: 8_000.0,
            decode_step: Duration::from_millis(15),
            decode_step_per_seq: Duration::from_micros(250),
            time_scale: 1.0,
            seed: 0,
        }
    }
}

impl Config {
    pub fn check(&self) -> Result<(), String> {
        if self.max_running == 0 {
            return Err("max_running must be at least 1".into());
        }
        if self.kv_tokens < 2 * BLOCK_TOKENS {
            return Err(format!(
                "kv_tokens must be at least {} (two blocks)",
                2 * BLOCK_TOKENS
            ));
        }
        let rate = |x: f64| x.is_finite() && x > 0.0;
        if !rate(self.prefill_tokens_per_s) || !rate(self.time_scale) {
            return Err("prefill_tokens_per_s and time_scale must be positive".into());
        }
        Ok(())
    }

    /// Tokens the KV cache holds: whole blocks only.
    pub fn kv_capacity(&self) -> usize {
        self.kv_tokens / BLOCK_TOKENS * BLOCK_TOKENS
    }

    fn prefill_time(&self, tokens: usize) -> Duration {
        Duration::from_secs_f64(tokens as f64 / self.prefill_tokens_per_s / self.time_scale)
    }

    fn decode_time(&self, seqs: usize) -> Duration {
        let seqs = u32::try_from(seqs).unwrap_or(u32::MAX);
        (self.decode_step + self.decode_step_per_seq * seqs).div_f64(self.time_scale)
    }
}

/// What a client asks for.
#[derive(Debug, Clone)]
pub struct Request {
    /// Token ids ([`super::text::tokenize`]).
    pub prompt: Vec<u64>,
    pub max_tokens: u32,
    /// Generate `max_tokens` tokens even past the natural end.
    pub ignore_eos: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model's end of sequence.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens found in the prefix cache at admission.
    pub cached_tokens: u32,
}

/// What a request's stream receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// One generated token; its text is a word (the stream puts a space before it).
    Token(&'static str),
    /// Sent right after the last token.
    Finished { reason: FinishReason, usage: Usage },
}

/// Where a sequence's events go; dropping the receiver aborts the sequence.
pub type Sink = mpsc::UnboundedSender<Event>;

/// A request the engine will not take, with the reason for the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection(pub String);

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Rejection {}

/// A fault that freezes sequences (see [`super::faults`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freeze {
    /// No sequence gets its first token; admitted ones hold their slot and memory.
    BeforeFirstToken,
    /// No sequence gets past this many tokens.
    AfterTokens(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Admitted; this many tokens to compute before the next token.
    Prefill(usize),
    Decode,
}

#[derive(Debug)]
struct Seq {
    prompt_len: usize,
    /// Hash chain of the prompt's full blocks.
    hashes: Vec<u64>,
    max_tokens: u32,
    ignore_eos: bool,
    generator: Generator,
    generated: u32,
    /// Holds the prompt's blocks first, in order, then the generated tokens' blocks.
    blocks: Vec<BlockId>,
    phase: Phase,
    cached_tokens: usize,
    arrived: Duration,
    admitted: Option<Duration>,
    first_token: Option<Duration>,
    in_step: bool,
    sink: Sink,
}

impl Seq {
    fn frozen(&self, freeze: Option<Freeze>) -> bool {
        match freeze {
            None => false,
            Some(Freeze::BeforeFirstToken) => self.first_token.is_none(),
            Some(Freeze::AfterTokens(n)) => self.generated >= n,
        }
    }

    /// Tokens whose KV the sequence holds once its next token is computed.
    fn context_after_next(&self) -> usize {
        self.prompt_len + self.generated as usize + 1
    }
}

/// The gauges of the moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    pub running: usize,
    /// Requests in the queue now, including those that arrived during the current step.
    pub waiting: usize,
    /// Requests the scheduler left waiting at its last step (arrivals since are not counted
    /// until the next step looks at them): what a real server's gauge shows, since vLLM,
    /// SGLang and the others publish their queue length from each step's statistics. A
    /// request that arrives while a step computes is not queued for lack of room.
    pub queued: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    /// Referenced blocks, 0 to 1.
    pub kv_usage: f64,
    /// Tokens reserved by the running batch: prompt plus `max_tokens` (TGI's view).
    pub batch_max_tokens: usize,
}

#[derive(Debug)]
pub struct Engine {
    config: Config,
    pool: BlockPool,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    freeze: Option<Freeze>,
    step_open: bool,
    /// Whether the open step prefills, and whether it decodes.
    step_kinds: (bool, bool),
    /// When the scheduler last admitted from the queue ([`Engine::plan`]).
    last_plan: Option<Duration>,
    /// Counters and histograms for the metrics endpoint.
    pub stats: Stats,
}

impl Engine {
    pub fn new(config: Config, buckets: Buckets) -> Result<Self, String> {
        config.check()?;
        let pool = BlockPool::new(config.kv_capacity() / BLOCK_TOKENS);
        Ok(Self {
            config,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            freeze: None,
            step_open: false,
            step_kinds: (false, false),
            last_plan: None,
            stats: Stats::new(buckets),
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Refuses what could never run: an empty answer, or a context larger than the cache.
    pub fn check(&self, prompt_tokens: usize, max_tokens: u32) -> Result<(), Rejection> {
        if max_tokens == 0 {
            return Err(Rejection("max_tokens must be at least 1".into()));
        }
        let capacity = self.config.kv_capacity();
        let asked = prompt_tokens + max_tokens as usize;
        if asked > capacity {
            return Err(Rejection(format!(
                "This server's maximum context length is {capacity} tokens (its whole KV \
                 cache). However, you requested {asked} tokens ({prompt_tokens} in the prompt, \
                 {max_tokens} for the completion). Please reduce the length of the prompt or \
                 max_tokens."
            )));
        }
        Ok(())
    }

    /// Queues a request arriving at `now`; its events go to `sink`.
    pub fn submit(&mut self, now: Duration, request: Request, sink: Sink) -> Result<(), Rejection> {
        self.check(request.prompt.len(), request.max_tokens)?;
        self.stats.requests_received += 1;
        self.waiting.push_back(Seq {
            prompt_len: request.prompt.len(),
            hashes: block_hashes(&request.prompt),
            max_tokens: request.max_tokens,
            ignore_eos: request.ignore_eos,
            generator: Generator::new(&request.prompt, self.config.seed),
            generated: 0,
            blocks: Vec::new(),
            phase: Phase::Decode,
            cached_tokens: 0,
            arrived: now,
            admitted: None,
            first_token: None,
            in_step: false,
            sink,
        });
        Ok(())
    }

    pub fn set_freeze(&mut self, freeze: Option<Freeze>) {
        self.freeze = freeze;
    }

    pub fn load(&self) -> Load {
        Load {
            running: self.running.len(),
            waiting: self.waiting.len(),
            queued: self
                .waiting
                .iter()
                .filter(|s| s.admitted.is_some() || self.last_plan.is_some_and(|t| s.arrived <= t))
                .count(),
            kv_blocks_used: self.pool.used(),
            kv_blocks_total: self.pool.total(),
            kv_usage: self.pool.usage(),
            batch_max_tokens: self
                .running
                .iter()
                .map(|s| s.prompt_len + s.max_tokens as usize)
                .sum(),
        }
    }

    /// Whether some sequence is held by a freeze (it only leaves when its client does).
    pub fn has_frozen(&self) -> bool {
        self.running.iter().any(|s| s.frozen(self.freeze))
    }

    /// Schedules the next step at `now`: drops sequences whose client left, admits from the
    /// queue, makes room for growth. Returns how long the step takes, or `None` when there is
    /// nothing to compute; then [`Engine::complete`] must follow before the next plan.
    pub fn plan(&mut self, now: Duration) -> Option<Duration> {
        assert!(!self.step_open, "plan() twice without complete()");
        self.reap();
        self.admit(now);
        self.last_plan = Some(now);
        self.grow();
        let (mut members, mut prefill, mut decoders) = (0, 0, 0);
        for seq in &mut self.running {
            if seq.frozen(self.freeze) {
                continue;
            }
            seq.in_step = true;
            members += 1;
            match seq.phase {
                Phase::Prefill(tokens) => prefill += tokens,
                Phase::Decode => decoders += 1,
            }
        }
        if members == 0 {
            return None;
        }
        self.step_open = true;
        self.step_kinds = (prefill > 0, decoders > 0);
        let forwards = &mut self.stats.forwards;
        forwards.prefill_started += u64::from(prefill > 0);
        forwards.decode_started += u64::from(decoders > 0);
        let prefill_time = self.config.prefill_time(prefill);
        let decode_time = if decoders > 0 {
            self.config.decode_time(decoders)
        } else {
            Duration::ZERO
        };
        self.stats.prefill_seconds += prefill_time.as_secs_f64();
        self.stats.decode_seconds += decode_time.as_secs_f64();
        self.stats.prefill_tokens_computed += prefill as u64;
        self.stats.window_prefill_tokens += prefill as u64;
        self.stats.window_prefill_seconds += prefill_time.as_secs_f64();
        self.stats.window_decode_seconds += decode_time.as_secs_f64();
        Some(prefill_time + decode_time)
    }

    /// Ends the step planned last, at `now`: one token for every sequence in it.
    pub fn complete(&mut self, now: Duration) {
        assert!(self.step_open, "complete() without plan()");
        self.step_open = false;
        let (prefilled, decoded) = self.step_kinds;
        let forwards = &mut self.stats.forwards;
        forwards.prefill_done += u64::from(prefilled);
        forwards.decode_done += u64::from(decoded);
        let mut done = Vec::new();
        let mut busy = 0u64;
        for (index, seq) in self.running.iter_mut().enumerate() {
            if !std::mem::take(&mut seq.in_step) {
                continue;
            }
            busy += 1;
            if let Phase::Prefill(_) = seq.phase {
                seq.phase = Phase::Decode;
                self.stats.prefill_cached += seq.cached_tokens as u64;
                for (&block, &hash) in seq.blocks.iter().zip(&seq.hashes) {
                    self.pool.publish(block, hash);
                }
            }
            let word = seq.generator.next_word();
            seq.generated += 1;
            self.stats.generation_tokens += 1;
            let length = (seq.prompt_len + seq.generated as usize) as u64;
            self.stats.n_tokens_max = self.stats.n_tokens_max.max(length);
            self.stats.window_decode_tokens += 1;
            if seq.first_token.is_none() {
                seq.first_token = Some(now);
                self.stats.prompt_tokens += seq.prompt_len as u64;
                self.stats.ttft.observe((now - seq.arrived).as_secs_f64());
            }
            let reason = if seq.generated == seq.max_tokens {
                Some(FinishReason::Length)
            } else if !seq.ignore_eos && seq.generated == seq.generator.natural_len() {
                Some(FinishReason::Stop)
            } else {
                None
            };
            if seq.sink.send(Event::Token(word)).is_err() {
                self.stats.aborted += 1;
                done.push(index);
            } else if let Some(reason) = reason {
                let usage = Usage {
                    prompt_tokens: u32::try_from(seq.prompt_len).unwrap_or(u32::MAX),
                    completion_tokens: seq.generated,
                    cached_tokens: u32::try_from(seq.cached_tokens).unwrap_or(u32::MAX),
                };
                // The client may leave between its last token and this; it got its answer.
                let _ = seq.sink.send(Event::Finished { reason, usage });
                self.stats.finish(
                    reason,
                    (now - seq.arrived).as_secs_f64(),
                    seq.prompt_len as u64,
                    u64::from(seq.generated),
                );
                done.push(index);
            }
        }
        if busy > 0 {
            self.stats.steps += 1;
            self.stats.busy_slots += busy;
        }
        for index in done.into_iter().rev() {
            let seq = self.running.remove(index);
            self.pool.release(&seq.blocks);
        }
    }

    /// Drops the sequences whose client has gone.
    fn reap(&mut self) {
        let before = self.waiting.len() + self.running.len();
        self.waiting.retain(|s| !s.sink.is_closed());
        let pool = &mut self.pool;
        self.running.retain(|s| {
            if s.sink.is_closed() {
                pool.release(&s.blocks);
                false
            } else {
                true
            }
        });
        self.stats.aborted += (before - self.waiting.len() - self.running.len()) as u64;
    }

    fn admit(&mut self, now: Duration) {
        let (mut batch_hits, mut batch_tokens) = (0usize, 0usize);
        while self.running.len() < self.config.max_running {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            let computed = seq.prompt_len + seq.generated as usize;
            // At least the last prompt token is computed, to have the logits of the next one.
            let max_hits = seq.prompt_len.saturating_sub(1) / BLOCK_TOKENS;
            let hits = self.pool.cached_prefix(&seq.hashes).min(max_hits);
            let fresh = blocks_for(seq.context_after_next()) - hits;
            let Some(blocks) = self.pool.allocate(&seq.hashes, hits, fresh) else {
                break;
            };
            let mut seq = self.waiting.pop_front().expect("front exists");
            let hit_tokens = hits * BLOCK_TOKENS;
            seq.blocks = blocks;
            seq.phase = Phase::Prefill(computed - hit_tokens);
            if seq.admitted.is_none() {
                seq.admitted = Some(now);
                seq.cached_tokens = hit_tokens;
                self.stats.prefix_queries += seq.prompt_len as u64;
                self.stats.prefix_hits += hit_tokens as u64;
                self.stats.hit_blocks += hits as u64;
                self.stats.missed_blocks += (seq.hashes.len() - hits) as u64;
                self.stats
                    .queue_time
                    .observe((now - seq.arrived).as_secs_f64());
                batch_hits += hit_tokens;
                batch_tokens += seq.prompt_len;
            }
            self.running.push(seq);
        }
        if batch_tokens > 0 {
            self.stats.last_batch_hit_rate = batch_hits as f64 / batch_tokens as f64;
        }
    }

    /// Gives every decoding sequence room for its next token, preempting the most recently
    /// admitted sequences when memory runs out.
    fn grow(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let seq = &self.running[i];
            if seq.frozen(self.freeze)
                || seq.phase != Phase::Decode
                || blocks_for(seq.context_after_next()) <= seq.blocks.len()
            {
                i += 1;
                continue;
            }
            match self.pool.allocate_one() {
                Some(block) => {
                    self.running[i].blocks.push(block);
                    i += 1;
                }
                // If the victim is `i` itself, the loop ends there or moves to what was next.
                None => self.preempt(self.running.len() - 1),
            }
        }
    }

    fn preempt(&mut self, index: usize) {
        let mut seq = self.running.remove(index);
        self.pool.release(&seq.blocks);
        seq.blocks.clear();
        seq.phase = Phase::Decode;
        self.stats.preemptions += 1;
        self.waiting.push_front(seq);
    }
}

/// An [`Engine`] stepped in real time by a tokio task, shared with the HTTP handlers.
#[derive(Clone)]
pub struct Sim {
    inner: Arc<Inner>,
}

struct Inner {
    engine: Mutex<Engine>,
    wake: Notify,
    epoch: std::time::Instant,
}

/// How often a server whose every sequence is frozen looks for clients that left.
const REAP_INTERVAL: Duration = Duration::from_millis(100);

impl Sim {
    /// Starts stepping `engine` on the current tokio runtime.
    pub fn start(engine: Engine) -> Self {
        let inner = Arc::new(Inner {
            engine: Mutex::new(engine),
            wake: Notify::new(),
            epoch: std::time::Instant::now(),
        });
        tokio::spawn(run(inner.clone()));
        Self { inner }
    }

    /// Queues `request`; its events arrive on the returned receiver, and dropping it aborts.
    pub fn submit(&self, request: Request) -> Result<mpsc::UnboundedReceiver<Event>, Rejection> {
        let (sink, events) = mpsc::unbounded_channel();
        self.engine()
            .submit(self.inner.epoch.elapsed(), request, sink)?;
        self.inner.wake.notify_one();
        Ok(events)
    }

    /// The engine, for a look or a change; the stepping task waits meanwhile, so keep it
    /// short, and call [`Sim::wake`] after a change that can unblock work.
    pub fn engine(&self) -> MutexGuard<'_, Engine> {
        // The engine stays consistent between calls; a panicking holder leaves it usable.
        self.inner
            .engine
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn wake(&self) {
        self.inner.wake.notify_one();
    }
}

async fn run(inner: Arc<Inner>) {
    let lock = || {
        inner
            .engine
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    };
    loop {
        let started = tokio::time::Instant::now();
        let (step, frozen) = {
            let mut engine = lock();
            let step = engine.plan(inner.epoch.elapsed());
            (step, engine.has_frozen())
        };
        match step {
            Some(duration) => {
                // Deadlines from the step's start, so the handling time does not add up.
                tokio::time::sleep_until(started + duration).await;
                lock().complete(inner.epoch.elapsed());
            }
            None if frozen => {
                let _ = tokio::time::timeout(REAP_INTERVAL, inner.wake.notified()).await;
            }
            None => inner.wake.notified().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::metrics::Dialect;
    use super::*;
    use std::time::Instant;

    fn engine(config: Config) -> Engine {
        Engine::new(config, Dialect::Vllm.buckets()).unwrap()
    }

    fn words(n: usize, tag: &str) -> Vec<u64> {
        super::super::text::tokenize(
            &(0..n)
                .map(|i| format!("{tag}{i}"))
                .collect::<Vec<_>>()
                .join(" "),
        )
    }

    fn request(prompt: Vec<u64>, max_tokens: u32) -> Request {
        Request {
            prompt,
            max_tokens,
            ignore_eos: true,
        }
    }

    /// A client of the engine: what its stream received.
    struct Client {
        events: mpsc::UnboundedReceiver<Event>,
        tokens: Vec<(&'static str, Duration)>,
        finished: Option<(FinishReason, Usage)>,
    }

    impl Client {
        fn submit(engine: &mut Engine, now: Duration, req: Request) -> Self {
            let (sink, events) = mpsc::unbounded_channel();
            engine.submit(now, req, sink).unwrap();
            Self {
                events,
                tokens: Vec::new(),
                finished: None,
            }
        }

        /// Takes what arrived, stamped `now`.
        fn drain(&mut self, now: Duration) {
            while let Ok(event) = self.events.try_recv() {
                match event {
                    Event::Token(word) => {
                        assert!(self.finished.is_none(), "token after the end");
                        self.tokens.push((word, now));
                    }
                    Event::Finished { reason, usage } => self.finished = Some((reason, usage)),
                }
            }
        }

        fn ttft(&self, arrived: Duration) -> Duration {
            self.tokens.first().expect("a first token").1 - arrived
        }
    }

    /// Virtual time: runs steps back to back until `until` holds or `limit` passes.
    fn run_until(
        engine: &mut Engine,
        now: &mut Duration,
        clients: &mut [&mut Client],
        limit: Duration,
        until: impl Fn(&Engine, &[&mut Client]) -> bool,
    ) {
        while !until(engine, clients) {
            assert!(*now < limit, "not done within {limit:?}");
            match engine.plan(*now) {
                Some(step) => {
                    *now += step;
                    engine.complete(*now);
                }
                None => panic!("idle before done"),
            }
            for client in clients.iter_mut() {
                client.drain(*now);
            }
        }
    }

    fn all_finished(_: &Engine, clients: &[&mut Client]) -> bool {
        clients.iter().all(|c| c.finished.is_some())
    }

    #[test]
    fn a_shared_2000_token_prefix_cuts_the_second_ttft() {
        let config = Config::default();
        let mut e = engine(config.clone());
        let preamble = words(2000, "doc");
        let with_question = |q: &str| {
            let mut p = preamble.clone();
            p.extend(words(20, q));
            p
        };
        let mut now = Duration::ZERO;
        let mut first = Client::submit(&mut e, now, request(with_question("a"), 4));
        run_until(
            &mut e,
            &mut now,
            &mut [&mut first],
            Duration::from_secs(10),
            all_finished,
        );
        let ttft_first = first.ttft(Duration::ZERO);

        let arrived = now;
        let mut second = Client::submit(&mut e, now, request(with_question("b"), 4));
        run_until(
            &mut e,
            &mut now,
            &mut [&mut second],
            Duration::from_secs(20),
            all_finished,
        );
        let ttft_second = second.ttft(arrived);

        // 2,020 uncached tokens at 8,000/s, then 2,000 of them cached (125 blocks).
        assert!(ttft_first > Duration::from_millis(250), "{ttft_first:?}");
        assert!(
            ttft_second * 4 < ttft_first,
            "second {ttft_second:?}, first {ttft_first:?}"
        );
        let usage = second.finished.unwrap().1;
        assert_eq!(usage.cached_tokens, 2000);
        assert_eq!(usage.prompt_tokens, 2020);
        assert_eq!(first.finished.unwrap().1.cached_tokens, 0);
        assert_eq!(e.stats.prefix_queries, 4040);
        assert_eq!(e.stats.prefix_hits, 2000);
        // Only the uncached part of the second prompt was computed.
        assert_eq!(e.stats.prefill_tokens_computed, 2020 + 20);
    }

    #[test]
    fn more_requests_than_slots_wait_and_ttft_grows() {
        let config = Config {
            max_running: 2,
            ..Config::default()
        };
        let mut e = engine(config);
        let mut now = Duration::ZERO;
        let mut clients: Vec<Client> = (0..6)
            .map(|i| Client::submit(&mut e, now, request(words(200, &format!("r{i}-")), 20)))
            .collect();
        assert_eq!((e.load().running, e.load().waiting), (0, 6));
        let step = e.plan(now).unwrap();
        assert_eq!((e.load().running, e.load().waiting), (2, 4));
        now += step;
        e.complete(now);
        for c in &mut clients {
            c.drain(now);
        }
        let mut refs: Vec<&mut Client> = clients.iter_mut().collect();
        run_until(
            &mut e,
            &mut now,
            &mut refs,
            Duration::from_secs(30),
            all_finished,
        );
        // Requests came at once: each pair waits for the one before.
        let ttfts: Vec<Duration> = clients.iter().map(|c| c.ttft(Duration::ZERO)).collect();
        for pair in ttfts.chunks(2).collect::<Vec<_>>().windows(2) {
            assert!(pair[1][0] > pair[0][1], "{ttfts:?}");
        }
        assert!(ttfts[5] > ttfts[0] * 3, "{ttfts:?}");
        assert!(clients.iter().all(|c| c.tokens.len() == 20));
        assert_eq!((e.load().running, e.load().waiting), (0, 0));
        // Queue time is recorded for everyone; the last pair waited longest.
        assert_eq!(e.stats.queue_time.count(), 6);
    }

    /// The published queue is the one the scheduler left: an arrival during a step is not
    /// queued for lack of room until the next step finds none for it.
    #[test]
    fn the_published_queue_is_the_schedulers() {
        let mut e = engine(Config {
            max_running: 2,
            ..Config::default()
        });
        let mut now = Duration::ZERO;
        let _clients: Vec<Client> = (0..3)
            .map(|i| Client::submit(&mut e, now, request(words(100, &format!("q{i}-")), 50)))
            .collect();
        assert_eq!(
            (e.load().waiting, e.load().queued),
            (3, 0),
            "not scheduled yet"
        );
        let step = e.plan(now).unwrap();
        assert_eq!((e.load().waiting, e.load().queued), (1, 1));
        let _late = Client::submit(&mut e, now + step / 2, request(words(100, "late"), 50));
        assert_eq!(
            (e.load().waiting, e.load().queued),
            (2, 1),
            "arrived mid-step"
        );
        now += step;
        e.complete(now);
        e.plan(now).unwrap();
        assert_eq!(
            (e.load().waiting, e.load().queued),
            (2, 2),
            "no room at the next step"
        );
    }

    #[test]
    fn kv_usage_rises_under_load_and_returns_to_zero() {
        let config = Config {
            max_running: 8,
            kv_tokens: 8 * 1024,
            ..Config::default()
        };
        let mut e = engine(config);
        let mut now = Duration::ZERO;
        assert_eq!(e.load().kv_usage, 0.0);
        let mut clients: Vec<Client> = (0..8)
            .map(|i| Client::submit(&mut e, now, request(words(500, &format!("k{i}-")), 100)))
            .collect();
        let mut peak: f64 = 0.0;
        let mut samples = Vec::new();
        while clients.iter().any(|c| c.finished.is_none()) {
            let step = e.plan(now).unwrap();
            let load = e.load();
            peak = peak.max(load.kv_usage);
            samples.push(load.kv_usage);
            now += step;
            e.complete(now);
            for c in &mut clients {
                c.drain(now);
            }
            assert!(now < Duration::from_secs(60));
        }
        // 8 x (500 + up to 100) tokens of 8,192.
        assert!(peak > 0.5 && peak <= 0.6, "peak {peak}");
        // Growth: usage climbs while the batch decodes.
        assert!(samples[samples.len() / 2] > samples[0], "{samples:?}");
        assert_eq!(e.plan(now), None);
        assert_eq!(e.load().kv_usage, 0.0, "idle: nothing referenced");
        assert!(e.pool.cached_blocks() > 0, "but the prefixes stay cached");
    }

    #[test]
    fn a_request_larger_than_the_kv_cache_is_refused_not_queued() {
        let mut e = engine(Config {
            kv_tokens: 4096,
            ..Config::default()
        });
        let (sink, _events) = mpsc::unbounded_channel();
        let err = e
            .submit(Duration::ZERO, request(words(4000, "x"), 100), sink.clone())
            .unwrap_err();
        assert!(
            err.0.contains("maximum context length is 4096 tokens"),
            "{err}"
        );
        assert!(
            err.0.contains("4100 tokens (4000 in the prompt, 100 for"),
            "{err}"
        );
        assert_eq!(e.load().waiting, 0);
        // Exactly the capacity is fine, and runs alone.
        e.submit(Duration::ZERO, request(words(3996, "x"), 100), sink)
            .unwrap();
        assert_eq!(e.load().waiting, 1);
        assert!(e.plan(Duration::ZERO).is_some());
        assert_eq!(e.load().running, 1);
        let err = e.check(1, 0).unwrap_err();
        assert!(err.0.contains("max_tokens"), "{err}");
    }

    #[test]
    fn a_full_cache_queues_the_head_and_preempts_on_growth() {
        // 8 blocks: two 40-token prompts take 3 blocks each; growing to 100 tokens each takes
        // 7 blocks each, which cannot both fit.
        let mut e = engine(Config {
            kv_tokens: 8 * BLOCK_TOKENS,
            ..Config::default()
        });
        let mut now = Duration::ZERO;
        let mut a = Client::submit(&mut e, now, request(words(40, "a"), 60));
        let mut b = Client::submit(&mut e, now, request(words(40, "b"), 60));
        let mut c = Client::submit(&mut e, now, request(words(100, "c"), 20));
        e.plan(now).unwrap();
        // c does not fit behind a and b, though a slot is free.
        assert_eq!((e.load().running, e.load().waiting), (2, 1));
        now += Duration::from_millis(1);
        e.complete(now);
        run_until(
            &mut e,
            &mut now,
            &mut [&mut a, &mut b, &mut c],
            Duration::from_secs(30),
            all_finished,
        );
        assert!(e.stats.preemptions > 0);
        for client in [&a, &b] {
            assert_eq!(client.tokens.len(), 60, "preemption loses no token");
        }
        assert_eq!(c.tokens.len(), 20);
        assert_eq!(e.load().kv_blocks_used, 0);
    }

    #[test]
    fn eos_max_tokens_and_determinism() {
        let run = |seed: u64, ignore_eos: bool, max_tokens: u32| {
            let mut e = engine(Config {
                seed,
                ..Config::default()
            });
            let mut now = Duration::ZERO;
            let mut req = request(words(30, "same"), max_tokens);
            req.ignore_eos = ignore_eos;
            let mut client = Client::submit(&mut e, now, req);
            run_until(
                &mut e,
                &mut now,
                &mut [&mut client],
                Duration::from_secs(60),
                all_finished,
            );
            let text: Vec<&str> = client.tokens.iter().map(|t| t.0).collect();
            (text, client.finished.unwrap())
        };
        let natural = Generator::new(&words(30, "same"), 7).natural_len();
        let (text, (reason, usage)) = run(7, false, 1000);
        assert_eq!(reason, FinishReason::Stop);
        assert_eq!(text.len() as u32, natural);
        assert_eq!(usage.completion_tokens, natural);
        assert_eq!(
            run(7, false, 1000).0,
            text,
            "same prompt and seed, same answer"
        );
        assert_ne!(run(8, false, 1000).0, text);
        let (long, (reason, _)) = run(7, true, natural + 5);
        assert_eq!(
            (reason, long.len() as u32),
            (FinishReason::Length, natural + 5)
        );
        assert_eq!(long[..text.len()], text[..]);
        let (short, (reason, _)) = run(7, false, 3);
        assert_eq!((reason, short.len()), (FinishReason::Length, 3));
    }

    #[test]
    fn a_client_that_leaves_frees_its_slot_and_memory() {
        let mut e = engine(Config::default());
        let client = Client::submit(&mut e, Duration::ZERO, request(words(100, "gone"), 50));
        e.plan(Duration::ZERO).unwrap();
        e.complete(Duration::from_millis(20));
        assert_eq!(e.load().running, 1);
        drop(client);
        assert_eq!(e.plan(Duration::from_millis(20)), None);
        assert_eq!((e.load().running, e.load().kv_blocks_used), (0, 0));
        assert_eq!(e.stats.aborted, 1);
    }

    #[test]
    fn freezes_hold_sequences_until_lifted() {
        let mut e = engine(Config::default());
        let mut now = Duration::ZERO;
        let mut a = Client::submit(&mut e, now, request(words(10, "a"), 10));
        e.set_freeze(Some(Freeze::AfterTokens(3)));
        for _ in 0..3 {
            now += e.plan(now).unwrap();
            e.complete(now);
        }
        assert_eq!(e.plan(now), None, "a is at 3 tokens: frozen");
        assert!(e.has_frozen());
        a.drain(now);
        assert_eq!(a.tokens.len(), 3);
        e.set_freeze(Some(Freeze::BeforeFirstToken));
        let mut b = Client::submit(&mut e, now, request(words(10, "b"), 10));
        // a goes on; b is admitted (holding its slot) but gets nothing.
        run_until(
            &mut e,
            &mut now,
            &mut [&mut a, &mut b],
            Duration::from_secs(10),
            |_, c| c[0].finished.is_some(),
        );
        assert!(b.tokens.is_empty());
        assert_eq!(e.load().running, 1);
        e.set_freeze(None);
        run_until(
            &mut e,
            &mut now,
            &mut [&mut b],
            Duration::from_secs(10),
            all_finished,
        );
        assert_eq!(b.tokens.len(), 10);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_real_time_driver_streams_at_the_scaled_pace() {
        let sim = Sim::start(engine(Config {
            time_scale: 10.0,
            ..Config::default()
        }));
        let started = Instant::now();
        let mut events = sim.submit(request(words(16_000, "p"), 40)).unwrap();
        let mut tokens = Vec::new();
        while let Some(event) = events.recv().await {
            match event {
                Event::Token(_) => tokens.push(started.elapsed()),
                Event::Finished { .. } => break,
            }
        }
        assert_eq!(tokens.len(), 40);
        // Prefill 16,000 tokens at 8,000/s is 2 s, a decode step 15.25 ms; ten times faster.
        assert!(
            tokens[0] >= Duration::from_millis(200) && tokens[0] < Duration::from_millis(600),
            "{:?}",
            tokens[0]
        );
        let decode = (tokens[39] - tokens[0]) / 39;
        // Timers tick in whole milliseconds, and a busy machine adds some: well below the
        // unscaled 15.25 ms all the same.
        assert!(
            decode >= Duration::from_micros(1400) && decode < Duration::from_millis(8),
            "{decode:?}"
        );
        let engine = sim.engine();
        assert_eq!(engine.stats.ttft.count(), 1);
        let ttft = engine.stats.ttft.sum();
        assert!(
            (0.2..0.6).contains(&ttft),
            "TTFT recorded in real seconds: {ttft}"
        );
    }
}
