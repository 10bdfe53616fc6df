//! Prometheus metrics: a real Prometheus server (the Debian package, started here on
//! loopback) scrapes the supervisor's admin listener, and its query API must count exactly
//! the requests the test sent, also across a worker's SIGKILL.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// The value of a scalar-ish PromQL query, if Prometheus has one yet.
fn query(p: &Prometheus, promql: &str) -> Option<f64> {
    p.query(promql)?["data"]["result"][0]["value"][1].as_str()?.parse().ok()
}

fn wait_for(p: &Prometheus, promql: &str, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(45);
    let mut last = None;
    while Instant::now() < deadline {
        last = query(p, promql);
        if last == Some(want) {
            return;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    panic!("Prometheus says {promql} = {last:?}, expected {want}");
}

#[test]
fn prometheus_counts_every_request_across_a_worker_sigkill() {
    let dir = TempDir::new("metrics");
    let port = free_port();
    write_config(dir.path(), port, test_workers(), &test_models(), "typed", &[], "");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    let prom_dir = TempDir::new("prometheus");
    let prom = Prometheus::start(prom_dir.path(), server.admin_addr());

    let send = |server: &Server, good_n: usize, bad_n: usize| {
        for _ in 0..good_n {
            assert_eq!(server.request("POST", "/v2/models/typed/infer", &typed_request()).status, 200);
        }
        for _ in 0..bad_n {
            assert_eq!(server.request("POST", "/v2/models/typed/infer", b"{\"inputs\": 1}").status, 400);
        }
    };
    send(&server, 120, 7);
    // Every worker has answered something: SIGKILL worker 0 between requests.
    let victim = server.worker_pids()[0];
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(victim), nix::sys::signal::Signal::SIGKILL).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let s = server.status();
        if s["phase"] == "ready" && s["workers"][0]["pid"].as_i64() != Some(victim as i64) {
            break;
        }
        assert!(Instant::now() < deadline, "no replacement: {s:#}");
        std::thread::sleep(Duration::from_millis(50));
    }
    send(&server, 80, 3);

    // The text the supervisor serves, straight.
    let text = server.metrics_text();
    let line = |prefix: &str| metric_value(&text, prefix).unwrap_or_else(|| panic!("no {prefix} in:\n{text}"));
    assert_eq!(line("inferd_requests_total{model=\"typed\",endpoint=\"infer\",code=\"200\"}"), 200.0);
    assert_eq!(line("inferd_requests_total{model=\"typed\",endpoint=\"infer\",code=\"400\"}"), 10.0);
    assert_eq!(line("inferd_worker_restarts_total{reason=\"signal\"}"), 1.0);
    assert_eq!(line("inferd_compute_duration_seconds_count{model=\"typed\"}"), 200.0);
    assert!(text.contains("inferd_model_info{model=\"typed\",version=\"1\",sha256=\""), "{text}");

    // And what Prometheus scraped.
    wait_for(&prom, "sum(inferd_requests_total)", 210.0);
    wait_for(&prom, "sum(inferd_requests_total{code=\"400\"})", 10.0);
    wait_for(&prom, "inferd_workers_ready", test_workers() as f64);
    wait_for(&prom, "inferd_worker_restarts_total{reason=\"signal\"}", 1.0);
}
