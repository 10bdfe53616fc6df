//! Guards: backpressure instead of collapse, stuck workers killed and replaced, hostile
//! clients refused without hurting the worker.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::json;

fn start(tag: &str, extra: &str) -> Server {
    serve(temp_dir(tag), test_workers(), &test_models(), "slow", &["typed"], extra)
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    sorted.get(((sorted.len() as f64 - 1.0) * p) as usize).map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
}

/// Three times more clients than the workers can serve at once: every request is answered,
/// with 200 or an immediate 503 + Retry-After, and the pool serves normally right after.
#[test]
fn overload_gets_fast_503s_and_recovers_at_once() {
    let server = start("overload", "max_queue = 2");
    let addr = server.addr;
    // ~10 ms of compute per request; 2 queued + 1 running per worker are admitted. What is
    // neither a 200 nor a 503 saying when to retry is a failure.
    let (ok, busy) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
    let clients = Clients::start(9 * test_workers(), |_| {
        let (ok, busy) = (ok.clone(), busy.clone());
        move || {
            let started = Instant::now();
            match request(addr, "POST", "/v2/models/slow/infer", &[], &slow_body(2_000)) {
                Ok(r) if r.status == 200 => ok.lock().unwrap().push(started.elapsed()),
                Ok(r) if r.status == 503 && r.header("retry-after") == Some("1") => {
                    busy.lock().unwrap().push(started.elapsed())
                }
                Ok(r) => {
                    return Step::Failed(format!("status {}, Retry-After {:?}", r.status, r.header("retry-after")))
                }
                Err(e) => return Step::Failed(e.to_string()),
            }
            Step::Served
        }
    });
    std::thread::sleep(Duration::from_secs(3));
    let results = clients.stop();
    assert!(results.failed.is_empty(), "not 200 or 503 with Retry-After: 1: {:?}", results.failed);
    let (mut ok, mut busy) = (ok.lock().unwrap().clone(), busy.lock().unwrap().clone());
    ok.sort();
    busy.sort();
    eprintln!(
        "{} answered: {} x 200 (p50 {:.1} ms, p99 {:.1} ms), {} x 503 (p50 {:.1} ms, p99 {:.1} ms)",
        results.served,
        ok.len(),
        percentile(&ok, 0.5),
        percentile(&ok, 0.99),
        busy.len(),
        percentile(&busy, 0.5),
        percentile(&busy, 0.99)
    );
    assert!(!busy.is_empty(), "3x overload produced no 503");
    assert!(ok.len() > 20, "the admitted requests were served");
    // Recovery: with the load gone, requests are served at once.
    for _ in 0..5 {
        assert_eq!(server.request("POST", "/v2/models/slow/infer", &slow_body(2_000)).status, 200);
    }
    assert_eq!(server.status()["phase"], "ready");
}

/// A model run past request_timeout_secs is stopped by its worker: the client gets a 504 that
/// names the limit, and the worker goes on serving (no restart, same processes).
#[test]
fn a_run_past_the_timeout_is_stopped_and_answered() {
    let server = start("run-timeout", "request_timeout_secs = 1");
    let pids = server.worker_pids();
    let started = Instant::now();
    // About an hour of compute.
    let r = request(server.addr, "POST", "/v2/models/slow/infer", &[], &slow_body(1_000_000_000)).unwrap();
    let took = started.elapsed();
    eprintln!("the overlong request was answered {} after {:.2} s", r.status, took.as_secs_f64());
    assert_eq!(r.status, 504, "{}", r.error());
    assert!(r.error().contains("server.request_timeout_secs = 1"), "{}", r.error());
    for _ in 0..4 {
        assert_eq!(server.request("POST", "/v2/models/slow/infer", &slow_body(10)).status, 200);
    }
    let status = server.status();
    assert_eq!(server.worker_pids(), pids, "a worker was replaced: {status:#}");
    assert!(status["workers"].as_array().unwrap().iter().all(|w| w["restarts"] == 0), "{status:#}");
    assert!(server.log().contains("stopping it"), "{}", server.log());
}

