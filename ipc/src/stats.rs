//! Counters a worker shares with the supervisor: one memfd per worker process, created by the
//! supervisor and handed to the worker as fd 4, mapped by both.
//!
//! Shared memory rather than messages: the worker counts a request with an atomic add before
//! its response is written, and the counts live in memory the supervisor also maps, so they
//! survive the worker's SIGKILL (the supervisor folds a dead worker's final counts into the
//! pool's totals) and cost the hot path no system call. The region is a flat array of
//! `AtomicU64`; the functions below give each counter its index.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::region::Region;
use inferd_config::auth::Refusal;

/// File descriptor of the counters in a worker.
pub const WORKER_STATS_FD: i32 = 4;

/// Models with counters of their own: the first this many a worker starts with. The others
/// (a server may serve any number), those loaded on demand or added while serving, and
/// requests for unknown names count together in the last row (`model="other"`).
pub const MAX_MODELS: usize = 8;
const MODEL_ROWS: usize = MAX_MODELS + 1;

/// The route families requests are counted under (`inferd_requests_total{endpoint}`): one per
/// kind of call a client makes, whichever protocol carries it (KServe's REST and gRPC infer
/// are both `infer`; TEI's `/embed` and `/v2/models/NAME/embed` both `embed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// KServe v2 infer, REST and gRPC.
    Infer,
    /// TEI `/embed` (and `/v2/models/NAME/embed`).
    Embed,
    /// TEI `/embed_all`.
    EmbedAll,
    /// TEI-style `/embed_chunks` (late chunking).
    EmbedChunks,
    /// TEI `/embed_sparse`.
    EmbedSparse,
    /// TEI `/similarity`.
    Similarity,
    /// OpenAI's `/v1/embeddings`.
    OpenAiEmbeddings,
    /// TEI `/predict`.
    Predict,
    /// TEI `/rerank`.
    Rerank,
    /// Cohere's `/v1/rerank` and `/v2/rerank`.
    CohereRerank,
    /// Cohere's `/v1/embed` and `/v2/embed`.
    CohereEmbed,
    /// SageMaker's `/invocations` and TEI's `POST /`: the default model's pipeline.
    Invocations,
}

impl Endpoint {
    pub const ALL: [Endpoint; 12] = [
        Endpoint::Infer,
        Endpoint::Embed,
        Endpoint::EmbedAll,
        Endpoint::EmbedChunks,
        Endpoint::EmbedSparse,
        Endpoint::Similarity,
        Endpoint::OpenAiEmbeddings,
        Endpoint::Predict,
        Endpoint::Rerank,
        Endpoint::CohereRerank,
        Endpoint::CohereEmbed,
        Endpoint::Invocations,
    ];

    /// Its `endpoint` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::Infer => "infer",
            Endpoint::Embed => "embed",
            Endpoint::EmbedAll => "embed_all",
            Endpoint::EmbedChunks => "embed_chunks",
            Endpoint::EmbedSparse => "embed_sparse",
            Endpoint::Similarity => "similarity",
            Endpoint::OpenAiEmbeddings => "openai_embeddings",
            Endpoint::Predict => "predict",
            Endpoint::Rerank => "rerank",
            Endpoint::CohereRerank => "cohere_rerank",
            Endpoint::CohereEmbed => "cohere_embed",
            Endpoint::Invocations => "invocations",
        }
    }
}

/// Status codes counted apart; any other counts as the last ("other").
/// 499: the client closed the connection before the answer (nginx's code for it).
pub const CODES: [u16; 10] = [200, 400, 404, 405, 413, 499, 500, 503, 504, 0];
/// Upper bounds (seconds) of the queue-time and compute-time histograms; +Inf follows.
pub const LATENCY_BUCKETS: [f64; 14] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
/// Upper bounds of the batch-size histogram; +Inf follows.
pub const BATCH_BUCKETS: [u64; 8] = [1, 2, 4, 8, 16, 32, 64, 128];

