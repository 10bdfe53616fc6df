//! Per-model pre- and post-processing: text through a tokenizer, images through a decoder,
//! and the model's outputs turned into embeddings or labelled scores.
//!
//! A [`Pipeline`] is built when the model loads, against the model's declared inputs and
//! outputs, so a `model.toml` that does not fit its model is refused at start (and by
//! `inferd check`) instead of failing on the first request. Tokenisation runs on the worker's
//! I/O thread for a request's texts up to 4 KiB in all, on its one blocking thread beyond
//! (request/tasks.rs); the lanes only run the model.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use std::io::Cursor;
use std::sync::OnceLock;

use image::{ImageFormat, ImageReader};
use inferd_config::model::{
    Activation, ChannelOrder, EmbeddingConfig, ImageConfig, Layout, ModelEntry, Pooling, Resample, Resize, Task,
};
use tokenizers::{EncodeInput, Encoding, Token, Tokenizer, TruncationParams};

use crate::runtime::tensor::{element_count, DataType, TensorData};
use crate::runtime::tensor::{Tensor, TensorSpec};

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("input {index} is empty")]
    Empty { index: usize },
    #[error(
        "input {index} has {tokens} tokens, but the model takes at most {max}; shorten it or send \"truncate\": true"
    )]
    TooLong { index: usize, tokens: usize, max: usize },
    #[error(
        "input {index} is {bytes} bytes of text; at most {max} bytes are tokenized (tokenizer.max_length x {BYTES_PER_TOKEN}); shorten it or send \"truncate\": true"
    )]
    TextTooLong { index: usize, bytes: usize, max: usize },
    #[error("input {index}: {message}")]
    Tokenizer { index: usize, message: String },
    #[error("image {index}: {message}")]
    NotAnImage { index: usize, message: String },
    #[error(
        "image {index} is {width}x{height} = {pixels} pixels, more than the model's limit of {max} (image.max_pixels)"
    )]
    ImageTooLarge { index: usize, width: u32, height: u32, pixels: u64, max: u64 },
    #[error("image {index} is {width}x{height}; no side may be longer than {max} (image.max_side)")]
    ImageTooLong { index: usize, width: u32, height: u32, max: u32 },
    #[error(
        "image {index} is {width}x{height}: resizing it to {to_width}x{to_height} needs {mib} MiB, more than the {max_mib} MiB one image may use"
    )]
    ImageTooCostly { index: usize, width: u32, height: u32, to_width: u32, to_height: u32, mib: u64, max_mib: u64 },
    #[error("the model's output does not fit the pipeline: {0}")]
    Output(String),
    /// Token vectors asked of a model whose output is pooled already (the client's request
    /// does not fit the model: 400, not the server's fault).
    #[error(
        "the model's output does not fit the pipeline: '{output}' has shape {shape:?}: token embeddings need [batch, sequence, dim]"
    )]
    NoTokenVectors { output: String, shape: Vec<i64> },
}

/// Text is cut to `max_length` times this many bytes before it is tokenized (or refused, when
/// it may not be truncated), so that the tokenizer's work and memory are bounded by the model's
/// own limit and not by the body size. A token of real text covers a few bytes (English ~4,
/// CJK 3 per character; WordPiece makes any word over 100 characters a single `[UNK]`), so
/// only text of many long unknown words or runs of whitespace could still have had fewer than
/// `max_length` tokens in it.
pub const BYTES_PER_TOKEN: usize = 64;

/// What the model does with its outputs.
#[derive(Debug, Clone)]
pub enum Head {
    /// `settings`: model.toml's `[embedding]` (pooling, normalisation, prompts).
    Embedding { output: usize, settings: EmbeddingConfig },
    /// `why`: where `activation` came from (model.toml, or what the graph ends in).
    Classification { output: usize, labels: Vec<String>, activation: Activation, why: String },
}

#[derive(Debug)]
pub enum Pipeline {
    /// Tensors in, tensors out.
    Raw,
    Text(Box<TextPipeline>),
    Image(ImagePipeline),
}

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
    /// The same with truncation at `max_length`, made the first time a text has to be cut (a
    /// tokenizer holds its vocabulary, ~6 MiB for MiniLM's; most workers never cut a text).
    truncating: OnceLock<Result<Tokenizer, String>>,
    pub max_length: usize,
    /// For every model input, in the model's order: what feeds it and its element type.
    feeds: Vec<(String, TextFeed, DataType)>,
    pub head: Head,
}

