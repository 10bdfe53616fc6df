//! TEI's request bodies as its clients send them, and how each is read: a field of the wrong
//! shape is refused in the client's terms, naming the field ([`crate::jsonbody`]).
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use serde::Deserialize;
use serde_json::Value;

use crate::jsonbody::{self, OneOrMany, Shape};
use crate::pipeline::{Side, Text};
use crate::request::error::ApiError;

/// The body read as the request `T`, or the 400 whose message says what was wrong with it.
pub(super) fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    read(body).map_err(ApiError::BadRequest)
}

/// The body read as the request `T`, or what was wrong with it: `request body: ` and the
/// field's path, what it must be and what came.
fn read<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    jsonbody::parse(body).map_err(|e| format!("request body: {e}"))
}

/// TEI's `truncation_direction`: which end of a text past the model's length `truncate` cuts.
#[derive(Default, Clone, Copy)]
pub(super) enum Direction {
    Left,
    #[default]
    Right,
}

impl<'de> Deserialize<'de> for Direction {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match String::deserialize(d)?.as_str() {
            "Left" => Ok(Direction::Left),
            "Right" => Ok(Direction::Right),
            other => Err(serde::de::Error::custom(format!("must be \"Left\" or \"Right\", not {other:?}"))),
        }
    }
}

impl Direction {
    /// The side cut, when `truncate` allows a cut.
    pub(super) fn side(self, truncate: bool) -> Option<Side> {
        truncate.then_some(match self {
            Direction::Left => Side::Left,
            Direction::Right => Side::Right,
        })
    }
}

/// One input of TEI's embedding routes: a text, or the model's own token ids (TEI's
/// `InputType::Ids`), fed as they are: no prompt, no special tokens added.
pub(super) enum EmbedInput {
    Text(String),
    Ids(Vec<u32>),
}

impl Shape for EmbedInput {
    const EXPECTED: &'static str = "a string or a list of token ids (whole numbers from 0 to 4294967295)";
    const PLURAL: &'static str = "strings and lists of token ids";
    fn fits(value: &Value) -> bool {
        match value {
            Value::String(_) => true,
            // `[]` is no input of no ids but a list of no inputs, as before ids were taken.
            Value::Array(ids) => !ids.is_empty() && ids.iter().all(|id| token_id(id).is_some()),
            _ => false,
        }
    }
    fn take(value: Value) -> Self {
        match value {
            Value::String(s) => EmbedInput::Text(s),
            Value::Array(ids) => EmbedInput::Ids(ids.iter().filter_map(token_id).collect()),
            _ => unreachable!("fits"),
        }
    }
}

impl From<EmbedInput> for Text {
    fn from(input: EmbedInput) -> Text {
        match input {
            EmbedInput::Text(s) => Text::Single(s),
            EmbedInput::Ids(ids) => Text::Ids(ids),
        }
    }
}

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
pub(super) struct EmbedRequest {
    pub(super) inputs: OneOrMany<EmbedInput>,
    /// One of the model's `[embedding.prompts]`, put before every input.
    #[serde(default)]
    pub(super) prompt_name: Option<String>,
    #[serde(default)]
    pub(super) normalize: Option<bool>,
    #[serde(default)]
    pub(super) truncate: bool,
    #[serde(default)]
    pub(super) truncation_direction: Direction,
    /// `/embed`: the first this many values of each embedding (TEI's Matryoshka), normalised
    /// after the cut when the embeddings are.
    #[serde(default)]
    pub(super) dimensions: Option<usize>,
}

/// `/embed_chunks`: one text, and its chunks as spans or by a rule (exactly one of the three).
#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
pub(super) struct ChunksRequest {
    pub(super) inputs: String,
    /// Character spans `[start, end)`.
    #[serde(default)]
    pub(super) chunks: Option<Vec<(usize, usize)>>,
    #[serde(default)]
    pub(super) chunk_by: Option<ChunkBy>,
    /// Chunks of this many tokens.
    #[serde(default)]
    pub(super) chunk_tokens: Option<usize>,
    #[serde(default)]
    pub(super) prompt_name: Option<String>,
    #[serde(default)]
    pub(super) normalize: Option<bool>,
}

#[derive(Clone, Copy)]
pub(super) enum ChunkBy {
    Sentence,
}

