//! Model folders as their publishers lay them out, served without a model.toml.
//!
//! A Hugging Face, sentence-transformers or optimum export carries what a model.toml would
//! say in its own files: `config.json` (architecture, `id2label`, `problem_type`,
//! `max_position_embeddings`), `modules.json` with `1_Pooling/config.json` (pooling,
//! Normalize), `sentence_bert_config.json` and `tokenizer_config.json` (the longest input),
//! `config_sentence_transformers.json` (prompts), `preprocessor_config.json` (image size,
//! resize, crop, filter, mean/std) and `model.onnx` or `onnx/model.onnx`. [`infer`] turns
//! them into the model.toml they amount to, each value commented with the file it came from;
//! the folder's model is then read from that text exactly as from a user's model.toml, so
//! `inferd init` (which saves it) and `inferd check` (which prints it) show what is served.
//!
//! What cannot be told from the files (several ONNX files, a Dense layer outside the graph,
//! a pooling inferd does not have) is refused with what to write instead.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::ColbertConfig;

/// The largest settings file read (`tokenizer_config.json` of a large vocabulary is the
/// biggest of them, a few hundred KB).
const JSON_LIMIT: u64 = 8 << 20;

/// Why a folder without model.toml cannot be served from its publisher's files.
#[derive(Debug, thiserror::Error)]
pub enum PublishedError {
    #[error(
        "{} has no model.toml and several ONNX files ({}): write one whose `file` names the one to serve \
         (`inferd init {} --file NAME`)",
        dir.display(),
        files.join(", "),
        dir.display()
    )]
    SeveralModels { dir: PathBuf, files: Vec<String> },
    #[error("{} has no model.toml and no ONNX file (model.onnx, onnx/model.onnx) to serve without one", dir.display())]
    NoModel { dir: PathBuf },
    #[error("{file} is {bytes} bytes; a settings file may have at most {JSON_LIMIT}")]
    TooLarge { file: String, bytes: u64 },
    #[error("cannot read {}: {error}", path.display())]
    Read { path: PathBuf, error: std::io::Error },
    #[error("{file}: {error}")]
    Json { file: String, error: serde_json::Error },
    /// What a settings file says that inferd cannot read or serve, naming the file and the
    /// key, and what to write instead: one sentence per case, each written where it is found
    /// (from a `String` or `&str`, so `?` and `.into()` make one).
    #[error("{0}")]
    Unservable(String),
}

impl From<String> for PublishedError {
    fn from(message: String) -> PublishedError {
        PublishedError::Unservable(message)
    }
}

impl From<&str> for PublishedError {
    fn from(message: &str) -> PublishedError {
        PublishedError::Unservable(message.into())
    }
}

/// The folders an export puts its ONNX file in.
const MODEL_FOLDERS: [&str; 2] = ["", "onnx"];

/// The ONNX file of a folder without model.toml: `model.onnx`, `onnx/model.onnx`, else the
/// only `.onnx` file of those two folders. `Ok(None)`: there is none.
pub fn model_file(dir: &Path) -> Result<Option<String>, PublishedError> {
    for candidate in ["model.onnx", "onnx/model.onnx"] {
        if dir.join(candidate).is_file() {
            return Ok(Some(candidate.into()));
        }
    }
    let mut found = Vec::new();
    for folder in MODEL_FOLDERS {
        let Ok(entries) = std::fs::read_dir(dir.join(folder)) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".onnx") && entry.path().is_file() {
                found.push(if folder.is_empty() { name } else { format!("{folder}/{name}") });
            }
        }
    }
    found.sort();
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(PublishedError::SeveralModels { dir: dir.to_path_buf(), files: found }),
    }
}

/// A settings file of the folder, parsed; None when it is not there.
fn json(dir: &Path, file: &str) -> Result<Option<Value>, PublishedError> {
    let path = dir.join(file);
    let Ok(meta) = std::fs::metadata(&path) else { return Ok(None) };
    if !meta.is_file() {
        return Ok(None);
    }
    if meta.len() > JSON_LIMIT {
        return Err(PublishedError::TooLarge { file: file.to_string(), bytes: meta.len() });
    }
    let text = std::fs::read_to_string(&path).map_err(|error| PublishedError::Read { path: path.clone(), error })?;
    serde_json::from_str(&text).map(Some).map_err(|error| PublishedError::Json { file: file.to_string(), error })
}

/// model.toml text: keys with the reason for each, in sections.
#[derive(Default)]
struct TomlText(String);