/// A worker whose batch timer thread stops beating (here: the whole process stopped) is killed
/// (SIGABRT, then SIGKILL) and replaced, while the other worker serves throughout.
#[test]
fn a_stuck_worker_is_killed_and_replaced() {
    let server = start("stuck", "request_timeout_secs = 1");
    let before = server.status();
    let stuck = before["workers"][0]["pid"].as_i64().unwrap() as i32;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(stuck), nix::sys::signal::Signal::SIGSTOP).unwrap();
    let mut served = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if test_workers() > 1 {
            // A connection the stopped worker accepted waits with it; the others succeed.
            let r = request(server.addr, "POST", "/v2/models/typed/infer", &[], &typed_request());
            if r.is_ok_and(|r| r.status == 200) {
                served += 1;
            }
        }
        let s = server.status();
        let restarted = s["workers"].as_array().unwrap().iter().any(|w| w["restarts"] == 1 && w["state"] == "ready");
        if restarted && s["phase"] == "ready" {
            break s;
        }
        assert!(Instant::now() < deadline, "no replacement: {s:#}\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("{served} other requests served meanwhile");
    assert!(!process_exists(stuck), "the stuck worker is still there");
    let w = status["workers"].as_array().unwrap().iter().find(|w| w["restarts"] == 1).unwrap();
    assert!(w["last_exit"].as_str().unwrap().contains("stuck: the batch timer thread has not beaten"), "{w}");
    assert!(server.log().contains("is stuck"), "{}", server.log());
    if test_workers() > 1 {
        assert!(served > 0);
        let unaffected = status["workers"].as_array().unwrap().iter().filter(|w| w["restarts"] == 0).count();
        assert_eq!(unaffected, before["workers"].as_array().unwrap().len() - 1);
    }
    let metrics = server.metrics_text();
    assert!(metrics.contains("inferd_worker_restarts_total{reason=\"stuck\"} 1"), "{metrics}");
}

