//! Client threads that repeat a step until stopped, and the tally of what their steps said:
//! the load behind the tests (requests through a reload, a restart, a fault) and the
//! benchmarks' closed loop ([`crate::load`]).

use std::sync::atomic::{AtomicBool, Ordering};
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
    threads: Vec<JoinHandle<Tally>>,
}

impl Clients {
    /// `n` threads; thread `i` repeats the step `client(i)` makes until stopped.
    pub fn start<S>(n: usize, client: impl Fn(usize) -> S) -> Clients
    where
        S: FnMut() -> Step + Send + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|i| {
                let (stop, mut step) = (stop.clone(), client(i));
                std::thread::spawn(move || {
                    let mut tally = Tally::default();
                    // Relaxed: a step more or less after the stop does not matter.
                    while !stop.load(Ordering::Relaxed) {
                        match step() {
                            Step::Served => tally.served += 1,
                            Step::Failed(why) => tally.failed.push(why),
                            Step::Skipped => {}
                        }
                    }
                    tally
                })
            })
            .collect();
        Clients { stop, threads }
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
