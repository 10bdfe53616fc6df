//! Dynamic batching on the default model (all-MiniLM-L6-v2): requests that wait together run
//! as one ONNX Runtime call, every answer equals the same request run alone, one request's bad
//! values fail only that request, and the batch sizes show in `status` and `/metrics`.
//!
//! The worker has 2 threads: a lone request runs on the wide session (both threads), concurrent
//! ones on the two narrow lanes, so the comparisons also cover wide against narrow.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

/// A model repository holding the default model with `batching` as its `[batching]` section.
fn minilm_with(dir: &Path, batching: &str) -> PathBuf {
    let source = repo().join("models/minilm");
    assert!(source.join("model.onnx").is_file(), "run `make setup` (`make test` does it first)");
    let target = dir.join("models/minilm");
    std::fs::create_dir_all(&target).unwrap();
    let toml = std::fs::read_to_string(source.join("model.toml")).unwrap();
    let toml = toml
        .replace("file = \"model.onnx\"", &format!("file = \"{}\"", source.join("model.onnx").display()))
        .replace("file = \"tokenizer.json\"", &format!("file = \"{}\"", source.join("tokenizer.json").display()));
    std::fs::write(target.join("model.toml"), format!("{toml}\n[batching]\n{batching}\n")).unwrap();
    dir.join("models")
}

/// One worker with two threads (allowed on a one-core machine too), serving minilm.
fn server(batching: &str) -> Server {
    let dir = temp_dir("batching");
    let port = free_port();
    let repository = minilm_with(dir.path(), batching);
    let config = write_config(dir.path(), port, 1, &repository, "minilm", &[], "allow_oversubscription = true");
    let text = std::fs::read_to_string(&config).unwrap().replace("threads = 1", "threads = 2");
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(90));
    server
}

fn embed(server: &Server, text: &str) -> Vec<f64> {
    let response = server.request("POST", "/embed", &serde_json::to_vec(&json!({ "inputs": text })).unwrap());
    assert_eq!(response.status, 200, "{}", String::from_utf8_lossy(&response.body));
    response.json()[0].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

fn texts() -> Vec<String> {
    let mut texts: Vec<String> = [
        "hi",
        "A short sentence.",
        "The quick brown fox jumps over the lazy dog near the river bank.",
        "Batching must not change the numbers a client gets back.",
        "ONNX Runtime pads every row of a batch to the longest one.",
        "Mean pooling ignores the padding through the attention mask.",
    ]
    .map(String::from)
    .to_vec();
    // Long texts too, so batches mix (or, past the token budget, refuse to mix) lengths.
    texts.push("a much longer text about serving models on ordinary servers ".repeat(12));
    texts.push("model ".repeat(200));
    texts
}

#[test]
fn concurrent_requests_are_batched_and_equal_single_runs() {
    // The oldest request waits up to 30 ms for company: batches form even on a busy machine.
    let server = server("max_batch_size = 8\nmax_queue_delay_ms = 30");
    let texts = texts();
    let alone: Vec<Vec<f64>> = texts.iter().map(|t| embed(&server, t)).collect();

    let rounds = 3;
    let answers: Vec<(usize, Vec<f64>)> = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..texts.len() * 2)
            .map(|c| {
                let (server, texts) = (&server, &texts);
                scope.spawn(move || {
                    (0..rounds).map(|_| (c % texts.len(), embed(server, &texts[c % texts.len()]))).collect::<Vec<_>>()
                })
            })
            .collect();
        clients.into_iter().flat_map(|c| c.join().unwrap()).collect()
    });
    assert_eq!(answers.len(), texts.len() * 2 * rounds);
    let worst = answers.iter().map(|(i, got)| max_diff(got, &alone[*i])).fold(0.0, f64::max);
    eprintln!("max |batched - alone| = {worst:e} over {} answers", answers.len());
    assert!(worst < 1e-5, "batched answers differ from single runs by {worst}");

    // Every request was answered by the model, and some runs carried more than one of them.
    let status = server.status();
    let batches = &status["batches"][0];
    assert_eq!(batches["model"], "minilm");
    let (runs, rows) = (batches["runs"].as_u64().unwrap(), batches["rows"].as_u64().unwrap());
    let requests = (texts.len() + answers.len()) as u64;
    assert_eq!(rows, requests, "one row per text: {batches}");
    assert!(runs < rows, "no run carried more than one request: {batches}");
    let metrics = server.metrics_text();
    let sum = metric_value(&metrics, "inferd_batch_size_sum{model=\"minilm\"}").unwrap();
    let count = metric_value(&metrics, "inferd_batch_size_count{model=\"minilm\"}").unwrap();
    assert_eq!((sum as u64, count as u64), (rows, runs), "/metrics and status agree");
    let table =
        std::process::Command::new(BIN).args(["status", "--control-socket"]).arg(&server.socket).output().unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains(&format!("batches of minilm: {runs} runs")), "{table}");
}

