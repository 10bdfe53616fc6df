//! Client threads that repeat a step until stopped, and the tally of what their steps said:
//! the load behind the tests (requests through a reload, a restart, a fault) and the
//! benchmarks' closed loop ([`crate::load`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// What one step of a client came to.
pub enum Step {
    /// A request answered as the client expects.
    Served,
    /// A request that went wrong, and how.
    Failed(String),
    /// Nothing to count (a pause, a request outside the measured time).
    Skipped,
}

impl<E: std::fmt::Display> From<Result<(), E>> for Step {
    fn from(result: Result<(), E>) -> Step {
        match result {
            Ok(()) => Step::Served,
            Err(e) => Step::Failed(e.to_string()),
        }
    }
}

/// What the clients' steps said, together.
#[derive(Debug, Default)]
pub struct Tally {
    pub served: usize,
    /// How each failed step went wrong, in each client's order.
    pub failed: Vec<String>,
}

impl Tally {
    /// Panics unless every step was served, and enough of them (`at_least`) to call it a load.
    pub fn assert_served(&self, at_least: usize, during: &str) {
        assert!(
            self.failed.is_empty(),
            "{} of {} requests failed {during}: {:?}",
            self.failed.len(),
            self.served + self.failed.len(),
            &self.failed[..self.failed.len().min(5)]
        );
        assert!(
            self.served >= at_least,
            "only {} requests served {during} (at least {at_least} expected)",
            self.served
        );
    }
}

/// Running client threads; [`Clients::stop`] ends them and returns their tally.
pub struct Clients {
    stop: Arc<AtomicBool>,
    /// Steps served so far, by every client ([`Clients::served`]).
    served: Arc<AtomicUsize>,
    threads: Vec<JoinHandle<Tally>>,
}

impl Clients {
    /// `n` threads; thread `i` repeats the step `client(i)` makes until stopped.
    pub fn start<S>(n: usize, client: impl Fn(usize) -> S) -> Clients
    where
        S: FnMut() -> Step + Send + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicUsize::new(0));
        let threads = (0..n)
            .map(|i| {
                let (stop, served, mut step) = (stop.clone(), served.clone(), client(i));
                std::thread::spawn(move || {
                    let mut tally = Tally::default();
                    // Relaxed: a step more or less after the stop does not matter.
                    while !stop.load(Ordering::Relaxed) {
                        match step() {
                            Step::Served => {
                                tally.served += 1;
                                served.fetch_add(1, Ordering::Relaxed);
                            }
                            Step::Failed(why) => tally.failed.push(why),
                            Step::Skipped => {}
                        }
                    }
                    tally
                })
            })
            .collect();
        Clients { stop, served, threads }
    }

    /// Waits until the clients have served `n` steps in all since they started, `within` at
    /// most; whether they did. A load measured in requests, not seconds: a slow CPU takes
    /// longer to serve them.
    pub fn wait_served(&self, n: usize, within: std::time::Duration) -> bool {
        let started = std::time::Instant::now();
        while self.served.load(Ordering::Relaxed) < n {
            if started.elapsed() >= within {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        true
    }

    /// Steps served so far.
    pub fn served(&self) -> usize {
        self.served.load(Ordering::Relaxed)
    }

    /// Stops every client after its current step and adds up what they did.
    pub fn stop(self) -> Tally {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Tally::default();
        for thread in self.threads {
            match thread.join() {
                Ok(tally) => {
                    all.served += tally.served;
                    all.failed.extend(tally.failed);
                }
                Err(_) => all.failed.push("a client thread panicked".into()),
            }
        }
        all
    }
}
