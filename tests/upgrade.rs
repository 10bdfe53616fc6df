//! Upgrading inferd itself (`inferd upgrade`, SIGUSR2; docs/operations.md, "Upgrading
//! inferd"): the running supervisor starts the new binary on its sockets and hands over once
//! the new workers are ready. Under load, with clients that connect for each request and
//! keep-alive clients, no request fails, and every answer after it comes from the new version
//! (`x-inferd-version`, `inferd status`). A new binary that exits at start, or whose model
//! cannot load, or that is not ready in time (killed), leaves the old serving, and `inferd
//! upgrade` fails naming why; a second upgrade is refused while one runs. Repeated upgrades leave neither processes nor descriptors behind.
//!
//! The second build is the same binary under a wrapper that sets INFERD_TEST_VERSION (a
//! `test-switches` build reports it as its version): what the tests check is the hand-over, not
//! the compiler's output.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;

/// An executable shell script `name` in `dir`: a "binary" to upgrade to.
fn script(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{text}\n")).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    path
}

/// A wrapper "build" of inferd reporting `version`, optionally after `delay` seconds.
fn build(dir: &Path, name: &str, version: &str, delay: u32) -> PathBuf {
    script(dir, name, &format!("sleep {delay}\nINFERD_TEST_VERSION={version} exec {BIN} \"$@\""))
}

/// `inferd upgrade --binary BINARY` against `server`: (exit success, stdout and stderr).
fn upgrade(server: &Server, binary: &Path) -> (bool, String) {
    let out = Command::new(BIN)
        .args(["upgrade", "--control-socket"])
        .arg(&server.socket)
        .arg("--binary")
        .arg(binary)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// Clients of both kinds until stopped: each answer's version, and every failure.
struct Load {
    stop: Arc<AtomicBool>,
    answers: Arc<Mutex<Vec<(Instant, String)>>>,
    failures: Arc<Mutex<Vec<String>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(server: &Server, path: &'static str, body: Vec<u8>) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let answers = Arc::new(Mutex::new(Vec::new()));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let mut threads = Vec::new();
        for keep_alive in [false, false, true, true] {
            let (stop, answers, failures, body, addr) =
                (stop.clone(), answers.clone(), failures.clone(), body.clone(), server.addr);
            threads.push(std::thread::spawn(move || {
                let mut connection = None;
                while !stop.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    let result = match keep_alive {
                        false => inferd_bench::http::request(
                            addr,
                            "POST",
                            path,
                            &[("Content-Type", "application/json")],
                            &body,
                        ),
                        true => {
                            if connection.is_none() {
                                connection = Some(inferd_bench::http::Connection::open(addr).unwrap());
                            }
                            let r = connection.as_mut().unwrap().post(path, &body);
                            if r.as_ref().map_or(true, |r| r.closes()) {
                                connection = None;
                            }
                            r
                        }
                    };
                    match result {
                        Ok(r) if r.status == 200 => {
                            let version = r.header("x-inferd-version").unwrap_or_default().to_string();
                            answers.lock().unwrap().push((sent, version));
                        }
                        Ok(r) => {
                            failures.lock().unwrap().push(format!("{}: {}", r.status, String::from_utf8_lossy(&r.body)))
                        }
                        Err(e) => failures.lock().unwrap().push(format!("keep-alive {keep_alive}: {e}")),
                    }
                    if keep_alive {
                        // Think time: the connection sits idle between requests.
                        std::thread::sleep(Duration::from_millis(15));
                    }
                }
            }));
        }
        Load { stop, answers, failures, threads }
    }

    fn finish(self) -> (Vec<(Instant, String)>, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            t.join().unwrap();
        }
        let answers = self.answers.lock().unwrap().clone();
        let failures = self.failures.lock().unwrap().clone();
        (answers, failures)
    }
}

