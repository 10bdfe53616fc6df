//! Connection balance: how many HTTP connections each serving worker has open, in one memfd
//! the supervisor creates for the pool and hands every worker as fd 10, mapped by all.
//!
//! SO_REUSEPORT places connections, not requests, and at random: a few more keep-alive
//! connections on one worker make its clients wait longer for as long as they live. Worse,
//! closing a connection after a fixed number of requests drives connections *towards* the
//! busiest worker: the clients of a less busy one get their answers sooner, reach the limit
//! sooner and reconnect, and half of them land on the busy one (measured: 32 connections on 2
//! workers drifted to 29 and 3 within seconds). With the counts shared here, a worker that
//! has two or more connections more than its least busy sibling announces `Connection: close`
//! on its next answer ([`Entry::over_share`]); the client's next connection is placed afresh,
//! and the difference shrinks until the workers hold their share.
//!
//! The table has one entry per worker: its pid (0: free) and its open connections. A worker
//! takes an entry when it starts accepting and marks it [`DRAINING`] when it stops (its
//! connections are going anyway, and its siblings must not shed theirs towards it); the
//! supervisor frees the entries of every worker it reaps ([`Balance::clear`]), so an entry is
//! never taken by another worker while its own still counts into it.
//!
//! With `models.placement = "pool"` an entry also says where its worker can be reached by a
//! sibling (the abstract Unix socket it forwards requests to, named from a random 64-bit
//! address) and which models loaded on demand it holds ([`HOLDINGS`] keys, each a hash of the
//! pool generation and the model's name; 0 is a free place). A sibling that cannot load a
//! model without evicting others looks here for a serving worker that holds it
//! ([`Entry::holder`]). What it reads may be a moment old: a worker that evicted the model
//! since, or is gone, is found out when the forwarded request reaches it (it loads the model
//! itself) or cannot (the sender serves the request).
//!
//! After the entries, one word for the whole pool: the most urgent request priority any worker
//! saw within the last second, and when ([`Balance::saw_priority`]). A worker keeps
//! lower-priority work off its first lane while it is recent, so a client that this table's
//! balance moves to another worker finds that worker ready for it too.
//!
//! Last, one row per worker for the requests waiting in its queue for models with a queue
//! limit of their own (`[batching] max_queue_size`, Triton's): a model's limit holds for the
//! pool, not for each worker, so a client whose second connection lands on another worker is
//! refused as Triton would refuse it ([`Waiting`]). A row is taken by the worker's pid and
//! freed with its entry when the supervisor reaps it, so a dead worker's waiting requests
//! never count.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::region::Region;
use crate::stats::monotonic_nanos;

/// File descriptor of the table in a worker.
pub const WORKER_BALANCE_FD: i32 = 10;

/// Entries in the table: more than the workers any pool runs at once, replacements included.
const ENTRIES: usize = 1024;

/// The entries, then how many of them were ever taken (a high-water mark: every answer reads
/// the table, and a pool uses a handful of entries, not all of them), then each entry's
/// placement: its address and the models it holds. Pages nobody writes cost no memory.
const COUNTS_LEN: usize = ENTRIES * 8 + 8;
/// Models loaded on demand an entry can say it holds (more are held, but not offered).
pub const HOLDINGS: usize = 63;
const PLACE_WORDS: usize = HOLDINGS + 1;
/// After the placements, one word for the pool: the most urgent priority a worker saw lately
/// and when ([`Balance::saw_priority`]).
const URGENT: usize = COUNTS_LEN + ENTRIES * PLACE_WORDS * 8;
/// Models with a queue limit a worker's row can count (more are limited in that worker alone).
pub const LIMITED: usize = 15;
/// A row: its pid, then a word per model: its key (above) and the requests waiting (below).
const ROW_WORDS: usize = LIMITED + 1;
const WAITING: usize = URGENT + 8;
/// After the rows, how many were ever taken (as for the entries).
const ROWS_USED: usize = WAITING + ENTRIES * ROW_WORDS * 8;
const LEN: usize = ROWS_USED + 8;
/// A waiting word's count: its low 24 bits; the model's key is the 40 above.
const COUNT_BITS: u32 = 24;
/// The urgent word's time: CLOCK_MONOTONIC milliseconds, below the priority's 8 bits.
const MS_MASK: u64 = (1 << 56) - 1;

