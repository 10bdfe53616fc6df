//! The repository loader: a model's folder in the repository (or the folder or file a
//! reload names), its model.toml or the one its published files amount to ([`published`]),
//! read and checked, with the files it names resolved into a [`ModelEntry`].

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::published;
use super::schema::{
    check_pipeline, yes, Batching, ClassificationConfig, CustomOps, EmbeddingConfig, ImageConfig, ModelFile, Precision,
    Quantization, Task, TokenizerConfig, Warmup,
};
use crate::ConfigError;

/// The file in a model's folder that says how to serve it.
pub const MODEL_CONFIG_FILE: &str = "model.toml";
/// The folder's signature unless model.toml names another (the model_signing CLI's default).
pub const SIGNATURE_FILE: &str = "model.sig";

/// A model as the workers will load it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelEntry {
    pub name: String,
    pub version: String,
    /// Absolute path of the ONNX file.
    pub path: PathBuf,
    pub warmup: Warmup,
    pub batching: Batching,
    /// model.toml's `optional_inputs`: graph inputs with an initializer that requests may
    /// give (Triton's `optional: true`).
    #[serde(default)]
    pub optional_inputs: Vec<String>,
    pub task: Task,
    /// Sessions map one prepared copy of the weights (with `runtime.cache_dir` set); false:
    /// each session optimises and holds its own (a graph that must stay as written, or a load
    /// time that matters more than memory).
    #[serde(default = "yes")]
    pub share_weights: bool,
    pub tokenizer: Option<TokenizerConfig>,
    pub embedding: Option<EmbeddingConfig>,
    pub classification: Option<ClassificationConfig>,
    pub image: Option<ImageConfig>,
    #[serde(default)]
    pub precision: Precision,
    #[serde(default)]
    pub quantization: Quantization,
    #[serde(default)]
    pub custom_ops: Option<CustomOps>,
    /// The model's folder, whose files a signature covers.
    #[serde(default)]
    pub folder: PathBuf,
    /// The SHA-256 (hex) of the settings text this entry was made from: the folder's
    /// model.toml, or the one its published files amount to. A load that verifies a signature
    /// derives it again from the verified files ([`ModelEntry::settings_digest`]), so the entry
    /// served is the one signed.
    #[serde(default)]
    pub settings_sha256: String,
    /// model.toml's `signature`, resolved: the folder's signature file when not `model.sig`.
    #[serde(default)]
    pub signature: Option<PathBuf>,
}

impl ModelEntry {
    /// Reads `<repository>/<name>/model.toml` and checks that the files it names exist and
    /// that its sections make sense together.
    pub fn load(repository: &Path, name: &str) -> Result<ModelEntry, ConfigError> {
        let dir = repository.join(name);
        if !dir.is_dir() {
            let message = format!("no folder {} in the model repository", dir.display());
            return Err(ConfigError::Model { model: name.to_string(), message });
        }
        ModelEntry::load_dir(&dir, name)
    }

    /// What `inferd reload --path` points at, for model `name`: a folder with its own
    /// model.toml (whose name must be `name`), or a model file that replaces this entry's.
    pub fn replaced_by(&self, path: &Path) -> Result<ModelEntry, ConfigError> {
        let err = |message: String| ConfigError::Model { model: self.name.clone(), message };
        if path.is_dir() {
            return ModelEntry::load_dir(path, &self.name);
        }
        if !path.is_file() {
            return Err(err(format!("{} is neither a model folder nor a model file", path.display())));
        }
        let path = std::path::absolute(path).map_err(|e| err(e.to_string()))?;
        Ok(ModelEntry { path, ..self.clone() })
    }

    /// Whether `dir` holds a model: its model.toml, or an ONNX file to serve without one.
    pub fn is_model_dir(dir: &Path) -> bool {
        dir.join(MODEL_CONFIG_FILE).is_file() || matches!(published::model_file(dir), Ok(Some(_)) | Err(_))
    }

    /// The names of `repository`'s model folders ([`ModelEntry::is_model_dir`]), sorted; none
    /// when it cannot be read.
    pub fn folders(repository: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(repository)
            .map(|dir| dir.flatten().filter_map(|e| e.file_name().into_string().ok()).collect())
            .unwrap_or_default();
        names.retain(|name| ModelEntry::is_model_dir(&repository.join(name)));
        names.sort();
        names
    }