/// Histogram slots: one per bucket (cumulative at export), +Inf, sum, count.
const LATENCY_SLOTS: usize = LATENCY_BUCKETS.len() + 3;
const BATCH_SLOTS: usize = BATCH_BUCKETS.len() + 3;
const REQUESTS_AT: usize = 0;
const QUEUE_AT: usize = REQUESTS_AT + MODEL_ROWS * Endpoint::ALL.len() * CODES.len();
const COMPUTE_AT: usize = QUEUE_AT + MAX_MODELS * LATENCY_SLOTS;
const REQUEST_LATENCY_AT: usize = COMPUTE_AT + MAX_MODELS * LATENCY_SLOTS;
const BATCH_AT: usize = REQUEST_LATENCY_AT + MAX_MODELS * LATENCY_SLOTS;
/// Per model: microseconds spent on requests that failed (any answer but 200), and the Unix
/// time in milliseconds of the last answer (a maximum, not a sum, across workers).
const ANSWERS_AT: usize = BATCH_AT + MAX_MODELS * BATCH_SLOTS;
const ANSWER_SLOTS: usize = 2;
const IN_FLIGHT_AT: usize = ANSWERS_AT + MAX_MODELS * ANSWER_SLOTS;
const QUEUED_AT: usize = IN_FLIGHT_AT + 1;
/// CLOCK_MONOTONIC nanoseconds when the oldest run in progress started (0: idle).
const BUSY_SINCE_AT: usize = QUEUED_AT + 1;
/// CLOCK_MONOTONIC nanoseconds of the batch timer thread's last beat (at least every second).
const BEAT_AT: usize = BUSY_SINCE_AT + 1;
/// CLOCK_MONOTONIC nanoseconds of the I/O loop's last beat (every 250 ms while it turns).
const IO_BEAT_AT: usize = BEAT_AT + 1;
/// Panics caught while serving a request (worker/src/panics.rs): the supervisor replaces a
/// worker that has any.
const FAULTS_AT: usize = IO_BEAT_AT + 1;
/// Requests refused for their API key, one counter per [`Refusal`] in the order of
/// [`Refusal::ALL`] (`inferd_auth_refused_total{reason}`).
const AUTH_REFUSED_AT: usize = FAULTS_AT + 1;
/// Runs on two threads, one on a sibling's idle core, and runs that waited for their own core
/// to come back from a sibling, by [`LENDING_EVENTS`] (server.lend_idle_cores).
const LENDING_AT: usize = AUTH_REFUSED_AT + Refusal::ALL.len();
/// `inferd_core_lending_total{event}`.
pub const LENDING_EVENTS: [&str; 2] = ["borrowed", "waited"];
/// Requests for a model a sibling holds, with models.placement = "pool", by [`FORWARD_EVENTS`].
const FORWARDS_AT: usize = LENDING_AT + LENDING_EVENTS.len();
/// `inferd_model_forwards_total{outcome}`: answered by the sibling; served here because the
/// sibling could not be reached (unreached), or went away before it answered (lost).
pub const FORWARD_EVENTS: [&str; 3] = ["forwarded", "unreached", "lost"];
/// Nanoseconds the worker's lanes spent running models, summed over its lanes: its busy lanes,
/// time-weighted, are this counter's rate.
const LANE_BUSY_AT: usize = FORWARDS_AT + FORWARD_EVENTS.len();
/// Spans exported to the collector, and spans dropped (the export queue was full, or an export
/// failed or timed out): `inferd_trace_spans_exported_total`, `inferd_trace_spans_dropped_total`.
const SPANS_AT: usize = LANE_BUSY_AT + 1;
/// Per model row ([`MODEL_ROWS`]), the cache of answers ([cache]): rows answered from it,
/// rows computed, entries evicted, and bytes held now (a gauge).
const CACHE_AT: usize = SPANS_AT + 2;
const CACHE_SLOTS: usize = 4;
/// Number of counters in a region.
pub const LEN: usize = CACHE_AT + MODEL_ROWS * CACHE_SLOTS;

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process on the machine.
pub fn monotonic_nanos() -> u64 {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC");
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}

/// Which latency histogram.
#[derive(Debug, Clone, Copy)]
pub enum Latency {
    /// Waiting for a lane.
    Queue,
    /// Running the model.
    Compute,
    /// The whole request, from routing to the response (everything the worker spends on it).
    Request,
}

