//! Cohere's embed API: `POST /v1/embed` and `POST /v2/embed`, for embedding models with a
//! text pipeline (dense pooling).
//!
//! - `texts`: the texts to embed (`images` and v2's `inputs` are refused: inferd embeds texts).
//! - `model`: an embedding model this server serves; any other name means the default model
//!   when it embeds, else the first embedding model loaded.
//! - `input_type` picks the model's prompt (`[embedding.prompts]`): `search_query` the one
//!   named `search_query`, else `query`; `search_document` `search_document`, else `document`,
//!   else `passage`; `classification` and `clustering` their own names. Where the model has no
//!   such prompt (or none at all), its default applies, as a request without `input_type`.
//! - `embedding_types`: any of `float`, `int8`, `uint8`, `binary`, `ubinary` (the codes of
//!   [`crate::pipeline::codes`]) and `base64` (the float vector's little-endian f32 bytes).
//!   Without it, v1 answers `embeddings_floats` (a list of vectors) and v2 the floats by type.
//! - `truncate`: `END` (the default) cuts a text past the model's length at its end, `START`
//!   at its start, `NONE` refuses it (413).
//! - `output_dimension` (v2): the first this many dimensions, for models trained for it
//!   (`matryoshka = true`), normalised again, as OpenAI's `dimensions`; `max_tokens` (v2)
//!   below the model's length is refused (inferd reads up to the model's length).
//! - `priority` (v2): as in rerank.
//! - The answer: `{"id", "response_type", "embeddings", "texts", "meta": {"api_version",
//!   "billed_units": {"input_tokens"}}}` with the `model` that answered beside.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use std::sync::Arc;

use base64::Engine as _;
use serde::Serialize;
use serde_json::{json, Value};

use super::{bad, Fields, Version};
use crate::http::reply::{ran, Reply};
use crate::pipeline::codes::Code;
use crate::pipeline::{cut_dimensions, Head, Pipeline, Side, Text};
use crate::request::app::AppState;
use crate::request::call::Call;
use crate::request::error::ApiError;
use crate::request::model::Model;
use crate::request::tasks::{self, Options, PipelineInput, Rows};
use inferd_config::model::Pooling;

/// One of `embedding_types`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Type {
    Float,
    Base64,
    Code(Code),
}

impl Type {
    const NAMES: &'static str = "float, int8, uint8, binary, ubinary, base64";

    fn named(name: &str) -> Option<Type> {
        Some(match name {
            "float" => Type::Float,
            "base64" => Type::Base64,
            "int8" => Type::Code(Code::Int8),
            "uint8" => Type::Code(Code::Uint8),
            "binary" => Type::Code(Code::Binary),
            "ubinary" => Type::Code(Code::Ubinary),
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Type::Float => "float",
            Type::Base64 => "base64",
            Type::Code(Code::Int8) => "int8",
            Type::Code(Code::Uint8) => "uint8",
            Type::Code(Code::Binary) => "binary",
            Type::Code(Code::Ubinary) => "ubinary",
        }
    }
}

/// `input_type`: the names of the prompts it picks, the first the model has.
fn prompts_for(input_type: &str) -> Option<&'static [&'static str]> {
    Some(match input_type {
        "search_query" => &["search_query", "query"],
        "search_document" => &["search_document", "document", "passage"],
        "classification" => &["classification"],
        "clustering" => &["clustering"],
        _ => return None,
    })
}

/// The request, checked field by field so that each mistake names its field.
pub struct Request {
    /// The model asked for, if any.
    pub model: Option<String>,
    texts: Vec<String>,
    input_type: Option<&'static [&'static str]>,
    /// None: v1's list of float vectors.
    types: Option<Vec<Type>>,
    truncate: Option<Side>,
    output_dimension: Option<usize>,
    max_tokens: Option<usize>,
    /// v2's `priority`.
    pub priority: Option<u8>,
}

