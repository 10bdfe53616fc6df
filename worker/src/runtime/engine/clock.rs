//! The lanes' run clock: when each lane's run started (the supervisor watches the oldest), and
//! the means to stop one that overstays server.request_timeout_secs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use inferd_config::file::Allocator;
use inferd_ipc::stats::WorkerCounters;
use tracing::warn;

/// The start of each lane's current run, so the supervisor sees the oldest one (a stuck lane
/// stays visible while another keeps finishing runs), and the means to stop a run that
/// overstays: each lane runs with its own ORT run options, which [`RunClock::stop_overdue`]
/// sets to terminate.
pub struct RunClock {
    // A mutex, not atomics: start and end must update the shared minimum together, and a run
    // is stopped only while its lane still says it runs (see `set`).
    starts: std::sync::Mutex<Vec<u64>>,
    counters: Arc<WorkerCounters>,
    stops: Vec<RunStop>,
    pub timeout: Duration,
}

struct RunStop {
    options: ort::session::RunOptions,
    /// Set (under the clock's lock) when this lane's run was told to terminate.
    stopped: AtomicBool,
}

impl RunClock {
    pub fn new(
        lanes: usize,
        counters: Arc<WorkerCounters>,
        timeout: Duration,
        allocator: Allocator,
    ) -> ort::Result<RunClock> {
        let stops = (0..lanes)
            .map(|_| {
                let mut options = ort::session::RunOptions::new()?;
                if allocator == Allocator::ArenaShrink {
                    // Every arena the run used goes back to its first chunk when it ends.
                    options.set("memory.enable_memory_arena_shrinkage", "cpu:0")?;
                }
                Ok(RunStop { options, stopped: AtomicBool::new(false) })
            })
            .collect::<ort::Result<_>>()?;
        Ok(RunClock { starts: std::sync::Mutex::new(vec![0; lanes]), counters, stops, timeout })
    }

    /// A lane starts or ends a run. Returns, at the end of a run, whether it was stopped.
    pub fn set(&self, lane: usize, running: bool) -> bool {
        let mut starts = self.starts.lock().unwrap_or_else(|e| e.into_inner());
        let now = inferd_ipc::stats::monotonic_nanos();
        if !running && starts[lane] != 0 {
            self.counters.lane_busy(now.saturating_sub(starts[lane]));
        }
        starts[lane] = if running { now } else { 0 };
        self.counters.busy_since(starts.iter().copied().filter(|&t| t != 0).min());
        drop(starts);
        let stop = &self.stops[lane];
        // No terminate can come after the start was cleared: the flag is final now.
        if !running && stop.stopped.swap(false, Ordering::Relaxed) {
            if let Err(e) = stop.options.unterminate() {
                warn!("cannot reset lane {lane}'s run options: {e}");
            }
            return true;
        }
        false
    }

    pub fn options(&self, lane: usize) -> &ort::session::RunOptions {
        &self.stops[lane].options
    }

    /// Tells every run that has lasted longer than the timeout to terminate (ORT stops between
    /// operators; a kernel that never returns is left to the supervisor's SIGABRT).
    pub fn stop_overdue(&self) {
        let starts = self.starts.lock().unwrap_or_else(|e| e.into_inner());
        let now = inferd_ipc::stats::monotonic_nanos();
        for (lane, &start) in starts.iter().enumerate() {
            let overdue = start != 0 && now.saturating_sub(start) > self.timeout.as_nanos() as u64;
            let stop = &self.stops[lane];
            if overdue && !stop.stopped.swap(true, Ordering::Relaxed) {
                warn!(lane, "a model run passed server.request_timeout_secs = {:?}; stopping it", self.timeout);
                if let Err(e) = stop.options.terminate() {
                    warn!("cannot stop lane {lane}'s run: {e}");
                }
            }
        }
    }
}
