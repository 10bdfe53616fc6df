//! Where a model may be loaded from: a path that an operator's request names (the admin
//! listener's `load`, `inferd reload --path`) must lie, symlinks resolved, inside the model
//! repository or admin.allowed_paths, and so must every file the model's settings name. The
//! control socket is the service's own uid's, which its workers share: a worker an attacker
//! took over must not get a file it wrote loaded by the others.

use std::path::{Path, PathBuf};

use inferd_config::model::ModelEntry;
use inferd_config::ConfigError;

/// Who gave a path to load a model from: the admin listener's `load` (a model folder) or
/// `inferd reload --path` (a folder, or a model file replacing the entry's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathFrom {
    AdminLoad,
    ReloadPath,
}

impl PathFrom {
    /// How the caller named the path, for the errors.
    fn name(self) -> &'static str {
        match self {
            PathFrom::AdminLoad => "parameters.path",
            PathFrom::ReloadPath => "--path",
        }
    }
}

/// Why a path may not be loaded from.
#[derive(Debug, thiserror::Error)]
pub enum Unconfined {
    #[error("{} {} is not inside the model repository or admin.allowed_paths ({allowed})", from.name(), path.display())]
    Outside { from: PathFrom, path: PathBuf, allowed: String },
    #[error("{} {} is not a model folder", from.name(), path.display())]
    NotAModelFolder { from: PathFrom, path: PathBuf },
    #[error(transparent)]
    Model(#[from] ConfigError),
    #[error(
        "model '{model}' in {} names {}, which is not inside the model repository or admin.allowed_paths",
        path.display(),
        file.display()
    )]
    NamesOutside { model: String, path: PathBuf, file: PathBuf },
}

/// `path`, symlinks resolved, when it is a model folder inside one of `allowed` and every file
/// the model's settings name is too (a model.toml naming `/etc/shadow` as its tokenizer, or a
/// link out of the folder, would let a caller read or load what the service can), or, from
/// `inferd reload --path`, a model file inside them.
pub fn confined(path: &Path, model: &str, allowed: &[PathBuf], from: PathFrom) -> Result<PathBuf, Unconfined> {
    let roots: Vec<PathBuf> = allowed.iter().filter_map(|r| std::fs::canonicalize(r).ok()).collect();
    let inside =
        |p: &Path| std::fs::canonicalize(p).ok().filter(|real| roots.iter().any(|root| real.starts_with(root)));
    let dir = inside(path).ok_or_else(|| Unconfined::Outside {
        from,
        path: path.to_path_buf(),
        allowed: allowed.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
    })?;
    if dir.is_file() && from == PathFrom::ReloadPath {
        // A model file replacing the entry's own: its settings stay those already checked.
        return Ok(dir);
    }
    if !dir.is_dir() {
        return Err(Unconfined::NotAModelFolder { from, path: path.to_path_buf() });
    }
    let entry = ModelEntry::load_dir(&dir, model)?;
    let mut files = vec![entry.path.clone()];
    files.extend(entry.tokenizer.iter().map(|t| t.path.clone()));
    files.extend(entry.quantization.calibration.iter().cloned());
    if let Some(ops) = &entry.custom_ops {
        files.push(ops.library.clone());
        files.extend(ops.preload.iter().cloned());
    }
    match files.into_iter().find(|f| inside(f).is_none()) {
        Some(file) => Err(Unconfined::NamesOutside { model: model.to_string(), path: path.to_path_buf(), file }),
        None => Ok(dir),
    }
}
