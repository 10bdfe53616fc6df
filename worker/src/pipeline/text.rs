//! Texts into a model's input tensors: tokenised (truncated when allowed, refused past the
//! model's length otherwise), padded to the batch's longest row, token ids fed as they are;
//! and `/tokenize`'s and `/decode`'s answers.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use std::sync::OnceLock;

use inferd_config::model::{Pooling, TokenizerConfig};
use tokenizers::{EncodeInput, Encoding, Token, Tokenizer, TruncationDirection, TruncationParams};

use super::bge_m3::BgeM3;
use super::colbert::{Colbert, Role};
use super::error::{BuildError, PipelineError};
use super::head::Head;
use super::text_bound::BYTES_PER_TOKEN;
use crate::runtime::tensor::{DataType, Tensor, TensorData, TensorSpec};

#[derive(Debug, Clone, Copy)]
enum TextFeed {
    Ids,
    Mask,
    TypeIds,
}

#[derive(Debug)]
pub struct TextPipeline {
    /// Padding and truncation off: the batch is padded to its longest sequence here.
    plain: Tokenizer,
    /// The same with truncation at `max_length` from the right, then from the left, each made
    /// the first time a text has to be cut so (a tokenizer holds its vocabulary, ~6 MiB for
    /// MiniLM's; most workers never cut a text).
    truncating: [OnceLock<Result<Tokenizer, String>>; 2],
    pub max_length: usize,
    /// For every model input, in the model's order: what feeds it and its element type.
    feeds: Vec<(String, TextFeed, DataType)>,
    pub head: Head,
    /// With `pooling = "colbert"`: its recipe, its tokens resolved.
    pub colbert: Option<Colbert>,
    /// With `pooling = "bge_m3"`: its heads.
    pub bge_m3: Option<BgeM3>,
}

/// Which end of a text longer than the model takes is cut, where a request allows it: the
/// right keeps its first tokens (the default everywhere), the left its last (TEI's
/// `truncation_direction: "Left"`, Cohere's `truncate: "START"`). The model's special tokens
/// stay in place either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Side {
    #[default]
    Right,
    Left,
}

/// One text input: a sentence, or a pair for cross-encoders.
#[derive(Debug, Clone, PartialEq)]
pub enum Text {
    Single(String),
    Pair(String, String),
    /// Already tokenised: the model's own token ids, fed as they are (no special tokens added).
    Ids(Vec<u32>),
}

impl Text {
    /// Bytes of text (or of ids) it holds.
    pub fn bytes(&self) -> usize {
        match self {
            Text::Single(s) => s.len(),
            Text::Pair(a, b) => a.len().saturating_add(b.len()),
            Text::Ids(ids) => ids.len().saturating_mul(4),
        }
    }
}

/// A tokenised batch, ready for the model.
pub struct Encoded {
    pub inputs: Vec<Tensor>,
    /// Tokens of each row before padding.
    pub lengths: Vec<usize>,
    /// Rows that were truncated.
    pub truncated: Vec<usize>,
}

/// Texts as ColBERT feeds them ([`TextPipeline::encode_colbert`]), and the positions of each
/// row that give a vector.
pub struct ColbertBatch {
    pub encoded: Encoded,
    pub keep: Vec<Vec<bool>>,
}

impl TextPipeline {
    /// The text pipeline `tokenizer` asks for, feeding `inputs` (input_ids, and attention_mask
    /// and token_type_ids when the model takes them), in front of `head`.
    pub(super) fn build(t: &TokenizerConfig, inputs: &[TensorSpec], head: Head) -> Result<TextPipeline, BuildError> {
        let load =
            || Tokenizer::from_file(&t.path).map_err(|error| BuildError::Tokenizer { path: t.path.clone(), error });
        let mut plain = load()?;
        plain.with_padding(None);
        plain.with_truncation(None).map_err(BuildError::Truncation)?;
        let mut feeds = Vec::new();
        for spec in inputs {
            let feed = match spec.name.as_str() {
                "input_ids" => TextFeed::Ids,
                "attention_mask" => TextFeed::Mask,
                "token_type_ids" => TextFeed::TypeIds,
                other => return Err(BuildError::NotAFeed(other.to_string())),
            };
            let dtype = spec.dtype.filter(|d| matches!(d, DataType::I64 | DataType::I32));
            if spec.shape.len() != 2 || dtype.is_none() {
                return Err(BuildError::TextInput {
                    name: spec.name.clone(),
                    datatype: spec.datatype.clone(),
                    shape: spec.shape.clone(),
                });
            }
            feeds.push((spec.name.clone(), feed, dtype.expect("checked")));
        }
        if !feeds.iter().any(|(_, f, _)| matches!(f, TextFeed::Ids)) {
            return Err(BuildError::NoInputIds);
        }
        let colbert = match &head {
            Head::Embedding { settings, .. } if settings.pooling == Pooling::Colbert => {
                Some(Colbert::build(&settings.colbert.clone().unwrap_or_default(), &plain)?)
            }
            _ => None,
        };
        let bge_m3 = match &head {
            Head::Embedding { settings, .. } => match &settings.bge_m3 {
                Some(config) if settings.pooling == Pooling::BgeM3 => Some(BgeM3::build(config, &plain)?),
                _ => None,
            },
            _ => None,
        };
        Ok(TextPipeline {
            plain,
            truncating: Default::default(),
            max_length: t.max_length,
            feeds,
            head,
            colbert,
            bge_m3,
        })
    }
}

