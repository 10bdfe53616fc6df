//! A rolling reload against every other action that starts a worker, each interleaving forced
//! rather than left to timing: a worker started for a given cause is held, warm but not yet
//! listening, while a file says so (INFERD_TEST_HOLD_DIR, worker/src/server/boot.rs), so the test
//! decides what is in flight when the reload starts and what finishes first.
//!
//! What must hold in each: a reload completes only when the worker it started itself is
//! ready, and fails only when that worker fails; a replacement that was already booting
//! finishes on the old models; after a failed reload every later worker runs the old models.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::common::*;
use nix::sys::signal::Signal;

/// Every bound: generous, since a busy 2-core machine boots workers slowly.
const BOUND: Duration = Duration::from_secs(60);

struct Race {
    server: Server,
    holds: PathBuf,
    /// The typed model with other bytes (another version), and a file that is no model at all.
    other: PathBuf,
    corrupt: PathBuf,
}

impl Race {
    /// One worker (of one thread) serving `typed`; `extra` goes into [server].
    fn start(tag: &str, extra: &str, env: &[(&str, String)]) -> Race {
        let dir = temp_dir(tag);
        let port = free_port();
        let holds = dir.path().join("holds");
        std::fs::create_dir(&holds).unwrap();
        let other = dir.path().join("other.onnx");
        model_variant(&test_models().join("typed/model.onnx"), &other, "inferd races: another version");
        let corrupt = dir.path().join("corrupt.onnx");
        std::fs::write(&corrupt, b"this is not an ONNX model").unwrap();
        let config = write_config(dir.path(), port, 1, &test_models(), "typed", &[], extra);
        let mut command = Command::new(BIN);
        command.arg("serve").arg("--config").arg(&config).env("INFERD_TEST_HOLD_DIR", &holds);
        for (key, value) in env {
            command.env(key, value);
        }
        let mut server = Server::spawn(command, dir, port, None);
        server.wait_ready(BOUND);
        Race { server, holds, other, corrupt }
    }

    /// Workers started for `cause` from now on wait before listening.
    fn hold(&self, cause: &str) {
        std::fs::write(self.holds.join(format!("hold-{cause}")), b"").unwrap();
    }

