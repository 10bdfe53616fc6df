//! The model repository: `<repository>/<name>/model.toml` next to the model file.
//!
//! ```toml
//! name = "minilm"        # must match the folder name
//! version = "1"          # free-form label shown in status and metadata
//! file = "model.onnx"    # relative to the model's folder
//! [warmup]
//! batch_sizes = [1, 4]   # warm-up runs, one per batch size
//! dynamic_dim = 16       # value used for every other dynamic dimension
//! ```
//!
//! Later: tokenizer, task and pre/post-processing settings live here too.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::ConfigError;

pub const MODEL_CONFIG_FILE: &str = "model.toml";

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelFile {
    name: String,
    #[serde(default = "default_version")]
    version: String,
    #[serde(default = "default_file")]
    file: PathBuf,
    #[serde(default)]
    warmup: Warmup,
}

fn default_version() -> String {
    "1".into()
}

fn default_file() -> PathBuf {
    PathBuf::from("model.onnx")
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Warmup {
    pub batch_sizes: Vec<usize>,
    pub dynamic_dim: usize,
}

impl Default for Warmup {
    fn default() -> Self {
        Warmup { batch_sizes: vec![1, 4], dynamic_dim: 16 }
    }
}

/// A model as the workers will load it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelEntry {
    pub name: String,
    pub version: String,
    /// Absolute path of the ONNX file.
    pub path: PathBuf,
    pub warmup: Warmup,
}

impl ModelEntry {
    /// Reads `<repository>/<name>/model.toml` and checks that the model file exists.
    pub fn load(repository: &Path, name: &str) -> Result<ModelEntry, ConfigError> {
        let err = |message: String| ConfigError::Model { model: name.to_string(), message };
        let dir = repository.join(name);
        let config_path = dir.join(MODEL_CONFIG_FILE);
        if !dir.is_dir() {
            return Err(err(format!("no folder {} in the model repository", dir.display())));
        }
        let text = std::fs::read_to_string(&config_path)
            .map_err(|e| err(format!("cannot read {}: {e}", config_path.display())))?;
        let file: ModelFile = toml::from_str(&text).map_err(|e| err(format!("{}: {e}", config_path.display())))?;
        if file.name != name {
            return Err(err(format!(
                "{} says name = \"{}\"; it must match its folder name",
                config_path.display(),
                file.name
            )));
        }
        if file.warmup.batch_sizes.is_empty() || file.warmup.batch_sizes.contains(&0) || file.warmup.dynamic_dim == 0 {
            return Err(err(format!("{}: warmup sizes must be at least 1", config_path.display())));
        }
        let path = std::path::absolute(dir.join(&file.file)).unwrap_or_else(|_| dir.join(&file.file));
        if !path.is_file() {
            return Err(err(format!(
                "model file {} not found (for the default model, `make setup` fetches it)",
                path.display()
            )));
        }
        Ok(ModelEntry { name: file.name, version: file.version, path, warmup: file.warmup })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn errors_name_the_model_and_the_problem() {
        let repo = repo_with("m2", "name = \"other\"\n", true);
        let e = ModelEntry::load(&repo, "m2").unwrap_err().to_string();
        assert!(e.contains("m2") && e.contains("folder name"), "{e}");
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
