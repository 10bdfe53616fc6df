//! `inferd tune`: the real binary starts a real server per candidate plan, loads it, prints one
//! row per candidate and writes the best plan into the configuration and the model's
//! model.toml, keeping their comments.

use std::process::Command;

use crate::common::*;

fn usable_cores(config: &std::path::Path) -> usize {
    let out = Command::new(BIN).arg("check").arg("--config").arg(config).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.starts_with("usable cores:")).unwrap_or_else(|| panic!("{text}"));
    line.split_whitespace().nth(2).unwrap().parse().unwrap()
}

/// `inferd tune --config CONFIG ARGS`: whether it succeeded, its stdout and its stderr.
fn tune(config: &std::path::Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN).arg("tune").arg("--config").arg(config).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The thread counts tune tries per worker on `usable` cores: 1, 2, 4, ... and all of them.
fn thread_splits(usable: usize) -> Vec<usize> {
    let mut splits: Vec<usize> = std::iter::successors(Some(1), |t| Some(t * 2)).take_while(|&t| t <= usable).collect();
    if !splits.contains(&usable) {
        splits.push(usable);
    }
    splits
}

#[test]
fn tune_measures_each_candidate_and_writes_the_best_keeping_comments() {
    let dir = temp_dir("tune");
    // A private copy of the model: --write edits its model.toml.
    let repository = dir.path().join("models");
    let model = repository.join("typed");
    std::fs::create_dir_all(&model).unwrap();
    for file in ["model.onnx", "model.toml"] {
        std::fs::copy(test_models().join("typed").join(file), model.join(file)).unwrap();
    }
    let config = write_config(dir.path(), free_port(), 1, &repository, "typed", &[], "");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("# operator's note: keep me\n{text}")).unwrap();
    let usable = usable_cores(&config);

    let (ok, stdout, stderr) = tune(&config, &["--seconds", "0.3", "--goal", "throughput", "--write"]);
    assert!(ok, "{stdout}\n{stderr}");

    // One row per candidate: every thread split 1, 2, 4, ... (and all cores) x 3 batchings.
    let splits = thread_splits(usable);
    for threads in &splits {
        let plan = format!("{} x {threads} ", usable / threads);
        let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with(&plan)).collect();
        assert_eq!(rows.len(), 3, "plan {plan}: {stdout}");
        assert!(rows.iter().all(|r| !r.contains("failed") && r.trim_end().ends_with(" 0")), "{stdout}");
    }
    assert!(stderr.contains(&format!("[{}/{}]", splits.len() * 3, splits.len() * 3)), "progress: {stderr}");

    // The best plan is in the files, and nothing else changed.
    let best = stdout.lines().find(|l| l.starts_with("best for Throughput: ")).unwrap_or_else(|| panic!("{stdout}"));
    let words: Vec<&str> = best.split_whitespace().collect();
    let (workers, threads) = (words[3], words[6]);
    let written = std::fs::read_to_string(&config).unwrap();
    assert!(written.starts_with("# operator's note: keep me\n"), "{written}");
    assert!(written.contains(&format!("workers = {workers}\n")), "{best}\n{written}");
    assert!(written.contains(&format!("threads = {threads}\n")), "{best}\n{written}");
    let other = |t: &str| -> Vec<String> {
        t.lines().filter(|l| !l.starts_with("workers =") && !l.starts_with("threads =")).map(String::from).collect()
    };
    assert_eq!(other(&written)[1..], other(&text)[..], "only the plan changed");
    let model_toml = std::fs::read_to_string(model.join("model.toml")).unwrap();
    assert!(model_toml.starts_with("# Test model generated"), "{model_toml}");
    let batch = if best.contains("batching off") { "1" } else { "32" };
    assert!(model_toml.contains(&format!("[batching]\nmax_batch_size = {batch}\n")), "{best}\n{model_toml}");
    // What was written is a valid configuration.
    assert_eq!(usable_cores(&config), usable);
    let check = Command::new(BIN).arg("check").arg("--config").arg(&config).output().unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
}

