//! The cache of answers ([cache]; docs/configuration.md, "The cache of answers"): a repeated
//! input is answered from it (the same answer, `x-inferd-cache: hit`), a batch partly from it,
//! `Cache-Control: no-cache` bypasses it, a reload to another model never answers from the old
//! one's entries, and a cache filled past its bound stays within `max_bytes`, counted.

use std::process::Command;
use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

/// One worker (so that every request meets the same cache) serving the published folder
/// `folder` as model "m", with `[cache] max_bytes`.
fn cached_server(tag: &str, folder: &str, max_bytes: &str) -> Server {
    let dir = temp_dir(tag);
    let repository = dir.path().join("repo");
    std::fs::create_dir_all(&repository).unwrap();
    std::os::unix::fs::symlink(test_models().join("published").join(folder), repository.join("m")).unwrap();
    let port = free_port();
    let config = write_config(dir.path(), port, 1, &repository, "m", &[], "");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str(&format!("\n[cache]\nmax_bytes = \"{max_bytes}\"\n"));
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(90));
    server
}

fn embed(server: &Server, inputs: Value, headers: &[(&str, &str)]) -> (Vec<Vec<f64>>, Option<String>) {
    let mut all = vec![("Content-Type", "application/json")];
    all.extend_from_slice(headers);
    let body = serde_json::to_vec(&json!({ "inputs": inputs })).unwrap();
    let r = inferd_bench::http::request(server.addr, "POST", "/v2/models/m/embed", &all, &body).unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let rows: Vec<Vec<f64>> = serde_json::from_slice(&r.body).unwrap();
    (rows, r.header("x-inferd-cache").map(str::to_string))
}

fn cache_metric(server: &Server, name: &str) -> f64 {
    let metrics = server.metrics_text();
    metric_value(&metrics, &format!("{name}{{model=\"m\"}}")).unwrap_or_else(|| panic!("no {name} in:\n{metrics}"))
}

#[test]
fn a_repeat_is_answered_from_the_cache_and_a_reload_to_another_model_never_answers_from_the_old_ones_entries() {
    let server = cached_server("cache", "st-embedder", "1MiB");
    let text = "cats purr";
    let (first, said) = embed(&server, json!([text]), &[]);
    assert_eq!(said.as_deref(), Some("miss"));
    let (again, said) = embed(&server, json!([text]), &[]);
    assert_eq!(said.as_deref(), Some("hit"));
    assert_eq!(again, first, "a hit is the answer computed the first time");
    // A batch with one row known: that row from the cache, the other computed.
    let (both, said) = embed(&server, json!(["dogs bark", text]), &[]);
    assert_eq!(said.as_deref(), Some("partial; hits=1; rows=2"));
    assert_eq!(both[1], first[0]);
    // Bypassed: computed afresh (the cache not consulted), the same answer within float noise.
    let (fresh, said) = embed(&server, json!([text]), &[("Cache-Control", "no-cache")]);
    assert_eq!(said, None);
    let diff = fresh[0].iter().zip(&first[0]).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(diff < 1e-5, "{diff}");
    assert_eq!(cache_metric(&server, "inferd_cache_hits_total"), 2.0);
    assert_eq!(cache_metric(&server, "inferd_cache_misses_total"), 2.0);

    // Model "m" becomes another model (its folder replaced) and the pool reloads: the same text
    // is answered by the new model, never from the old one's entries.
    let link = server.dir.path().join("repo/m");
    std::fs::remove_file(&link).unwrap();
    std::os::unix::fs::symlink(test_models().join("published/st-lasttoken"), &link).unwrap();
    let out = Command::new(BIN).args(["reload", "--wait", "--control-socket"]).arg(&server.socket).output().unwrap();
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let (after, said) = embed(&server, json!([text]), &[]);
    assert_eq!(said.as_deref(), Some("miss"), "the new model's first answer is computed");
    assert_ne!(after, first, "the new model answers as itself");
    let (fresh, _) = embed(&server, json!([text]), &[("Cache-Control", "no-cache")]);
    let diff = fresh[0].iter().zip(&after[0]).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(diff < 1e-5, "the new model's answer, cached or not: {diff}");
}

#[test]
fn a_cache_filled_past_its_bound_stays_within_max_bytes_and_counts_its_evictions() {
    let max = 16 * 1024;
    let server = cached_server("cache-bound", "st-embedder", &format!("{max}"));
    // Each answer is one entry of a few hundred bytes or more: 300 distinct texts overflow it.
    for n in 0..300 {
        embed(&server, json!([format!("text number {n} of many")]), &[]);
    }
    let bytes = cache_metric(&server, "inferd_cache_bytes");
    let evictions = cache_metric(&server, "inferd_cache_evictions_total");
    eprintln!("cache: {bytes} bytes held, {evictions} evictions");
    assert!(bytes > 0.0 && bytes <= max as f64, "{bytes} bytes held; the bound is {max}");
    assert!(evictions > 0.0, "300 answers cannot fit in {max} bytes");
    assert_eq!(cache_metric(&server, "inferd_cache_misses_total"), 300.0);
    // The latest answers are still there: least recently used out first.
    let (_, said) = embed(&server, json!(["text number 299 of many"]), &[]);
    assert_eq!(said.as_deref(), Some("hit"));
    let (_, said) = embed(&server, json!(["text number 0 of many"]), &[]);
    assert_eq!(said.as_deref(), Some("miss"));
}
