//! The cache of answers ([cache]; docs/configuration.md, "The cache of answers"): per worker,
//! a row of a pipeline's answer (an embedding, a row of scores) under a key of everything
//! that decides it, least recently used out first, within this worker's share of
//! `cache.max_bytes`.
//!
//! The key is a SHA-256 of the model's identity (its file's digest, its version and its
//! precision), the options that change the row (pooling, Dense layers by their digest and
//! normalization, the activation or raw scores), and the input exactly as the model sees it: each input tensor's row, so a
//! text's token ids after its prompt and truncation (and a pair's type ids), an image's
//! decoded pixels. A model reloaded with another file or version therefore never meets the
//! old one's entries; a request that changes nothing the model sees shares them.
//!
//! A request with `Cache-Control: no-cache` (or `no-store`) neither reads nor fills it
//! ([`crate::request::call::Call::fresh`]).

use std::sync::Mutex;

use sha2::{Digest, Sha256};

use crate::request::model::Model;
use crate::runtime::tensor::Tensor;
use inferd_ipc::stats::WorkerCounters;

/// What an entry costs beside its floats: the key, the list's links and the allocation.
const ENTRY_OVERHEAD: usize = 96;

/// The options of a request that change its rows beside the model and the input.
#[derive(Debug, Clone, Copy)]
pub struct RowOptions {
    pub normalize: Option<bool>,
    pub raw_scores: bool,
    pub tokens: bool,
}

/// A row's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key([u8; 32]);

struct Entry {
    row: Vec<f32>,
    /// The model's counter row, for its bytes.
    model: usize,
}

impl Entry {
    fn cost(&self) -> usize {
        ENTRY_OVERHEAD.saturating_add(self.row.len().saturating_mul(4))
    }
}

/// A worker's cache: at most `max_bytes` of entries.
pub struct Cache {
    inner: Mutex<Inner>,
    max_bytes: usize,
}

struct Inner {
    entries: lru::LruCache<Key, Entry>,
    bytes: usize,
}

impl Cache {
    /// A cache of `max_bytes` (None when 0: off).
    pub fn new(max_bytes: u64) -> Option<Cache> {
        let max_bytes = usize::try_from(max_bytes).unwrap_or(usize::MAX);
        (max_bytes > 0)
            .then(|| Cache { inner: Mutex::new(Inner { entries: lru::LruCache::unbounded(), bytes: 0 }), max_bytes })
    }

    /// Each key's row, where the cache has it (a hit moves it to the front).
    pub fn get(&self, keys: &[Key]) -> Vec<Option<Vec<f32>>> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        keys.iter().map(|k| inner.entries.get(k).map(|e| e.row.clone())).collect()
    }

    /// Stores `rows` of `model` (its counter row) under their keys, evicting the least
    /// recently used entries beyond the bound; counts evictions and bytes.
    pub fn put(&self, model: usize, rows: impl IntoIterator<Item = (Key, Vec<f32>)>, stats: &WorkerCounters) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        for (key, row) in rows {
            let entry = Entry { row, model };
            let cost = entry.cost();
            if cost > self.max_bytes {
                continue;
            }
            if let Some(old) = inner.entries.put(key, entry) {
                inner.bytes = inner.bytes.saturating_sub(old.cost());
                stats.cache_bytes(old.model, -(old.cost() as i64));
            }
            inner.bytes = inner.bytes.saturating_add(cost);
            stats.cache_bytes(model, cost as i64);
            while inner.bytes > self.max_bytes {
                let Some((_, old)) = inner.entries.pop_lru() else { break };
                inner.bytes = inner.bytes.saturating_sub(old.cost());
                stats.cache_bytes(old.model, -(old.cost() as i64));
                stats.cache_evicted(old.model);
            }
        }
    }
}

/// The key of each of a batch's `rows`: `tensors` are its inputs, each row padded to the
/// batch's width; `lengths` the rows' own lengths (text), empty when every row is whole.
pub fn keys(meta: &Model, options: &RowOptions, tensors: &[Tensor], lengths: &[usize], rows: usize) -> Vec<Key> {
    let mut base = Sha256::new();
    base.update(meta.info.sha256.as_bytes());
    base.update([0]);
    base.update(meta.info.version.as_bytes());
    base.update([0]);
    base.update(meta.info.precision.to_string().as_bytes());
    base.update([0]);
    // The options that change a row; pooling and the activation come with the model's
    // version only when its model.toml is versioned with it, so they are named here.
    let head = format!(
        "{:?}|{:?}|{}|{:?}",
        meta.pipeline.head().map(head_settings),
        options.normalize,
        options.raw_scores,
        options.tokens
    );
    base.update(head.as_bytes());
    (0..rows)
        .map(|row| {
            let mut hash = base.clone();
            for tensor in tensors {
                let width = tensor.data.len().checked_div(rows).unwrap_or(0);
                let used = lengths.get(row).copied().unwrap_or(width).min(width);
                let start = row.saturating_mul(width);
                hash.update(tensor.name.as_bytes());
                hash.update((used as u64).to_le_bytes());
                hash.update(tensor.data.slice(start..start.saturating_add(used)).to_binary());
            }
            Key(hash.finalize().into())
        })
        .collect()
}

/// What of a head decides its rows beside the model's file.
fn head_settings(head: &crate::pipeline::Head) -> String {
    match head {
        // The Dense layers by their files' digest: new weights never meet old answers.
        crate::pipeline::Head::Embedding { settings, dense, .. } => {
            format!("embedding {:?} {} {:?}", settings.pooling, settings.normalize, dense.digest)
        }
        crate::pipeline::Head::Classification { labels, activation, .. } => {
            format!("classification {} {:?}", labels.len(), activation)
        }
    }
}
