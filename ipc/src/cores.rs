//! Core claims: which process runs on which CPU right now, in one memfd the supervisor creates
//! for the pool and hands every worker as fd 9, mapped by all.
//!
//! They let workers lend idle cores to each other (`server.lend_idle_cores`): a worker of one
//! thread claims its own core for each run and gives it back after; it may also *borrow* a
//! sibling's core, for one run on two threads (the second pinned there), but only while
//! nobody holds that core and its owner was not busy lately. An owner that finds its core lent waits for it (at most one run of its
//! borrower) instead of running beside the borrower's thread: the pool never runs more
//! threads than it has cores.
//!
//! Each CPU has a 32-bit word, 0 when free, else the holder's pid with [`WAITING`] set while
//! someone sleeps on it (a futex on the shared mapping wakes them), and a 64-bit word, the
//! CLOCK_MONOTONIC time its owner was last busy: it had to wait for the core, or had more
//! work than one run ([`CoreClaims::mark_busy`]). A holder that dies leaves its
//! pid: the supervisor clears the claims of every worker it reaps ([`CoreClaims::clear`]),
//! and a waiter that finds the holder gone takes the core over itself.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::region::Region;
use crate::stats::monotonic_nanos;

/// File descriptor of the claims in a worker.
pub const WORKER_CORES_FD: i32 = 9;

/// CPUs with a claim: every CPU number Linux's affinity calls take (`CPU_SETSIZE`).
pub const CPUS: usize = 1024;

/// Set in a claim word while a process sleeps until the core is free.
const WAITING: u32 = 1 << 31;

/// How long a waiter sleeps before it looks again (a wake-up normally comes first).
const RECHECK: Duration = Duration::from_millis(10);

/// After this long waiting, a waiter checks that the holder still exists.
const HOLDER_CHECK: Duration = Duration::from_millis(500);

const LEN: usize = CPUS * 4 + CPUS * 8;

/// The pool's claims, mapped.
pub struct CoreClaims {
    region: Region,
}

impl CoreClaims {
    /// A new region, every core free, and the descriptor to hand to workers.
    pub fn create() -> std::io::Result<(CoreClaims, OwnedFd)> {
        let (region, fd) = Region::create("inferd-cores", LEN)?;
        Ok((CoreClaims { region }, fd))
    }

    /// Maps a region made by [`CoreClaims::create`] (in a worker: fd 9).
    pub fn map(fd: impl AsFd) -> std::io::Result<CoreClaims> {
        Ok(CoreClaims { region: Region::map(fd, LEN)? })
    }

    fn claim(&self, cpu: usize) -> &AtomicU32 {
        assert!(cpu < CPUS);
        self.region.at(cpu * 4)
    }

    fn busy_at(&self, cpu: usize) -> &AtomicU64 {
        assert!(cpu < CPUS);
        self.region.at(CPUS * 4 + cpu * 8)
    }

    /// Takes `cpu`, its own core, for `pid`, waiting while another process holds it. Returns
    /// whether it had to wait.
    pub fn take(&self, cpu: usize, pid: u32) -> bool {
        let word = self.claim(cpu);
        let mut since = None;
        loop {
            let holder = match word.compare_exchange(0, pid, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return since.is_some(),
                Err(holder) => holder,
            };
            if since.is_none() {
                self.mark_busy(cpu);
            }
            let started = *since.get_or_insert_with(std::time::Instant::now);
            let owner = holder & !WAITING;
            if started.elapsed() >= HOLDER_CHECK && !alive(owner) {
                // Its holder is gone and the supervisor has not cleared it yet.
                let _ = word.compare_exchange(holder, 0, Ordering::Relaxed, Ordering::Relaxed);
                continue;
            }
            if holder & WAITING == 0
                && word.compare_exchange(holder, holder | WAITING, Ordering::Relaxed, Ordering::Relaxed).is_err()
            {
                continue;
            }
            futex_wait(word, holder | WAITING, RECHECK);
        }
    }

    /// Its owner has more work than one run, or waited for it: not to be lent for a while.
    pub fn mark_busy(&self, cpu: usize) {
        self.busy_at(cpu).store(monotonic_nanos(), Ordering::Relaxed);
    }

