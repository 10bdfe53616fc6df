//! API keys' limits (the keys file's `rate=`, `burst=` and `concurrency=`; docs/configuration.md,
//! "API keys"): pool-wide, whichever worker a request lands on. A key over its rate or its
//! concurrency gets 429 with Retry-After and `RateLimit` headers, naming the limit, while
//! another key's requests all succeed; requests are counted by key name and priority in
//! /metrics; the requests in flight of a worker killed mid-request do not count against its key.

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::common::*;

const MODEL_PATH: &str = "/v2/models/typed/infer";

/// `typed` on two workers, with the keys of `keys`.
fn start(tag: &str, keys: &str) -> Server {
    let dir = temp_dir(tag);
    let file = dir.path().join("keys");
    std::fs::write(&file, keys).unwrap();
    std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let repository = model_repository(dir.path(), &["typed"]);
    let port = free_port();
    write_config(dir.path(), port, 2, &repository, "typed", &[], "[auth]\napi_keys_file = \"keys\"");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(90));
    server
}

fn post(server: &Server, key: &str) -> Response {
    let bearer = format!("Bearer {key}");
    let headers = [("Content-Type", "application/json"), ("Authorization", bearer.as_str())];
    inferd_bench::http::request(server.addr, "POST", MODEL_PATH, &headers, &typed_request()).unwrap()
}

fn metric(server: &Server, series: &str) -> f64 {
    metric_value(&server.metrics_text(), &format!("{series} ")).unwrap_or(0.0)
}

#[test]
fn a_key_over_its_rate_gets_429_with_retry_after_pool_wide_while_another_keys_requests_all_succeed() {
    // 10 a second with a burst of 5, for the whole pool of two workers.
    let server =
        start("key-rate", "bulk-key-0123456789 name=reindex rate=10/s burst=5\nuser-key-0123456789 name=web\n");
    let started = Instant::now();
    // The bulk client, four threads at full speed, a new connection per request: SO_REUSEPORT
    // spreads them over both workers.
    let bulk: Vec<_> = (0..4)
        .map(|_| {
            let addr = server.addr;
            std::thread::spawn(move || {
                let mut answers = Vec::new();
                let until = Instant::now() + Duration::from_secs(3);
                while Instant::now() < until {
                    let headers =
                        [("Content-Type", "application/json"), ("Authorization", "Bearer bulk-key-0123456789")];
                    let r = inferd_bench::http::request(addr, "POST", MODEL_PATH, &headers, &typed_request()).unwrap();
                    answers.push(r);
                }
                answers
            })
        })
        .collect();
    // The other key's client meanwhile.
    let mut web = Vec::new();
    for _ in 0..30 {
        web.push(post(&server, "user-key-0123456789"));
        std::thread::sleep(Duration::from_millis(50));
    }
    let bulk: Vec<Response> = bulk.into_iter().flat_map(|b| b.join().unwrap()).collect();
    let elapsed = started.elapsed().as_secs_f64();
    for r in &web {
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.header("ratelimit"), None, "a key without a rate has no RateLimit header");
    }
    let admitted: Vec<&Response> = bulk.iter().filter(|r| r.status == 200).collect();
    let refused: Vec<&Response> = bulk.iter().filter(|r| r.status == 429).collect();
    assert_eq!(admitted.len() + refused.len(), bulk.len(), "only 200 and 429");
    eprintln!("bulk: {} admitted, {} refused in {elapsed:.2} s", admitted.len(), refused.len());
    // GCRA admits at most the burst plus the rate over the time: pool-wide, not per worker.
    assert!(admitted.len() >= 5, "at least the burst is admitted");
    assert!(
        admitted.len() as f64 <= 5.0 + 10.0 * elapsed + 1.0,
        "{} admitted in {elapsed:.2} s: more than 10/s with a burst of 5",
        admitted.len()
    );
    assert!(!refused.is_empty());
    for r in &admitted {
        assert_eq!(r.header("ratelimit-policy"), Some("\"key\";q=5;w=1"));
        let state = r.header("ratelimit").expect("RateLimit on an admitted answer");
        assert!(state.starts_with("\"key\";r=") && state.contains(";t="), "{state}");
    }
    for r in &refused {
        let retry: u64 = r.header("retry-after").expect("Retry-After").parse().unwrap();
        assert!(retry >= 1);
        assert_eq!(r.header("ratelimit"), Some(format!("\"key\";r=0;t={retry}").as_str()));
        let body = String::from_utf8_lossy(&r.body);
        assert!(body.contains("\\\"reindex\\\" is over its rate of 10/s (burst 5)"), "{body}");
    }
    // Counted by key name and priority, and the refusals by limit.
    assert_eq!(metric(&server, "inferd_key_requests_total{key=\"reindex\",priority=\"0\"}"), admitted.len() as f64);
    assert_eq!(metric(&server, "inferd_key_requests_total{key=\"web\",priority=\"0\"}"), 30.0);
    assert_eq!(metric(&server, "inferd_key_limited_total{key=\"reindex\",limit=\"rate\"}"), refused.len() as f64);
    assert_eq!(metric(&server, "inferd_key_limited_total{key=\"web\",limit=\"rate\"}"), 0.0);
    // A second later, the key is admitted again.
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(post(&server, "bulk-key-0123456789").status, 200);
}

