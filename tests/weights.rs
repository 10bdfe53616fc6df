//! Shared weights (`runtime.cache_dir`): each model version is optimised once into an artefact
//! that every session of every worker maps. Answers must not change, a damaged artefact is
//! rebuilt and never loaded, and a new version gets its own artefact while the old one goes.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::*;
use base64::Engine as _;
use nix::sys::signal::Signal;
use serde_json::json;

/// Every test model plus the default one, all loaded by each worker.
const MODELS: [&str; 5] = ["minilm", "typed", "slow", "classifier", "cnn"];

fn repo_root() -> PathBuf {
    crate::common::repo()
}

/// One request per model, and the bodies of their answers.
fn answers(server: &Server) -> Vec<(String, Vec<u8>)> {
    let image = std::fs::read(repo_root().join("tests/fixtures/images/red.png")).unwrap();
    let image = base64::engine::general_purpose::STANDARD.encode(image);
    let requests: Vec<(&str, Vec<u8>)> = vec![
        ("/embed", serde_json::to_vec(&json!({"inputs": ["shared weights change nothing", "a second text"]})).unwrap()),
        ("/v2/models/typed/infer", typed_request()),
        ("/v2/models/slow/infer", slow_body(50)),
        (
            "/v2/models/classifier/predict",
            serde_json::to_vec(&json!({"inputs": "what a lovely day", "raw_scores": true})).unwrap(),
        ),
        ("/v2/models/cnn/predict", serde_json::to_vec(&json!({"image_b64": image, "raw_scores": true})).unwrap()),
    ];
    requests
        .into_iter()
        .map(|(path, body)| {
            let r = server.request("POST", path, &body);
            assert_eq!(r.status, 200, "{path}: {}", String::from_utf8_lossy(&r.body));
            (path.to_string(), r.body)
        })
        .collect()
}

fn serve(tag: &str, extra_sections: &str) -> Server {
    let dir = temp_dir(tag);
    let port = free_port();
    let repo = model_repository(dir.path(), &MODELS);
    let config = write_config(dir.path(), port, test_workers(), &repo, "minilm", &MODELS[1..], "");
    let text = std::fs::read_to_string(&config).unwrap() + extra_sections;
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(120));
    server
}

/// How each worker holds each model's weights, from status.
fn weights(server: &Server) -> Vec<String> {
    let status = server.status();
    let mut all: Vec<String> = status["workers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|w| w["models"].as_array().unwrap().iter().map(|m| format!("{}: {}", m["name"], m["weights"])))
        .collect();
    all.sort();
    all
}

/// The same server (folder, config, port) started again after it stopped.
fn restart(mut server: Server) -> Server {
    let dir = std::mem::replace(&mut server.dir, temp_dir("weights-spare"));
    let port = server.addr.port();
    drop(server);
    let mut again = Server::start(dir, port, &[]);
    again.wait_ready(Duration::from_secs(120));
    again
}

fn artefacts(cache: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(cache)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().to_string()).collect())
        .unwrap_or_default();
    // Not the preparations' lock files (`.lock-{artefact}`).
    names.retain(|n| !n.starts_with('.'));
    names.sort();
    names
}

#[test]
fn shared_weights_answer_exactly_as_private_ones_and_are_prepared_once() {
    let shared = serve("weights-shared", "");
    let private = serve("weights-private", "[runtime]\ncache_dir = \"\"\n");
    for ((path, a), (_, b)) in answers(&shared).into_iter().zip(answers(&private)) {
        assert!(
            a == b,
            "{path}: shared and private weights answer differently:\n{}\n{}",
            String::from_utf8_lossy(&a),
            String::from_utf8_lossy(&b)
        );
    }
    let shared_weights = weights(&shared);
    assert!(shared_weights.iter().all(|w| w.ends_with("\"shared\"")), "{shared_weights:#?}");
    let private_weights = weights(&private);
    assert!(
        private_weights.iter().all(|w| w.contains("private: runtime.cache_dir is not set")),
        "{private_weights:#?}"
    );
    // One artefact per model, prepared by the first worker and mapped by the others.
    let cache = shared.dir.path().join(".cache/inferd");
    let made = artefacts(&cache);
    assert_eq!(made.len(), MODELS.len(), "{made:#?}");
    for name in MODELS {
        assert!(made.iter().any(|a| a.starts_with(&format!("{name}-"))), "no artefact for {name}: {made:#?}");
    }
    assert_eq!(shared.log().matches("shared weights prepared").count(), MODELS.len(), "{}", shared.log());
    assert!(!private.dir.path().join(".cache/inferd").exists());
    // Status tells RSS (shared pages included) from private memory.
    for w in shared.status()["workers"].as_array().unwrap() {
        let (rss, private) = (w["rss_bytes"].as_u64().unwrap(), w["private_bytes"].as_u64().unwrap());
        assert!(private > 0 && private < rss, "{w:#}");
    }
}

