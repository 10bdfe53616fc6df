//! The schema of model.toml: its sections, their defaults and the checks that need no files
//! (each section's values, and which sections go together).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ModelFile {
    pub(super) name: String,
    #[serde(default = "default_version")]
    pub(super) version: String,
    #[serde(default = "default_file")]
    pub(super) file: PathBuf,
    #[serde(default)]
    pub(super) task: Task,
    #[serde(default = "yes")]
    pub(super) share_weights: bool,
    #[serde(default)]
    pub(super) warmup: Warmup,
    #[serde(default)]
    pub(super) batching: Batching,
    /// Graph inputs that have an initializer (ONNX Runtime's overridable initializers) that a
    /// request may give or leave out, Triton's `optional: true`: left out, the graph runs with
    /// the initializer's value.
    #[serde(default)]
    pub(super) optional_inputs: Vec<String>,
    pub(super) tokenizer: Option<TokenizerFile>,
    pub(super) embedding: Option<EmbeddingConfig>,
    pub(super) classification: Option<ClassificationConfig>,
    pub(super) image: Option<ImageConfig>,
    #[serde(default)]
    pub(super) precision: Precision,
    #[serde(default)]
    pub(super) quantization: Quantization,
    pub(super) custom_ops: Option<CustomOps>,
    /// The folder's OpenSSF model-signing signature, relative to it (default `model.sig`).
    pub(super) signature: Option<PathBuf>,
}

/// A shared library of custom operators the model's graph uses (ONNX Runtime's
/// `RegisterCustomOpsLibrary`, e.g. onnxruntime-extensions'), registered with each of the
/// model's sessions. Paths relative to the model's folder in model.toml, absolute once loaded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CustomOps {
    pub library: PathBuf,
    /// Libraries loaded first, their symbols visible to the ones after: for a library built
    /// against another it does not name itself (onnxruntime-extensions' PyPI build needs
    /// libpython's symbols; no interpreter is started).
    #[serde(default)]
    pub preload: Vec<PathBuf>,
}

/// How a model's MatMuls run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// As the file says.
    #[default]
    Fp32,
    /// Weights of every MatMul quantised to int8 per output column, activations quantised at
    /// run time (ONNX Runtime's DynamicQuantizeMatMul), prepared by inferd and checked against
    /// fp32 by the accuracy guard; refused, with the figures, when the guard cannot pass.
    Int8,
    /// Int8 when the guard passes and int8 is faster on this CPU, else fp32.
    Auto,
}

/// The accuracy guard of int8 (see [`Precision::Int8`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Quantization {
    /// Embedding models: the least cosine between an int8 and the fp32 embedding of any
    /// calibration text.
    pub min_cosine: f64,
    /// Classifiers: the largest difference of any class probability to fp32.
    pub max_probability_error: f64,
    /// Raw models: the largest relative error of any float output, |int8 - fp32| / |fp32|
    /// over the output tensor (L2 norms).
    pub max_relative_error: f64,
    /// The user's own calibration inputs, one per line, used with the built-in ones (relative
    /// to the model's folder in model.toml; absolute once loaded): texts for text models, image
    /// files (relative to this file's folder) for image models, KServe v2 inference requests
    /// (JSON) for raw models.
    pub calibration: Option<PathBuf>,
}

impl Default for Quantization {
    fn default() -> Self {
        Quantization { min_cosine: 0.99, max_probability_error: 0.02, max_relative_error: 0.05, calibration: None }
    }
}