impl TomlText {
    fn key(&mut self, key: &str, value: impl Into<toml::Value>, why: &str) {
        let value = value.into().to_string();
        let _ = match why.is_empty() {
            true => writeln!(self.0, "{} = {value}", bare_or_quoted(key)),
            false => writeln!(self.0, "{} = {value}  # {why}", bare_or_quoted(key)),
        };
    }

    fn section(&mut self, name: &str) {
        let _ = writeln!(self.0, "\n[{name}]");
    }
}

fn bare_or_quoted(key: &str) -> String {
    let bare = !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare {
        key.to_string()
    } else {
        toml::Value::String(key.into()).to_string()
    }
}

/// What a folder's files say about the model.
struct Files {
    config: Option<Value>,
    modules: Option<Value>,
    preprocessor: Option<Value>,
    /// Relative to the folder.
    tokenizer: Option<String>,
}

/// The model.toml the files of `dir` amount to, for model `name`; `file`: the ONNX file to
/// serve (relative to `dir`), default [`model_file`]'s choice.
pub fn infer(dir: &Path, name: &str, file: Option<&str>) -> Result<String, PublishedError> {
    let file = match file {
        Some(f) => f.to_string(),
        None => model_file(dir)?.ok_or_else(|| PublishedError::NoModel { dir: dir.to_path_buf() })?,
    };
    let model_folder = Path::new(&file).parent().map(Path::to_path_buf).unwrap_or_default();
    let tokenizer = [PathBuf::new(), model_folder]
        .iter()
        .map(|folder| folder.join("tokenizer.json"))
        .find(|p| dir.join(p).is_file())
        .map(|p| p.to_string_lossy().into_owned());
    let files = Files {
        config: json(dir, "config.json")?,
        modules: json(dir, "modules.json")?,
        preprocessor: json(dir, "preprocessor_config.json")?,
        tokenizer,
    };
    let architecture = files
        .config
        .as_ref()
        .and_then(|c| c["architectures"].get(0))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();

    let mut t = TomlText::default();
    let _ = writeln!(
        t.0,
        "# Inferred by inferd from the files of {} (it has no model.toml); saved by `inferd init`,\n\
         # to be edited: a model.toml, where present, is read instead of these files.",
        dir.display()
    );
    t.key("name", name, "the folder's name");
    t.key("file", file.as_str(), "");
    let image = files.preprocessor.as_ref().filter(|p| is_image_processor(p));
    if let Some(preprocessor) = image {
        let labels = labels(&files)?.ok_or(
            "preprocessor_config.json describes images, but config.json has no id2label: inferd serves image \
             models as classifiers (write a model.toml with task = \"raw\" to serve its tensors)",
        )?;
        t.key("task", "classification", &why_architecture(&architecture, "an image processor and labels"));
        classification(&mut t, &files, labels);
        image_section(&mut t, preprocessor)?;
        return Ok(t.0);
    }
    let Some(tokenizer) = &files.tokenizer else {
        if dir.join("vocab.txt").is_file() || dir.join("sentencepiece.bpe.model").is_file() {
            return Err("the folder has a vocabulary but no tokenizer.json, the file inferd's tokenizer reads: save \
                        it with transformers' AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
                .into());
        }
        t.key("task", "raw", "no tokenizer.json or preprocessor_config.json: tensors in, tensors out");
        return Ok(t.0);
    };
    let classifier = architecture.ends_with("ForSequenceClassification")
        || (architecture.is_empty() && files.modules.is_none() && labels(&files)?.is_some());
    if classifier {
        let labels = labels(&files)?.ok_or(format!("config.json says {architecture}, but has no id2label"))?;
        t.key("task", "classification", &why_architecture(&architecture, "labels and a tokenizer"));
        tokenizer_section(&mut t, dir, &files, tokenizer)?;
        classification(&mut t, &files, labels);
        return Ok(t.0);
    }
    // sentence-transformers loads the base model whatever head config.json names (decoder
    // embedders say *ForCausalLM); without modules.json, a head is what the export computes.
    if files.modules.is_none() {
        if let Some((_, head)) = architecture.split_once("For") {
            return Err(format!(
                "config.json says {architecture}: a {head} head, which inferd does not serve from its files \
                 (it serves embeddings, classifiers, and SPLADE from a sentence-transformers folder); write a \
                 model.toml (task = \"raw\" serves its tensors)"
            )
            .into());
        }
    }
    let why = match &files.modules {
        Some(_) => "modules.json: a sentence-transformers model".to_string(),
        None => why_architecture(&architecture, "a tokenizer and no labels"),
    };
    t.key("task", "embedding", &why);
    tokenizer_section(&mut t, dir, &files, tokenizer)?;
    embedding_section(&mut t, dir, &files)?;
    Ok(t.0)
}

