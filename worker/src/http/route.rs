//! The HTTP routes: each path's endpoint, and what each endpoint is (its template, the model
//! its path names, its error bodies' style, its method, whether it is a probe).

use inferd_config::restricted::Api;

use crate::http::{cohere, shared_memory};

/// The endpoints; `/versions/{v}` is accepted wherever the protocol allows it, and a missing
/// model name means the default model.
pub enum Route<'a> {
    Server,
    Live,
    Ready,
    Model(&'a str, Option<&'a str>),
    ModelReady(&'a str, Option<&'a str>),
    /// Triton's model configuration extension ([`model_config`]).
    ModelConfig(&'a str, Option<&'a str>),
    Infer(&'a str, Option<&'a str>),
    /// Triton's generate extension ([`crate::kserve::generate`]): one answer (false) or the
    /// same answer as a server-sent event (`generate_stream`, true).
    Generate(&'a str, Option<&'a str>, bool),
    /// Triton's statistics extension: every model's (None), or one's (of one version); the
    /// pool's counters, which the supervisor holds.
    Statistics(Option<&'a str>, Option<&'a str>),
    /// Triton's repository index (the supervisor's answer too).
    RepositoryIndex,
    /// Triton's repository `load` (true) or `unload` of a model: a rolling reload the
    /// supervisor runs, with admin.model_control_on_main_port.
    RepositoryChange(&'a str, bool),
    /// Triton's trace settings, the global ones (None) or a model's ([`crate::http::trace_setting`]).
    TraceSetting(Option<&'a str>),
    /// Triton's shared-memory extensions ([`shared_memory`]).
    SharedMemory(shared_memory::Memory, shared_memory::Action<'a>),
    Embed(Option<&'a str>),
    Predict(Option<&'a str>),
    /// OpenAI's `POST /v1/embeddings`; the model is named in the body.
    OpenAiEmbeddings,
    /// text-embeddings-inference's routes for the default model.
    Info,
    Tokenize,
    Decode,
    Similarity,
    EmbedAll,
    /// `/embed_chunks` (late chunking), for the default model or one named in the path.
    EmbedChunks(Option<&'a str>),
    EmbedSparse(Option<&'a str>),
    /// `/encode` (BGE-M3's three outputs), for the default model or one named in the path.
    Encode(Option<&'a str>),
    Rerank(Option<&'a str>),
    /// Cohere's `POST /v1/rerank` and `/v2/rerank`; the model is named in the body.
    CohereRerank(cohere::Version),
    /// Cohere's `POST /v1/embed` and `/v2/embed`; the model is named in the body.
    CohereEmbed(cohere::Version),
    /// `POST /` and SageMaker's `POST /invocations`: `/embed` or `/predict` by the default
    /// model's task.
    Invocations,
    /// SageMaker's health check.
    Ping,
}

/// The shape of an error body: KServe v2's `{"error"}`, text-embeddings-inference's (with
/// `error_type`), OpenAI's or Cohere's.
#[derive(Clone, Copy)]
pub enum ErrorStyle {
    V2,
    Tei,
    OpenAi,
    Cohere,
}

impl<'a> Route<'a> {
    /// The model the route is for: `Some(Some(name))` named in the path, `Some(None)` the
    /// default model unless the path names one (TEI's routes), None for the other routes
    /// (OpenAI's names its model in the body).
    pub fn model(&self) -> Option<Option<&'a str>> {
        match *self {
            Route::Model(m, _)
            | Route::ModelReady(m, _)
            | Route::ModelConfig(m, _)
            | Route::Infer(m, _)
            | Route::Generate(m, _, _) => Some(Some(m)),
            Route::Embed(m)
            | Route::Predict(m)
            | Route::Rerank(m)
            | Route::EmbedSparse(m)
            | Route::EmbedChunks(m)
            | Route::Encode(m) => Some(m),
            Route::Similarity | Route::EmbedAll | Route::Info | Route::Tokenize | Route::Decode => Some(None),
            _ => None,
        }
    }

    /// The route as OpenTelemetry's `http.route` names it: the path's template.
    pub fn template(&self) -> &'static str {
        match self {
            Route::Server => "/v2",
            Route::Live => "/v2/health/live",
            Route::Ready => "/v2/health/ready",
            Route::Model(_, None) => "/v2/models/{model}",
            Route::Model(_, Some(_)) => "/v2/models/{model}/versions/{version}",
            Route::ModelReady(_, None) => "/v2/models/{model}/ready",
            Route::ModelReady(_, Some(_)) => "/v2/models/{model}/versions/{version}/ready",
            Route::ModelConfig(_, None) => "/v2/models/{model}/config",
            Route::ModelConfig(_, Some(_)) => "/v2/models/{model}/versions/{version}/config",
            Route::Infer(_, None) => "/v2/models/{model}/infer",
            Route::Infer(_, Some(_)) => "/v2/models/{model}/versions/{version}/infer",
            Route::Generate(_, None, false) => "/v2/models/{model}/generate",
            Route::Generate(_, Some(_), false) => "/v2/models/{model}/versions/{version}/generate",
            Route::Generate(_, None, true) => "/v2/models/{model}/generate_stream",
            Route::Generate(_, Some(_), true) => "/v2/models/{model}/versions/{version}/generate_stream",
            Route::Statistics(None, _) => "/v2/models/stats",
            Route::Statistics(Some(_), None) => "/v2/models/{model}/stats",
            Route::Statistics(Some(_), Some(_)) => "/v2/models/{model}/versions/{version}/stats",
            Route::RepositoryIndex => "/v2/repository/index",
            Route::RepositoryChange(_, true) => "/v2/repository/models/{model}/load",
            Route::RepositoryChange(_, false) => "/v2/repository/models/{model}/unload",
            Route::TraceSetting(None) => "/v2/trace/setting",
            Route::TraceSetting(Some(_)) => "/v2/models/{model}/trace/setting",
            Route::SharedMemory(memory, action) => {
                use shared_memory::{Action::*, Memory::*};
                match (memory, action) {
                    (System, Status(None)) => "/v2/systemsharedmemory/status",
                    (System, Status(Some(_))) => "/v2/systemsharedmemory/region/{region}/status",
                    (System, Register(_)) => "/v2/systemsharedmemory/region/{region}/register",
                    (System, Unregister(None)) => "/v2/systemsharedmemory/unregister",
                    (System, Unregister(Some(_))) => "/v2/systemsharedmemory/region/{region}/unregister",
                    (Cuda, Status(None)) => "/v2/cudasharedmemory/status",
                    (Cuda, Status(Some(_))) => "/v2/cudasharedmemory/region/{region}/status",
                    (Cuda, Register(_)) => "/v2/cudasharedmemory/region/{region}/register",
                    (Cuda, Unregister(None)) => "/v2/cudasharedmemory/unregister",
                    (Cuda, Unregister(Some(_))) => "/v2/cudasharedmemory/region/{region}/unregister",
                }
            }
            Route::Embed(None) => "/embed",
            Route::Embed(Some(_)) => "/v2/models/{model}/embed",
            Route::Predict(None) => "/predict",
            Route::Predict(Some(_)) => "/v2/models/{model}/predict",
            Route::OpenAiEmbeddings => "/v1/embeddings",
            Route::Info => "/info",
            Route::Tokenize => "/tokenize",
            Route::Decode => "/decode",
            Route::Similarity => "/similarity",
            Route::EmbedAll => "/embed_all",
            Route::EmbedChunks(None) => "/embed_chunks",
            Route::EmbedChunks(Some(_)) => "/v2/models/{model}/embed_chunks",
            Route::EmbedSparse(None) => "/embed_sparse",
            Route::EmbedSparse(Some(_)) => "/v2/models/{model}/embed_sparse",
            Route::Encode(None) => "/encode",
            Route::Encode(Some(_)) => "/v2/models/{model}/encode",
            Route::Rerank(None) => "/rerank",
            Route::Rerank(Some(_)) => "/v2/models/{model}/rerank",
            Route::CohereRerank(cohere::Version::V1) => "/v1/rerank",
            Route::CohereRerank(cohere::Version::V2) => "/v2/rerank",
            Route::CohereEmbed(cohere::Version::V1) => "/v1/embed",
            Route::CohereEmbed(cohere::Version::V2) => "/v2/embed",
            Route::Invocations => "/invocations",
            Route::Ping => "/ping",
        }
    }

    /// What the route is, beside its path: one row each.
    pub fn kind(&self) -> Kind {
        use Api::*;
        use ErrorStyle::*;
        // Its API category is Triton's grouping ([[auth.restricted]]): TEI's `/info` is
        // metadata, and every route that runs a model (or its tokenizer) is inference.
        let (style, post, probe, api) = match self {
            Route::Server | Route::Model(..) => (V2, false, false, Metadata),
            Route::ModelConfig(..) => (V2, false, false, ModelConfig),
            Route::Statistics(..) => (V2, false, false, Statistics),
            Route::RepositoryIndex | Route::RepositoryChange(..) => (V2, true, false, ModelRepository),
            Route::TraceSetting(_) => (V2, true, false, Trace),
            Route::SharedMemory(_, action) => {
                (V2, !matches!(action, shared_memory::Action::Status(_)), false, SharedMemory)
            }
            Route::Live | Route::Ready | Route::ModelReady(..) => (V2, false, true, Health),
            Route::Infer(..) | Route::Generate(..) => (V2, true, false, Inference),
            Route::OpenAiEmbeddings => (OpenAi, true, false, Inference),
            Route::CohereRerank(_) | Route::CohereEmbed(_) => (Cohere, true, false, Inference),
            Route::Embed(_)
            | Route::Predict(_)
            | Route::Tokenize
            | Route::Decode
            | Route::Similarity
            | Route::EmbedAll
            | Route::EmbedChunks(_)
            | Route::EmbedSparse(_)
            | Route::Encode(_)
            | Route::Rerank(_)
            | Route::Invocations => (Tei, true, false, Inference),
            Route::Info => (Tei, false, false, Metadata),
            Route::Ping => (Tei, false, true, Health),
        };
        // Triton compresses infer answers alone, and its asyncio client asks for gzip on every
        // route while it inflates only those: metadata, statistics, the repository's answers
        // and generate's (which Triton does not compress) go as they are.
        let compress = post
            && !matches!(
                self,
                Route::RepositoryIndex
                    | Route::RepositoryChange(..)
                    | Route::SharedMemory(..)
                    | Route::TraceSetting(_)
                    | Route::Generate(..)
            );
        // Trace settings are read by GET and changed by POST.
        let get = !post || matches!(self, Route::TraceSetting(_));
        Kind { style, post, get, probe, compress, api }
    }
}

pub fn parse<'a>(segments: &[&'a str]) -> Option<Route<'a>> {
    Some(match *segments {
        ["v2"] => Route::Server,
        ["v2", "health", "live"] | ["health"] => Route::Live,
        ["v2", "health", "ready"] => Route::Ready,
        // Before `/v2/models/{model}`: Triton's statistics of every model.
        ["v2", "models", "stats"] => Route::Statistics(None, None),
        ["v2", "models", name, "stats"] => Route::Statistics(Some(name), None),
        ["v2", "models", name, "versions", v, "stats"] => Route::Statistics(Some(name), Some(v)),
        ["v2", "repository", "index"] => Route::RepositoryIndex,
        ["v2", "trace", "setting"] => Route::TraceSetting(None),
        ["v2", "models", name, "trace", "setting"] => Route::TraceSetting(Some(name)),
        ["v2", memory @ ("systemsharedmemory" | "cudasharedmemory"), ref rest @ ..] => {
            use shared_memory::Action;
            let memory = match memory {
                "cudasharedmemory" => shared_memory::Memory::Cuda,
                _ => shared_memory::Memory::System,
            };
            let action = match *rest {
                ["status"] => Action::Status(None),
                ["unregister"] => Action::Unregister(None),
                ["region", region, "status"] => Action::Status(Some(region)),
                ["region", region, "register"] => Action::Register(region),
                ["region", region, "unregister"] => Action::Unregister(Some(region)),
                _ => return None,
            };
            Route::SharedMemory(memory, action)
        }
        ["v2", "repository", "models", name, "load"] => Route::RepositoryChange(name, true),
        ["v2", "repository", "models", name, "unload"] => Route::RepositoryChange(name, false),
        ["v2", "models", name] => Route::Model(name, None),
        ["v2", "models", name, "versions", v] => Route::Model(name, Some(v)),
        ["v2", "models", name, "ready"] => Route::ModelReady(name, None),
        ["v2", "models", name, "versions", v, "ready"] => Route::ModelReady(name, Some(v)),
        ["v2", "models", name, "config"] => Route::ModelConfig(name, None),
        ["v2", "models", name, "versions", v, "config"] => Route::ModelConfig(name, Some(v)),
        ["v2", "models", name, "infer"] => Route::Infer(name, None),
        ["v2", "models", name, "versions", v, "infer"] => Route::Infer(name, Some(v)),
        ["v2", "models", name, "generate"] => Route::Generate(name, None, false),
        ["v2", "models", name, "versions", v, "generate"] => Route::Generate(name, Some(v), false),
        ["v2", "models", name, "generate_stream"] => Route::Generate(name, None, true),
        ["v2", "models", name, "versions", v, "generate_stream"] => Route::Generate(name, Some(v), true),
        ["embed"] => Route::Embed(None),
        ["v2", "models", name, "embed"] => Route::Embed(Some(name)),
        ["predict"] => Route::Predict(None),
        ["v2", "models", name, "predict"] => Route::Predict(Some(name)),
        ["v1", "embeddings"] | ["embeddings"] => Route::OpenAiEmbeddings,
        ["info"] => Route::Info,
        ["tokenize"] => Route::Tokenize,
        ["decode"] => Route::Decode,
        ["similarity"] => Route::Similarity,
        ["embed_all"] => Route::EmbedAll,
        ["embed_chunks"] => Route::EmbedChunks(None),
        ["v2", "models", name, "embed_chunks"] => Route::EmbedChunks(Some(name)),
        ["embed_sparse"] => Route::EmbedSparse(None),
        ["v2", "models", name, "embed_sparse"] => Route::EmbedSparse(Some(name)),
        ["encode"] => Route::Encode(None),
        ["v2", "models", name, "encode"] => Route::Encode(Some(name)),
        ["rerank"] => Route::Rerank(None),
        ["v1", "rerank"] => Route::CohereRerank(cohere::Version::V1),
        ["v2", "rerank"] => Route::CohereRerank(cohere::Version::V2),
        ["v1", "embed"] => Route::CohereEmbed(cohere::Version::V1),
        ["v2", "embed"] => Route::CohereEmbed(cohere::Version::V2),
        ["v2", "models", name, "rerank"] => Route::Rerank(Some(name)),
        ["invocations"] | [""] => Route::Invocations,
        ["ping"] => Route::Ping,
        _ => return None,
    })
}

/// What a route is ([`Route::kind`]).
#[derive(Clone, Copy)]
pub struct Kind {
    pub style: ErrorStyle,
    /// Served to POST (an inference, TEI's tokenizer, a change).
    pub post: bool,
    /// Served to GET and HEAD (what is not POST's, and trace settings).
    pub get: bool,
    /// A health or readiness probe ([`crate::request::door::Arrival::probe`]).
    pub probe: bool,
    /// Its answer is compressed where the client asks ([`crate::http::compress`]): an
    /// inference's (or TEI's tokenizer's), not metadata's.
    pub compress: bool,
    /// Its API category ([[auth.restricted]]).
    pub api: Api,
}
