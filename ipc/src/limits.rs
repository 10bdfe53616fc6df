//! Per-key limits and counts, pool-wide: one memfd the supervisor creates and hands every
//! worker as fd 11, mapped by all.
//!
//! A key's rate and concurrency limits ([auth] keys file: `rate=`, `burst=`, `concurrency=`)
//! hold for the whole pool, not per worker: SO_REUSEPORT places a client's connections on any
//! worker, and a limit per worker would let a client through at K times its rate, or hold a
//! one-connection client to 1/K of it. So the state is here, touched by every worker through
//! atomics:
//!
//! - one slot per key name (found by a 64-bit hash of the name, claimed by the first worker
//!   that serves the key, never freed: [`SLOTS`] bound the names a supervisor ever limits or
//!   counts): the rate's state as GCRA's theoretical arrival time (one word, updated by
//!   compare-and-swap: [`Seat::admit`]), the refusals, the requests served by priority, and
//!   the name itself for the supervisor's metrics;
//! - one row per worker of its requests in flight by key: a key's concurrency is the sum over
//!   the rows. A worker takes a row as it starts ([`Limits::join`]); the supervisor zeroes and
//!   frees the row of every worker it reaps ([`Limits::clear`]), so a worker killed mid-request
//!   leaves nothing counted against its keys.
//!
//! The clock is CLOCK_MONOTONIC, the same in every process of the host.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::region::Region;

/// File descriptor of the table in a worker.
pub const WORKER_LIMITS_FD: i32 = 11;

/// Key names the table holds over the supervisor's life.
pub const SLOTS: usize = 4096;
/// Workers with a row at once (replacements included).
const WORKERS: usize = 256;
/// Longest name kept (longer ones are refused by the keys file's parser).
pub const NAME_BYTES: usize = 64;

/// A slot's words: hash, arrival time, refused by rate, by concurrency, name set, then the name.
const SLOT_WORDS: usize = 5 + NAME_BYTES / 8;
const SLOT_LEN: usize = 128;
const SLOTS_LEN: usize = SLOTS * SLOT_LEN;
/// Requests served by (slot, priority).
const SERVED_AT: usize = SLOTS_LEN;
const SERVED_LEN: usize = SLOTS * 256 * 8;
/// The workers' pids (0: free), then their rows of in-flight counts by slot.
const PIDS_AT: usize = SERVED_AT + SERVED_LEN;
const ROWS_AT: usize = PIDS_AT + WORKERS * 4;
const LEN: usize = ROWS_AT + WORKERS * SLOTS * 4;

const _: () = assert!(SLOT_WORDS * 8 <= SLOT_LEN);

/// A key's limits, as the worker applies them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyLimits {
    /// Nanoseconds between requests at the sustained rate, and how many may come at once.
    pub rate: Option<(u64, u32)>,
    /// Requests in flight at once, pool-wide.
    pub concurrency: Option<u32>,
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    /// Over its rate: the next request would be admitted in this many nanoseconds.
    Rate { retry_ns: u64 },
    /// This many requests of the key were in flight, its limit.
    Concurrency { limit: u32 },
}

/// Where the key stands against its rate, after an admitted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    /// Requests it may still send at once.
    pub remaining: u32,
    /// Nanoseconds until its whole burst is available again.
    pub reset_ns: u64,
}

/// What the supervisor reports of one key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyReport {
    pub name: String,
    /// (priority, requests admitted) for every priority with any.
    pub served: Vec<(u8, u64)>,
    pub refused_rate: u64,
    pub refused_concurrency: u64,
    pub in_flight: u64,
}

/// The pool's table, mapped.
pub struct Limits {
    region: Region,
}

fn hash(name: &str) -> u64 {
    // FNV-1a: stable across processes and builds, and never 0 (a free slot).
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    h.max(1)
}

/// CLOCK_MONOTONIC in nanoseconds.
pub fn now_ns() -> u64 {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC");
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}

impl Limits {
    /// A new table, every slot free, and the descriptor to hand to workers.
    pub fn create() -> std::io::Result<(Limits, OwnedFd)> {
        let (region, fd) = Region::create("inferd-limits", LEN)?;
        Ok((Limits { region }, fd))
    }

    /// Maps a table made by [`Limits::create`] (in a worker: fd 11).
    pub fn map(fd: impl AsFd) -> std::io::Result<Limits> {
        Ok(Limits { region: Region::map(fd, LEN)? })
    }

    fn word(&self, slot: usize, word: usize) -> &AtomicU64 {
        self.region.at(slot * SLOT_LEN + word * 8)
    }

    fn served(&self, slot: usize, priority: u8) -> &AtomicU64 {
        self.region.at(SERVED_AT + (slot * 256 + priority as usize) * 8)
    }

    fn pid(&self, row: usize) -> &AtomicU32 {
        self.region.at(PIDS_AT + row * 4)
    }