impl<'de> Deserialize<'de> for ChunkBy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match String::deserialize(d)?.as_str() {
            "sentence" => Ok(ChunkBy::Sentence),
            other => Err(serde::de::Error::custom(format!("must be \"sentence\", not {other:?}"))),
        }
    }
}

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
pub(super) struct SparseRequest {
    pub(super) inputs: OneOrMany<EmbedInput>,
    #[serde(default)]
    pub(super) truncate: bool,
    #[serde(default)]
    pub(super) truncation_direction: Direction,
    #[serde(default)]
    pub(super) prompt_name: Option<String>,
    /// Only the k largest entries of each vector.
    #[serde(default)]
    pub(super) top_k: Option<usize>,
    /// Only entries above this (default 0: every non-zero one).
    #[serde(default)]
    pub(super) threshold: Option<f32>,
}

/// `/encode` (BGE-M3): FlagEmbedding's `encode` and its three switches, with its defaults.
#[derive(Deserialize)]
#[serde(expecting = "a JSON object", deny_unknown_fields)]
pub(super) struct EncodeRequest {
    pub(super) inputs: OneOrMany<EmbedInput>,
    #[serde(default = "yes")]
    pub(super) return_dense: bool,
    #[serde(default)]
    pub(super) return_sparse: bool,
    #[serde(default)]
    pub(super) return_colbert_vecs: bool,
}

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
pub(super) struct SimilarityRequest {
    pub(super) inputs: SimilarityInputs,
    #[serde(default)]
    pub(super) truncate: bool,
    #[serde(default)]
    pub(super) truncation_direction: Direction,
}

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
pub(super) struct SimilarityInputs {
    pub(super) source_sentence: String,
    pub(super) sentences: Vec<String>,
}

/// A text, or a pair of texts (`["query", "passage"]`).
pub(super) enum Sequence {
    Single(String),
    Pair(String, String),
}

impl Shape for Sequence {
    const EXPECTED: &'static str = "a text or a pair of texts";
    const PLURAL: &'static str = "texts and pairs of texts";
    fn fits(value: &Value) -> bool {
        match value {
            Value::String(_) => true,
            Value::Array(pair) => pair.len() == 2 && pair.iter().all(Value::is_string),
            _ => false,
        }
    }
    fn take(value: Value) -> Self {
        match value {
            Value::String(text) => Sequence::Single(text),
            Value::Array(pair) => {
                let mut texts = pair.into_iter().map(String::take);
                match (texts.next(), texts.next()) {
                    (Some(a), Some(b)) => Sequence::Pair(a, b),
                    _ => unreachable!("fits"),
                }
            }
            _ => unreachable!("fits"),
        }
    }
}

impl From<Sequence> for Text {
    fn from(s: Sequence) -> Text {
        match s {
            Sequence::Single(t) => Text::Single(t),
            Sequence::Pair(a, b) => Text::Pair(a, b),
        }
    }
}

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
pub(super) struct PredictRequest {
    #[serde(default)]
    pub(super) inputs: Option<OneOrMany<Sequence>>,
    #[serde(default)]
    pub(super) image_b64: Option<OneOrMany<String>>,
    #[serde(default)]
    pub(super) raw_scores: bool,
    #[serde(default)]
    pub(super) truncate: bool,
    #[serde(default)]
    pub(super) truncation_direction: Direction,
    #[serde(default)]
    pub(super) top_k: Option<usize>,
}

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
pub(super) struct RerankRequest {
    pub(super) query: String,
    pub(super) texts: Vec<String>,
    #[serde(default)]
    pub(super) truncate: bool,
    #[serde(default)]
    pub(super) truncation_direction: Direction,
    #[serde(default)]
    pub(super) raw_scores: bool,
    #[serde(default)]
    pub(super) return_text: bool,
}

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
pub(super) struct TokenizeRequest {
    #[serde(deserialize_with = "jsonbody::read")]
    pub(super) inputs: TokenizeInputs,
    #[serde(default = "yes")]
    pub(super) add_special_tokens: bool,
}

fn yes() -> bool {
    true
}

/// As TEI reads it: a text, or a list of texts; a pair is a list of two inside the list.
pub(super) enum TokenizeInputs {
    One(String),
    Many(Vec<Sequence>),
}