    /// The model.toml the files of `dir` amount to when it has none ([`published`]); None
    /// when it has one.
    pub fn inferred_toml(dir: &Path, name: &str) -> Result<Option<String>, ConfigError> {
        if dir.join(MODEL_CONFIG_FILE).exists() {
            return Ok(None);
        }
        published::infer(dir, name, None)
            .map(Some)
            .map_err(|e| ConfigError::Model { model: name.into(), message: e.to_string() })
    }

    /// The settings text of folder `dir` (its model.toml, or the one its published files
    /// amount to) and the name to give it in messages.
    fn settings(dir: &Path, name: &str) -> Result<(String, PathBuf), ConfigError> {
        Ok(match ModelEntry::inferred_toml(dir, name)? {
            Some(text) => (text, dir.join("(inferred model.toml)")),
            None => {
                let path = dir.join(MODEL_CONFIG_FILE);
                let text = read_settings(&path)
                    .map_err(|e| ConfigError::Model { model: name.to_string(), message: e.to_string() })?;
                (text, path)
            }
        })
    }

    /// The SHA-256 (hex) of folder `dir`'s settings text as they read now
    /// ([`ModelEntry::settings_sha256`]).
    pub fn settings_digest(dir: &Path, name: &str) -> Result<String, ConfigError> {
        ModelEntry::settings(dir, name).map(|(text, _)| sha256_hex(text.as_bytes()))
    }

    /// The folder's signature file ([`SIGNATURE_FILE`] unless model.toml names another).
    pub fn signature_file(&self) -> PathBuf {
        let folder = match self.folder.as_os_str().is_empty() {
            true => self.path.parent().unwrap_or(Path::new(".")),
            false => &self.folder,
        };
        self.signature.clone().unwrap_or_else(|| folder.join(SIGNATURE_FILE))
    }

    /// The files besides the settings that a load of this entry reads: the model file, its
    /// tokenizer, Dense layers, calibration texts and custom operator libraries.
    pub fn files(&self) -> Vec<&Path> {
        let mut files = vec![self.path.as_path()];
        files.extend(self.tokenizer.iter().map(|t| t.path.as_path()));
        files.extend(self.embedding.iter().flat_map(|e| e.dense.iter().map(|d| d.file.as_path())));
        if let Some(m3) = self.embedding.as_ref().and_then(|e| e.bge_m3.as_ref()) {
            files.extend([m3.colbert_linear.as_path(), m3.sparse_linear.as_path()]);
        }
        files.extend(self.quantization.calibration.as_deref());
        if let Some(ops) = &self.custom_ops {
            files.push(&ops.library);
            files.extend(ops.preload.iter().map(PathBuf::as_path));
        }
        files
    }