    fn in_flight(&self, row: usize, slot: usize) -> &AtomicU32 {
        self.region.at(ROWS_AT + (row * SLOTS + slot) * 4)
    }

    /// The slot of `name`, claimed if it has none (None: the table is full).
    fn slot(&self, name: &str) -> Option<usize> {
        let h = hash(name);
        for slot in 0..SLOTS {
            let word = self.word(slot, 0);
            match word.load(Ordering::Acquire) {
                0 => match word.compare_exchange(0, h, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        let mut bytes = [0u8; NAME_BYTES];
                        let n = name.len().min(NAME_BYTES);
                        bytes[..n].copy_from_slice(&name.as_bytes()[..n]);
                        for (i, chunk) in bytes.chunks(8).enumerate() {
                            let w = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
                            self.word(slot, 5 + i).store(w, Ordering::Relaxed);
                        }
                        self.word(slot, 4).store(1, Ordering::Release);
                        return Some(slot);
                    }
                    Err(taken) if taken == h => return Some(slot),
                    Err(_) => continue,
                },
                taken if taken == h => return Some(slot),
                _ => continue,
            }
        }
        None
    }

    /// Takes a free row for worker `pid` (None: every row is taken).
    pub fn join(self, pid: u32) -> Option<Seat> {
        let row = (0..WORKERS)
            .find(|&r| self.pid(r).compare_exchange(0, pid, Ordering::AcqRel, Ordering::Relaxed).is_ok())?;
        for slot in 0..self.used() {
            self.in_flight(row, slot).store(0, Ordering::Release);
        }
        Some(Seat { limits: self, row })
    }

    /// Slots claimed so far: 0 up to this.
    fn used(&self) -> usize {
        (0..SLOTS).find(|&s| self.word(s, 0).load(Ordering::Acquire) == 0).unwrap_or(SLOTS)
    }

    /// Zeroes and frees the row of `pid`: the supervisor, for a worker it reaped.
    pub fn clear(&self, pid: u32) {
        let used = self.used();
        for row in (0..WORKERS).filter(|&r| self.pid(r).load(Ordering::Acquire) == pid) {
            for slot in 0..used {
                self.in_flight(row, slot).store(0, Ordering::Release);
            }
            self.pid(row).store(0, Ordering::Release);
        }
    }

    /// Every key's counts, for the supervisor's metrics.
    pub fn report(&self) -> Vec<KeyReport> {
        let rows: Vec<usize> = (0..WORKERS).filter(|&r| self.pid(r).load(Ordering::Acquire) != 0).collect();
        (0..self.used())
            .filter(|&slot| self.word(slot, 4).load(Ordering::Acquire) == 1)
            .map(|slot| {
                let bytes: Vec<u8> = (0..NAME_BYTES / 8)
                    .flat_map(|i| self.word(slot, 5 + i).load(Ordering::Relaxed).to_le_bytes())
                    .take_while(|&b| b != 0)
                    .collect();
                KeyReport {
                    name: String::from_utf8_lossy(&bytes).into_owned(),
                    served: (0..=255u8)
                        .map(|p| (p, self.served(slot, p).load(Ordering::Relaxed)))
                        .filter(|&(_, n)| n > 0)
                        .collect(),
                    refused_rate: self.word(slot, 2).load(Ordering::Relaxed),
                    refused_concurrency: self.word(slot, 3).load(Ordering::Relaxed),
                    in_flight: rows.iter().map(|&r| self.in_flight(r, slot).load(Ordering::Relaxed) as u64).sum(),
                }
            })
            .collect()
    }
}

/// A worker's row in the table.
pub struct Seat {
    limits: Limits,
    row: usize,
}

impl Seat {
    /// Admits a request of key `name` at `priority` within `limits` at `now` (ns), counting
    /// it; the [`Pass`] holds its place in the key's concurrency until dropped. A key whose
    /// name the full table cannot hold is served unlimited and uncounted.
    pub fn admit(&self, name: &str, priority: u8, limits: KeyLimits, now: u64) -> Result<Admitted<'_>, Over> {
        let table = &self.limits;
        let Some(slot) = table.slot(name) else {
            return Ok(Admitted { pass: None, standing: None, untracked: true });
        };
        // Concurrency first: a request refused for it must not spend the rate.
        let mut pass = None;
        if let Some(limit) = limits.concurrency {
            self.limits.in_flight(self.row, slot).fetch_add(1, Ordering::SeqCst);
            let taken = Pass { seat: self, slot };
            let total: u64 = (0..WORKERS)
                .filter(|&r| r == self.row || table.pid(r).load(Ordering::Acquire) != 0)
                .map(|r| table.in_flight(r, slot).load(Ordering::SeqCst) as u64)
                .sum();
            if total > limit as u64 {
                drop(taken);
                table.word(slot, 3).fetch_add(1, Ordering::Relaxed);
                return Err(Over::Concurrency { limit });
            }
            pass = Some(taken);
        }
        let mut standing = None;
        if let Some((interval, burst)) = limits.rate {
            match gcra(table.word(slot, 1), interval, burst, now) {
                Ok(s) => standing = Some(s),
                Err(retry_ns) => {
                    table.word(slot, 2).fetch_add(1, Ordering::Relaxed);
                    return Err(Over::Rate { retry_ns });
                }
            }
        }
        table.served(slot, priority).fetch_add(1, Ordering::Relaxed);
        Ok(Admitted { pass, standing, untracked: false })
    }
}