pub fn parse(body: &[u8], version: Version) -> Result<Request, ApiError> {
    let fields = Fields::of(body)?;
    for other in ["images", "inputs"] {
        if fields.given(other).is_some() {
            return Err(bad(format!("'{other}' is not served: inferd's embed takes 'texts'")));
        }
    }
    let texts = match fields.given("texts") {
        Some(Value::Array(texts)) if !texts.is_empty() => texts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                t.as_str().map(str::to_string).ok_or_else(|| bad(format!("'texts[{i}]' must be a text, not {t}")))
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(Value::Array(_)) => return Err(bad("'texts' is an empty list".into())),
        Some(_) => return Err(bad("'texts' must be a list of texts".into())),
        None => return Err(bad("missing 'texts'".into())),
    };
    let input_type = match fields.given("input_type") {
        None => None,
        Some(Value::String(name)) if name == "image" => {
            return Err(bad("'input_type' is \"image\", but inferd's embed takes texts".into()))
        }
        Some(v) => Some(v.as_str().and_then(prompts_for).ok_or_else(|| {
            bad(format!(
                "'input_type' must be one of search_query, search_document, classification, clustering, not {v}"
            ))
        })?),
    };
    let types = match fields.given("embedding_types") {
        None => None,
        Some(Value::Array(names)) if !names.is_empty() => {
            let mut types = Vec::with_capacity(names.len());
            for name in names {
                let Some(t) = name.as_str().and_then(Type::named) else {
                    return Err(bad(format!("'embedding_types' holds {name}; each must be one of {}", Type::NAMES)));
                };
                if !types.contains(&t) {
                    types.push(t);
                }
            }
            Some(types)
        }
        Some(_) => {
            return Err(bad(format!("'embedding_types' must be a non-empty list of names from {}", Type::NAMES)))
        }
    };
    let truncate = match fields.given("truncate") {
        None => Some(Side::Right),
        Some(Value::String(t)) if t.eq_ignore_ascii_case("END") => Some(Side::Right),
        Some(Value::String(t)) if t.eq_ignore_ascii_case("START") => Some(Side::Left),
        Some(Value::String(t)) if t.eq_ignore_ascii_case("NONE") => None,
        Some(v) => return Err(bad(format!("'truncate' must be NONE, START or END, not {v}"))),
    };
    let (output_dimension, max_tokens) = match version {
        Version::V1 => {
            for v2 in ["output_dimension", "max_tokens"] {
                if fields.given(v2).is_some() {
                    return Err(bad(format!("'{v2}' is part of v2 embed; use /v2/embed")));
                }
            }
            (None, None)
        }
        Version::V2 => (fields.count("output_dimension", 1)?, fields.count("max_tokens", 1)?),
    };
    let types = match version {
        Version::V2 => Some(types.unwrap_or_else(|| vec![Type::Float])),
        Version::V1 => types,
    };
    Ok(Request {
        model: fields.model()?,
        texts,
        input_type,
        types,
        truncate,
        output_dimension,
        max_tokens,
        priority: fields.priority()?,
    })
}

/// The answer, serialised as it is (each f32 as its shortest text).
#[derive(Serialize)]
struct Answer<'a> {
    id: &'a str,
    response_type: &'static str,
    embeddings: Embeddings<'a>,
    texts: &'a [String],
    meta: Value,
    model: &'a str,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Embeddings<'a> {
    /// v1 without `embedding_types`.
    Floats(&'a [Vec<f32>]),
    /// Each type asked for, by name, in the order asked.
    ByType(ByType<'a>),
}

/// A map of each type's name to its vectors.
struct ByType<'a>(Vec<(&'static str, Vectors<'a>)>);

impl Serialize for ByType<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(name, vectors)| (name, vectors)))
    }
}

#[derive(Serialize)]
#[serde(untagged)]
enum Vectors<'a> {
    Floats(&'a [Vec<f32>]),
    Base64(Vec<String>),
    Codes(Vec<Vec<i16>>),
}

/// Refuses a model that cannot answer `/v{1,2}/embed`: dense embeddings of texts.
fn embeds(meta: &Model) -> Result<(), ApiError> {
    match (&*meta.pipeline, meta.pipeline.head()) {
        (Pipeline::Text(_), Some(Head::Embedding { settings, .. }))
            if !matches!(settings.pooling, Pooling::Splade | Pooling::Colbert | Pooling::BgeM3) =>
        {
            Ok(())
        }
        _ => Err(bad(format!("model '{}' does not embed texts into dense vectors; embed needs one", meta.info.name))),
    }
}

