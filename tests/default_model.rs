//! The README's path: the repository's own inferd.toml, found without --config, serves the
//! default model (all-MiniLM-L6-v2 int8, fetched by `make setup`) with the same numbers as
//! onnxruntime in Python (reference produced by scripts/make_reference.py).

use std::process::Command;
use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

fn fixture(name: &str) -> Value {
    serde_json::from_slice(&std::fs::read(repo().join("tests/fixtures").join(name)).unwrap()).unwrap()
}

/// `inferd serve` with the repository's own inferd.toml, found without --config.
fn default_server() -> Server {
    let model = repo().join("models/minilm/model.onnx");
    assert!(model.is_file(), "{} is missing: run `make setup` (`make test` does it first)", model.display());
    let dir = temp_dir("default");
    let port = free_port();
    let socket = dir.path().join("ctl.sock");
    let mut command = Command::new(BIN);
    // No --config, and a working directory without inferd.toml: the file beside/above the
    // binary (the repository's) must be found.
    command
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--workers", &test_workers().to_string()])
        .args(["--admin-listen", ""])
        .arg("--control-socket")
        .arg(&socket)
        .env_remove("INFERD_CONFIG")
        .env_remove("ORT_DYLIB_PATH");
    let mut server = Server::spawn(command, dir, port, Some(socket));
    let status = server.wait_ready(Duration::from_secs(90));
    assert_eq!(status["workers"][0]["models"][0]["name"], "minilm");
    server
}

#[test]
fn default_config_serves_minilm_like_python_onnxruntime() {
    let reference = fixture("minilm_reference.json");
    let server = default_server();

    let ready = server.request("GET", "/v2/health/ready", b"");
    assert_eq!(ready.status, 200);

    let body = serde_json::to_vec(&json!({ "id": "ref-1", "inputs": reference["inputs"] })).unwrap();
    let response = server.request("POST", "/v2/models/minilm/infer", &body);
    assert_eq!(response.status, 200, "{}", String::from_utf8_lossy(&response.body));
    let answer = response.json();
    assert_eq!(answer["id"], "ref-1");
    let output = &answer["outputs"][0];
    let expected = &reference["output"];
    assert_eq!(output["name"], expected["name"]);
    assert_eq!(output["datatype"], "FP32");
    assert_eq!(output["shape"], expected["shape"]);
    let got: Vec<f64> = output["data"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let want: Vec<f64> = expected["data"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert_eq!(got.len(), want.len());
    let max_diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    eprintln!("max |inferd - python onnxruntime| = {max_diff:e} over {} values", got.len());
    assert!(max_diff < 1e-4, "max abs diff {max_diff} >= 1e-4");
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// `/embed` (TEI-compatible) on the default model matches tokenizers + onnxruntime in Python
/// (scripts/make_reference.py), normalised and not, with and without truncation.
#[test]
fn embed_matches_the_python_pipeline() {
    let reference = fixture("minilm_embed_reference.json");
    let server = default_server();
    let mut worst: f64 = 0.0;
    for case in reference["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let truncated = case["truncated"].as_bool().unwrap();
        let body = serde_json::to_vec(&json!({ "inputs": text, "truncate": truncated })).unwrap();
        let r = server.request("POST", "/embed", &body);
        assert_eq!(r.status, 200, "{text:.40}: {}", String::from_utf8_lossy(&r.body));
        let rows = r.json();
        assert_eq!(rows.as_array().unwrap().len(), 1);
        let d = max_diff(&floats(&rows[0]), &floats(&case["embedding"]));
        assert!(d < 1e-4, "{text:.40}: max diff {d}");
        worst = worst.max(d);
        assert_eq!(r.header("x-inferd-truncated"), truncated.then_some("0"), "{text:.40}");
        // Where the model's time went: waiting for a lane and the run are parts of it.
        let timing = |metric| r.server_timing(metric).unwrap_or_else(|| panic!("no {metric} in Server-Timing"));
        let (model, queue, compute) = (timing("model"), timing("queue"), timing("compute"));
        assert!(compute > 0.0 && queue >= 0.0, "{text:.40}: queue {queue}, compute {compute}");
        // Each is rounded to a microsecond.
        assert!(queue + compute <= model + 0.002, "{text:.40}: queue {queue} + compute {compute} > model {model}");

        let body = serde_json::to_vec(&json!({ "inputs": [text], "truncate": true, "normalize": false })).unwrap();
        let raw = server.request("POST", "/embed", &body).json();
        let d = max_diff(&floats(&raw[0]), &floats(&case["embedding_raw"]));
        assert!(d < 1e-4, "{text:.40} (not normalised): max diff {d}");

        if truncated {
            // Too long and truncation not allowed: refused, naming the count and the limit.
            let body = serde_json::to_vec(&json!({ "inputs": text })).unwrap();
            let r = server.request("POST", "/embed", &body);
            assert_eq!(r.status, 413);
            let tokens = case["tokens"].as_u64().unwrap();
            assert!(
                r.error().contains(&format!("input 0 has {tokens} tokens, but the model takes at most 256")),
                "{}",
                r.error()
            );
        }
    }
    eprintln!("max |inferd - python| over all /embed cases: {worst:e}");

    // The same through KServe v2 with a BYTES input.
    let case = &reference["cases"][2];
    let body = serde_json::to_vec(
        &json!({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [case["text"]]}]}),
    )
    .unwrap();
    let r = server.request("POST", "/v2/models/minilm/infer", &body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let out = &r.json()["outputs"][0];
    assert_eq!((out["name"].as_str(), &out["shape"]), (Some("embedding"), &json!([1, 384])));
    assert!(max_diff(&floats(&out["data"]), &floats(&case["embedding"])) < 1e-4);

    // An empty string is refused (documented in docs/protocol.md).
    let r = server.request("POST", "/embed", br#"{"inputs": ["fine", ""]}"#);
    assert_eq!(r.status, 400);
    assert_eq!(r.error(), "input 1 is empty");
}

/// Padding to the longest text in a batch must not change any text's embedding.
#[test]
fn a_batch_gives_each_text_its_own_embedding() {
    let reference = fixture("minilm_embed_reference.json");
    let server = default_server();
    let cases = reference["cases"].as_array().unwrap();
    let texts: Vec<&Value> = cases.iter().map(|c| &c["text"]).collect();
    let body = serde_json::to_vec(&json!({ "inputs": texts, "truncate": true })).unwrap();
    let r = server.request("POST", "/embed", &body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let rows = r.json();
    assert_eq!(rows.as_array().unwrap().len(), cases.len());
    for (i, case) in cases.iter().enumerate() {
        let alone = server
            .request("POST", "/embed", &serde_json::to_vec(&json!({"inputs": case["text"], "truncate": true})).unwrap())
            .json();
        let d = max_diff(&floats(&rows[i]), &floats(&alone[0]));
        assert!(d < 1e-5, "case {i}: batched and alone differ by {d}");
    }
    let truncated: Vec<String> = cases
        .iter()
        .enumerate()
        .filter(|(_, c)| c["truncated"].as_bool().unwrap())
        .map(|(i, _)| i.to_string())
        .collect();
    assert_eq!(r.header("x-inferd-truncated"), Some(truncated.join(",").as_str()));
}
