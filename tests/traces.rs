//! OpenTelemetry traces ([tracing]; docs/operations.md, "Traces"), read from a real OTLP
//! receiver built on OpenTelemetry's protocol definitions (tests/clients/otlp_receiver.py,
//! OTLP/HTTP and OTLP/gRPC): a client's `traceparent` continued on KServe REST, TEI, OpenAI and
//! gRPC requests, the stages nested in the server span, a batched run linked to each of its
//! requests, sampling by ratio and by parent, the resource; real clients (the Python SDK's
//! requests and gRPC instrumentations) followed into inferd; a collector that hangs or is down
//! costs no request, and its spans are dropped and counted.

use std::collections::{BTreeSet, HashMap};
use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::*;

/// The receiver, killed on drop: its OTLP/HTTP and OTLP/gRPC ports, and the spans it wrote.
struct Receiver {
    child: Child,
    out: PathBuf,
    http: u16,
    grpc: u16,
    _dir: TempDir,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Receiver {
    fn start(hang: bool) -> Receiver {
        Receiver::start_with(temp_dir("otlp-receiver"), if hang { &["--hang"] } else { &[] })
    }

    /// A receiver started with `options` (otlp_receiver.py's), writing into `dir`.
    fn start_with<S: AsRef<std::ffi::OsStr>>(dir: TempDir, options: &[S]) -> Receiver {
        let out = dir.path().join("spans.jsonl");
        let (http, grpc) = (free_port(), free_port());
        let mut command = Command::new(python());
        command
            .arg(repo().join("tests/clients/otlp_receiver.py"))
            .arg(&out)
            .arg(http.to_string())
            .arg(grpc.to_string())
            .args(options);
        let mut child = command.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "listening", "the receiver did not start");
        Receiver { child, out, http, grpc, _dir: dir }
    }

    fn http_endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.http)
    }

    fn spans(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
    }

    /// The spans once `done` holds of them (the workers export at least every second).
    fn spans_when(&self, what: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            assert!(Instant::now() < deadline, "no {what} within 30 s; the receiver has:\n{spans:#?}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// A server of `models` (the first the default) with `workers` and the [tracing] `settings`.
fn traced_server(tag: &str, workers: usize, models: &[&str], settings: &str, args: &[&str]) -> Server {
    let dir = temp_dir(tag);
    let repository = model_repository(dir.path(), models);
    let port = free_port();
    let config = write_config(dir.path(), port, workers, &repository, models[0], &models[1..], "");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str(&format!("\n[tracing]\n{settings}\n"));
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(dir, port, args);
    server.wait_ready(Duration::from_secs(120));
    server
}

fn traceparent(trace: &str, parent: &str, sampled: bool) -> String {
    format!("00-{trace}-{parent}-{}", if sampled { "01" } else { "00" })
}

/// 32 and 16 hex digits, distinct per call.
fn ids(n: u64) -> (String, String) {
    let seed = std::process::id() as u64 * 1_000_003 + n;
    (format!("{:016x}{:016x}", seed.wrapping_mul(0x9e37_79b9_7f4a_7c15), n + 1), format!("{:016x}", seed | 1))
}

fn post(server: &Server, path: &str, body: &[u8], traceparent: Option<&str>) -> Response {
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(t) = traceparent {
        headers.push(("traceparent", t));
    }
    let response = inferd_bench::http::request(server.addr, "POST", path, &headers, body).unwrap();
    assert_eq!(response.status, 200, "{path}: {}", String::from_utf8_lossy(&response.body));
    response
}

fn server_spans<'a>(spans: &'a [Value], trace: &str) -> Vec<&'a Value> {
    spans.iter().filter(|s| s["trace_id"] == trace && s["kind"] == 2).collect()
}

fn children<'a>(spans: &'a [Value], parent: &Value) -> Vec<&'a Value> {
    spans.iter().filter(|s| s["trace_id"] == parent["trace_id"] && s["parent_span_id"] == parent["span_id"]).collect()
}

fn within(child: &Value, parent: &Value) -> bool {
    let (s, e) = (child["start"].as_u64().unwrap(), child["end"].as_u64().unwrap());
    let (ps, pe) = (parent["start"].as_u64().unwrap(), parent["end"].as_u64().unwrap());
    ps <= s && s <= e && e <= pe
}

