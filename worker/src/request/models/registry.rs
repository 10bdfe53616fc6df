//! The models loaded now, as the registry holds them ([`Registry`]): those loaded at boot
//! first, pinned, then those loaded on demand in the order they loaded, each with its engine
//! number, what it holds and the marks eviction reads (used since SIEVE's hand passed, when
//! last looked up).

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;

use inferd_ipc::spec::ModelCost;

use crate::load::Model;

/// The models loaded now: those loaded at boot first, then those loaded on demand in the
/// order they loaded (SIEVE's queue, oldest first).
pub(super) struct Registry {
    pub(super) entries: Vec<Entry>,
    /// SIEVE's hand: the place it looks at next among the models loaded on demand (0: the
    /// first after the pinned ones).
    pub(super) hand: usize,
}

/// A model loaded now.
pub(super) struct Entry {
    /// The engine's number for it.
    pub(super) number: usize,
    pub(super) model: Arc<Model>,
    /// Loaded at boot: never evicted.
    pub(super) pinned: bool,
    /// What it holds (zero for a pinned model: the worker's own memory counts it).
    pub(super) cost: ModelCost,
    /// Used since SIEVE's hand last passed it.
    pub(super) visited: AtomicBool,
    /// When a request last looked it up (ms since the registry was made).
    pub(super) used: AtomicU64,
}

impl Entry {
    pub(super) fn new(number: usize, model: Model, pinned: bool, cost: ModelCost) -> Entry {
        let model = Arc::new(model);
        Entry { number, model, pinned, cost, visited: AtomicBool::new(false), used: AtomicU64::new(0) }
    }

    /// No request holds it: only the registry has the model.
    pub(super) fn idle(&self) -> bool {
        Arc::strong_count(&self.model) == 1
    }
}