/// The model a request names when it serves it, else the default model if it embeds, else the
/// first embedding model loaded.
pub async fn model_for(state: &AppState, call: &Call, name: Option<&str>) -> Result<(usize, Arc<Model>), ApiError> {
    super::model_for(state, call, name, embeds, "no model that embeds texts is loaded").await
}

/// Embeds the texts and answers each type asked for.
pub async fn embed(
    state: &AppState,
    call: &Call,
    (index, meta): (usize, &Model),
    request: Request,
    version: Version,
) -> Result<Reply, ApiError> {
    let (Pipeline::Text(pipeline), Some(Head::Embedding { settings, .. })) = (&*meta.pipeline, meta.pipeline.head())
    else {
        return Err(bad(format!("model '{}' does not embed texts", meta.info.name)));
    };
    if let Some(asked) = request.max_tokens.filter(|&m| m < pipeline.max_length) {
        return Err(bad(format!(
            "'max_tokens' is {asked}, but model '{}' reads up to {} tokens of a text: leave it out or ask for at least \
             that",
            meta.info.name, pipeline.max_length
        )));
    }
    // A bit code of fewer dimensions than a whole number of bytes is refused before the run;
    // of the model's own, after it (the model says how many it gives by running).
    let codes = || {
        request.types.iter().flatten().filter_map(|&t| match t {
            Type::Code(code) => Some((t, code)),
            _ => None,
        })
    };
    let fits = |dimensions: usize| -> Result<(), ApiError> {
        for (t, code) in codes() {
            code.fits(dimensions).map_err(|e| bad(format!("'embedding_types' asks for {}: {e}", t.name())))?;
        }
        Ok(())
    };
    if let Some(wanted) = request.output_dimension {
        fits(wanted)?;
    }
    // The first prompt `input_type` names that the model has; else the model's default.
    let prompt_name = request
        .input_type
        .and_then(|names| names.iter().find(|n| settings.prompts.contains_key(**n)))
        .map(|n| n.to_string());
    let normalize = settings.normalize;
    let options = Options { truncate: request.truncate, normalize: Some(normalize), prompt_name, ..Options::default() };
    let texts = request.texts.iter().cloned().map(Text::Single).collect();
    let mut outcome = tasks::run_pipeline(state, call, index, meta, PipelineInput::Texts(texts), options).await?;
    let Rows::Embeddings(rows) = &mut outcome.rows else { unreachable!("embedding models return embeddings") };
    let full = rows.first().map_or(0, Vec::len);
    if let Some(wanted) = request.output_dimension {
        if wanted > full || (wanted < full && !settings.matryoshka) {
            return Err(bad(format!(
                "'output_dimension' is {wanted}; model '{}' gives {full} dimensions{}",
                meta.info.name,
                match wanted > full {
                    true => "",
                    false => " and is not trained to give fewer ([embedding] matryoshka = false in its model.toml)",
                }
            )));
        }
        cut_dimensions(rows, wanted, normalize);
    }
    fits(rows.first().map_or(0, Vec::len))?;
    let embeddings = match &request.types {
        None => Embeddings::Floats(rows),
        Some(types) => Embeddings::ByType(ByType(
            types
                .iter()
                .map(|&t| {
                    let vectors = match t {
                        Type::Float => Vectors::Floats(rows),
                        Type::Base64 => Vectors::Base64(
                            rows.iter()
                                .map(|row| {
                                    let bytes: Vec<u8> = row.iter().flat_map(|x| x.to_le_bytes()).collect();
                                    base64::engine::general_purpose::STANDARD.encode(bytes)
                                })
                                .collect(),
                        ),
                        Type::Code(code) => Vectors::Codes(rows.iter().map(|row| code.of(row)).collect()),
                    };
                    (t.name(), vectors)
                })
                .collect(),
        )),
    };
    let body = Answer {
        id: &call.id,
        response_type: if request.types.is_some() { "embeddings_by_type" } else { "embeddings_floats" },
        embeddings,
        texts: &request.texts,
        meta: json!({
            "api_version": {"version": version.number()},
            "billed_units": {"input_tokens": outcome.tokens},
        }),
        model: &meta.info.name,
    };
    Ok(ran(serde_json::to_vec(&body).expect("json"), &outcome))
}
