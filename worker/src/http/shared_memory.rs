//! Triton's shared-memory extensions, HTTP and gRPC alike: system shared memory through the
//! pool's registry ([`inferd_ipc::shm`]: a region registered with one worker is known to all
//! behind the port), CUDA shared memory as a server that takes none (inferd runs on CPUs: every
//! status is empty, a named region is not found, unregistering has nothing to drop and
//! succeeds, registering is refused with the reason). Tensors in a region are read and
//! written by the request layer ([`crate::kserve`], [`crate::request::infer`]).

use inferd_ipc::shm::{Region, Registry};

use crate::request::error::ApiError;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Memory {
    System,
    Cuda,
}

/// What a route asks (the region's name where it names one).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Action<'a> {
    /// Every region's status (None), or one's.
    Status(Option<&'a str>),
    Register(&'a str),
    /// Every region (None), or one.
    Unregister(Option<&'a str>),
}

/// What a registration asks beside the region's name (HTTP's body, gRPC's message).
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registration {
    pub key: String,
    #[serde(default)]
    pub offset: u64,
    pub byte_size: u64,
}

/// The regions `action` reports (empty for a change), or why it cannot be done.
/// `registration` is what a `Register` asks.
pub fn answer(
    registry: Option<&Registry>,
    memory: Memory,
    action: Action,
    registration: Option<Registration>,
) -> Result<Vec<Region>, ApiError> {
    let registry = match (memory, registry) {
        (Memory::System, Some(registry)) => registry,
        (Memory::System, None) => return nothing(action, "system", "this worker was given no registry"),
        (Memory::Cuda, _) => return nothing(action, "cuda", "inferd runs on CPUs; there is no device memory"),
    };
    match action {
        Action::Status(name) => Ok(registry.status(name)?),
        Action::Unregister(name) => registry.unregister(name).map(|()| Vec::new()).map_err(ApiError::from),
        Action::Register(name) => {
            let Some(Registration { key, offset, byte_size }) = registration else {
                return Err(ApiError::BadRequest(format!(
                    "registering system shared memory region '{name}' needs its key, offset and byte_size"
                )));
            };
            registry.register(&Region { name: name.to_string(), key, offset, byte_size })?;
            Ok(Vec::new())
        }
    }
}

/// The answers of a server that holds no region of `memory` (and takes none, `why`).
fn nothing(action: Action, memory: &str, why: &str) -> Result<Vec<Region>, ApiError> {
    match action {
        Action::Status(None) | Action::Unregister(_) => Ok(Vec::new()),
        Action::Status(Some(name)) => {
            Err(ApiError::NotFound(format!("Unable to find {memory} shared memory region: '{name}'")))
        }
        Action::Register(name) => Err(ApiError::BadRequest(format!(
            "cannot register {memory} shared memory region '{name}': {why}; send the tensors in the request"
        ))),
    }
}

/// A status as Triton's HTTP answer writes it.
pub fn to_json(regions: &[Region]) -> serde_json::Value {
    serde_json::to_value(regions).expect("regions serialise")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_memory_is_never_registered_so_statuses_are_empty_and_registering_says_why_not() {
        for registry in [None, Some(&Registry::new(std::env::temp_dir().join("inferd-no-such-registry")))] {
            assert!(answer(registry, Memory::Cuda, Action::Status(None), None).unwrap().is_empty());
            assert!(answer(registry, Memory::Cuda, Action::Unregister(Some("r")), None).unwrap().is_empty());
            let Err(ApiError::NotFound(why)) = answer(registry, Memory::Cuda, Action::Status(Some("r")), None) else {
                panic!()
            };
            assert_eq!(why, "Unable to find cuda shared memory region: 'r'");
            let asked = Registration { key: "/k".into(), offset: 0, byte_size: 1 };
            let Err(ApiError::BadRequest(why)) = answer(registry, Memory::Cuda, Action::Register("r"), Some(asked))
            else {
                panic!()
            };
            assert!(why.contains("inferd runs on CPUs"), "{why}");
        }
    }
}
