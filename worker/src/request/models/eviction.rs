//! Eviction within the worker's share of the memory budget: which model goes when a load
//! needs its memory, by models.eviction (LRU, or SIEVE by default). Only a model loaded on
//! demand, and only while no request holds it: a handler holds the model's `Arc` from its
//! lookup to its answer, so a model whose `Arc` only the registry holds has no request
//! between those, and the registry's write lock (held by [`super::Models::evict_one`] while
//! it goes) keeps new lookups out. A job of a request whose client went away may still wait
//! in the engine: it finds the model's number gone and is answered to nobody, never run on
//! another model.

use std::sync::atomic::Ordering;

use inferd_config::file::Eviction;
use inferd_ipc::spec::ModelCost;

use super::registry::{Entry, Registry};

/// A model the loader evicted, for it to drop from the engine and report.
#[derive(Debug)]
pub struct Evicted {
    pub number: usize,
    pub name: String,
    pub cost: ModelCost,
}

/// Takes the next idle model loaded on demand out of `registry`, by `policy`, sparing model
/// number `spare`; None when every other model loaded on demand is in use (or there is none).
pub(super) fn take(registry: &mut Registry, policy: Eviction, spare: Option<usize>) -> Option<Entry> {
    let Registry { entries, hand } = registry;
    let first = entries.iter().position(|e| !e.pinned)?;
    let may_go = |e: &Entry| e.idle() && Some(e.number) != spare;
    let place = match policy {
        Eviction::Lru => {
            let idle = entries.iter().enumerate().skip(first).filter(|(_, e)| may_go(e));
            idle.min_by_key(|(_, e)| e.used.load(Ordering::Relaxed)).map(|(i, _)| i)
        }
        Eviction::Sieve => sieve(&entries[first..], hand, may_go).map(|i| first + i),
    }?;
    Some(entries.remove(place))
}

/// SIEVE (Zhang et al., NSDI '24) over `queue` (oldest first): the hand walks from the oldest
/// to the newest and round again, clearing the mark of each model used since it last passed
/// and stopping at the first one not used since that `may_go`; where it stops is returned, and
/// the hand stays there (the next model moves into the place once this one is removed).
/// Models that may not go (in use) are passed over with their marks. None after two rounds
/// without one.
fn sieve(queue: &[Entry], hand: &mut usize, may_go: impl Fn(&Entry) -> bool) -> Option<usize> {
    for _ in 0..2 * queue.len() {
        if *hand >= queue.len() {
            *hand = 0;
        }
        let entry = &queue[*hand];
        if may_go(entry) && !entry.visited.swap(false, Ordering::Relaxed) {
            return Some(*hand);
        }
        *hand += 1;
    }
    None
}