#[test]
fn a_clients_trace_continues_on_rest_tei_and_openai_with_the_stages_nested_and_the_run_linked() {
    let receiver = Receiver::start(false);
    let settings = format!("endpoint = \"{}\"\n[log]\naccess_log = true", receiver.http_endpoint());
    let server = traced_server("traces", 1, &["minilm", "typed"], &settings, &[]);
    let calls = [
        (
            "kserve",
            "/v2/models/typed/infer",
            typed_request(),
            "/v2/models/{model}/infer",
            vec!["read body", "queue wait"],
        ),
        (
            "tei",
            "/embed",
            br#"{"inputs":"a traced sentence"}"#.to_vec(),
            "/embed",
            vec!["read body", "tokenize", "queue wait", "post-process"],
        ),
        (
            "openai",
            "/v1/embeddings",
            br#"{"model":"minilm","input":"a traced sentence"}"#.to_vec(),
            "/v1/embeddings",
            vec!["read body", "tokenize", "queue wait", "post-process"],
        ),
    ];
    let mut sent = Vec::new();
    for (n, (what, path, body, route, stages)) in calls.into_iter().enumerate() {
        let (trace, parent) = ids(n as u64);
        post(&server, path, &body, Some(&traceparent(&trace, &parent, true)));
        sent.push((what, trace, parent, route, stages));
    }
    // A malformed traceparent is ignored: answered, in a trace of its own.
    post(&server, "/v2/models/typed/infer", &typed_request(), Some("00-not-a-trace-01"));
    let pid = server.worker_pids()[0];

    let spans = receiver.spans_when("server span of every request", |spans| {
        sent.iter().all(|(_, trace, ..)| !server_spans(spans, trace).is_empty())
            && spans.iter().filter(|s| s["kind"] == 2 && s["parent_span_id"] == "").count() >= 1
    });
    for (what, trace, parent, route, stages) in &sent {
        let found = server_spans(&spans, trace);
        assert_eq!(found.len(), 1, "{what}: {found:#?}");
        let span = found[0];
        assert_eq!(span["parent_span_id"], *parent, "{what}: the server span's parent is the client's span");
        assert_eq!(span["attributes"]["http.route"], *route, "{what}");
        assert_eq!(span["attributes"]["http.request.method"], "POST");
        assert_eq!(span["attributes"]["http.response.status_code"], 200);
        assert!(span["attributes"]["inferd.request_id"].as_str().is_some_and(|id| !id.is_empty()));
        assert_eq!(span["name"], format!("POST {route}"));
        // Its stages, nested in it and within its time.
        let inner = children(&spans, span);
        let names: BTreeSet<&str> = inner.iter().map(|s| s["name"].as_str().unwrap()).collect();
        for stage in stages {
            assert!(names.contains(stage), "{what}: no '{stage}' stage among {names:?}");
        }
        for child in &inner {
            assert!(
                within(child, span),
                "{what}: {} is not within the server span:\n{child:#}\n{span:#}",
                child["name"]
            );
        }
        // The model run: a child of the request, linked to it.
        let run =
            inner.iter().find(|s| s["name"] == "model run").unwrap_or_else(|| panic!("{what}: no run in {names:?}"));
        assert!(run["links"].as_array().unwrap().contains(&json!({"trace_id": trace, "span_id": span["span_id"]})));
        assert_eq!(run["attributes"]["inferd.batch.requests"], 1);
        // The resource says which host, worker and pid.
        let resource = &span["resource"];
        assert_eq!(resource["service.name"], "inferd");
        assert_eq!(resource["process.pid"], pid);
        assert_eq!(resource["inferd.worker"], 0);
        assert!(resource["host.name"].as_str().is_some_and(|h| !h.is_empty()), "{resource}");
        // Its access log line carries its trace and span ids.
        let log = server.log();
        let line = log.lines().find(|l| l.contains(" 200 client=") && l.contains(trace.as_str()));
        let line = line.unwrap_or_else(|| panic!("{what}: no access line with trace {trace}:\n{log}"));
        assert!(line.contains(span["span_id"].as_str().unwrap()), "{line}");
    }
    let metrics = server.metrics_text();
    assert!(metric_value(&metrics, "inferd_trace_spans_exported_total ").unwrap() >= 12.0, "{metrics}");
    assert_eq!(metric_value(&metrics, "inferd_trace_spans_dropped_total "), Some(0.0));
}

