//! Priorities (`x-inferd-priority`, Cohere v2's `priority`, an API key's `priority=`;
//! docs/configuration.md, "Priorities"): with a bulk client saturating a worker at a low
//! priority, an interactive client's requests are taken by the worker's lanes ahead of the
//! waiting bulk work, so they wait for a lane far less than the bulk requests do; every request
//! of both is answered. The bulk client's key caps its priority (it asks for the highest and
//! gets its key's), and the access log names each request's key.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use serde_json::json;

/// The `queue;dur=` of an answer's Server-Timing, in ms.
fn queue_ms(r: &Response) -> f64 {
    let timing = r.header("server-timing").unwrap_or_default();
    timing
        .split(',')
        .find_map(|p| p.trim().strip_prefix("queue;dur="))
        .and_then(|d| d.parse().ok())
        .unwrap_or_else(|| panic!("no queue time in {timing:?}"))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
fn an_interactive_client_is_served_ahead_of_a_bulk_client_at_a_lower_priority() {
    // One worker of one thread: every request waits for the one lane. The default model,
    // one request a run ([batching] max_batch_size = 1), so that the bulk client's requests
    // wait in line one behind the other and a lane's choice of the next one shows.
    let dir = temp_dir("priority");
    let repository = dir.path().join("repo");
    let folder = repository.join("solo");
    std::fs::create_dir_all(&folder).unwrap();
    let minilm = repo().join("models/minilm");
    let toml = format!(
        "name = \"solo\"\nversion = \"1\"\nfile = \"{}\"\ntask = \"embedding\"\n\n[tokenizer]\nfile = \"{}\"\n\
         max_length = 256\n\n[embedding]\npooling = \"mean\"\nnormalize = true\n\n[batching]\nmax_batch_size = 1\n",
        minilm.join("model.onnx").display(),
        minilm.join("tokenizer.json").display()
    );
    std::fs::write(folder.join("model.toml"), toml).unwrap();
    // Two keys: the bulk client's, whose requests run at priority 9 at best, and a user's.
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "bulk-key-0123456789 name=reindex priority=9\nuser-key-0123456789 name=web\n").unwrap();
    std::fs::set_permissions(&keys, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let port = free_port();
    let config = write_config(dir.path(), port, 1, &repository, "solo", &[], "");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str(&format!("\n[auth]\napi_keys_file = \"{}\"\n[log]\naccess_log = true\n", keys.display()));
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(120));
    let bulk_text = "a passage of a re-indexing run, one of very many, ".repeat(8);
    let bulk_body = serde_json::to_vec(&json!({ "inputs": bulk_text })).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let bulk_waits = Arc::new(Mutex::new(Vec::new()));
    let failures = Arc::new(Mutex::new(Vec::new()));
    let bulk: Vec<_> = (0..12)
        .map(|_| {
            let (stop, waits, failures, body, addr) =
                (stop.clone(), bulk_waits.clone(), failures.clone(), bulk_body.clone(), server.addr);
            std::thread::spawn(move || {
                // It asks for the highest priority; its key says 9.
                let headers = [
                    ("Content-Type", "application/json"),
                    ("x-inferd-priority", "0"),
                    ("Authorization", "Bearer bulk-key-0123456789"),
                ];
                while !stop.load(Ordering::Relaxed) {
                    match inferd_bench::http::request(addr, "POST", "/embed", &headers, &body) {
                        Ok(r) if r.status == 200 => waits.lock().unwrap().push(queue_ms(&r)),
                        Ok(r) => failures.lock().unwrap().push(format!("bulk: {}", r.status)),
                        Err(e) => failures.lock().unwrap().push(format!("bulk: {e}")),
                    }
                }
            })
        })
        .collect();
    // Let the bulk load fill the queue, then the interactive client asks, one at a time.
    std::thread::sleep(Duration::from_secs(2));
    let interactive_body = serde_json::to_vec(&json!({ "inputs": "where is my order?" })).unwrap();
    let mut interactive = Vec::new();
    for _ in 0..40 {
        let headers = [("Content-Type", "application/json"), ("Authorization", "Bearer user-key-0123456789")];
        let r = inferd_bench::http::request(server.addr, "POST", "/embed", &headers, &interactive_body).unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        interactive.push(queue_ms(&r));
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    for b in bulk {
        b.join().unwrap();
    }
    let failures = failures.lock().unwrap();
    assert!(failures.is_empty(), "{failures:?}");
    let bulk = bulk_waits.lock().unwrap().clone();
    let (mine, theirs) = (median(interactive.clone()), median(bulk.clone()));
    eprintln!(
        "queue wait, median: interactive {mine:.1} ms ({} requests), bulk {theirs:.1} ms ({} requests)",
        interactive.len(),
        bulk.len()
    );
    assert!(bulk.len() > 50, "the bulk client ran: {} requests", bulk.len());
    // The interactive request waits for the run in progress at most; a bulk one for the bulk
    // requests ahead of it (12 clients: several runs).
    assert!(mine * 3.0 < theirs, "interactive {mine:.1} ms against bulk {theirs:.1} ms");
    // A priority that is not one is refused, naming the header.
    let r = inferd_bench::http::request(
        server.addr,
        "POST",
        "/embed",
        &[
            ("Content-Type", "application/json"),
            ("x-inferd-priority", "high"),
            ("Authorization", "Bearer user-key-0123456789"),
        ],
        &interactive_body,
    )
    .unwrap();
    assert_eq!(r.status, 400);
    assert!(String::from_utf8_lossy(&r.body).contains("x-inferd-priority"));
    // Each access line names the request's key, never the key itself.
    let log = server.log();
    assert!(log.lines().any(|l| l.contains("POST /embed 200") && l.contains("key=\"reindex\"")), "{log}");
    assert!(log.lines().any(|l| l.contains("POST /embed 200") && l.contains("key=\"web\"")), "{log}");
    assert!(!log.contains("key-0123456789"), "a key in the log");
}
