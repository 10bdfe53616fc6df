//! Endpoints compatible with Hugging Face text-embeddings-inference, so its clients work
//! unchanged: `POST /embed` and `POST /predict` (the default model), and the same under
//! `/v2/models/{name}/` for any model.
//!
//! - `/embed`: `{"inputs": "text" | ["t1", ...], "normalize": true, "truncate": false}` ->
//!   `[[f32, ...], ...]`, one vector per input.
//! - `/predict` (text): `{"inputs": ..., "raw_scores": false, "truncate": false, "top_k": n}`
//!   where inputs is a text, a pair `["a", "b"]` (as TEI reads a two-element list), or a list
//!   of texts and pairs -> `[{"label", "score"}, ...]` best first, or a list of those for a
//!   list input.
//! - `/predict` (image): `{"image_b64": "<base64 PNG/JPEG>" | [...], "top_k": n}` -> the same.
//! - `/similarity`: `{"inputs": {"source_sentence": "a", "sentences": ["b", ...]}}` -> cosine
//!   similarities `[f32, ...]`.
//! - `/rerank` (cross-encoders: a classification model with one label): `{"query": "q",
//!   "texts": [...], "raw_scores", "return_text", "truncate"}` -> `[{"index", "score"}, ...]`
//!   best first.
//! - `/embed_all`: the same body as `/embed` -> `[[[f32, ...], ...], ...]`, every token's vector.
//! - `/embed_chunks` (late chunking, inferd's own): `{"inputs": "text", "chunks": [[start,
//!   end], ...] | "chunk_by": "sentence" | "chunk_tokens": n, "prompt_name", "normalize"}` ->
//!   `[{"start", "end", "tokens", "embedding"}, ...]`, each chunk pooled from the token states
//!   of the whole text ([`crate::pipeline::late`]).
//! - `/embed_sparse` (`pooling = "splade"`): `{"inputs", "truncate", "prompt_name"}`, and
//!   inferd's own `"top_k"` and `"threshold"` -> `[[{"index", "value"}, ...], ...]`, the
//!   non-zero entries (above the threshold, the top k of them) in index order.
//! - `GET /info`, `POST /tokenize`, `POST /decode`: the default model and its tokenizer.
//! - `POST /` and `POST /invocations` (SageMaker): `/embed` or `/predict`, by the default
//!   model's task; `GET /ping` answers like `/v2/health/ready`.
//!
//! Errors carry TEI's `error_type` beside the message.
//!
//! The files: [`bodies`], the request bodies and how each is read; [`open`], what every
//! inference route does around its own part (the model checked, the body read, the pipeline
//! run); [`embed`] and [`classify`], the inference routes; [`tokenizer`], `/info`, `/tokenize`
//! and `/decode`.

mod bodies;
mod classify;
mod embed;
mod open;
mod tokenizer;

pub use bodies::parse_bodies;
pub use classify::{predict, rerank};
pub use embed::{embed, embed_all, embed_chunks, embed_sparse, encode, similarity};
pub use open::Inference;
pub use tokenizer::{decode, info, tokenize};

use crate::request::error::ApiError;

/// text-embeddings-inference's error body: the message and its `error_type`.
pub fn error_body(e: &ApiError) -> serde_json::Value {
    let kind = match e {
        ApiError::Overloaded(_) | ApiError::TooManyRequests(..) => "Overloaded",
        ApiError::Unauthorized(_) => "Unauthorized",
        ApiError::Internal(_) | ApiError::Timeout(_) | ApiError::DeadlineExceeded(_) => "Backend",
        ApiError::Empty(_) => "Empty",
        _ => "Validation",
    };
    serde_json::json!({"error": e.to_string(), "error_type": kind})
}