/// A model.toml (or `--model` setting) whose values cannot work, alone or together; the
/// message names the keys. Reported as the model's error ([`crate::ConfigError::Model`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SettingsError {
    #[error("quantization.{key} = {value} is not in (0, 1]")]
    Bound { key: &'static str, value: f64 },
    #[error("batching.max_batch_tokens must be at least 1")]
    NoBatchTokens,
    #[error(
        "batching.max_queue_delay_ms = {0} is more than {MAX_QUEUE_DELAY_MS}; a request should wait \
         milliseconds for company, not seconds"
    )]
    QueueDelay(u64),
    /// Sections that do not go with the task, or a value that cannot be 0: the message says
    /// which, in one sentence written where it is checked.
    #[error("{0}")]
    Sections(&'static str),
    #[error("embedding.chunk_overlap = {overlap} must be under half of tokenizer.max_length = {max_length}")]
    ChunkOverlap { overlap: usize, max_length: usize },
    #[error("embedding.max_chunked_tokens = {chunked} is less than tokenizer.max_length = {max_length}")]
    ChunkedTokens { chunked: usize, max_length: usize },
    #[error(
        "image.shortest_edge = {edge} must be between the crop's larger side ({larger}) and image.max_side ({max_side})"
    )]
    ShortestEdge { edge: u32, larger: u32, max_side: u32 },
    #[error(
        "embedding.colbert.{key} = {value} must be from {least} (a marker and the special tokens) to \
         tokenizer.max_length = {max_length}"
    )]
    ColbertLength { key: &'static str, value: usize, least: usize, max_length: usize },
}

/// A `--precision` or `precision` that is none of fp32, int8 and auto.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{0}': use fp32, int8 or auto")]
pub struct UnknownPrecision(pub String);

impl Quantization {
    /// Every bound in (0, 1].
    pub(super) fn check(&self) -> Result<(), SettingsError> {
        for (key, value) in [
            ("min_cosine", self.min_cosine),
            ("max_probability_error", self.max_probability_error),
            ("max_relative_error", self.max_relative_error),
        ] {
            if !(value > 0.0 && value <= 1.0) {
                return Err(SettingsError::Bound { key, value });
            }
        }
        Ok(())
    }
}

fn default_version() -> String {
    "1".into()
}

pub(super) fn yes() -> bool {
    true
}

fn default_file() -> PathBuf {
    PathBuf::from("model.onnx")
}

/// The runs a worker makes before it takes traffic, so that no request pays for ONNX
/// Runtime's first-run work.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Warmup {
    /// false: no warm-up run (the first requests pay for what it would have done).
    pub enabled: bool,
    /// One run per size: the first dimension of every input.
    pub batch_sizes: Vec<usize>,
    /// Every other dynamic dimension.
    pub dynamic_dim: usize,
    /// A value for every element of an input, by the input's name, instead of zeros (empty
    /// strings, false): a graph that cannot take zeros (strings of digits cast to numbers,
    /// indices into a table) warms up on values it can. Triton's `model_warmup` input data.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub inputs: BTreeMap<String, serde_json::Value>,
}

impl Default for Warmup {
    fn default() -> Self {
        Warmup { enabled: true, batch_sizes: vec![1, 4], dynamic_dim: 16, inputs: BTreeMap::new() }
    }
}

/// Dynamic batching in the worker's engine: requests for the same model that wait in the
/// queue run as one ONNX Runtime call, and a request past the limits runs in pieces of fewer
/// rows. Both need the first dimension to be a batch (each row answered on its own): only a
/// model whose inputs and outputs all have a dynamic first dimension of one name may have one,
/// and it does where model.toml says so (`max_batch_size` >= 1), or says nothing and inferd
/// builds the rows itself (a tokenizer or an image pipeline), or the graph names the dimension
/// as a batch (see the worker's `ModelMeta::batch_rows`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Batching {
    /// Most rows in one run; 1 = every request runs alone (and a request of many rows in pieces
    /// of one); 0 = the model has no batch dimension (Triton's `max_batch_size: 0`): a request
    /// always runs whole and alone. Unset: [`DEFAULT_MAX_BATCH_SIZE`] where the first dimension
    /// is a batch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_batch_size: Option<usize>,
    /// Text models: most rows x padded sequence length in one run, so one long text does not
    /// inflate a batch of short ones.
    pub max_batch_tokens: usize,
    /// How long the oldest waiting request may be held back for more to arrive. 0 = batch only
    /// what is already waiting, so an idle server adds no latency.
    pub max_queue_delay_ms: u64,
    /// Most requests for this model waiting in the pool's queues together (not running); one
    /// more is answered 503 with Retry-After at once, as Triton's `max_queue_size`. 0 = no
    /// limit of its own (`server.max_queue` bounds every model's together, per worker).
    pub max_queue_size: usize,
}

