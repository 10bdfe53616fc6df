//! Logs operators read: JSON lines from every process, one access line per answered request,
//! and request ids (X-Request-Id) echoed and carried into the failure's log line.

use std::time::{Duration, Instant};

use crate::common::*;
use nix::sys::signal::Signal;

fn json_lines(log: &str) -> Vec<serde_json::Value> {
    log.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l:?}\nlog:\n{log}")))
        .collect()
}

fn access_lines(log: &str) -> Vec<serde_json::Value> {
    json_lines(log).into_iter().filter(|l| l["target"] == "inferd::access").collect()
}

#[test]
fn json_logs_one_access_line_per_answered_request_and_request_ids_in_failures() {
    let dir = temp_dir("access-log");
    let port = free_port();
    // The [log] section goes after the others: write_config's `extra` lands inside [server].
    let config = write_config(dir.path(), port, test_workers(), &test_models(), "slow", &[], "");
    let text = std::fs::read_to_string(&config).unwrap() + "[log]\nformat = \"json\"\naccess_log = true\n";
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    let addr = server.addr;

    // 4 clients x 25 requests: 200s, and 400s for a missing input; each with its own id.
    let clients: Vec<_> = (0..4)
        .map(|c| {
            std::thread::spawn(move || {
                (0..25)
                    .map(|i| {
                        let id = format!("client{c}-req{i}");
                        let body = if i % 5 == 4 { infer_body(serde_json::json!([])) } else { slow_body(10) };
                        let r = request(addr, "POST", "/v2/models/slow/infer", &[("X-Request-Id", &id)], &body)
                            .expect("answered");
                        assert_eq!(r.header("x-request-id"), Some(id.as_str()), "the id is echoed");
                        (id, r.status)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut sent: Vec<(String, u16)> = clients.into_iter().flat_map(|c| c.join().unwrap()).collect();
    assert_eq!(sent.iter().filter(|(_, s)| *s == 200).count(), 80);
    assert_eq!(sent.iter().filter(|(_, s)| *s == 400).count(), 20);

    // A request that fails on the server's side (its deadline passes in the queue): 504, an
    // id of the server's making, and a WARN line that carries it.
    let r = request(
        addr,
        "POST",
        "/v2/models/slow/infer",
        &[("x-inferd-deadline-ms", "0"), ("X-Request-Id", "not a usable id")],
        &slow_body(10),
    )
    .unwrap();
    assert_eq!(r.status, 504, "{}", r.error());
    let failed_id = r.header("x-request-id").expect("an id is generated").to_string();
    assert!(failed_id.len() == 16 && failed_id.chars().all(|c| c.is_ascii_hexdigit()), "generated id {failed_id:?}");
    sent.push((failed_id.clone(), 504));

    // Every line is JSON; every answered request has exactly one access line, with its status.
    let deadline = Instant::now() + Duration::from_secs(30);
    while access_lines(&server.log()).len() < sent.len() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    server.signal(Signal::SIGTERM);
    assert!(server.wait_exit(Duration::from_secs(60)).success());
    std::thread::sleep(Duration::from_millis(200)); // the stderr reader catches up
    let log = server.log();
    let access = access_lines(&log);
    assert_eq!(access.len(), sent.len(), "access lines vs requests answered");
    for (id, status) in &sent {
        let lines: Vec<_> = access.iter().filter(|l| l["request_id"] == id.as_str()).collect();
        assert_eq!(lines.len(), 1, "access lines for {id}: {lines:?}");
        let line = lines[0];
        assert_eq!(line["status"], *status);
        assert_eq!(line["method"], "POST");
        assert_eq!(line["path"], "/v2/models/slow/infer");
        assert_eq!(line["model"], "slow");
        assert!(line["client"].as_str().unwrap().starts_with("127.0.0.1:"), "{line}");
        assert!(line["bytes"].as_u64().unwrap() > 0, "{line}");
        assert!(line["duration_ms"].as_f64().is_some(), "{line}");
        assert!(line["worker"].as_u64().unwrap() < test_workers() as u64, "{line}");
        assert!(line["timestamp"].is_string(), "{line}");
    }
    let failures: Vec<_> = json_lines(&log)
        .into_iter()
        .filter(|l| l["level"] == "WARN" && l["request_id"] == failed_id.as_str())
        .collect();
    assert_eq!(failures.len(), 1, "one WARN line for the failed request {failed_id}:\n{log}");
    assert!(failures[0]["message"].as_str().unwrap().contains("deadline"), "{}", failures[0]);
    // The supervisor's own lines are JSON too (checked above) and say what it did.
    assert!(json_lines(&log).iter().any(|l| l["message"].as_str().is_some_and(|m| m.starts_with("pool ready"))));
}

#[test]
fn access_log_is_off_by_default() {
    let mut server = serve(temp_dir("no-access-log"), 1, &test_models(), "slow", &[], "");
    let r = server.request("POST", "/v2/models/slow/infer", &slow_body(10));
    assert_eq!(r.status, 200);
    assert!(r.header("x-request-id").is_some_and(|id| id.len() == 16), "an id is generated for every answer");
    server.signal(Signal::SIGTERM);
    assert!(server.wait_exit(Duration::from_secs(60)).success());
    let log = server.log();
    assert!(!log.contains("/v2/models/slow/infer"), "an access line was written with access_log off:\n{log}");
    assert!(log.contains("pool ready"), "text lines by default:\n{log}");
}