/// The tokenised inputs of `ids` as a v2 request with one row.
fn raw_request(ids: &[i64]) -> Vec<u8> {
    let n = ids.len();
    infer_body(json!([
        {"name": "input_ids", "datatype": "INT64", "shape": [1, n], "data": ids},
        {"name": "attention_mask", "datatype": "INT64", "shape": [1, n], "data": vec![1; n]},
        {"name": "token_type_ids", "datatype": "INT64", "shape": [1, n], "data": vec![0; n]},
    ]))
}

#[test]
fn a_bad_request_fails_alone_and_its_batch_mates_are_answered() {
    let server = server("max_batch_size = 16\nmax_queue_delay_ms = 50");
    // Same shape, so they batch; the bad one has a token id far outside the vocabulary.
    let good: Vec<Vec<i64>> = (0..7).map(|i| vec![101, 2000 + i, 2100 + i, 2200 + i, 102]).collect();
    let bad = vec![101, 1_000_000_000, 2100, 2200, 102];
    let alone: Vec<Value> =
        good.iter().map(|ids| server.request("POST", "/v2/models/minilm/infer", &raw_request(ids)).json()).collect();

    let (answers, refused) = std::thread::scope(|scope| {
        let good: Vec<_> = good
            .iter()
            .map(|ids| {
                let server = &server;
                scope.spawn(move || server.request("POST", "/v2/models/minilm/infer", &raw_request(ids)))
            })
            .collect();
        let bad = scope.spawn(|| server.request("POST", "/v2/models/minilm/infer", &raw_request(&bad)));
        (good.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>(), bad.join().unwrap())
    });
    assert_ne!(refused.status, 200, "an out-of-vocabulary id cannot be embedded");
    assert!(refused.error().contains("minilm"), "the error names the model: {}", refused.error());
    for (i, answer) in answers.iter().enumerate() {
        assert_eq!(answer.status, 200, "request {i}: {}", String::from_utf8_lossy(&answer.body));
        let got = answer.json()["outputs"][0]["data"].clone();
        let want = alone[i]["outputs"][0]["data"].clone();
        let floats = |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect::<Vec<_>>();
        let diff = max_diff(&floats(&got), &floats(&want));
        assert!(diff < 1e-5, "request {i} differs from its single run by {diff}");
    }
    // The pool is intact: the worker still answers.
    assert_eq!(embed(&server, "still here").len(), 384);
}

