//! What the door learned about a request ([`crate::request::door`]), one value passed by
//! reference to every stage that serves it: no stage learns a request's facts anywhere else.

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use hyper::header::HeaderValue;

use crate::runtime::engine::Terms;

#[derive(Debug, Clone)]
pub struct Call {
    /// Its id: the client's `X-Request-Id` where usable, else one made for it.
    pub id: String,
    /// When the door let it in: the instant its deadlines count from.
    pub arrived: Instant,
    /// Its priority and deadline, as the engine takes them with each of its jobs.
    pub terms: Terms,
    /// The highest priority its API key allows (0 without keys): a priority the body asks for
    /// (Cohere v2's `priority`) is taken no higher.
    pub floor: u8,
    /// The name of its API key, when the server has keys (never the key itself).
    pub key: Option<String>,
    /// `Cache-Control: no-cache` (or `no-store`): computed, neither read from the cache of
    /// answers nor stored in it.
    pub fresh: bool,
    /// What its stages learned on the way, which its answer and access line say. Shared by
    /// the call's copies (a protocol may hand one to its handler by value).
    learned: Arc<Learned>,
}

#[derive(Debug, Default)]
struct Learned {
    /// The model it was served by, once looked up.
    model: OnceLock<String>,
    /// How long it waited for that model's load on demand, if it did (its answer's
    /// Server-Timing says so).
    load_wait: OnceLock<Duration>,
}

impl Call {
    pub fn new(id: String, terms: Terms, floor: u8, key: Option<String>, fresh: bool) -> Call {
        Call { id, arrived: Instant::now(), terms, floor, key, fresh, learned: Arc::default() }
    }

    /// The same request with a deadline `timeout` after its arrival too (a body's own, such as
    /// KServe's `parameters.timeout`): the earlier of that and any it came with.
    pub fn within(&self, timeout: Duration) -> Call {
        let asked = self.arrived.checked_add(timeout);
        let deadline = self.terms.deadline.into_iter().chain(asked).min();
        Call { terms: Terms { deadline, ..self.terms }, ..self.clone() }
    }

    /// The same request at the priority its body asks for, no higher than its key allows.
    pub fn at_priority(&self, asked: u8) -> Call {
        let terms = Terms { priority: asked.max(self.floor), ..self.terms };
        Call { terms, ..self.clone() }
    }

    /// Records the model it is served by (the first, if it looked up two).
    pub fn found(&self, model: &str) {
        let _ = self.learned.model.get_or_init(|| model.to_string());
    }

    pub fn model(&self) -> Option<&str> {
        self.learned.model.get().map(String::as_str)
    }

    /// Records its wait for its model's load (the first, if it waited twice).
    pub fn waited_for_load(&self, waited: Duration) {
        let _ = self.learned.load_wait.set(waited);
    }

    pub fn load_wait(&self) -> Option<Duration> {
        self.learned.load_wait.get().copied()
    }
}

impl Default for Call {
    fn default() -> Call {
        Call::new(String::new(), Terms::default(), 0, None, false)
    }
}

/// Request ids for requests that come without a usable `X-Request-Id`: 16 hex digits, from a
/// per-process random key (std's hasher keys) and a counter.
#[derive(Default)]
pub struct RequestIds {
    key: std::collections::hash_map::RandomState,
    next: std::sync::atomic::AtomicU64,
}

impl RequestIds {
    /// The client's id when it is one (1-128 visible ASCII characters), else a new one.
    pub fn for_request(&self, given: Option<&HeaderValue>) -> HeaderValue {
        let usable = |v: &&HeaderValue| (1..=128).contains(&v.len()) && v.as_bytes().iter().all(u8::is_ascii_graphic);
        if let Some(v) = given.filter(usable) {
            return v.clone();
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let id = std::hash::BuildHasher::hash_one(&self.key, (std::process::id(), n));
        HeaderValue::from_str(&format!("{id:016x}")).expect("hex digits")
    }
}