fn why_architecture(architecture: &str, otherwise: &str) -> String {
    match architecture {
        "" => otherwise.to_string(),
        a => format!("config.json: {a}"),
    }
}

fn is_image_processor(p: &Value) -> bool {
    ["image_processor_type", "feature_extractor_type", "image_mean", "crop_size"].iter().any(|k| p.get(k).is_some())
        && p.get("sampling_rate").is_none()
}

/// `config.json`'s `id2label` in id order; None when absent.
fn labels(files: &Files) -> Result<Option<Vec<String>>, PublishedError> {
    let Some(map) = files.config.as_ref().and_then(|c| c.get("id2label")).and_then(Value::as_object) else {
        return Ok(None);
    };
    let mut labels = vec![None; map.len()];
    for (id, label) in map {
        let slot = id.parse::<usize>().ok().and_then(|i| labels.get_mut(i)).ok_or(format!(
            "config.json: id2label has id '{id}'; ids must be 0 to {} with none missing",
            map.len().saturating_sub(1)
        ))?;
        *slot = Some(label.as_str().ok_or(format!("config.json: id2label[{id}] is not a string"))?.to_string());
    }
    Ok(Some(labels.into_iter().map(|l| l.expect("every id 0..n was seen once")).collect()))
}

fn classification(t: &mut TomlText, files: &Files, labels: Vec<String>) {
    let multi = files.config.as_ref().and_then(|c| c["problem_type"].as_str()) == Some("multi_label_classification");
    let single = labels.len() == 1;
    t.section("classification");
    t.key("labels", labels, "config.json: id2label");
    if multi {
        t.key("activation", "sigmoid", "config.json: problem_type = \"multi_label_classification\"");
    } else if single {
        t.key("activation", "sigmoid", "one label: a score of its own (a cross-encoder's relevance)");
    } else {
        let _ = writeln!(
            t.0,
            "# activation: none when the graph ends in Softmax or Sigmoid, else softmax (read from the graph)"
        );
    }
}