#[derive(Debug)]
pub struct ImagePipeline {
    pub config: ImageConfig,
    input: String,
    pub head: Head,
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

impl Pipeline {
    /// Builds the pipeline `entry` asks for and checks it against the model's inputs and outputs.
    /// `producer` names the operator that computes a graph value (see [`Producer`]).
    pub fn build(
        entry: &ModelEntry,
        inputs: &[TensorSpec],
        outputs: &[TensorSpec],
        producer: Producer,
    ) -> Result<Pipeline, String> {
        if entry.task == Task::Raw {
            return Ok(Pipeline::Raw);
        }
        let head = head(entry, outputs, producer)?;
        if let Some(t) = &entry.tokenizer {
            let load = || Tokenizer::from_file(&t.path).map_err(|e| format!("tokenizer {}: {e}", t.path.display()));
            let mut plain = load()?;
            plain.with_padding(None);
            plain.with_truncation(None).map_err(|e| e.to_string())?;
            let mut feeds = Vec::new();
            for spec in inputs {
                let feed = match spec.name.as_str() {
                    "input_ids" => TextFeed::Ids,
                    "attention_mask" => TextFeed::Mask,
                    "token_type_ids" => TextFeed::TypeIds,
                    other => {
                        return Err(format!(
                            "input '{other}' is not one the text pipeline produces (input_ids, attention_mask, \
                             token_type_ids)"
                        ))
                    }
                };
                let dtype = spec.dtype.filter(|d| matches!(d, DataType::I64 | DataType::I32));
                if spec.shape.len() != 2 || dtype.is_none() {
                    return Err(format!(
                        "input '{}' is {} {:?}; the text pipeline feeds INT64 or INT32 [batch, sequence]",
                        spec.name, spec.datatype, spec.shape
                    ));
                }
                feeds.push((spec.name.clone(), feed, dtype.expect("checked")));
            }
            if !feeds.iter().any(|(_, f, _)| matches!(f, TextFeed::Ids)) {
                return Err("the model has no input 'input_ids' for the tokenizer to feed".into());
            }
            return Ok(Pipeline::Text(Box::new(TextPipeline {
                plain,
                truncating: OnceLock::new(),
                max_length: t.max_length,
                feeds,
                head,
            })));
        }
        let config = entry.image.clone().ok_or("a classification model needs [tokenizer] or [image]")?;
        if inputs.len() != 1 {
            return Err(format!("an image model must have exactly one input, this one has {}", inputs.len()));
        }
        let spec = match &config.input {
            Some(name) => {
                inputs.iter().find(|i| &i.name == name).ok_or(format!("image.input '{name}' is not an input"))?
            }
            None => &inputs[0],
        };
        let (h, w) = (config.height as i64, config.width as i64);
        let want = match config.layout {
            Layout::Nchw => [-1, 3, h, w],
            Layout::Nhwc => [-1, h, w, 3],
        };
        let fits =
            spec.shape.len() == 4 && spec.shape.iter().zip(want).skip(1).all(|(&have, want)| have < 0 || have == want);
        if spec.dtype != Some(DataType::F32) || !fits {
            return Err(format!(
                "input '{}' is {} {:?}; image settings ({}x{}, {:?}) need FP32 {:?}",
                spec.name, spec.datatype, spec.shape, config.width, config.height, config.layout, want
            ));
        }
        Ok(Pipeline::Image(ImagePipeline { input: spec.name.clone(), config, head }))
    }

