//! Operating the pool: rolling reloads under load (command and SIGHUP, K=2 and K=1), reloads
//! that must fail without hurting anyone, scaling within the CPU budget, and who may talk to
//! the control socket.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::common::*;
use nix::sys::signal::Signal;
use serde_json::json;

/// A model repository of its own (the test rewrites files in it) holding `typed`.
fn repository(dir: &Path) -> PathBuf {
    let models = dir.join("models");
    for name in ["typed", "classifier"] {
        let folder = models.join(name);
        std::fs::create_dir_all(&folder).unwrap();
        for file in ["model.onnx", "model.toml"] {
            std::fs::copy(test_models().join(name).join(file), folder.join(file)).unwrap();
        }
    }
    let toml = std::fs::read_to_string(models.join("classifier/model.toml")).unwrap();
    let tokenizer = repo().join("models/minilm/tokenizer.json");
    std::fs::write(
        models.join("classifier/model.toml"),
        toml.replace("../../../models/minilm/tokenizer.json", &tokenizer.display().to_string()),
    )
    .unwrap();
    models
}

fn start(tag: &str, workers: usize, load: &[&str]) -> Server {
    let dir = temp_dir(tag);
    let port = free_port();
    let models = repository(dir.path());
    write_config(dir.path(), port, workers, &models, "typed", load, "");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    server
}

/// Closed-loop clients, recording every failure and the model version each answer came from.
fn typed_load(server: &Server, clients: usize) -> TypedLoad<String> {
    let load = TypedLoad::start(server, clients, Duration::ZERO, |r, _| {
        r.header("x-inferd-model-version").unwrap().to_string()
    });
    std::thread::sleep(Duration::from_millis(300));
    load
}

fn inferd(server: &Server, args: &[&str]) -> Output {
    Command::new(BIN).args(args).arg("--control-socket").arg(&server.socket).output().unwrap()
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn versions_of(status: &serde_json::Value) -> Vec<String> {
    status["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            format!("{}+{}", w["models"][0]["version"].as_str().unwrap(), w["models"][0]["sha256"].as_str().unwrap())
        })
        .collect()
}

