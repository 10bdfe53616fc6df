//! What a batch is made of: a [`Job`] (one request's tensors and its reply), which jobs can
//! share an ORT call ([`Join`], [`Job::fits`]), a model's limits ([`Policy`]), and how a
//! batch's inputs are assembled ([`merge`]) and its outputs split back ([`split`]).

use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::HEAVY_TOKENS;
use crate::runtime::model::{ModelError, ModelSession};
use crate::runtime::tensor::element_count;
use crate::runtime::tensor::Tensor;

/// How a job's tensors may be combined with other jobs' tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Join {
    /// Every dimension but the first must match (raw tensors, images).
    Exact,
    /// Tokenised text `[rows, sequence, ...]`: the sequence axis may differ and is padded with
    /// zeros (attention mask 0) to the batch's longest row.
    PadSequence,
}

/// Where a job's result goes: the handler awaiting it (not an HTTP answer: that is
/// `request::app::Reply`).
pub(super) type ReplyTo = oneshot::Sender<Result<Vec<Tensor>, ModelError>>;

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
}

impl Job {
    pub(super) fn new(model: usize, inputs: Vec<Tensor>, join: Join, deadline: Option<Instant>, reply: ReplyTo) -> Job {
        let rows = inputs.first().and_then(|t| t.shape.first()).copied().unwrap_or(0);
        let width = match join {
            Join::Exact => Some(1),
            Join::PadSequence => inputs.first().and_then(|t| t.shape.get(1)).copied(),
        };
        // Batchable: every input has the same rows (and width), and each row holds data.
        let uniform = width.is_some()
            && inputs.iter().all(|t| {
                t.shape.first() == Some(&rows)
                    && (join == Join::Exact || t.shape.get(1).copied() == width)
                    && element_count(&t.shape[1..]).is_some_and(|n| n > 0)
            });
        let rows = (uniform && rows > 0).then_some(rows as usize);
        let width = width.unwrap_or(1).max(1) as usize;
        Job { model, inputs, join, rows, width, queued_at: Instant::now(), deadline, reply }
    }

    /// Whether `other` can run in one ORT call with `self`.
    pub(super) fn fits(&self, other: &Job) -> bool {
        let same_tensor = |a: &Tensor, b: &Tensor| {
            let skip = if self.join == Join::PadSequence { 2 } else { 1 };
            a.name == b.name
                && a.data.dtype() == b.data.dtype()
                && a.shape.len() == b.shape.len()
                && a.shape[skip.min(a.shape.len())..] == b.shape[skip.min(b.shape.len())..]
        };
        self.model == other.model
            && self.join == other.join
            && self.rows.is_some()
            && other.rows.is_some()
            && self.inputs.len() == other.inputs.len()
            && self.inputs.iter().zip(&other.inputs).all(|(a, b)| same_tensor(a, b))
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
pub(super) struct Policy {
    /// 1 when the model has no dynamic batch dimension.
    pub(super) max_rows: usize,
    pub(super) max_tokens: usize,
    pub(super) delay: Duration,
}

impl Policy {
    pub(super) fn of(model: &ModelSession) -> Policy {
        let b = &model.entry().batching;
        let max_rows = if model.meta.batchable() { b.max_batch_size } else { 1 };
        Policy { max_rows, max_tokens: b.max_batch_tokens, delay: Duration::from_millis(b.max_queue_delay_ms) }
    }
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
        Job::new(0, inputs, Join::PadSequence, None, oneshot::channel().0)
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
    fn exact_jobs_must_agree_beyond_the_first_dimension() {
        let job = |shape: Vec<i64>, dtype_f32: bool| {
            let n = element_count(&shape).unwrap();
            let data = if dtype_f32 { TensorData::F32(vec![0.; n]) } else { TensorData::I32(vec![0; n]) };
            Job::new(0, vec![Tensor { name: "x".into(), shape, data }], Join::Exact, None, oneshot::channel().0)
        };
        assert!(job(vec![1, 4], true).fits(&job(vec![3, 4], true)));
        assert!(!job(vec![1, 4], true).fits(&job(vec![1, 5], true)));
        assert!(!job(vec![1, 4], true).fits(&job(vec![1, 4], false)));
        assert!(job(vec![0, 4], true).rows.is_none(), "no rows: never batched");
        assert!(job(vec![2, 0], true).rows.is_none(), "empty rows: never batched");
    }
}