fn number(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

fn tokenizer_section(t: &mut TomlText, dir: &Path, files: &Files, tokenizer: &str) -> Result<(), PublishedError> {
    // sentence-transformers' own limit first; then the tokenizer's, within the positions the
    // model has (transformers writes 1e30 for "no limit").
    let st = json(dir, "sentence_bert_config.json")?.and_then(|c| number(&c, "max_seq_length"));
    let tok = json(dir, "tokenizer_config.json")?.and_then(|c| number(&c, "model_max_length")).filter(|n| *n < 1e9);
    let positions = files.config.as_ref().and_then(|c| number(c, "max_position_embeddings"));
    let (max, why) = match (st, tok, positions) {
        (Some(n), _, _) => (n, "sentence_bert_config.json: max_seq_length".to_string()),
        (None, Some(n), Some(p)) if p < n => (p, "config.json: max_position_embeddings".into()),
        (None, Some(n), _) => (n, "tokenizer_config.json: model_max_length".into()),
        (None, None, Some(p)) => (p, "config.json: max_position_embeddings".into()),
        (None, None, None) => (512.0, "no file states a limit".into()),
    };
    if !(2.0..=1e6).contains(&max) || max.fract() != 0.0 {
        return Err(format!("{why} = {max} is not a usable number of tokens").into());
    }
    t.section("tokenizer");
    t.key("file", tokenizer, "");
    t.key("max_length", max as i64, &why);
    Ok(())
}

fn embedding_section(t: &mut TomlText, dir: &Path, files: &Files) -> Result<(), PublishedError> {
    let mut pooling_dir = None;
    let mut splade_dir = None;
    let mut normalize = None;
    // Dense modules, in order: (folder, activation, where the activation came from).
    let mut dense = Vec::new();
    let st = json(dir, "config_sentence_transformers.json")?;
    // PyLate's ColBERT: its Dense modules project each token's vector, with no pooling.
    let colbert = files
        .modules
        .as_ref()
        .and_then(Value::as_array)
        .is_some_and(|list| list.iter().any(|m| m["type"].as_str().is_some_and(|t| t.starts_with("pylate."))))
        || st.as_ref().is_some_and(|c| c["model_type"] == "ColBERT");
    if let Some(modules) = &files.modules {
        let list = modules.as_array().ok_or("modules.json is not a list of modules")?;
        for module in list {
            let kind = module["type"].as_str().unwrap_or_default();
            let path = module["path"].as_str().unwrap_or_default();
            match kind.rsplit('.').next().unwrap_or_default() {
                "Transformer" | "MLMTransformer" => {}
                "Dense" if colbert => dense.push(dense_module(dir, path)?),
                "Pooling" => pooling_dir = Some(path.to_string()),
                "SpladePooling" => splade_dir = Some(path.to_string()),
                "Normalize" => normalize = Some(true),
                "Dense" if pooling_dir.is_none() || normalize.is_some() => {
                    return Err(format!(
                        "modules.json has a Dense module ('{path}') that is not between Pooling and Normalize: inferd \
                         applies Dense layers to the pooled vector, before normalising it"
                    )
                    .into())
                }
                "Dense" => dense.push(dense_module(dir, path)?),
                _ => {
                    return Err(format!(
                        "modules.json has {kind} ('{path}'), a layer applied after the model that inferd does \
                         not apply: export it into the ONNX graph, or write a model.toml"
                    )
                    .into())
                }
            }
        }
        normalize.get_or_insert(false);
    } else if dir.join("1_Pooling/config.json").is_file() {
        pooling_dir = Some("1_Pooling".into());
    }
    t.section("embedding");
    if dir.join("colbert_linear.pt").is_file() || dir.join("colbert_linear.safetensors").is_file() {
        return bge_m3_section(t, dir);
    }
    if colbert {
        return colbert_section(t, dir, st.unwrap_or(Value::Null), dense);
    }
    let config_of = |p: &str| format!("{}config.json", if p.is_empty() { String::new() } else { format!("{p}/") });
    match (splade_dir, pooling_dir) {
        (Some(_), Some(_)) => return Err("modules.json has both a Pooling and a SpladePooling module".into()),
        (Some(p), None) => {
            let file = config_of(&p);
            let config = json(dir, &file)?.unwrap_or(Value::Null);
            // sentence-transformers' defaults: max over the tokens of log(1 + relu).
            let strategy = config.get("pooling_strategy").and_then(Value::as_str).unwrap_or("max");
            let activation = config.get("activation_function").and_then(Value::as_str).unwrap_or("relu");
            if (strategy, activation) != ("max", "relu") {
                return Err(format!(
                    "{file}: pooling_strategy = {strategy}, activation_function = {activation}; inferd's SPLADE is \
                     max and relu"
                )
                .into());
            }
            t.key("pooling", "splade", &format!("modules.json: SpladePooling ({strategy} of log(1 + {activation}))"));
        }
        (None, Some(p)) => {
            let file = config_of(&p);
            let config = json(dir, &file)?
                .ok_or(format!("modules.json names a Pooling module in '{p}', but {file} is missing"))?;
            let (pooling, key) = pooling(&config).map_err(|e| format!("{file}: {e}"))?;
            t.key("pooling", pooling, &format!("{file}: {key}"));
        }
        (None, None) => t.key("pooling", "mean", "no pooling configuration: mean over the tokens"),
    }
    match normalize {
        Some(true) => t.key("normalize", true, "modules.json: sentence_transformers.models.Normalize"),
        Some(false) => t.key("normalize", false, "modules.json: no Normalize module"),
        None => t.key("normalize", true, "the default of /embed"),
    }
    if let Some(st) = &st {
        prompts_section(t, st)?;
    }
    dense_sections(t, dense);
    Ok(())
}

fn dense_sections(t: &mut TomlText, dense: Vec<(String, &'static str, String)>) {
    for (file, activation, why) in dense {
        let _ = writeln!(t.0, "\n[[embedding.dense]]  # modules.json: a Dense module");
        t.key("file", file, "");
        t.key("activation", activation, &why);
    }
}

/// A BGE-M3 folder (FlagEmbedding's `colbert_linear` and `sparse_linear` heads beside the
/// model): its three outputs, dense and ColBERT vectors normalised (`BGEM3FlagModel`'s
/// default), the heads' weights from safetensors (a pickle is refused, naming the
/// conversion), no lexical weight for the tokenizer's cls, eos, pad and unk tokens.
fn bge_m3_section(t: &mut TomlText, dir: &Path) -> Result<(), PublishedError> {
    t.key("pooling", "bge_m3", "colbert_linear and sparse_linear beside the model: BGE-M3");
    t.key("normalize", true, "BGEM3FlagModel's default");
    t.section("embedding.bge_m3");
    for head in ["colbert_linear", "sparse_linear"] {
        let file = format!("{head}.safetensors");
        if !dir.join(&file).is_file() {
            return Err(format!(
                "{head}.pt holds BGE-M3's {head} head as a pickle, which inferd does not read (loading one runs the \
                 code it holds); save its tensors with safetensors: python -c \"import torch, safetensors.torch as s; \
                 s.save_file(torch.load('{head}.pt', weights_only=True), '{file}')\""
            )
            .into());
        }
        t.key(head, file, "");
    }
    // FlagEmbedding's unused tokens: those of the four the tokenizer names.
    let names = json(dir, "special_tokens_map.json")?.or(json(dir, "tokenizer_config.json")?).unwrap_or(Value::Null);
    let unused: Vec<String> = ["cls_token", "eos_token", "pad_token", "unk_token"]
        .iter()
        .filter_map(|key| match &names[*key] {
            Value::String(s) => Some(s.clone()),
            Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
            _ => None,
        })
        .collect();
    t.key("unused_tokens", unused, "special_tokens_map.json: cls, eos, pad and unk tokens (those named)");
    Ok(())
}

/// A PyLate ColBERT folder: a vector per token, through its Dense modules, each normalised
/// (PyLate's `encode` normalises by default), and its recipe from
/// config_sentence_transformers.json (PyLate's defaults where a key is absent), the mask
/// token from tokenizer_config.json.
fn colbert_section(
    t: &mut TomlText,
    dir: &Path,
    st: Value,
    dense: Vec<(String, &'static str, String)>,
) -> Result<(), PublishedError> {
    const FILE: &str = "config_sentence_transformers.json";
    t.key("pooling", "colbert", "PyLate's ColBERT: a vector per token");
    t.key("normalize", true, "PyLate normalises each token's vector");
    dense_sections(t, dense);
    t.section("embedding.colbert");
    let defaults = ColbertConfig::default();
    let text = |key: &str, default: &str| -> Result<(String, String), PublishedError> {
        match &st[key] {
            Value::Null => Ok((default.to_string(), "PyLate's default".into())),
            Value::String(s) => Ok((s.clone(), format!("{FILE}: {key}"))),
            other => Err(format!("{FILE}: {key} = {other} is not a text").into()),
        }
    };
    for (key, default) in [("query_prefix", &defaults.query_prefix), ("document_prefix", &defaults.document_prefix)] {
        let (value, why) = text(key, default)?;
        t.key(key, value, &why);
    }
    for (key, default) in [("query_length", defaults.query_length), ("document_length", defaults.document_length)] {
        match &st[key] {
            Value::Null => t.key(key, default as i64, "PyLate's default"),
            v => match v.as_u64() {
                Some(n) => t.key(key, n as i64, &format!("{FILE}: {key}")),
                None => return Err(format!("{FILE}: {key} = {v} is not a number of tokens").into()),
            },
        }
    }
    let flags = [
        ("do_query_expansion", defaults.do_query_expansion),
        ("attend_to_expansion_tokens", defaults.attend_to_expansion_tokens),
    ];
    for (key, default) in flags {
        match &st[key] {
            Value::Null => t.key(key, default, "PyLate's default"),
            Value::Bool(b) => t.key(key, *b, &format!("{FILE}: {key}")),
            other => return Err(format!("{FILE}: {key} = {other} is not true or false").into()),
        }
    }
    let (skiplist, why): (Vec<String>, String) = match &st["skiplist_words"] {
        Value::Null => (defaults.skiplist_words.clone(), "PyLate's default: string.punctuation".into()),
        v => (
            serde_json::from_value(v.clone()).map_err(|e| format!("{FILE}: skiplist_words: {e}"))?,
            format!("{FILE}: skiplist_words"),
        ),
    };
    t.key("skiplist_words", skiplist, &why);
    let tokenizer = json(dir, "tokenizer_config.json")?.unwrap_or(Value::Null);
    // A token as text, or as an object with its `content`.
    let mask = match &tokenizer["mask_token"] {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    };
    match mask {
        Some(mask) => t.key("mask_token", mask, "tokenizer_config.json: mask_token"),
        None => t.key("mask_token", defaults.mask_token, "tokenizer_config.json names none: BERT's"),
    }
    Ok(())
}

/// A Dense module's folder: its weights' file (safetensors only) and its activation.
fn dense_module(dir: &Path, path: &str) -> Result<(String, &'static str, String), PublishedError> {
    let file = format!("{path}/config.json");
    let config =
        json(dir, &file)?.ok_or(format!("modules.json names a Dense module in '{path}', but {file} is missing"))?;
    if config.get("use_residual") == Some(&Value::Bool(true)) {
        return Err(format!(
            "{file}: use_residual = true (PyLate adds the module's input to its output), which inferd's Dense layers do not"
        )
        .into());
    }
    let function =
        config.get("activation_function").and_then(Value::as_str).unwrap_or("torch.nn.modules.linear.Identity");
    let activation = match function.rsplit('.').next().unwrap_or_default() {
        "Identity" => "identity",
        "Tanh" => "tanh",
        "ReLU" => "relu",
        "Sigmoid" => "sigmoid",
        "GELU" => "gelu",
        other => return Err(format!("{file}: activation_function {function}: inferd's Dense layers apply Identity, Tanh, ReLU, Sigmoid or GELU, not {other}").into()),
    };
    let weights = format!("{path}/model.safetensors");
    if !dir.join(&weights).is_file() {
        let pickle = dir.join(path).join("pytorch_model.bin").is_file();
        return Err(match pickle {
            true => format!(
                "{path}/pytorch_model.bin holds the Dense module's weights as a pickle, which inferd does not read (loading \
                 one runs the code it holds); save the module with safetensors (sentence-transformers' \
                 save(..., safe_serialization=True)) to give it {weights}"
            ),
            false => format!("modules.json names a Dense module in '{path}', but {weights} is missing"),
        }
        .into());
    }
    Ok((weights, activation, format!("{file}: activation_function {function}")))
}

/// `config_sentence_transformers.json`'s default prompt and prompts.
fn prompts_section(t: &mut TomlText, st: &Value) -> Result<(), PublishedError> {
    let prompts: BTreeMap<String, String> = match st.get("prompts") {
        None | Some(Value::Null) => BTreeMap::new(),
        Some(p) => {
            serde_json::from_value(p.clone()).map_err(|e| format!("config_sentence_transformers.json: prompts: {e}"))?
        }
    };
    if let Some(default) = st.get("default_prompt_name").and_then(Value::as_str) {
        t.key("default_prompt", default, "config_sentence_transformers.json: default_prompt_name");
    }
    if !prompts.is_empty() {
        t.section("embedding.prompts");
        let _ = writeln!(t.0, "# config_sentence_transformers.json: prompts (`prompt_name` on /embed)");
        for (name, text) in prompts {
            t.key(&name, text, "");
        }
    }
    Ok(())
}

/// The one pooling mode a sentence-transformers Pooling configuration switches on.
fn pooling(config: &Value) -> Result<(&'static str, &'static str), PublishedError> {
    const MODES: [(&str, Option<&str>); 6] = [
        ("pooling_mode_cls_token", Some("cls")),
        ("pooling_mode_mean_tokens", Some("mean")),
        ("pooling_mode_max_tokens", Some("max")),
        ("pooling_mode_lasttoken", Some("last_token")),
        ("pooling_mode_mean_sqrt_len_tokens", None),
        ("pooling_mode_weightedmean_tokens", None),
    ];
    if config.get("include_prompt").and_then(Value::as_bool) == Some(false) {
        return Err("include_prompt = false (prompt tokens left out of the pooling) is not supported".into());
    }
    let on: Vec<_> = MODES.iter().filter(|(key, _)| config.get(*key).and_then(Value::as_bool) == Some(true)).collect();
    match on.as_slice() {
        [(key, Some(mode))] => Ok((mode, key)),
        [(key, None)] => Err(format!("{key} is not a pooling inferd has (cls, mean, max, last token)").into()),
        [] => Err("no pooling_mode_* is true".into()),
        _ => Err(format!(
            "{} are all true: a concatenation of poolings, which inferd does not make",
            on.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
        )
        .into()),
    }
}

/// A `size`/`crop_size` value: `{"height", "width"}`, `{"shortest_edge"}` or one number.
enum Size {
    Exact(u64, u64),
    ShortestEdge(u64),
}

fn size(v: &Value, key: &str) -> Result<Option<Size>, PublishedError> {
    let Some(v) = v.get(key).filter(|v| !v.is_null()) else { return Ok(None) };
    let int = |x: &Value| x.as_u64().filter(|n| (1..=1 << 20).contains(n));
    let bad = || format!("preprocessor_config.json: {key} = {v} is not a size inferd reads");
    if let Some(n) = int(v) {
        return Ok(Some(Size::Exact(n, n)));
    }
    match (v.get("height").and_then(int), v.get("width").and_then(int), v.get("shortest_edge").and_then(int)) {
        (Some(h), Some(w), None) => Ok(Some(Size::Exact(w, h))),
        (None, None, Some(edge)) if v.get("longest_edge").is_none() => Ok(Some(Size::ShortestEdge(edge))),
        _ => Err(bad().into()),
    }
}

fn image_section(t: &mut TomlText, p: &Value) -> Result<(), PublishedError> {
    let flag = |key: &str| p.get(key).and_then(Value::as_bool).unwrap_or(true);
    let f = "preprocessor_config.json";
    if !flag("do_resize") {
        return Err(
            format!("{f}: do_resize = false: the model takes images of any size, which inferd cannot feed").into()
        );
    }
    let resize = size(p, "size")?.ok_or(format!("{f} has no size"))?;
    let crop_wanted = p.get("do_center_crop").and_then(Value::as_bool).unwrap_or(p.get("crop_size").is_some());
    let crop = if crop_wanted { size(p, "crop_size")? } else { None };
    t.section("image");
    match (resize, crop) {
        (Size::ShortestEdge(edge), Some(Size::Exact(w, h))) => {
            t.key("width", w as i64, &format!("{f}: crop_size"));
            t.key("height", h as i64, &format!("{f}: crop_size"));
            t.key("resize", "shortest_edge", &format!("{f}: size.shortest_edge, then a centre crop"));
            t.key("shortest_edge", edge as i64, &format!("{f}: size.shortest_edge"));
        }
        // A single number with a centre crop is an old processor's shortest edge.
        (Size::Exact(edge, same), Some(Size::Exact(w, h))) if edge == same && p["size"].is_u64() => {
            t.key("width", w as i64, &format!("{f}: crop_size"));
            t.key("height", h as i64, &format!("{f}: crop_size"));
            t.key("resize", "shortest_edge", &format!("{f}: size (one number), then a centre crop"));
            t.key("shortest_edge", edge as i64, &format!("{f}: size"));
        }
        (Size::Exact(w, h), None) => {
            t.key("width", w as i64, &format!("{f}: size"));
            t.key("height", h as i64, &format!("{f}: size"));
            t.key("resize", "stretch", &format!("{f}: size is exact, no crop"));
        }
        (Size::Exact(w, h), Some(Size::Exact(cw, ch))) if (w, h) == (cw, ch) => {
            t.key("width", w as i64, &format!("{f}: size"));
            t.key("height", h as i64, &format!("{f}: size"));
            t.key("resize", "stretch", &format!("{f}: size is exact; the crop is the whole image"));
        }
        (Size::ShortestEdge(_), None) => {
            return Err(format!(
                "{f}: a shortest-edge resize without a crop gives images of any size, which inferd cannot feed"
            )
            .into())
        }
        _ => return Err(format!("{f}: this combination of size and crop_size is not one inferd reads").into()),
    }
    // Pillow's filter numbers.
    let resample = match p.get("resample").and_then(Value::as_u64) {
        None => ("bilinear", format!("{f} names no resample: bilinear")),
        Some(0) => ("nearest", format!("{f}: resample = 0")),
        Some(1) => ("lanczos", format!("{f}: resample = 1")),
        Some(2) => ("bilinear", format!("{f}: resample = 2")),
        Some(3) => ("bicubic", format!("{f}: resample = 3")),
        Some(n) => return Err(format!("{f}: resample = {n} is a filter inferd does not have (0, 1, 2, 3)").into()),
    };
    t.key("resample", resample.0, &resample.1);
    let scale = match flag("do_rescale") {
        true => number(p, "rescale_factor").unwrap_or(1.0 / 255.0),
        false => 1.0,
    };
    t.key("scale", scale, &format!("{f}: rescale_factor"));
    if flag("do_normalize") {
        for (key, ours) in [("image_mean", "mean"), ("image_std", "std")] {
            let (values, why): (Vec<f64>, String) = match p.get(key) {
                None => (vec![0.5; 3], format!("{f} names no {key}: 0.5")),
                Some(v) => {
                    let list: Vec<f64> =
                        v.as_array().map(|a| a.iter().filter_map(Value::as_f64).collect()).unwrap_or_default();
                    if list.len() != 3 {
                        return Err(format!("{f}: {key} = {v} is not three numbers").into());
                    }
                    (list, format!("{f}: {key}"))
                }
            };
            t.key(ours, values, &why);
        }
    }
    let _ = writeln!(t.0, "# channels RGB, layout NCHW: Hugging Face's pixel_values");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn folder(tag: &str, files: &[(&str, Value)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("inferd-published-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("model.onnx"), b"x").unwrap();
        for (name, value) in files {
            std::fs::write(dir.join(name), value.to_string()).unwrap();
        }
        dir
    }

    fn image(tag: &str, preprocessor: Value) -> Result<String, String> {
        let config = json!({"architectures": ["ResNetForImageClassification"], "id2label": {"0": "a", "1": "b"}});
        infer(&folder(tag, &[("config.json", config), ("preprocessor_config.json", preprocessor)]), "m", None)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn image_processors_sizes_become_a_resize_and_a_crop() {
        let old =
            image("old", json!({"size": 256, "do_center_crop": true, "crop_size": 224, "image_mean": [0.5, 0.5, 0.5]}))
                .unwrap();
        assert!(old.contains("resize = \"shortest_edge\"") && old.contains("shortest_edge = 256"), "{old}");
        assert!(old.contains("width = 224") && old.contains("resample = \"bilinear\""), "{old}");
        let exact =
            image("exact", json!({"size": {"height": 32, "width": 48}, "image_mean": [0, 0, 0], "resample": 0}))
                .unwrap();
        assert!(
            exact.contains("resize = \"stretch\"") && exact.contains("width = 48") && exact.contains("height = 32")
        );
        assert!(exact.contains("resample = \"nearest\"") && exact.contains("std = [0.5, 0.5, 0.5]"), "{exact}");
        let plain =
            image("plain", json!({"size": 8, "do_normalize": false, "do_rescale": false, "image_processor_type": "X"}))
                .unwrap();
        assert!(plain.contains("scale = 1.0") && !plain.contains("mean ="), "{plain}");
        for (tag, p, message) in [
            ("longest", json!({"size": {"longest_edge": 512}, "image_mean": [0, 0, 0]}), "not a size inferd reads"),
            ("filter", json!({"size": 8, "resample": 4, "image_mean": [0, 0, 0]}), "resample = 4"),
            ("nocrop", json!({"size": {"shortest_edge": 8}, "image_mean": [0, 0, 0]}), "without a crop"),
            ("mean", json!({"size": 8, "image_mean": [0.5]}), "image_mean = [0.5] is not three numbers"),
        ] {
            let e = image(tag, p).unwrap_err();
            assert!(e.contains(message), "{tag}: {e}");
        }
    }

    #[test]
    fn labels_are_read_in_id_order_and_gaps_refused() {
        let text = |tag: &str, config: Value| {
            let dir = folder(tag, &[("config.json", config)]);
            std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
            infer(&dir, "m", None).map_err(|e| e.to_string())
        };
        let arch = "BertForSequenceClassification";
        let ok = text(
            "order",
            json!({"architectures": [arch], "id2label": {"1": "b", "0": "a"}, "max_position_embeddings": 64}),
        )
        .unwrap();
        assert!(ok.contains("labels = [\"a\", \"b\"]") && ok.contains("max_length = 64"), "{ok}");
        let one = text("one", json!({"architectures": [arch], "id2label": {"0": "relevant"}})).unwrap();
        assert!(one.contains("activation = \"sigmoid\"") && one.contains("max_length = 512"), "{one}");
        let e = text("gap", json!({"architectures": [arch], "id2label": {"0": "a", "2": "c"}})).unwrap_err();
        assert!(e.contains("id2label has id '2'"), "{e}");
        let e = text("lm", json!({"architectures": ["BertForMaskedLM"]})).unwrap_err();
        assert!(e.contains("BertForMaskedLM: a MaskedLM head"), "{e}");
        let e =
            text("ner", json!({"architectures": ["BertForTokenClassification"], "id2label": {"0": "O"}})).unwrap_err();
        assert!(e.contains("a TokenClassification head"), "{e}");
    }

    #[test]
    fn a_sentence_transformers_decoder_is_an_embedder_whatever_its_head() {
        let modules = json!([
            {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        ]);
        let dir = folder(
            "decoder",
            &[("config.json", json!({"architectures": ["Qwen3ForCausalLM"]})), ("modules.json", modules)],
        );
        std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
        std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
        std::fs::write(dir.join("1_Pooling/config.json"), json!({"pooling_mode_lasttoken": true}).to_string()).unwrap();
        let toml = infer(&dir, "m", None).unwrap();
        assert!(toml.contains("task = \"embedding\"") && toml.contains("pooling = \"last_token\""), "{toml}");
        assert!(toml.contains("normalize = true"), "{toml}");
    }

    #[test]
    fn a_folder_with_only_an_onnx_file_serves_tensors() {
        let toml = infer(&folder("raw", &[]), "m", None).unwrap();
        assert!(toml.contains("task = \"raw\""), "{toml}");
    }
}
