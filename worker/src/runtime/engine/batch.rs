//! What a batch is made of: a [`Job`] (one request's tensors and its reply), which jobs can
//! share an ORT call ([`Join`], [`Job::fits`]), a model's limits ([`Policy`]), how a
//! batch's inputs are assembled ([`merge`]) and its outputs split back ([`split`]), and how a
//! request past the limits is cut into runs within them ([`runs`], [`take_rows`]) whose outputs
//! are joined again ([`concat`]).

use std::ops::Range;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::runtime::engine::terms::{EngineError, Terms, Timing};
use crate::runtime::model::ModelSession;
use crate::runtime::tensor::element_count;
use crate::runtime::tensor::Tensor;

/// A job of at least this many tokens (rows x padded length; other jobs count their rows) is
/// *heavy*: one 256-token MiniLM text takes ~70 ms on one thread, 14x a short sentence. Heavy
/// jobs may occupy all lanes but one while lighter jobs wait, so a stream of long texts does
/// not hold short ones up behind it (measured: short texts' p99 went from 61 ms alone to 1.5 s
/// with one request in 8 of 256 tokens before this rule).
pub const HEAVY_TOKENS: usize = 256;

/// How a job's tensors may be combined with other jobs' tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Join {
    /// Every dimension but the first must match (raw tensors, images).
    Exact,
    /// Tokenised text `[rows, sequence, ...]`: the sequence axis may differ and is padded with
    /// zeros (attention mask 0) to the batch's longest row.
    PadSequence,
}

/// Where a job's result (its outputs and where its time went) goes: the handler awaiting it
/// (not an HTTP answer: that is `request::app::Reply`).
pub(super) type ReplyTo = oneshot::Sender<Result<(Vec<Tensor>, Timing), EngineError>>;

pub(super) struct Job {
    pub(super) model: usize,
    pub(super) inputs: Vec<Tensor>,
    pub(super) join: Join,
    /// Rows (the first dimension, the same in every input); `None` = cannot be batched.
    pub(super) rows: Option<usize>,
    /// Sequence length of a `PadSequence` job (1 otherwise).
    pub(super) width: usize,
    pub(super) queued_at: Instant,
    /// Past this the job is dropped before it reaches the model.
    pub(super) deadline: Option<Instant>,
    pub(super) reply: ReplyTo,
    /// The span of its request, when that is traced and sampled: the run links to it.
    pub(super) trace: Option<opentelemetry::trace::SpanContext>,
    /// Its request's priority, 0 the highest ([`Terms`]).
    pub(super) priority: u8,
    /// Whether it has begun running or its waiter has given up on it.
    pub(super) start: Start,
}

/// Which came first for a queued job: a lane beginning its run ([`Start::begin`]), or its
/// waiter giving up at the job's deadline ([`Start::give_up`]). Decided once, so a job
/// answered as timed out never runs, and one that began runs to its answer.
#[derive(Debug, Clone, Default)]
pub(super) struct Start(Arc<AtomicU8>);

const WAITING: u8 = 0;
const RUNNING: u8 = 1;
const GIVEN_UP: u8 = 2;

impl Start {
    /// Whether the job may run: true unless its waiter gave up first.
    pub(super) fn begin(&self) -> bool {
        match self.0.compare_exchange(WAITING, RUNNING, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => true,
            Err(state) => state == RUNNING,
        }
    }

    /// Whether the waiter may answer without the job's outputs: true unless its run began.
    pub(super) fn give_up(&self) -> bool {
        match self.0.compare_exchange(WAITING, GIVEN_UP, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => true,
            Err(state) => state == GIVEN_UP,
        }
    }
}

/// Whether two tensors can stand in one batch, row after row: the same name and element type,
/// and the same shape but for the rows (and, for text, the sequence length, padded).
fn agree(a: &Tensor, b: &Tensor, join: Join) -> bool {
    let skip = if join == Join::PadSequence { 2 } else { 1 };
    a.name == b.name
        && a.data.dtype() == b.data.dtype()
        && a.shape.len() == b.shape.len()
        && a.shape[skip.min(a.shape.len())..] == b.shape[skip.min(b.shape.len())..]
}

/// A request's rows and their (padded) length: `None` for the rows when they cannot be told
/// apart (the inputs disagree on them, or a row holds no data), so the request can be neither
/// batched nor cut.
fn rows_and_width(inputs: &[Tensor], join: Join) -> (Option<usize>, usize) {
    let rows = inputs.first().and_then(|t| t.shape.first()).copied().unwrap_or(0);
    let width = match join {
        Join::Exact => Some(1),
        Join::PadSequence => inputs.first().and_then(|t| t.shape.get(1)).copied(),
    };
    // Every input has the same rows (and width), and each row holds data.
    let uniform = width.is_some()
        && inputs.iter().all(|t| {
            t.shape.first() == Some(&rows)
                && (join == Join::Exact || t.shape.get(1).copied() == width)
                && element_count(&t.shape[1..]).is_some_and(|n| n > 0)
        });
    ((uniform && rows > 0).then_some(rows as usize), width.unwrap_or(1).max(1) as usize)
}