/// The longest `max_queue_delay_ms` accepted: batching is for milliseconds, not seconds.
pub const MAX_QUEUE_DELAY_MS: u64 = 1000;

/// A batch model's `max_batch_size` when model.toml does not say.
pub const DEFAULT_MAX_BATCH_SIZE: usize = 32;

impl Default for Batching {
    fn default() -> Self {
        Batching { max_batch_size: None, max_batch_tokens: 512, max_queue_delay_ms: 0, max_queue_size: 0 }
    }
}

impl Precision {
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Int8 => "int8",
            Precision::Auto => "auto",
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = UnknownPrecision;
    fn from_str(s: &str) -> Result<Precision, UnknownPrecision> {
        match s {
            "fp32" => Ok(Precision::Fp32),
            "int8" => Ok(Precision::Int8),
            "auto" => Ok(Precision::Auto),
            _ => Err(UnknownPrecision(s.to_string())),
        }
    }
}

impl Batching {
    pub(super) fn check(&self) -> Result<(), SettingsError> {
        if self.max_batch_tokens == 0 {
            return Err(SettingsError::NoBatchTokens);
        }
        if self.max_queue_delay_ms > MAX_QUEUE_DELAY_MS {
            return Err(SettingsError::QueueDelay(self.max_queue_delay_ms));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TokenizerFile {
    pub(super) file: PathBuf,
    #[serde(default = "default_max_length")]
    pub(super) max_length: usize,
}

fn default_max_length() -> usize {
    512
}

/// What the model is for; decides which endpoints serve it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Task {
    /// Tensors in, tensors out (KServe v2 only).
    #[default]
    Raw,
    /// Text in, one vector per text out (`/embed`).
    Embedding,
    /// Text or an image in, labels with scores out (`/predict`).
    Classification,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerConfig {
    /// Absolute path of `tokenizer.json`.
    pub path: PathBuf,
    pub max_length: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// Mean of the token vectors, padding excluded.
    #[default]
    Mean,
    /// The first token's vector.
    Cls,
    /// The largest value of each dimension over the tokens, padding excluded.
    Max,
    /// The last token's vector (decoder models, whose last token has seen the whole text).
    LastToken,
    /// SPLADE over a masked-LM's logits `[batch, sequence, vocabulary]`: per vocabulary
    /// entry, the largest `log(1 + relu(logit))` over the tokens; a sparse vector
    /// (`/embed_sparse`).
    Splade,
    /// No pooling: a vector per token, ColBERT's late interaction (`[embedding.colbert]`; the
    /// OpenAI route's `is_query`, as PyLate's server).
    Colbert,
    /// BGE-M3 (FlagEmbedding's `BGEM3FlagModel`): from one run, the first token's vector
    /// (dense), per token id the largest `relu(sparse_linear(state))` (lexical weights) and
    /// `colbert_linear(state)` of every token after the first (ColBERT vectors); its heads in
    /// `[embedding.bge_m3]`.
    BgeM3,
}

impl Pooling {
    pub fn as_str(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Max => "max",
            Pooling::LastToken => "last_token",
            Pooling::Splade => "splade",
            Pooling::Colbert => "colbert",
            Pooling::BgeM3 => "bge_m3",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EmbeddingConfig {
    pub pooling: Pooling,
    pub normalize: bool,
    /// Output holding the token vectors `[batch, sequence, dim]` (or already pooled
    /// `[batch, dim]`); default the first output.
    pub output: Option<String>,
    /// Trained so that the first N dimensions are an embedding too (Matryoshka): requests may
    /// ask for fewer dimensions (OpenAI's `dimensions`).
    pub matryoshka: bool,
    /// Texts put before the input, by name (sentence-transformers' `prompts`, e5's
    /// `query: `): a request names one with `prompt_name`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub prompts: BTreeMap<String, String>,
    /// The prompt of requests that name none; absent: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_prompt: Option<String>,
    /// A text longer than `tokenizer.max_length` in a request that does not ask to truncate:
    /// refused (the default), truncated, or embedded whole in windows ([`LongTexts`]).
    pub long_texts: LongTexts,
    /// With `long_texts = "chunk"`: tokens each window shares with the one before.
    pub chunk_overlap: usize,
    /// With `long_texts = "chunk"`: how the windows' embeddings become the text's.
    pub chunk_pooling: ChunkPooling,
    /// With `long_texts = "chunk"`: tokens one request may have embedded in all (413 beyond).
    pub max_chunked_tokens: usize,
    /// Linear layers applied after pooling, in order, before normalisation
    /// (sentence-transformers' `Dense` modules).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub dense: Vec<DenseLayer>,
    /// With `pooling = "colbert"`: how queries and documents are marked, cut and expanded
    /// (PyLate's config_sentence_transformers.json); its defaults where absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub colbert: Option<ColbertConfig>,
    /// With `pooling = "bge_m3"`: its two heads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bge_m3: Option<BgeM3Config>,
}

/// BGE-M3's heads as FlagEmbedding saves them (`colbert_linear.pt`, `sparse_linear.pt`, each a
/// `torch.nn.Linear`), converted to safetensors (`weight` `[out, in]` and `bias`): inferd does
/// not read pickles.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BgeM3Config {
    /// hidden -> ColBERT vector, relative to the model's folder (absolute once read).
    pub colbert_linear: PathBuf,
    /// hidden -> one weight per token.
    pub sparse_linear: PathBuf,
    /// Tokens that get no lexical weight (FlagEmbedding's: the tokenizer's cls, eos, pad and
    /// unk tokens, those it has).
    #[serde(default)]
    pub unused_tokens: Vec<String>,
}

/// ColBERT's recipe as PyLate states it in a model's config_sentence_transformers.json: a
/// marker token after the first token (`[CLS]`), texts cut to `query_length` /
/// `document_length` tokens with it, queries padded to `query_length` with the mask token
/// (query expansion), and the documents' tokens of `skiplist_words` (punctuation) left out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ColbertConfig {
    /// The token put after a query's first token; empty: none.
    pub query_prefix: String,
    /// The token put after a document's first token; empty: none.
    pub document_prefix: String,
    /// A query's tokens, with its marker and special tokens.
    pub query_length: usize,
    /// The most tokens of a document, with its marker and special tokens.
    pub document_length: usize,
    /// Queries padded to `query_length` with `mask_token`, whose vectors are kept.
    pub do_query_expansion: bool,
    /// Whether the model attends to the expansion tokens (their attention mask 1).
    pub attend_to_expansion_tokens: bool,
    /// Tokens whose vectors a document leaves out (PyLate's default: each of Python's
    /// `string.punctuation`).
    pub skiplist_words: Vec<String>,
    /// The token queries are expanded with (tokenizer_config.json's `mask_token`).
    pub mask_token: String,
}

impl Default for ColbertConfig {
    fn default() -> Self {
        ColbertConfig {
            query_prefix: "[unused0]".into(),
            document_prefix: "[unused1]".into(),
            query_length: 32,
            document_length: 180,
            do_query_expansion: true,
            attend_to_expansion_tokens: false,
            skiplist_words: "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~".chars().map(String::from).collect(),
            mask_token: "[MASK]".into(),
        }
    }
}

/// One linear layer after pooling: `activation(W x + b)`, its weights in a safetensors file
/// (`linear.weight` `[out, in]`, and `linear.bias` `[out]` where it has one), as
/// sentence-transformers saves a `Dense` module.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DenseLayer {
    /// The safetensors file, relative to the model's folder (absolute once read).
    pub file: PathBuf,
    #[serde(default)]
    pub activation: DenseActivation,
}

/// What a Dense layer applies to its sums (sentence-transformers' `activation_function`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DenseActivation {
    /// `torch.nn.Identity`: the sums as they are.
    #[default]
    Identity,
    Tanh,
    Relu,
    Sigmoid,
    /// `torch.nn.GELU` (the exact one, with erf).
    Gelu,
}

/// What becomes of a text longer than the model takes ([`EmbeddingConfig::long_texts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LongTexts {
    /// Refused with 413, unless the request sends `"truncate": true` (TEI's behaviour).
    #[default]
    Refuse,
    /// Cut at the model's length, whatever the request says (TEI's `--auto-truncate`).
    Truncate,
    /// Unless the request asks to truncate: cut into windows of the model's length, embedded
    /// in one batch and pooled into one embedding (normalized after pooling when the model
    /// normalizes), as vLLM's pooling server does.
    Chunk,
}