#[test]
fn every_allocator_answers_exactly_as_the_default_one() {
    // runtime.allocator changes where a run's buffers come from, never what it computes.
    let default = answers(&serve("allocator-malloc", ""));
    for choice in ["arena", "arena-shrink", "shared-arena"] {
        let server = serve(&format!("allocator-{choice}"), &format!("[runtime]\nallocator = \"{choice}\"\n"));
        for ((path, a), (_, b)) in default.iter().zip(answers(&server)) {
            assert!(
                *a == b,
                "{path}: allocator {choice} answers differently:\n{}\n{}",
                String::from_utf8_lossy(a),
                String::from_utf8_lossy(&b)
            );
        }
    }
}

#[test]
fn a_damaged_artefact_is_rebuilt_never_loaded() {
    let mut server = serve("weights-damaged", "");
    let before = answers(&server);
    let cache = server.dir.path().join(".cache/inferd");
    server.signal(Signal::SIGTERM);
    assert!(server.wait_exit(Duration::from_secs(60)).success());
    // Cut the default model's data file short.
    let minilm = artefacts(&cache).into_iter().find(|a| a.starts_with("minilm-")).unwrap();
    let data = cache.join(&minilm).join("model.onnx.data");
    let len = std::fs::metadata(&data).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&data).unwrap().set_len(len / 2).unwrap();

    let again = restart(server);
    let log = again.log();
    assert!(log.contains("are damaged") && log.contains("model.onnx.data is"), "{log}");
    assert_eq!(log.matches("shared weights prepared").count(), 1, "only the damaged one is rebuilt:\n{log}");
    assert_eq!(std::fs::metadata(&data).unwrap().len(), len);
    assert!(answers(&again) == before, "answers changed after the rebuild");
}

#[test]
fn a_new_version_gets_its_own_artefact_and_the_old_one_goes() {
    let server = serve("weights-reload", "");
    let cache = server.dir.path().join(".cache/inferd");
    let old: Vec<String> = artefacts(&cache).into_iter().filter(|a| a.starts_with("typed-")).collect();
    assert_eq!(old.len(), 1);
    // The same graph with one unknown protobuf field appended (field 100, varint 1): other
    // bytes, so another version, and a model ONNX Runtime loads as before.
    let mut bytes = std::fs::read(test_models().join("typed/model.onnx")).unwrap();
    bytes.extend_from_slice(&[0xa0, 0x06, 0x01]);
    let new_file = server.dir.path().join("typed-v2.onnx");
    std::fs::write(&new_file, bytes).unwrap();

    // Requests throughout the rolling reload.
    let addr = server.addr;
    let load = Clients::start(1, |_| move || post_step(addr, "/v2/models/typed/infer", &typed_request()));
    let out = std::process::Command::new(BIN)
        .args(["reload", "--wait", "--model", "typed", "--path"])
        .arg(&new_file)
        .arg("--control-socket")
        .arg(&server.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stderr), server.log());
    // The old workers drain and exit; then only the new artefact is left.
    let deadline = Instant::now() + Duration::from_secs(60);
    while server.status()["workers"].as_array().unwrap().len() != test_workers() {
        assert!(Instant::now() < deadline, "{:#}", server.status());
        std::thread::sleep(Duration::from_millis(100));
    }
    load.stop().assert_served(1, "during the reload");
    let now: Vec<String> = artefacts(&cache).into_iter().filter(|a| a.starts_with("typed-")).collect();
    assert_eq!(now.len(), 1, "{now:#?}");
    assert_ne!(now, old, "the new version has an artefact of its own");
    let status = server.status();
    for w in status["workers"].as_array().unwrap() {
        let typed = w["models"].as_array().unwrap().iter().find(|m| m["name"] == "typed").unwrap();
        assert_eq!(typed["weights"], "shared", "{w:#}");
        assert!(now[0].contains(typed["sha256"].as_str().unwrap()), "{} vs {typed}", now[0]);
        assert!(w["private_bytes"].as_u64().unwrap() < w["rss_bytes"].as_u64().unwrap(), "{w:#}");
    }
}