    pub fn head(&self) -> Option<&Head> {
        match self {
            Pipeline::Raw => None,
            Pipeline::Text(t) => Some(&t.head),
            Pipeline::Image(i) => Some(&i.head),
        }
    }
}

/// The operator that computes a graph value, through shape-only operators: (op type, node), or
/// None for a graph input or initializer. Read from the model file only when asked.
pub type Producer<'a> = &'a dyn Fn(&str) -> Result<Option<(String, String)>, String>;

/// The activation of a classifier whose model.toml names none, from what computes its output:
/// probabilities the graph made itself are not activated again (a second softmax flattens
/// them: measured on published tf2onnx ResNet-50 and VGG16 files, up to 0.27 and 0.52 off).
fn chosen_activation(output: &str, producer: Producer) -> Result<(Activation, String), String> {
    let (activation, why) = match producer(output)? {
        Some((op, node)) if op == "Softmax" || op == "Sigmoid" => {
            (Activation::AsIs, format!("output '{output}' comes from {op} node '{node}': probabilities already"))
        }
        // softmax(log p) = p: the probabilities.
        Some((op, node)) if op == "LogSoftmax" => (
            Activation::Softmax,
            format!("output '{output}' comes from LogSoftmax node '{node}': softmax of log-probabilities"),
        ),
        Some((op, node)) => (Activation::Softmax, format!("output '{output}' comes from {op} node '{node}': logits")),
        None => (Activation::Softmax, format!("output '{output}' is not computed by a node: taken as logits")),
    };
    Ok((activation, format!("{why} (chosen from the graph; classification.activation in model.toml overrides)")))
}

fn head(entry: &ModelEntry, outputs: &[TensorSpec], producer: Producer) -> Result<Head, String> {
    let pick = |name: &Option<String>| -> Result<(usize, &TensorSpec), String> {
        match name {
            Some(n) => outputs.iter().position(|o| &o.name == n).map(|i| (i, &outputs[i])).ok_or(format!(
                "output '{n}' is not an output of the model ({})",
                outputs.iter().map(|o| o.name.as_str()).collect::<Vec<_>>().join(", ")
            )),
            None => outputs.first().map(|o| (0, o)).ok_or("the model has no outputs".to_string()),
        }
    };
    match entry.task {
        Task::Embedding => {
            let e = entry.embedding.clone().unwrap_or_default();
            let (output, spec) = pick(&e.output)?;
            if spec.dtype != Some(DataType::F32) || !matches!(spec.shape.len(), 2 | 3) {
                return Err(format!(
                    "output '{}' is {} {:?}; embeddings need FP32 [batch, sequence, dim] or [batch, dim]",
                    spec.name, spec.datatype, spec.shape
                ));
            }
            Ok(Head::Embedding { output, settings: e })
        }
        Task::Classification => {
            let c = entry.classification.clone().expect("checked when model.toml was read");
            let (output, spec) = pick(&c.output)?;
            let width = spec.shape.last().copied();
            if spec.dtype != Some(DataType::F32) || spec.shape.len() != 2 {
                return Err(format!(
                    "output '{}' is {} {:?}; classification needs FP32 [batch, labels]",
                    spec.name, spec.datatype, spec.shape
                ));
            }
            if width.is_some_and(|w| w >= 0 && w as usize != c.labels.len()) {
                return Err(format!(
                    "{} labels, but output '{}' has {} logits per row",
                    c.labels.len(),
                    spec.name,
                    width.unwrap_or_default()
                ));
            }
            let (activation, why) = match c.activation {
                Some(a) => (a, "classification.activation in model.toml".to_string()),
                None => chosen_activation(&spec.name, producer)?,
            };
            Ok(Head::Classification { output, labels: c.labels, activation, why })
        }
        Task::Raw => unreachable!("raw models have no head"),
    }
}

impl TextPipeline {
    /// The most bytes of one text that are tokenized ([`BYTES_PER_TOKEN`]).
    pub fn max_text_bytes(&self) -> usize {
        self.max_length.saturating_mul(BYTES_PER_TOKEN)
    }