impl Job {
    pub(super) fn new(model: usize, inputs: Vec<Tensor>, join: Join, terms: Terms, reply: ReplyTo) -> Job {
        let (rows, width) = rows_and_width(&inputs, join);
        let trace = crate::trace::current();
        let Terms { priority, deadline } = terms;
        let start = Start::default();
        Job { model, inputs, join, rows, width, queued_at: Instant::now(), deadline, reply, trace, priority, start }
    }

    /// Whether `other` can run in one ORT call with `self`.
    pub(super) fn fits(&self, other: &Job) -> bool {
        self.model == other.model
            && self.join == other.join
            && self.rows.is_some()
            && other.rows.is_some()
            && self.inputs.len() == other.inputs.len()
            && self.inputs.iter().zip(&other.inputs).all(|(a, b)| agree(a, b, self.join))
    }

    /// Rows x padded length (rows alone for jobs that are not text).
    pub(super) fn tokens(&self) -> usize {
        self.rows.unwrap_or(1) * self.width
    }

    pub(super) fn heavy(&self) -> bool {
        self.tokens() >= HEAVY_TOKENS
    }

    pub(super) fn expired(&self, now: Instant) -> bool {
        self.deadline.is_some_and(|d| now >= d)
    }
}

/// A model's batching limits, from its model.toml `[batching]`.
#[derive(Debug, Clone)]
pub(super) struct Policy {
    /// Whether its first dimension is a batch ([`ModelMeta::batch_rows`]): requests may then be
    /// batched together, and cut into runs of fewer rows.
    pub(super) batchable: bool,
    /// 1 when the model is not batchable.
    pub(super) max_rows: usize,
    pub(super) max_tokens: usize,
    pub(super) delay: Duration,
    /// Most of its jobs waiting at once in the pool (`[batching] max_queue_size`; 0: no limit
    /// of its own).
    pub(super) max_waiting: usize,
    /// Its key in the pool's waiting rows ([`inferd_ipc::balance::Waiting`]).
    pub(super) key: u64,
}

impl Policy {
    /// The limits of a job whose model was unloaded while it waited: it runs alone, and its
    /// lane answers that the model is gone.
    pub(super) const GONE: Policy =
        Policy { batchable: false, max_rows: 1, max_tokens: usize::MAX, delay: Duration::ZERO, max_waiting: 0, key: 0 };

    pub(super) fn of(model: &ModelSession) -> Policy {
        let b = &model.entry().batching;
        let rows = model.meta.batch_rows();
        Policy {
            batchable: rows.is_ok(),
            max_rows: rows.unwrap_or(1),
            max_tokens: b.max_batch_tokens,
            delay: Duration::from_millis(b.max_queue_delay_ms),
            max_waiting: b.max_queue_size,
            key: inferd_ipc::balance::Waiting::key(model.name()),
        }
    }
}

/// The runs a request past its model's limits is served in: its rows cut so that each run
/// stays within `max_batch_size` rows and `max_batch_tokens` padded tokens (at least one row a
/// run). One request of many long texts then takes its turns with other requests, a run at a
/// time, instead of holding a lane for seconds, and each of its runs is as fast per token as a
/// full batch. Returns the request's rows and the runs' ranges; `None` when it runs whole: it
/// fits, or cannot be cut (a model without a dynamic batch dimension, inputs that disagree on
/// their rows).
pub(super) fn runs(inputs: &[Tensor], join: Join, policy: &Policy) -> Option<(usize, Vec<Range<usize>>)> {
    let (rows, width) = rows_and_width(inputs, join);
    let rows = rows.filter(|_| policy.batchable)?;
    let per_run = (policy.max_tokens / width).min(policy.max_rows).max(1);
    (rows > per_run)
        .then(|| (rows, (0..rows).step_by(per_run).map(|start| start..(start + per_run).min(rows)).collect()))
}

/// Rows `range` of a request's inputs, `rows` in all (every input has them, see [`runs`]).
pub(super) fn take_rows(inputs: &[Tensor], range: Range<usize>, rows: usize) -> Vec<Tensor> {
    inputs
        .iter()
        .map(|t| {
            let row_len = t.data.len() / rows.max(1);
            let mut shape = t.shape.clone();
            shape[0] = range.len() as i64;
            Tensor { name: t.name.clone(), shape, data: t.data.slice(range.start * row_len..range.end * row_len) }
        })
        .collect()
}