    /// Waits until a worker started for `cause` waits at the hold; returns its pid.
    fn held(&self, cause: &str) -> u32 {
        let marker = self.holds.join(format!("held-{cause}"));
        let deadline = Instant::now() + BOUND;
        loop {
            if let Some(pid) = std::fs::read_to_string(&marker).ok().and_then(|t| t.parse().ok()) {
                return pid;
            }
            assert!(Instant::now() < deadline, "no worker for {cause} was held; log:\n{}", self.server.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn release(&self, cause: &str) {
        std::fs::remove_file(self.holds.join(format!("hold-{cause}"))).unwrap();
    }

    fn control(&self, args: &[&str]) -> Output {
        Command::new(BIN).args(args).arg("--control-socket").arg(&self.server.socket).output().unwrap()
    }

    /// Starts `inferd reload --wait` plus `args` in the background and waits until the reload
    /// has begun (the generation moved on); returns its answer to come and the generation
    /// before it.
    fn reload(&self, args: &[&str]) -> (JoinHandle<Output>, u64) {
        let before = self.server.status()["generation"].as_u64().unwrap();
        let socket = self.server.socket.clone();
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let answer = std::thread::spawn(move || {
            Command::new(BIN)
                .args(["reload", "--wait"])
                .args(&args)
                .arg("--control-socket")
                .arg(&socket)
                .output()
                .unwrap()
        });
        self.wait_for("the reload starts", |s| s["generation"].as_u64() > Some(before) && !s["reload"].is_null());
        (answer, before)
    }

    /// Sends requests until a worker started for `cause` (a guard's replacement the requests
    /// bring about) waits at its hold; returns its pid.
    fn serve_until_held(&self, cause: &str) -> u32 {
        let marker = self.holds.join(format!("held-{cause}"));
        let deadline = Instant::now() + BOUND;
        while !marker.exists() {
            assert!(Instant::now() < deadline, "no worker for {cause} was started: {:#}", self.server.status());
            self.infer();
        }
        self.held(cause)
    }

    /// Status, once `test` holds for it.
    fn wait_for(&self, what: &str, test: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
        let deadline = Instant::now() + BOUND;
        loop {
            let status = self.server.status();
            if test(&status) {
                return status;
            }
            assert!(Instant::now() < deadline, "{what}: not within {BOUND:?}: {status:#}\n{}", self.server.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The pool back to `workers` ready workers and no reload; their model versions.
    fn settled(&self, workers: usize) -> Vec<String> {
        let status = self.wait_for("the pool settles", |s| {
            let all = s["workers"].as_array().unwrap();
            s["phase"] == "ready" && all.len() == workers && all.iter().all(|w| w["state"] == "ready")
        });
        versions(&status)
    }

    /// SIGKILLs the worker `pid` and returns the status once its replacement serves.
    fn kill(&self, pid: u32) -> serde_json::Value {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
        self.wait_for("the killed worker is replaced", |s| {
            let all = s["workers"].as_array().unwrap();
            s["phase"] == "ready" && all.iter().all(|w| w["state"] == "ready" && w["pid"].as_u64() != Some(pid as u64))
        })
    }

    fn infer(&self) -> String {
        let answer = self.server.request("POST", "/v2/models/typed/infer", &typed_request());
        assert_eq!(answer.status, 200, "{}", answer.error());
        answer.header("x-inferd-model-version").unwrap().to_string()
    }
}

/// Each worker's model version as answers carry it (`x-inferd-model-version`).
fn versions(status: &serde_json::Value) -> Vec<String> {
    status["workers"].as_array().unwrap().iter().map(version).collect()
}

fn version(worker: &serde_json::Value) -> String {
    let model = &worker["models"][0];
    format!("{}+{}", model["version"].as_str().unwrap(), model["sha256"].as_str().unwrap())
}

fn worker(status: &serde_json::Value, pid: u32) -> Option<&serde_json::Value> {
    status["workers"].as_array().unwrap().iter().find(|w| w["pid"].as_u64() == Some(pid as u64))
}

/// The answer of a reload to a corrupt file: it failed at the pool's one worker.
fn failed_at_the_worker(answer: JoinHandle<Output>) -> Output {
    let out = answer.join().unwrap();
    assert!(!out.status.success(), "a reload to a corrupt file succeeded: {}", text(&out));
    assert!(text(&out).contains("reload failed at worker 1 of 1"), "{}", text(&out));
    out
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn pid_of(status: &serde_json::Value) -> u32 {
    status["workers"][0]["pid"].as_u64().unwrap() as u32
}

/// Reload x memory replacement: the memory guard's replacement (old models) is booting when the
/// reload starts and becomes ready first. The reload must not count it: it replaces that worker
/// in turn with its own, and completes only when its own is ready.
#[test]
fn a_memory_replacement_in_flight_never_completes_a_reload() {
    // A fresh typed worker holds ~9 MiB of private memory; 400 KiB leaked per request passes
    // the 32 MiB soft limit after some 60 requests.
    let leak = [("INFERD_TEST_LEAK_BYTES_PER_REQUEST", (400 * 1024).to_string())];
    let race = Race::start("race-memory", "worker_memory_soft_limit_mb = 32", &leak);
    let old = race.settled(1);
    race.hold("memory");
    race.hold("reload");
    let replacement = race.serve_until_held("memory");
    let (answer, _) = race.reload(&["--path", path(&race.other)]);
    race.release("memory");
    // The replacement takes over the slot, on the old models...
    let status = race.wait_for("the memory replacement serves", |s| {
        worker(s, replacement).is_some_and(|w| w["state"] == "ready" && w["started_for"] == "memory")
    });
    assert_eq!(version(worker(&status, replacement).unwrap()), old[0], "the replacement finished on the old models");
    // ...and the reload goes on: its own worker is the one held now, so it cannot be complete.
    let own = race.held("reload");
    assert_ne!(own, replacement);
    let status = race.server.status();
    assert_eq!(status["phase"], "reloading", "a worker the reload did not start completed it: {status:#}");
    assert!(!answer.is_finished(), "the reload answered before its own worker was ready");
    race.release("reload");
    let out = answer.join().unwrap();
    assert!(out.status.success() && text(&out).contains("reload complete"), "{}", text(&out));
    let now = race.settled(1);
    assert_ne!(now, old, "the reload's own worker serves the new file");
    let status = race.server.status();
    assert_eq!(status["workers"][0]["pid"].as_u64(), Some(own as u64));
    assert_eq!(status["workers"][0]["started_for"], "reload");
    assert_eq!(race.infer(), now[0], "answers come from the new file");
}

/// Reload x recycle, to a corrupt file: the recycling replacement (old models) is booting when
/// the reload starts. The reload fails on its own worker; the pool keeps the old models, and a
/// worker killed afterwards comes back on them.
#[test]
fn a_corrupt_reload_beside_a_recycle_fails_and_later_workers_run_the_old_models() {
    let race = Race::start("race-recycle", "max_requests = 10", &[]);
    let old = race.settled(1);
    race.hold("recycle");
    let recycled = race.serve_until_held("recycle");
    let (answer, _) = race.reload(&["--path", path(&race.corrupt)]);
    race.release("recycle");
    let out = failed_at_the_worker(answer);
    assert!(text(&out).contains("still booting on the previous models"), "it waited for the recycle: {}", text(&out));
    assert_eq!(race.settled(1), old);
    let status = race.server.status();
    assert_eq!(pid_of(&status), recycled, "the recycled worker serves: {status:#}");
    assert_eq!(status["reloads_failed"], 1);
    // After the failed reload, a respawn loads the old models, not the corrupt file.
    let status = race.kill(recycled);
    assert_eq!(status["workers"][0]["started_for"], "respawn");
    assert_eq!(versions(&status), old, "the respawn runs the old models: {status:#}");
    assert_eq!(race.infer(), old[0]);
}

/// Reload x SIGKILL respawn, to a corrupt file: the dead worker's respawn is booting when the
/// reload starts; the reload waits for it, then fails on its own worker, and the respawned
/// worker goes on serving the old models, as does the one after it.
#[test]
fn a_corrupt_reload_beside_a_respawn_fails_and_the_respawn_keeps_the_old_models() {
    let race = Race::start("race-respawn", "", &[]);
    let old = race.settled(1);
    race.hold("respawn");
    let first = pid_of(&race.server.status());
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(first as i32), Signal::SIGKILL).unwrap();
    let respawn = race.held("respawn");
    let (answer, _) = race.reload(&["--path", path(&race.corrupt)]);
    race.release("respawn");
    failed_at_the_worker(answer);
    assert_eq!(race.settled(1), old);
    let status = race.server.status();
    assert_eq!(pid_of(&status), respawn);
    assert_eq!(status["workers"][0]["started_for"], "respawn");
    let status = race.kill(respawn);
    assert_eq!(versions(&status), old, "the next respawn runs the old models too: {status:#}");
}

/// Reload x scale +1: the new slot's first worker (old models) is booting when the reload
/// reaches that slot; the reload waits for it, replaces it, and only then completes.
#[test]
fn a_reload_replaces_a_slot_that_scale_up_is_still_booting() {
    let race = Race::start("race-scale", "", &[]);
    if race.server.status()["usable_cores"].as_u64() < Some(2) {
        eprintln!("skipped: scale +1 needs a second usable core for a 1-thread worker");
        return;
    }
    let old = race.settled(1);
    race.hold("scale");
    let out = race.control(&["scale", "+1"]);
    assert!(out.status.success(), "{}", text(&out));
    let scaled = race.held("scale");
    race.hold("reload");
    let (answer, _) = race.reload(&["--path", path(&race.other)]);
    // Worker 1 of 2 is replaced first; release it and the reload reaches the booting slot.
    let first = race.held("reload");
    std::fs::remove_file(race.holds.join("held-reload")).unwrap();
    race.release("reload");
    race.wait_for("the reload reaches worker 2", |s| {
        s["reload"].as_str().is_some_and(|r| r.contains("worker 2 of 2"))
            && worker(s, first).is_some_and(|w| w["state"] == "ready")
    });
    race.hold("reload");
    race.release("scale");
    let status =
        race.wait_for("the scaled-up worker serves", |s| worker(s, scaled).is_some_and(|w| w["state"] == "ready"));
    assert_eq!(worker(&status, scaled).unwrap()["started_for"], "scale");
    let second = race.held("reload");
    assert!(!answer.is_finished(), "the reload completed before its worker 2 was ready: {:#}", race.server.status());
    race.release("reload");
    let out = answer.join().unwrap();
    assert!(out.status.success() && text(&out).contains("reload complete"), "{}", text(&out));
    let now = race.settled(2);
    assert!(now.iter().all(|v| *v != old[0]), "every worker runs the new file: {now:?}");
    let status = race.server.status();
    let mut pids: Vec<u64> = status["workers"].as_array().unwrap().iter().map(|w| w["pid"].as_u64().unwrap()).collect();
    pids.sort();
    let mut own = vec![first as u64, second as u64];
    own.sort();
    assert_eq!(pids, own, "the reload's own two workers serve: {status:#}");
}

/// Two reloads: while one waits for its worker, a second (control socket or SIGHUP) is refused
/// and changes nothing; a corrupt reload after a good one leaves the good one's models in
/// every later worker.
#[test]
fn a_second_reload_is_refused_while_one_runs_and_a_failed_one_keeps_the_last_good_models() {
    let race = Race::start("race-reloads", "", &[]);
    let old = race.settled(1);
    race.hold("reload");
    let (answer, before) = race.reload(&["--path", path(&race.other)]);
    let own = race.held("reload");
    let second = race.control(&["reload", "--wait", "--path", path(&race.corrupt)]);
    assert!(!second.status.success(), "{}", text(&second));
    assert!(text(&second).contains("a reload is already in progress"), "{}", text(&second));
    // The control socket's refusal logged the same words: wait for one more, the signal's.
    let refusals = || race.server.log().matches("reload refused: a reload is already").count();
    let refused_before = refusals();
    race.server.signal(Signal::SIGHUP);
    let status = race.wait_for("SIGHUP is refused", |_| refusals() > refused_before);
    assert_eq!(status["generation"], before + 1, "only one reload began");
    race.release("reload");
    let out = answer.join().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let good = race.settled(1);
    assert_ne!(good, old);
    assert_eq!(pid_of(&race.server.status()), own);
    let out = race.control(&["reload", "--wait", "--path", path(&race.corrupt)]);
    assert!(!out.status.success() && text(&out).contains("reload failed"), "{}", text(&out));
    assert_eq!(race.settled(1), good);
    let status = race.kill(own);
    assert_eq!(versions(&status), good, "a respawn after the failed reload runs the last good file: {status:#}");
}
