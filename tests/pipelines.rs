//! Classification pipelines end to end: a text classifier through the TEI-compatible
//! `/predict` and KServe v2 BYTES tensors, one whose graph computes probabilities itself
//! (not activated again), images resized and centre-cropped as Pillow does, and a CNN fed
//! encoded images, including hostile ones that must get a 4xx without hurting the worker. References come from
//! scripts/make_reference.py (tokenizers/Pillow + onnxruntime in Python).

use std::time::Duration;

use crate::common::*;
use base64::Engine as _;
use serde_json::{json, Value};

fn fixture(name: &str) -> Value {
    serde_json::from_slice(&std::fs::read(repo().join("tests/fixtures").join(name)).unwrap()).unwrap()
}

fn image(name: &str) -> Vec<u8> {
    std::fs::read(repo().join("tests/fixtures/images").join(name)).unwrap()
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Default model `classifier` (so the short /predict path serves it), plus `cnn`.
fn server(tag: &str) -> Server {
    let tokenizer = repo().join("models/minilm/tokenizer.json");
    assert!(tokenizer.is_file(), "{} is missing: run `make setup`", tokenizer.display());
    serve(temp_dir(tag), test_workers(), &test_models(), "classifier", &["cnn"], "max_batch_inputs = 8")
}

fn post(server: &Server, path: &str, body: Value) -> Response {
    server.request("POST", path, &serde_json::to_vec(&body).unwrap())
}

fn labels(list: &Value) -> Vec<&str> {
    list.as_array().unwrap().iter().map(|p| p["label"].as_str().unwrap()).collect()
}

#[test]
fn text_classifier_predicts_like_the_reference() {
    let reference = fixture("classifier_reference.json");
    let server = server("classify");
    let cases = reference["cases"].as_array().unwrap();
    for case in cases {
        let r = post(&server, "/predict", json!({ "inputs": case["text"] }));
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let list = r.json();
        assert_eq!(
            labels(&list),
            case["ranking"].as_array().unwrap().iter().map(|l| l.as_str().unwrap()).collect::<Vec<_>>()
        );
        let label_names: Vec<&str> =
            reference["labels"].as_array().unwrap().iter().map(|l| l.as_str().unwrap()).collect();
        for p in list.as_array().unwrap() {
            let i = label_names.iter().position(|l| *l == p["label"]).unwrap();
            let want = case["probabilities"][i].as_f64().unwrap();
            assert!((p["score"].as_f64().unwrap() - want).abs() < 1e-4, "{p} vs {want}");
        }
        // top_k, and raw scores (the logits).
        let top = post(&server, "/v2/models/classifier/predict", json!({ "inputs": case["text"], "top_k": 1 })).json();
        assert_eq!(top.as_array().unwrap().len(), 1);
        assert_eq!(top[0]["label"], case["ranking"][0]);
        let raw = post(&server, "/predict", json!({ "inputs": case["text"], "raw_scores": true })).json();
        let best_logit =
            case["logits"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).fold(f64::MIN, f64::max);
        assert!((raw[0]["score"].as_f64().unwrap() - best_logit).abs() < 1e-4, "{raw}");
    }
    // A list of texts gets a list of lists, each as when sent alone.
    let texts: Vec<&Value> = cases.iter().map(|c| &c["text"]).skip(1).collect();
    let batch = post(&server, "/predict", json!({ "inputs": texts })).json();
    assert_eq!(batch.as_array().unwrap().len(), 3);
    for (row, case) in batch.as_array().unwrap().iter().zip(cases.iter().skip(1)) {
        assert_eq!(labels(row)[0], case["ranking"][0]);
    }
    // As TEI does, a two-element list is one pair of texts.
    let pair = post(&server, "/predict", json!({ "inputs": ["first text", "second text"] })).json();
    assert_eq!(pair.as_array().unwrap().len(), 3, "one ranking of 3 labels: {pair}");

    // Errors: empty text, no inputs, too many, wrong endpoint, a model that takes images.
    let cases: Vec<(&str, Value, u16, &str)> = vec![
        ("/predict", json!({"inputs": ""}), 400, "input 0 is empty"),
        ("/predict", json!({"top_k": 1}), 400, "missing 'inputs'"),
        (
            "/predict",
            json!({"inputs": ["a", "b", "c", "d", "e", "f", "g", "h", "i"]}),
            413,
            "9 inputs in one request; the limit is 8",
        ),
        (
            "/embed",
            json!({"inputs": "x"}),
            400,
            "/embed needs an embedding model, but 'classifier' is a classification model",
        ),
        ("/v2/models/cnn/predict", json!({"inputs": "x"}), 400, "model 'cnn' takes images, not text"),
        ("/predict", json!({"inputs": 5}), 400, "request body"),
    ];
    for (path, body, status, message) in cases {
        let r = post(&server, path, body);
        assert_eq!(r.status, status, "{path}: {}", String::from_utf8_lossy(&r.body));
        assert!(r.error().contains(message), "{path}: {} does not contain {message:?}", r.error());
    }
}

/// A classifier whose graph ends in its own Softmax (then an Identity, as tf2onnx writes them)
/// and whose model.toml names no activation: its scores are onnxruntime's own probabilities,
/// not softmaxed again, and `inferd check` says why; the logits classifier beside it is still
/// softmaxed once; an activation model.toml names wins over the graph.
#[test]
fn probabilities_the_graph_computes_are_not_activated_again() {
    let reference = fixture("classifier_reference.json");
    let dir = temp_dir("classify-probs");
    let port = free_port();
    let config =
        write_config(dir.path(), port, test_workers(), &test_models(), "classifier_probs", &["classifier"], "");
    let check = |config: &std::path::Path| {
        let out = std::process::Command::new(BIN).arg("check").arg("--config").arg(config).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let said = check(&config);
    let chosen = "scores none: output 'probs' comes from Softmax node 'head_softmax': probabilities already \
                  (chosen from the graph; classification.activation in model.toml overrides)";
    assert!(said.contains(chosen), "{said}");
    assert!(said.contains("scores softmax: classification.activation in model.toml"), "{said}");

    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    let names: Vec<&str> = reference["labels"].as_array().unwrap().iter().map(|l| l.as_str().unwrap()).collect();
    for case in reference["cases"].as_array().unwrap() {
        for model in ["classifier_probs", "classifier"] {
            let r = post(&server, &format!("/v2/models/{model}/predict"), json!({ "inputs": case["text"] }));
            assert_eq!(r.status, 200, "{model}: {}", String::from_utf8_lossy(&r.body));
            for p in r.json().as_array().unwrap() {
                let want =
                    case["probabilities"][names.iter().position(|l| *l == p["label"]).unwrap()].as_f64().unwrap();
                assert!((p["score"].as_f64().unwrap() - want).abs() < 1e-5, "{model}: {p} vs {want}");
            }
        }
        // Raw scores are the output as the model gave it: here, the probabilities.
        let raw = post(&server, "/predict", json!({ "inputs": case["text"], "raw_scores": true })).json();
        let best = case["probabilities"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).fold(0.0, f64::max);
        assert!((raw[0]["score"].as_f64().unwrap() - best).abs() < 1e-5, "{raw}");
    }

    // model.toml's word wins: the same graph with activation = "softmax" is softmaxed (again).
    let other = temp_dir("classify-probs-toml");
    let folder = other.path().join("repo/classifier_probs");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(test_models().join("classifier_probs/model.onnx"), folder.join("model.onnx")).unwrap();
    let toml = std::fs::read_to_string(test_models().join("classifier_probs/model.toml")).unwrap();
    let tokenizer = repo().join("models/minilm/tokenizer.json");
    let toml = toml
        .replace("../../../models/minilm/tokenizer.json", &tokenizer.display().to_string())
        .replace("output = \"probs\"", "output = \"probs\"\nactivation = \"softmax\"");
    std::fs::write(folder.join("model.toml"), toml).unwrap();
    let config = write_config(other.path(), free_port(), 1, &other.path().join("repo"), "classifier_probs", &[], "");
    let said = check(&config);
    assert!(said.contains("scores softmax: classification.activation in model.toml"), "{said}");
}

#[test]
fn text_classifier_through_v2_bytes_tensors() {
    let reference = fixture("classifier_reference.json");
    let server = server("v2text");
    let texts: Vec<&Value> = reference["cases"].as_array().unwrap().iter().map(|c| &c["text"]).collect();
    let body = json!({
        "id": "bytes-1",
        "inputs": [{"name": "text", "shape": [texts.len()], "datatype": "BYTES", "data": texts}],
        "outputs": [{"name": "label"}, {"name": "probabilities"}],
    });
    let r = post(&server, "/v2/models/classifier/infer", body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let a = r.json();
    assert_eq!(a["id"], "bytes-1");
    assert_eq!(a["outputs"][0]["datatype"], "BYTES");
    let want: Vec<&Value> = reference["cases"].as_array().unwrap().iter().map(|c| &c["ranking"][0]).collect();
    assert_eq!(a["outputs"][0]["data"], json!(want));
    assert_eq!(a["outputs"][1]["shape"], json!([4, 3]));
    // The raw tensors still work too: the model's own inputs bypass the pipeline.
    let meta = server.request("GET", "/v2/models/classifier", b"").json();
    assert_eq!(meta["pipeline"]["inputs"][0], json!({"name": "text", "datatype": "BYTES", "shape": [-1]}));
    assert_eq!(meta["inputs"][0]["name"], "input_ids");
    let r = post(
        &server,
        "/v2/models/classifier/infer",
        json!({"inputs": [{"name": "text", "shape": [1], "datatype": "FP32", "data": [1]}]}),
    );
    assert_eq!(r.status, 400);
    assert!(r.error().contains("input 'text': expected BYTES, got FP32"), "{}", r.error());
}

/// Images resized as Hugging Face's image processors do (`resize = "shortest_edge"`, a centre
/// crop, bicubic): what the model is fed equals what Pillow computes for the same steps, for a
/// landscape and a portrait image (the `pixels` test model answers its own input). Pillow
/// makes the images and the reference (tests/clients/pixels_reference.py).
#[test]
fn the_shortest_edge_is_resized_and_the_centre_cropped_as_pillow_does() {
    let out =
        std::process::Command::new(python()).arg(repo().join("tests/clients/pixels_reference.py")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let reference: Value = serde_json::from_slice(&out.stdout).unwrap();
    let server = serve(temp_dir("pixels"), 1, &test_models(), "pixels", &[], "");
    for case in reference.as_array().unwrap() {
        let r = post(&server, "/predict", json!({ "image_b64": case["png"] }));
        assert_eq!(r.status, 200, "{}: {}", case["size"], String::from_utf8_lossy(&r.body));
        // The answer ranks "labels" p0..p143 by score: put each value back in its place.
        let mut got = vec![f64::NAN; 144];
        for p in r.json().as_array().unwrap() {
            let i: usize = p["label"].as_str().unwrap()[1..].parse().unwrap();
            got[i] = p["score"].as_f64().unwrap();
        }
        let want: Vec<f64> = case["expected"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        let diffs: Vec<f64> = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).collect();
        let (worst, mean) = (diffs.iter().copied().fold(0.0, f64::max), diffs.iter().sum::<f64>() / diffs.len() as f64);
        // Measured: equal to Pillow's within 1e-7 on these gradients; a crop one pixel off is
        // 0.055 off at worst (14 levels of 255) and 0.025 on average. The bound allows two
        // implementations of one bicubic filter (f32, Pillow's fixed point) a level or two.
        assert!(worst <= 2.0 / 255.0 && mean <= 0.5 / 255.0, "{}: worst {worst}, mean {mean}", case["size"]);
    }
}

#[test]
fn cnn_classifies_images_and_refuses_hostile_ones() {
    let reference = fixture("cnn_reference.json");
    let mut server = server("images");
    for case in reference["cases"].as_array().unwrap() {
        let file = case["file"].as_str().unwrap();
        let r = post(&server, "/v2/models/cnn/predict", json!({ "image_b64": b64(&image(file)) }));
        assert_eq!(r.status, 200, "{file}: {}", String::from_utf8_lossy(&r.body));
        let list = r.json();
        assert_eq!(list[0]["label"], case["label"], "{file}: {list}");
        let want =
            case["probabilities"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).fold(f64::MIN, f64::max);
        // A different bilinear implementation may move scores a little, never the class.
        assert!((list[0]["score"].as_f64().unwrap() - want).abs() < 0.05, "{file}: {list} vs {want}");
    }
    // KServe v2 with the image as a BYTES tensor (base64 in JSON).
    let body = json!({"inputs": [{"name": "image", "shape": [2], "datatype": "BYTES", "data": [b64(&image("red.png")), b64(&image("gray.jpg"))]}]});
    let r = post(&server, "/v2/models/cnn/infer", body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["outputs"][0]["data"], json!(["red", "gray"]));

    let hostile = [
        ("truncated.jpg", 400, "corrupt or truncated"),
        ("not_an_image.txt", 400, "not a PNG or JPEG image"),
        ("zero.png", 400, "image 0: empty"),
        ("huge.png", 413, "image 0 is 20000x20000 = 400000000 pixels, more than the model's limit of 40000000"),
        // Found by the image_decode fuzz target: zune-jpeg panics decoding it (refused, 400).
        ("decoder_panic.jpg", 400, "corrupt: the decoder failed on it"),
    ];
    let before = server.worker_pids();
    for (file, status, message) in hostile {
        let r = post(&server, "/v2/models/cnn/predict", json!({ "image_b64": b64(&image(file)) }));
        assert_eq!(r.status, status, "{file}: {}", String::from_utf8_lossy(&r.body));
        assert!(r.error().contains(message), "{file}: {}", r.error());
    }
    let r = post(&server, "/v2/models/cnn/predict", json!({ "image_b64": "***" }));
    assert_eq!(r.status, 400);
    assert!(r.error().contains("image_b64 0 is not base64"), "{}", r.error());
    // Every worker survived and is still ready.
    assert_eq!(server.worker_pids(), before);
    let status = server.wait_ready(Duration::from_secs(1));
    assert!(status["workers"].as_array().unwrap().iter().all(|w| w["restarts"] == 0), "{status:#}");
    assert_eq!(server.request("GET", "/v2/health/ready", b"").status, 200);
}