/// Joins the outputs of a request's runs ([`runs`]) back into one, row after row; `rows` is
/// each run's. Text's runs may have been padded to different lengths (a run joins other
/// requests' batches): an output whose second dimension differs is padded with zeros to the
/// longest, as a batch pads its shorter rows. `None` when the runs' outputs cannot be joined
/// (an output without the run's rows, or that differs in type or beyond that dimension).
pub(super) fn concat(parts: Vec<Vec<Tensor>>, rows: &[usize], join: Join) -> Option<Vec<Tensor>> {
    let first = parts.first()?;
    let sound = parts.iter().zip(rows).all(|(part, &n)| {
        part.len() == first.len()
            && part.iter().zip(first).all(|(t, f)| agree(t, f, join) && t.shape.first() == Some(&(n as i64)))
    });
    if !sound {
        return None;
    }
    let total: usize = rows.iter().sum();
    (0..first.len())
        .map(|i| {
            let widest = parts.iter().map(|p| p[i].shape.get(1).copied().unwrap_or(1)).max().unwrap_or(1);
            let mut shape = first[i].shape.clone();
            shape[0] = total as i64;
            if let Some(width) = shape.get_mut(1) {
                *width = widest;
            }
            let row_len = element_count(&shape[1..])?;
            let mut data = first[i].data.dtype().zeros(0);
            for (part, &n) in parts.iter().zip(rows) {
                let from = part[i].data.len() / n.max(1);
                data.extend_rows(&part[i].data, n, from, row_len).then_some(())?;
            }
            Some(Tensor { name: first[i].name.clone(), shape, data })
        })
        .collect()
}

/// The batch's inputs: each job's rows one after the other, padded along the sequence axis to
/// the longest when the jobs are text.
pub(super) fn merge(batch: &[Job], total: usize) -> Vec<Tensor> {
    let width = batch.iter().map(|j| j.width).max().unwrap_or(1);
    batch[0]
        .inputs
        .iter()
        .enumerate()
        .map(|(i, first)| {
            let mut shape = first.shape.clone();
            shape[0] = total as i64;
            if batch[0].join == Join::PadSequence {
                shape[1] = width as i64;
            }
            let row_len = element_count(&shape[1..]).unwrap_or(0);
            let mut data = first.data.dtype().zeros(0);
            for job in batch {
                let input = &job.inputs[i];
                let rows = job.rows.unwrap_or(0);
                let from = input.data.len() / rows.max(1);
                let ok = data.extend_rows(&input.data, rows, from, row_len);
                debug_assert!(ok, "fits() checked the element types");
            }
            Tensor { name: first.name.clone(), shape, data }
        })
        .collect()
}

