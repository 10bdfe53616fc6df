//! Keep-alive clients across everything that retires a worker while the pool serves: rolling
//! reloads, `scale -1`, and recycling after `max_requests`. Clients keep one connection each,
//! pause 0-30 ms between requests (so their connections sit idle when a worker drains) and
//! never retry: a request that fails is a failure. A retiring worker hands its idle
//! connections to a sibling instead of closing them under the client.

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use inferd_bench::load::Connection;

/// What the clients saw: answers, failures (with what went wrong), and connections the
/// server closed with notice (`Connection: close`, which a client handles by reconnecting).
#[derive(Default)]
struct Seen {
    ok: u64,
    failed: Vec<String>,
    announced_closes: u64,
}

fn clients(
    addr: String,
    n: usize,
    pause_ms: u64,
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
) -> Vec<std::thread::JoinHandle<()>> {
    (0..n)
        .map(|i| {
            let (addr, stop, seen) = (addr.clone(), stop.clone(), seen.clone());
            std::thread::spawn(move || {
                let body = typed_request();
                // A small LCG per client: pauses of 0-`pause_ms` ms, different for each.
                let mut x: u64 = 0x9e37_79b9_7f4a_7c15 ^ (i as u64 + 1);
                let mut connection = Connection::open(&addr).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    match connection.post(&addr, "/v2/models/typed/infer", &body) {
                        Ok(answer) if answer.status == 200 => {
                            let mut s = seen.lock().unwrap();
                            s.ok += 1;
                            if answer.close {
                                s.announced_closes += 1;
                                drop(s);
                                connection = Connection::open(&addr).unwrap();
                            }
                        }
                        Ok(answer) => seen.lock().unwrap().failed.push(format!("status {}", answer.status)),
                        Err(e) => {
                            seen.lock().unwrap().failed.push(format!("{e:#}"));
                            connection = Connection::open(&addr).unwrap();
                        }
                    }
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    std::thread::sleep(Duration::from_millis((x >> 33) % (pause_ms + 1)));
                }
            })
        })
        .collect()
}

fn control(server: &Server, args: &[&str]) {
    let out = Command::new(BIN).args(args).arg("--control-socket").arg(&server.socket).output().unwrap();
    assert!(
        out.status.success(),
        "inferd {args:?}: {}{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        server.log()
    );
}

/// Waits until the pool is ready with `workers` workers and no retiring one left.
fn settle(server: &Server, workers: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = server.status();
        let all = status["workers"].as_array().unwrap();
        if status["phase"] == "ready" && all.len() == workers && all.iter().all(|w| w["state"] == "ready") {
            return;
        }
        assert!(Instant::now() < deadline, "the pool did not settle: {status:#}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn keep_alive_clients_lose_nothing_when_workers_retire() {
    workers_retire_under(16, 30, 150);
}

#[test]
fn many_slow_keep_alive_clients_lose_nothing_when_workers_retire() {
    workers_retire_under(32, 200, 40);
}

/// `clients_n` keep-alive clients pausing up to `pause_ms` between requests, through 4
/// reloads, 2 rounds of scale -1/+1 (2 workers) and recycling after `max_requests`.
fn workers_retire_under(clients_n: usize, pause_ms: u64, max_requests: u64) {
    let workers = test_workers();
    let dir = TempDir::new("keepalive");
    let port = free_port();
    // Recycling too: each worker is replaced after max_requests plus up to a third more.
    let recycling = format!("max_requests = {max_requests}\nmax_requests_jitter = {}", max_requests / 3);
    write_config(dir.path(), port, workers, &test_models(), "typed", &[], &recycling);
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let threads = clients(server.addr.to_string(), clients_n, pause_ms, stop.clone(), seen.clone());

    std::thread::sleep(Duration::from_millis(500));
    for round in 0..4 {
        control(&server, &["reload", "--wait"]);
        settle(&server, workers);
        if workers > 1 && round % 2 == 1 {
            control(&server, &["scale", "-1"]);
            settle(&server, workers - 1);
            control(&server, &["scale", "+1"]);
            settle(&server, workers);
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    stop.store(true, Ordering::Relaxed);
    threads.into_iter().for_each(|t| t.join().unwrap());

    let seen = seen.lock().unwrap();
    let status = server.status();
    let recycled = metric_value(&server.metrics_text(), "inferd_worker_recycles_total{reason=\"max_requests\"}");
    eprintln!(
        "{clients_n} clients pausing 0-{pause_ms} ms: {} answered, {} failed, {} closes announced; generation {}, \
         recycled for max_requests: {recycled:?}",
        seen.ok,
        seen.failed.len(),
        seen.announced_closes,
        status["generation"]
    );
    assert!(
        seen.failed.is_empty(),
        "{} of {} requests failed: {:?}\n{}",
        seen.failed.len(),
        seen.ok,
        seen.failed,
        server.log()
    );
    assert!(seen.ok > 300, "only {} requests answered", seen.ok);
    assert_eq!(status["generation"], 5);
    assert!(recycled.unwrap_or(0.0) >= 1.0, "no worker was recycled for max_requests");
    assert!(server.log().contains("handing_over=true"), "no worker handed its connections over:\n{}", server.log());
}
