//! Keep-alive clients across everything that retires a worker while the pool serves: rolling
//! reloads, `scale -1`, and recycling after `max_requests`. Clients keep one connection each,
//! pause 0-30 ms between requests (so their connections sit idle when a worker drains) and
//! never retry: a request that fails is a failure. A retiring worker hands its idle
//! connections to a sibling instead of closing them under the client.

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;

/// Keep-alive clients pausing 0-`pause_ms` ms between requests (different pauses for each);
/// `announced_closes` counts the connections the server closed with notice (`Connection:
/// close`, which a client handles by reconnecting).
fn clients(addr: std::net::SocketAddr, n: usize, pause_ms: u64, announced_closes: Arc<AtomicU64>) -> Clients {
    Clients::start(n, |i| {
        let (body, announced_closes) = (typed_request(), announced_closes.clone());
        // A small LCG per client.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15 ^ (i as u64 + 1);
        let mut connection = Connection::open(addr).unwrap();
        move || {
            let step = match connection.post("/v2/models/typed/infer", &body) {
                Ok(answer) if answer.status == 200 => {
                    if answer.closes() {
                        announced_closes.fetch_add(1, Ordering::Relaxed);
                        connection = Connection::open(addr).unwrap();
                    }
                    Step::Served
                }
                Ok(answer) => Step::Failed(format!("status {}", answer.status)),
                Err(e) => {
                    connection = Connection::open(addr).unwrap();
                    Step::Failed(e.to_string())
                }
            };
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            std::thread::sleep(Duration::from_millis((x >> 33) % (pause_ms + 1)));
            step
        }
    })
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
    // Recycling too: each worker is replaced after max_requests plus up to a third more.
    let recycling = format!("max_requests = {max_requests}\nmax_requests_jitter = {}", max_requests / 3);
    let server = serve(temp_dir("keepalive"), workers, &test_models(), "typed", &[], &recycling);
    let announced_closes = Arc::new(AtomicU64::new(0));
    let load = clients(server.addr, clients_n, pause_ms, announced_closes.clone());

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
    let seen = load.stop();
    let status = server.status();
    let recycled = metric_value(&server.metrics_text(), "inferd_worker_recycles_total{reason=\"max_requests\"}");
    eprintln!(
        "{clients_n} clients pausing 0-{pause_ms} ms: {} answered, {} failed, {} closes announced; generation {}, \
         recycled for max_requests: {recycled:?}",
        seen.served,
        seen.failed.len(),
        announced_closes.load(Ordering::Relaxed),
        status["generation"]
    );
    seen.assert_served(300, "while workers retired");
    assert_eq!(status["generation"], 5);
    assert!(recycled.unwrap_or(0.0) >= 1.0, "no worker was recycled for max_requests");
    assert!(server.log().contains("handing_over=true"), "no worker handed its connections over:\n{}", server.log());
}
