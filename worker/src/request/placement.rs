//! `models.placement = "pool"`: this worker's view of which models loaded on demand its
//! serving siblings hold, in the pool's table (`inferd_ipc::balance`), and its own entry
//! there. A model is offered under a key of the pool generation and its name, so that a
//! worker of one generation never forwards to one serving another generation's files.

use std::sync::Arc;

use inferd_ipc::balance::Entry;
use tracing::debug;

pub struct Placement {
    entry: Arc<Entry>,
    generation: u64,
    /// Where this worker takes its siblings' requests.
    pub address: u64,
}

impl Placement {
    /// Offers this worker at `address` in `entry` (see `http::forward`).
    pub fn new(entry: Arc<Entry>, generation: u64, address: u64) -> Placement {
        entry.offer_at(address);
        Placement { entry, generation, address }
    }

    /// `name`'s key in the table: FNV-1a of the generation and the name, never 0 (a free place).
    fn key(&self, name: &str) -> u64 {
        inferd_ipc::balance::fnv1a(self.generation.to_le_bytes().into_iter().chain(name.bytes())).max(1)
    }

    /// This worker loaded `name` on demand: siblings may send its requests here.
    pub fn held(&self, name: &str) {
        if !self.entry.hold(self.key(name)) {
            debug!(model = name, "not offered to siblings: this worker offers as many models as the table holds");
        }
    }

    /// This worker evicted `name`.
    pub fn released(&self, name: &str) {
        self.entry.release(self.key(name));
    }

    /// Where a serving sibling that holds `name` is reached, if one does.
    pub fn holder(&self, name: &str) -> Option<u64> {
        self.entry.holder(self.key(name))
    }
}
