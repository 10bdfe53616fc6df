//! The model repository: `<repository>/<name>/model.toml` next to the model file; a folder
//! without model.toml is read from the files its publisher put there ([`published`]).
//!
//! ```toml
//! name = "minilm"        # must match the folder name
//! version = "1"          # free-form label shown in status and metadata
//! file = "model.onnx"    # relative to the model's folder
//! task = "embedding"     # "raw" (default) | "embedding" | "classification"
//! share_weights = true   # one optimised copy of the weights for every session (runtime.cache_dir)
//! precision = "fp32"     # "fp32" | "int8" | "auto": see [`Precision`], [`Quantization`]
//! [warmup]
//! batch_sizes = [1, 4]   # warm-up runs, one per batch size
//! dynamic_dim = 16       # value used for every other dynamic dimension
//! [tokenizer]            # text models
//! file = "tokenizer.json"
//! max_length = 256       # tokens, special tokens included
//! [embedding]            # task = "embedding"
//! pooling = "mean"       # "mean" | "max" (over the attention mask) | "cls" | "last_token" | "splade"
//! normalize = true       # L2; the default for requests that do not say
//! matryoshka = false     # true: a prefix of the vector is an embedding too (`dimensions`)
//! default_prompt = "query"  # optional: the prompt of requests that name none
//! [embedding.prompts]    # optional: text put before an input, chosen by `prompt_name`
//! query = "query: "
//! [classification]       # task = "classification"
//! labels = ["negative", "positive"]
//! activation = "softmax" # "softmax" | "sigmoid" | "none"; default: read from the graph
//! [image]                # image models: see [`ImageConfig`]
//! [quantization]         # the accuracy guard of int8; defaults shown
//! min_cosine = 0.99      # embeddings: least cosine to fp32 over the calibration texts
//! max_probability_error = 0.02  # classifiers: largest probability difference to fp32
//! max_relative_error = 0.05     # raw models: largest relative (L2) error of an output
//! calibration = "inputs.txt"    # optional: your own inputs, one per line, added to the built-in set
//! [custom_ops]           # optional: see [`CustomOps`]
//! library = "libortextensions.so"
//! preload = []
//! [batching]             # see [`Batching`]; defaults shown
//! max_batch_size = 32    # rows in one ORT run; 1 switches batching off; 0: no batch dimension
//!                        # (unset: 32 where the first dimension is a batch, see [`Batching`])
//! max_batch_tokens = 512 # text: rows x padded length in one run
//! max_queue_delay_ms = 0 # how long a request may wait for company; 0 = only what already waits
//! max_queue_size = 0     # requests of this model waiting at most (then 503); 0 = server.max_queue only
//! ```
//!
//! What can be checked without the model is checked here; whether the pipeline fits the
//! model's inputs and outputs is checked when a worker (or `inferd check`) loads it.
//!
//! Three parts, each using only those below it: the command line's settings over every model
//! (overrides.rs: [`ModelOverride`]), the repository loader (repository.rs: finding a model's
//! folder, reading its model.toml or inferring one from [`published`] files, resolving the
//! files it names into a [`ModelEntry`]) and the schema of model.toml (schema.rs: its
//! sections, their defaults and checks). All are used through this module's paths; this file
//! holds only what none of them uses.

mod overrides;
pub mod published;
mod repository;
mod schema;

pub use overrides::ModelOverride;
pub use repository::{ModelEntry, MODEL_CONFIG_FILE, SIGNATURE_FILE};
pub use schema::{
    Activation, Batching, BgeM3Config, ChannelOrder, ChunkPooling, ClassificationConfig, ColbertConfig, CustomOps,
    DenseActivation, DenseLayer, EmbeddingConfig, ImageConfig, Layout, LongTexts, Pooling, Precision, Quantization,
    Resample, Resize, SettingsError, Task, TokenizerConfig, UnknownPrecision, Warmup, DEFAULT_MAX_BATCH_SIZE,
    MAX_QUEUE_DELAY_MS,
};