    /// Reads `dir/model.toml`, which must describe model `name`; without one, the settings
    /// the folder's published files amount to ([`published`]).
    pub fn load_dir(dir: &Path, name: &str) -> Result<ModelEntry, ConfigError> {
        let err = |message: String| ConfigError::Model { model: name.to_string(), message };
        let (text, config_path) = ModelEntry::settings(dir, name)?;
        let file: ModelFile = toml::from_str(&text).map_err(|e| err(format!("{}: {e}", config_path.display())))?;
        if file.name != name {
            return Err(err(format!("{} says name = \"{}\"; it must be \"{name}\"", config_path.display(), file.name)));
        }
        if file.warmup.batch_sizes.is_empty() || file.warmup.batch_sizes.contains(&0) || file.warmup.dynamic_dim == 0 {
            return Err(err(format!("{}: warmup sizes must be at least 1", config_path.display())));
        }
        file.batching.check().map_err(|e| err(format!("{}: {e}", config_path.display())))?;
        // A file named in model.toml, relative to its folder.
        let resolve = |file: &Path| std::path::absolute(dir.join(file)).unwrap_or_else(|_| dir.join(file));
        let path = resolve(&file.file);
        if !path.is_file() {
            return Err(err(format!(
                "model file {} not found (for the default model, `make setup` fetches it)",
                path.display()
            )));
        }
        let tokenizer = match file.tokenizer {
            None => None,
            Some(t) => {
                let path = resolve(&t.file);
                if !path.is_file() {
                    return Err(err(format!("tokenizer file {} not found", path.display())));
                }
                if t.max_length < 2 {
                    return Err(err("tokenizer.max_length must be at least 2".into()));
                }
                Some(TokenizerConfig { path, max_length: t.max_length })
            }
        };
        check_pipeline(file.task, &tokenizer, &file.embedding, &file.classification, &file.image)
            .map_err(|e| err(e.to_string()))?;
        let mut embedding = file.embedding;
        if let Some(e) = &mut embedding {
            e.prompt(None).map_err(|e| err(format!("embedding.default_prompt: {e}")))?;
            for (i, layer) in e.dense.iter_mut().enumerate() {
                layer.file = resolve(&layer.file);
                if !layer.file.is_file() {
                    return Err(err(format!("embedding.dense[{i}]: {} not found", layer.file.display())));
                }
            }
            if let Some(m3) = &mut e.bge_m3 {
                for (key, file) in
                    [("colbert_linear", &mut m3.colbert_linear), ("sparse_linear", &mut m3.sparse_linear)]
                {
                    *file = resolve(file);
                    if !file.is_file() {
                        return Err(err(format!("embedding.bge_m3.{key}: {} not found", file.display())));
                    }
                }
            }
        }
        let quantization =
            Quantization { calibration: file.quantization.calibration.as_deref().map(resolve), ..file.quantization };
        quantization.check().map_err(|e| err(e.to_string()))?;
        if let Some(c) = quantization.calibration.as_ref().filter(|c| !c.is_file()) {
            return Err(err(format!("quantization.calibration: {} not found", c.display())));
        }
        let custom_ops = match file.custom_ops {
            None => None,
            Some(c) => {
                let ops =
                    CustomOps { library: resolve(&c.library), preload: c.preload.iter().map(|p| resolve(p)).collect() };
                if let Some(missing) = std::iter::once(&ops.library).chain(&ops.preload).find(|p| !p.is_file()) {
                    return Err(err(format!("custom_ops: {} not found", missing.display())));
                }
                if file.precision != Precision::Fp32 {
                    return Err(err("precision int8 or auto is not prepared for graphs with custom operators".into()));
                }
                Some(ops)
            }
        };
        Ok(ModelEntry {
            name: file.name,
            version: file.version,
            path,
            warmup: file.warmup,
            batching: file.batching,
            optional_inputs: file.optional_inputs,
            task: file.task,
            share_weights: file.share_weights,
            tokenizer,
            embedding,
            classification: file.classification,
            image: file.image,
            precision: file.precision,
            quantization,
            custom_ops,
            folder: std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf()),
            settings_sha256: sha256_hex(text.as_bytes()),
            signature: file.signature.as_deref().map(resolve),
        })
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// The largest model.toml read.
const MAX_MODEL_TOML_BYTES: u64 = 1 << 20;

/// Why a model.toml was not read.
#[derive(Debug, thiserror::Error)]
enum SettingsError {
    #[error("cannot read {}: {error}", path.display())]
    Read { path: PathBuf, error: std::io::Error },
    #[error("{} is not a regular file", path.display())]
    NotAFile { path: PathBuf },
    #[error("{} is {bytes} bytes; a model.toml may have at most {MAX_MODEL_TOML_BYTES}", path.display())]
    TooLarge { path: PathBuf, bytes: u64 },
}

/// A model.toml's text: a regular file (a FIFO or device would block the reader) of at most
/// [`MAX_MODEL_TOML_BYTES`].
fn read_settings(path: &Path) -> Result<String, SettingsError> {
    let unreadable = |error| SettingsError::Read { path: path.to_path_buf(), error };
    let meta = std::fs::metadata(path).map_err(unreadable)?;
    if !meta.is_file() {
        return Err(SettingsError::NotAFile { path: path.to_path_buf() });
    }
    if meta.len() > MAX_MODEL_TOML_BYTES {
        return Err(SettingsError::TooLarge { path: path.to_path_buf(), bytes: meta.len() });
    }
    std::fs::read_to_string(path).map_err(unreadable)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ChannelOrder, Layout};

