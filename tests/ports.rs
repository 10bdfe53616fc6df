//! A port another server listens on is refused at start instead of shared (SO_REUSEPORT would
//! let a second server of the same user join the group and take part of the first's
//! connections): another inferd, or any program, holding `server.listen` or
//! `server.grpc_listen` makes `inferd serve` exit with the configuration's code, naming the
//! address and the process; a restart right after a stop is not refused for the connections
//! the stopped server left in TIME_WAIT. Reloads, upgrades and socket activation share the
//! port as before (tests/reload.rs, upgrade.rs, systemd.rs).

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::common::*;

/// `inferd serve` in a new folder on `port` (and gRPC on `grpc` when given), started, not
/// waited for.
fn start(tag: &str, port: u16, grpc: Option<u16>) -> Server {
    let dir = temp_dir(tag);
    let extra = grpc.map_or(String::new(), |g| format!("grpc_listen = \"127.0.0.1:{g}\""));
    write_config(dir.path(), port, 1, &test_models(), "typed", &[], &extra);
    Server::start(dir, port, &[])
}

/// The server exits at once with the configuration's code, its log naming `says`.
fn refused(mut server: Server, says: &[String]) {
    let status = server.wait_exit(Duration::from_secs(60));
    // Its last words may reach the test's copy of the log a moment after it exits.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !says.iter().all(|s| server.log().contains(s.as_str())) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = server.log();
    assert_eq!(status.code(), Some(78), "{log}");
    for said in says {
        assert!(log.contains(said.as_str()), "no {said:?} in:\n{log}");
    }
    assert!(!log.contains(") ready after"), "a worker started:\n{log}");
}

#[test]
fn a_second_server_on_a_served_port_is_refused_and_the_first_keeps_every_request() {
    let first = serve(temp_dir("port-first"), 1, &test_models(), "typed", &[], "");
    let port = first.addr.port();
    let second = start("port-second", port, None);
    refused(
        second,
        &[format!("127.0.0.1:{port} is already served by"), format!("pid {} (inferd)", first.process.pid())],
    );
    for _ in 0..40 {
        assert_eq!(first.request("POST", "/v2/models/typed/infer", &typed_request()).status, 200);
    }
    let metrics = first.metrics_text();
    let answered: f64 = metrics
        .lines()
        .filter(|l| {
            l.starts_with("inferd_requests_total{") && l.contains("model=\"typed\"") && l.contains("code=\"200\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(answered, 40.0, "the first server answered every request:\n{metrics}");

    // `inferd check` of the second's configuration says so too.
    let dir = temp_dir("port-check");
    let config = write_config(dir.path(), port, 1, &test_models(), "typed", &[], "");
    let out = Command::new(BIN).arg("check").arg("--config").arg(&config).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("ALREADY SERVED by pid {}", first.process.pid())), "{text}");
}

#[test]
fn a_port_any_program_listens_on_is_refused_naming_it() {
    let me = format!("pid {}", std::process::id());
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    refused(start("port-plain", port, None), &[format!("127.0.0.1:{port} is already served by {me}")]);
    // The gRPC port too.
    refused(
        start("port-grpc", free_port(), Some(port)),
        &[format!("127.0.0.1:{port} (gRPC) is already served by {me}"), "server.grpc_listen".into()],
    );
    drop(held);
}

/// The server's side of its connections in TIME_WAIT on `port` (/proc/net/tcp, state 06).
fn time_wait(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let local = format!(":{port:04X} ");
    table.lines().skip(1).filter(|l| l.split_whitespace().nth(3) == Some("06") && l.contains(&local)).count()
}

#[test]
fn a_start_right_after_a_stop_on_the_same_port_serves() {
    let mut first = serve(temp_dir("port-stop"), 1, &test_models(), "typed", &[], "");
    let addr: SocketAddr = first.addr;
    // `Connection: close`: the server closes first, so its side waits in TIME_WAIT.
    for _ in 0..10 {
        let r = request(addr, "POST", "/v2/models/typed/infer", &[("Connection", "close")], &typed_request()).unwrap();
        assert_eq!(r.status, 200);
    }
    first.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(first.wait_exit(Duration::from_secs(30)).code(), Some(0), "{}", first.log());
    assert!(time_wait(addr.port()) > 0, "no connection in TIME_WAIT: the test proves nothing");
    let mut second = start("port-restart", addr.port(), None);
    second.wait_ready(Duration::from_secs(60));
    assert_eq!(second.request("POST", "/v2/models/typed/infer", &typed_request()).status, 200);
    assert!(Path::new(&second.socket).exists());
}