    /// Takes `cpu`, a sibling's core, for `pid` if nobody holds it and its owner was not busy
    /// within `recent` (it has work coming: a loan would make it wait).
    pub fn try_borrow(&self, cpu: usize, pid: u32, recent: Duration) -> bool {
        let busy = self.busy_at(cpu).load(Ordering::Relaxed);
        if busy != 0 && monotonic_nanos().saturating_sub(busy) < recent.as_nanos() as u64 {
            return false;
        }
        self.claim(cpu).compare_exchange(0, pid, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    /// Gives `cpu` back if `pid` holds it, waking whoever waits for it.
    pub fn release(&self, cpu: usize, pid: u32) {
        let word = self.claim(cpu);
        let mut current = word.load(Ordering::Relaxed);
        while current & !WAITING == pid {
            match word.compare_exchange(current, 0, Ordering::Release, Ordering::Relaxed) {
                Ok(_) if current & WAITING != 0 => return futex_wake(word),
                Ok(_) => return,
                Err(now) => current = now,
            }
        }
    }

    /// Gives back every core `pid` holds: the supervisor, for a worker it reaped.
    pub fn clear(&self, pid: u32) {
        for cpu in 0..CPUS {
            self.release(cpu, pid);
        }
    }

    /// The pid holding `cpu` (None: free).
    pub fn holder(&self, cpu: usize) -> Option<u32> {
        Some(self.claim(cpu).load(Ordering::Relaxed) & !WAITING).filter(|&p| p != 0)
    }
}

fn alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else { return false };
    !matches!(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None), Err(nix::errno::Errno::ESRCH))
}

/// Sleeps while `word` holds `expected`, at most `timeout` (a shared futex: the word is in a
/// mapping other processes share).
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let timeout = libc::timespec { tv_sec: timeout.as_secs() as _, tv_nsec: timeout.subsec_nanos() as _ };
    // SAFETY: the word is a valid, aligned u32 for the duration of the call; the kernel only
    // reads it. A spurious or early return is fine: the caller looks again.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &timeout as *const libc::timespec)
    };
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: as in `futex_wait`.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_waits_for_a_lent_core_and_a_borrower_keeps_off_a_wanted_one() {
        let (claims, fd) = CoreClaims::create().unwrap();
        let other = CoreClaims::map(&fd).unwrap();
        let (owner, borrower) = (std::process::id(), std::process::id() + 1);
        // Free and not wanted: lent.
        assert!(claims.try_borrow(1, borrower, Duration::from_millis(50)));
        assert_eq!(other.holder(1), Some(borrower), "one region, seen through both mappings");
        assert!(!claims.try_borrow(1, borrower + 1, Duration::ZERO), "held: not lent twice");
        // The owner waits until the borrower gives it back.
        let waiting = std::thread::spawn(move || other.take(1, owner));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiting.is_finished(), "the owner waits while the core is lent");
        claims.release(1, borrower);
        assert!(waiting.join().unwrap(), "it had to wait");
        assert_eq!(claims.holder(1), Some(owner));
        // Its owner wanted it just now: not lent again for a while.
        claims.release(1, owner);
        assert!(!claims.try_borrow(1, borrower, Duration::from_secs(60)));
        assert!(claims.try_borrow(1, borrower, Duration::ZERO));
        // Nor is a core whose owner says it is busy.
        claims.mark_busy(2);
        assert!(!claims.try_borrow(2, borrower, Duration::from_secs(60)));
        // A release by a process that does not hold it changes nothing; clear frees them all.
        claims.release(1, owner);
        assert_eq!(claims.holder(1), Some(borrower));
        assert!(!claims.take(0, borrower), "its own core, free: no wait");
        claims.clear(borrower);
        assert_eq!((claims.holder(0), claims.holder(1)), (None, None));
    }

    #[test]
    fn a_core_held_by_a_dead_process_is_taken_over() {
        let (claims, _fd) = CoreClaims::create().unwrap();
        // A pid that exited (reaped, so it cannot be anybody's now unless reused at once).
        let gone = std::process::Command::new("true").spawn().unwrap();
        let pid = gone.id();
        let mut gone = gone;
        gone.wait().unwrap();
        assert!(claims.try_borrow(3, pid, Duration::ZERO));
        assert!(claims.take(3, std::process::id()), "waited, then took it over");
        assert_eq!(claims.holder(3), Some(std::process::id()));
    }
}
