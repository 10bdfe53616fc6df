//! Lent cores (server.lend_idle_cores): a worker of one pinned thread claims its core for each
//! run in the pool's shared claims, and may borrow an idle sibling's.

use inferd_ipc::stats::WorkerCounters;

use crate::runtime::engine::dispatch;

/// A worker's part in the pool's core claims (see [`inferd_ipc::cores`]).
pub struct Cores {
    pub claims: inferd_ipc::cores::CoreClaims,
    /// Its own core.
    pub home: usize,
    /// The sibling's core its wide sessions' second thread is pinned to.
    pub borrow: Option<usize>,
    pid: u32,
}

impl Cores {
    pub fn new(claims: inferd_ipc::cores::CoreClaims, home: usize, borrow: Option<usize>) -> Cores {
        Cores { claims, home, borrow, pid: std::process::id() }
    }

    /// Claims the worker's core for a run (waiting while a sibling has it) and, when `wide`,
    /// borrows the sibling's if it is free and its owner was not busy lately.
    pub fn hold(&self, wide: bool, counters: &WorkerCounters) -> Held<'_> {
        if self.claims.take(self.home, self.pid) {
            counters.lending(true);
        }
        let borrowed = match self.borrow {
            Some(cpu) if wide => self.claims.try_borrow(cpu, self.pid, dispatch::RECENT_LOAD).then_some(cpu),
            _ => None,
        };
        if borrowed.is_some() {
            counters.lending(false);
        }
        Held { cores: self, borrowed }
    }
}

/// The cores a run holds, given back when it ends (or panics).
pub struct Held<'a> {
    cores: &'a Cores,
    pub borrowed: Option<usize>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let Cores { claims, home, pid, .. } = self.cores;
        if let Some(cpu) = self.borrowed {
            claims.release(cpu, *pid);
        }
        claims.release(*home, *pid);
    }
}