/// Splits a batch's outputs back into each job's rows; `None` when an output has no batch
/// dimension to split along.
pub(super) fn split(outputs: Vec<Tensor>, rows: &[usize]) -> Option<Vec<Vec<Tensor>>> {
    let total: usize = rows.iter().sum();
    let mut parts: Vec<Vec<Tensor>> = rows.iter().map(|_| Vec::with_capacity(outputs.len())).collect();
    for output in outputs {
        if output.shape.first().copied() != Some(total as i64) {
            return None;
        }
        let row_len = element_count(&output.shape[1..])?;
        let mut start = 0;
        for (part, &n) in parts.iter_mut().zip(rows) {
            let mut shape = output.shape.clone();
            shape[0] = n as i64;
            part.push(Tensor {
                name: output.name.clone(),
                shape,
                data: output.data.slice(start * row_len..(start + n) * row_len),
            });
            start += n;
        }
    }
    Some(parts)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::runtime::tensor::TensorData;

    pub(in crate::runtime::engine) fn text_job(rows: usize, width: usize, first_id: i64) -> Job {
        let ids: Vec<i64> = (0..(rows * width) as i64).map(|i| first_id + i).collect();
        let shape = vec![rows as i64, width as i64];
        let inputs = vec![
            Tensor { name: "input_ids".into(), shape: shape.clone(), data: TensorData::I64(ids) },
            Tensor { name: "attention_mask".into(), shape, data: TensorData::I64(vec![1; rows * width]) },
        ];
        Job::new(0, inputs, Join::PadSequence, Terms::default(), oneshot::channel().0)
    }

    #[test]
    fn text_jobs_pad_to_the_longest_row_and_split_back() {
        let batch = vec![text_job(1, 2, 10), text_job(2, 3, 20)];
        assert!(batch[0].fits(&batch[1]));
        let merged = merge(&batch, 3);
        assert_eq!(merged[0].shape, vec![3, 3]);
        assert_eq!(merged[0].data, TensorData::I64(vec![10, 11, 0, 20, 21, 22, 23, 24, 25]));
        assert_eq!(merged[1].data, TensorData::I64(vec![1, 1, 0, 1, 1, 1, 1, 1, 1]));

        let out = Tensor { name: "o".into(), shape: vec![3, 2], data: TensorData::F32(vec![0., 1., 2., 3., 4., 5.]) };
        let parts = split(vec![out], &[1, 2]).unwrap();
        assert_eq!(parts[0][0].shape, vec![1, 2]);
        assert_eq!(parts[1][0].data, TensorData::F32(vec![2., 3., 4., 5.]));
        // An output without the batch's rows cannot be split.
        let scalar = Tensor { name: "s".into(), shape: vec![], data: TensorData::F32(vec![1.]) };
        assert!(split(vec![scalar], &[1, 2]).is_none());
    }

    #[test]
    fn a_request_past_the_limits_is_cut_into_runs_within_them_and_joined_back() {
        let policy = |max_rows, max_tokens| Policy {
            batchable: true,
            max_rows,
            max_tokens,
            delay: Duration::ZERO,
            max_waiting: 0,
            key: 0,
        };
        let request = text_job(5, 100, 0).inputs;
        // 512 tokens a run: 5 rows of 100 in runs of 5; of 250 tokens, runs of 2, 2 and 1.
        assert!(runs(&request, Join::PadSequence, &policy(32, 512)).is_none(), "it fits: one run");
        let (rows, ranges) = runs(&request, Join::PadSequence, &policy(32, 250)).unwrap();
        assert_eq!((rows, ranges.clone()), (5, vec![0..2, 2..4, 4..5]));
        assert_eq!(runs(&request, Join::PadSequence, &policy(3, 512)).unwrap().1, vec![0..3, 3..5]);
        // A row past the budget runs alone; a model without a batch dimension is never cut.
        assert_eq!(runs(&request, Join::PadSequence, &policy(32, 10)).unwrap().1.len(), 5);
        let fixed = Policy { batchable: false, ..policy(1, 10) };
        assert!(runs(&request, Join::PadSequence, &fixed).is_none());

        let middle = take_rows(&request, 2..4, 5);
        assert_eq!(middle[0].shape, vec![2, 100]);
        assert_eq!(middle[0].data, TensorData::I64((200..400).collect()));
        assert_eq!(middle[1].data, TensorData::I64(vec![1; 200]));

        // Outputs [rows, sequence, 1]: the second run's was padded to 3 by a batch it joined.
        let out = |rows: i64, seq: i64, first: f32| {
            let data = (0..rows * seq).map(|i| first + i as f32).collect();
            Tensor { name: "o".into(), shape: vec![rows, seq, 1], data: TensorData::F32(data) }
        };
        let joined = concat(vec![vec![out(2, 2, 0.)], vec![out(1, 3, 10.)]], &[2, 1], Join::PadSequence).unwrap();
        assert_eq!(joined[0].shape, vec![3, 3, 1]);
        assert_eq!(joined[0].data, TensorData::F32(vec![0., 1., 0., 2., 3., 0., 10., 11., 12.]));
        // Images' runs must agree beyond the rows; an output without the run's rows cannot join.
        assert!(concat(vec![vec![out(2, 2, 0.)], vec![out(1, 3, 0.)]], &[2, 1], Join::Exact).is_none());
        assert!(concat(vec![vec![out(2, 2, 0.)], vec![out(2, 2, 0.)]], &[2, 1], Join::PadSequence).is_none());
    }

    #[test]
    fn exact_jobs_must_agree_beyond_the_first_dimension() {
        let job = |shape: Vec<i64>, dtype_f32: bool| {
            let n = element_count(&shape).unwrap();
            let data = if dtype_f32 { TensorData::F32(vec![0.; n]) } else { TensorData::I32(vec![0; n]) };
            Job::new(
                0,
                vec![Tensor { name: "x".into(), shape, data }],
                Join::Exact,
                Terms::default(),
                oneshot::channel().0,
            )
        };
        assert!(job(vec![1, 4], true).fits(&job(vec![3, 4], true)));
        assert!(!job(vec![1, 4], true).fits(&job(vec![1, 5], true)));
        assert!(!job(vec![1, 4], true).fits(&job(vec![1, 4], false)));
        assert!(job(vec![0, 4], true).rows.is_none(), "no rows: never batched");
        assert!(job(vec![2, 0], true).rows.is_none(), "empty rows: never batched");
    }
}