/// A worker with this many connections more than its least busy sibling sheds one.
pub const EXCESS: u32 = 2;

/// Set in an entry's pid while its worker drains: out of the comparison.
const DRAINING: u32 = 1 << 31;

/// The pool's table, mapped.
pub struct Balance {
    region: Region,
}

impl Balance {
    /// A new table, every entry free, and the descriptor to hand to workers.
    pub fn create() -> std::io::Result<(Balance, OwnedFd)> {
        let (region, fd) = Region::create("inferd-balance", LEN)?;
        Ok((Balance { region }, fd))
    }

    /// Maps a table made by [`Balance::create`] (in a worker: fd 10).
    pub fn map(fd: impl AsFd) -> std::io::Result<Balance> {
        Ok(Balance { region: Region::map(fd, LEN)? })
    }

    fn pid(&self, entry: usize) -> &AtomicU32 {
        self.region.at(entry * 8)
    }

    fn count(&self, entry: usize) -> &AtomicU32 {
        self.region.at(entry * 8 + 4)
    }

    /// Word `word` of `entry`'s placement: 0 its address, then the keys of the models it holds.
    fn place(&self, entry: usize, word: usize) -> &AtomicU64 {
        self.region.at(COUNTS_LEN + (entry * PLACE_WORDS + word) * 8)
    }

    /// The entries taken so far: 0 up to this.
    fn used(&self) -> usize {
        (self.region.at::<AtomicU32>(ENTRIES * 8).load(Ordering::Acquire) as usize).min(ENTRIES)
    }

    /// Takes a free entry for `pid`, starting from `open` connections (None: the table is
    /// full, and this worker does not take part).
    pub fn join(self, pid: u32, open: u32) -> Option<Entry> {
        let entry = (0..ENTRIES)
            .find(|&e| self.pid(e).compare_exchange(0, pid, Ordering::AcqRel, Ordering::Relaxed).is_ok())?;
        // A sibling that reads the entry before this store sees its previous worker's count:
        // at worst one answer's decision is off by that.
        self.count(entry).store(open, Ordering::Relaxed);
        // Nothing of the entry's previous worker offered (it is reaped).
        for word in 0..PLACE_WORDS {
            self.place(entry, word).store(0, Ordering::Relaxed);
        }
        self.region.at::<AtomicU32>(ENTRIES * 8).fetch_max(entry as u32 + 1, Ordering::AcqRel);
        Some(Entry { balance: self, entry })
    }