#[test]
fn a_batched_run_is_one_span_linked_to_each_of_its_requests() {
    let receiver = Receiver::start(false);
    let server =
        traced_server("traces-batch", 1, &["minilm"], &format!("endpoint = \"{}\"", receiver.http_endpoint()), &[]);
    // Rounds of 16 requests at once on one worker, until a run served several of them.
    for round in 0..10u64 {
        let threads: Vec<_> = (0..16u64)
            .map(|i| {
                let (trace, parent) = ids(1000 + round * 16 + i);
                let addr = server.addr;
                std::thread::spawn(move || {
                    let header = traceparent(&trace, &parent, true);
                    let headers = [("Content-Type", "application/json"), ("traceparent", header.as_str())];
                    let body = format!(r#"{{"inputs":"sentence number {i} of round {round}"}}"#);
                    let r = inferd_bench::http::request(addr, "POST", "/embed", &headers, body.as_bytes()).unwrap();
                    assert_eq!(r.status, 200);
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        std::thread::sleep(Duration::from_millis(1500));
        let spans = receiver.spans();
        let servers: HashMap<&str, &Value> =
            spans.iter().filter(|s| s["kind"] == 2).map(|s| (s["span_id"].as_str().unwrap(), s)).collect();
        let batched = spans.iter().find(|s| s["name"] == "model run" && s["links"].as_array().unwrap().len() >= 2);
        if let Some(run) = batched {
            let links = run["links"].as_array().unwrap();
            assert_eq!(run["attributes"]["inferd.batch.requests"], links.len() as i64, "{run:#}");
            for link in links {
                let request =
                    servers.get(link["span_id"].as_str().unwrap()).unwrap_or_else(|| panic!("{link} links no request"));
                assert_eq!(request["trace_id"], link["trace_id"]);
            }
            // The child of its first request: in that request's trace.
            assert_eq!(run["trace_id"], links[0]["trace_id"]);
            assert_eq!(run["parent_span_id"], links[0]["span_id"]);
            return;
        }
    }
    panic!("10 rounds of 16 concurrent requests on one worker and no run served two of them");
}

#[test]
fn roots_are_sampled_by_ratio_and_a_parents_decision_is_followed() {
    let receiver = Receiver::start(false);
    let settings = format!("endpoint = \"{}\"\nsample_ratio = 0.25", receiver.http_endpoint());
    let server = traced_server("traces-sampling", test_workers(), &["typed"], &settings, &[]);
    let ready = |traceparent: Option<&str>| {
        let headers: Vec<(&str, &str)> = traceparent.map(|t| vec![("traceparent", t)]).unwrap_or_default();
        let r = inferd_bench::http::request(server.addr, "GET", "/v2/health/ready", &headers, b"").unwrap();
        assert_eq!(r.status, 200);
    };
    let n = 400;
    for _ in 0..n {
        ready(None);
    }
    let (mut sampled, mut unsampled) = (Vec::new(), Vec::new());
    for i in 0..20u64 {
        let (trace, parent) = ids(5000 + i);
        ready(Some(&traceparent(&trace, &parent, true)));
        sampled.push(trace);
        let (trace, parent) = ids(6000 + i);
        ready(Some(&traceparent(&trace, &parent, false)));
        unsampled.push(trace);
    }
    receiver.spans_when("every sampled parent's request", |spans| {
        sampled.iter().all(|t| !server_spans(spans, t).is_empty())
    });
    std::thread::sleep(Duration::from_secs(2)); // the roots' last batch
    let spans = receiver.spans();
    let roots = spans.iter().filter(|s| s["kind"] == 2 && s["parent_span_id"] == "").count() as f64;
    // Binomial: mean 100, standard deviation 8.7; 4 of them either way.
    let (mean, sd) = (n as f64 * 0.25, (n as f64 * 0.25 * 0.75).sqrt());
    eprintln!("{roots} of {n} roots sampled at 0.25");
    assert!((roots - mean).abs() <= 4.0 * sd, "{roots} of {n} roots sampled at a ratio of 0.25");
    for trace in &unsampled {
        assert!(server_spans(&spans, trace).is_empty(), "a request whose parent was not sampled was recorded");
    }
}

#[test]
fn real_clients_traces_continue_into_inferd_over_http_and_grpc_and_spans_go_out_over_otlp_grpc() {
    let receiver = Receiver::start(false);
    let settings = format!("endpoint = \"http://127.0.0.1:{}\"\nprotocol = \"grpc\"", receiver.grpc);
    let grpc = format!("127.0.0.1:{}", free_port());
    let server =
        traced_server("traces-clients", test_workers(), &["minilm", "typed"], &settings, &["--grpc-listen", &grpc]);
    let out = Command::new(python())
        .arg(repo().join("tests/clients/traced_client.py"))
        .args([&server.addr.to_string(), &grpc, &receiver.http_endpoint()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let traces: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    for (call, route) in [("embed", "POST /embed"), ("grpc", "inference.GRPCInferenceService/ModelInfer")] {
        let trace = traces[call].as_str().unwrap().to_string();
        let spans = receiver.spans_when(&format!("{call}'s run"), |spans| {
            spans.iter().any(|s| s["trace_id"] == trace && s["name"] == "model run")
        });
        let mine: Vec<&Value> = spans.iter().filter(|s| s["trace_id"] == trace).collect();
        let server = mine.iter().find(|s| s["kind"] == 2 && s["resource"]["service.name"] == "inferd");
        let server = server.unwrap_or_else(|| panic!("{call}: no inferd server span in {mine:#?}"));
        assert_eq!(server["name"], route);
        assert_eq!(server["protocol"], "grpc", "inferd exports over OTLP/gRPC here");
        // Its parent is the client's span: the instrumentation's (kind CLIENT, 3).
        let parent = mine.iter().find(|s| s["span_id"] == server["parent_span_id"]);
        let parent =
            parent.unwrap_or_else(|| panic!("{call}: the server span's parent is not in the trace: {mine:#?}"));
        assert_eq!(parent["kind"], 3, "{parent:#}");
        assert_eq!(parent["resource"]["service.name"], "traced-client");
        if call == "grpc" {
            assert_eq!(server["attributes"]["rpc.system"], "grpc");
            assert_eq!(server["attributes"]["rpc.grpc.status_code"], 0);
        }
    }
}

/// RSS (KiB) of `pid`.
fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")?.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

#[test]
fn a_collector_that_hangs_or_is_down_costs_no_request_and_its_spans_are_dropped_and_counted() {
    let hanging = Receiver::start(true);
    let nobody = format!("http://127.0.0.1:{}", free_port());
    for (what, endpoint) in [("hanging", hanging.http_endpoint()), ("down", nobody)] {
        let settings = format!("endpoint = \"{endpoint}\"\ntimeout_secs = 1\nmax_queued_spans = 256");
        let server = traced_server("traces-down", test_workers(), &["typed"], &settings, &[]);
        let pids = server.worker_pids();
        let load = TypedLoad::start(&server, 8, Duration::ZERO, |_, _| ());
        std::thread::sleep(Duration::from_secs(3));
        let early: Vec<u64> = pids.iter().map(|&p| rss_kib(p)).collect();
        std::thread::sleep(Duration::from_secs(6));
        let late: Vec<u64> = pids.iter().map(|&p| rss_kib(p)).collect();
        let (served, failed, _) = load.finish();
        assert!(failed.is_empty(), "{what}: {} failed: {:?}", failed.len(), &failed[..failed.len().min(3)]);
        assert!(served > 100, "{what}: {served}");
        let metrics = server.metrics_text();
        let dropped = metric_value(&metrics, "inferd_trace_spans_dropped_total ").unwrap();
        eprintln!("{what}: {served} answered, {dropped} spans dropped, RSS {early:?} -> {late:?} KiB");
        assert!(dropped > 0.0, "{what}: {metrics}");
        assert_eq!(metric_value(&metrics, "inferd_trace_spans_exported_total "), Some(0.0));
        // Flat: the queue is bounded, and so is what an export holds.
        for (e, l) in early.iter().zip(&late) {
            assert!(*l <= e + 16 * 1024, "{what}: a worker's RSS grew from {e} to {l} KiB");
        }
        assert_eq!(server.worker_pids(), pids, "{what}: no worker replaced");
    }
}

#[test]
fn a_rolling_reload_is_one_trace_of_the_supervisor_with_a_span_per_slot() {
    let receiver = Receiver::start(false);
    let server =
        traced_server("traces-reload", 2, &["typed"], &format!("endpoint = \"{}\"", receiver.http_endpoint()), &[]);
    let out = Command::new(BIN).args(["reload", "--wait", "--control-socket"]).arg(&server.socket).output().unwrap();
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let spans = receiver.spans_when("the reload's span and its slots'", |spans| {
        spans.iter().any(|s| s["name"] == "rolling reload")
            && spans.iter().filter(|s| s["name"].as_str().is_some_and(|n| n.starts_with("reload slot "))).count() >= 2
    });
    let reload = spans.iter().find(|s| s["name"] == "rolling reload").unwrap();
    assert_eq!(reload["parent_span_id"], "", "a trace of its own");
    assert_eq!(reload["attributes"]["inferd.outcome"], "complete");
    assert_eq!(reload["attributes"]["inferd.generation"], 2);
    assert_eq!(reload["resource"]["inferd.role"], "supervisor");
    assert_eq!(reload["resource"]["process.pid"], server.process.pid() as i64);
    let slots = children(&spans, reload);
    let names: BTreeSet<&str> = slots.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, BTreeSet::from(["reload slot 0", "reload slot 1"]), "{slots:#?}");
    for slot in &slots {
        assert_eq!(slot["attributes"]["inferd.outcome"], "promoted", "{slot:#}");
        assert!(within(slot, reload), "{slot:#}\n{reload:#}");
        let pid = slot["attributes"]["process.pid"].as_i64().unwrap() as i32;
        assert!(server.worker_pids().contains(&pid), "the promoted worker {pid} serves");
    }
    // One after the other: slot 1 starts once slot 0's worker is promoted.
    let start = |name: &str| slots.iter().find(|s| s["name"] == name).unwrap()["start"].as_u64().unwrap();
    let end = |name: &str| slots.iter().find(|s| s["name"] == name).unwrap()["end"].as_u64().unwrap();
    assert!(end("reload slot 0") <= start("reload slot 1"));
}

#[test]
fn an_on_demand_load_is_a_span_of_the_request_that_asked_for_it() {
    let receiver = Receiver::start(false);
    let dir = temp_dir("traces-load");
    let repository = model_repository(dir.path(), &["typed", "classifier"]);
    let port = free_port();
    let config = write_config(dir.path(), port, 1, &repository, "typed", &[], "");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str(&format!("on_demand = true\n\n[tracing]\nendpoint = \"{}\"\n", receiver.http_endpoint()));
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(120));
    let (trace, parent) = ids(9000);
    post(
        &server,
        "/v2/models/classifier/predict",
        br#"{"inputs":"a traced load"}"#,
        Some(&traceparent(&trace, &parent, true)),
    );
    let spans = receiver.spans_when("the load's span", |spans| {
        spans.iter().any(|s| s["trace_id"] == trace && s["name"] == "load model")
    });
    let request = server_spans(&spans, &trace)[0];
    let load = spans.iter().find(|s| s["trace_id"] == trace && s["name"] == "load model").unwrap();
    assert_eq!(load["parent_span_id"], request["span_id"], "the load is the request's child");
    assert_eq!(load["attributes"]["inferd.model"], "classifier");
    assert!(load["attributes"]["inferd.model.bytes"].as_i64().is_some(), "{load:#}");
    assert!(within(load, request), "{load:#}\n{request:#}");
    // Its log line carries the trace.
    let log = server.log();
    assert!(log.lines().any(|l| l.contains("loaded on demand") && l.contains(trace.as_str())), "{log}");
}

#[test]
fn a_workers_replacement_is_a_trace_of_the_supervisor_with_its_cause() {
    let receiver = Receiver::start(false);
    let dir = temp_dir("traces-replace");
    let repository = model_repository(dir.path(), &["typed"]);
    let port = free_port();
    // Recycled after exactly 30 requests (no jitter).
    let config =
        write_config(dir.path(), port, 2, &repository, "typed", &[], "max_requests = 30\nmax_requests_jitter = 0");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str(&format!("\n[tracing]\nendpoint = \"{}\"\n", receiver.http_endpoint()));
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(120));
    let replacement = |spans: &[Value], pid: i32| -> Option<Value> {
        spans
            .iter()
            .find(|s| {
                s["name"].as_str().is_some_and(|n| n.starts_with("replace worker "))
                    && s["attributes"]["inferd.replaced_pid"] == pid
            })
            .cloned()
    };

    // A crash: the worker is killed, the supervisor starts another in its slot.
    let killed = server.worker_pids()[0];
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(killed), nix::sys::signal::Signal::SIGKILL).unwrap();
    let spans = receiver.spans_when("the crash's replacement", |spans| replacement(spans, killed).is_some());
    let crash = replacement(&spans, killed).unwrap();
    assert_eq!(crash["parent_span_id"], "", "a trace of its own: {crash:#}");
    assert_eq!(crash["resource"]["inferd.role"], "supervisor");
    assert_eq!(crash["attributes"]["inferd.cause"], "respawn", "{crash:#}");
    assert_eq!(crash["attributes"]["inferd.reason"], "signal", "{crash:#}");
    assert!(crash["attributes"]["inferd.detail"].as_str().unwrap().contains("SIGKILL"), "{crash:#}");
    assert_eq!(crash["attributes"]["inferd.outcome"], "ready", "{crash:#}");
    let new = crash["attributes"]["process.pid"].as_i64().unwrap() as i32;
    assert_ne!(new, killed);
    server.wait_ready(Duration::from_secs(120));
    assert!(server.worker_pids().contains(&new), "the new worker {new} serves: {:?}", server.worker_pids());
    // Its log lines carry the trace.
    let trace = crash["trace_id"].as_str().unwrap();
    let log = server.log();
    assert!(log.lines().any(|l| l.contains("replacing it") && l.contains(trace)), "{log}");

    // A recycle: past max_requests, replaced incoming first.
    let before = server.worker_pids();
    for _ in 0..120 {
        let response = inferd_bench::http::request(
            server.addr,
            "POST",
            "/v2/models/typed/infer",
            &[("Content-Type", "application/json"), ("Connection", "close")],
            &typed_request(),
        )
        .unwrap();
        assert_eq!(response.status, 200, "{}", String::from_utf8_lossy(&response.body));
    }
    let spans = receiver.spans_when("a recycle's replacement", |spans| {
        before.iter().any(|&pid| replacement(spans, pid).is_some_and(|s| s["attributes"]["inferd.cause"] == "recycle"))
    });
    let recycle = before.iter().find_map(|&pid| replacement(&spans, pid)).unwrap();
    assert_eq!(recycle["attributes"]["inferd.reason"], "max_requests", "{recycle:#}");
    assert_eq!(recycle["attributes"]["inferd.outcome"], "ready", "{recycle:#}");
    assert!(recycle["end"].as_u64() > recycle["start"].as_u64());
}

#[test]
fn spans_reach_a_collector_over_tls_with_a_client_certificate_by_grpc_and_http() {
    let dir = temp_dir("otlp-tls");
    let ca = crate::tls::Ca::new("collector CA");
    let ca_file = ca.write(dir.path(), "ca.pem");
    let (cert, key) = ca.write_leaf(dir.path(), "collector");
    let (client_cert, client_key) = ca.write_leaf(dir.path(), "exporter");
    let options = [cert.as_os_str(), key.as_os_str(), ca_file.as_os_str()];
    let receiver =
        Receiver::start_with(dir, &["--tls".as_ref(), options[0], options[1], "--client-ca".as_ref(), options[2]]);
    for (n, (protocol, port)) in [("grpc", receiver.grpc), ("http/protobuf", receiver.http)].into_iter().enumerate() {
        let settings = format!(
            "endpoint = \"https://localhost:{port}\"\nprotocol = \"{protocol}\"\ncertificate = \"{}\"\n\
             client_certificate = \"{}\"\nclient_key = \"{}\"",
            ca_file.display(),
            client_cert.display(),
            client_key.display()
        );
        let server = traced_server("traces-tls", 1, &["typed"], &settings, &[]);
        let (trace, parent) = ids(7000 + n as u64);
        post(&server, "/v2/models/typed/infer", &typed_request(), Some(&traceparent(&trace, &parent, true)));
        let spans = receiver.spans_when(&format!("{protocol}'s spans over TLS"), |spans| {
            server_spans(spans, &trace).first().is_some_and(|s| s["protocol"] == protocol)
        });
        assert_eq!(server_spans(&spans, &trace)[0]["parent_span_id"], parent);
        let metrics = server.metrics_text();
        assert_eq!(metric_value(&metrics, "inferd_trace_spans_dropped_total "), Some(0.0), "{protocol}");
    }

    // Without the client certificate the collector refuses the exporter: its spans are dropped
    // and counted, and requests are answered as ever.
    let settings =
        format!("endpoint = \"https://localhost:{}\"\ncertificate = \"{}\"", receiver.http, ca_file.display());
    let server = traced_server("traces-tls-refused", 1, &["typed"], &settings, &[]);
    for _ in 0..5 {
        post(&server, "/v2/models/typed/infer", &typed_request(), None);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric_value(&server.metrics_text(), "inferd_trace_spans_dropped_total ").unwrap_or(0.0) == 0.0 {
        assert!(Instant::now() < deadline, "no span counted as dropped: {}", server.metrics_text());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(metric_value(&server.metrics_text(), "inferd_trace_spans_exported_total "), Some(0.0));
}