pub fn request_index(model: usize, endpoint: Endpoint, code: u16) -> usize {
    let code = CODES.iter().position(|&c| c == code).unwrap_or(CODES.len() - 1);
    REQUESTS_AT + (model.min(MAX_MODELS) * Endpoint::ALL.len() + endpoint as usize) * CODES.len() + code
}

fn latency_base(kind: Latency, model: usize) -> Option<usize> {
    let at = match kind {
        Latency::Queue => QUEUE_AT,
        Latency::Compute => COMPUTE_AT,
        Latency::Request => REQUEST_LATENCY_AT,
    };
    (model < MAX_MODELS).then_some(at + model * LATENCY_SLOTS)
}

/// A view of one histogram in a snapshot: per-bucket (not cumulative) counts incl. +Inf, the
/// sum (seconds) and the count.
pub struct Histogram<'a> {
    pub buckets: &'a [u64],
    pub sum: f64,
    pub count: u64,
}

impl Histogram<'static> {
    /// No observations, `bounds + 1` buckets.
    fn empty(bounds: usize) -> Histogram<'static> {
        static ZEROS: [u64; 64] = [0; 64];
        Histogram { buckets: &ZEROS[..=bounds.min(63)], sum: 0.0, count: 0 }
    }
}

/// One worker's counters: a mapped memfd region, written by the worker and read by the
/// supervisor, only ever through atomics.
pub struct WorkerCounters {
    region: Region,
}

impl WorkerCounters {
    /// A new zeroed region and the descriptor to hand to a worker.
    pub fn create(name: &str) -> std::io::Result<(WorkerCounters, OwnedFd)> {
        let (region, fd) = Region::create(name, LEN * 8)?;
        Ok((WorkerCounters { region }, fd))
    }

    /// Maps a region created by [`WorkerCounters::create`] (in the worker: fd 4).
    pub fn map(fd: impl AsFd) -> std::io::Result<WorkerCounters> {
        Ok(WorkerCounters { region: Region::map(fd, LEN * 8)? })
    }

    fn counter(&self, index: usize) -> &AtomicU64 {
        assert!(index < LEN);
        self.region.at(index * 8)
    }

    pub fn add(&self, index: usize, n: u64) {
        self.counter(index).fetch_add(n, Ordering::Relaxed);
    }

    pub fn sub(&self, index: usize, n: u64) {
        self.counter(index).fetch_sub(n, Ordering::Relaxed);
    }

    pub fn count_request(&self, model: usize, endpoint: Endpoint, code: u16) {
        self.add(request_index(model, endpoint, code), 1);
    }

    pub fn observe_latency(&self, kind: Latency, model: usize, seconds: f64) {
        let Some(base) = latency_base(kind, model) else { return };
        let bucket = LATENCY_BUCKETS.iter().position(|&b| seconds <= b).unwrap_or(LATENCY_BUCKETS.len());
        self.add(base + bucket, 1);
        self.add(base + LATENCY_BUCKETS.len() + 1, (seconds * 1e6) as u64);
        self.add(base + LATENCY_BUCKETS.len() + 2, 1);
    }

    pub fn observe_batch(&self, model: usize, size: u64) {
        if model >= MAX_MODELS {
            return;
        }
        let base = BATCH_AT + model * BATCH_SLOTS;
        let bucket = BATCH_BUCKETS.iter().position(|&b| size <= b).unwrap_or(BATCH_BUCKETS.len());
        self.add(base + bucket, 1);
        self.add(base + BATCH_BUCKETS.len() + 1, size);
        self.add(base + BATCH_BUCKETS.len() + 2, 1);
    }

    /// A request of `model` was answered with `code` after `seconds` (beside its count and
    /// latency): what Triton's statistics split into success and failure, and when.
    pub fn answered(&self, model: usize, code: u16, seconds: f64) {
        if model >= MAX_MODELS {
            return;
        }
        let base = ANSWERS_AT + model * ANSWER_SLOTS;
        if code != 200 {
            self.add(base, (seconds * 1e6) as u64);
        }
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
        self.counter(base + 1).fetch_max(now as u64, Ordering::Relaxed);
    }

    pub fn in_flight(&self, delta: i64) {
        if delta >= 0 {
            self.add(IN_FLIGHT_AT, delta as u64)
        } else {
            self.sub(IN_FLIGHT_AT, (-delta) as u64)
        }
    }

