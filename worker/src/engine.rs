//! The model thread: the one place sessions run.
//!
//! HTTP handlers never run inference on the async executor. They send a [`Job`] over a channel
//! and await its `oneshot` reply; the model thread takes jobs in order and runs them on the
//! worker's ORT thread pool. A dynamic batcher slots in here later: it would drain several
//! jobs from the same channel before one `run`.

use std::sync::mpsc;

use tokio::sync::oneshot;

use crate::model::{Model, ModelError, Tensor};

struct Job {
    model: usize,
    inputs: Vec<Tensor>,
    reply: oneshot::Sender<Result<Vec<Tensor>, ModelError>>,
}

/// Handle to the model thread; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    // std's channel: the receiving side is a plain thread that blocks on recv().
    jobs: mpsc::Sender<Job>,
}

impl Engine {
    /// Moves the loaded models onto a new thread named `inferd-model`.
    pub fn start(mut models: Vec<Model>) -> std::io::Result<Engine> {
        let (jobs, queue) = mpsc::channel::<Job>();
        std::thread::Builder::new().name("inferd-model".into()).spawn(move || {
            while let Ok(job) = queue.recv() {
                if job.reply.is_closed() {
                    continue; // the client went away while queued: skip the work
                }
                let result = models[job.model].run(job.inputs);
                let _ = job.reply.send(result);
            }
        })?;
        Ok(Engine { jobs })
    }

    /// Runs model number `model` (its index in the worker's model list).
    pub async fn infer(&self, model: usize, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, ModelError> {
        let (reply, answer) = oneshot::channel();
        self.jobs.send(Job { model, inputs, reply }).map_err(|_| ModelError::EngineGone)?;
        answer.await.map_err(|_| ModelError::EngineGone)?
    }
}