/// A request of many long texts (64 of ~250 tokens: seconds on one thread) is cut into runs
/// within the model's token budget (two texts a run), queued one after another, so short
/// requests that come meanwhile take their turns between them; with the background lane
/// (`background_lane`, the default) a worker of one thread runs the long runs there, at a lower
/// priority, while short ones come. Either way, once `status` counts the first run's rows, five
/// short requests one after another must all be answered while the long one still runs, and
/// the long one's answer is each text's embedding, in order. Run as one ORT call (before the
/// cut, without the background lane), the short requests waited for it and it was answered
/// first.
fn short_requests_are_answered_while_a_bulk_request_runs(background_lane: bool) {
    let dir = temp_dir("bulk");
    let repository = model_repository(dir.path(), &["minilm"]);
    let extra = format!("background_lane = {background_lane}");
    let server = serve(dir, 1, &repository, "minilm", &[], &extra);
    let worker = server.worker_pids()[0];

    // The background lane's thread, where there is one, is 10 nicer than the main thread.
    let nice = |task: &std::path::Path| -> i64 {
        let stat = std::fs::read_to_string(task.join("stat")).unwrap();
        // Fields after the command's closing parenthesis: state is the 3rd, nice the 19th.
        stat.rsplit_once(')').unwrap().1.split_whitespace().nth(16).unwrap().parse().unwrap()
    };
    let lane = std::fs::read_dir(format!("/proc/{worker}/task"))
        .unwrap()
        .map(|t| t.unwrap().path())
        .find(|t| std::fs::read_to_string(t.join("comm")).unwrap().trim() == "inferd-lane-bg");
    assert_eq!(lane.is_some(), background_lane, "a worker of one thread has a background lane unless turned off");
    if let Some(lane) = lane {
        // Capped at 19, the kernel's last nice value (a suite run under `nice` starts at 10).
        let main = nice(&std::path::PathBuf::from(format!("/proc/{worker}/task/{worker}")));
        assert_eq!(nice(&lane), (main + 10).min(19), "the main thread's nice is {main}");
    }

    let texts: Vec<String> = (0..64).map(|i| format!("text {i} {}", "model ".repeat(248))).collect();
    let body = serde_json::to_vec(&json!({ "inputs": texts })).unwrap();
    let addr = server.addr;
    let long = std::thread::spawn(move || request(addr, "POST", "/embed", &[], &body).unwrap());
    let rows = |server: &Server| server.status()["batches"][0]["rows"].as_u64().unwrap_or(0);
    let until = std::time::Instant::now() + Duration::from_secs(60);
    while rows(&server) == 0 {
        assert!(std::time::Instant::now() < until && !long.is_finished(), "the long request never started running");
        std::thread::sleep(Duration::from_millis(20));
    }
    for i in 0..5 {
        let short = embed(&server, "A short sentence.");
        assert_eq!(short.len(), 384);
        assert!(!long.is_finished(), "short request {i} was answered only after the long one");
    }
    let answer = long.join().unwrap();
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    let answer = answer.json();
    let rows = answer.as_array().unwrap();
    assert_eq!(rows.len(), 64);
    // Joined back in order: the first and last of the first run, the last run's.
    for i in [0, 1, 2, 63] {
        let got: Vec<f64> = rows[i].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        let diff = max_diff(&got, &embed(&server, &texts[i]));
        assert!(diff < 1e-5, "text {i} of the bulk request differs from its own run by {diff}");
    }
}

#[test]
fn short_requests_are_answered_while_a_bulk_request_runs_on_a_worker_of_one_thread() {
    short_requests_are_answered_while_a_bulk_request_runs(true);
}

#[test]
fn short_requests_are_answered_while_a_bulk_request_runs_without_the_background_lane() {
    short_requests_are_answered_while_a_bulk_request_runs(false);
}

/// A request cut into runs is bounded as a whole by request_timeout_secs, as one run is: 512
/// texts of ~250 tokens (~15 s on two cores) with a limit of 1 s are answered 504 naming the
/// limit, and the worker serves on (the same process).
#[test]
fn a_bulk_request_past_the_timeout_is_answered_504_and_the_worker_serves_on() {
    let dir = temp_dir("bulk-timeout");
    let repository = model_repository(dir.path(), &["minilm"]);
    let server = serve(dir, 1, &repository, "minilm", &[], "request_timeout_secs = 1\nmax_batch_inputs = 512");
    let pids = server.worker_pids();
    let texts: Vec<String> = (0..512).map(|i| format!("text {i} {}", "model ".repeat(248))).collect();
    let r = server.request("POST", "/embed", &serde_json::to_vec(&json!({ "inputs": texts })).unwrap());
    assert_eq!(r.status, 504, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.error().contains("server.request_timeout_secs = 1"), "{}", r.error());
    assert_eq!(embed(&server, "still here").len(), 384);
    assert_eq!(server.worker_pids(), pids, "the worker was replaced");
}