/// Slowloris, oversized and too many headers, deep JSON, a tensor shape of 1e9, binary data
/// that disagrees with its header: each refused, the worker still ready, its memory flat.
#[test]
fn hostile_clients_are_refused_and_cost_nothing_lasting() {
    let server = start("hostile", "header_timeout_secs = 1\nmax_connections = 64");
    let rss = |s: &serde_json::Value| -> u64 {
        s["workers"].as_array().unwrap().iter().map(|w| w["rss_bytes"].as_u64().unwrap()).sum()
    };
    let before = rss(&server.status());

    // Slowloris: 40 connections trickling a header byte every 200 ms.
    let trickle: Vec<_> = (0..40)
        .map(|_| {
            let addr = server.addr;
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let started = Instant::now();
                for b in b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaa" {
                    if s.write_all(&[*b]).is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(200));
                    if started.elapsed() > Duration::from_secs(4) {
                        break;
                    }
                }
                let mut rest = Vec::new();
                let _ = s.read_to_end(&mut rest);
                started.elapsed()
            })
        })
        .collect();
    // Meanwhile, normal requests are served.
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..10 {
        assert_eq!(server.request("POST", "/v2/models/slow/infer", &slow_body(10)).status, 200);
    }
    for t in trickle {
        let lasted = t.join().unwrap();
        assert!(lasted < Duration::from_secs(4), "a slowloris connection was kept {lasted:?}");
    }

    let big_header = "x".repeat(20_000);
    let r = request(server.addr, "GET", "/v2/health/ready", &[("X-Big", &big_header)], b"").unwrap();
    assert_eq!(r.status, 431, "oversized header");
    let many: Vec<(String, String)> = (0..100).map(|i| (format!("X-H{i}"), "v".into())).collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let r = request(server.addr, "GET", "/v2/health/ready", &many, b"").unwrap();
    assert_eq!(r.status, 431, "too many headers");

    let deep = format!(
        "{{\"inputs\": [{{\"name\": \"x\", \"shape\": [1], \"datatype\": \"FP32\", \"data\": {}{}}}]}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let r = server.request("POST", "/v2/models/slow/infer", deep.as_bytes());
    assert_eq!(r.status, 400);
    assert!(r.error().contains("recursion limit exceeded"), "{}", r.error());

    let huge = json!({"inputs": [
        {"name": "x", "shape": [1000000000, 256], "datatype": "FP32", "data": [1.0]},
        {"name": "iterations", "shape": [1], "datatype": "INT64", "data": [1]},
    ]});
    let r = server.request("POST", "/v2/models/slow/infer", &serde_json::to_vec(&huge).unwrap());
    assert_eq!(r.status, 400);
    assert!(r.error().contains("has more elements than the request's"), "{}", r.error());

    let head = r#"{"inputs":[{"name":"x","shape":[1,256],"datatype":"FP32","parameters":{"binary_data_size":1024}},{"name":"iterations","shape":[1],"datatype":"INT64","data":[1]}]}"#;
    let mut body = head.as_bytes().to_vec();
    body.extend_from_slice(&[0u8; 1000]);
    let len = head.len().to_string();
    let r = request(server.addr, "POST", "/v2/models/slow/infer", &[("Inference-Header-Content-Length", &len)], &body)
        .unwrap();
    assert_eq!(r.status, 400);
    assert!(r.error().contains("binary_data_size is 1024, but only 1000 bytes"), "{}", r.error());

    let after = server.status();
    assert_eq!(after["phase"], "ready");
    assert!(after["workers"].as_array().unwrap().iter().all(|w| w["restarts"] == 0));
    assert_eq!(server.request("GET", "/v2/health/ready", b"").status, 200);
    let grown = rss(&after) as i64 - before as i64;
    eprintln!("RSS of the pool: {} MiB before, {:+.1} MiB after", before >> 20, grown as f64 / 1048576.0);
    assert!(grown < 16 << 20, "the pool's RSS grew by {grown} bytes");
}

/// KServe's `parameters.timeout` (tritonclient's `timeout`) over REST and gRPC, and the
/// deadline header on TEI's and OpenAI's routes: queued behind a long run, each is answered at
/// its deadline while that run goes on (tests/clients/deadline_check.py), counted 504 under its
/// model and endpoint, and never runs; a timeout that is no number of microseconds is a 400.
#[test]
fn deadlines_on_every_protocol_are_answered_in_time_and_never_run() {
    let dir = temp_dir("deadlines");
    let repository = model_repository(dir.path(), &["minilm", "slow"]);
    let port = free_port();
    write_config(dir.path(), port, 1, &repository, "minilm", &["slow"], "");
    let grpc = format!("127.0.0.1:{}", free_port());
    let mut server = Server::start(dir, port, &["--grpc-listen", &grpc]);
    server.wait_ready(Duration::from_secs(120));
    let runs = |model: &str| metric(&server, &format!("inferd_compute_duration_seconds_count{{model=\"{model}\"}}"));
    let before = (runs("slow"), runs("minilm"));
    let said =
        client_check("deadline_check.py", &[&server.addr.to_string(), &grpc], &server, "deadlines: all checks passed");
    eprintln!("{said}");
    // The long run and the two of 60 s ran; nothing that timed out did.
    assert_eq!((runs("slow") - before.0, runs("minilm") - before.1), (3.0, 0.0), "{}", server.metrics_text());
    let timed_out = |model: &str, endpoint: &str| {
        metric(&server, &format!("inferd_requests_total{{model=\"{model}\",endpoint=\"{endpoint}\",code=\"504\"}}"))
    };
    assert_eq!(timed_out("slow", "infer"), 2.0, "REST and gRPC");
    assert_eq!((timed_out("minilm", "embed"), timed_out("minilm", "openai_embeddings")), (1.0, 1.0));
    server.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(server.wait_exit(Duration::from_secs(30)).code(), Some(0));
}

