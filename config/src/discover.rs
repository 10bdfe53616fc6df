//! Where `inferd.toml` is looked for when `--config` is not given.

use std::path::PathBuf;

/// Name of the configuration file looked for when `--config` is not given.
pub const CONFIG_FILE_NAME: &str = "inferd.toml";

/// System-wide location, used by packaged installs (see `systemd/`).
pub const SYSTEM_CONFIG: &str = "/etc/inferd/inferd.toml";

/// Finds the configuration used when `--config` is not given: `./inferd.toml`, then
/// `inferd.toml` in the binary's folder or any folder above it (so `target/release/inferd`
/// finds the repository's file), then `/etc/inferd/inferd.toml`.
pub fn discover() -> Option<PathBuf> {
    let mut candidates = vec![PathBuf::from(CONFIG_FILE_NAME)];
    if let Ok(exe) = std::env::current_exe() {
        candidates.extend(exe.ancestors().skip(1).map(|dir| dir.join(CONFIG_FILE_NAME)));
    }
    candidates.push(PathBuf::from(SYSTEM_CONFIG));
    candidates.into_iter().find(|p| p.is_file())
}