fn wait_until(what: &str, server: &mut Server, mut done: impl FnMut(&mut Server) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !done(server) {
        assert!(Instant::now() < deadline, "{what} never happened; log:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The processes of the server's process group (supervisors and workers).
fn group(server: &Server) -> Vec<i32> {
    let pgid = server.process.pid();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
            fields.first() != Some(&"Z") && fields.get(2).and_then(|g| g.parse::<i32>().ok()) == Some(pgid)
        })
        .collect()
}

/// Every thread of every worker at the supervisor's nice (this test's: 0, or 10 in a suite
/// run under `nice`), but the background lane at 10 more (19 at most): a worker that booted
/// niced put its threads back before it listened. Says when it did not boot niced.
fn assert_threads_at_their_priority(server: &Server, booted_niced: bool) {
    if !booted_niced {
        eprintln!("workers boot at their own priority here (the supervisor may not put a thread back): checked as is");
    }
    let nice_of = |stat: &str| -> i32 {
        // After the name: state is field 3; nice is field 19.
        let close = stat.rfind(')').unwrap();
        stat[close + 2..].split_whitespace().nth(16).unwrap().parse().unwrap()
    };
    let base = nice_of(&std::fs::read_to_string("/proc/self/stat").unwrap());
    for pid in server.worker_pids() {
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
            let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
            let name = &stat[open + 1..close];
            let nice = nice_of(&stat);
            let want = if name == "inferd-lane-bg" { (base + 10).min(19) } else { base };
            assert_eq!(nice, want, "worker {pid} thread {name}: nice {nice}");
        }
    }
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

#[test]
fn an_upgrade_under_load_fails_no_request_and_every_answer_after_it_comes_from_the_new_version() {
    let dir = temp_dir("upgrade");
    let repository = model_repository(dir.path(), &["minilm"]);
    let port = free_port();
    write_config(dir.path(), port, 2, &repository, "minilm", &[], "");
    let new = build(dir.path(), "inferd-new", "0.1.0-new", 0);
    let mut server = Server::start(dir, port, &[]);
    let before = server.wait_ready(Duration::from_secs(120));
    let old_pid = before["pid"].as_u64().unwrap() as u32;
    let body = serde_json::to_vec(&serde_json::json!({ "inputs": "an upgrade must not fail this request" })).unwrap();
    let load = Load::start(&server, "/embed", body);
    std::thread::sleep(Duration::from_secs(2));
    let (ok, said) = upgrade(&server, &new);
    assert!(ok, "{said}\n{}", server.log());
    assert!(said.contains("upgraded: pid") && said.contains("inferd 0.1.0-new"), "{said}");
    // The old supervisor goes once its workers have drained.
    wait_until("the old supervisor's exit", &mut server, |s| s.process.exited().is_some());
    let after_old = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    let (answers, failures) = load.finish();
    assert!(
        failures.is_empty(),
        "{} failed: {:?}\n{}",
        failures.len(),
        &failures[..failures.len().min(5)],
        server.log()
    );
    let old = answers.iter().filter(|(_, v)| v != "0.1.0-new").count();
    let late: Vec<&String> = answers.iter().filter(|(t, _)| *t > after_old).map(|(_, v)| v).collect();
    eprintln!("{} answers, {old} from the old version, {} after the old supervisor exited", answers.len(), late.len());
    assert!(old > 0, "the old version answered before the upgrade");
    assert!(!late.is_empty() && late.iter().all(|v| *v == "0.1.0-new"), "{late:?}");
    let status = server.status();
    assert_eq!(status["version"], "0.1.0-new");
    assert_ne!(status["pid"].as_u64().unwrap() as u32, old_pid);
    assert_eq!(status["phase"], "ready");
    // One supervisor and its two workers are left.
    assert_eq!(group(&server).len(), 3, "{:?}", group(&server));
}

#[test]
fn an_upgrade_that_cannot_start_or_load_its_model_leaves_the_old_serving_and_says_why() {
    let dir = temp_dir("upgrade-fail");
    let repository = model_repository(dir.path(), &["typed"]);
    let port = free_port();
    write_config(dir.path(), port, 2, &repository, "typed", &[], "");
    let broken = script(dir.path(), "inferd-broken", "echo 'this build cannot start' >&2\nexit 3");
    let slow = build(dir.path(), "inferd-slow", "0.1.0-slow", 3);
    let mut server = Server::start(dir, port, &[]);
    let before = server.wait_ready(Duration::from_secs(60));
    let pids = server.worker_pids();
    let load = Load::start(&server, MODEL_PATH, typed_request());
    // A binary that exits at once.
    let (ok, said) = upgrade(&server, &broken);
    assert!(!ok && said.contains("exited before it was ready") && said.contains("serves as before"), "{said}");
    // Its own words may reach the log a moment after the upgrade is answered.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server.log().contains("this build cannot start") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(server.log().contains("this build cannot start"), "{}", server.log());
    // A model the new supervisor cannot load (the file replaced since the old loaded it).
    let typed = repository.join("typed");
    std::fs::remove_file(&typed).unwrap();
    std::fs::create_dir(&typed).unwrap();
    std::fs::copy(test_models().join("typed/model.toml"), typed.join("model.toml")).unwrap();
    std::fs::write(typed.join("model.onnx"), b"not an onnx model").unwrap();
    let (ok, said) = upgrade(&server, Path::new(BIN));
    assert!(!ok && said.contains("could not load its model"), "{said}");
    // Still the same supervisor and workers, serving.
    let status = server.status();
    assert_eq!((status["pid"].clone(), status["phase"].clone()), (before["pid"].clone(), "ready".into()));
    assert_eq!(server.worker_pids(), pids);
    assert!(status.get("upgrade").is_none(), "{status}");
    // The model back; a slow new build: a second upgrade is refused while it starts.
    std::fs::remove_dir_all(&typed).unwrap();
    std::os::unix::fs::symlink(test_models().join("typed"), &typed).unwrap();
    let first = {
        let (socket, slow) = (server.socket.clone(), slow.clone());
        std::thread::spawn(move || {
            Command::new(BIN)
                .args(["upgrade", "--control-socket"])
                .arg(socket)
                .arg("--binary")
                .arg(slow)
                .output()
                .unwrap()
        })
    };
    wait_until("the upgrade's start", &mut server, |s| s.status()["upgrade"].is_string());
    let (ok, said) = upgrade(&server, Path::new(BIN));
    assert!(!ok && said.contains("an upgrade is in progress"), "{said}");
    let first = first.join().unwrap();
    assert!(
        first.status.success(),
        "{}{}",
        String::from_utf8_lossy(&first.stdout),
        String::from_utf8_lossy(&first.stderr)
    );
    wait_until("the old supervisor's exit", &mut server, |s| s.process.exited().is_some());
    let (answers, failures) = load.finish();
    assert!(failures.is_empty(), "{failures:?}");
    assert!(answers.iter().any(|(_, v)| v == "0.1.0-slow"));
    assert_eq!(server.status()["version"], "0.1.0-slow");
}

const MODEL_PATH: &str = "/v2/models/typed/infer";

#[test]
fn repeated_upgrades_under_load_leave_no_process_or_descriptor_behind() {
    let dir = temp_dir("upgrade-again");
    let repository = model_repository(dir.path(), &["typed"]);
    let port = free_port();
    write_config(dir.path(), port, 2, &repository, "typed", &[], "");
    let builds = [build(dir.path(), "inferd-a", "0.1.0-a", 0), build(dir.path(), "inferd-b", "0.1.0-b", 0)];
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    let load = Load::start(&server, MODEL_PATH, typed_request());
    let mut fds = Vec::new();
    // The new workers boot at nice +9 beside the serving ones where the supervisor may put
    // them back (root, as `make test` runs; the log says when it may not).
    let booted_niced = !server.log().contains("workers boot at their own priority");
    for round in 0..4 {
        let old = server.status()["pid"].as_u64().unwrap() as u32;
        let (ok, said) = upgrade(&server, &builds[round % 2]);
        assert!(ok, "round {round}: {said}\n{}", server.log());
        wait_until("the old supervisor's exit", &mut server, |_| !process_exists(old as i32));
        let status = server.status();
        assert_eq!(status["version"], ["0.1.0-a", "0.1.0-b"][round % 2]);
        let pid = status["pid"].as_u64().unwrap() as u32;
        wait_until("one supervisor and two workers", &mut server, |s| group(s).len() == 3);
        assert_threads_at_their_priority(&server, booted_niced);
        // The channel to the old closes as the supervisor reads its end-of-file.
        std::thread::sleep(Duration::from_millis(500));
        fds.push(open_fds(pid));
    }
    let (answers, failures) = load.finish();
    assert!(failures.is_empty(), "{failures:?}");
    eprintln!("{} answers over 4 upgrades; supervisor descriptors after each: {fds:?}", answers.len());
    // The supervisor holds the same descriptors after every upgrade: none leaks.
    assert!(fds.windows(2).all(|w| w[0] == w[1]), "{fds:?}");
}

#[test]
fn a_new_supervisor_not_ready_in_time_is_killed_and_the_old_serves_on() {
    let dir = temp_dir("upgrade-late");
    let repository = model_repository(dir.path(), &["typed"]);
    let port = free_port();
    let config = write_config(dir.path(), port, 2, &repository, "typed", &[], "");
    // A short boot timeout: the new supervisor has 2 x 2 s to be ready.
    let text = std::fs::read_to_string(&config).unwrap().replace("boot_timeout_secs = 60", "boot_timeout_secs = 2");
    std::fs::write(&config, text).unwrap();
    // A "binary" that hangs at start, never saying a word.
    let hangs = script(dir.path(), "inferd-hangs", "exec sleep 60");
    let mut server = Server::start(dir, port, &[]);
    let before = server.wait_ready(Duration::from_secs(60));
    let load = Load::start(&server, MODEL_PATH, typed_request());
    let started = Instant::now();
    let (ok, said) = upgrade(&server, &hangs);
    assert!(!ok && said.contains("was not ready within 4 s") && said.contains("serves as before"), "{said}");
    assert!(started.elapsed() >= Duration::from_secs(4), "answered after {:?}", started.elapsed());
    let (answers, failures) = load.finish();
    assert!(failures.is_empty() && !answers.is_empty(), "{failures:?}");
    let status = server.status();
    assert_eq!((status["pid"].clone(), status["phase"].clone()), (before["pid"].clone(), "ready".into()));
    // The hung one is gone: the supervisor and its two workers are left.
    wait_until("the hung supervisor's end", &mut server, |s| group(s).len() == 3);
}
