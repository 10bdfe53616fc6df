//! Triton's system shared memory, pool-wide: the regions clients register, and the reads and
//! writes of tensors in them.
//!
//! A client creates a POSIX shared-memory object (`shm_open`, a file under `/dev/shm`),
//! registers a region of it by name, then names the region in its requests instead of
//! sending the tensor. Any worker behind the port may take the registration and any other the
//! request, so the registry is not a worker's: it is a folder the supervisor empties at a
//! fresh start (kept across `inferd upgrade`), one file per region written whole and linked
//! into place (so a reader sees a region whole or not at all), and a region's name is taken
//! by the first registration only. A worker opens the object on every use and reads or writes
//! it with `pread`/`pwrite`, never a mapping: an object the client shrinks after registering
//! gives a short read and an error, not a SIGBUS that would take the worker down.
//!
//! Errors carry Triton's words (its shared-memory manager), which its clients and tests read.

use std::fs::File;
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where `shm_open` keeps its objects.
const SHM_DIR: &str = "/dev/shm";
/// Triton keeps keys with this prefix for its own regions; refused as there.
const RESERVED_PREFIX: &str = "triton_python_backend_shm_region_";
/// A region's file is its name in hex: 127 bytes of name fit a file name (255).
const MAX_NAME: usize = 127;
/// Registrations the pool holds at once (each is a small file; a status lists them all).
pub const MAX_REGIONS: usize = 1024;

/// A registered region: `byte_size` bytes from `offset` of the object `key`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Region {
    pub name: String,
    pub key: String,
    pub offset: u64,
    pub byte_size: u64,
}

/// Where a request's tensor lies: `byte_size` bytes from `offset` of the region `region`.
#[derive(Debug, Clone, PartialEq)]
pub struct Place {
    pub region: String,
    pub offset: u64,
    pub byte_size: u64,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ShmError {
    #[error("Unable to find system shared memory region: '{0}'")]
    NotFound(String),
    #[error("shared memory region '{0}' already in manager")]
    AlreadyExists(String),
    /// An argument of the request that cannot be (the reason in Triton's words where it has
    /// them).
    #[error("{0}")]
    Invalid(String),
    /// The object, the registry or the system failed.
    #[error("{0}")]
    Failed(String),
}

/// The pool's registry, in `dir`.
#[derive(Debug, Clone)]
pub struct Registry {
    dir: PathBuf,
}

impl Registry {
    pub fn new(dir: PathBuf) -> Registry {
        Registry { dir }
    }

    /// Creates the folder (owner only) with no region in it: at a fresh start of the pool.
    pub fn reset(&self) -> std::io::Result<()> {
        match std::fs::remove_dir_all(&self.dir) {
            Err(e) if e.kind() != ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&self.dir)
    }

    /// Registers `region` once its object opens and holds it (Triton's checks).
    pub fn register(&self, region: &Region) -> Result<(), ShmError> {
        let name = &region.name;
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(ShmError::Invalid(format!(
                "cannot register shared memory region '{name}': a name takes 1 to {MAX_NAME} bytes"
            )));
        }
        open(name, &region.key).and_then(|(file, size)| {
            drop(file);
            match region.offset.checked_add(region.byte_size).is_some_and(|end| end <= size) {
                true => Ok(()),
                false => {
                    Err(ShmError::Invalid(format!("failed to register shared memory region '{name}': invalid args")))
                }
            }
        })?;
        if self.names()?.len() >= MAX_REGIONS {
            return Err(ShmError::Invalid(format!(
                "cannot register shared memory region '{name}': {MAX_REGIONS} regions are registered already; \
                 unregister some first"
            )));
        }
        // Written whole under a name of its own, then linked into place: the link fails when
        // the name is registered already (by a sibling a moment ago, too).
        let staged = self.dir.join(format!(".staged-{}-{}", std::process::id(), hex(name)));
        let body = serde_json::to_vec(region).map_err(|e| self.failed(e))?;
        std::fs::write(&staged, body).map_err(|e| self.failed(e))?;
        let linked = std::fs::hard_link(&staged, self.path(name));
        let _ = std::fs::remove_file(&staged);
        match linked {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => Err(ShmError::AlreadyExists(name.clone())),
            Err(e) => Err(self.failed(e)),
        }
    }

    /// Unregisters `name`, or every region (None). A region not registered has nothing to
    /// drop: success, as Triton's.
    pub fn unregister(&self, name: Option<&str>) -> Result<(), ShmError> {
        let names = match name {
            Some(name) => vec![name.to_string()],
            None => self.names()?,
        };
        for name in names {
            match std::fs::remove_file(self.path(&name)) {
                Err(e) if e.kind() != ErrorKind::NotFound => return Err(self.failed(e)),
                _ => {}
            }
        }
        Ok(())
    }

