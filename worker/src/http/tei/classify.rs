//! TEI's classification routes: `/predict` (texts, pairs of texts or images) and `/rerank`
//! (a cross-encoder's scores of a query against texts).
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use base64::Engine as _;
use serde::Serialize;

use crate::http::reply::{ran, Reply};
use crate::http::tei::bodies::{PredictRequest, RerankRequest};
use crate::http::tei::open::{Inference, Needs};
use crate::pipeline::{ranked, Text};
use crate::request::error::ApiError;
use crate::request::tasks::{Options, PipelineInput, Rows};

#[derive(Serialize)]
struct Prediction {
    label: String,
    score: f32,
}

pub async fn predict(tei: Inference<'_>, body: &[u8]) -> Result<Reply, ApiError> {
    let request: PredictRequest = tei.open(Needs::Classification, "/predict", body)?;
    let (input, listed) = match (request.inputs, request.image_b64) {
        (Some(inputs), None) => {
            let (seqs, listed) = inputs.into_vec();
            let texts = seqs.into_iter().map(Text::from).collect();
            (PipelineInput::Texts(texts), listed)
        }
        (None, Some(images)) => {
            let (encoded, listed) = images.into_vec();
            let images = encoded
                .iter()
                .enumerate()
                .map(|(i, b64)| {
                    base64::engine::general_purpose::STANDARD
                        .decode(b64.trim())
                        .map_err(|e| ApiError::BadRequest(format!("image_b64 {i} is not base64: {e}")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            (PipelineInput::Images(images), listed)
        }
        (Some(_), Some(_)) => return Err(ApiError::BadRequest("send either 'inputs' or 'image_b64', not both".into())),
        (None, None) => return Err(ApiError::BadRequest("missing 'inputs' (text) or 'image_b64' (image)".into())),
    };
    let options = Options {
        truncate: request.truncation_direction.side(request.truncate),
        raw_scores: request.raw_scores,
        ..Options::default()
    };
    let outcome = tei.run(input, options).await?;
    let Rows::Scores { labels, scores } = &outcome.rows else { unreachable!("classifiers return scores") };
    let lists: Vec<Vec<Prediction>> = scores
        .iter()
        .map(|row| {
            ranked(labels, row, request.top_k).into_iter().map(|(label, score)| Prediction { label, score }).collect()
        })
        .collect();
    let body = if listed { serde_json::to_vec(&lists) } else { serde_json::to_vec(&lists[0]) };
    Ok(ran(body.expect("predictions serialise"), &outcome))
}

#[derive(Serialize)]
struct Rank {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<String>,
    score: f32,
}

/// `POST /rerank`: `{"query": "q", "texts": ["a", ...], "raw_scores": false, "return_text":
/// false, "truncate": false}` -> `[{"index", "score"[, "text"]}, ...]`, best first. The model
/// is a cross-encoder: a classification model with one label, run on each (query, text) pair;
/// the score is the sigmoid of its logit (the logit with `raw_scores`).
pub async fn rerank(tei: Inference<'_>, body: &[u8]) -> Result<Reply, ApiError> {
    let request: RerankRequest = tei.open(Needs::CrossEncoder, "/rerank", body)?;
    if request.texts.is_empty() {
        return Err(ApiError::BadRequest("'texts' is an empty list".into()));
    }
    let pairs = request.texts.iter().map(|t| Text::Pair(request.query.clone(), t.clone())).collect();
    let options = Options {
        truncate: request.truncation_direction.side(request.truncate),
        raw_scores: true,
        ..Options::default()
    };
    let outcome = tei.run(PipelineInput::Texts(pairs), options).await?;
    let Rows::Scores { scores, .. } = &outcome.rows else { unreachable!("classifiers return scores") };
    let mut ranks: Vec<Rank> = scores
        .iter()
        .enumerate()
        .map(|(i, row)| {
            let logit = row.first().copied().unwrap_or(f32::NAN);
            Rank {
                index: i,
                text: request.return_text.then(|| request.texts[i].clone()),
                score: if request.raw_scores { logit } else { 1.0 / (1.0 + (-logit).exp()) },
            }
        })
        .collect();
    ranks.sort_by(|a, b| b.score.total_cmp(&a.score));
    Ok(ran(serde_json::to_vec(&ranks).expect("ranks serialise"), &outcome))
}
