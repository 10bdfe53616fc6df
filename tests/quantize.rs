//! `precision = "int8"`: inferd rewrites the default model's MatMuls for ONNX Runtime's integer
//! kernels itself, measures the result against fp32 (the accuracy guard) and serves it only
//! when the guard passes, saying what it measured; the session runs DynamicQuantizeMatMul and QAttention
//! (read from the graph ORT optimised and the workers map); embeddings of texts the guard
//! never saw stay close to onnxruntime's fp32 ones; a guard that cannot pass refuses int8
//! (`int8`) or serves fp32 (`auto`), with the figures. Image and raw models are guarded too, on
//! generated images and tensors and on the user's own inputs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::*;
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
        assert!(
            precision.starts_with("int8 (") && precision.contains("MatMul/Gemm/Attention nodes in int8"),
            "{precision}"
        );
        assert!(precision.contains("min cosine 0.9"), "{precision}");
        // The CPU's int8 class by CPUID, and the weights' bits it decides (8 only with VNNI).
        let served = &worker["models"][0]["precision_served"];
        let class = served["cpu"].as_str().unwrap_or("");
        let (weights, bits) =
            (served["weight_type"].as_str().unwrap_or(""), served["weight_bits"].as_u64().unwrap_or(0));
        assert!(["avx512-vnni", "avx-vnni", "avx512", "avx2", "other"].contains(&class), "{served}");
        // With VNNI, s8 weights of 8 bits; without, the guard's choice of s8 of 7 or u8 of 8.
        let expected: &[(&str, u64)] = if class.ends_with("vnni") { &[("s8", 8)] } else { &[("s8", 7), ("u8", 8)] };
        assert!(expected.contains(&(weights, bits)), "{served}");
        assert!(precision
            .contains(&format!("CPU class {class} (CPUID): u8 activations x {weights} weights of {bits} bits")));
        let row = format!(
            "inferd_model_int8_info{{model=\"minilm\",version=\"1\",cpu_class=\"{class}\",weight_type=\"{weights}\",weight_bits=\"{bits}\"}} 1"
        );
        assert!(server.metrics_text().contains(&row), "{row}");
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

/// A repository in `dir` of the test model `model` with `settings` in its model.toml (keys
/// first, then any `[section]`) and `files` (name, bytes) beside it.
fn test_repository(dir: &Path, model: &str, settings: &str, files: &[(&str, &[u8])]) -> PathBuf {
    let folder = dir.join("repo").join(model);
    std::fs::create_dir_all(&folder).unwrap();
    let source = test_models().join(model);
    std::fs::copy(source.join("model.onnx"), folder.join("model.onnx")).unwrap();
    let tokenizer = repo().join("models/minilm/tokenizer.json");
    let toml = std::fs::read_to_string(source.join("model.toml")).unwrap();
    let toml = toml.replace("../../../models/minilm/tokenizer.json", tokenizer.to_str().unwrap());
    // Top-level keys go before the file's sections, a section after them.
    let (keys, section) = settings.split_at(settings.find('[').unwrap_or(settings.len()));
    let file = "file = \"model.onnx\"\n";
    let toml = format!("{}\n{section}\n", toml.replacen(file, &format!("{file}{keys}\n"), 1));
    std::fs::write(folder.join("model.toml"), toml).unwrap();
    for (name, bytes) in files {
        std::fs::write(folder.join(name), bytes).unwrap();
    }
    dir.join("repo")
}