/// How the windows of a chunked text are pooled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChunkPooling {
    /// The mean of the windows' embeddings, each weighted by its tokens (vLLM's).
    #[default]
    Mean,
    /// The largest value of each dimension over the windows.
    Max,
}

impl Default for EmbeddingConfig {
    fn default() -> Self {
        EmbeddingConfig {
            pooling: Pooling::Mean,
            normalize: true,
            output: None,
            matryoshka: false,
            prompts: BTreeMap::new(),
            default_prompt: None,
            long_texts: LongTexts::Refuse,
            chunk_overlap: 0,
            chunk_pooling: ChunkPooling::Mean,
            max_chunked_tokens: 8192,
            dense: Vec::new(),
            colbert: None,
            bge_m3: None,
        }
    }
}

impl EmbeddingConfig {
    /// The text to put before an input: the prompt `name`, else the default one.
    pub fn prompt(&self, name: Option<&str>) -> Result<Option<&str>, String> {
        match name.or(self.default_prompt.as_deref()) {
            None => Ok(None),
            Some(name) => self.prompts.get(name).map(|p| Some(p.as_str())).ok_or_else(|| match self.prompts.len() {
                0 => format!("prompt '{name}' is not one of the model's: it has none"),
                _ => format!(
                    "prompt '{name}' is not one of the model's ({})",
                    self.prompts.keys().map(String::as_str).collect::<Vec<_>>().join(", ")
                ),
            }),
        }
    }
}

