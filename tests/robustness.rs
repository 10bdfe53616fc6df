//! Inputs that used to take the supervisor down, or leave it wrong: more models than counter
//! rows, timers
//! it cannot hold, a label value with a quote, clients that leave mid-request, a reload while
//! `scale -1` drains. Each must end in a clear message or a correct count, never a panic.

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;
use nix::sys::signal::Signal;

/// A repository of `n` models m0..m{n-1}, each the `slow` test model under its own name;
/// m0's version label is `version0`.
fn repository(dir: &Path, n: usize, version0: &str) -> std::path::PathBuf {
    let repo = dir.join("repo");
    for i in 0..n {
        let m = repo.join(format!("m{i}"));
        std::fs::create_dir_all(&m).unwrap();
        std::os::unix::fs::symlink(test_models().join("slow/model.onnx"), m.join("model.onnx")).unwrap();
        let version = if i == 0 { version0.to_string() } else { "1".into() };
        let toml = format!("name = \"m{i}\"\nversion = {}\nfile = \"model.onnx\"\n", toml_string(&version));
        std::fs::write(m.join("model.toml"), toml).unwrap();
    }
    repo
}

fn toml_string(s: &str) -> String {
    toml_edit::value(s).to_string().trim().to_string()
}

/// Starts `inferd serve` on the config in `dir` and returns its log once it has exited with
/// an error; fails if it serves instead.
fn refused(dir: TempDir, port: u16) -> String {
    let mut server = Server::start(dir, port, &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.running() {
        assert!(Instant::now() < deadline, "accepted: still serving after 30 s; log:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = server.wait_exit(Duration::from_secs(1));
    std::thread::sleep(Duration::from_millis(100)); // the stderr reader catches up
    assert!(!status.success(), "exited 0; log:\n{}", server.log());
    server.log()
}

/// More models than the counters have rows (once a panic at start, then a refusal): nine
/// serve, the ninth counted as `other`; a version label with a quote, a backslash and a
/// newline is escaped.
#[test]
fn nine_models_serve_the_ninth_counted_as_other_and_scrape_with_escaped_labels() {
    let dir = temp_dir("nine-models");
    let repo = repository(dir.path(), 9, "v\"1\\\nrc");
    let port = free_port();
    let load: Vec<String> = (1..9).map(|i| format!("m{i}")).collect();
    let load: Vec<&str> = load.iter().map(String::as_str).collect();
    write_config(dir.path(), port, 1, &repo, "m0", &load, "");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(90));
    for i in 0..9 {
        let r = server.request("POST", &format!("/v2/models/m{i}/infer"), &slow_body(10));
        assert_eq!(r.status, 200, "m{i}: {}", r.error());
    }
    assert!(!server.log().contains("panicked"), "{}", server.log());
    let text = server.metrics_text();
    assert!(text.contains(r#"inferd_model_info{model="m0",version="v\"1\\\nrc",sha256="#), "{text}");
    assert!(text.contains(r#"inferd_requests_total{model="m7",endpoint="infer",code="200"} 1"#), "{text}");
    assert!(text.contains(r#"inferd_requests_total{model="other",endpoint="infer",code="200"} 1"#), "m8: {text}");
    assert!(!text.contains(r#"inferd_requests_total{model="m8""#), "m8 has no counter row of its own: {text}");
    // Prometheus itself reads the page (promtool's parser).
    let mut check = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool (scripts/test-deps.sh installs it)");
    check.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let checked = check.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&checked.stderr) + String::from_utf8_lossy(&checked.stdout);
    assert!(!said.contains("error while linting") && !said.contains("parse"), "promtool: {said}");
    assert!(server.running(), "the supervisor died on a scrape:\n{}", server.log());
}

#[test]
fn timers_it_cannot_hold_are_refused_by_name() {
    for key in ["boot_timeout_secs", "graceful_timeout_secs", "request_timeout_secs"] {
        let dir = temp_dir("huge-timeout");
        let config = write_config(dir.path(), free_port(), 1, &test_models(), "slow", &[], "");
        let text: String = std::fs::read_to_string(&config)
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with(&format!("{key} =")))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&config, text.replacen("[server]\n", &format!("[server]\n{key} = 1e300\n"), 1)).unwrap();
        let stderr = refused(dir, free_port());
        assert!(stderr.contains(&format!("server.{key}")) && stderr.contains("year"), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn clients_that_leave_mid_request_are_counted_and_leave_in_flight() {
    let server = serve(temp_dir("leavers"), test_workers(), &test_models(), "slow", &[], "");
    // Requests of ~0.4 s each whose clients hang up after 50 ms.
    let body = slow_body(100_000);
    let leavers: Vec<_> = (0..12)
        .map(|_| {
            let body = body.clone();
            let addr = server.addr;
            std::thread::spawn(move || {
                let mut s = std::net::TcpStream::connect(addr).unwrap();
                let head =
                    format!("POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", body.len());
                s.write_all(head.as_bytes()).unwrap();
                s.write_all(&body).unwrap();
                std::thread::sleep(Duration::from_millis(50));
                drop(s);
            })
        })
        .collect();
    leavers.into_iter().for_each(|t| t.join().unwrap());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = server.status();
        let in_flight: u64 =
            status["workers"].as_array().unwrap().iter().map(|w| w["in_flight"].as_u64().unwrap()).sum();
        let counted =
            metric_value(&server.metrics_text(), r#"inferd_requests_total{model="slow",endpoint="infer",code="499"}"#);
        if in_flight == 0 && counted == Some(12.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "in flight {in_flight}, counted as 499: {counted:?} (12 clients left); log:\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(server.request("POST", "/v2/models/slow/infer", &slow_body(10)).status, 200);
}

#[test]
fn a_reload_while_scale_down_drains_is_refused_and_works_after() {
    if test_workers() < 2 {
        return eprintln!("skipped: needs 2 usable cores for 2 workers");
    }
    let server = serve(temp_dir("reload-scale"), 2, &test_models(), "slow", &[], "");
    let control = |args: &[&str]| {
        let out = Command::new(BIN).args(args).arg("--control-socket").arg(&server.socket).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr))
    };
    // Worker 1 cannot finish draining while it is stopped.
    let last = server.status()["workers"][1]["pid"].as_i64().unwrap() as i32;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(last), Signal::SIGSTOP).unwrap();
    let (ok, said) = control(&["scale", "-1"]);
    assert!(ok, "{said}");
    let (ok, said) = control(&["reload", "--wait"]);
    assert!(!ok && said.contains("still draining"), "reload during a drain: {said}");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(last), Signal::SIGCONT).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.status()["workers"].as_array().unwrap().len() != 1 {
        assert!(Instant::now() < deadline, "worker 1 did not leave:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let (ok, said) = control(&["reload", "--wait"]);
    assert!(ok, "{said}\n{}", server.log());
    assert_eq!(server.status()["generation"], 2);
    // The replaced worker drains and leaves: one slot, one worker.
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.status()["workers"].as_array().unwrap().len() != 1 {
        assert!(Instant::now() < deadline, "{:#}", server.status());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(server.request("POST", "/v2/models/slow/infer", &slow_body(10)).status, 200);
}
