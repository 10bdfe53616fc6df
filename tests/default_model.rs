//! The README's path: the repository's own inferd.toml, found without --config, serves the
//! default model (all-MiniLM-L6-v2 int8, fetched by `make setup`) with the same numbers as
//! onnxruntime in Python (reference produced by scripts/make_reference.py).

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

#[test]
fn default_config_serves_minilm_like_python_onnxruntime() {
    let model = repo().join("models/minilm/model.onnx");
    assert!(model.is_file(), "{} is missing: run `make setup` (`make test` does it first)", model.display());
    let reference: Value =
        serde_json::from_slice(&std::fs::read(repo().join("tests/fixtures/minilm_reference.json")).unwrap()).unwrap();

    let dir = TempDir::new("default");
    let port = free_port();
    let socket = dir.path().join("ctl.sock");
    let mut command = Command::new(BIN);
    // No --config, and a working directory without inferd.toml: the file beside/above the
    // binary (the repository's) must be found.
    command
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--workers", &test_workers().to_string()])
        .arg("--control-socket")
        .arg(&socket)
        .env_remove("INFERD_CONFIG")
        .env_remove("ORT_DYLIB_PATH");
    let mut server = Server::spawn(command, dir, port, Some(socket));
    let status = server.wait_ready(Duration::from_secs(90));
    assert_eq!(status["workers"][0]["models"][0]["name"], "minilm");

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
