//! SIGTERM under load: accepted requests complete, the supervisor exits 0, no worker is left.
//! (Own file: it sends real signals.)

mod common;

use std::io::ErrorKind;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;

#[test]
fn sigterm_finishes_accepted_requests_exits_0_and_leaves_no_worker() {
    let dir = TempDir::new("sigterm");
    let port = free_port();
    write_config(
        dir.path(),
        port,
        test_workers(),
        &test_models(),
        "slow",
        &[],
        "",
    );
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    let workers = server.worker_pids();
    let addr = server.addr;

    // Light background load of quick requests until the server is gone.
    let stop = Arc::new(AtomicBool::new(false));
    let background = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut ok, mut refused, mut partial) = (0, 0, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                match request(addr, "POST", "/v2/models/slow/infer", &[], &slow_body(10)) {
                    Ok(r) if r.status == 200 => ok += 1,
                    Ok(r) => partial.push(format!("status {}", r.status)),
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
                        refused += 1;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => partial.push(e.to_string()),
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            (ok, refused, partial)
        })
    };

    // Slow requests (~0.4 s of compute each, 3 per worker) still running or queued when SIGTERM
    // arrives 0.3 s later.
    let slow: Vec<_> = (0..6)
        .map(|_| {
            std::thread::spawn(move || {
                request(
                    addr,
                    "POST",
                    "/v2/models/slow/infer",
                    &[],
                    &slow_body(100_000),
                )
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let term_at = Instant::now();
    server.signal(Signal::SIGTERM);
    for (i, handle) in slow.into_iter().enumerate() {
        let r = handle
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("in-flight request {i} failed: {e}\n{}", server.log()));
        assert_eq!(
            r.status,
            200,
            "in-flight request {i}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(r.json()["outputs"][0]["shape"], serde_json::json!([1, 256]));
    }
    let status = server.wait_exit(Duration::from_secs(30));
    stop.store(true, Ordering::Relaxed);
    let (ok, refused, partial) = background.join().unwrap();
    eprintln!(
        "stopped {:.2} s after SIGTERM; background: {ok} ok, {refused} not accepted",
        term_at.elapsed().as_secs_f64()
    );
    assert!(partial.is_empty(), "requests cut mid-way: {partial:?}");
    assert!(ok > 0);
    assert_eq!(status.code(), Some(0), "log:\n{}", server.log());
    for pid in workers {
        assert!(!process_exists(pid), "worker {pid} outlived the supervisor");
    }
    let log = server.log();
    assert!(log.contains("drained; exiting"), "{log}");
}