/// What turns the classification output into scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    Softmax,
    Sigmoid,
    /// The output is the scores already (the graph ends in its own Softmax or Sigmoid).
    #[serde(rename = "none")]
    AsIs,
}

impl Activation {
    pub fn as_str(self) -> &'static str {
        match self {
            Activation::Softmax => "softmax",
            Activation::Sigmoid => "sigmoid",
            Activation::AsIs => "none",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassificationConfig {
    pub labels: Vec<String>,
    /// Absent: chosen from the graph when the model loads (an output the graph's own Softmax
    /// or Sigmoid produced is not activated again; see the worker's pipeline).
    #[serde(default)]
    pub activation: Option<Activation>,
    /// Output holding the logits `[batch, labels]`; default the first output.
    #[serde(default)]
    pub output: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChannelOrder {
    #[default]
    #[serde(rename = "RGB")]
    Rgb,
    #[serde(rename = "BGR")]
    Bgr,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Layout {
    #[default]
    #[serde(rename = "NCHW")]
    Nchw,
    #[serde(rename = "NHWC")]
    Nhwc,
}

/// How an image is brought to the model's `width` x `height`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resize {
    /// The whole image to `width` x `height`, its aspect ratio not kept.
    #[default]
    Stretch,
    /// As Hugging Face's image processors (`size.shortest_edge`, `do_center_crop`): the
    /// shorter side to `shortest_edge`, the longer one in proportion (rounded down), then the
    /// centre `width` x `height` cut out.
    ShortestEdge,
}

/// The resampling filter of the resize (Pillow's names; `preprocessor_config.json`'s
/// `resample` 0 = nearest, 2 = bilinear, 3 = bicubic, 1 = lanczos).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resample {
    Nearest,
    #[default]
    Bilinear,
    Bicubic,
    Lanczos,
}

/// How an encoded image becomes the model's input: decoded (PNG, JPEG), converted to three
/// channels, resized to `width` x `height` (see [`Resize`], [`Resample`]), then
/// `(pixel * scale - mean) / std` per channel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageConfig {
    /// Model input fed with the image; default the first input.
    #[serde(default)]
    pub input: Option<String>,
    pub width: u32,
    pub height: u32,
    #[serde(default)]
    pub channels: ChannelOrder,
    #[serde(default)]
    pub layout: Layout,
    #[serde(default = "default_scale")]
    pub scale: f32,
    #[serde(default = "default_mean")]
    pub mean: [f32; 3],
    #[serde(default = "default_std")]
    pub std: [f32; 3],
    /// Encoded images with more pixels than this are refused (413) before decoding.
    #[serde(default = "default_max_pixels")]
    pub max_pixels: u64,
    /// Encoded images wider or taller than this are refused (413) before decoding: the
    /// resize's intermediate buffer grows with the source's width times the model's height,
    /// whatever the pixel count (a 39,000,000 x 1 image would need 140 GB).
    #[serde(default = "default_max_side")]
    pub max_side: u32,
    #[serde(default)]
    pub resize: Resize,
    /// With `resize = "shortest_edge"`: what the shorter side is resized to before the crop;
    /// default (and at least) the larger of `width` and `height`.
    #[serde(default)]
    pub shortest_edge: Option<u32>,
    #[serde(default)]
    pub resample: Resample,
}

impl ImageConfig {
    /// The size an image of `width` x `height` is resized to, before any crop.
    pub fn resized_size(&self, width: u32, height: u32) -> (u32, u32) {
        match self.resize {
            Resize::Stretch => (self.width, self.height),
            Resize::ShortestEdge => {
                let short = u64::from(self.shortest_edge.unwrap_or(self.width.max(self.height)));
                let (w, h) = (u64::from(width.max(1)), u64::from(height.max(1)));
                // The longer side in proportion, rounded down as Hugging Face's int() does.
                let long = |long: u64, short_side: u64| u32::try_from(short * long / short_side).unwrap_or(u32::MAX);
                let short = u32::try_from(short).unwrap_or(u32::MAX);
                if w <= h {
                    (short, long(h, w))
                } else {
                    (long(w, h), short)
                }
            }
        }
    }
}

fn default_scale() -> f32 {
    1.0 / 255.0
}

fn default_mean() -> [f32; 3] {
    [0.0; 3]
}

fn default_std() -> [f32; 3] {
    [1.0; 3]
}

fn default_max_pixels() -> u64 {
    40_000_000
}

fn default_max_side() -> u32 {
    16_384
}

/// The combinations of sections that make sense, and values that cannot work.
pub(super) fn check_pipeline(
    task: Task,
    tokenizer: &Option<TokenizerConfig>,
    embedding: &Option<EmbeddingConfig>,
    classification: &Option<ClassificationConfig>,
    image: &Option<ImageConfig>,
) -> Result<(), SettingsError> {
    match task {
        Task::Raw => {
            if tokenizer.is_some() || image.is_some() || embedding.is_some() || classification.is_some() {
                return Err(SettingsError::Sections(
                    "task = \"raw\" takes no [tokenizer], [image], [embedding] or [classification] \
                            section; set task",
                ));
            }
        }
        Task::Embedding => {
            if tokenizer.is_none() {
                return Err(SettingsError::Sections("task = \"embedding\" needs a [tokenizer] section"));
            }
            if image.is_some() || classification.is_some() {
                return Err(SettingsError::Sections(
                    "task = \"embedding\" takes no [image] or [classification] section",
                ));
            }
            if let (Some(e), Some(t)) = (embedding, tokenizer) {
                if e.colbert.is_some() && e.pooling != Pooling::Colbert {
                    return Err(SettingsError::Sections("[embedding.colbert] goes with pooling = \"colbert\""));
                }
                if e.bge_m3.is_some() != (e.pooling == Pooling::BgeM3) {
                    return Err(SettingsError::Sections(
                        "pooling = \"bge_m3\" and an [embedding.bge_m3] section naming its heads go together",
                    ));
                }
                if e.pooling == Pooling::BgeM3 && (e.long_texts == LongTexts::Chunk || !e.dense.is_empty()) {
                    return Err(SettingsError::Sections(
                        "pooling = \"bge_m3\" has its own heads: no [[embedding.dense]] and no long_texts = \"chunk\"",
                    ));
                }
                if e.pooling == Pooling::Colbert {
                    if e.long_texts == LongTexts::Chunk {
                        return Err(SettingsError::Sections(
                            "pooling = \"colbert\" cuts texts at its own lengths: long_texts = \"chunk\" does not apply",
                        ));
                    }
                    let c = e.colbert.clone().unwrap_or_default();
                    for (key, value) in [("query_length", c.query_length), ("document_length", c.document_length)] {
                        if !(4..=t.max_length).contains(&value) {
                            return Err(SettingsError::ColbertLength {
                                key,
                                value,
                                least: 4,
                                max_length: t.max_length,
                            });
                        }
                    }
                }
                if e.long_texts == LongTexts::Chunk {
                    if e.chunk_overlap.saturating_mul(2) >= t.max_length {
                        return Err(SettingsError::ChunkOverlap { overlap: e.chunk_overlap, max_length: t.max_length });
                    }
                    if e.max_chunked_tokens < t.max_length {
                        return Err(SettingsError::ChunkedTokens {
                            chunked: e.max_chunked_tokens,
                            max_length: t.max_length,
                        });
                    }
                }
            }
        }
        Task::Classification => {
            let Some(c) = classification else {
                return Err(SettingsError::Sections(
                    "task = \"classification\" needs a [classification] section with labels",
                ));
            };
            if c.labels.is_empty() {
                return Err(SettingsError::Sections("classification.labels must not be empty"));
            }
            if tokenizer.is_some() == image.is_some() {
                return Err(SettingsError::Sections(
                    "task = \"classification\" needs exactly one of [tokenizer] (text) or [image]",
                ));
            }
            if embedding.is_some() {
                return Err(SettingsError::Sections("task = \"classification\" takes no [embedding] section"));
            }
        }
    }
    if let Some(i) = image {
        if i.width == 0 || i.height == 0 {
            return Err(SettingsError::Sections("image.width and image.height must be at least 1"));
        }
        if i.std.iter().any(|s| *s == 0.0 || !s.is_finite()) || i.mean.iter().any(|m| !m.is_finite()) {
            return Err(SettingsError::Sections("image.std must be non-zero and image.mean finite"));
        }
        if i.max_pixels == 0 {
            return Err(SettingsError::Sections("image.max_pixels must be at least 1"));
        }
        if i.max_side == 0 {
            return Err(SettingsError::Sections("image.max_side must be at least 1"));
        }
        match (i.resize, i.shortest_edge) {
            (Resize::Stretch, Some(_)) => {
                return Err(SettingsError::Sections("image.shortest_edge needs image.resize = \"shortest_edge\""));
            }
            (Resize::ShortestEdge, Some(edge)) if edge < i.width.max(i.height) || edge > i.max_side => {
                return Err(SettingsError::ShortestEdge { edge, larger: i.width.max(i.height), max_side: i.max_side });
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shortest_edge_is_resized_as_hugging_face_does() {
        let mut c: ImageConfig =
            toml::from_str("width = 224\nheight = 224\nresize = \"shortest_edge\"\nshortest_edge = 256\n").unwrap();
        // The longer side in proportion, rounded down: 256 * 500 / 333 = 384.38.
        assert_eq!(c.resized_size(500, 333), (384, 256));
        assert_eq!(c.resized_size(333, 500), (256, 384));
        assert_eq!(c.resized_size(1, 16_384), (256, 4_194_304));
        c.shortest_edge = None;
        assert_eq!(c.resized_size(400, 300), (298, 224), "default: the crop's larger side");
        c.resize = Resize::Stretch;
        assert_eq!(c.resized_size(400, 300), (224, 224));
    }
}
