//! An HTTP request let in by the door, dispatched to its route's handler: KServe v2's
//! ([`crate::http::v2`]), TEI's ([`crate::http::tei`]), OpenAI's and Cohere's; or sent to the
//! sibling that holds its model ([`crate::http::forward`]). Each inference is counted under
//! its model and endpoint, and its answer names the model's version.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;

use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::{Method, Request, StatusCode};

use inferd_config::model::Task;
use inferd_ipc::stats::Endpoint;

use crate::http::reply::{json_reply, Reply};
use crate::http::route::{self, Route};
use crate::http::{body, cohere, forward, model_config, openai, shared_memory, tei, trace_setting, v2};
use crate::request::app::{counted, found_index, AppState};
use crate::request::call::Call;
use crate::request::error::ApiError;
use crate::request::model::Model;

/// A request let in by the door ([`crate::request::door`]), served by its route's handler
/// (or sent to the sibling that holds its model); `call`: what the door learned of it.
pub async fn routed(
    state: &AppState,
    peer: SocketAddr,
    request: Request<Incoming>,
    call: &Call,
) -> Result<Reply, ApiError> {
    let path = request.uri().path().to_string();
    let method = request.method().clone();
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let route = route::parse(&segments).ok_or_else(|| ApiError::NotFound(format!("no route for {method} {path}")))?;
    let kind = route.kind();
    let allowed = match method {
        Method::POST => kind.post,
        Method::GET | Method::HEAD => kind.get,
        _ => false,
    };
    if !allowed {
        return Err(ApiError::MethodNotAllowed(method, path.clone()));
    }
    let ready = state.ready.load(Ordering::Relaxed);
    // models.placement = "pool": a request for a model a sibling holds (and this worker could
    // only load by evicting others) is that sibling's. Its head is copied only when it goes
    // (or, for OpenAI's route, whose body names the model, before that body is read).
    let forwardable = forward::forwardable(state, &request);
    // An inference for a model its path names.
    let named = route.model().flatten().filter(|_| kind.post);
    if let (Some(name), true) = (named, forwardable) {
        if let Some(sibling) = forward::sibling_for(state, name).await {
            let head = forward::Head::of(&request, peer);
            let body = body::receive(state, request, call.terms.deadline).await?;
            return forward::send(state, sibling, head, body.bytes.clone(), call.terms.deadline).await;
        }
    }
    match route {
        Route::Server => Ok(v2::server_metadata(state)),
        Route::Live => Ok(json_reply(StatusCode::OK, b"{\"live\":true}".to_vec())),
        Route::Ready => Ok(readiness(ready)),
        Route::Statistics(name, version) => v2::statistics(state, name, version).await,
        Route::RepositoryIndex => v2::repository_index(state, request).await,
        Route::RepositoryChange(name, load) => v2::repository_change(state, name, load, request).await,
        Route::TraceSetting(model) => {
            let asked = match method {
                Method::POST => {
                    Some(trace_setting::asked_of_json(&body::receive(state, request, call.terms.deadline).await?)?)
                }
                _ => None,
            };
            let settings = trace_setting::answer(state, model, call, asked.as_ref()).await?;
            let answer = trace_setting::to_json(&settings);
            Ok(json_reply(StatusCode::OK, serde_json::to_vec(&answer).expect("json")))
        }
        Route::SharedMemory(memory, action) => {
            let registration = match action {
                shared_memory::Action::Register(name) if memory == shared_memory::Memory::System => {
                    let body = body::receive(state, request, call.terms.deadline).await?;
                    Some(serde_json::from_slice(&body.bytes).map_err(|e| {
                        ApiError::BadRequest(format!(
                            "registering shared memory region '{name}': the body must be {{\"key\": ..., \"offset\": \
                             ..., \"byte_size\": ...}}: {e}"
                        ))
                    })?)
                }
                _ => None,
            };
            let regions = shared_memory::answer(state.shared_memory.as_ref(), memory, action, registration)?;
            Ok(match action {
                shared_memory::Action::Status(_) => {
                    json_reply(StatusCode::OK, serde_json::to_vec(&shared_memory::to_json(&regions)).expect("json"))
                }
                _ => json_reply(StatusCode::OK, Vec::new()),
            })
        }
        // A model loaded on demand is not loaded by being asked about.
        Route::Model(name, None) if state.models.loads_on_demand(name) => Ok(v2::not_loaded(name, None)),
        Route::ModelReady(name, None) if state.models.loads_on_demand(name) => Ok(v2::not_loaded(name, Some(ready))),
        Route::ModelConfig(name, None) if state.models.loads_on_demand(name) => Ok(v2::not_loaded(name, None)),
        Route::Model(name, version) => {
            state.models.find(name, version, call).await.map(|(_, m)| versioned(v2::model_metadata(&m), &m))
        }
        Route::ModelReady(name, version) => {
            state.models.find(name, version, call).await.map(|(_, m)| versioned(readiness(ready), &m))
        }
        Route::ModelConfig(name, version) => state.models.find(name, version, call).await.map(|(_, m)| {
            let config = model_config::Config::of(&m, state.max_batch_inputs).to_json();
            versioned(json_reply(StatusCode::OK, serde_json::to_vec(&config).expect("json")), &m)
        }),
        Route::Infer(name, version) => {
            let found = state.models.find(name, version, call).await;
            let row = found_index(state, &found);
            let work = async {
                let (index, meta) = found?;
                v2::infer(state, call, index, &meta, request).await.map(|r| versioned(r, &meta))
            };
            counted(state, row, Endpoint::Infer, work).await
        }
        // Counted as KServe inference: it is one, in another body.
        Route::Generate(name, version, stream) => {
            let found = state.models.find(name, version, call).await;
            let row = found_index(state, &found);
            let work = async {
                let (index, meta) = found?;
                v2::generate(state, call, index, &meta, request, stream).await.map(|r| versioned(r, &meta))
            };
            counted(state, row, Endpoint::Infer, work).await
        }
        Route::Embed(name) => tei_route(state, name, request, call, Endpoint::Embed, tei::embed).await,
        Route::Predict(name) => tei_route(state, name, request, call, Endpoint::Predict, tei::predict).await,
        Route::OpenAiEmbeddings => {
            // The model is named in the body; a name this server does not load (a client's
            // default) means the default model.
            let head = forwardable.then(|| forward::Head::of(&request, peer));
            let body = match body::receive(state, request, call.terms.deadline).await {
                Ok(body) => body,
                Err(e) => return counted(state, 0, Endpoint::OpenAiEmbeddings, async { Err(e) }).await,
            };
            let request = openai::parse(&body);
            let wanted = request.as_ref().ok().and_then(|r| r.model.as_deref());
            if let (Some(head), Some(name)) = (head, wanted) {
                if let Some(sibling) = forward::sibling_for(state, name).await {
                    return forward::send(state, sibling, head, body.bytes.clone(), call.terms.deadline).await;
                }
            }
            let found = match wanted {
                Some(name) => state.models.find(name, None, call).await.ok(),
                None => None,
            };
            let found = found.unwrap_or_else(|| (0, state.models.default_model()));
            let work = async {
                let reply = openai::embeddings(state, call, (found.0, &found.1), request?).await?;
                Ok(versioned(reply, &found.1))
            };
            counted(state, state.engine.row(found.0), Endpoint::OpenAiEmbeddings, work).await
        }
        Route::Info => Ok(tei::info(state, &state.models.default_model())),
        Route::Tokenize => {
            tei::tokenize(
                state,
                &state.models.default_model(),
                &body::receive(state, request, call.terms.deadline).await?,
            )
            .await
        }
        Route::Decode => tei::decode(
            state,
            &state.models.default_model(),
            &body::receive(state, request, call.terms.deadline).await?,
        ),
        Route::Similarity => tei_route(state, None, request, call, Endpoint::Similarity, tei::similarity).await,
        Route::Rerank(name) => tei_route(state, name, request, call, Endpoint::Rerank, tei::rerank).await,
        Route::CohereRerank(version) => {
            // The model is named in the body: what fails before it is known counts under the
            // default model, as OpenAI's route does.
            let found = async {
                let request =
                    cohere::rerank::parse(&body::receive(state, request, call.terms.deadline).await?, version)?;
                let found = cohere::rerank::model_for(state, call, request.model.as_deref()).await?;
                Ok((request, found))
            };
            let (request, (index, meta)) = match found.await {
                Ok(found) => found,
                Err(e) => return counted(state, 0, Endpoint::CohereRerank, async { Err(e) }).await,
            };
            // v2's `priority`, over the header's (no higher than the key's either).
            let call = match request.priority {
                Some(p) => &call.at_priority(p),
                None => call,
            };
            let work = async {
                let reply = cohere::rerank::rerank(state, call, (index, &meta), request, version).await?;
                Ok(versioned(reply, &meta))
            };
            counted(state, state.engine.row(index), Endpoint::CohereRerank, work).await
        }
        Route::CohereEmbed(version) => {
            // As rerank: what fails before the model is known counts under the default model.
            let found = async {
                let request =
                    cohere::embed::parse(&body::receive(state, request, call.terms.deadline).await?, version)?;
                let found = cohere::embed::model_for(state, call, request.model.as_deref()).await?;
                Ok((request, found))
            };
            let (request, (index, meta)) = match found.await {
                Ok(found) => found,
                Err(e) => return counted(state, 0, Endpoint::CohereEmbed, async { Err(e) }).await,
            };
            let call = match request.priority {
                Some(p) => &call.at_priority(p),
                None => call,
            };
            let work = async {
                let reply = cohere::embed::embed(state, call, (index, &meta), request, version).await?;
                Ok(versioned(reply, &meta))
            };
            counted(state, state.engine.row(index), Endpoint::CohereEmbed, work).await
        }
        Route::EmbedAll => tei_route(state, None, request, call, Endpoint::EmbedAll, tei::embed_all).await,
        Route::EmbedChunks(name) => {
            tei_route(state, name, request, call, Endpoint::EmbedChunks, tei::embed_chunks).await
        }
        Route::EmbedSparse(name) => {
            tei_route(state, name, request, call, Endpoint::EmbedSparse, tei::embed_sparse).await
        }
        // Counted with /embed: the shared counters' rows of endpoints stay as they are.
        Route::Encode(name) => tei_route(state, name, request, call, Endpoint::Embed, tei::encode).await,
        Route::Invocations => {
            let meta = &state.models.default_model();
            let embedding = match meta.task {
                Task::Embedding => true,
                Task::Classification => false,
                Task::Raw => {
                    return Err(ApiError::BadRequest(format!(
                        "the default model '{}' has no pipeline; send its tensors to /v2/models/{0}/infer",
                        meta.info.name
                    )))
                }
            };
            let work = async {
                let body = body::receive(state, request, call.terms.deadline).await?;
                let tei = tei::Inference { state, call, index: 0, meta };
                let reply = match embedding {
                    true => tei::embed(tei, &body).await,
                    false => tei::predict(tei, &body).await,
                };
                reply.map(|r| versioned(r, meta))
            };
            counted(state, 0, Endpoint::Invocations, work).await
        }
        Route::Ping => Ok(readiness(ready)),
    }
}