impl TextPipeline {
    /// The most bytes of one text that are tokenized ([`BYTES_PER_TOKEN`]).
    pub fn max_text_bytes(&self) -> usize {
        self.max_length.saturating_mul(BYTES_PER_TOKEN)
    }

    /// `text`, cut at a character boundary to [`TextPipeline::max_text_bytes`] on the side
    /// `truncate` names, else refused when longer.
    fn bounded<'a>(&self, index: usize, text: &'a str, truncate: Option<Side>) -> Result<&'a str, PipelineError> {
        let max = self.max_text_bytes();
        match (text.len() > max, truncate) {
            (false, _) => Ok(text),
            (true, Some(Side::Right)) => Ok(&text[..text.floor_char_boundary(max)]),
            (true, Some(Side::Left)) => Ok(&text[text.ceil_char_boundary(text.len().saturating_sub(max))..]),
            (true, None) => Err(PipelineError::TextTooLong { index, bytes: text.len(), max }),
        }
    }

    /// Tokens the model's special tokens add to a text (BERT's `[CLS] a [SEP]`: 2), or to a
    /// pair (`[CLS] a [SEP] b [SEP]`: 3).
    pub fn special_tokens(&self, pair: bool) -> usize {
        use tokenizers::PostProcessor as _;
        self.plain.get_post_processor().map_or(0, |p| p.added_tokens(pair))
    }

    /// Tokens of `text` alone, without special tokens; refused past the model's bound on bytes.
    pub fn count_tokens(&self, index: usize, text: &str) -> Result<usize, PipelineError> {
        let text = self.bounded(index, text, None)?;
        let encoding = self
            .plain
            .encode_fast(text, false)
            .map_err(|e| PipelineError::Tokenizer { index, message: e.to_string() })?;
        Ok(encoding.len())
    }

    /// The first `max_tokens` tokens of `text` (no special tokens) in windows of at most
    /// `size` tokens, each starting `size - overlap` tokens after the one before, at most
    /// `limit` of them: each window's text, cut at its tokens' byte offsets, and its number of
    /// tokens. Only what the
    /// windows can cover is tokenized (at most [`BYTES_PER_TOKEN`] bytes for each of their
    /// tokens); the rest of the text is left out.
    pub fn windows(
        &self,
        index: usize,
        text: &str,
        size: usize,
        overlap: usize,
        (limit, max_tokens): (usize, usize),
    ) -> Result<Vec<(String, usize)>, PipelineError> {
        let step = size.saturating_sub(overlap).max(1);
        let covered = step.saturating_mul(limit.saturating_sub(1)).saturating_add(size).min(max_tokens);
        let text = &text[..text.floor_char_boundary(covered.saturating_mul(BYTES_PER_TOKEN))];
        // `encode`, not `encode_fast`: the windows are cut at the tokens' byte offsets.
        let encoding =
            self.plain.encode(text, false).map_err(|e| PipelineError::Tokenizer { index, message: e.to_string() })?;
        let offsets = &encoding.get_offsets()[..encoding.len().min(covered)];
        let mut windows = Vec::new();
        let mut start = 0;
        while start < offsets.len() && windows.len() < limit {
            let end = start.saturating_add(size).min(offsets.len());
            let (from, to) = (offsets[start].0, offsets[end.saturating_sub(1)].1);
            windows.push((text.get(from..to).unwrap_or_default().to_string(), end.saturating_sub(start)));
            if end == offsets.len() {
                break;
            }
            start = start.saturating_add(step);
        }
        match windows.is_empty() {
            true => Err(PipelineError::Empty { index }),
            false => Ok(windows),
        }
    }

    /// Tokenises a batch and pads it to its longest row (never to a fixed length); a text past
    /// the model's length is cut on the side `truncate` names, or refused without one.
    pub fn encode(&self, texts: &[Text], truncate: Option<Side>) -> Result<Encoded, PipelineError> {
        let mut encodings = Vec::with_capacity(texts.len());
        let mut truncated = Vec::new();
        for (index, text) in texts.iter().enumerate() {
            let (first, second) = match text {
                Text::Single(s) if s.is_empty() => return Err(PipelineError::Empty { index }),
                Text::Pair(a, b) if a.is_empty() || b.is_empty() => return Err(PipelineError::Empty { index }),
                Text::Single(s) => (self.bounded(index, s, truncate)?, None),
                Text::Pair(a, b) => (self.bounded(index, a, truncate)?, Some(self.bounded(index, b, truncate)?)),
                Text::Ids(ids) => {
                    let (encoding, cut) = self.encode_ids(index, ids, truncate)?;
                    if cut {
                        truncated.push(index);
                    }
                    encodings.push(encoding);
                    continue;
                }
            };
            let encoding = self
                .encode_text(first, second, truncate)
                .map_err(|message| PipelineError::Tokenizer { index, message })?;
            if encoding.len() > self.max_length {
                return Err(PipelineError::TooLong { index, tokens: encoding.len(), max: self.max_length });
            }
            if !encoding.get_overflowing().is_empty() {
                truncated.push(index);
            }
            encodings.push(encoding);
        }
        let inputs = self.batch(&encodings)?;
        Ok(Encoded { inputs, lengths: encodings.iter().map(|e| e.len()).collect(), truncated })
    }

    /// `texts` as ColBERT marks them for `role` ([`Colbert::mark`]), padded into a batch, and
    /// which tokens of each row give a vector; None for a model that is not ColBERT. A text is
    /// cut to the recipe's length: at most that many tokens' bytes are tokenized.
    pub fn encode_colbert(&self, texts: &[String], role: Role) -> Result<Option<ColbertBatch>, PipelineError> {
        let Some(colbert) = &self.colbert else { return Ok(None) };
        let bounded: Vec<&str> = texts
            .iter()
            .enumerate()
            .map(|(index, text)| self.bounded(index, text, Some(Side::Right)))
            .collect::<Result<_, _>>()?;
        let marked = colbert.mark(&self.plain, self.special_tokens(false), &bounded, role)?;
        let inputs = self.batch(&marked.rows)?;
        let lengths = marked.rows.iter().map(Encoding::len).collect();
        Ok(Some(ColbertBatch { encoded: Encoded { inputs, lengths, truncated: Vec::new() }, keep: marked.keep }))
    }

    /// `encodings` padded to the longest of them, as the model's input tensors.
    fn batch(&self, encodings: &[Encoding]) -> Result<Vec<Tensor>, PipelineError> {
        let rows = encodings.len();
        let width = encodings.iter().map(|e| e.len()).max().unwrap_or(0);
        // rows <= server.max_batch_inputs, width <= max_length: checked all the same.
        let size = rows.checked_mul(width).ok_or_else(|| PipelineError::Output("batch too large".into()))?;
        Ok(self
            .feeds
            .iter()
            .map(|(name, feed, dtype)| {
                let mut flat = vec![0i64; size];
                for (row, e) in flat.chunks_mut(width.max(1)).zip(encodings) {
                    let values = match feed {
                        TextFeed::Ids => e.get_ids(),
                        TextFeed::Mask => e.get_attention_mask(),
                        TextFeed::TypeIds => e.get_type_ids(),
                    };
                    row.iter_mut().zip(values).for_each(|(slot, &v)| *slot = i64::from(v));
                }
                let data = match dtype {
                    DataType::I32 => TensorData::I32(flat.into_iter().map(|v| v as i32).collect()),
                    _ => TensorData::I64(flat),
                };
                Tensor { name: name.clone(), shape: vec![rows as i64, width as i64], data }
            })
            .collect())
    }

    /// A text (or a pair) with the model's special tokens; with `truncate`, cut to `max_length`
    /// tokens on that side by the tokenizer with truncation on. What fits is encoded once, by
    /// the plain tokenizer: with nothing to cut, both give the same.
    fn encode_text(&self, first: &str, second: Option<&str>, truncate: Option<Side>) -> Result<Encoding, String> {
        let encode = |tokenizer: &Tokenizer| match second {
            None => tokenizer.encode_fast(first, true),
            Some(second) => tokenizer.encode_fast((first, second), true),
        };
        let whole = encode(&self.plain).map_err(|e| e.to_string())?;
        let Some(side) = truncate.filter(|_| whole.len() > self.max_length) else { return Ok(whole) };
        let (slot, direction) = match side {
            Side::Right => (0, TruncationDirection::Right),
            Side::Left => (1, TruncationDirection::Left),
        };
        let truncating = self.truncating[slot].get_or_init(|| {
            let mut t = self.plain.clone();
            let params = TruncationParams { max_length: self.max_length, direction, ..Default::default() };
            t.with_truncation(Some(params)).map(|_| ()).map_err(|e| e.to_string())?;
            Ok(t)
        });
        encode(truncating.as_ref()?).map_err(|e| e.to_string())
    }

    /// Token ids a client tokenised itself, checked against the vocabulary; truncated to
    /// `max_length` on the side `truncate` names (the second value says whether they were).
    fn encode_ids(&self, index: usize, ids: &[u32], truncate: Option<Side>) -> Result<(Encoding, bool), PipelineError> {
        if ids.is_empty() {
            return Err(PipelineError::Empty { index });
        }
        self.known_ids(index, ids)?;
        let cut = ids.len().saturating_sub(self.max_length);
        let kept = match truncate {
            _ if cut == 0 => ids,
            Some(Side::Right) => &ids[..self.max_length],
            Some(Side::Left) => &ids[cut..],
            None => return Err(PipelineError::TooLong { index, tokens: ids.len(), max: self.max_length }),
        };
        let tokens = kept.iter().map(|&id| Token::new(id, String::new(), (0, 0))).collect();
        Ok((Encoding::from_tokens(tokens, 0), kept.len() < ids.len()))
    }

    /// Every id within the vocabulary (an id past it would index the model's embedding table
    /// out of bounds).
    fn known_ids(&self, index: usize, ids: &[u32]) -> Result<(), PipelineError> {
        let vocabulary = self.plain.get_vocab_size(true);
        match ids.iter().find(|&&id| id as usize >= vocabulary) {
            Some(bad) => Err(PipelineError::Tokenizer {
                index,
                message: format!("token id {bad} is not in the model's vocabulary of {vocabulary}"),
            }),
            None => Ok(()),
        }
    }

    /// The tokens of input `index` as the model sees them (`/tokenize`): id, text, whether
    /// special, and byte offsets into the text.
    pub fn tokenize(&self, index: usize, text: &Text, add_special_tokens: bool) -> Result<Vec<Piece>, PipelineError> {
        // Every token is listed: nothing is cut, so a text past the bound is refused.
        let (input, source): (EncodeInput, &str) = match text {
            Text::Single(s) => {
                let s = self.bounded(index, s, None)?;
                (s.into(), s)
            }
            Text::Pair(a, b) => {
                let a = self.bounded(index, a, None)?;
                ((a, self.bounded(index, b, None)?).into(), a)
            }
            Text::Ids(_) => return Err(PipelineError::Tokenizer { index, message: "already token ids".into() }),
        };
        let encoding = self
            .plain
            .encode(input, add_special_tokens)
            .map_err(|e| PipelineError::Tokenizer { index, message: e.to_string() })?;
        let pieces = (0..encoding.len())
            .map(|i| {
                let (start, stop) = encoding.get_offsets()[i];
                let special = encoding.get_special_tokens_mask()[i] == 1;
                // Offsets of the second text of a pair point into that text.
                let in_second = encoding.get_sequence_ids()[i] == Some(1);
                let text = match (special, in_second, text) {
                    (true, _, _) => encoding.get_tokens()[i].clone(),
                    (false, true, Text::Pair(_, b)) => b.get(start..stop).unwrap_or_default().to_string(),
                    _ => source.get(start..stop).unwrap_or_default().to_string(),
                };
                Piece {
                    id: encoding.get_ids()[i],
                    text,
                    special,
                    start: (!special).then_some(start),
                    stop: (!special).then_some(stop),
                }
            })
            .collect();
        Ok(pieces)
    }

    /// Input `index`'s token ids back to text (`/decode`).
    pub fn decode(&self, index: usize, ids: &[u32], skip_special_tokens: bool) -> Result<String, PipelineError> {
        self.known_ids(index, ids)?;
        self.plain
            .decode(ids, skip_special_tokens)
            .map_err(|e| PipelineError::Tokenizer { index, message: e.to_string() })
    }
}

