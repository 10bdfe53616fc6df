//! What a panic does in a worker: a bug must cost the request that found it, never leave a
//! worker that looks ready but cannot answer.
//!
//! - Inside a *guarded* region (a request's handler on the I/O thread, a lane running a batch,
//!   a blocking task tokenising or decoding for one request) the panic is caught where it
//!   happened; the requests it concerned are answered 500, the worker's fault counter goes up,
//!   and the supervisor, which reads that counter, replaces the worker gap-free (incoming
//!   first), since state a panic unwound through is no longer trusted for long.
//! - Anywhere else (the dispatcher, whichever thread holds it: see [`unguarded`]; the accept
//!   loops, the hand-off, the runtime itself) the hook logs the panic and ends the process at
//!   once with [`EXIT_PANIC`]: the supervisor sees a crash and respawns the slot, and no
//!   thread is left silently dead behind a worker that still reports ready.

use std::cell::Cell;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::task::Poll;
use std::thread::LocalKey;

use inferd_ipc::spec::EXIT_PANIC;
use inferd_ipc::stats::WorkerCounters;

thread_local! {
    /// Set while this thread runs a guarded region: its panic is caught by [`guarded`].
    static GUARDED: Cell<bool> = const { Cell::new(false) };
    /// Set while this thread runs [`contained`] library code.
    static CONTAINED: Cell<bool> = const { Cell::new(false) };
}

/// Installs the process's panic hook (once, at worker start).
pub fn install(stats: Arc<WorkerCounters>) {
    std::panic::set_hook(Box::new(move |info| {
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("unnamed");
        if contained_now() {
            tracing::warn!("a library panicked on a request's input (the request is refused): {info}");
            return;
        }
        if GUARDED.with(Cell::get) {
            tracing::error!("bug: thread {name} panicked serving a request: {info}; that request is answered 500 and the worker will be replaced");
            stats.fault();
            return;
        }
        tracing::error!("bug: thread {name} panicked: {info}; the worker exits (code {EXIT_PANIC}) and is replaced");
        eprintln!("inferd worker: thread {name} panicked: {info}");
        // SAFETY: _exit ends the process without running anything else (no atexit handlers,
        // no destructors that might wait for the thread that just died).
        unsafe { libc::_exit(EXIT_PANIC) }
    }));
}

/// Runs `f` with `flag` set for this thread (what the hook asks), catching a panic in it.
fn catching<R>(flag: &'static LocalKey<Cell<bool>>, f: impl FnOnce() -> R) -> std::thread::Result<R> {
    let outer = flag.with(|g| g.replace(true));
    let result = catch_unwind(AssertUnwindSafe(f));
    flag.with(|g| g.set(outer));
    result
}

/// Runs `f`, catching a panic in it.
pub fn guarded<R>(f: impl FnOnce() -> R) -> std::thread::Result<R> {
    catching(&GUARDED, f)
}

/// Runs `f` outside any guarded region, though its caller may be in one: a panic in it ends the
/// process. For state that every thread of the worker shares (the dispatcher's, taken under
/// its lock by the I/O thread and the lanes): unwound half-changed, it could leave the worker
/// ready but unable to answer.
pub fn unguarded<R>(f: impl FnOnce() -> R) -> R {
    let outer = GUARDED.with(|g| g.replace(false));
    let result = f(); // a panic here never returns: the hook ends the process
    GUARDED.with(|g| g.set(outer));
    result
}

/// Runs library code that works on one request's input alone and keeps no state (an image
/// decoder), turning a panic in it into `Err` with the panic's message: the input is refused
/// as invalid, and the worker is not counted faulty, since nothing it holds was touched.
/// (zune-jpeg 0.5.15, the latest, panics in its AVX2 IDCT on some crafted JPEGs: found by
/// the image_decode fuzz target, tests/fixtures/images/decoder_panic.jpg.)
pub fn contained<R>(f: impl FnOnce() -> R) -> Result<R, Panicked> {
    catching(&CONTAINED, f).map_err(|payload| {
        let message = match (payload.downcast_ref::<&str>(), payload.downcast_ref::<String>()) {
            (Some(s), _) => s.to_string(),
            (_, Some(s)) => s.clone(),
            _ => "a panic".to_string(),
        };
        Panicked { message }
    })
}

/// A panic [`contained`] caught: its message ("a panic" when it had none).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Panicked {
    pub message: String,
}

/// Whether this thread runs [`contained`] code now (a panic hook's question).
pub fn contained_now() -> bool {
    CONTAINED.with(Cell::get)
}

/// `future`, every poll of it [`guarded`]: `Err` once it panicked (it is not polled again).
pub async fn guarded_future<F: Future>(future: F) -> std::thread::Result<F::Output> {
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(|cx| match guarded(|| future.as_mut().poll(cx)) {
        Ok(Poll::Pending) => Poll::Pending,
        Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
        Err(panic) => Poll::Ready(Err(panic)),
    })
    .await
}

/// Test switch for the hostile-input tests: with INFERD_TEST_PANIC="lane:7,batch:9" in its
/// environment, a worker panics where `site` names (`lane`: running the batch, guarded;
/// `batch`: the dispatcher taking the job, on the I/O thread but not guarded; `grpc`: a
/// ModelInfer call, guarded) for a job of that many rows. Never set in production: the variable is read once, and an unset one costs
/// a branch. Only in builds with the `test-switches` feature (`make test`'s), not releases.
#[cfg(not(feature = "test-switches"))]
pub fn test_switch(_site: &str, _rows: Option<usize>) {}

#[cfg(feature = "test-switches")]
pub fn test_switch(site: &str, rows: Option<usize>) {
    static SITES: std::sync::OnceLock<Vec<(String, usize)>> = std::sync::OnceLock::new();
    let sites = SITES.get_or_init(|| {
        let spec = std::env::var("INFERD_TEST_PANIC").unwrap_or_default();
        spec.split(',')
            .filter_map(|s| s.split_once(':'))
            .filter_map(|(site, rows)| Some((site.to_string(), rows.parse().ok()?)))
            .collect()
    });
    if sites.iter().any(|(s, n)| s == site && rows == Some(*n)) {
        panic!("INFERD_TEST_PANIC: a job of {rows:?} rows at {site}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guarded_panic_is_caught_and_the_flag_restored() {
        assert!(guarded(|| panic!("inside")).is_err());
        assert!(!GUARDED.with(Cell::get));
        assert_eq!(guarded(|| 7).unwrap(), 7);
    }

    #[test]
    fn a_guarded_future_answers_its_panic() {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let caught = runtime.block_on(guarded_future(async {
            tokio::task::yield_now().await;
            panic!("after a yield")
        }));
        assert!(caught.is_err());
        assert_eq!(runtime.block_on(guarded_future(async { 3 })).unwrap(), 3);
    }
}