#[test]
fn a_goal_tune_does_not_know_is_refused_with_the_choices() {
    let out = Command::new(BIN).args(["tune", "--goal", "fast"]).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("latency, throughput or p99-under=MS"), "{stderr}");
}

/// The goal's accuracy bound: int8 candidates are served under it, and a bound the guard
/// cannot meet fails them with the figures, so the verdict and the files stay fp32. A bound
/// out of range is refused before anything is measured.
#[test]
fn int8_candidates_are_held_to_the_accuracy_bound_given() {
    let dir = temp_dir("tune-int8");
    let repository = model_repository(dir.path(), &["minilm"]);
    // --write edits model.toml: a copy of it beside links to the rest.
    let model = repository.join("minilm");
    std::fs::remove_file(&model).unwrap();
    std::fs::create_dir_all(&model).unwrap();
    for file in ["model.onnx", "tokenizer.json"] {
        std::os::unix::fs::symlink(repo().join("models/minilm").join(file), model.join(file)).unwrap();
    }
    std::fs::copy(repo().join("models/minilm/model.toml"), model.join("model.toml")).unwrap();
    let config = write_config(dir.path(), free_port(), 1, &repository, "minilm", &[], "");
    let text = std::fs::read_to_string(&config).unwrap().replace("boot_timeout_secs = 60", "boot_timeout_secs = 600");
    std::fs::write(&config, text).unwrap();

    let (ok, _, stderr) = tune(&config, &["--min-cosine", "1.5"]);
    assert!(!ok && stderr.contains("quantization.min_cosine = 1.5 is not in (0, 1]"), "{stderr}");
    assert!(!stderr.contains("candidates"), "refused before measuring: {stderr}");

    let (ok, stdout, stderr) = tune(&config, &["--seconds", "0.3", "--min-cosine", "0.99999", "--write"]);
    assert!(ok, "{stdout}\n{stderr}");
    let int8: Vec<&str> = stdout.lines().filter(|l| l.contains(" int8 ")).collect();
    assert!(!int8.is_empty(), "{stdout}");
    for row in int8 {
        assert!(row.contains("failed") && row.contains("int8\" refused") && row.contains("min cosine"), "{row}");
    }
    let best = stdout.lines().find(|l| l.starts_with("best for Throughput: ")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(best.ends_with(", fp32"), "{best}");
    let model_toml = std::fs::read_to_string(model.join("model.toml")).unwrap();
    assert!(model_toml.contains("precision = \"fp32\""), "{model_toml}");
    assert!(!model_toml.contains("[quantization]"), "no bound written for fp32: {model_toml}");
}

/// Image models are loaded with an image (a PNG of the model's input size, or `--image`):
/// every candidate of the CNN answers it without an error, and the best plan is named. An
/// image for a model that takes none is refused before anything is measured.
#[test]
fn tune_loads_an_image_model_with_images() {
    let dir = temp_dir("tune-image");
    let config = write_config(dir.path(), free_port(), 1, &test_models(), "cnn", &[], "");
    let usable = usable_cores(&config);
    let (ok, stdout, stderr) = tune(&config, &["--seconds", "0.3", "--goal", "throughput"]);
    assert!(ok, "{stdout}\n{stderr}");
    let rows: Vec<&str> = stdout.lines().filter(|l| l.contains(" fp32 ")).collect();
    assert_eq!(rows.len(), thread_splits(usable).len() * 3, "three batchings per plan, fp32 only: {stdout}");
    for row in &rows {
        assert!(!row.contains("failed") && row.trim_end().ends_with(" 0"), "answered without errors: {row}");
        // c=1 answered something: its requests per second are not 0.
        let c1: f64 = row.split(" fp32 ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();
        assert!(c1 > 0.0, "{row}");
    }
    assert!(stdout.lines().any(|l| l.starts_with("best for Throughput: ")), "{stdout}");

    let text = write_config(dir.path(), free_port(), 1, &test_models(), "typed", &[], "");
    let (ok, _, stderr) = tune(&text, &["--image", "x.png"]);
    assert!(!ok && stderr.contains("--image: model 'typed' takes no images"), "{stderr}");
}