/// GCRA on the arrival time in `tat`: a request at `now` is admitted when the key's next
/// arrival time, one `interval` later than the later of `now` and its last, is no more than
/// `burst` intervals ahead of `now`. Err: nanoseconds until it would be.
fn gcra(tat: &AtomicU64, interval: u64, burst: u32, now: u64) -> Result<Standing, u64> {
    let tolerance = interval.saturating_mul(burst as u64);
    let mut old = tat.load(Ordering::Acquire);
    loop {
        let next = old.max(now).saturating_add(interval);
        let ahead = next - now;
        if ahead > tolerance {
            return Err(ahead - tolerance);
        }
        match tat.compare_exchange_weak(old, next, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                let remaining = ((tolerance - ahead) / interval.max(1)).min(u32::MAX as u64) as u32;
                return Ok(Standing { remaining, reset_ns: ahead });
            }
            Err(current) => old = current,
        }
    }
}

/// An admitted request: its place in its key's concurrency (if limited) and its key's
/// standing against its rate (if limited).
pub struct Admitted<'a> {
    pub pass: Option<Pass<'a>>,
    pub standing: Option<Standing>,
    /// The table is full and the key has no slot: neither limited nor counted.
    pub untracked: bool,
}

/// A request's place in its key's concurrency, given back when dropped.
pub struct Pass<'a> {
    seat: &'a Seat,
    slot: usize,
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        let count = self.seat.limits.in_flight(self.seat.row, self.slot);
        let _ = count.fetch_update(Ordering::SeqCst, Ordering::Relaxed, |n| Some(n.saturating_sub(1)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000_000;

    #[test]
    fn a_keys_rate_admits_its_burst_then_one_per_interval_across_workers() {
        let (table, fd) = Limits::create().unwrap();
        let a = table.join(1).unwrap();
        let b = Limits::map(&fd).unwrap().join(2).unwrap();
        // 10/s, burst 3: three at once, from either worker, then none until 100 ms later.
        let limits = KeyLimits { rate: Some((SECOND / 10, 3)), concurrency: None };
        let t = 50 * SECOND;
        assert_eq!(a.admit("bulk", 9, limits, t).unwrap().standing.unwrap().remaining, 2);
        assert_eq!(b.admit("bulk", 9, limits, t).unwrap().standing.unwrap().remaining, 1);
        assert_eq!(a.admit("bulk", 9, limits, t).unwrap().standing.unwrap().remaining, 0);
        assert_eq!(b.admit("bulk", 9, limits, t).err(), Some(Over::Rate { retry_ns: SECOND / 10 }));
        // Another key is its own.
        assert!(b.admit("ui", 0, limits, t).is_ok());
        assert!(a.admit("bulk", 9, limits, t + SECOND / 10).is_ok());
        assert!(a.admit("bulk", 9, limits, t + SECOND / 10).is_err());
        let reports = Limits::map(&fd).unwrap().report();
        let bulk = reports.iter().find(|r| r.name == "bulk").unwrap();
        assert_eq!((bulk.served.clone(), bulk.refused_rate), (vec![(9, 4)], 2));
    }

    #[test]
    fn a_keys_concurrency_is_pool_wide_and_a_reaped_workers_requests_leave_it() {
        let (table, fd) = Limits::create().unwrap();
        let a = table.join(1).unwrap();
        let b = Limits::map(&fd).unwrap().join(2).unwrap();
        let limits = KeyLimits { rate: None, concurrency: Some(2) };
        let first = a.admit("k", 0, limits, 0).unwrap();
        let second = b.admit("k", 0, limits, 0).unwrap();
        assert_eq!(a.admit("k", 0, limits, 0).err(), Some(Over::Concurrency { limit: 2 }));
        drop(first);
        let third = a.admit("k", 0, limits, 0).unwrap();
        // Worker 2 dies holding one: the supervisor clears its row.
        std::mem::forget(second);
        let supervisor = Limits::map(&fd).unwrap();
        assert_eq!(supervisor.report()[0].in_flight, 2);
        supervisor.clear(2);
        assert_eq!(supervisor.report()[0].in_flight, 1);
        let fourth = a.admit("k", 0, limits, 0).unwrap();
        assert!(a.admit("k", 0, limits, 0).is_err());
        drop((third, fourth));
        assert_eq!(supervisor.report()[0].in_flight, 0);
        assert_eq!(supervisor.report()[0].refused_concurrency, 2);
    }
}
