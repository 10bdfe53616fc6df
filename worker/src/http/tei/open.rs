//! What every TEI inference route does around its own part: the model checked for what the
//! route needs and the body read as its request (its opening), the pipeline run, and a large
//! answer held against the worker's byte budget with how the pipeline ran.

use serde::Serialize;

use crate::http::reply::{annotate, large_json, Reply};
use crate::http::tei::bodies::parse;
use crate::jsonbody::OneOrMany;
use crate::pipeline::{Head, Pipeline, Text};
use crate::request::app::AppState;
use crate::request::call::Call;
use crate::request::error::ApiError;
use crate::request::model::Model;
use crate::request::tasks::{self, Options, Outcome, PipelineInput};
use inferd_config::model::{Pooling, Task};

/// One TEI inference on the model its route found: what each inference route's handler is
/// given (its body beside).
#[derive(Clone, Copy)]
pub struct Inference<'a> {
    pub state: &'a AppState,
    pub call: &'a Call,
    /// The model's place among the worker's (its row in the engine).
    pub index: usize,
    pub meta: &'a Model,
}

/// What an inference route needs of its model, checked before its body is read.
#[derive(Clone, Copy)]
pub(super) enum Needs {
    /// An embedding model (`/embed`, `/embed_all`, `/similarity`).
    Embedding,
    /// An embedding model with SPLADE pooling (`/embed_sparse`).
    Splade,
    /// An embedding model with BGE-M3's heads (`/encode`).
    BgeM3,
    /// A classification model (`/predict`).
    Classification,
    /// A cross-encoder (`/rerank`): a classification model, then one of one label
    /// ([`Model::cross_encoder`], the check Cohere's rerank makes too).
    CrossEncoder,
}

impl Inference<'_> {
    /// Every inference route's opening: the model checked for what `endpoint` needs, then the
    /// body read as the route's request.
    pub(super) fn open<T: serde::de::DeserializeOwned>(
        &self,
        needs: Needs,
        endpoint: &str,
        body: &[u8],
    ) -> Result<T, ApiError> {
        let meta = self.meta;
        match needs {
            Needs::Embedding => require(meta, Task::Embedding, endpoint)?,
            Needs::Splade => {
                require(meta, Task::Embedding, endpoint)?;
                let head = meta.pipeline.head();
                let splade =
                    matches!(head, Some(Head::Embedding { settings, .. }) if settings.pooling == Pooling::Splade);
                if !splade {
                    return Err(ApiError::BadRequest(format!(
                        "{endpoint} needs a SPLADE model (pooling = \"splade\"); '{}' gives dense vectors: use /embed",
                        meta.info.name
                    )));
                }
            }
            Needs::BgeM3 => {
                require(meta, Task::Embedding, endpoint)?;
                let m3 = matches!(&*meta.pipeline, Pipeline::Text(p) if p.bge_m3.is_some());
                if !m3 {
                    return Err(ApiError::BadRequest(format!(
                        "{endpoint} needs a BGE-M3 model (pooling = \"bge_m3\"); '{}' gives one vector per text: use /embed",
                        meta.info.name
                    )));
                }
            }
            Needs::Classification => require(meta, Task::Classification, endpoint)?,
            Needs::CrossEncoder => {
                require(meta, Task::Classification, endpoint)?;
                meta.cross_encoder(endpoint)?;
            }
        }
        parse(body)
    }

    /// Runs `input` through the model's pipeline with `options`.
    pub(super) async fn run(&self, input: PipelineInput, options: Options) -> Result<Outcome, ApiError> {
        tasks::run_pipeline(self.state, self.call, self.index, self.meta, input, options).await
    }

    /// Runs texts, each on its own: what `/embed`, `/embed_all` and `/embed_sparse` run.
    pub(super) async fn run_texts<T: Into<Text>>(
        &self,
        inputs: OneOrMany<T>,
        options: Options,
    ) -> Result<Outcome, ApiError> {
        let (texts, _) = inputs.into_vec();
        self.run(PipelineInput::Texts(texts.into_iter().map(Into::into).collect()), options).await
    }

    /// A large answer ([`large_json`]: `bound` is what its JSON takes at most) with the headers
    /// that say how the pipeline ran.
    pub(super) async fn ran_large<T: Serialize + Send + 'static>(
        &self,
        outcome: &Outcome,
        value: T,
        bound: u64,
    ) -> Result<Reply, ApiError> {
        let mut reply = large_json(self.state, value, bound).await?;
        annotate(&mut reply, outcome);
        Ok(reply)
    }
}

/// The model's task is `task`, or the refusal names the route that fits it.
fn require(meta: &Model, task: Task, endpoint: &str) -> Result<(), ApiError> {
    if meta.task == task {
        return Ok(());
    }
    let wanted = match task {
        Task::Embedding => "an embedding",
        Task::Classification => "a classification",
        Task::Raw => "a raw",
    };
    let other = match meta.task {
        Task::Embedding => "an embedding model; use /embed",
        Task::Classification => "a classification model; use /predict",
        Task::Raw => "a raw model (no pipeline); send tensors to /v2/models/NAME/infer",
    };
    Err(ApiError::BadRequest(format!("{endpoint} needs {wanted} model, but '{}' is {other}", meta.info.name)))
}
