//! Priorities (`x-inferd-priority`, Cohere v2's `priority`, an API key's `priority=`;
//! docs/configuration.md, "Priorities"): with a bulk client saturating a worker at a low
//! priority, an interactive client's request is taken by the worker's lane ahead of every bulk
//! job waiting when it arrived, so it waits at most for the run in progress, however long the
//! bulk line has waited; every request of both is answered. The bulk client's key caps its
//! priority (it asks for the highest and gets its key's), and the access log names each
//! request's key.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use serde_json::json;

/// A `NAME;dur=` of an answer's Server-Timing, in ms: `queue` (waiting for a lane) or
/// `compute` (the run it was in).
fn timing_ms(r: &Response, name: &str) -> f64 {
    let timing = r.header("server-timing").unwrap_or_default();
    let prefix = format!("{name};dur=");
    timing
        .split(',')
        .find_map(|p| p.trim().strip_prefix(prefix.as_str()))
        .and_then(|d| d.parse().ok())
        .unwrap_or_else(|| panic!("no {name} time in {timing:?}"))
}

/// The value at fraction `q` of the sorted values (0.5: the median).
fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
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
    // Each bulk answer's (queue, compute): its wait for the lane, and its run's length.
    let bulk_times = Arc::new(Mutex::new(Vec::new()));
    let failures = Arc::new(Mutex::new(Vec::new()));
    let bulk: Vec<_> = (0..12)
        .map(|_| {
            let (stop, waits, failures, body, addr) =
                (stop.clone(), bulk_times.clone(), failures.clone(), bulk_body.clone(), server.addr);
            std::thread::spawn(move || {
                // It asks for the highest priority; its key says 9.
                let headers = [
                    ("Content-Type", "application/json"),
                    ("x-inferd-priority", "0"),
                    ("Authorization", "Bearer bulk-key-0123456789"),
                ];
                while !stop.load(Ordering::Relaxed) {
                    match inferd_bench::http::request(addr, "POST", "/embed", &headers, &body) {
                        Ok(r) if r.status == 200 => {
                            waits.lock().unwrap().push((timing_ms(&r, "queue"), timing_ms(&r, "compute")))
                        }
                        Ok(r) => failures.lock().unwrap().push(format!("bulk: {}", r.status)),
                        Err(e) => failures.lock().unwrap().push(format!("bulk: {e}")),
                    }
                }
            })
        })
        .collect();
    // Let the bulk load fill the line (every client answered twice: each has come back to
    // the end of it), then the interactive client asks, one at a time; the bulk answers from
    // then on are the ones measured. Counted in answers, not seconds, on a CPU of any speed.
    let started = std::time::Instant::now();
    while bulk_times.lock().unwrap().len() < 24 {
        let failed = failures.lock().unwrap().clone();
        assert!(failed.is_empty(), "{failed:?}");
        assert!(started.elapsed() < Duration::from_secs(120), "the bulk client got no 24 answers in 120 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    let warmed = bulk_times.lock().unwrap().len();
    let interactive_body = serde_json::to_vec(&json!({ "inputs": "where is my order?" })).unwrap();
    let mut interactive = Vec::new();
    for _ in 0..40 {
        let headers = [("Content-Type", "application/json"), ("Authorization", "Bearer user-key-0123456789")];
        let r = inferd_bench::http::request(server.addr, "POST", "/embed", &headers, &interactive_body).unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        interactive.push(timing_ms(&r, "queue"));
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    for b in bulk {
        b.join().unwrap();
    }
    let failures = failures.lock().unwrap();
    assert!(failures.is_empty(), "{failures:?}");
    let bulk = bulk_times.lock().unwrap()[warmed..].to_vec();
    // The bulk line kept moving beside the interactive client (each of its 40 requests waits
    // for a bulk run in progress).
    assert!(bulk.len() >= 12, "the bulk client ran: {} requests", bulk.len());
    let bulk_wait = quantile(bulk.iter().map(|b| b.0).collect(), 0.5);
    let runs: Vec<f64> = bulk.iter().map(|b| b.1).collect();
    let (run, longest_run) = (quantile(runs.clone(), 0.5), quantile(runs, 1.0));
    let (mine, mine_p90) = (quantile(interactive.clone(), 0.5), quantile(interactive.clone(), 0.9));
    eprintln!(
        "bulk: {} requests, median wait {bulk_wait:.1} ms, runs median {run:.1} ms, longest {longest_run:.1} ms; \
         interactive: {} requests, wait median {mine:.1} ms, p90 {mine_p90:.1} ms",
        bulk.len(),
        interactive.len()
    );
    // What makes the test a test: the bulk line is long (12 clients, one request a run: a bulk
    // request waits for the ~11 ahead of it), on any CPU, since both sides scale with it.
    assert!(bulk_wait > 4.0 * run, "the bulk line was short: waits {bulk_wait:.1} ms, runs {run:.1} ms");
    // The contract: an interactive request is taken before every bulk job waiting when it
    // arrived, so it waits for the run in progress and no other: half a run on average, one at
    // most. In runs, not milliseconds, so it holds on a CPU of any speed; levelling priorities
    // by the time waited broke it exactly when the line was long.
    assert!(mine <= run, "interactive median wait {mine:.1} ms, more than a run ({run:.1} ms)");
    assert!(
        mine_p90 <= 1.5 * longest_run,
        "interactive p90 wait {mine_p90:.1} ms, more than the longest run ({longest_run:.1} ms): {interactive:?}"
    );
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