impl Shape for TokenizeInputs {
    const EXPECTED: &'static str = "a text or a list of texts and pairs of texts";
    const PLURAL: &'static str = "such lists";
    fn fits(value: &Value) -> bool {
        match value {
            Value::String(_) => true,
            Value::Array(items) => items.iter().all(Sequence::fits),
            _ => false,
        }
    }
    fn take(value: Value) -> Self {
        match value {
            Value::String(text) => TokenizeInputs::One(text),
            Value::Array(items) => TokenizeInputs::Many(items.into_iter().map(Sequence::take).collect()),
            _ => unreachable!("fits"),
        }
    }
}

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
pub(super) struct DecodeRequest {
    pub(super) ids: OneOrMany<IdsOrId>,
    #[serde(default = "yes")]
    pub(super) skip_special_tokens: bool,
}

pub(super) enum IdsOrId {
    Id(u32),
    Ids(Vec<u32>),
}

/// A token id: a whole number that fits the tokenizer's u32.
fn token_id(value: &Value) -> Option<u32> {
    value.as_u64().and_then(|id| u32::try_from(id).ok())
}

impl Shape for IdsOrId {
    const EXPECTED: &'static str = "a token id (a whole number from 0 to 4294967295) or a list of them";
    const PLURAL: &'static str = "token ids and lists of token ids";
    fn fits(value: &Value) -> bool {
        match value {
            Value::Array(ids) => ids.iter().all(|id| token_id(id).is_some()),
            id => token_id(id).is_some(),
        }
    }
    fn take(value: Value) -> Self {
        match value {
            Value::Array(ids) => IdsOrId::Ids(ids.iter().filter_map(token_id).collect()),
            id => IdsOrId::Id(token_id(&id).expect("fits")),
        }
    }
}

