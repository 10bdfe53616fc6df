//! What goes wrong reading the configuration: [`ConfigError`], the one error of this crate's
//! loaders (`inferd.toml`, model.toml, key and TLS files), so that each names the file or key
//! at fault.

use std::path::PathBuf;

use crate::discover::{CONFIG_FILE_NAME, SYSTEM_CONFIG};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {error}")]
    Read { path: PathBuf, error: std::io::Error },
    #[error("config {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config key `{key}`: {message}")]
    Invalid { key: &'static str, message: String },
    #[error(
        "no config file given and none found (looked for ./{CONFIG_FILE_NAME}, {CONFIG_FILE_NAME} \
         beside or above the inferd binary, and {SYSTEM_CONFIG}); pass --config FILE"
    )]
    NotFound,
    #[error("model '{model}': {message}")]
    Model { model: String, message: String },
}