    pub fn queued(&self, delta: i64) {
        if delta >= 0 {
            self.add(QUEUED_AT, delta as u64)
        } else {
            self.sub(QUEUED_AT, (-delta) as u64)
        }
    }

    /// Requests the worker is handling now, from routing to answer.
    pub fn in_flight_now(&self) -> u64 {
        self.counter(IN_FLIGHT_AT).load(Ordering::Relaxed)
    }

    /// Seconds its lanes have spent running models since it started.
    pub fn lane_busy_seconds_now(&self) -> f64 {
        self.counter(LANE_BUSY_AT).load(Ordering::Relaxed) as f64 / 1e9
    }

    /// Requests waiting for a lane now.
    pub fn queued_now(&self) -> u64 {
        self.counter(QUEUED_AT).load(Ordering::Relaxed)
    }

    /// The batch timer thread is alive (called from its loop).
    pub fn beat(&self) {
        self.counter(BEAT_AT).store(monotonic_nanos(), Ordering::Relaxed);
    }

    /// The I/O loop is alive (called from a task on it).
    pub fn io_beat(&self) {
        self.counter(IO_BEAT_AT).store(monotonic_nanos(), Ordering::Relaxed);
    }

    /// Seconds since the I/O loop last beat, once it has.
    pub fn io_thread(&self) -> Option<f64> {
        let at = self.counter(IO_BEAT_AT).load(Ordering::Relaxed);
        (at != 0).then(|| monotonic_nanos().saturating_sub(at) as f64 / 1e9)
    }

    /// A panic was caught serving a request.
    pub fn fault(&self) {
        self.add(FAULTS_AT, 1);
    }

    pub fn faults(&self) -> u64 {
        self.counter(FAULTS_AT).load(Ordering::Relaxed)
    }

    /// A request refused for its API key.
    pub fn count_auth_refusal(&self, reason: Refusal) {
        self.add(AUTH_REFUSED_AT + reason as usize, 1);
    }

    /// A run borrowed a sibling's core (`waited`: false), or waited for its own core to come
    /// back from a sibling (true).
    pub fn lending(&self, waited: bool) {
        self.add(LENDING_AT + usize::from(waited), 1);
    }

    /// A request for a model a sibling holds: its [`FORWARD_EVENTS`] outcome, by index.
    pub fn forward(&self, outcome: usize) {
        self.add(FORWARDS_AT + outcome.min(FORWARD_EVENTS.len() - 1), 1);
    }

    /// `n` spans exported (`dropped`: false) or dropped.
    pub fn spans(&self, dropped: bool, n: u64) {
        self.add(SPANS_AT + usize::from(dropped), n);
    }

    /// Rows of `model` (its counter row) looked up in the cache: found, and not.
    pub fn cache_lookups(&self, model: usize, hits: u64, misses: u64) {
        let base = CACHE_AT + model.min(MAX_MODELS) * CACHE_SLOTS;
        self.add(base, hits);
        self.add(base + 1, misses);
    }

    /// An entry of `model` evicted from the cache.
    pub fn cache_evicted(&self, model: usize) {
        self.add(CACHE_AT + model.min(MAX_MODELS) * CACHE_SLOTS + 2, 1);
    }

    /// The cache holds `delta` more bytes (fewer when negative) of `model`.
    pub fn cache_bytes(&self, model: usize, delta: i64) {
        let at = CACHE_AT + model.min(MAX_MODELS) * CACHE_SLOTS + 3;
        if delta >= 0 {
            self.add(at, delta as u64)
        } else {
            self.sub(at, delta.unsigned_abs())
        }
    }

    /// A lane ran a model for `nanos`.
    pub fn lane_busy(&self, nanos: u64) {
        self.add(LANE_BUSY_AT, nanos);
    }

    /// The oldest model run in progress started at this [`monotonic_nanos`] instant; `None`
    /// when no run is in progress.
    pub fn busy_since(&self, started: Option<u64>) {
        self.counter(BUSY_SINCE_AT).store(started.unwrap_or(0), Ordering::Relaxed);
    }