/// `[batching] max_queue_size` (Triton's per-model queue): with one request of the model
/// running and one waiting, the next is answered 503 with Retry-After at once, naming the
/// setting; the ones in the queue are served, and so is another model.
#[test]
fn a_model_with_its_own_queue_size_refuses_the_request_past_it_at_once() {
    let dir = temp_dir("model-queue");
    let repository = model_repository(dir.path(), &["typed"]);
    model_of_file(&repository, "slow", &test_models().join("slow/model.onnx"), "[batching]\nmax_queue_size = 1\n");
    let port = free_port();
    write_config(dir.path(), port, 1, &repository, "slow", &["typed"], "");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    let addr = server.addr;
    let send = move |iterations| {
        std::thread::spawn(move || request(addr, "POST", "/v2/models/slow/infer", &[], &slow_body(iterations)).unwrap())
    };
    // Seconds of the worker's one lane, then one waiting behind it.
    let long = send(1_000_000);
    std::thread::sleep(Duration::from_millis(300));
    let queued = send(10);
    std::thread::sleep(Duration::from_millis(300));
    let refused = request(addr, "POST", "/v2/models/slow/infer", &[], &slow_body(10)).unwrap();
    assert_eq!(refused.status, 503, "{}", String::from_utf8_lossy(&refused.body));
    assert!(refused.header("retry-after").is_some(), "{:?}", refused.headers);
    assert!(refused.error().contains("[batching] max_queue_size"), "{}", refused.error());
    assert!(!long.is_finished(), "the long run ended before the refusal: nothing was queued");
    // Another model queues as server.max_queue allows.
    let other = request(addr, "POST", "/v2/models/typed/infer", &[], &typed_request()).unwrap();
    assert_eq!(other.status, 200, "{}", String::from_utf8_lossy(&other.body));
    assert_eq!((long.join().unwrap().status, queued.join().unwrap().status), (200, 200));
    let refusals = metric(&server, "inferd_requests_total{model=\"slow\",endpoint=\"infer\",code=\"503\"}");
    assert_eq!(refusals, 1.0);
    server.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(server.wait_exit(Duration::from_secs(30)).code(), Some(0));
}

/// The limit holds for the pool, as Triton's one queue does (its L0_http
/// `test_descriptive_status_code`, whose second request comes on a new connection): with a
/// run and a request waiting on one worker, a request that reaches the other worker, idle, is
/// refused all the same; once the queue is empty, that worker serves the model again.
#[test]
fn a_models_queue_size_holds_across_the_pools_workers() {
    let dir = temp_dir("pool-queue");
    let repository = model_repository(dir.path(), &[]);
    model_of_file(&repository, "slow", &test_models().join("slow/model.onnx"), "[batching]\nmax_queue_size = 1\n");
    let server = serve(dir, 2, &repository, "slow", &[], "max_requests_per_connection = 0");
    // Kept connections: two to worker 0, one to worker 1 (new connections until they are).
    let (mut zero, mut one) = (Vec::new(), Vec::new());
    for _ in 0..400 {
        let mut c = Connection::open(server.addr).unwrap();
        let r = c.send("GET", "/v2/health/ready", &[], b"").unwrap();
        match r.header("x-inferd-worker").filter(|_| !r.closes()) {
            Some("0") if zero.len() < 2 => zero.push(c),
            Some("1") if one.is_empty() => one.push(c),
            _ => {}
        }
        if zero.len() == 2 && one.len() == 1 {
            break;
        }
    }
    let (Some(mut third), Some(mut first), Some(mut second)) = (zero.pop(), zero.pop(), one.pop()) else {
        panic!("400 connections did not reach both workers")
    };
    // Worker 0: one long run, then one request waiting behind it (its lane is busy).
    let long = std::thread::spawn(move || first.post("/v2/models/slow/infer", &slow_body(1_000_000)).unwrap());
    std::thread::sleep(Duration::from_millis(300));
    let queued = std::thread::spawn(move || third.post("/v2/models/slow/infer", &slow_body(10)).unwrap());
    std::thread::sleep(Duration::from_millis(500));
    let refused = second.post("/v2/models/slow/infer", &slow_body(10)).unwrap();
    assert_eq!(refused.header("x-inferd-worker"), Some("1"));
    assert_eq!(refused.status, 503, "worker 1 is idle, but the pool's queue is full: {}", refused.error());
    assert!(refused.error().contains("1 requests are already waiting"), "{}", refused.error());
    assert!(!long.is_finished(), "the long run ended before the refusal: nothing was queued");
    let (long, queued) = (long.join().unwrap(), queued.join().unwrap());
    assert_eq!((long.status, queued.status), (200, 200), "{} {}", long.error(), queued.error());
    assert_eq!(queued.header("x-inferd-worker"), Some("0"));
    // The queue is empty again: the model is served (on a new connection: the kept one may
    // have been idle past the keep-alive timeout).
    let served = request(server.addr, "POST", "/v2/models/slow/infer", &[], &slow_body(10)).unwrap();
    assert_eq!(served.status, 200, "{}", served.error());
}