    /// Every region, by name, or the one named.
    pub fn status(&self, name: Option<&str>) -> Result<Vec<Region>, ShmError> {
        match name {
            Some(name) => Ok(vec![self.region(name)?]),
            None => {
                let mut regions = Vec::new();
                for name in self.names()? {
                    match self.region(&name) {
                        Ok(region) => regions.push(region),
                        // Unregistered between the listing and the read.
                        Err(ShmError::NotFound(_)) => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(regions)
            }
        }
    }

    /// The bytes at `place`; at most `limit` of them are read (a request's own bound).
    pub fn read(&self, place: &Place, limit: usize) -> Result<Vec<u8>, ShmError> {
        let (file, at) = self.locate(place)?;
        let len = usize::try_from(place.byte_size).ok().filter(|&n| n <= limit).ok_or_else(|| {
            ShmError::Invalid(format!(
                "shared_memory_byte_size {} for region '{}' is more than a request may carry ({limit} bytes)",
                place.byte_size, place.region
            ))
        })?;
        let mut bytes = vec![0; len];
        file.read_exact_at(&mut bytes, at).map_err(|e| self.short(place, e))?;
        Ok(bytes)
    }

    /// Writes `bytes` (an output `name`) at `place`, which must hold them.
    pub fn write(&self, place: &Place, output: &str, bytes: &[u8]) -> Result<(), ShmError> {
        if bytes.len() as u64 > place.byte_size {
            return Err(Registry::too_small(place, output, bytes.len()));
        }
        let (file, at) = self.locate(place)?;
        file.write_all_at(bytes, at).map_err(|e| self.short(place, e))
    }

    /// Why `len` bytes of output `output` do not go to `place` (Triton's words).
    pub fn too_small(place: &Place, output: &str, len: usize) -> ShmError {
        ShmError::Invalid(format!(
            "shared memory size specified with the request for output '{output}' ({} bytes) should be at least \
             {len} bytes to hold the results",
            place.byte_size
        ))
    }

    /// The object behind `place`, open, and the offset in it where `place` starts, once
    /// `place` is checked to lie within its region.
    fn locate(&self, place: &Place) -> Result<(File, u64), ShmError> {
        let region = self.region(&place.region)?;
        let name = &place.region;
        if place.offset >= region.byte_size {
            return Err(ShmError::Invalid(format!("Invalid offset for shared memory region: '{name}'")));
        }
        if place.offset.checked_add(place.byte_size).is_none_or(|end| end > region.byte_size) {
            return Err(ShmError::Invalid(format!("Invalid offset + byte size for shared memory region: '{name}'")));
        }
        let (file, _) = open(name, &region.key)?;
        // Both within the region, which lies within the object: no overflow.
        Ok((file, region.offset.saturating_add(place.offset)))
    }

    fn region(&self, name: &str) -> Result<Region, ShmError> {
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(ShmError::NotFound(name.to_string()));
        }
        let body = match std::fs::read(self.path(name)) {
            Ok(body) => body,
            Err(e) if e.kind() == ErrorKind::NotFound => return Err(ShmError::NotFound(name.to_string())),
            Err(e) => return Err(self.failed(e)),
        };
        serde_json::from_slice(&body).map_err(|e| self.failed(e))
    }

    /// The registered names.
    fn names(&self) -> Result<Vec<String>, ShmError> {
        let entries = std::fs::read_dir(&self.dir).map_err(|e| self.failed(e))?;
        let mut names: Vec<String> =
            entries.filter_map(|entry| entry.ok()?.file_name().to_str().and_then(unhex)).collect();
        names.sort();
        Ok(names)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(hex(name))
    }

    fn failed(&self, e: impl std::fmt::Display) -> ShmError {
        ShmError::Failed(format!("the shared memory registry ({}): {e}", self.dir.display()))
    }

    fn short(&self, place: &Place, e: std::io::Error) -> ShmError {
        ShmError::Failed(format!(
            "shared memory region '{}': {} bytes from offset {} cannot be reached ({e}); was its object shrunk?",
            place.region, place.byte_size, place.offset
        ))
    }
}

/// Opens the object `key` names as `shm_open` would (read and write, no link followed), and
/// its size. A key is one name under /dev/shm after its leading slashes.
fn open(name: &str, key: &str) -> Result<(File, u64), ShmError> {
    let object = key.trim_start_matches('/');
    if object.is_empty() || object.contains('/') || object == "." || object == ".." || object.contains('\0') {
        return Err(ShmError::Invalid(format!(
            "cannot register shared memory region '{name}' - invalid shm key '{key}'"
        )));
    }
    if object.starts_with(RESERVED_PREFIX) {
        return Err(ShmError::Invalid(format!(
            "cannot register shared memory region '{name}' with key '{key}' as the key contains the reserved prefix \
             '{RESERVED_PREFIX}'"
        )));
    }
    // The client's key: a 400 (Triton says 500), as any argument of the request that is wrong.
    let unable = || ShmError::Invalid(format!("Unable to open shared memory region: '{key}'"));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(Path::new(SHM_DIR).join(object))
        .map_err(|_| unable())?;
    let meta = file.metadata().map_err(|_| unable())?;
    if !meta.is_file() {
        return Err(ShmError::Invalid(format!("Invalid shared memory region: '{key}'")));
    }
    Ok((file, meta.len()))
}

fn hex(name: &str) -> String {
    name.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex(file: &str) -> Option<String> {
    if !file.len().is_multiple_of(2) || file.is_empty() {
        return None;
    }
    let bytes: Option<Vec<u8>> =
        (0..file.len()).step_by(2).map(|i| u8::from_str_radix(file.get(i..i + 2)?, 16).ok()).collect();
    String::from_utf8(bytes?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Object(PathBuf);
    impl Drop for Object {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn object(tag: &str, bytes: &[u8]) -> (Object, String) {
        let name = format!("inferd-shm-test-{}-{tag}", std::process::id());
        let path = Path::new(SHM_DIR).join(&name);
        std::fs::write(&path, bytes).unwrap();
        (Object(path), format!("/{name}"))
    }

    fn registry(tag: &str) -> Registry {
        let registry = Registry::new(std::env::temp_dir().join(format!("inferd-shm-{}-{tag}", std::process::id())));
        registry.reset().unwrap();
        registry
    }

    fn region(name: &str, key: &str, offset: u64, byte_size: u64) -> Region {
        Region { name: name.into(), key: key.into(), offset, byte_size }
    }

    #[test]
    fn a_region_is_registered_once_read_and_written_within_its_bounds_and_unregistered() {
        let registry = registry("cycle");
        let (_object, key) = object("cycle", &[1, 2, 3, 4, 5, 6, 7, 8]);
        let r = region("in", &key, 2, 4);
        registry.register(&r).unwrap();
        assert_eq!(registry.register(&r), Err(ShmError::AlreadyExists("in".into())));
        assert_eq!(registry.status(None).unwrap(), vec![r.clone()]);
        assert_eq!(registry.status(Some("in")).unwrap(), vec![r]);
        let place = |offset, byte_size| Place { region: "in".into(), offset, byte_size };
        assert_eq!(registry.read(&place(1, 2), 100).unwrap(), vec![4, 5]);
        registry.write(&place(0, 2), "y", &[9, 9]).unwrap();
        assert_eq!(registry.read(&place(0, 4), 100).unwrap(), vec![9, 9, 5, 6]);
        for (p, want) in [
            (place(4, 0), "Invalid offset for shared memory region: 'in'"),
            (place(2, 3), "Invalid offset + byte size for shared memory region: 'in'"),
            (place(1, u64::MAX), "Invalid offset + byte size"),
        ] {
            let e = registry.read(&p, 100).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        assert!(registry.read(&place(0, 4), 3).unwrap_err().to_string().contains("more than a request may carry"));
        let e = registry.write(&place(0, 1), "y", &[1, 2]).unwrap_err().to_string();
        assert!(e.contains("for output 'y' (1 bytes) should be at least 2 bytes"), "{e}");
        assert_eq!(
            registry.read(&Place { region: "no".into(), ..place(0, 1) }, 9),
            Err(ShmError::NotFound("no".into()))
        );
        registry.unregister(Some("in")).unwrap();
        registry.unregister(Some("in")).unwrap();
        assert_eq!(registry.status(None).unwrap(), vec![]);
        assert_eq!(registry.status(Some("in")), Err(ShmError::NotFound("in".into())));
    }

    #[test]
    fn registrations_that_cannot_be_are_refused_with_the_reason() {
        let registry = registry("refused");
        let (_object, key) = object("refused", &[0; 16]);
        let cases = [
            (region("a", &key, 8, 9), "failed to register shared memory region 'a': invalid args"),
            (region("a", &key, u64::MAX, 2), "invalid args"),
            (
                region("a", "/inferd-no-such-object", 0, 1),
                "Unable to open shared memory region: '/inferd-no-such-object'",
            ),
            (region("a", "/../etc/passwd", 0, 1), "invalid shm key '/../etc/passwd'"),
            (region("a", "//", 0, 1), "invalid shm key '//'"),
            (region("a", "/triton_python_backend_shm_region_1", 0, 1), "reserved prefix"),
            (region(&"n".repeat(200), &key, 0, 1), "a name takes 1 to 127 bytes"),
        ];
        for (r, want) in cases {
            let e = registry.register(&r).unwrap_err().to_string();
            assert!(e.contains(want), "{e} (wanted {want})");
        }
        assert_eq!(registry.status(None).unwrap(), vec![]);
        // A fresh start forgets every region.
        registry.register(&region("b", &key, 0, 16)).unwrap();
        registry.unregister(None).unwrap();
        registry.register(&region("b", &key, 0, 16)).unwrap();
        registry.reset().unwrap();
        assert_eq!(registry.status(None).unwrap(), vec![]);
    }

    #[test]
    fn a_shrunk_object_is_an_error_not_a_crash() {
        let registry = registry("shrunk");
        let (object, key) = object("shrunk", &[0; 64]);
        registry.register(&region("s", &key, 0, 64)).unwrap();
        std::fs::OpenOptions::new().write(true).open(&object.0).unwrap().set_len(8).unwrap();
        let e = registry.read(&Place { region: "s".into(), offset: 0, byte_size: 64 }, 100).unwrap_err();
        assert!(e.to_string().contains("was its object shrunk?"), "{e}");
    }
}