fn reload_to_a_new_file_under_load(workers: usize) {
    let mut server = start(&format!("reload{workers}"), workers, &[]);
    let before = server.status();
    let old = versions_of(&before)[0].clone();
    let new_file = server.dir.path().join("typed-v2.onnx");
    model_variant(&test_models().join("typed/model.onnx"), &new_file, "inferd test v2");

    let load = typed_load(&server, 4);
    let started = Instant::now();
    let out = inferd(&server, &["reload", "--model", "typed", "--path", new_file.to_str().unwrap(), "--wait"]);
    let took = started.elapsed();
    std::thread::sleep(Duration::from_millis(300));
    let (ok, failed, versions) = load.finish();
    let log = text(&out);
    assert!(out.status.success(), "{log}\n{}", server.log());
    assert!(log.contains(&format!("worker {workers} of {workers} ready")), "{log}");
    assert!(log.contains("reload complete"), "{log}");
    eprintln!("K={workers}: reload took {:.2} s; {ok} requests answered, {} failed", took.as_secs_f64(), failed.len());
    assert!(
        failed.is_empty(),
        "{} requests failed during the reload: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );

    // Old answers, then new ones, and after the reload only the new version.
    let after = server.wait_ready(Duration::from_secs(5));
    let new = versions_of(&after)[0].clone();
    assert_ne!(old, new);
    assert!(versions_of(&after).iter().all(|v| *v == new), "{after:#}");
    assert_eq!(after["generation"], 2);
    assert_eq!(after["workers"].as_array().unwrap().len(), workers);
    assert!(
        versions.contains(&old) && versions.contains(&new),
        "both versions answered: old {old}, new {new}, seen {:?}",
        versions.iter().collect::<std::collections::BTreeSet<_>>()
    );
    let tail = &versions[versions.len().saturating_sub(10)..];
    assert!(tail.iter().all(|v| *v == new), "after the reload: {tail:?}\n{}", server.log());
    let meta = server.request("GET", "/v2/models/typed", b"").json();
    assert_eq!(meta["inferd_version"], new.as_str());
    // The old workers are gone.
    for w in before["workers"].as_array().unwrap() {
        assert!(!process_exists(w["pid"].as_i64().unwrap() as i32));
    }
}

#[test]
fn reload_to_a_new_file_under_load_with_two_workers() {
    if test_workers() < 2 {
        return eprintln!("needs 2 cores");
    }
    reload_to_a_new_file_under_load(2);
}

#[test]
fn reload_to_a_new_file_under_load_with_one_worker() {
    reload_to_a_new_file_under_load(1);
}

/// SIGHUP is `inferd reload`: the models are read again; unchanged files are a forced recycle,
/// every worker replaced, still without a failed request.
#[test]
fn sighup_recycles_every_worker_without_a_failed_request() {
    let workers = test_workers();
    let server = start("sighup", workers, &[]);
    let before: Vec<i32> = server.worker_pids();
    let load = typed_load(&server, 4);
    server.signal(Signal::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(20);
    let after = loop {
        let status = server.status();
        let pids: Vec<i32> =
            status["workers"].as_array().unwrap().iter().filter_map(|w| w["pid"].as_i64()).map(|p| p as i32).collect();
        if status["phase"] == "ready" && status["generation"] == 2 && pids.iter().all(|p| !before.contains(p)) {
            break status;
        }
        assert!(Instant::now() < deadline, "no recycle: {status:#}\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(300));
    let (ok, failed, _) = load.finish();
    eprintln!("SIGHUP recycle: {ok} answered, {} failed", failed.len());
    assert!(failed.is_empty(), "{:?}", &failed[..failed.len().min(5)]);
    assert_eq!(after["reloads_succeeded"], 1);
    assert_eq!(after["workers"].as_array().unwrap().len(), workers);
}

/// The socket at a worker's fd 5: its slot's place on the port ("socket:[inode]").
fn port_socket(pid: i32) -> String {
    std::fs::read_link(format!("/proc/{pid}/fd/5")).unwrap().to_string_lossy().into_owned()
}

/// Waits until slot `index` has a ready worker other than `old`; returns its pid. (Status
/// lists every worker, a slot's retiring and incoming ones included: rows are found by slot.)
fn replaced(server: &Server, index: usize, old: i32) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = server.status();
        let pid = status["workers"].as_array().unwrap().iter().find_map(|w| {
            let pid = w["pid"].as_i64()? as i32;
            (w["index"] == index && w["state"] == "ready" && pid != old).then_some(pid)
        });
        if let Some(pid) = pid {
            return pid;
        }
        assert!(Instant::now() < deadline, "slot {index} not replaced: {status:#}\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A slot's socket on the port is never closed while its worker is replaced (the kernel
/// resets a connection whose handshake completes as its listener closes: the recycling test
/// above lost one request in about 20 runs when each worker had a socket of its own). After a
/// reload every slot's new worker accepts on its predecessor's socket; after a crash the slot
/// leaves the port and its next worker joins it again on the same socket, and is answered.
#[test]
fn a_slots_socket_outlives_its_workers() {
    let workers = test_workers();
    let server = start("slotsocket", workers, &[]);
    let before: Vec<i32> = server.worker_pids();
    let sockets: Vec<String> = before.iter().map(|&p| port_socket(p)).collect();
    assert!(sockets.iter().all(|s| s.starts_with("socket:[")), "{sockets:?}");
    let mut unique = sockets.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), workers, "one socket per slot: {sockets:?}");
    server.signal(Signal::SIGHUP);
    let after: Vec<i32> = (0..workers).map(|index| replaced(&server, index, before[index])).collect();
    for (index, &pid) in after.iter().enumerate() {
        assert_eq!(port_socket(pid), sockets[index], "slot {index} after the reload");
    }
    // Once the replaced workers are gone, the last slot's worker dies.
    let deadline = Instant::now() + Duration::from_secs(20);
    while server.worker_pids().len() > workers {
        assert!(Instant::now() < deadline, "old workers still there: {:#}", server.status());
        std::thread::sleep(Duration::from_millis(50));
    }
    let last = workers - 1;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(after[last]), Signal::SIGKILL).unwrap();
    let respawned = replaced(&server, last, after[last]);
    assert_eq!(port_socket(respawned), sockets[last], "slot {last} after a crash");
    let index = last.to_string();
    let served = (0..200).any(|_| {
        server.request("POST", "/v2/models/typed/infer", &typed_request()).header("x-inferd-worker")
            == Some(index.as_str())
    });
    assert!(served, "the respawned worker never answered\n{}", server.log());
}

#[test]
fn a_reload_that_cannot_work_fails_and_the_old_models_keep_serving() {
    let mut server = start("badreload", test_workers(), &["classifier"]);
    let before = server.status();
    let old = versions_of(&before)[0].clone();
    let garbage = server.dir.path().join("garbage.onnx");
    std::fs::write(&garbage, b"not an onnx model at all").unwrap();
    // A copy in the test's folder (admin.allowed_paths): --path must lie inside it or the
    // repository, whose folders here are links to the test models.
    let typed_file = server.dir.path().join("typed.onnx");
    std::fs::copy(test_models().join("typed/model.onnx"), &typed_file).unwrap();
    // Outside the repository and admin.allowed_paths: a file, and a link to it from inside.
    let outside = test_models().join("typed/model.onnx");
    let link = server.dir.path().join("link.onnx");
    std::os::unix::fs::symlink(&outside, &link).unwrap();
    let cases = [
        (vec!["--model", "typed", "--path", garbage.to_str().unwrap()], "model 'typed' failed to load"),
        (vec!["--model", "typed", "--path", outside.to_str().unwrap()], "is not inside the model repository"),
        (vec!["--model", "typed", "--path", link.to_str().unwrap()], "is not inside the model repository"),
        // The classifier's text pipeline cannot feed typed's inputs.
        (
            vec!["--model", "classifier", "--path", typed_file.to_str().unwrap()],
            "output 'logits' is not an output of the model",
        ),
        (vec!["--model", "nope", "--path", garbage.to_str().unwrap()], "this server has no model 'nope'"),
        (vec!["--path", garbage.to_str().unwrap()], "--path needs --model"),
    ];
    for (args, message) in cases {
        let load = typed_load(&server, 2);
        let mut full = vec!["reload", "--wait"];
        full.extend(args.iter().copied());
        let out = inferd(&server, &full);
        let (ok, failed, versions) = load.finish();
        assert!(!out.status.success(), "{args:?} succeeded: {}", text(&out));
        assert!(text(&out).contains(message), "{args:?}: {}", text(&out));
        assert!(failed.is_empty(), "{args:?}: {:?}", &failed[..failed.len().min(5)]);
        assert!(ok > 0 && versions.iter().all(|v| *v == old), "{args:?}: only the old version answers");
    }
    let after = server.wait_ready(Duration::from_secs(10));
    assert_eq!(after["reloads_failed"], 2, "the two that started a new worker");
    assert_eq!(
        server.worker_pids(),
        before["workers"].as_array().unwrap().iter().map(|w| w["pid"].as_i64().unwrap() as i32).collect::<Vec<_>>()
    );
    // A reload while the pool is fine afterwards still works.
    let out = inferd(&server, &["reload", "--wait"]);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn scale_stays_within_the_cpu_budget() {
    let workers = test_workers();
    let server = start("scale", workers, &[]);
    let usable = server.status()["usable_cores"].as_u64().unwrap() as usize;
    if workers == usable {
        let out = inferd(&server, &["scale", "+1"]);
        assert!(!out.status.success());
        assert!(
            text(&out).contains(&format!("scale +1 refused: {} workers x 1 threads", workers + 1)),
            "{}",
            text(&out)
        );
    }
    if workers < 2 {
        return;
    }
    // -1 drains the last worker; SIGTTIN (= scale +1) brings one back, and it takes traffic.
    let out = inferd(&server, &["scale", "-1"]);
    assert!(out.status.success(), "{}", text(&out));
    let deadline = Instant::now() + Duration::from_secs(15);
    while server.status()["workers"].as_array().unwrap().len() != workers - 1 {
        assert!(Instant::now() < deadline, "{:#}", server.status());
        std::thread::sleep(Duration::from_millis(50));
    }
    server.signal(Signal::SIGTTIN);
    let status = loop {
        let s = server.status();
        if s["workers"].as_array().unwrap().len() == workers && s["phase"] == "ready" {
            break s;
        }
        assert!(Instant::now() < deadline, "{s:#}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let last = &status["workers"][workers - 1];
    assert_eq!(last["cpus"], json!([workers - 1]));
    let index = (workers - 1).to_string();
    let served = (0..200).any(|_| {
        server.request("POST", "/v2/models/typed/infer", &typed_request()).header("x-inferd-worker")
            == Some(index.as_str())
    });
    assert!(served, "the new worker never answered");
}

#[test]
fn the_control_socket_refuses_other_users_and_status_says_when_no_server_runs() {
    let server = start("perm", 1, &[]);
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&server.socket).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED the other-user half of this test: needs root to run `inferd status` as nobody");
    } else {
        // Let "nobody" reach the socket's folder, so that only the socket's own mode stops it,
        // and run a copy of the binary from there: the checkout may sit in a folder nobody
        // cannot enter (a home directory, `mktemp -d`).
        std::fs::set_permissions(server.dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let bin = server.dir.path().join("inferd-copy");
        std::fs::copy(BIN, &bin).unwrap();
        // A child another test thread forked while the copy was open for writing holds it
        // until that child execs: the copy is "busy" (ETXTBSY) for that moment.
        let status_as_nobody = || {
            Command::new(&bin).args(["status", "--control-socket"]).arg(&server.socket).uid(65534).gid(65534).output()
        };
        let mut out = status_as_nobody();
        for _ in 0..100 {
            match &out {
                Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                    std::thread::sleep(Duration::from_millis(20));
                    out = status_as_nobody();
                }
                _ => break,
            }
        }
        let out = out.unwrap();
        assert!(!out.status.success());
        assert!(text(&out).contains("permission denied"), "{}", text(&out));
    }
    let out = Command::new(BIN)
        .args(["status", "--control-socket"])
        .arg(server.dir.path().join("nothing.sock"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(text(&out).contains("inferd is not running"), "{}", text(&out));
}

#[test]
fn status_exits_2_while_the_pool_is_degraded() {
    let mut server = start("degraded", 1, &[]);
    let out = inferd(&server, &["status"]);
    assert!(out.status.success());
    // A reload the server refuses exits 2, as a degraded status does: the server answered no.
    let out = inferd(&server, &["reload", "--model", "nosuch"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("nosuch"), "{}", text(&out));
    // The model file disappears, then the worker dies: its replacement cannot load, so the
    // slot stays down (retried with backoff) and the pool is degraded.
    let model = server.dir.path().join("models/typed/model.onnx");
    std::fs::remove_file(&model).unwrap();
    let pid = server.worker_pids()[0];
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = inferd(&server, &["status"]);
        if out.status.code() == Some(2) {
            assert!(text(&out).contains("degraded"), "{}", text(&out));
            break;
        }
        assert!(Instant::now() < deadline, "never degraded: {}", text(&out));
        std::thread::sleep(Duration::from_millis(50));
    }
    // Once the file is back, the next retry brings the pool back to ready.
    std::fs::copy(test_models().join("typed/model.onnx"), &model).unwrap();
    server.wait_ready(Duration::from_secs(20));
}

/// server.max_requests recycles workers (with jitter) through the same gap-free replacement
/// as a reload: under load, workers are replaced again and again, and no request fails.
#[test]
fn max_requests_recycles_workers_without_a_failed_request() {
    let dir = temp_dir("recycle");
    let port = free_port();
    let models = repository(dir.path());
    write_config(
        dir.path(),
        port,
        test_workers(),
        &models,
        "typed",
        &[],
        "max_requests = 300\nmax_requests_jitter = 50",
    );
    let mut server = Server::start(dir, port, &[]);
    let before = server.wait_ready(Duration::from_secs(60));
    let first: Vec<i32> = server.worker_pids();
    let load = typed_load(&server, 4);
    // Until 4 recycles are done (counted, not timed: a slow CPU serves fewer requests a second,
    // and a replacement boots at a low priority beside the serving workers).
    let recycles = |server: &Server| {
        metric_value(&server.metrics_text(), "inferd_worker_recycles_total{reason=\"max_requests\"}").unwrap_or(0.0)
    };
    let started = std::time::Instant::now();
    while recycles(&server) < 4.0 && started.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let (ok, failed, _) = load.finish();
    let after = server.wait_ready(Duration::from_secs(30));
    let recycled = recycles(&server);
    eprintln!("{ok} requests, {} failed, {recycled} recycles", failed.len());
    assert!(failed.is_empty(), "{:?}", &failed[..failed.len().min(5)]);
    // A worker past its limit keeps serving until its replacement is ready, one replacement at
    // a time: thousands of requests a second overshoot the limit, so only a floor is checked.
    assert!(recycled >= 4.0, "{recycled} recycles for {ok} requests");
    assert!(after["workers"].as_array().unwrap().iter().all(|w| !first.contains(&(w["pid"].as_i64().unwrap() as i32))));
    assert_eq!(after["generation"], before["generation"], "recycling is not a reload");
    assert!(after["workers"].as_array().unwrap().iter().all(|w| w["restarts"] == 0), "recycles are not restarts");
}