/// One token of `/tokenize`'s answer, in text-embeddings-inference's shape.
#[derive(Debug, serde::Serialize)]
pub struct Piece {
    pub id: u32,
    pub text: String,
    pub special: bool,
    pub start: Option<usize>,
    pub stop: Option<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use inferd_config::model::Activation;

    #[test]
    fn texts_are_cut_as_the_truncating_tokenizer_cuts_it_made_only_when_needed() {
        use tokenizers::processors::bert::BertProcessing;
        use tokenizers::processors::PostProcessorWrapper;
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let long = "The committee postponed its decision until the auditors had reviewed every account \
                    of the previous three years, including those of the subsidiaries abroad.";
        let texts =
            ["hello", "Why?", long, "東京は日本の首都で、人口が最も多い都市です。", "a b c d e f g h i j k l m n o p"];
        let mut checked = 0;
        for file in ["models/minilm/tokenizer.json", "tests/models/published/st-embedder/tokenizer.json"] {
            let Ok(mut plain) = Tokenizer::from_file(root.join(file)) else {
                eprintln!("skipping {file}: not there (`make setup` fetches the default model's)");
                continue;
            };
            plain.with_padding(None);
            plain.with_truncation(None).unwrap();
            // The file's own post-processor (a template), BERT's, and none.
            let mut bert = plain.clone();
            bert.with_post_processor(Some(BertProcessing::new(("[SEP]".into(), 102), ("[CLS]".into(), 101))));
            let mut bare = plain.clone();
            bare.with_post_processor(None::<PostProcessorWrapper>);
            for tokenizer in [plain, bert, bare] {
                for (max_length, side) in [5, 12, 128].into_iter().flat_map(|m| [(m, Side::Right), (m, Side::Left)]) {
                    let (slot, direction) = match side {
                        Side::Right => (0, TruncationDirection::Right),
                        Side::Left => (1, TruncationDirection::Left),
                    };
                    let mut reference = tokenizer.clone();
                    let params = TruncationParams { max_length, direction, ..Default::default() };
                    reference.with_truncation(Some(params)).unwrap();
                    let pipeline = TextPipeline {
                        plain: tokenizer.clone(),
                        truncating: Default::default(),
                        max_length,
                        feeds: Vec::new(),
                        head: Head::Classification {
                            output: 0,
                            labels: Vec::new(),
                            activation: Activation::AsIs,
                            why: String::new(),
                        },
                        colbert: None,
                        bge_m3: None,
                    };
                    // What fits is encoded by the plain tokenizer alone.
                    pipeline.encode_text("hi", None, Some(side)).unwrap();
                    assert!(pipeline.truncating.iter().all(|t| t.get().is_none()), "{file}, {max_length}");
                    let mut needed = false;
                    let pairs = texts.iter().flat_map(|a| texts.iter().map(move |b| (*a, Some(*b))));
                    for (first, second) in texts.iter().map(|t| (*t, None)).chain(pairs) {
                        let want = match second {
                            None => reference.encode_fast(first, true),
                            Some(second) => reference.encode_fast((first, second), true),
                        }
                        .unwrap();
                        let got = pipeline.encode_text(first, second, Some(side)).unwrap();
                        let what = format!("{file}, max_length {max_length}, {side:?}: {first:?} / {second:?}");
                        assert_eq!(got.get_ids(), want.get_ids(), "{what}");
                        assert_eq!(got.get_type_ids(), want.get_type_ids(), "{what}");
                        assert_eq!(got.get_attention_mask(), want.get_attention_mask(), "{what}");
                        assert_eq!(got.get_overflowing().is_empty(), want.get_overflowing().is_empty(), "{what}");
                        checked += 1;
                        needed |= pipeline.encode_text(first, second, None).unwrap().len() > max_length;
                    }
                    // Made once a text had to be cut, for that side alone.
                    assert_eq!(pipeline.truncating[slot].get().is_some(), needed, "{file}, {max_length}");
                    assert!(pipeline.truncating[[1, 0][slot]].get().is_none(), "{file}, {max_length}");
                }
            }
        }
        assert!(checked > 0, "no tokenizer to check with");
    }
}