/// `inferd check` on a repository of `model` (minilm or a test model) with `settings` added to
/// its model.toml and `files` beside it: whether it passed, and what it printed.
fn check_with(dir: &Path, case: &str, model: &str, settings: &str, files: &[(&str, &[u8])]) -> (bool, String) {
    let sub = dir.join(case);
    std::fs::create_dir_all(&sub).unwrap();
    let repository = match model {
        "minilm" => repository(&sub, settings),
        _ => test_repository(&sub, model, settings, files),
    };
    let config = write_config(&sub, free_port(), 1, &repository, model, &[], "");
    let out = Command::new(BIN).arg("check").arg("--config").arg(&config).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn check(dir: &Path, case: &str, model: &str, settings: &str) -> (bool, String) {
    check_with(dir, case, model, settings, &[])
}

#[test]
fn a_classifiers_guard_measures_probabilities() {
    let dir = temp_dir("int8-classifier");
    // The test classifier has one MatMul; quantised, its probabilities move by 0.0058 with
    // VNNI and 0.0112 without (AVX2): under the default bound 0.02 on either, accepted.
    let (ok, text) = check(dir.path(), "int8", "classifier", "precision = \"int8\"");
    assert!(ok, "{text}");
    assert!(
        text.contains("precision int8 (1 of 1 MatMul/Gemm/Attention nodes in int8; largest probability error 0.0"),
        "{text}"
    );
    assert!(text.contains("% with fp32 over 48 texts"), "{text}");
    let error = figure(&text, "largest probability error ");
    eprintln!("the classifier in int8 on this CPU: largest probability error {error}, bound 0.02");
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

/// The CPU class and the formulation `check` printed: `CPU class NAME (CPUID): FORMULATION`,
/// up to what it was chosen over.
fn cpu_class(text: &str) -> (&str, &str) {
    let rest = text.split("; CPU class ").nth(1).unwrap_or_else(|| panic!("no CPU class in: {text}"));
    let (class, rest) = rest.split_once(" (CPUID): ").unwrap_or_else(|| panic!("{text}"));
    let end = rest.find(", chosen over").or_else(|| rest.find(")\n")).unwrap_or(rest.len());
    (class, &rest[..end])
}

const S8_7: &str = "u8 activations x s8 weights of 7 bits per output column (reduce_range)";
const U8_8: &str = "u8 activations x u8 weights of 8 bits per output column (zero point 128)";

/// Issue 60: int8's class is the kernels' own, read from CPUID as ONNX Runtime reads it, so a
/// CPU without VNNI is known as one even where /proc/cpuinfo says otherwise, and the guard
/// measures the formulations its kernels add exactly. Here an AMD EPYC Zen 3 (AVX2 and FMA, no
/// VNNI, no AVX-512) emulated by Debian's qemu-user runs `inferd check` on the test
/// classifier, its /proc/cpuinfo the host's: CPUID says avx2, both 7-bit s8 and 8-bit u8
/// weights were measured and one chosen, and ONNX Runtime's int8 kernels ran (the
/// probabilities moved from fp32's, within the guard's bound). Before, a VNNI host's flags gave
/// full-range s8 weights to the AVX2 kernels, whose 16-bit pairs saturate: the largest
/// probability error was 0.0770 (top-1 agreement 97.9%) and int8 was refused; 7-bit s8 gives
/// 0.0112, 8-bit u8 0.0058, as with VNNI. ~3 s.
#[test]
fn without_vnni_by_cpuid_an_emulated_avx2_cpu_measures_its_formulations_and_runs_int8() {
    let qemu = system_bin("qemu-x86_64", "qemu-user");
    let dir = temp_dir("int8-emulated");
    let (ok, native) = check(dir.path(), "native", "classifier", "precision = \"int8\"");
    assert!(ok, "{native}");
    let (class, formulation) = cpu_class(&native);
    match class.ends_with("vnni") {
        true => assert_eq!(formulation, "u8 activations x s8 weights of 8 bits per output column", "{native}"),
        false => assert!([S8_7, U8_8].contains(&formulation), "{native}"),
    }

    let sub = dir.path().join("emulated");
    std::fs::create_dir_all(&sub).unwrap();
    let repository = test_repository(&sub, "classifier", "precision = \"int8\"", &[]);
    let config = write_config(&sub, free_port(), 1, &repository, "classifier", &[], "");
    let out = Command::new(qemu).args(["-cpu", "EPYC-Milan", BIN, "check", "--config"]).arg(&config).output().unwrap();
    // qemu warns of each CPU feature its emulation lacks; the rest is inferd's.
    let emulated: String = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
        .lines()
        .filter(|l| !l.contains("TCG doesn't support requested feature"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(out.status.success(), "{emulated}");
    let (class, chosen) = cpu_class(&emulated);
    assert_eq!(class, "avx2", "{emulated}");
    assert!([S8_7, U8_8].contains(&chosen), "{emulated}");
    let other = if chosen == S8_7 { U8_8 } else { S8_7 };
    assert!(emulated.contains(&format!("chosen over {other}: the largest probability error 0.")), "{emulated}");
    let served = "precision int8 (1 of 1 MatMul/Gemm/Attention nodes in int8; largest probability error ";
    let (error, passed_over) = (figure(&emulated, served), figure(&emulated, "the largest probability error "));
    assert!(error > 0.0 && error <= 0.02 && passed_over > 0.0, "int8 ran and passed its guard: {emulated}");
    eprintln!("the classifier in int8 on an emulated avx2 CPU: {chosen}: {error}; {other}: {passed_over}");
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

/// The figure a guard's report gives after `label` (`"largest probability error "`).
fn figure(text: &str, label: &str) -> f64 {
    let at = text.find(label).unwrap_or_else(|| panic!("no {label:?} in: {text}")) + label.len();
    let number: String = text[at..].chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
    number.parse().unwrap_or_else(|_| panic!("no figure after {label:?} in: {text}"))
}

#[test]
fn image_models_are_guarded_on_generated_images_and_the_users_own() {
    let dir = temp_dir("int8-image");
    // The test CNN's Gemm head (its Conv stays fp32) over the 24 generated images. Its error
    // depends on the CPU's int8 kernels (0.0222 without VNNI, less with it), so the guard's
    // contract is asserted around the figure measured here, with bounds far from it: accepted
    // under a bound ten times any kernel's figure, refused with the figure under half of it,
    // and served in fp32 then by `auto`.
    let loose = "precision = \"int8\"\n[quantization]\nmax_probability_error = 0.25";
    let (ok, text) = check(dir.path(), "int8", "cnn", loose);
    assert!(ok, "{text}");
    assert!(
        text.contains("precision int8 (1 of 1 MatMul/Gemm/Attention nodes in int8; largest probability error 0.0"),
        "{text}"
    );
    assert!(text.contains("with fp32 over 24 images"), "{text}");
    let error = figure(&text, "largest probability error ");
    eprintln!("the CNN in int8 on this CPU: largest probability error {error}, bound 0.25");
    if error > 0.0 {
        let strict = format!("[quantization]\nmax_probability_error = {}", error / 2.0);
        let (ok, refused) = check(dir.path(), "strict", "cnn", &format!("precision = \"int8\"\n{strict}"));
        assert!(!ok, "{refused}");
        assert!(
            refused.contains(&format!("the largest probability error is {error:.4}"))
                && refused.contains(&format!("max_probability_error = {}", error / 2.0)),
            "{refused}"
        );
        let (ok, fp32) = check(dir.path(), "auto", "cnn", &format!("precision = \"auto\"\n{strict}"));
        assert!(ok, "{fp32}");
        assert!(fp32.contains("precision fp32 (int8 refused: the largest probability error is"), "{fp32}");
    } else {
        eprintln!("SKIPPED the strict bound: int8 equals fp32 exactly on this CPU, no bound below it");
    }
    // The user's images, named relative to the calibration file, are measured too.
    let images = repo().join("tests/fixtures/images");
    let red = std::fs::read(images.join("red.png")).unwrap();
    let gray = std::fs::read(images.join("gray.jpg")).unwrap();
    let own = format!("{loose}\ncalibration = \"calibration.txt\"");
    let list = b"red.png\n\ngray.jpg\n";
    let files: &[(&str, &[u8])] = &[("calibration.txt", list), ("red.png", &red), ("gray.jpg", &gray)];
    let (ok, text) = check_with(dir.path(), "own", "cnn", &own, files);
    assert!(ok, "{text}");
    assert!(text.contains("with fp32 over 26 images"), "{text}");
    // One that cannot be read is named with its line.
    let files: &[(&str, &[u8])] = &[("calibration.txt", b"red.png\nmissing.png\n"), ("red.png", &red)];
    let (ok, text) = check_with(dir.path(), "missing", "cnn", &own, files);
    assert!(!ok, "{text}");
    assert!(text.contains("calibration.txt, line 2: cannot read") && text.contains("missing.png"), "{text}");
    // Nor one outside the calibration file's folder (a model.toml may not name files outside
    // the repository, and neither may its calibration list).
    let files: &[(&str, &[u8])] = &[("calibration.txt", b"../../inferd.toml\n")];
    let (ok, text) = check_with(dir.path(), "outside", "cnn", &own, files);
    assert!(!ok, "{text}");
    assert!(text.contains("line 1: cannot read") && text.contains("outside the calibration file's folder"), "{text}");
    // A model with nothing to quantise: `auto` serves fp32 and says why.
    let (ok, text) = check(dir.path(), "pixels", "pixels", "precision = \"auto\"");
    assert!(ok, "{text}");
    assert!(text.contains("precision fp32 (int8 refused: the model has no fp32 MatMul or Gemm"), "{text}");
}

/// The test MLP's fp32 output for `x`, by onnxruntime.
fn mlp_fp32(x: &[f32]) -> Vec<f64> {
    let script = "import json, sys, numpy as np, onnxruntime as ort\n\
                  s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n\
                  x = np.array(json.loads(sys.argv[2]), np.float32).reshape(-1, 16)\n\
                  print(json.dumps(s.run(None, {'x': x})[0].ravel().tolist()))";
    let model = test_models().join("mlp/model.onnx");
    let x = serde_json::to_string(x).unwrap();
    let out = Command::new(python()).args(["-c", script]).arg(model).arg(x).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    floats(&serde_json::from_slice(&out.stdout).unwrap())
}

#[test]
fn raw_models_are_guarded_on_generated_tensors_and_the_users_requests() {
    let dir = temp_dir("int8-raw");
    // Served: the MatMul and the Gemm (transB) in int8, answers close to onnxruntime's fp32.
    let repository = test_repository(dir.path(), "mlp", "precision = \"int8\"", &[]);
    let server = serve(dir, 1, &repository, "mlp", &[], "");
    let precision = server.status()["workers"][0]["models"][0]["precision"].as_str().unwrap().to_string();
    assert!(
        precision.starts_with("int8 (2 of 2 MatMul/Gemm/Attention nodes in int8; relative error to fp32 at most 0.0"),
        "{precision}"
    );
    assert!(precision.contains("over 24 inputs"), "{precision}");
    let x: Vec<f32> = (0..32).map(|i| ((i * 7 % 13) as f32 - 6.0) / 3.0).collect();
    let body = json!({"inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32", "data": x}]});
    let r = server.request("POST", "/v2/models/mlp/infer", &serde_json::to_vec(&body).unwrap());
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let got = floats(&r.json()["outputs"][0]["data"]);
    let want = mlp_fp32(&x);
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|d| d * d).sum::<f64>().sqrt();
    let error = norm(&mut got.iter().zip(&want).map(|(g, w)| g - w)) / norm(&mut want.iter().copied());
    assert!(got.len() == 8 && error < 0.05, "int8 {got:?} against fp32 {want:?}: relative error {error}");
    drop(server);

    let dir = temp_dir("int8-raw-check");
    // A bound it cannot meet refuses int8 with the figure and the key.
    let strict = "precision = \"int8\"\n[quantization]\nmax_relative_error = 0.0001";
    let (ok, text) = check(dir.path(), "strict", "mlp", strict);
    assert!(!ok, "{text}");
    assert!(
        text.contains("the largest relative error of an output is 0.0")
            && text.contains("over quantization.max_relative_error = 0.0001"),
        "{text}"
    );
    // The user's own inputs, as KServe v2 requests, one per line.
    let line = |v: f32| json!({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": vec![v; 16]}]});
    let requests = format!("{}\n{}\n", line(0.5), line(-2.0));
    let own = "precision = \"int8\"\n[quantization]\ncalibration = \"requests.jsonl\"";
    let (ok, text) = check_with(dir.path(), "own", "mlp", own, &[("requests.jsonl", requests.as_bytes())]);
    assert!(ok, "{text}");
    assert!(text.contains("over 26 inputs"), "{text}");
    // A request that does not fit the model is named by its line, with what is wrong.
    let wrong = json!({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]});
    let requests = format!("{}\n{wrong}\n", line(0.5));
    let (ok, text) = check_with(dir.path(), "wrong", "mlp", own, &[("requests.jsonl", requests.as_bytes())]);
    assert!(!ok, "{text}");
    assert!(text.contains("requests.jsonl, line 2: input 'x'"), "{text}");
}
