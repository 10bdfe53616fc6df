//! KServe v2 over gRPC (`server.grpc_listen`, `--grpc-listen`): NVIDIA's tritonclient.grpc and
//! the protocol's raw stub against every worker's gRPC port (tests/clients/triton_grpc_check.py),
//! counted like REST requests; gRPC clients see no failure while the pool reloads; a gRPC port
//! that cannot be bound stops the start with a message.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::*;

/// `typed` (the default), `minilm`, `classifier` and `slow`, serving gRPC on a port of its own
/// (given on the command line); two workers where there are two cores.
fn grpc_server(tag: &str) -> (Server, String) {
    grpc_server_with(tag, "")
}

fn grpc_server_with(tag: &str, settings: &str) -> (Server, String) {
    let dir = TempDir::new(tag);
    let repository = model_repository(dir.path(), &["minilm", "typed", "classifier", "slow"]);
    let port = free_port();
    let extra = format!("max_body_bytes = 65536\n{settings}");
    let extra = extra.as_str();
    write_config(dir.path(), port, test_workers(), &repository, "typed", &["minilm", "classifier", "slow"], extra);
    let grpc = format!("127.0.0.1:{}", free_port());
    let mut server = Server::start(dir, port, &["--grpc-listen", &grpc]);
    server.wait_ready(Duration::from_secs(120));
    (server, grpc)
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

#[test]
fn tritonclient_grpc_gets_what_rest_and_the_references_give() {
    let (server, grpc) = grpc_server("grpc-client");
    client_check("triton_grpc_check.py", &[&grpc, &server.addr.to_string()], &server, "grpc: all checks passed");
    // Counted with the REST requests, by model and status: `typed` answered the script's three
    // requests and refused its mistakes (wrong datatype, missing input, unknown output, typed
    // FP16, short raw data) with 400s; no worker failed.
    let metrics = server.metrics_text();
    let count = |code: u16| {
        let line = format!("inferd_requests_total{{model=\"typed\",endpoint=\"infer\",code=\"{code}\"}}");
        metric_value(&metrics, &line).unwrap_or(0.0)
    };
    assert_eq!((count(200), count(400), count(500)), (3.0, 5.0, 0.0), "{metrics}");
    let status = server.status();
    assert!(status["workers"].as_array().unwrap().iter().all(|w| w["restarts"] == 0), "{status}");
    assert_eq!(status["grpc_listen"], grpc.as_str(), "{status}");
    let table = Command::new(BIN).args(["status", "--control-socket"]).arg(&server.socket).output().unwrap();
    let first = String::from_utf8_lossy(&table.stdout).lines().next().unwrap_or_default().to_string();
    assert!(first.contains(&format!("on {} (gRPC on {grpc})", server.addr)), "{first}");
}

/// A message that decodes to far more than its size (many empty entries) is refused before it
/// is decoded, many at once, while well-behaved clients see no failure; the refusals are
/// counted like any answer; an idle connection is closed (GOAWAY) and its client reconnects.
#[test]
fn hostile_grpc_messages_are_refused_before_decoding_and_idle_connections_close() {
    let (server, grpc) = grpc_server_with("grpc-hostile", "idle_timeout_secs = 1");
    let out = client_check("grpc_hostile.py", &[&grpc, "1"], &server, "grpc hostile: all checks passed");
    let refused: f64 = out
        .lines()
        .find_map(|l| l.strip_prefix("hostile: ")?.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no count in {out}"));
    // Counted before they were answered, under "other": the model they name is not read.
    let metrics = server.metrics_text();
    let count = |code: u16| {
        let line = format!("inferd_requests_total{{model=\"other\",endpoint=\"infer\",code=\"{code}\"}}");
        metric_value(&metrics, &line).unwrap_or(0.0)
    };
    assert_eq!((count(413), count(400)), (refused - 1.0, 1.0), "{refused} refused:\n{metrics}");
    let status = server.status();
    assert!(status["workers"].as_array().unwrap().iter().all(|w| w["restarts"] == 0), "{status}");
}

#[test]
fn grpc_clients_see_no_failure_while_the_pool_reloads() {
    let (server, grpc) = grpc_server("grpc-reload");
    let load = Command::new(python())
        .arg(repo().join("tests/clients/triton_grpc_check.py"))
        .args(["--load", "20", &grpc, &server.addr.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    // Each rolling reload retires every worker: its gRPC connections get GOAWAY after their
    // streams finish, and the clients reconnect to the new workers.
    for round in 0..3 {
        let out =
            Command::new(BIN).args(["reload", "--wait", "--control-socket"]).arg(&server.socket).output().unwrap();
        assert!(out.status.success(), "reload {round}: {}\n{}", text(&out), server.log());
    }
    let out = load.wait_with_output().unwrap();
    let text = text(&out);
    let line = text.lines().find(|l| l.starts_with("load: ")).unwrap_or_else(|| panic!("no summary:\n{text}"));
    let numbers: Vec<u64> = line.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse().ok()).collect();
    assert!(numbers[0] > 0 && numbers[1] == 0, "{text}\nserver log:\n{}", server.log());
    assert_eq!(server.status()["generation"], 4, "three reloads");
}

#[test]
fn a_grpc_port_that_cannot_be_bound_stops_the_start_with_a_message() {
    // Held by a socket outside the SO_REUSEPORT group: no worker can join it.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let grpc = taken.local_addr().unwrap().to_string();
    let dir = TempDir::new("grpc-taken");
    let port = free_port();
    write_config(dir.path(), port, 1, &test_models(), "typed", &[], "");
    let out = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(dir.path().join("inferd.toml"))
        .args(["--grpc-listen", &grpc])
        .output()
        .unwrap();
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains(&format!("cannot listen on {grpc} (gRPC)")), "{log}");
    // And an address that is no address is refused before anything starts.
    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(dir.path().join("inferd.toml"))
        .args(["--grpc-listen", "8001"])
        .output()
        .unwrap();
    let refused = text(&out);
    assert!(!out.status.success() && refused.contains("server.grpc_listen"), "{refused}");
}
