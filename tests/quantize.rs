//! `precision = "int8"`: inferd rewrites the default model's MatMuls for ONNX Runtime's integer
//! kernels itself, measures the result against fp32 (the accuracy guard) and serves it only
//! when the guard passes, saying what it measured; the session runs DynamicQuantizeMatMul and QAttention
//! (read from the graph ORT optimised and the workers map); embeddings of texts the guard
//! never saw stay close to onnxruntime's fp32 ones; a guard that cannot pass refuses int8
//! (`int8`) or serves fp32 (`auto`), with the figures.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

/// A repository whose `minilm` is the default model with `settings` added to its model.toml.
fn repository(dir: &Path, settings: &str) -> PathBuf {
    let source = repo().join("models/minilm");
    assert!(source.join("model.onnx").is_file(), "run `make setup` (`make test` does it first)");
    let folder = dir.join("repo/minilm");
    std::fs::create_dir_all(&folder).unwrap();
    for file in ["model.onnx", "tokenizer.json"] {
        std::os::unix::fs::symlink(source.join(file), folder.join(file)).unwrap();
    }
    let toml = std::fs::read_to_string(source.join("model.toml")).unwrap();
    let toml = toml.replacen("task = \"embedding\"", &format!("task = \"embedding\"\n{settings}"), 1);
    std::fs::write(folder.join("model.toml"), toml).unwrap();
    dir.join("repo")
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

#[test]
fn int8_is_served_with_the_guards_figures_and_stays_close_to_fp32() {
    let dir = temp_dir("int8-serve");
    // A guard every CPU's int8 kernels pass (with VNNI the default 0.99 passes too, with 7 of
    // the 24 nodes kept in fp32; without VNNI the weights lose a bit to reduced range).
    let repository = repository(dir.path(), "precision = \"int8\"\n[quantization]\nmin_cosine = 0.98");
    let port = free_port();
    let config = write_config(dir.path(), port, test_workers(), &repository, "minilm", &[], "");
    // The first worker prepares int8 (~20 s alone on 2 cores, more on a busy machine).
    let text = std::fs::read_to_string(&config).unwrap().replace("boot_timeout_secs = 60", "boot_timeout_secs = 600");
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(240));
    let status = server.status();
    for worker in status["workers"].as_array().unwrap() {
        let precision = worker["models"][0]["precision"].as_str().unwrap();
        assert!(precision.starts_with("int8 (") && precision.contains("MatMul/Attention nodes in int8"), "{precision}");
        assert!(precision.contains("min cosine 0.9"), "{precision}");
    }
    // Prepared once, by one process: the others found it.
    let log = server.log();
    assert_eq!(log.matches("int8 prepared in").count(), 1, "{log}");

    // What the session runs: ORT's optimised graph (the artefact the workers map) has the
    // integer MatMuls.
    let cache = server.dir.path().join(".cache/inferd");
    let artefacts: Vec<PathBuf> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("manifest").is_file())
        .collect();
    assert_eq!(artefacts.len(), 1, "{artefacts:?}");
    let script = "import collections, onnx, sys\n\
                  m = onnx.load(sys.argv[1], load_external_data=False)\n\
                  c = collections.Counter(n.op_type for n in m.graph.node)\n\
                  print(c['DynamicQuantizeMatMul'], c['MatMul'], c['QAttention'], c['Attention'])";
    let out = Command::new(python()).args(["-c", script]).arg(artefacts[0].join("model.onnx")).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let counts: Vec<usize> = text.split_whitespace().map(|n| n.parse().unwrap()).collect();
    assert!(out.status.success() && counts.len() == 4, "{text}{}", String::from_utf8_lossy(&out.stderr));
    // At most half of the 24 nodes kept in fp32, the rest integer.
    let (integer, kept) = (counts[0] + counts[2], counts[1] + counts[3]);
    assert!(integer >= 12 && integer + kept == 24 && counts[0] + counts[1] == 18, "{counts:?}");

    // Texts the guard never saw, against onnxruntime's fp32 embeddings.
    let reference: Value =
        serde_json::from_slice(&std::fs::read(repo().join("tests/fixtures/minilm_embed_reference.json")).unwrap())
            .unwrap();
    for case in reference["cases"].as_array().unwrap() {
        let body = serde_json::to_vec(&json!({"inputs": case["text"], "truncate": true})).unwrap();
        let r = server.request("POST", "/embed", &body);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let got = floats(&r.json()[0]);
        let c = cosine(&got, &floats(&case["embedding"]));
        eprintln!("int8 vs fp32, {} tokens: cosine {c:.4}", case["tokens"]);
        assert!(c > 0.97, "cosine {c} for {:?}", case["text"]);
    }
}