    /// (seconds the current run has taken, if one runs; seconds since the last beat, if any).
    pub fn model_thread(&self) -> (Option<f64>, Option<f64>) {
        let now = monotonic_nanos();
        let ago = |at: u64| (at != 0).then(|| now.saturating_sub(at) as f64 / 1e9);
        (ago(self.counter(BUSY_SINCE_AT).load(Ordering::Relaxed)), ago(self.counter(BEAT_AT).load(Ordering::Relaxed)))
    }

    /// A copy of every counter.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot((0..LEN).map(|i| self.counter(i).load(Ordering::Relaxed)).collect())
    }
}

/// A model's answers, as Triton's statistics split them into success and failure.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Outcomes {
    /// Requests answered 200.
    pub ok: u64,
    /// Seconds they took.
    pub ok_seconds: f64,
    /// Requests answered otherwise.
    pub failed: u64,
    /// Seconds those took.
    pub failed_seconds: f64,
    /// Unix milliseconds of the last answer (0: none yet).
    pub last_millis: u64,
}

/// Plain counts: one worker's at a moment, or the pool's totals.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot(pub Vec<u64>);

impl Default for Snapshot {
    fn default() -> Self {
        Snapshot(vec![0; LEN])
    }
}

/// Where each model's counters lie in a region: (start of row 0, counters per row, rows).
const MODEL_SECTIONS: [(usize, usize, usize); 7] = [
    (REQUESTS_AT, Endpoint::ALL.len() * CODES.len(), MODEL_ROWS),
    (QUEUE_AT, LATENCY_SLOTS, MAX_MODELS),
    (COMPUTE_AT, LATENCY_SLOTS, MAX_MODELS),
    (REQUEST_LATENCY_AT, LATENCY_SLOTS, MAX_MODELS),
    (BATCH_AT, BATCH_SLOTS, MAX_MODELS),
    (ANSWERS_AT, ANSWER_SLOTS, MAX_MODELS),
    (CACHE_AT, CACHE_SLOTS, MODEL_ROWS),
];

/// The counter holding a time of the last answer: combined by maximum, not sum.
fn is_last_answer(index: usize) -> bool {
    (ANSWERS_AT..IN_FLIGHT_AT).contains(&index) && (index - ANSWERS_AT) % ANSWER_SLOTS == 1
}

impl Snapshot {
    /// Adds the counters of `other`; gauges (in flight, queued) add up as well, which is what
    /// a pool total of live workers wants.
    pub fn add(&mut self, other: &Snapshot) {
        for (i, (a, b)) in self.0.iter_mut().zip(&other.0).enumerate() {
            *a = if is_last_answer(i) { (*a).max(*b) } else { *a + b };
        }
    }

    /// The same counts with each model's counters moved to another row: `rows[i]` is the new
    /// row of row `i` (`None`: dropped); the row of unknown models stays. How the supervisor
    /// adds up workers that list the same models in different orders (after an unload, or
    /// while a reload rolls).
    pub fn remapped(&self, rows: &[Option<usize>]) -> Snapshot {
        let mut out = self.clone();
        for &(at, width, count) in &MODEL_SECTIONS {
            out.0[at..at + width * count].fill(0);
        }
        for &(at, width, count) in &MODEL_SECTIONS {
            for row in 0..count {
                let target = if row == MAX_MODELS { Some(MAX_MODELS) } else { rows.get(row).copied().flatten() };
                let Some(target) = target.filter(|&t| t < count) else { continue };
                for k in 0..width {
                    let (from, to) = (at + row * width + k, at + target * width + k);
                    out.0[to] = if is_last_answer(to) { out.0[to].max(self.0[from]) } else { out.0[to] + self.0[from] };
                }
            }
        }
        out
    }

    /// A model's answers: how many were 200 and how many not, the seconds each took, and
    /// when the last was.
    pub fn outcomes(&self, model: usize) -> Outcomes {
        if model >= MAX_MODELS {
            return Outcomes::default();
        }
        let codes = |pick: fn(u16) -> bool| -> u64 {
            Endpoint::ALL
                .into_iter()
                .flat_map(|e| CODES.iter().filter(|&&c| pick(c)).map(move |&c| (e, c)))
                .map(|(e, c)| self.requests(model, e, c))
                .sum()
        };
        let base = ANSWERS_AT + model * ANSWER_SLOTS;
        let failed_seconds = self.0[base] as f64 / 1e6;
        let all_seconds = self.latency(Latency::Request, model).sum;
        Outcomes {
            ok: codes(|c| c == 200),
            ok_seconds: (all_seconds - failed_seconds).max(0.0),
            failed: codes(|c| c != 200),
            failed_seconds,
            last_millis: self.0[base + 1],
        }
    }

