//! Long texts embedded whole (model.toml's `[embedding] long_texts = "chunk"`; docs/models.md,
//! "Long texts"): a text past the model's length, in a request that does not ask to truncate,
//! is cut into windows, embedded in one batch and pooled into one embedding, equal to
//! tests/clients/chunk_reference.py (the same windows and pooling with onnxruntime in
//! Python) for texts of about 1, 2.5 and 10 times the model's length; a request past
//! `max_chunked_tokens` is refused with 413 naming it.

use std::process::Command;
use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

/// The default model (minilm) as two models of a repository: `chunked` (mean of the windows,
/// 16 tokens of overlap) and `chunked_max` (their largest values, no overlap).
fn server() -> Server {
    let dir = temp_dir("long-texts");
    let repository = dir.path().join("repo");
    let minilm = repo().join("models/minilm");
    for (name, settings) in [
        ("chunked", "chunk_overlap = 16\nmax_chunked_tokens = 4096"),
        ("chunked_max", "chunk_pooling = \"max\"\nmax_chunked_tokens = 3000"),
    ] {
        let folder = repository.join(name);
        std::fs::create_dir_all(&folder).unwrap();
        let toml = format!(
            "name = \"{name}\"\nversion = \"1\"\nfile = \"{}\"\ntask = \"embedding\"\n\n[tokenizer]\nfile = \"{}\"\n\
             max_length = 256\n\n[embedding]\npooling = \"mean\"\nnormalize = true\nlong_texts = \"chunk\"\n{settings}\n",
            minilm.join("model.onnx").display(),
            minilm.join("tokenizer.json").display()
        );
        std::fs::write(folder.join("model.toml"), toml).unwrap();
    }
    let port = free_port();
    write_config(dir.path(), port, 1, &repository, "chunked", &["chunked_max"], "");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(120));
    server
}

fn reference(overlap: usize, pooling: &str, texts: &[&str]) -> Vec<Value> {
    let out = Command::new(python())
        .arg(repo().join("tests/clients/chunk_reference.py"))
        .arg(overlap.to_string())
        .arg(pooling)
        .args(texts)
        .output()
        .unwrap();
    assert!(out.status.success(), "chunk_reference.py: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn embed(server: &Server, model: &str, texts: &[&str], truncate: bool) -> Response {
    let body = json!({ "inputs": texts, "truncate": truncate });
    server.request("POST", &format!("/v2/models/{model}/embed"), &serde_json::to_vec(&body).unwrap())
}

fn worst(got: &[f64], want: &Value) -> f64 {
    let want: Vec<f64> = want.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert_eq!(got.len(), want.len());
    got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max)
}

/// About `tokens` tokens of text (each repetition is 12 tokens for MiniLM's tokenizer).
fn text_of(tokens: usize) -> String {
    "Every window of the long text is read by the model. ".repeat(tokens / 12)
}

#[test]
fn long_texts_are_embedded_whole_as_the_python_reference_pools_their_windows() {
    let server = server();
    // Just past the model's 254 tokens beside [CLS] and [SEP], 2.5 and 10 times its length.
    let texts = [text_of(264), text_of(640), text_of(2560)];
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    let want = reference(16, "mean", &texts);
    let r = embed(&server, "chunked", &texts, false);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let got: Vec<Vec<f64>> = serde_json::from_slice(&r.body).unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let d = worst(g, &w["embedding"]);
        eprintln!("text {i}: {} tokens in {} windows: {d:.2e} from the reference", w["tokens"], w["windows"]);
        assert!(d < 1e-5, "text {i}: {d}");
        assert!(w["windows"].as_u64().unwrap() >= 2, "text {i} is long: {w}");
    }
    assert!(r.header("x-inferd-truncated").is_none(), "nothing was cut");
    // The largest values of the windows instead of their mean.
    let want = reference(0, "max", &texts[1..2]);
    let r = embed(&server, "chunked_max", &texts[1..2], false);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let got: Vec<Vec<f64>> = serde_json::from_slice(&r.body).unwrap();
    assert!(worst(&got[0], &want[0]["embedding"]) < 1e-5, "max pooling");
    // A request that asks to truncate still gets the first window alone.
    let r = embed(&server, "chunked", &texts[1..2], true);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-inferd-truncated"), Some("0"));
    let cut: Vec<Vec<f64>> = serde_json::from_slice(&r.body).unwrap();
    let whole: Vec<Vec<f64>> = serde_json::from_slice(&embed(&server, "chunked", &texts[1..2], false).body).unwrap();
    assert!(worst(&cut[0], &json!(whole[0])) > 1e-3, "truncated and whole differ");
    // Past max_chunked_tokens (4096): refused before any run, naming the bound.
    let r = embed(&server, "chunked", &[&text_of(4600)], false);
    assert_eq!(r.status, 413, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.error().contains("embedding.max_chunked_tokens"), "{}", r.error());
}
