//! Saturation: how much of the pool's capacity is taken, for autoscalers (docs/operations.md,
//! "Saturation"). CPU use says little on its own: a pod's CPU may be shared with a load
//! generator, a sidecar or a noisy neighbour, and a pool can be full while its CPUs idle
//! (requests waiting for a slow client's body, or a model run stalled on memory).
//!
//! Every tick (200 ms) the supervisor samples, from the counters each worker shares:
//! - the pool: requests held by its ready workers (routing to answer) against their lanes
//!   (one per intra-op thread: what runs at once), capped at 1, and 1 while connections wait
//!   in the port's accept queues (no worker takes them) or no worker is ready;
//! - each worker: the seconds its lanes have spent running models, whose rate over the
//!   window is its busy lanes, time-weighted.
//!
//! `inferd_saturation` is the mean of the pool's samples over the last [`WINDOW`].

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::slot::Pool;
use crate::status::WorkerState;

/// What the gauges average over.
pub(super) const WINDOW: Duration = Duration::from_secs(5);

#[derive(Debug, Default)]
pub(super) struct Saturation {
    /// The pool's samples, oldest first.
    pool: VecDeque<(Instant, f64)>,
    /// By live worker (pid): its lanes' busy seconds at each sample, oldest first.
    lanes: HashMap<u32, VecDeque<(Instant, f64)>>,
}

impl Saturation {
    /// The mean of the pool's samples over the window (0 before the first).
    pub(super) fn pool(&self) -> f64 {
        match self.pool.len() {
            0 => 0.0,
            n => self.pool.iter().map(|(_, f)| f).sum::<f64>() / n as f64,
        }
    }

    /// Worker `pid`'s lanes busy over the window, time-weighted (None: not sampled twice yet).
    pub(super) fn busy_lanes(&self, pid: u32) -> Option<f64> {
        let samples = self.lanes.get(&pid)?;
        let ((t0, b0), (t1, b1)) = (samples.front()?, samples.back()?);
        let seconds = t1.duration_since(*t0).as_secs_f64();
        (seconds > 0.0).then(|| ((b1 - b0) / seconds).max(0.0))
    }

    /// One sample of `pool` (every tick).
    pub(super) fn sample(&mut self, now: Instant, pool: &Pool) {
        let (mut held, mut lanes, mut waiting) = (0u64, 0u64, 0u64);
        let mut workers = Vec::new();
        for slot in &pool.slots {
            waiting += slot.sockets.waiting();
            for w in &slot.workers {
                workers.push((w.pid, w.stats.lane_busy_seconds_now()));
                if w.state == WorkerState::Ready {
                    held += w.stats.in_flight_now();
                    lanes += slot.placement.threads.max(1) as u64;
                }
            }
        }
        let fraction = match (lanes, waiting) {
            (0, _) | (_, 1..) => 1.0,
            (lanes, 0) => (held as f64 / lanes as f64).min(1.0),
        };
        self.record(now, fraction, workers);
    }

    fn record(&mut self, now: Instant, fraction: f64, workers: Vec<(u32, f64)>) {
        let old = |t: &Instant| now.duration_since(*t) > WINDOW;
        self.pool.push_back((now, fraction));
        while self.pool.front().is_some_and(|(t, _)| old(t)) {
            self.pool.pop_front();
        }
        let live: Vec<u32> = workers.iter().map(|(pid, _)| *pid).collect();
        self.lanes.retain(|pid, _| live.contains(pid));
        for (pid, busy) in workers {
            let samples = self.lanes.entry(pid).or_default();
            samples.push_back((now, busy));
            while samples.front().is_some_and(|(t, _)| old(t)) {
                samples.pop_front();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gauges_average_over_the_window_and_forget_workers_gone() {
        let mut s = Saturation::default();
        assert_eq!(s.pool(), 0.0);
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        s.record(at(0), 1.0, vec![(7, 10.0), (8, 0.0)]);
        assert_eq!(s.busy_lanes(7), None, "one sample: no rate yet");
        s.record(at(1000), 0.0, vec![(7, 10.5), (8, 2.0)]);
        assert_eq!(s.pool(), 0.5);
        assert_eq!(s.busy_lanes(7), Some(0.5));
        assert_eq!(s.busy_lanes(8), Some(2.0));
        // Past the window, the first samples go.
        s.record(at(5500), 0.0, vec![(8, 3.0)]);
        assert_eq!(s.pool(), 0.0);
        assert_eq!(s.busy_lanes(7), None, "worker 7 is gone");
        assert!((s.busy_lanes(8).unwrap() - 1.0 / 4.5).abs() < 1e-9, "{:?}", s.busy_lanes(8));
    }
}