    /// Drops the gauges: what a dead worker leaves to the totals.
    pub fn without_gauges(mut self) -> Snapshot {
        for at in [IN_FLIGHT_AT, QUEUED_AT, BUSY_SINCE_AT, BEAT_AT, IO_BEAT_AT, FAULTS_AT] {
            self.0[at] = 0;
        }
        for row in 0..MODEL_ROWS {
            self.0[CACHE_AT + row * CACHE_SLOTS + 3] = 0;
        }
        self
    }

    /// Requests refused for their API key, per [`Refusal::ALL`].
    pub fn auth_refused(&self) -> &[u64] {
        &self.0[AUTH_REFUSED_AT..AUTH_REFUSED_AT + Refusal::ALL.len()]
    }

    /// Runs that borrowed a core and runs that waited for theirs, per [`LENDING_EVENTS`].
    pub fn lending(&self) -> &[u64] {
        &self.0[LENDING_AT..LENDING_AT + LENDING_EVENTS.len()]
    }

    /// Spans (exported, dropped).
    pub fn spans(&self) -> (u64, u64) {
        (self.0[SPANS_AT], self.0[SPANS_AT + 1])
    }

    /// Seconds the lanes spent running models.
    pub fn lane_busy_seconds(&self) -> f64 {
        self.0[LANE_BUSY_AT] as f64 / 1e9
    }

    /// A model row's cache: (hits, misses, evictions, bytes held).
    pub fn cache(&self, model: usize) -> [u64; 4] {
        let base = CACHE_AT + model.min(MAX_MODELS) * CACHE_SLOTS;
        [self.0[base], self.0[base + 1], self.0[base + 2], self.0[base + 3]]
    }

    /// Requests for models siblings hold, per [`FORWARD_EVENTS`].
    pub fn forwards(&self) -> &[u64] {
        &self.0[FORWARDS_AT..FORWARDS_AT + FORWARD_EVENTS.len()]
    }

    pub fn requests(&self, model: usize, endpoint: Endpoint, code: u16) -> u64 {
        self.0[request_index(model, endpoint, code)]
    }

    /// Every request counted, whatever its model, endpoint or status.
    pub fn requests_total(&self) -> u64 {
        self.0[REQUESTS_AT..QUEUE_AT].iter().sum()
    }