/// A request's lookups in the word-embedding table (MiniLM's: 45 MiB, the artefact's one
/// mapping of 40 MiB or more) map the pages of the rows they read and the cached ones around
/// them (the kernel maps up to 64 KiB around a fault), not the large folios a file read
/// through is cached in: ~30 distinct tokens used to leave 14 MiB or more of the table
/// resident in each worker on this kernel.
#[test]
fn lookups_map_the_rows_they_read_not_the_table_around_them() {
    let dir = temp_dir("weights-tables");
    let port = free_port();
    let repo = model_repository(dir.path(), &["minilm"]);
    write_config(dir.path(), port, test_workers(), &repo, "minilm", &[], "");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(120));
    let texts = [
        "The quick brown fox jumps over the lazy dog while the cat sleeps.",
        "Shared weights change nothing in what a model answers.",
        "A second text, with other words in it.",
    ];
    for _ in 0..20 {
        for text in texts {
            let r = server.request("POST", "/embed", &serde_json::to_vec(&json!({ "inputs": text })).unwrap());
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        }
    }
    let cache = server.dir.path().join(".cache/inferd");
    for w in server.status()["workers"].as_array().unwrap() {
        let pid = w["pid"].as_i64().unwrap();
        let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
        // (size, Rss) in kB of each mapping of an artefact's data file.
        let (mut tables, mut size) = (Vec::new(), None);
        for line in smaps.lines() {
            let mut words = line.split_whitespace();
            match (words.next().unwrap_or(""), words.next()) {
                // A mapping's first line: its addresses, ..., its file.
                (first, _) if !first.ends_with(':') => {
                    size = (line.contains(&*cache.to_string_lossy()) && line.ends_with("model.onnx.data")).then_some(0);
                }
                ("Size:", Some(kb)) if size.is_some() => size = kb.parse().ok(),
                ("Rss:", Some(kb)) => {
                    if let Some(size) = size.filter(|&kb| kb >= 40 << 10) {
                        tables.push((size, kb.parse::<u64>().unwrap()));
                    }
                }
                _ => {}
            }
        }
        assert!(!tables.is_empty(), "worker {pid} maps no table of 40 MiB or more:\n{smaps}");
        for (size, rss) in tables {
            assert!(rss <= 4 << 10, "worker {pid}: {rss} kB of a {size} kB table resident after ~30 distinct tokens");
        }
    }
}

/// A cache someone else could write to is never used: an artefact planted by another user
/// (here the genuine one, handed to uid 65534) is not mapped, nor is anything in a cache
/// folder group or others may write; each session loads its own weights, status says why, and
/// the answers are those of the model itself.
#[test]
fn an_artefact_someone_else_could_have_written_is_never_mapped() {
    use std::os::unix::fs::PermissionsExt;
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: handing an artefact to another user needs root (chown)");
        return;
    }
    let mut server = serve("weights-planted", "");
    let before = answers(&server);
    let cache = server.dir.path().join(".cache/inferd");
    server.signal(Signal::SIGTERM);
    assert!(server.wait_exit(Duration::from_secs(60)).success());
    let typed = artefacts(&cache).into_iter().find(|a| a.starts_with("typed-")).unwrap();
    for entry in std::fs::read_dir(cache.join(&typed)).unwrap().flatten().map(|e| e.path()).chain([cache.join(&typed)])
    {
        nix::unistd::chown(&entry, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
    }
    let again = restart(server);
    let w = weights(&again);
    assert!(w.iter().filter(|l| l.starts_with("\"typed\"")).all(|l| l.contains("belongs to uid 65534")), "{w:#?}");
    assert!(w.iter().filter(|l| l.starts_with("\"minilm\"")).all(|l| l.contains("shared")), "{w:#?}");
    assert!(answers(&again) == before, "answers changed");

    // The whole cache writable by others: nothing in it is used.
    let mut server = again;
    server.signal(Signal::SIGTERM);
    assert!(server.wait_exit(Duration::from_secs(60)).success());
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o777)).unwrap();
    let again = restart(server);
    let w = weights(&again);
    assert!(w.iter().all(|l| l.contains("writable by group or others (mode 777)")), "{w:#?}");
    assert!(answers(&again) == before, "answers changed");
}
