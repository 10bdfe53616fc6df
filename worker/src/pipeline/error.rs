//! What goes wrong in a pipeline: a request's input it cannot take, or the model's output it
//! cannot read ([`PipelineError`]), and a model.toml whose pipeline does not fit its model
//! ([`BuildError`]).

use super::text_bound::BYTES_PER_TOKEN;

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
    /// One vector per text asked of a ColBERT model, which gives one per token.
    #[error(
        "the model gives a vector per token (pooling = \"colbert\"), not one per text: ask POST /v1/embeddings, with \"is_query\" true for queries and false for documents"
    )]
    PerToken,
    /// One vector per text asked of a BGE-M3 model, which gives three kinds at once.
    #[error(
        "the model gives BGE-M3's three outputs (pooling = \"bge_m3\"): ask POST /encode (or /v2/models/NAME/encode) for them"
    )]
    ThreeOutputs,
}

/// Why model.toml's pipeline does not fit the model it names: the model is refused when it
/// loads, with this message after "model.toml: ".
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("a classification model needs [tokenizer] or [image]")]
    NoPipeline,
    #[error(
        "BGE-M3's heads do not fit together: colbert_linear takes {:?} and gives {:?}, sparse_linear takes {:?} and gives {:?} (it must give 1, and take what colbert_linear takes)",
        colbert.0, colbert.1, sparse.0, sparse.1
    )]
    BgeM3Heads { colbert: (Option<usize>, Option<usize>), sparse: (Option<usize>, Option<usize>) },
    #[error("embedding.bge_m3.unused_tokens: '{0}' is not a token of the model's tokenizer")]
    UnusedToken(String),
    #[error("embedding.colbert.{key} = '{token}' is not a token of the model's tokenizer")]
    ColbertToken { key: &'static str, token: String },
    #[error("output '{name}' is {datatype} {shape:?}; a vector per token (pooling = \"colbert\" or \"bge_m3\") needs FP32 [batch, sequence, dim]")]
    ColbertOutput { name: String, datatype: String, shape: Vec<i64> },
    #[error("output '{name}' is not an output of the model ({})", outputs.join(", "))]
    NotAnOutput { name: String, outputs: Vec<String> },
    #[error("the model has no outputs")]
    NoOutputs,
    #[error("output '{name}' is {datatype} {shape:?}; embeddings need FP32 [batch, sequence, dim] or [batch, dim]")]
    EmbeddingOutput { name: String, datatype: String, shape: Vec<i64> },
    #[error("output '{name}' is {datatype} {shape:?}; classification needs FP32 [batch, labels]")]
    ClassificationOutput { name: String, datatype: String, shape: Vec<i64> },
    #[error("{labels} labels, but output '{output}' has {logits} logits per row")]
    LabelCount { labels: usize, output: String, logits: i64 },
    /// What computes an output could not be read from the model file.
    #[error("{0}")]
    Producer(#[from] crate::onnx::OnnxError),
    #[error("tokenizer {}: {error}", path.display())]
    Tokenizer { path: std::path::PathBuf, error: tokenizers::Error },
    #[error("{0}")]
    Truncation(tokenizers::Error),
    #[error("input '{0}' is not one the text pipeline produces (input_ids, attention_mask, token_type_ids)")]
    NotAFeed(String),
    #[error("input '{name}' is {datatype} {shape:?}; the text pipeline feeds INT64 or INT32 [batch, sequence]")]
    TextInput { name: String, datatype: String, shape: Vec<i64> },
    #[error("the model has no input 'input_ids' for the tokenizer to feed")]
    NoInputIds,
    #[error("{0}")]
    Dense(#[from] super::dense::DenseError),
    #[error("an image model must have exactly one input, this one has {0}")]
    ImageInputs(usize),
    #[error("image.input '{0}' is not an input")]
    NotAnInput(String),
    #[error(
        "input '{name}' is {datatype} {shape:?}; image settings ({width}x{height}, {layout:?}) need FP32 {want:?}"
    )]
    ImageInput {
        name: String,
        datatype: String,
        shape: Vec<i64>,
        width: u32,
        height: u32,
        layout: inferd_config::model::Layout,
        want: [i64; 4],
    },
}