    /// A model's latency histogram (an empty one for a row the counters do not have).
    pub fn latency(&self, kind: Latency, model: usize) -> Histogram<'_> {
        let n = LATENCY_BUCKETS.len();
        let Some(base) = latency_base(kind, model) else { return Histogram::empty(n) };
        Histogram {
            buckets: &self.0[base..=base + n],
            sum: self.0[base + n + 1] as f64 / 1e6,
            count: self.0[base + n + 2],
        }
    }

    /// Requests per latency bucket over every model (for percentiles in `inferd status`).
    pub fn request_latency_buckets(&self) -> Vec<u64> {
        let n = LATENCY_BUCKETS.len() + 1;
        (0..n).map(|b| (0..MAX_MODELS).map(|m| self.0[REQUEST_LATENCY_AT + m * LATENCY_SLOTS + b]).sum()).collect()
    }

    pub fn batch(&self, model: usize) -> Histogram<'_> {
        let n = BATCH_BUCKETS.len();
        if model >= MAX_MODELS {
            return Histogram::empty(n);
        }
        let base = BATCH_AT + model * BATCH_SLOTS;
        Histogram { buckets: &self.0[base..=base + n], sum: self.0[base + n + 1] as f64, count: self.0[base + n + 2] }
    }

    pub fn in_flight(&self) -> u64 {
        self.0[IN_FLIGHT_AT]
    }

    pub fn queued(&self) -> u64 {
        self.0[QUEUED_AT]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_of_one_region_see_the_same_counters() {
        let (a, fd) = WorkerCounters::create("inferd-test").unwrap();
        let b = WorkerCounters::map(&fd).unwrap();
        a.count_request(0, Endpoint::Embed, 200);
        b.count_request(0, Endpoint::Embed, 200);
        b.count_request(3, Endpoint::Infer, 418);
        b.count_request(1, Endpoint::Invocations, 200);
        a.observe_latency(Latency::Compute, 2, 0.003);
        a.observe_batch(2, 3);
        a.in_flight(2);
        a.in_flight(-1);
        let s = b.snapshot();
        assert_eq!(s.requests(0, Endpoint::Embed, 200), 2);
        assert_eq!(s.requests(3, Endpoint::Infer, 0), 1, "unknown codes count as other");
        assert_eq!(s.requests(1, Endpoint::Invocations, 200), 1, "the last endpoint has its own row");
        assert_eq!(s.requests(1, Endpoint::Rerank, 200), 0);
        assert_eq!(s.requests_total(), 4);
        let h = s.latency(Latency::Compute, 2);
        assert_eq!((h.count, h.buckets[3]), (1, 1), "0.003 s falls in the 0.005 bucket");
        assert!((h.sum - 0.003).abs() < 1e-6);
        assert_eq!(s.batch(2).buckets[2], 1, "3 falls in the 4 bucket");
        assert_eq!(s.in_flight(), 1);
        // Rows follow the models: model 2's counters become row 0's, model 0's are dropped.
        let moved = s.remapped(&[None, Some(1), Some(0)]);
        assert_eq!((moved.requests(0, Endpoint::Embed, 200), moved.requests(3, Endpoint::Infer, 0)), (0, 0));
        assert_eq!(moved.latency(Latency::Compute, 0).count, 1);
        assert_eq!(moved.batch(0).buckets[2], 1);
        assert_eq!(moved.latency(Latency::Compute, 2).count, 0);
        assert_eq!(moved.in_flight(), 1, "gauges stay");
        a.answered(1, 200, 0.5);
        a.answered(1, 503, 0.25);
        a.observe_latency(Latency::Request, 1, 0.5);
        a.observe_latency(Latency::Request, 1, 0.25);
        let Outcomes { ok_seconds, failed_seconds, last_millis: last, .. } = b.snapshot().outcomes(1);
        assert!((ok_seconds - 0.5).abs() < 1e-6 && (failed_seconds - 0.25).abs() < 1e-6);
        let mut twice = b.snapshot();
        twice.add(&b.snapshot());
        assert_eq!(twice.outcomes(1).last_millis, last, "the last answer's time is a maximum, not a sum");
        a.busy_since(Some(monotonic_nanos()));
        assert!(b.model_thread().0.is_some());
        a.busy_since(None);
        a.beat();
        let (busy, beat) = b.model_thread();
        assert!(busy.is_none() && beat.unwrap() < 1.0);
        let mut total = Snapshot::default();
        total.add(&s.clone().without_gauges());
        total.add(&s);
        assert_eq!(total.requests_total(), 8);
        assert_eq!(total.in_flight(), 1);
    }

    #[test]
    fn auth_refusals_are_counted_by_reason() {
        // The counters are indexed by the enum's value: `Refusal::ALL` must be in its order.
        assert!(Refusal::ALL.iter().enumerate().all(|(i, &r)| r as usize == i));
        let (a, _fd) = WorkerCounters::create("inferd-test").unwrap();
        a.count_auth_refusal(Refusal::Invalid);
        a.count_auth_refusal(Refusal::Invalid);
        a.count_auth_refusal(Refusal::Missing);
        assert_eq!(a.snapshot().auth_refused(), &[1, 2]);
    }

    #[test]
    fn model_rows_beyond_the_limit_share_the_last() {
        assert_eq!(
            request_index(MAX_MODELS + 5, Endpoint::Infer, 200),
            request_index(MAX_MODELS, Endpoint::Infer, 200)
        );
        let none = Snapshot::default();
        assert_eq!(none.latency(Latency::Request, MAX_MODELS + 1).count, 0);
        assert_eq!(none.batch(MAX_MODELS).buckets.len(), BATCH_BUCKETS.len() + 1);
        assert!(request_index(MAX_MODELS, Endpoint::Invocations, 0) < QUEUE_AT);
    }
}