fn metric(server: &Server, prefix: &str) -> f64 {
    metric_value(&server.metrics_text(), prefix).unwrap_or(0.0)
}

/// A request whose client deadline passes while it waits for the model is dropped before
/// the model sees it (504), and one whose body bytes would pass the worker's budget gets a
/// fast 503.
#[test]
fn deadlines_and_the_bytes_in_flight_budget() {
    let dir = temp_dir("deadline");
    let port = free_port();
    write_config(
        dir.path(),
        port,
        1,
        &test_models(),
        "slow",
        &[],
        "max_body_bytes = 65536\nmax_body_bytes_in_flight = 65536",
    );
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    let addr = server.addr;
    // ~0.4 s of compute ahead in the queue.
    let long = std::thread::spawn(move || {
        request(addr, "POST", "/v2/models/slow/infer", &[], &slow_body(100_000)).map(|r| r.status)
    });
    std::thread::sleep(Duration::from_millis(100));
    let r = request(addr, "POST", "/v2/models/slow/infer", &[("X-Inferd-Deadline-Ms", "50")], &slow_body(10)).unwrap();
    assert_eq!(r.status, 504, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.error().contains("deadline passed"), "{}", r.error());
    assert_eq!(long.join().unwrap().unwrap(), 200);
    assert_eq!(
        metric(&server, "inferd_compute_duration_seconds_count{model=\"slow\"}"),
        1.0,
        "the dropped request never ran"
    );
    assert_eq!(metric(&server, "inferd_requests_total{model=\"slow\",endpoint=\"infer\",code=\"504\"}"), 1.0);
    let r =
        request(addr, "POST", "/v2/models/slow/infer", &[("X-Inferd-Deadline-Ms", "soon")], &slow_body(10)).unwrap();
    assert_eq!(r.status, 400);

    // One client holds 60000 body bytes (sending slowly); the next 10000 do not fit.
    let mut slow_sender = std::net::TcpStream::connect(addr).unwrap();
    slow_sender
        .write_all(b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 60000\r\n\r\n{\"inputs\":")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let r = request(addr, "POST", "/v2/models/slow/infer", &[("Content-Length", "10000")], &[b' '; 10000]).unwrap();
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.error().contains("too many request bytes in flight"), "{}", r.error());
    drop(slow_sender);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(request(addr, "POST", "/v2/models/slow/infer", &[], &slow_body(10)).unwrap().status, 200);
    server.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(server.wait_exit(Duration::from_secs(30)).code(), Some(0));
}
