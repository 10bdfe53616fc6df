//! `[models] memory_budget`: with models on demand, each worker keeps what it holds within its
//! share of the budget, evicting idle models before a load; many models, several times the
//! budget, served under Zipf-distributed traffic with every answer its own model's; a model
//! too large for the budget refused naming both sizes.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use inferd_bench::models::{answer, close, generate, request, row, trace, tree_pss, Mlp, Outcome, BYTES_PER_HIDDEN};

use crate::common::*;

const MIB: usize = 1 << 20;

/// A pool of `test_workers()` serving `typed` (pinned) and every other model of
/// `repository` on demand, within `budget` bytes.
fn budget_server(dir: TempDir, repository: &Path, budget: usize, extra_models: &str) -> Server {
    let port = free_port();
    let config = write_config(dir.path(), port, test_workers(), repository, "typed", &[], "");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str(&format!("on_demand = true\nmemory_budget = \"{} MiB\"\n{extra_models}", budget / MIB));
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    server
}

/// The sum of `metric`'s series whose labels contain `labels`.
fn metric_sum(text: &str, metric: &str, labels: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn ninety_models_four_times_the_budget_serve_zipf_traffic_with_their_own_answers_within_it() {
    let dir = temp_dir("budget");
    let repository = model_repository(dir.path(), &["typed"]);
    let models = generate(&repository, 90, 5, 30).unwrap();
    let total: usize = models.iter().map(|m| m.hidden * BYTES_PER_HIDDEN).sum();
    // Each worker's share holds the largest model's first load (its weights prepared then),
    // beside the worker itself.
    let budget = 180 * MIB * test_workers();
    assert!(total >= 4 * budget, "the models ({} MiB) are at least 4x the budget ({} MiB)", total / MIB, budget / MIB);
    let server = budget_server(dir, &repository, budget, "");
    let pids = || {
        let mut pids = server.worker_pids();
        pids.sort();
        pids
    };
    let workers = pids();

    // The pool's PSS every 100 ms while the clients run.
    let running = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (running, supervisor) = (running.clone(), server.process.pid() as u32);
        std::thread::spawn(move || {
            let mut peak = 0;
            while running.load(Ordering::Relaxed) {
                peak = peak.max(tree_pss(supervisor));
                std::thread::sleep(Duration::from_millis(100));
            }
            peak
        })
    };
    let seconds: f64 = std::env::var("INFERD_TEST_BUDGET_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60.0);
    let sent = trace(server.addr, &models, 8, seconds, 1.0);
    running.store(false, Ordering::Relaxed);
    let peak = sampler.join().unwrap() as usize;
    let answered = sent.iter().filter(|s| s.outcome == Outcome::Answered).count();
    let busy = sent.iter().filter(|s| s.outcome == Outcome::Busy).count();
    let failures: Vec<&Outcome> = sent.iter().map(|s| &s.outcome).filter(|o| matches!(o, Outcome::Failed(_))).collect();
    // What the workers logged, once the supervisor has counted it too (their reports reach
    // it a moment after).
    let (mut metrics, mut log) = (String::new(), String::new());
    let logged = |log: &str, what: &str| log.lines().filter(|l| l.contains(what)).count();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::time::Instant::now() < deadline {
        (metrics, log) = (server.metrics_text(), server.log());
        let counted = metric_sum(&metrics, "inferd_model_loads_total", "reason=\"on_demand\"")
            + metric_sum(&metrics, "inferd_model_evictions_total", "");
        if counted == (logged(&log, "loaded on demand in") + logged(&log, "to make room for another model")) as f64 {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let (loads, evictions) = (logged(&log, "loaded on demand in"), logged(&log, "to make room for another model"));
    eprintln!(
        "{answered} answered, {busy} 503, {} failed in {seconds} s; {loads} loads, {evictions} evictions; peak pool \
         PSS {} MiB for a budget of {} MiB",
        failures.len(),
        peak / MIB,
        budget / MIB
    );
    assert!(failures.is_empty(), "{} failed requests, first: {:?}", failures.len(), &failures[..failures.len().min(5)]);
    assert!(answered > 0);
    assert!((busy as f64) < 0.01 * (answered + busy) as f64, "{busy} of {} requests answered 503", answered + busy);
    assert!(peak <= budget + budget / 10, "the pool's PSS reached {} MiB, budget {} MiB", peak / MIB, budget / MIB);
    // The budget held: the pool evicted to load others.
    assert!(evictions > 0, "no model was evicted:\n{log}");
    // No worker replaced (for memory or anything else).
    assert_eq!(pids(), workers, "a worker was replaced:\n{log}");
    assert_eq!(metric_sum(&metrics, "inferd_worker_recycles_total", ""), 0.0, "{metrics}");
    assert_eq!(metric_sum(&metrics, "inferd_worker_restarts_total", ""), 0.0, "{metrics}");
    // Loads and evictions counted exactly, by model.
    let mut counted: HashMap<&str, (usize, usize)> = HashMap::new();
    for line in log.lines() {
        let Some(model) = line.split("model=\"").nth(1).and_then(|m| m.split('"').next()) else { continue };
        if line.contains("loaded on demand in") {
            counted.entry(model).or_default().0 += 1;
        } else if line.contains("to make room for another model") {
            counted.entry(model).or_default().1 += 1;
        }
    }
    for (model, (loads, evictions)) in counted {
        let labels = format!("model=\"{model}\"");
        let loaded = metric_sum(&metrics, "inferd_model_loads_total", &format!("{labels},reason=\"on_demand\""));
        assert_eq!(loaded, loads as f64, "{model}'s loads in /metrics");
        assert_eq!(metric_sum(&metrics, "inferd_model_evictions_total", &labels), evictions as f64, "{model}");
    }
    assert_eq!(metric_sum(&metrics, "inferd_model_loads_total", "reason=\"on_demand\""), loads as f64);
    assert_eq!(metric_sum(&metrics, "inferd_model_evictions_total", ""), evictions as f64);
    assert_eq!(metric_value(&metrics, "inferd_models_budget_bytes"), Some(budget as f64), "{metrics}");
}

#[test]
fn a_model_larger_than_the_budget_is_refused_naming_both_sizes_and_others_still_load() {
    let dir = temp_dir("budget-large");
    let repository = model_repository(dir.path(), &["typed"]);
    Mlp::of_size(1, 6 * MIB).write(&repository.join("small"), "small").unwrap();
    let large = Mlp::of_size(2, 160 * MIB);
    large.write(&repository.join("large"), "large").unwrap();
    let budget = 100 * MIB * test_workers();
    let server = budget_server(dir, &repository, budget, "");
    let refused = server.request("POST", "/v2/models/large/infer", &request(&row(0)));
    assert_eq!(refused.status, 500, "{}", String::from_utf8_lossy(&refused.body));
    let message = refused.error();
    assert!(
        message.contains("model 'large' needs 160 MiB") && message.contains("share of models.memory_budget is 100 MiB"),
        "{message}"
    );
    // Refused again at once while its file is the same: the loader asked once per worker.
    for _ in 0..6 {
        let again = server.request("POST", "/v2/models/large/infer", &request(&row(0)));
        assert_eq!(again.status, 500);
        assert!(again.error().contains("model 'large' needs 160 MiB"), "{}", again.error());
    }
    let asked = server.log().lines().filter(|l| l.contains("cannot load on demand") && l.contains("'large'")).count();
    assert!((1..=test_workers()).contains(&asked), "the loader was asked {asked} times:\n{}", server.log());
    let small = server.request("POST", "/v2/models/small/infer", &request(&row(1)));
    assert_eq!(small.status, 200, "{}", String::from_utf8_lossy(&small.body));
    let want = Mlp::of_size(1, 6 * MIB).reference(&row(1));
    assert!(close(&answer(&small.json()).unwrap(), &want));
    // A load waited for: Server-Timing says how long.
    assert!(small.server_timing("load").is_some(), "{:?}", small.headers);
    // `inferd check` says so before any request: the largest, what never fits, and what may
    // peak past a share's room while it loads (5 times its file, estimated).
    let said = server.check();
    assert!(said.contains("largest on demand: 'large', a file of 160 MiB: its first load peaks at about"), "{said}");
    assert!(said.contains("NEVER FITS: 'large' (larger than a share's room)"), "{said}");
    let room: u64 = said.split("a share's room: ").nth(1).and_then(|r| r.split(' ').next()?.parse().ok()).unwrap();
    assert!((1..100).contains(&room), "{said}");
    let small = std::fs::metadata(server.dir.path().join("repo/small/model.onnx")).unwrap().len();
    let small_peaks = said.lines().any(|l| l.contains("WARNING: 'small' may peak past a share's room"));
    let peak = (small * 5) >> 20;
    // (Within a MiB of the room, the rounded figures cannot tell.)
    if peak.abs_diff(room) > 1 {
        assert_eq!(small_peaks, peak > room, "{small} bytes x 5 against {room} MiB of room:\n{said}");
    }
}

#[test]
fn a_repository_of_a_thousand_models_starts_lists_and_serves_any_of_them_and_refuses_names_that_are_not() {
    let dir = temp_dir("budget-thousand");
    let repository = model_repository(dir.path(), &["typed"]);
    let started = std::time::Instant::now();
    let models: Vec<Mlp> = (0..1000).map(|k| Mlp { seed: k, hidden: 4 }).collect();
    for (k, mlp) in models.iter().enumerate() {
        mlp.write(&repository.join(inferd_bench::models::name(k)), &inferd_bench::models::name(k)).unwrap();
    }
    let server = budget_server(dir, &repository, 4096 * MIB, "");
    eprintln!("1000 models: written and the pool ready in {:.1} s", started.elapsed().as_secs_f64());
    let listed = server.request("GET", "/v2", b"").json();
    assert_eq!(listed["loadable"].as_array().unwrap().len(), 1000, "{listed}");
    // Any of them, its own answer; the status and the metrics stay small.
    for k in [0, 517, 999] {
        let answered = server.request("POST", &format!("/v2/models/m{k:02}/infer"), &request(&row(k)));
        assert_eq!(answered.status, 200, "{}", String::from_utf8_lossy(&answered.body));
        assert!(close(&answer(&answered.json()).unwrap(), &models[k].reference(&row(k))), "m{k}");
    }
    // Each worker's reports reach the supervisor a moment after its answers.
    let held = |status: &serde_json::Value| -> usize {
        status["workers"].as_array().unwrap().iter().map(|w| w["models"].as_array().unwrap().len()).sum()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while held(&server.status()) < test_workers() + 3 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = server.status();
    assert_eq!(
        held(&status),
        test_workers() + 3,
        "typed on each worker, and each of the three on the worker it was asked of: {status}"
    );
    let metrics = server.metrics_text();
    assert!(metrics.len() < 64 * 1024, "/metrics is {} bytes for 1000 models, 3 loaded", metrics.len());
    assert_eq!(metric_sum(&metrics, "inferd_model_loads_total", "reason=\"on_demand\""), 3.0, "{metrics}");
    // The admin index: the three READY (loaded on demand), the rest loadable.
    let index = |body: &str| {
        inferd_bench::http::request(server.admin_addr(), "POST", "/v2/repository/index", &[], body.as_bytes()).unwrap()
    };
    let all = index("{}").json();
    assert_eq!(all.as_array().unwrap().len(), 1001, "typed and the thousand");
    let entry = |name: &str| all.as_array().unwrap().iter().find(|e| e["name"] == name).unwrap().clone();
    assert_eq!(
        (entry("m517")["state"].as_str(), entry("m517")["reason"].as_str()),
        (Some("READY"), Some("loaded on demand"))
    );
    assert_eq!(entry("m518")["state"], "UNAVAILABLE");
    assert!(entry("m518")["reason"].as_str().unwrap().contains("first request"), "{}", entry("m518"));
    let ready: Vec<String> = index("{\"ready\": true}")
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ready, ["typed", "m00", "m517", "m999"]);
    // An unknown name: a 404 naming a few, not a thousand.
    let unknown = server.request("POST", "/v2/models/nope/infer", &request(&row(0)));
    assert_eq!(unknown.status, 404);
    let message = unknown.error();
    assert!(
        message.contains("unknown model: 'nope'") && message.contains("981 more (GET /v2 lists them)"),
        "{message}"
    );
    // Names no folder can have: 404 naming why, nothing looked up.
    let long = "x".repeat(300);
    for (name, why) in [
        (long.as_str(), "at most 255 bytes"),
        ("..", "not '.' or '..'"),
        ("m00%2F..%2Fm01", "has no '/'"),
        ("m%00", "has no NUL"),
    ] {
        let refused = server.request("POST", &format!("/v2/models/{name}/infer"), &request(&row(0)));
        assert_eq!(refused.status, 404, "{name}");
        assert!(refused.error().contains(why), "{name}: {}", refused.error());
    }
}

/// A keep-alive connection that worker `index` serves (the port places connections at
/// random: connections are opened until one lands there).
fn connection_to(addr: std::net::SocketAddr, index: usize) -> Connection {
    for _ in 0..500 {
        let mut connection = Connection::open(addr).unwrap();
        let live = connection.send("GET", "/v2/health/live", &[], b"").unwrap();
        if live.header("x-inferd-worker") == Some(&index.to_string()) {
            return connection;
        }
    }
    panic!("no connection reached worker {index} in 500 tries");
}

#[test]
fn with_pool_placement_a_worker_without_room_sends_a_model_its_sibling_holds_there_and_loads_it_once_that_sibling_is_gone(
) {
    let dir = temp_dir("budget-placement");
    let repository = model_repository(dir.path(), &["typed"]);
    // Four models of 25 MiB. A share of 180 MiB holds a worker (20-30 MiB warm), one of them
    // (about 50 MiB) and a first load's room (5 x 25 MiB) beside it only while it holds none.
    let models = generate(&repository, 4, 25, 25).unwrap();
    let port = free_port();
    let config = write_config(dir.path(), port, 2, &repository, "typed", &[], "");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str("on_demand = true\nmemory_budget = \"360 MiB\"\nplacement = \"pool\"\n");
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    let ask = |connection: &mut Connection, k: usize, worker: usize| {
        let path = format!("/v2/models/{}/infer", inferd_bench::models::name(k));
        let headers = [("Content-Type", "application/json"), ("X-Request-Id", "placed-7")];
        let answered = connection.send("POST", &path, &headers, &request(&row(k))).unwrap();
        assert_eq!(answered.status, 200, "m{k}: {}", String::from_utf8_lossy(&answered.body));
        assert!(close(&answer(&answered.json()).unwrap(), &models[k].reference(&row(k))), "m{k}'s own answer");
        assert_eq!(answered.header("x-inferd-worker"), Some(&*worker.to_string()), "m{k}: which worker answered");
        assert_eq!(answered.header("x-request-id"), Some("placed-7"));
    };
    let (mut a, mut b) = (connection_to(server.addr, 0), connection_to(server.addr, 1));
    ask(&mut a, 0, 0);
    ask(&mut b, 1, 1);
    // Worker 1 holds m01 and has no room for another first load: worker 0 answers for m00.
    for _ in 0..3 {
        ask(&mut b, 0, 0);
    }
    let metrics = server.metrics_text();
    let loads = |metrics: &str, k: usize| {
        metric_sum(metrics, "inferd_model_loads_total", &format!("model=\"m{k:02}\",reason=\"on_demand\""))
    };
    assert_eq!(loads(&metrics, 0), 1.0, "m00 loaded once, by worker 0:\n{metrics}");
    assert_eq!(metric_value(&metrics, "inferd_model_forwards_total{outcome=\"forwarded\"}"), Some(3.0), "{metrics}");
    // Worker 0 killed: worker 1 no longer finds m00 held (or cannot reach its holder), and
    // loads it itself; nothing fails.
    let status = server.status();
    let first = status["workers"].as_array().unwrap().iter().find(|w| w["index"] == 0).expect("worker 0")["pid"]
        .as_i64()
        .unwrap() as i32;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(first), nix::sys::signal::Signal::SIGKILL).unwrap();
    ask(&mut b, 0, 1);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while loads(&server.metrics_text(), 0) < 2.0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(loads(&server.metrics_text(), 0), 2.0, "m00 loaded again, by worker 1");
    assert!(server.running(), "{}", server.log());
}
