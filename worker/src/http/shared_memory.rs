//! Triton's shared-memory extensions (system and CUDA), answered as a server that takes no
//! shared memory: no region is ever registered (docs/protocol.md, "What stays out of reach":
//! a region registered with one worker would be unknown to its siblings behind the same
//! port). So the status of every region is an empty list, the status of a named one is "not
//! found", unregistering (every region, or one) has nothing to drop and succeeds, as Triton's
//! does for a region it does not hold, and registering is refused with the reason. Clients
//! that tidy up before they start (unregister all, then read the status) go on to their
//! registration, and are told there why it cannot be done. One set of answers for HTTP
//! (`/v2/systemsharedmemory/...`, `/v2/cudasharedmemory/...`) and gRPC.

use crate::request::error::ApiError;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Memory {
    System,
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Action<'a> {
    /// Every region's status (None), or one's.
    Status(Option<&'a str>),
    Register(&'a str),
    /// Every region (None), or one.
    Unregister(Option<&'a str>),
}

impl Memory {
    fn words(self) -> &'static str {
        match self {
            Memory::System => "system",
            Memory::Cuda => "cuda",
        }
    }
}

/// What `action` on `memory` comes to: Ok (an empty status, or nothing to unregister), or why
/// not.
pub fn answer(memory: Memory, action: Action) -> Result<(), ApiError> {
    match action {
        Action::Status(None) | Action::Unregister(_) => Ok(()),
        Action::Status(Some(name)) => Err(ApiError::NotFound(format!(
            "Unable to find {} shared memory region: '{name}' (inferd registers none)",
            memory.words()
        ))),
        Action::Register(name) => Err(ApiError::BadRequest(format!(
            "cannot register {} shared memory region '{name}': inferd takes no shared memory (a region registered \
             with one worker would be unknown to the others behind the same port); send the tensors in the request",
            memory.words()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_registered_so_statuses_are_empty_unregistering_succeeds_and_registering_says_why_not() {
        for memory in [Memory::System, Memory::Cuda] {
            assert!(answer(memory, Action::Status(None)).is_ok());
            assert!(answer(memory, Action::Unregister(None)).is_ok());
            assert!(answer(memory, Action::Unregister(Some("r"))).is_ok());
            let Err(ApiError::NotFound(why)) = answer(memory, Action::Status(Some("r"))) else { panic!() };
            assert!(why.contains(&format!("Unable to find {} shared memory region: 'r'", memory.words())), "{why}");
            let Err(ApiError::BadRequest(why)) = answer(memory, Action::Register("r")) else { panic!() };
            assert!(why.contains("inferd takes no shared memory"), "{why}");
        }
    }
}