/// A TEI route: the model `name` names (None: the default model) looked up, the body read and
/// `handler` run on them, all counted under `endpoint`; the answer carries the model's version.
async fn tei_route(
    state: &AppState,
    name: Option<&str>,
    request: Request<Incoming>,
    call: &Call,
    endpoint: Endpoint,
    handler: impl AsyncFnOnce(tei::Inference<'_>, &[u8]) -> Result<Reply, ApiError>,
) -> Result<Reply, ApiError> {
    let found = match name {
        Some(name) => state.models.find(name, None, call).await,
        None => Ok((0, state.models.default_model())),
    };
    let row = found_index(state, &found);
    let work = async {
        let (index, meta) = found?;
        let body = body::receive(state, request, call.terms.deadline).await?;
        handler(tei::Inference { state, call, index, meta: &meta }, &body).await.map(|r| versioned(r, &meta))
    };
    counted(state, row, endpoint, work).await
}

/// `x-inferd-model-version: <version label>+<sha256 prefix>`: which model answered, so a
/// client can see a rolling reload arrive.
pub fn versioned(mut reply: Reply, meta: &Model) -> Reply {
    if let Ok(v) = HeaderValue::from_str(&meta.info.full_version()) {
        reply.headers_mut().insert("x-inferd-model-version", v);
    }
    reply
}

pub fn readiness(ready: bool) -> Reply {
    if ready {
        json_reply(StatusCode::OK, b"{\"ready\":true}".to_vec())
    } else {
        json_reply(StatusCode::SERVICE_UNAVAILABLE, b"{\"ready\":false}".to_vec())
    }
}
