//! SIGTERM under load: accepted requests complete, the supervisor exits 0, no worker is left.
//! (Own file: it sends real signals.)

use std::io::ErrorKind;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use nix::sys::signal::Signal;

#[test]
fn sigterm_finishes_accepted_requests_exits_0_and_leaves_no_worker() {
    // The drain may take as long as its requests: 6 runs of ~0.4 s on a fast CPU may land on one
    // worker, one after another, on a CPU twice as slow and shared with another test.
    let dir = temp_dir("sigterm");
    let port = free_port();
    let config = write_config(dir.path(), port, test_workers(), &test_models(), "slow", &[], "");
    let text =
        std::fs::read_to_string(&config).unwrap().replace("graceful_timeout_secs = 20", "graceful_timeout_secs = 120");
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    let workers = server.worker_pids();
    let addr = server.addr;

    // Light background load of quick requests until the server is gone.
    let refused = Arc::new(AtomicUsize::new(0));
    let background = Clients::start(1, |_| {
        let refused = refused.clone();
        move || {
            std::thread::sleep(Duration::from_millis(5));
            match request(addr, "POST", "/v2/models/slow/infer", &[], &slow_body(10)) {
                Ok(r) if r.status == 200 => Step::Served,
                Ok(r) => Step::Failed(format!("status {}", r.status)),
                // Not accepted by any worker: refused, or closed before a byte was answered.
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::ConnectionRefused
                            | ErrorKind::ConnectionReset
                            | ErrorKind::UnexpectedEof
                            | ErrorKind::BrokenPipe
                    ) =>
                {
                    refused.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(20));
                    Step::Skipped
                }
                Err(e) => Step::Failed(e.to_string()),
            }
        }
    });

    // Slow requests (~0.4 s of compute each, 3 per worker) still running or queued when SIGTERM
    // arrives, once the workers hold all of them (and at most the background client's one).
    let slow: Vec<_> = (0..6)
        .map(|_| std::thread::spawn(move || request(addr, "POST", "/v2/models/slow/infer", &[], &slow_body(100_000))))
        .collect();
    let started = Instant::now();
    loop {
        let status = server.status();
        let in_flight: u64 =
            status["workers"].as_array().unwrap().iter().map(|w| w["in_flight"].as_u64().unwrap()).sum();
        if in_flight >= 7 || (in_flight >= 6 && started.elapsed() > Duration::from_millis(300)) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "the slow requests were not taken: {status:#}");
        std::thread::sleep(Duration::from_millis(10));
    }
    let term_at = Instant::now();
    server.signal(Signal::SIGTERM);
    for (i, handle) in slow.into_iter().enumerate() {
        let r =
            handle.join().unwrap().unwrap_or_else(|e| panic!("in-flight request {i} failed: {e}\n{}", server.log()));
        assert_eq!(r.status, 200, "in-flight request {i}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["outputs"][0]["shape"], serde_json::json!([1, 256]));
    }
    let status = server.wait_exit(Duration::from_secs(30));
    let Tally { served, failed: partial } = background.stop();
    eprintln!(
        "stopped {:.2} s after SIGTERM; background: {served} ok, {} not accepted",
        term_at.elapsed().as_secs_f64(),
        refused.load(Ordering::Relaxed)
    );
    assert!(partial.is_empty(), "requests cut mid-way: {partial:?}");
    assert!(served > 0);
    assert_eq!(status.code(), Some(0), "log:\n{}", server.log());
    for pid in workers {
        assert!(!process_exists(pid), "worker {pid} outlived the supervisor");
    }
    let log = server.log();
    assert!(log.contains("drained; exiting"), "{log}");
}

/// A worker that stops gracefully on its own (SIGTERM to the worker, not the supervisor)
/// loses no request: it stops accepting, the supervisor takes its slot's socket out of the
/// port's group so that connections queued on it move to its sibling (net.ipv4.
/// tcp_migrate_req), and it finishes what it had accepted. The supervisor then replaces it,
/// and the replacement joins the port on the same socket.
#[test]
fn a_worker_that_drains_loses_no_request() {
    if test_workers() < 2 {
        eprintln!("needs 2 cores: a draining worker needs a sibling to take its traffic");
        return;
    }
    let dir = temp_dir("drain");
    let port = free_port();
    write_config(dir.path(), port, 2, &test_models(), "slow", &[], "");
    let mut server = Server::start(dir, port, &[]);
    let before = server.wait_ready(Duration::from_secs(60));
    let victim = before["workers"][0]["pid"].as_i64().unwrap() as i32;
    let addr = server.addr;

    // Closed-loop clients, a new connection per request, each request ~10 ms of compute; the
    // load is measured in requests served, not seconds, on a CPU of any speed.
    let load = Clients::start(4, |_| move || post_step(addr, "/v2/models/slow/infer", &slow_body(2_000)));
    assert!(load.wait_served(25, Duration::from_secs(60)), "the load did not start");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(victim), Signal::SIGTERM).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let status = server.status();
        let w = &status["workers"][0];
        if w["state"] == "ready" && w["pid"].as_i64() != Some(victim as i64) {
            break;
        }
        assert!(Instant::now() < deadline, "no replacement: {status:#}\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    // And goes on through the replacement: 25 more after it.
    let replaced = load.served();
    assert!(load.wait_served(replaced + 25, Duration::from_secs(60)), "the load stalled after the replacement");
    let tally = load.stop();
    eprintln!(
        "{} requests answered while worker 0 drained and was replaced; {} failed",
        tally.served,
        tally.failed.len()
    );
    tally.assert_served(50, "while worker 0 drained and was replaced");
    assert!(!process_exists(victim));
    let _ = server.wait_ready(Duration::from_secs(1));
}