    /// Frees the entries and the waiting row of `pid`: the supervisor, for a worker it reaped.
    pub fn clear(&self, pid: u32) {
        for entry in 0..self.used() {
            for word in [pid, pid | DRAINING] {
                let _ = self.pid(entry).compare_exchange(word, 0, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
        for row in 0..self.rows_used() {
            if self.row_word(row, 0).load(Ordering::Acquire) == u64::from(pid) {
                for word in 1..ROW_WORDS {
                    self.row_word(row, word).store(0, Ordering::Relaxed);
                }
                self.row_word(row, 0).store(0, Ordering::Release);
            }
        }
    }

    fn row_word(&self, row: usize, word: usize) -> &AtomicU64 {
        self.region.at(WAITING + (row * ROW_WORDS + word) * 8)
    }

    fn rows_used(&self) -> usize {
        (self.region.at::<AtomicU32>(ROWS_USED).load(Ordering::Acquire) as usize).min(ENTRIES)
    }

    /// Takes a free waiting row for `pid` (None: the table is full; this worker's limits then
    /// hold for itself alone).
    pub fn waiting_row(self, pid: u32) -> Option<Waiting> {
        let row = (0..ENTRIES).find(|&r| {
            self.row_word(r, 0).compare_exchange(0, u64::from(pid), Ordering::AcqRel, Ordering::Relaxed).is_ok()
        })?;
        for word in 1..ROW_WORDS {
            self.row_word(row, word).store(0, Ordering::Relaxed);
        }
        self.region.at::<AtomicU32>(ROWS_USED).fetch_max(row as u32 + 1, Ordering::AcqRel);
        Some(Waiting { balance: self, row, slots: Vec::new() })
    }

    /// A request of `priority` (0 the most urgent) arrived now at some worker of the pool:
    /// recorded unless one more urgent was recorded within `window`.
    pub fn saw_priority(&self, priority: u8, window: Duration) {
        let word: &AtomicU64 = self.region.at(URGENT);
        let now = monotonic_nanos() / 1_000_000;
        let mut current = word.load(Ordering::Relaxed);
        loop {
            let (seen, at) = ((current >> 56) as u8, current & MS_MASK);
            if current != 0 && seen < priority && now.saturating_sub(at) < window.as_millis() as u64 {
                return;
            }
            let new = (u64::from(priority) << 56) | (now & MS_MASK);
            match word.compare_exchange_weak(current, new, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return,
                Err(changed) => current = changed,
            }
        }
    }

    /// The most urgent priority any worker of the pool saw within `window` (None: none).
    pub fn urgent(&self, window: Duration) -> Option<u8> {
        let current = self.region.at::<AtomicU64>(URGENT).load(Ordering::Relaxed);
        let at = current & MS_MASK;
        let now = monotonic_nanos() / 1_000_000;
        (current != 0 && now.saturating_sub(at) < window.as_millis() as u64).then_some((current >> 56) as u8)
    }

    /// The fewest connections any serving worker but `except` has open (None: no other).
    fn least_but(&self, except: usize) -> Option<u32> {
        (0..self.used())
            .filter(|&e| e != except && matches!(self.pid(e).load(Ordering::Acquire), p if p != 0 && p & DRAINING == 0))
            .map(|e| self.count(e).load(Ordering::Relaxed))
            .min()
    }
}

/// A worker's entry in the table.
pub struct Entry {
    balance: Balance,
    entry: usize,
}

impl Entry {
    /// A connection opened (+1) or closed, or was told to close (-1).
    pub fn add(&self, delta: i32) {
        let count = self.balance.count(self.entry);
        match delta >= 0 {
            true => count.fetch_add(delta.unsigned_abs(), Ordering::Relaxed),
            // Never below 0, whatever the order of a join and a close.
            false => count
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| Some(n.saturating_sub(delta.unsigned_abs())))
                .unwrap_or_default(),
        };
    }

    /// Whether this worker holds [`EXCESS`] connections or more beyond its least busy
    /// sibling's: one of them should go. The caller that acts on it counts that connection
    /// out at once (`add(-1)`), so that the connections answered next see the new count and
    /// no more go than the difference asks.
    pub fn over_share(&self) -> bool {
        let mine = self.balance.count(self.entry).load(Ordering::Relaxed);
        self.balance.least_but(self.entry).is_some_and(|least| mine >= least.saturating_add(EXCESS))
    }

    /// Takes the worker out of the comparison: it drains. Its connections still count into
    /// its entry until the supervisor frees it. Its models are no longer offered either.
    pub fn drain(&self) {
        self.balance.pid(self.entry).fetch_or(DRAINING, Ordering::AcqRel);
    }

    /// Says where siblings reach this worker (a non-zero address).
    pub fn offer_at(&self, address: u64) {
        self.balance.place(self.entry, 0).store(address, Ordering::Release);
    }

    /// Says this worker holds the model of `key` (not 0); false when its places are full.
    pub fn hold(&self, key: u64) -> bool {
        (1..PLACE_WORDS).any(|w| {
            self.balance.place(self.entry, w).compare_exchange(0, key, Ordering::AcqRel, Ordering::Relaxed).is_ok()
        })
    }

    /// Says this worker no longer holds the model of `key`.
    pub fn release(&self, key: u64) {
        for word in 1..PLACE_WORDS {
            let _ = self.balance.place(self.entry, word).compare_exchange(key, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    /// The address of a serving sibling that holds the model of `key`, if one says so.
    pub fn holder(&self, key: u64) -> Option<u64> {
        let table = &self.balance;
        (0..table.used())
            .filter(|&e| {
                e != self.entry && matches!(table.pid(e).load(Ordering::Acquire), p if p != 0 && p & DRAINING == 0)
            })
            .filter(|&e| (1..PLACE_WORDS).any(|w| table.place(e, w).load(Ordering::Acquire) == key))
            .map(|e| table.place(e, 0).load(Ordering::Acquire))
            .find(|&address| address != 0)
    }
}

/// FNV-1a of `bytes`: the table's keys of models (placement's holdings, waiting rows).
pub fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// A worker's waiting row: how many requests wait in its queue for each model of a limited
/// queue, and the sum over its siblings' rows.
pub struct Waiting {
    balance: Balance,
    row: usize,
    /// The keys of this row's words, in order (at most [`LIMITED`]).
    slots: Vec<u64>,
}

impl Waiting {
    /// A model's key: FNV-1a of its name, in the 40 bits a word holds, never 0.
    pub fn key(name: &str) -> u64 {
        (fnv1a(name.bytes()) >> COUNT_BITS).max(1)
    }

    /// Says `count` requests wait here for the model of `key`.
    pub fn set(&mut self, key: u64, count: usize) {
        let slot = match self.slots.iter().position(|&k| k == key) {
            Some(slot) => slot,
            None if self.slots.len() < LIMITED && count > 0 => {
                self.slots.push(key);
                self.slots.len() - 1
            }
            None => return,
        };
        let count = (count as u64).min((1 << COUNT_BITS) - 1);
        self.balance.row_word(self.row, slot + 1).store(key << COUNT_BITS | count, Ordering::Relaxed);
    }

    /// The requests waiting for the model of `key` in the serving siblings' queues.
    pub fn elsewhere(&self, key: u64) -> usize {
        let table = &self.balance;
        (0..table.rows_used())
            .filter(|&r| r != self.row && table.row_word(r, 0).load(Ordering::Acquire) != 0)
            .flat_map(|r| (1..ROW_WORDS).map(move |w| table.row_word(r, w).load(Ordering::Relaxed)))
            .filter(|word| word >> COUNT_BITS == key)
            .map(|word| (word & ((1 << COUNT_BITS) - 1)) as usize)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_worker_sees_the_most_urgent_priority_any_saw_within_the_window() {
        let (_supervisor, fd) = Balance::create().unwrap();
        let (a, b) = (Balance::map(&fd).unwrap(), Balance::map(&fd).unwrap());
        let window = Duration::from_secs(60);
        assert_eq!(b.urgent(window), None, "nothing seen yet");
        a.saw_priority(9, window);
        assert_eq!(b.urgent(window), Some(9));
        a.saw_priority(0, window);
        b.saw_priority(9, window);
        assert_eq!((a.urgent(window), b.urgent(window)), (Some(0), Some(0)), "9 does not hide a recent 0");
        // Past the window, the 0 is forgotten and the next priority seen holds.
        std::thread::sleep(Duration::from_millis(20));
        let short = Duration::from_millis(10);
        assert_eq!(b.urgent(short), None);
        b.saw_priority(9, short);
        assert_eq!(a.urgent(window), Some(9));
    }

    #[test]
    fn a_models_waiting_requests_add_up_over_the_pool_and_a_reaped_worker_counts_no_more() {
        let (supervisor, fd) = Balance::create().unwrap();
        let row = |pid| Balance::map(&fd).unwrap().waiting_row(pid).unwrap();
        let (mut a, mut b, mut c) = (row(100), row(200), row(300));
        let (m, n) = (Waiting::key("m"), Waiting::key("n"));
        assert_ne!(m, n);
        a.set(m, 2);
        b.set(m, 1);
        b.set(n, 5);
        assert_eq!((c.elsewhere(m), c.elsewhere(n)), (3, 5));
        assert_eq!(a.elsewhere(m), 1, "a worker's own row is not counted");
        a.set(m, 0);
        assert_eq!(c.elsewhere(m), 1);
        // A reaped worker's row counts no more, and is taken again empty.
        supervisor.clear(200);
        assert_eq!(c.elsewhere(m) + c.elsewhere(n), 0);
        let d = row(400);
        assert_eq!(d.row, 1, "b's row");
        assert_eq!(a.elsewhere(n), 0);
        // Past LIMITED models a row counts no more of them (they are limited per worker).
        for i in 0..LIMITED as u64 {
            c.set(1000 + i, 1);
        }
        c.set(5000, 1);
        assert_eq!((a.elsewhere(1000), a.elsewhere(5000)), (1, 0));
    }

    #[test]
    fn a_worker_sheds_only_while_it_holds_two_more_than_its_least_busy_sibling() {
        let (supervisor, fd) = Balance::create().unwrap();
        let join = |pid, open| Balance::map(&fd).unwrap().join(pid, open).unwrap();
        let a = join(100, 0);
        a.add(5);
        assert!(!a.over_share(), "alone in the table: nobody to shed to");
        let b = join(200, 4);
        assert!(!a.over_share() && !b.over_share(), "5 against 4");
        a.add(1);
        assert!(a.over_share() && !b.over_share(), "6 against 4");
        a.add(-1);
        assert!(!a.over_share());
        // A third worker with none: both others have too many.
        let c = join(300, 0);
        assert!(a.over_share() && b.over_share() && !c.over_share());
        // A draining worker is out of the comparison: the others no longer shed towards it.
        c.drain();
        assert!(!a.over_share() && !b.over_share());
        // Counts never go below zero.
        b.add(-100);
        assert!(a.over_share(), "5 against 0");
        // The supervisor frees a reaped worker's entry, draining or not, and it is taken again.
        supervisor.clear(200);
        assert!(!a.over_share(), "b reaped: a alone again");
        supervisor.clear(300);
        let d = join(400, 2);
        assert_eq!(d.entry, 1, "the first free entry");
        let e = join(500, 0);
        assert_eq!(e.entry, 2, "the draining worker's, once reaped");
        assert!(a.over_share() && d.over_share() && !e.over_share(), "5, 2 and 0: both shed towards e");
    }

    #[test]
    fn a_worker_finds_the_serving_sibling_that_holds_a_model_and_never_a_draining_or_reaped_one() {
        let (supervisor, fd) = Balance::create().unwrap();
        let join = |pid| Balance::map(&fd).unwrap().join(pid, 0).unwrap();
        let (a, b) = (join(100), join(200));
        a.offer_at(0xa);
        b.offer_at(0xb);
        assert_eq!(a.holder(7), None, "nobody holds it");
        assert!(b.hold(7) && b.hold(8));
        assert_eq!(a.holder(7), Some(0xb));
        assert_eq!(b.holder(7), None, "a worker never finds itself");
        b.release(7);
        assert_eq!(a.holder(7), None);
        assert_eq!(a.holder(8), Some(0xb));
        // Its places fill up: a model past them is held but not offered.
        for key in 100..100 + HOLDINGS as u64 - 1 {
            assert!(b.hold(key), "{key}");
        }
        assert!(!b.hold(9));
        b.drain();
        assert_eq!(a.holder(8), None, "a draining worker offers nothing");
        supervisor.clear(200);
        let c = join(300);
        assert_eq!(c.entry, b.entry, "b's entry, taken again");
        assert_eq!(a.holder(8), None, "nothing of b's is offered by its successor");
        assert_eq!(c.holder(8), None);
    }
}