/// Every request body of TEI's routes, parsed as its handler parses it: the inputs each
/// would carry, or the error a client would read where the body is not that request (the fuzz
/// target's entry, fuzz/fuzz_targets/tei_openai.rs).
pub fn parse_bodies(body: &[u8]) -> [Result<usize, String>; 8] {
    fn count<T: serde::de::DeserializeOwned>(body: &[u8], count: impl FnOnce(T) -> usize) -> Result<usize, String> {
        read(body).map(count)
    }
    [
        count(body, |r: EmbedRequest| r.inputs.into_vec().0.len()),
        count(body, |r: PredictRequest| {
            let texts = r.inputs.map_or(0, |i| i.into_vec().0.into_iter().map(Text::from).count());
            texts.saturating_add(r.image_b64.map_or(0, |i| i.into_vec().0.len()))
        }),
        count(body, |r: RerankRequest| r.texts.len()),
        count(body, |r: TokenizeRequest| match r.inputs {
            TokenizeInputs::One(_) => 1,
            TokenizeInputs::Many(list) => list.len(),
        }),
        count(body, |r: DecodeRequest| match r.ids {
            OneOrMany::One(_) => 1,
            OneOrMany::Many(items) => items.len(),
        }),
        count(body, |r: SimilarityRequest| r.inputs.sentences.len()),
        count(body, |r: SparseRequest| r.inputs.into_vec().0.len()),
        count(body, |r: ChunksRequest| r.chunks.map_or(0, |c| c.len())),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Words of serde's and Rust's that a client's error must not carry.
    pub(crate) const INTERNAL: [&str; 12] = [
        "untagged",
        "variant",
        "struct ",
        "enum ",
        "OneOrMany",
        "usize",
        "u32",
        "u64",
        "i64",
        "f32",
        "a sequence",
        "a map",
    ];

    /// Each seed of the fuzz targets' corpora with each of its fields given each wrong shape:
    /// every route's error names the field, says what it must be and what came, in words.
    #[test]
    fn every_body_error_over_the_seed_corpora_is_in_the_clients_terms() {
        let wrong = [
            json!(5),
            json!(-1),
            json!(1.5),
            json!("x"),
            json!(true),
            json!(null),
            json!([]),
            json!({}),
            json!([5]),
            json!([[5]]),
            json!([{"a": 1}]),
            json!(["a", 5]),
        ];
        let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/tei_openai");
        let mut checked = 0;
        for seed in std::fs::read_dir(&corpus).unwrap() {
            let seed = seed.unwrap().path();
            let Ok(Value::Object(fields)) = serde_json::from_slice::<Value>(&std::fs::read(&seed).unwrap()) else {
                continue;
            };
            for key in fields.keys() {
                for value in &wrong {
                    let mut body = fields.clone();
                    body.insert(key.clone(), value.clone());
                    let body = serde_json::to_vec(&body).unwrap();
                    let openai = crate::http::openai::parse(&body).err().map(|e| e.to_string());
                    use crate::http::cohere::{embed, rerank, Version};
                    let cohere = [Version::V1, Version::V2].into_iter().flat_map(|v| {
                        [rerank::parse(&body, v).err(), embed::parse(&body, v).err()].map(|e| e.map(|e| e.to_string()))
                    });
                    let others = cohere.into_iter().flatten().chain(openai);
                    for error in parse_bodies(&body).into_iter().filter_map(Result::err).chain(others) {
                        checked += 1;
                        for word in INTERNAL {
                            assert!(
                                !error.contains(word),
                                "{}: {key} = {value}: {error:?} says {word:?}",
                                seed.display()
                            );
                        }
                        // A value of the wrong shape is named by its path (TEI's routes) or
                        // its name (OpenAI's).
                        if ["must be", "invalid type", "invalid value"].iter().any(|w| error.contains(w)) {
                            let named = error.starts_with("request body: `") || error.starts_with('\'');
                            assert!(named, "{key} = {value}: {error}");
                        }
                    }
                }
            }
        }
        assert!(checked > 1000, "only {checked} errors checked: is the corpus at {} there?", corpus.display());
    }

    #[test]
    fn the_embed_inputs_that_were_a_rust_type_name_now_say_what_they_must_be() {
        let [embed, ..] = parse_bodies(br#"{"inputs": 5}"#);
        let error = embed.unwrap_err();
        assert!(
            error.starts_with(
                "request body: `inputs`: must be a string or a list of token ids (whole numbers from 0 to 4294967295) \
                 or a list of strings and lists of token ids, got the number 5"
            ),
            "{error}"
        );
        let [_, predict, _, tokenize, decode, ..] = parse_bodies(br#"{"inputs": [["a", "b"], ["c"]], "ids": [1, -2]}"#);
        let predict = predict.unwrap_err();
        assert!(predict.contains("must be a text or a pair of texts or a list of texts and pairs of texts, got a list whose item [1] is a list of 1"), "{predict}");
        let tokenize = tokenize.unwrap_err();
        assert!(tokenize.contains("`inputs`: must be a text or a list of texts and pairs of texts"), "{tokenize}");
        let decode = decode.unwrap_err();
        assert!(
            decode.contains("`ids`: must be a token id") && decode.contains("item [1] is the number -2"),
            "{decode}"
        );
    }

    #[test]
    fn embed_inputs_are_texts_or_token_ids_one_or_many() {
        let inputs = |body: &str| -> Vec<Text> {
            let request: EmbedRequest = parse(body.as_bytes()).unwrap_or_else(|e| panic!("{body}: {e:?}"));
            request.inputs.into_vec().0.into_iter().map(Text::from).collect()
        };
        let ids = |v: &[u32]| Text::Ids(v.to_vec());
        assert_eq!(inputs(r#"{"inputs": "a"}"#), [Text::Single("a".into())]);
        assert_eq!(inputs(r#"{"inputs": [101, 7, 102]}"#), [ids(&[101, 7, 102])], "a list of numbers is one input");
        assert_eq!(inputs(r#"{"inputs": [[101], [7, 8]]}"#), [ids(&[101]), ids(&[7, 8])]);
        assert_eq!(inputs(r#"{"inputs": ["a", [7]]}"#), [Text::Single("a".into()), ids(&[7])]);
        assert!(inputs(r#"{"inputs": []}"#).is_empty(), "no inputs, as before");
        let refused =
            |body: &str| parse::<EmbedRequest>(body.as_bytes()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused(r#"{"inputs": [1, -2]}"#).contains("`inputs`"), "{}", refused(r#"{"inputs": [1, -2]}"#));
        assert!(refused(r#"{"inputs": [[1], [4294967296]]}"#).contains("item [1]"));
    }
}
