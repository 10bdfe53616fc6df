//! Prometheus metrics: a real Prometheus server (the Debian package, started here on
//! loopback) scrapes the supervisor's admin listener, and its query API must count exactly
//! the requests the test sent, also across a worker's SIGKILL.

use std::time::{Duration, Instant};

use crate::common::*;

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
    let server = serve(temp_dir("metrics"), test_workers(), &test_models(), "typed", &[], "");
    let prom_dir = temp_dir("prometheus");
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

#[test]
fn every_route_family_is_counted_under_its_own_name() {
    let dir = temp_dir("metrics-routes");
    let repository = model_repository(dir.path(), &["minilm", "typed", "classifier", "reranker"]);
    std::os::unix::fs::symlink(test_models().join("published/splade"), repository.join("splade")).unwrap();
    let port = free_port();
    let load = ["typed", "classifier", "reranker", "splade"];
    write_config(dir.path(), port, 1, &repository, "minilm", &load, "");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(90));

    // Before any restart or recycle, each reason's series is there at 0.
    let first = server.metrics_text();
    for reason in ["stuck", "memory_hard", "model_load", "boot", "panic", "signal", "exit"] {
        let line = format!("inferd_worker_restarts_total{{reason=\"{reason}\"}}");
        assert_eq!(metric_value(&first, &line), Some(0.0), "{line} in:\n{first}");
    }
    for reason in ["memory", "max_requests", "max_age", "fault"] {
        let line = format!("inferd_worker_recycles_total{{reason=\"{reason}\"}}");
        assert_eq!(metric_value(&first, &line), Some(0.0), "{line} in:\n{first}");
    }

    let text = br#"{"inputs": "hello"}"#.to_vec();
    let calls: [(&str, Vec<u8>, &str, &str); 9] = [
        ("/v2/models/typed/infer", typed_request(), "typed", "infer"),
        ("/embed", text.clone(), "minilm", "embed"),
        ("/embed_all", text.clone(), "minilm", "embed_all"),
        ("/v2/models/splade/embed_sparse", text.clone(), "splade", "embed_sparse"),
        (
            "/similarity",
            br#"{"inputs": {"source_sentence": "a", "sentences": ["b"]}}"#.to_vec(),
            "minilm",
            "similarity",
        ),
        ("/v1/embeddings", br#"{"input": "hello", "model": "minilm"}"#.to_vec(), "minilm", "openai_embeddings"),
        ("/v2/models/classifier/predict", text.clone(), "classifier", "predict"),
        ("/v2/models/reranker/rerank", br#"{"query": "q", "texts": ["a"]}"#.to_vec(), "reranker", "rerank"),
        ("/invocations", text, "minilm", "invocations"),
    ];
    for (path, body, _, _) in &calls {
        let r = server.request("POST", path, body);
        assert_eq!(r.status, 200, "{path}: {}", String::from_utf8_lossy(&r.body));
    }
    let metrics = server.metrics_text();
    for (path, _, model, endpoint) in &calls {
        let line = format!("inferd_requests_total{{model=\"{model}\",endpoint=\"{endpoint}\",code=\"200\"}}");
        assert_eq!(metric_value(&metrics, &line), Some(1.0), "{path} counted as {line}, in:\n{metrics}");
    }
    let total: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("inferd_requests_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(total, calls.len() as f64, "each call counted once:\n{metrics}");
}

/// `inferd_saturation` (docs/operations.md, "Saturation"): 0 on an idle pool, near 1 while 32
/// closed-loop clients keep every lane held; the workers' busy lanes and the lanes' busy time
/// move with them.
#[test]
fn saturation_reads_zero_idle_and_near_one_under_a_closed_loop_of_thirty_two() {
    let server = serve(temp_dir("saturation"), 2, &test_models(), "typed", &[], "");
    let metric = |text: &str, name: &str| metric_value(text, name).unwrap_or_else(|| panic!("no {name}:\n{text}"));
    // A window (5 s) of idle samples.
    std::thread::sleep(Duration::from_secs(6));
    let idle = server.metrics_text();
    assert!(metric(&idle, "inferd_saturation ") <= 0.05, "idle:\n{idle}");
    assert_eq!(metric(&idle, "inferd_accept_queue_connections "), 0.0);
    assert_eq!(idle.lines().filter(|l| l.starts_with("inferd_worker_lanes{")).count(), 2, "{idle}");
    let busy_before = metric(&idle, "inferd_lane_busy_seconds_total ");

    let load = TypedLoad::start(&server, 32, Duration::ZERO, |_, _| ());
    // The window fills with loaded samples; a loaded machine may take a while to get there.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut loaded = String::new();
    std::thread::sleep(Duration::from_secs(6));
    while Instant::now() < deadline {
        loaded = server.metrics_text();
        if metric(&loaded, "inferd_saturation ") >= 0.9 {
            break;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let (served, failed, _) = load.finish();
    assert!(failed.is_empty(), "{} failed: {:?}", failed.len(), &failed[..failed.len().min(3)]);
    assert!(served > 0);
    let saturation = metric(&loaded, "inferd_saturation ");
    eprintln!("saturation idle {:.3}, under 32 clients {saturation:.3}", metric(&idle, "inferd_saturation "));
    assert!(saturation >= 0.9, "32 closed-loop clients on 2 lanes:\n{loaded}");
    assert!(metric(&loaded, "inferd_lane_busy_seconds_total ") > busy_before, "{loaded}");
    let busy: Vec<f64> = loaded
        .lines()
        .filter(|l| l.starts_with("inferd_worker_busy_lanes{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    assert_eq!(busy.len(), 2, "{loaded}");
    // One lane each (a run is counted as it ends: a window may take a little of the last).
    assert!(busy.iter().all(|b| (0.0..=1.1).contains(b)), "one lane each: {busy:?}");
    assert!(busy.iter().any(|&b| b > 0.0), "{busy:?}");
}