    /// `text`, cut at a character boundary to [`TextPipeline::max_text_bytes`] when `truncate`
    /// allows it, else refused when longer.
    fn bounded<'a>(&self, index: usize, text: &'a str, truncate: bool) -> Result<&'a str, PipelineError> {
        let max = self.max_text_bytes();
        match (text.len() > max, truncate) {
            (false, _) => Ok(text),
            (true, true) => Ok(&text[..text.floor_char_boundary(max)]),
            (true, false) => Err(PipelineError::TextTooLong { index, bytes: text.len(), max }),
        }
    }

    /// Tokenises a batch and pads it to its longest row (never to a fixed length).
    pub fn encode(&self, texts: &[Text], truncate: bool) -> Result<Encoded, PipelineError> {
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
        let rows = encodings.len();
        let width = encodings.iter().map(|e| e.len()).max().unwrap_or(0);
        // rows <= server.max_batch_inputs, width <= max_length: checked all the same.
        let size = rows.checked_mul(width).ok_or_else(|| PipelineError::Output("batch too large".into()))?;
        let inputs = self
            .feeds
            .iter()
            .map(|(name, feed, dtype)| {
                let mut flat = vec![0i64; size];
                for (row, e) in flat.chunks_mut(width.max(1)).zip(&encodings) {
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
            .collect();
        Ok(Encoded { inputs, lengths: encodings.iter().map(|e| e.len()).collect(), truncated })
    }

    /// A text (or a pair) with the model's special tokens; with `truncate`, cut to `max_length`
    /// tokens by the tokenizer with truncation on. What fits is encoded once, by the plain
    /// tokenizer: with nothing to cut, both give the same.
    fn encode_text(&self, first: &str, second: Option<&str>, truncate: bool) -> Result<Encoding, String> {
        let encode = |tokenizer: &Tokenizer| match second {
            None => tokenizer.encode_fast(first, true),
            Some(second) => tokenizer.encode_fast((first, second), true),
        };
        let whole = encode(&self.plain).map_err(|e| e.to_string())?;
        if !truncate || whole.len() <= self.max_length {
            return Ok(whole);
        }
        let truncating = self.truncating.get_or_init(|| {
            let mut t = self.plain.clone();
            let params = TruncationParams { max_length: self.max_length, ..Default::default() };
            t.with_truncation(Some(params)).map(|_| ()).map_err(|e| e.to_string())?;
            Ok(t)
        });
        encode(truncating.as_ref()?).map_err(|e| e.to_string())
    }

    /// Token ids a client tokenised itself, checked against the vocabulary; truncated to
    /// `max_length` when allowed (the second value says whether they were).
    fn encode_ids(&self, index: usize, ids: &[u32], truncate: bool) -> Result<(Encoding, bool), PipelineError> {
        if ids.is_empty() {
            return Err(PipelineError::Empty { index });
        }
        self.known_ids(index, ids)?;
        if ids.len() > self.max_length && !truncate {
            return Err(PipelineError::TooLong { index, tokens: ids.len(), max: self.max_length });
        }
        let kept = &ids[..ids.len().min(self.max_length)];
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
                let s = self.bounded(index, s, false)?;
                (s.into(), s)
            }
            Text::Pair(a, b) => {
                let a = self.bounded(index, a, false)?;
                ((a, self.bounded(index, b, false)?).into(), a)
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

impl ImagePipeline {
    /// Decodes, resizes and normalises a batch of encoded images into the model's input.
    pub fn preprocess(&self, images: &[Vec<u8>]) -> Result<Vec<Tensor>, PipelineError> {
        let c = &self.config;
        let (w, h) = (c.width as usize, c.height as usize);
        // The model's own size (model.toml) times at most server.max_batch_inputs images.
        let too_large = || PipelineError::Output("image batch too large".into());
        let plane = w.checked_mul(h).ok_or_else(too_large)?;
        let per_image = plane.checked_mul(3).ok_or_else(too_large)?;
        let mut data = vec![0f32; images.len().checked_mul(per_image).ok_or_else(too_large)?];
        let source = match c.channels {
            ChannelOrder::Rgb => [0, 1, 2],
            ChannelOrder::Bgr => [2, 1, 0],
        };
        for (n, (bytes, out)) in images.iter().zip(data.chunks_mut(per_image.max(1))).enumerate() {
            let rgb = decode(n, bytes, c)?;
            let resized = resize(&rgb, c);
            let value =
                |pixel: &image::Rgb<u8>, ch: usize| (pixel.0[source[ch]] as f32 * c.scale - c.mean[ch]) / c.std[ch];
            match c.layout {
                Layout::Nchw => {
                    for (ch, channel) in out.chunks_mut(plane.max(1)).enumerate() {
                        channel.iter_mut().zip(resized.pixels()).for_each(|(slot, p)| *slot = value(p, ch));
                    }
                }
                Layout::Nhwc => {
                    for (slots, p) in out.chunks_mut(3).zip(resized.pixels()) {
                        slots.iter_mut().enumerate().for_each(|(ch, slot)| *slot = value(p, ch));
                    }
                }
            }
        }
        let shape = match c.layout {
            Layout::Nchw => vec![images.len() as i64, 3, h as i64, w as i64],
            Layout::Nhwc => vec![images.len() as i64, h as i64, w as i64, 3],
        };
        Ok(vec![Tensor { name: self.input.clone(), shape, data: TensorData::F32(data) }])
    }
}

/// `rgb` brought to the model's size as model.toml's `[image]` says: stretched, or its shorter
/// side resized and the centre cut out (both sides of the resized image are at least the
/// crop's: model.toml's check).
fn resize(rgb: &image::RgbImage, c: &ImageConfig) -> image::RgbImage {
    use image::imageops::FilterType;
    let filter = match c.resample {
        Resample::Nearest => FilterType::Nearest,
        Resample::Bilinear => FilterType::Triangle,
        Resample::Bicubic => FilterType::CatmullRom,
        Resample::Lanczos => FilterType::Lanczos3,
    };
    let (width, height) = c.resized_size(rgb.width(), rgb.height());
    let resized = image::imageops::resize(rgb, width, height, filter);
    match c.resize {
        Resize::Stretch => resized,
        // As Hugging Face's center_crop: the offsets rounded down.
        Resize::ShortestEdge => {
            let (left, top) = (width.saturating_sub(c.width) / 2, height.saturating_sub(c.height) / 2);
            image::imageops::crop_imm(&resized, left, top, c.width, c.height).to_image()
        }
    }
}

/// [`decode`] for one image: what the fuzz target (fuzz/fuzz_targets/image_decode.rs) drives.
pub fn decode_image(bytes: &[u8], config: &ImageConfig) -> Result<image::RgbImage, PipelineError> {
    decode(0, bytes, config)
}

/// PNG or JPEG to RGB, refusing anything else, and checking the pixel count from the header
/// before a single pixel is decoded.
fn decode(index: usize, bytes: &[u8], c: &ImageConfig) -> Result<image::RgbImage, PipelineError> {
    let bad = |message: String| PipelineError::NotAnImage { index, message };
    if bytes.is_empty() {
        return Err(bad("empty".into()));
    }
    let reader = || -> Result<ImageReader<Cursor<&[u8]>>, PipelineError> {
        let reader = ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| bad(e.to_string()))?;
        match reader.format() {
            Some(ImageFormat::Png | ImageFormat::Jpeg) => Ok(reader),
            _ => Err(bad("not a PNG or JPEG image".into())),
        }
    };
    let header = reader()?;
    // The JPEG decoder fills a cut-off image with grey instead of failing: a complete JPEG has
    // its end-of-image marker after the last start-of-scan (entropy-coded data never contains
    // an unescaped 0xFF 0xD9).
    if header.format() == Some(ImageFormat::Jpeg) && !jpeg_complete(bytes) {
        return Err(bad("corrupt or truncated: the JPEG data ends before its end-of-image marker".into()));
    }
    let (width, height) = header.into_dimensions().map_err(|e| bad(format!("unreadable header: {e}")))?;
    let pixels = u64::from(width).saturating_mul(u64::from(height));
    if pixels > c.max_pixels {
        return Err(PipelineError::ImageTooLarge { index, width, height, pixels, max: c.max_pixels });
    }
    if width.max(height) > c.max_side {
        return Err(PipelineError::ImageTooLong { index, width, height, max: c.max_side });
    }
    resize_cost(index, width, height, c)?;
    let mut decoder = reader()?;
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(width);
    limits.max_image_height = Some(height);
    limits.max_alloc = Some(pixels.saturating_mul(8).saturating_add(1 << 20));
    decoder.limits(limits);
    let decoded = crate::panics::contained(|| decoder.decode())
        .map_err(|panic| bad(format!("corrupt: the decoder failed on it ({panic})")))?
        .map_err(|e| bad(format!("corrupt or truncated: {e}")))?;
    Ok(decoded.to_rgb8())
}

/// The most one image's resize may allocate: a 16,384-pixel-wide source resized to 1024 rows.
const MAX_RESIZE_BYTES: u64 = 256 << 20;

/// What `image::imageops::resize` allocates for a `width` x `height` source: it resamples the
/// rows first, into a `width` x (resized height) buffer of four f32 channels, then the columns
/// (the resized size is the model's, or with `shortest_edge` one that follows the source's
/// aspect ratio). Refused when over [`MAX_RESIZE_BYTES`], from the header, before anything is
/// decoded.
fn resize_cost(index: usize, width: u32, height: u32, c: &ImageConfig) -> Result<(), PipelineError> {
    let (to_width, to_height) = c.resized_size(width, height);
    let bytes = u64::from(width.max(to_width)).saturating_mul(u64::from(to_height)).saturating_mul(16);
    match bytes > MAX_RESIZE_BYTES {
        true => Err(PipelineError::ImageTooCostly {
            index,
            width,
            height,
            to_width,
            to_height,
            mib: bytes >> 20,
            max_mib: MAX_RESIZE_BYTES >> 20,
        }),
        false => Ok(()),
    }
}

fn jpeg_complete(bytes: &[u8]) -> bool {
    let last_scan = bytes.windows(2).rposition(|w| w == [0xFF, 0xDA]).unwrap_or(0);
    bytes[last_scan..].windows(2).any(|w| w == [0xFF, 0xD9])
}

impl Head {
    /// The output the head reads.
    pub fn output(&self) -> usize {
        match self {
            Head::Embedding { output, .. } | Head::Classification { output, .. } => *output,
        }
    }
}

/// Scales `row` to unit length (a zero vector stays zero).
pub fn l2_normalize(row: &mut [f32]) {
    let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    row.iter_mut().for_each(|x| *x /= norm);
}

/// The vector of every token of every row (`/embed_all`), padding left out: from a
/// `[batch, sequence, dim]` output only.
pub fn token_embeddings(output: &Tensor, lengths: &[usize]) -> Result<Vec<Vec<Vec<f32>>>, PipelineError> {
    let TensorData::F32(values) = &output.data else {
        return Err(PipelineError::Output(format!("'{}' is not FP32", output.name)));
    };
    let dims: Vec<usize> = output.shape.iter().map(|&d| d.max(0) as usize).collect();
    let [b, s, d] = dims[..] else {
        return Err(PipelineError::NoTokenVectors { output: output.name.clone(), shape: output.shape.clone() });
    };
    if b != lengths.len() || d == 0 || element_count(&output.shape) != Some(values.len()) {
        return Err(PipelineError::Output(format!(
            "'{}' has shape {:?} for {} values",
            output.name,
            output.shape,
            values.len()
        )));
    }
    // s x d is at most values.len(), checked above.
    Ok(values
        .chunks(s.saturating_mul(d).max(1))
        .zip(lengths)
        .map(|(row, &n)| row.chunks(d).take(n.min(s)).map(<[f32]>::to_vec).collect())
        .collect())
}

/// Pools token vectors `[batch, sequence, dim]` (or passes `[batch, dim]` through), then
/// L2-normalises when asked.
pub fn embeddings(
    output: &Tensor,
    lengths: &[usize],
    pooling: Pooling,
    normalize: bool,
) -> Result<Vec<Vec<f32>>, PipelineError> {
    let TensorData::F32(values) = &output.data else {
        return Err(PipelineError::Output(format!("'{}' is not FP32", output.name)));
    };
    let dims: Vec<usize> = output.shape.iter().map(|&d| d.max(0) as usize).collect();
    if dims.iter().skip(1).any(|&d| d == 0) || element_count(&output.shape) != Some(values.len()) {
        return Err(PipelineError::Output(format!(
            "'{}' has shape {:?} for {} values: no embedding can be read from it",
            output.name,
            output.shape,
            values.len()
        )));
    }
    let mut rows = match dims.as_slice() {
        [b, d] if *b == lengths.len() => values.chunks(*d).map(<[f32]>::to_vec).collect::<Vec<_>>(),
        [b, s, _] if *b == lengths.len() && *s == 0 => {
            return Err(PipelineError::Output(format!("'{}' has no tokens (shape {:?})", output.name, output.shape)))
        }
        [b, s, d] if *b == lengths.len() => values
            .chunks(s.saturating_mul(*d).max(1))
            .zip(lengths)
            .map(|(row, &length)| {
                // Rows are padded at the end: the first `n` tokens are the text's.
                let n = length.clamp(1, *s);
                let mut tokens = row.chunks(*d).take(n);
                match pooling {
                    Pooling::Cls => row[..*d].to_vec(),
                    Pooling::LastToken => tokens.next_back().unwrap_or(&row[..*d]).to_vec(),
                    Pooling::Mean => {
                        let mut sum = vec![0f32; *d];
                        for token in tokens {
                            sum.iter_mut().zip(token).for_each(|(a, b)| *a += b);
                        }
                        sum.iter().map(|x| x / n as f32).collect()
                    }
                    Pooling::Max => {
                        let mut max = vec![f32::NEG_INFINITY; *d];
                        for token in tokens {
                            max.iter_mut().zip(token).for_each(|(a, &b)| *a = a.max(b));
                        }
                        max
                    }
                    // log(1 + relu(x)) grows with x: the largest x of each entry decides.
                    Pooling::Splade => {
                        let mut max = vec![0f32; *d];
                        for token in tokens {
                            max.iter_mut().zip(token).for_each(|(a, &b)| *a = a.max(b));
                        }
                        max.iter().map(|x| x.ln_1p()).collect()
                    }
                }
            })
            .collect(),
        _ => return Err(PipelineError::Output(format!("'{}' has shape {:?}", output.name, output.shape))),
    };
    if normalize {
        rows.iter_mut().for_each(|row| l2_normalize(row));
    }
    Ok(rows)
}

/// The entries of `row` above `threshold` as (index, value) in index order; with `top_k`, only
/// the `top_k` largest of them (`/embed_sparse`).
pub fn sparse(row: &[f32], threshold: f32, top_k: Option<usize>) -> Vec<(usize, f32)> {
    let mut kept: Vec<(usize, f32)> = row.iter().copied().enumerate().filter(|(_, v)| *v > threshold).collect();
    if let Some(k) = top_k.filter(|&k| k < kept.len()) {
        kept.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        kept.truncate(k);
        kept.sort_by_key(|e| e.0);
    }
    kept
}

/// Scores per row, `raw` = the output as the model gave it, else activated.
pub fn scores(
    output: &Tensor,
    labels: usize,
    activation: Activation,
    raw: bool,
) -> Result<Vec<Vec<f32>>, PipelineError> {
    let TensorData::F32(values) = &output.data else {
        return Err(PipelineError::Output(format!("'{}' is not FP32", output.name)));
    };
    if output.shape.len() != 2 || output.shape[1] as usize != labels || labels == 0 {
        return Err(PipelineError::Output(format!(
            "'{}' has shape {:?}, expected [batch, {labels}]",
            output.name, output.shape
        )));
    }
    Ok(values
        .chunks(labels)
        .map(|logits| match (raw, activation) {
            (true, _) => logits.to_vec(),
            (false, Activation::AsIs) => logits.to_vec(),
            (false, Activation::Sigmoid) => logits.iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect(),
            (false, Activation::Softmax) => {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exp: Vec<f32> = logits.iter().map(|x| (x - max).exp()).collect();
                let sum: f32 = exp.iter().sum();
                exp.iter().map(|x| x / sum).collect()
            }
        })
        .collect())
}

/// Labels with their scores, best first, at most `top_k`.
pub fn ranked(labels: &[String], scores: &[f32], top_k: Option<usize>) -> Vec<(String, f32)> {
    let mut pairs: Vec<(String, f32)> = labels.iter().cloned().zip(scores.iter().copied()).collect();
    pairs.sort_by(|a, b| b.1.total_cmp(&a.1));
    pairs.truncate(top_k.unwrap_or(usize::MAX));
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

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
                for max_length in [5, 12, 128] {
                    let mut reference = tokenizer.clone();
                    let params = TruncationParams { max_length, ..Default::default() };
                    reference.with_truncation(Some(params)).unwrap();
                    let pipeline = TextPipeline {
                        plain: tokenizer.clone(),
                        truncating: OnceLock::new(),
                        max_length,
                        feeds: Vec::new(),
                        head: Head::Classification {
                            output: 0,
                            labels: Vec::new(),
                            activation: Activation::AsIs,
                            why: String::new(),
                        },
                    };
                    // What fits is encoded by the plain tokenizer alone.
                    pipeline.encode_text("hi", None, true).unwrap();
                    assert!(pipeline.truncating.get().is_none(), "{file}, {max_length}");
                    let mut needed = false;
                    let pairs = texts.iter().flat_map(|a| texts.iter().map(move |b| (*a, Some(*b))));
                    for (first, second) in texts.iter().map(|t| (*t, None)).chain(pairs) {
                        let want = match second {
                            None => reference.encode_fast(first, true),
                            Some(second) => reference.encode_fast((first, second), true),
                        }
                        .unwrap();
                        let got = pipeline.encode_text(first, second, true).unwrap();
                        let what = format!("{file}, max_length {max_length}: {first:?} / {second:?}");
                        assert_eq!(got.get_ids(), want.get_ids(), "{what}");
                        assert_eq!(got.get_type_ids(), want.get_type_ids(), "{what}");
                        assert_eq!(got.get_attention_mask(), want.get_attention_mask(), "{what}");
                        assert_eq!(got.get_overflowing().is_empty(), want.get_overflowing().is_empty(), "{what}");
                        checked += 1;
                        needed |= pipeline.encode_text(first, second, false).unwrap().len() > max_length;
                    }
                    // Made once a text had to be cut.
                    assert_eq!(pipeline.truncating.get().is_some(), needed, "{file}, {max_length}");
                }
            }
        }
        assert!(checked > 0, "no tokenizer to check with");
    }

    #[test]
    fn mean_pooling_ignores_padding_and_normalises() {
        // Two rows, sequence 3, dim 2; row 1 has one real token.
        let out = Tensor {
            name: "h".into(),
            shape: vec![2, 3, 2],
            data: TensorData::F32(vec![1., 2., 3., 4., 9., 9., 6., 8., 100., 100., 100., 100.]),
        };
        let e = embeddings(&out, &[2, 1], Pooling::Mean, false).unwrap();
        assert_eq!(e, vec![vec![2., 3.], vec![6., 8.]]);
        let e = embeddings(&out, &[2, 1], Pooling::Mean, true).unwrap();
        assert!((e[1][0] - 0.6).abs() < 1e-6 && (e[1][1] - 0.8).abs() < 1e-6);
        let e = embeddings(&out, &[2, 1], Pooling::Cls, false).unwrap();
        assert_eq!(e[1], vec![6., 8.]);
        // Row 0 has tokens (1, 2) and (3, 4), then padding (9, 9); row 1 one token.
        let e = embeddings(&out, &[2, 1], Pooling::Max, false).unwrap();
        assert_eq!(e, vec![vec![3., 4.], vec![6., 8.]]);
        let e = embeddings(&out, &[2, 1], Pooling::LastToken, false).unwrap();
        assert_eq!(e, vec![vec![3., 4.], vec![6., 8.]]);
        let out = Tensor { data: TensorData::F32(vec![5., -2., 3., 4., 9., 9., 6., 8., 0., 0., 0., 0.]), ..out };
        let e = embeddings(&out, &[2, 1], Pooling::Max, false).unwrap();
        assert_eq!(e[0], vec![5., 4.], "each dimension's own maximum");
        let e = embeddings(&out, &[2, 1], Pooling::Splade, false).unwrap();
        assert_eq!(e[0], vec![5f32.ln_1p(), 4f32.ln_1p()]);
        let out = Tensor { data: TensorData::F32(vec![-1., -2., 3., -4., 9., 9., 6., 8., 0., 0., 0., 0.]), ..out };
        let e = embeddings(&out, &[2, 1], Pooling::Splade, false).unwrap();
        assert_eq!(e[0], vec![3f32.ln_1p(), 0.], "relu: no token above 0 gives 0");
    }

    #[test]
    fn sparse_vectors_keep_what_is_above_the_threshold_or_the_top_k() {
        let row = [0., 0.5, 0., 2., 0.1, 1.];
        assert_eq!(sparse(&row, 0., None), vec![(1, 0.5), (3, 2.), (4, 0.1), (5, 1.)]);
        assert_eq!(sparse(&row, 0.2, None), vec![(1, 0.5), (3, 2.), (5, 1.)]);
        assert_eq!(sparse(&row, 0., Some(2)), vec![(3, 2.), (5, 1.)], "the two largest, in index order");
        assert_eq!(sparse(&row, 0., Some(9)).len(), 4);
        assert!(sparse(&row, 0., Some(0)).is_empty());
    }

    #[test]
    fn zero_sized_outputs_are_a_model_error_not_a_panic() {
        for shape in [vec![2, 0], vec![2, 3, 0], vec![2, 0, 4]] {
            let out = Tensor { name: "h".into(), shape, data: TensorData::F32(vec![]) };
            for pooling in [Pooling::Mean, Pooling::Cls, Pooling::Max, Pooling::LastToken, Pooling::Splade] {
                let err = embeddings(&out, &[1, 1], pooling, true).unwrap_err().to_string();
                assert!(err.contains("no embedding"), "{err}");
            }
        }
        let short = Tensor { name: "h".into(), shape: vec![2, 3, 2], data: TensorData::F32(vec![1.; 6]) };
        assert!(embeddings(&short, &[1, 1], Pooling::Mean, false).is_err());
        let none = Tensor { name: "l".into(), shape: vec![1, 0], data: TensorData::F32(vec![]) };
        assert!(scores(&none, 0, Activation::Softmax, false).is_err());
    }

    #[test]
    fn a_jpeg_without_its_end_marker_is_incomplete() {
        assert!(jpeg_complete(&[0xFF, 0xD8, 0xFF, 0xDA, 1, 2, 0xFF, 0x00, 0xFF, 0xD9]));
        assert!(!jpeg_complete(&[0xFF, 0xD8, 0xFF, 0xDA, 1, 2, 0xFF, 0x00]));
        // An end marker before the last scan (a thumbnail's) does not count.
        assert!(!jpeg_complete(&[0xFF, 0xD8, 0xFF, 0xD9, 0xFF, 0xDA, 1, 2]));
    }

    #[test]
    fn a_shortest_edge_resize_is_bounded_from_the_header() {
        let c: ImageConfig = serde_json::from_value(serde_json::json!(
            {"width": 224, "height": 224, "resize": "shortest_edge", "shortest_edge": 256}
        ))
        .unwrap();
        assert!(resize_cost(0, 640, 480, &c).is_ok());
        // 1 x 16384: its short side to 256 makes the long one 4,194,304 (a 16 GiB buffer).
        let e = resize_cost(0, 1, 16_384, &c).unwrap_err().to_string();
        assert!(e.contains("256x4194304"), "{e}");
    }

    #[test]
    fn softmax_sigmoid_raw_and_ranking() {
        let out = Tensor { name: "l".into(), shape: vec![1, 3], data: TensorData::F32(vec![0., 1., 2.]) };
        let s = scores(&out, 3, Activation::Softmax, false).unwrap();
        assert!((s[0].iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(scores(&out, 3, Activation::Softmax, true).unwrap()[0], vec![0., 1., 2.]);
        assert!((scores(&out, 3, Activation::Sigmoid, false).unwrap()[0][0] - 0.5).abs() < 1e-6);
        let labels: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let r = ranked(&labels, &s[0], Some(2));
        assert_eq!(r.iter().map(|p| p.0.as_str()).collect::<Vec<_>>(), ["c", "b"]);
        assert!(scores(&out, 4, Activation::Softmax, false).is_err());
    }
}