/// Graphs whose first dimension is no batch (tests/fixtures, scripts/gen_test_models.py):
/// `cumsum`, a running sum over a vector whose dimension the graph names `n`, and `centered`,
/// rows less the mean of all the request's rows, whose graph names its rows `batch` although
/// each answer depends on every row, so its model.toml says `max_batch_size = 0`. Cut into
/// pieces, a request to either is answered wrong; run with another request's rows, so is
/// `centered`. Each is answered whole and alone: every answer equals the graph's on that
/// request (the sum restarted at 33 when pieces of 32 rows were the rule).
#[test]
fn a_model_without_a_batch_dimension_answers_every_request_whole_and_alone() {
    let dir = temp_dir("no-batch");
    let repository = dir.path().join("models");
    for (name, batching) in [("cumsum", ""), ("centered", "[batching]\nmax_batch_size = 0\nmax_queue_delay_ms = 50\n")]
    {
        model_of_file(&repository, name, &fixture(name), batching);
    }
    let server = serve(dir, 1, &repository, "cumsum", &["centered"], "");
    let infer = |model: &str, shape: &[usize], data: &[f32]| -> Vec<f64> {
        let body = infer_body(json!([{ "name": "x", "shape": shape, "datatype": "FP32", "data": data }]));
        let r = server.request("POST", &format!("/v2/models/{model}/infer"), &body);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        r.json()["outputs"][0]["data"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect()
    };

    // 100 ones: 1, 2, ..., 100, past the 32 rows a batch model's run takes.
    let sums = infer("cumsum", &[100], &[1.0; 100]);
    assert_eq!(sums, (1..=100).map(f64::from).collect::<Vec<_>>());

    // Clients at once, each request of 1 to 40 rows of its own values: each answer is its rows
    // less their own mean, whatever waited beside it (50 ms of max_queue_delay_ms would have
    // gathered company for a batch model).
    let requests: Vec<Vec<f32>> =
        (0..24).map(|k| (0..4 * (1 + (k * 7) % 40)).map(|i| (k * 100 + i) as f32).collect()).collect();
    std::thread::scope(|scope| {
        for chunk in requests.chunks(3) {
            let infer = &infer;
            scope.spawn(move || {
                for rows in chunk {
                    let n = rows.len() / 4;
                    let got = infer("centered", &[n, 4], rows);
                    for (i, value) in got.iter().enumerate() {
                        let column = (0..n).map(|r| f64::from(rows[r * 4 + i % 4])).sum::<f64>() / n as f64;
                        let want = f64::from(rows[i]) - column;
                        assert!(
                            (value - want).abs() < 1e-3,
                            "a request of {n} rows, value {i}: {value} against {want}"
                        );
                    }
                }
            });
        }
    });
    // One run a request: none was cut into pieces or ran with another.
    let status = server.status();
    let batches = status["batches"].as_array().unwrap();
    let runs_of = |model: &str| {
        let b = batches.iter().find(|b| b["model"] == model).unwrap_or_else(|| panic!("{status:#}"));
        (b["runs"].as_u64().unwrap(), b["rows"].as_u64().unwrap())
    };
    let rows: usize = requests.iter().map(|r| r.len() / 4).sum();
    // The warm-up's runs are not counted: the requests' runs and rows alone.
    assert_eq!(runs_of("centered"), (requests.len() as u64, rows as u64), "{status:#}");
    assert_eq!(runs_of("cumsum"), (1, 100), "{status:#}");
    // Triton's model configuration says so: no batch dimension, the whole shape in `dims`.
    let config = server.request("GET", "/v2/models/cumsum/config", b"").json();
    assert_eq!((config["max_batch_size"].as_u64(), &config["input"][0]["dims"]), (Some(0), &json!([-1])), "{config}");
    assert!(config.get("dynamic_batching").is_none(), "{config}");
    // The log says why each runs whole.
    let log = server.log();
    assert!(log.contains("no batch dimension") && log.contains("('n')"), "{log}");
    assert!(log.contains("max_batch_size = 0"), "{log}");
}
