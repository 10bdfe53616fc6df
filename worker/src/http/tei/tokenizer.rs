//! TEI's routes about the default model rather than through it: `GET /info` (what it is and
//! the limits requests meet), `POST /tokenize` and `POST /decode` (its tokenizer).
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use crate::http::reply::{json_reply, large_json, Reply};
use crate::http::tei::bodies::{parse, DecodeRequest, IdsOrId, Sequence, TokenizeInputs, TokenizeRequest};
use crate::jsonbody::OneOrMany;
use crate::pipeline::{Head, Pipeline, Text, TextPipeline};
use crate::request::app::AppState;
use crate::request::error::ApiError;
use crate::request::model::Model;
use crate::request::tasks;

fn text_pipeline<'a>(meta: &'a Model, endpoint: &str) -> Result<&'a TextPipeline, ApiError> {
    match &*meta.pipeline {
        Pipeline::Text(p) => Ok(p),
        _ => Err(ApiError::BadRequest(format!(
            "{endpoint} needs a text model, but '{}' has no tokenizer",
            meta.info.name
        ))),
    }
}

/// `GET /info`: what the default model is and the limits requests meet.
pub fn info(state: &AppState, meta: &Model) -> Reply {
    let model_type = match meta.pipeline.head() {
        Some(Head::Embedding { settings, .. }) => serde_json::json!({"embedding": {"pooling": settings.pooling}}),
        Some(Head::Classification { labels, .. }) => {
            let id2label: serde_json::Map<String, serde_json::Value> =
                labels.iter().enumerate().map(|(i, l)| (i.to_string(), l.clone().into())).collect();
            let label2id: serde_json::Map<String, serde_json::Value> =
                labels.iter().enumerate().map(|(i, l)| (l.clone(), i.into())).collect();
            // As TEI: a cross-encoder (one label, text pairs) is a reranker.
            let kind = if meta.cross_encoder("/info").is_ok() { "reranker" } else { "classifier" };
            serde_json::json!({kind: {"id2label": id2label, "label2id": label2id}})
        }
        // No kind TEI knows (its schema has embedding, classifier and reranker).
        None => serde_json::json!({"raw": {}}),
    };
    // An integer, as TEI's schema requires: 0 where the model takes no text.
    let max_input_length = match &*meta.pipeline {
        Pipeline::Text(p) => p.max_length,
        _ => 0,
    };
    let body = serde_json::json!({
        "model_id": meta.info.name,
        "model_sha": meta.info.sha256,
        "model_version": meta.info.version,
        "model_dtype": if matches!(meta.info.precision, inferd_ipc::spec::Precision::Int8 { .. }) { "int8" } else { "float32" },
        "served_model_name": meta.info.name,
        "model_type": model_type,
        "max_input_length": max_input_length,
        "max_batch_tokens": meta.batching.max_batch_tokens,
        "max_batch_requests": meta.batch_rows().ok(),
        "max_client_batch_size": state.max_batch_inputs,
        // Requests that may wait for this worker's model before more are refused at once
        // (server.max_queue), as TEI's limit refuses rather than queue.
        "max_concurrent_requests": state.engine.max_queue(),
        "auto_truncate": false,
        "tokenization_workers": 1,
        "version": inferd_ipc::version(),
    });
    json_reply(hyper::StatusCode::OK, serde_json::to_vec(&body).expect("json"))
}

/// `POST /tokenize`: `[[{"id", "text", "special", "start", "stop"}, ...], ...]`, one list per
/// input (a single text too), offsets in bytes of the text (of the second text for its tokens).
pub async fn tokenize(state: &AppState, meta: &Model, body: &[u8]) -> Result<Reply, ApiError> {
    let pipeline = text_pipeline(meta, "/tokenize")?;
    let request: TokenizeRequest = parse(body)?;
    let sequences = match request.inputs {
        TokenizeInputs::One(text) => vec![Sequence::Single(text)],
        TokenizeInputs::Many(list) => list,
    };
    tasks::within_limit(state, sequences.len())?;
    let lists = sequences
        .into_iter()
        .enumerate()
        .map(|(i, s)| pipeline.tokenize(i, &Text::from(s), request.add_special_tokens))
        .collect::<Result<Vec<_>, _>>()?;
    // A token's object with its largest numbers, and its text escaped (at most 6 bytes each).
    let bound = lists.iter().flatten().map(|p| 112u64.saturating_add(6u64.saturating_mul(p.text.len() as u64)));
    let bound = bound.fold(2u64.saturating_mul(lists.len() as u64).saturating_add(2), u64::saturating_add);
    large_json(state, lists, bound).await
}

/// `POST /decode`: `{"ids": [..] | [[..], ..], "skip_special_tokens": true}` -> a list of texts.
pub fn decode(state: &AppState, meta: &Model, body: &[u8]) -> Result<Reply, ApiError> {
    let pipeline = text_pipeline(meta, "/decode")?;
    let request: DecodeRequest = parse(body)?;
    // One list of ids, or a list of lists.
    let lists: Vec<Vec<u32>> = match request.ids {
        OneOrMany::One(IdsOrId::Ids(ids)) => vec![ids],
        OneOrMany::One(IdsOrId::Id(id)) => vec![vec![id]],
        OneOrMany::Many(items) => {
            let (ids, lists): (Vec<_>, Vec<_>) = items.into_iter().partition(|i| matches!(i, IdsOrId::Id(_)));
            let unwrap = |items: Vec<IdsOrId>| -> Vec<Vec<u32>> {
                items
                    .into_iter()
                    .map(|i| match i {
                        IdsOrId::Id(id) => vec![id],
                        IdsOrId::Ids(ids) => ids,
                    })
                    .collect()
            };
            match (ids.is_empty(), lists.is_empty()) {
                (false, false) => return Err(ApiError::BadRequest("'ids' mixes token ids and lists of them".into())),
                (false, true) => vec![unwrap(ids).concat()],
                _ => unwrap(lists),
            }
        }
    };
    tasks::within_limit(state, lists.len())?;
    let texts = lists
        .iter()
        .enumerate()
        .map(|(i, ids)| match ids.is_empty() {
            true => Err(ApiError::BadRequest(format!("ids {i} is an empty list"))),
            false => Ok(pipeline.decode(i, ids, request.skip_special_tokens)?),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(json_reply(hyper::StatusCode::OK, serde_json::to_vec(&texts).expect("json")))
}
