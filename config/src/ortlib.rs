//! Where the ONNX Runtime shared library comes from.
//!
//! Order: `runtime.ort_library` in the config, then `ORT_DYLIB_PATH`, then the well-known
//! folders: `vendor/onnxruntime/lib` in the folder of the config file or of the binary or any
//! folder above them (filled by `make setup`), `/usr/lib/inferd`, `/usr/local/lib/inferd`,
//! `/opt/inferd/lib`. In a folder, `libonnxruntime.so` wins, else the highest
//! `libonnxruntime.so.1.N.P` (the PyPI wheel ships only the versioned name).

use std::path::{Path, PathBuf};

/// ONNX Runtime versions older than this lack the C API that inferd's `ort` build uses.
pub const MIN_ORT_VERSION: &str = "1.31";
pub const VENDOR_DIR: &str = "vendor/onnxruntime/lib";
pub const SYSTEM_DIRS: [&str; 3] = ["/usr/lib/inferd", "/usr/local/lib/inferd", "/opt/inferd/lib"];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrtLibrary {
    pub path: PathBuf,
    /// Which rule found it, for `inferd check` and the logs.
    pub source: String,
}

#[derive(Debug, thiserror::Error)]
pub enum OrtLibError {
    #[error("{what} points to {path}, which does not exist")]
    Missing { what: &'static str, path: PathBuf },
    #[error(
        "ONNX Runtime (libonnxruntime.so, >= {MIN_ORT_VERSION}) not found; looked in: {tried}. \
         Fix: run `make setup` in the inferd repository (extracts it from the onnxruntime wheel on \
         PyPI into {VENDOR_DIR}), or set ORT_DYLIB_PATH=/path/to/libonnxruntime.so.1.xx, or set \
         runtime.ort_library in the config"
    )]
    NotFound { tried: String },
}

/// Finds the library; `base_dir` is the config file's folder.
pub fn locate(configured: Option<&Path>, base_dir: &Path) -> Result<OrtLibrary, OrtLibError> {
    if let Some(path) = configured {
        let path = if path.is_absolute() { path.to_path_buf() } else { base_dir.join(path) };
        return if path.is_file() {
            Ok(OrtLibrary { path, source: "runtime.ort_library".into() })
        } else {
            Err(OrtLibError::Missing { what: "runtime.ort_library", path })
        };
    }
    if let Some(value) = std::env::var_os("ORT_DYLIB_PATH").filter(|v| !v.is_empty()) {
        let path = PathBuf::from(value);
        return if path.is_file() {
            Ok(OrtLibrary { path: std::path::absolute(&path).unwrap_or(path), source: "ORT_DYLIB_PATH".into() })
        } else {
            Err(OrtLibError::Missing { what: "ORT_DYLIB_PATH", path })
        };
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    let exe = std::env::current_exe().ok();
    let roots = std::iter::once(base_dir).chain(exe.iter().flat_map(|e| e.ancestors().skip(1)));
    for root in roots.flat_map(|r| r.ancestors()) {
        let dir = root.join(VENDOR_DIR);
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    dirs.extend(SYSTEM_DIRS.iter().map(PathBuf::from));
    for dir in &dirs {
        if let Some(path) = library_in(dir) {
            return Ok(OrtLibrary { path, source: format!("well-known folder {}", dir.display()) });
        }
    }
    let tried = format!(
        "runtime.ort_library (unset), ORT_DYLIB_PATH (unset), {VENDOR_DIR} in {} and the folders above it and above the binary, {}",
        base_dir.display(),
        SYSTEM_DIRS.join(", ")
    );
    Err(OrtLibError::NotFound { tried })
}

/// `libonnxruntime.so`, else the highest versioned `libonnxruntime.so.X.Y.Z`, in `dir`.
pub fn library_in(dir: &Path) -> Option<PathBuf> {
    let plain = dir.join("libonnxruntime.so");
    if plain.is_file() {
        return Some(plain);
    }
    let mut best: Option<(Vec<u64>, PathBuf)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let name = entry.file_name();
        let Some(version) = name.to_str().and_then(|n| n.strip_prefix("libonnxruntime.so.")) else {
            continue;
        };
        let Ok(parts) = version.split('.').map(str::parse::<u64>).collect::<Result<Vec<_>, _>>() else {
            continue;
        };
        if best.as_ref().is_none_or(|(b, _)| parts > *b) {
            best = Some((parts, entry.path()));
        }
    }
    best.map(|(_, p)| p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_highest_versioned_name() {
        let dir = std::env::temp_dir().join(format!("inferd-ortlib-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["libonnxruntime.so.1.9.0", "libonnxruntime.so.1.31.1", "libonnxruntime.so.1.31.0", "other.so"] {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        assert_eq!(library_in(&dir).unwrap().file_name().unwrap(), "libonnxruntime.so.1.31.1");
        std::fs::write(dir.join("libonnxruntime.so"), b"").unwrap();
        assert_eq!(library_in(&dir).unwrap().file_name().unwrap(), "libonnxruntime.so");
    }

    #[test]
    fn a_configured_path_that_is_missing_is_an_error_not_a_fallback() {
        let err = locate(Some(Path::new("/nonexistent/libonnxruntime.so")), Path::new("/")).unwrap_err();
        assert!(err.to_string().contains("runtime.ort_library points to /nonexistent"), "{err}");
    }
}