/// `inferd check` on a repository of `model` (minilm or the test classifier) with `settings`
/// added to its model.toml: whether it passed, and what it printed.
fn check(dir: &Path, case: &str, model: &str, settings: &str) -> (bool, String) {
    let sub = dir.join(case);
    std::fs::create_dir_all(&sub).unwrap();
    let repository = match model {
        "minilm" => repository(&sub, settings),
        _ => {
            let folder = sub.join("repo").join(model);
            std::fs::create_dir_all(&folder).unwrap();
            let source = test_models().join(model);
            std::fs::copy(source.join("model.onnx"), folder.join("model.onnx")).unwrap();
            let tokenizer = repo().join("models/minilm/tokenizer.json");
            let toml = std::fs::read_to_string(source.join("model.toml")).unwrap();
            let toml = toml.replace("../../../models/minilm/tokenizer.json", tokenizer.to_str().unwrap());
            let toml = toml.replacen("task = \"classification\"", &format!("task = \"classification\"\n{settings}"), 1);
            std::fs::write(folder.join("model.toml"), toml).unwrap();
            sub.join("repo")
        }
    };
    let config = write_config(&sub, free_port(), 1, &repository, model, &[], "");
    let out = Command::new(BIN).arg("check").arg("--config").arg(&config).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn a_classifiers_guard_measures_probabilities() {
    let dir = temp_dir("int8-classifier");
    // The test classifier has one MatMul; quantised, its probabilities move by well under 0.02
    // and every top class stays.
    let (ok, text) = check(dir.path(), "int8", "classifier", "precision = \"int8\"");
    assert!(ok, "{text}");
    assert!(
        text.contains("precision int8 (1 of 1 MatMul/Attention nodes in int8; largest probability error 0.0"),
        "{text}"
    );
    assert!(text.contains("top-1 agreement 100.0% with fp32"), "{text}");
    let (ok, text) = check(
        dir.path(),
        "strict",
        "classifier",
        "precision = \"int8\"\n[quantization]\nmax_probability_error = 0.0001",
    );
    assert!(!ok, "{text}");
    assert!(
        text.contains("the largest probability error is 0.0") && text.contains("max_probability_error = 0.0001"),
        "{text}"
    );
}

#[test]
fn a_guard_that_cannot_pass_refuses_int8_or_keeps_fp32_with_the_figures() {
    let dir = temp_dir("int8-refused");
    let check = |case: &str, settings: &str| check(dir.path(), case, "minilm", settings);
    // No int8 model is that close to fp32.
    let guard = "[quantization]\nmin_cosine = 0.99999";
    let (ok, text) = check("int8", &format!("precision = \"int8\"\n{guard}"));
    assert!(!ok, "{text}");
    assert!(
        text.contains("precision = \"int8\" refused") && text.contains("quantization.min_cosine = 0.99999"),
        "{text}"
    );
    assert!(text.contains("min cosine 0.9"), "the figures: {text}");
    let (ok, text) = check("auto", &format!("precision = \"auto\"\n{guard}"));
    assert!(ok, "{text}");
    assert!(text.contains("precision fp32 (int8 refused: the least cosine to fp32 is"), "{text}");
}