/// A request whose headers are sent and whose body is not: admitted (keys are checked on the
/// headers) and in flight until its connection closes.
fn hold(server: &Server, key: &str) -> TcpStream {
    let mut stream = TcpStream::connect(server.addr).unwrap();
    let head = format!(
        "POST {MODEL_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n\
         Content-Length: 1000\r\n\r\n{{\"inputs\": ["
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream
}

fn wait_in_flight(server: &Server, n: f64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric(server, "inferd_key_in_flight{key=\"slow\"}") != n {
        assert!(Instant::now() < deadline, "in flight never {n}:\n{}", server.metrics_text());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_keys_concurrency_is_pool_wide_and_a_killed_worker_leaves_none_of_its_requests_counted() {
    let server =
        start("key-concurrency", "slow-key-0123456789 name=slow concurrency=3\nuser-key-0123456789 name=web\n");
    let mut held: Vec<TcpStream> = (0..3).map(|_| hold(&server, "slow-key-0123456789")).collect();
    wait_in_flight(&server, 3.0);
    // Whichever workers hold the three, a fourth is refused on either.
    for _ in 0..6 {
        let r = post(&server, "slow-key-0123456789");
        assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.header("retry-after"), Some("1"));
        assert!(String::from_utf8_lossy(&r.body).contains("3 requests in flight, its concurrency limit"));
    }
    assert_eq!(post(&server, "user-key-0123456789").status, 200, "another key is served");
    // One given up: its place is free again.
    drop(held.pop());
    wait_in_flight(&server, 2.0);
    assert_eq!(post(&server, "slow-key-0123456789").status, 200);
    // Both workers killed while they hold requests: the supervisor forgets their requests.
    let more = hold(&server, "slow-key-0123456789");
    wait_in_flight(&server, 3.0);
    let before = server.worker_pids();
    for &pid in &before {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    }
    drop((held, more));
    let deadline = Instant::now() + Duration::from_secs(120);
    while server.try_status().is_none_or(|s| s["phase"] != "ready")
        || server.worker_pids().iter().any(|p| before.contains(p))
    {
        assert!(Instant::now() < deadline, "the workers were not replaced:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(200));
    }
    wait_in_flight(&server, 0.0);
    let again: Vec<TcpStream> = (0..3).map(|_| hold(&server, "slow-key-0123456789")).collect();
    wait_in_flight(&server, 3.0);
    assert_eq!(post(&server, "slow-key-0123456789").status, 429);
    drop(again);
    wait_in_flight(&server, 0.0);
    assert_eq!(post(&server, "slow-key-0123456789").status, 200);
    assert!(metric(&server, "inferd_key_limited_total{key=\"slow\",limit=\"concurrency\"}") >= 7.0);
}