    fn repo_with(name: &str, toml: &str, onnx: bool) -> PathBuf {
        let root = std::env::temp_dir().join(format!("inferd-model-test-{}-{name}", std::process::id()));
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(MODEL_CONFIG_FILE), toml).unwrap();
        if onnx {
            std::fs::write(dir.join("model.onnx"), b"x").unwrap();
        }
        root
    }

    #[test]
    fn loads_with_defaults() {
        let repo = repo_with("m1", "name = \"m1\"\n", true);
        let entry = ModelEntry::load(&repo, "m1").unwrap();
        assert_eq!(entry.version, "1");
        assert_eq!(entry.warmup, Warmup::default());
        assert!(entry.path.ends_with("m1/model.onnx"));
    }

    #[test]
    fn pipelines_are_read_and_checked() {
        let repo = repo_with(
            "c1",
            "name = \"c1\"\ntask = \"classification\"\n[classification]\nlabels = [\"a\", \"b\"]\n\
             [image]\nwidth = 8\nheight = 8\nmean = [0.5, 0.5, 0.5]\nstd = [0.5, 0.5, 0.5]\nlayout = \"NHWC\"\n",
            true,
        );
        let entry = ModelEntry::load(&repo, "c1").unwrap();
        let image = entry.image.unwrap();
        assert_eq!((image.layout, image.channels, image.max_pixels), (Layout::Nhwc, ChannelOrder::Rgb, 40_000_000));
        assert_eq!(entry.classification.unwrap().activation, None, "chosen from the graph at load");

        let cases = [
            ("task = \"embedding\"\n", "needs a [tokenizer]"),
            ("task = \"classification\"\n", "needs a [classification] section"),
            ("task = \"classification\"\n[classification]\nlabels = [\"a\"]\n", "exactly one of"),
            ("[image]\nwidth = 8\nheight = 8\n", "task = \"raw\" takes no"),
            ("[tokenizer]\nfile = \"absent.json\"\n", "tokenizer file"),
            ("task = \"classification\"\n[classification]\nlabels = [\"a\"]\n[image]\nwidth = 8\nheight = 0\n", "at least 1"),
            (
                "task = \"classification\"\n[classification]\nlabels = [\"a\"]\n[image]\nwidth = 8\nheight = 8\nstd = [1, 0, 1]\n",
                "non-zero",
            ),
            (
                "task = \"classification\"\n[classification]\nlabels = [\"a\"]\n[image]\nwidth = 8\nheight = 8\nshortest_edge = 9\n",
                "image.shortest_edge needs image.resize = \"shortest_edge\"",
            ),
            (
                "task = \"classification\"\n[classification]\nlabels = [\"a\"]\n[image]\nwidth = 8\nheight = 6\n\
                 resize = \"shortest_edge\"\nshortest_edge = 7\n",
                "image.shortest_edge = 7 must be between the crop's larger side (8)",
            ),
            ("task = \"sorting\"\n", "unknown variant"),
            ("[batching]\nmax_batch_tokens = 0\n", "must be at least 1"),
            ("[batching]\nmax_queue_delay_ms = 5000\n", "milliseconds"),
        ];
        for (i, (extra, message)) in cases.iter().enumerate() {
            let name = format!("p{i}");
            let repo = repo_with(&name, &format!("name = \"{name}\"\n{extra}"), true);
            let e = ModelEntry::load(&repo, &name).unwrap_err().to_string();
            assert!(e.contains(message), "case {i}: {e}");
        }
    }

    #[test]
    fn errors_name_the_model_and_the_problem() {
        let repo = repo_with("m2", "name = \"other\"\n", true);
        let e = ModelEntry::load(&repo, "m2").unwrap_err().to_string();
        assert!(e.contains("m2") && e.contains("it must be \"m2\""), "{e}");
        let repo = repo_with("m3", "name = \"m3\"\n", false);
        let e = ModelEntry::load(&repo, "m3").unwrap_err().to_string();
        assert!(e.contains("not found"), "{e}");
        let e = ModelEntry::load(&repo, "absent").unwrap_err().to_string();
        assert!(e.contains("absent"), "{e}");
        let repo = repo_with("m4", "name = \"m4\"\ncolour = 1\n", true);
        let e = ModelEntry::load(&repo, "m4").unwrap_err().to_string();
        assert!(e.contains("colour"), "{e}");
    }
}
