//! Random sequences of operator actions and faults against a serving pool, with the pool's
//! invariants checked after every step. Seeded and reproducible: the seed is printed, and
//! INFERD_FAULT_SEED=N replays it; INFERD_FAULT_STEPS=N runs longer (default 12).
//!
//! Steps: a rolling reload (`inferd reload --wait`), a reload to a corrupt model file and one
//! to a misfit model (a folder whose model.toml wants a text classifier, with a model that is
//! not one): both refused, nothing changes; SIGHUP, scale +1 / -1, SIGKILL of a worker,
//! SIGSTOP of a worker (stuck: the supervisor must notice its silent batch timer thread, kill and
//! replace it), concurrent control clients. Keep-alive clients load the pool throughout;
//! workers are recycled after max_requests, and every request leaks 400 KiB in the worker
//! (INFERD_TEST_LEAK_BYTES_PER_REQUEST) against a 32 MiB soft limit, so workers are also
//! replaced for memory as they go. The load pauses only around a SIGKILL or SIGSTOP, whose
//! requests in flight would fail by design. Between the steps, drawn from a second generator
//! so that a seed's steps stay what they were, a worker is poisoned: hostile requests (a
//! tensor whose byte size wraps, a huge JSON shape, a BYTES element claiming 4 GiB, a
//! multi-byte value cut in an error) must each be refused with a 400, and a request that
//! panics its lane (INFERD_TEST_PANIC) answered 500 while its worker is replaced gap-free.
//! After each step, within a bound: the supervisor is alive; the pool is ready with the
//! intended number of workers, each alive, and no other worker process of the supervisor
//! exists; with the load paused, nothing is in flight; the Prometheus request total equals the
//! answers the clients received; and no request failed.

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;
use nix::sys::signal::Signal;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Keep-alive clients that can be paused; they count answers and failures as they go.
struct Load {
    run: Arc<AtomicBool>,
    /// Bumped when the clients' connections are known dead (their worker was killed): a
    /// client then opens a new one, as a client that notices the close before reuse does.
    epoch: Arc<AtomicU64>,
    busy: Arc<AtomicU64>,
    answered: Arc<AtomicU64>,
    failed: Arc<Mutex<Vec<String>>>,
    clients: Clients,
}

impl Load {
    fn start(addr: std::net::SocketAddr, clients: usize) -> Load {
        let (run, epoch) = (Arc::new(AtomicBool::new(true)), Arc::new(AtomicU64::new(0)));
        let (busy, answered) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let failed = Arc::new(Mutex::new(Vec::new()));
        let clients = Clients::start(clients, |i| {
            let (run, epoch, busy, answered, failed) =
                (run.clone(), epoch.clone(), busy.clone(), answered.clone(), failed.clone());
            let body = typed_request();
            let mut rng = Rng(i as u64 + 7);
            let (mut connection, mut opened_in) = (None, 0);
            move || {
                if !run.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(5));
                    return Step::Skipped;
                }
                busy.fetch_add(1, Ordering::SeqCst);
                // Checked again: `pause` waits for `busy` to reach 0 after clearing `run`.
                if run.load(Ordering::SeqCst) {
                    let now = epoch.load(Ordering::SeqCst);
                    let c = match connection.take().filter(|_| opened_in == now) {
                        Some(c) => Ok(c),
                        None => {
                            opened_in = now;
                            Connection::open(addr)
                        }
                    };
                    match c.and_then(|mut c| c.post("/v2/models/typed/infer", &body).map(|a| (c, a))) {
                        Ok((c, answer)) => {
                            answered.fetch_add(1, Ordering::SeqCst);
                            if answer.status != 200 {
                                failed.lock().unwrap().push(format!("status {}", answer.status));
                            }
                            if !answer.closes() {
                                connection = Some(c);
                            }
                        }
                        Err(e) => failed.lock().unwrap().push(e.to_string()),
                    }
                }
                busy.fetch_sub(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(rng.below(20)));
                // Counted live above: `check` reads the counts while the clients run.
                Step::Skipped
            }
        });
        Load { run, epoch, busy, answered, failed, clients }
    }

    /// Stops sending and waits until no request is in flight.
    fn pause(&self) {
        self.run.store(false, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.busy.load(Ordering::SeqCst) > 0 {
            assert!(Instant::now() < deadline, "the clients did not pause");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn resume(&self) {
        self.run.store(true, Ordering::SeqCst);
    }

    fn finish(self) {
        // Every step is counted live and says Skipped: a failure here is a client that panicked.
        let tally = self.clients.stop();
        assert!(tally.failed.is_empty(), "{:?}", tally.failed);
    }
}

fn control(server: &Server, args: &[&str]) -> (bool, String) {
    let out = Command::new(BIN).args(args).arg("--control-socket").arg(&server.socket).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr))
}

/// Worker processes whose parent is the supervisor.
fn children(supervisor: u32) -> Vec<i32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
        // fields[0] is the state, fields[1] the parent.
        if fields.get(1) == Some(&supervisor.to_string().as_str()) && fields.first() != Some(&"Z") {
            pids.push(pid);
        }
    }
    pids.sort();
    pids
}

/// Sum of the Prometheus request counts.
fn requests_counted(server: &Server) -> u64 {
    let text = server.metrics_text();
    let lines = text.lines().filter(|l| l.starts_with("inferd_requests_total{"));
    lines.map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap()).sum::<f64>() as u64
}

/// Hostile requests against the pool, with the clients paused so that what they add to the
/// request counts is known; returns that.
fn poison(server: &Server, load: &Load, what: &str) -> u64 {
    load.pause();
    let before = requests_counted(server);
    let huge = 2_305_843_009_213_693_952i64;
    let cases = [
        (
            binary_infer_body(
                serde_json::json!([{"name": "i64_in", "shape": [1, huge], "datatype": "INT64", "parameters": {"binary_data_size": 0}}]),
                b"",
            ),
            400,
        ),
        (
            binary_infer_body(
                serde_json::json!([{"name": "f32_in", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 4}}]),
                &u32::MAX.to_le_bytes(),
            ),
            400,
        ),
    ];
    for ((body, length), status) in cases {
        let r = request(
            server.addr,
            "POST",
            "/v2/models/typed/infer",
            &[("Inference-Header-Content-Length", &length)],
            &body,
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(r.status, status, "{what}: {}", String::from_utf8_lossy(&r.body));
    }
    let json_cases = [
        (infer_body(serde_json::json!([{"name": "i64_in", "shape": [1, huge], "datatype": "INT64", "data": []}])), 400),
        (
            infer_body(
                serde_json::json!([{"name": "f32_in", "shape": [1, 1], "datatype": "FP32", "data": ["é".repeat(30)]}]),
            ),
            400,
        ),
    ];
    for (body, status) in json_cases {
        let r = server.request("POST", "/v2/models/typed/infer", &body);
        assert_eq!(r.status, status, "{what}: {}", String::from_utf8_lossy(&r.body));
    }
    // 7 rows: the lane panics (caught); this request alone fails, its worker is replaced.
    let r = server.request("POST", "/v2/models/typed/infer", &typed_rows_request(7));
    assert_eq!(r.status, 500, "{what}: a lane panic: {}", String::from_utf8_lossy(&r.body));
    let added = requests_counted(server) - before;
    load.resume();
    added
}

/// The invariants, once the pool has had `bound` to settle with `workers` workers; `own`:
/// requests the test itself sent (poison) that the counts include beside the clients'.
fn check(server: &mut Server, load: &Load, workers: usize, step: &str, bound: Duration, own: u64) {
    let deadline = Instant::now() + bound;
    let supervisor = server.process.child.id();
    loop {
        assert!(server.running(), "{step}: the supervisor died\n{}", server.log());
        let status = server.status();
        let all = status["workers"].as_array().unwrap();
        let mut pids: Vec<i32> = all.iter().filter_map(|w| w["pid"].as_i64()).map(|p| p as i32).collect();
        pids.sort();
        let settled = status["phase"] == "ready"
            && all.len() == workers
            && all.iter().all(|w| w["state"] == "ready")
            && pids.iter().all(|&p| process_exists(p))
            && children(supervisor) == pids;
        if settled {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{step}: not back to {workers} ready workers within {bound:?} (processes {:?}): {status:#}\n{}",
            children(supervisor),
            server.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    load.pause();
    let status = server.status();
    let in_flight: u64 = status["workers"].as_array().unwrap().iter().map(|w| w["in_flight"].as_u64().unwrap()).sum();
    assert_eq!(in_flight, 0, "{step}: requests in flight with the clients paused: {status:#}");
    let counted = requests_counted(server);
    let answered = load.answered.load(Ordering::SeqCst);
    assert_eq!(
        counted,
        answered + own,
        "{step}: Prometheus counts {counted} requests, the clients got {answered} answers, the test sent {own}"
    );
    let failed = load.failed.lock().unwrap().clone();
    assert!(failed.is_empty(), "{step}: {} requests failed: {failed:?}\n{}", failed.len(), server.log());
    load.resume();
}

#[test]
fn random_fault_sequences_keep_the_pool_whole() {
    let seed: u64 = std::env::var("INFERD_FAULT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 % 1_000_000
    });
    let steps: usize = std::env::var("INFERD_FAULT_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(12);
    eprintln!("random fault sequence: seed {seed}, {steps} steps (INFERD_FAULT_SEED={seed} replays it)");
    let max_workers = test_workers();
    let dir = temp_dir("faults");
    let port = free_port();
    // request_timeout_secs: a worker whose batch timer thread is silent this long is stuck.
    // A fresh typed worker holds ~9 MiB of private memory: with the leak below it passes the
    // soft limit after a few dozen requests (1-4 replacements in 20 steps), about when
    // max_requests would recycle it (25-35), if no reload replaced it first.
    let extra = "max_requests = 25\nmax_requests_jitter = 10\nrequest_timeout_secs = 5\n\
                 worker_memory_soft_limit_mb = 32";
    let config = write_config(dir.path(), port, 1, &test_models(), "typed", &[], extra);
    let corrupt = dir.path().join("corrupt.onnx");
    std::fs::write(&corrupt, b"this is not an ONNX model").unwrap();
    // The typed model under a model.toml for a text classifier: it loads, but has neither the
    // tokenizer's inputs nor a `logits` output.
    let misfit = dir.path().join("misfit");
    std::fs::create_dir(&misfit).unwrap();
    std::os::unix::fs::symlink(test_models().join("typed/model.onnx"), misfit.join("model.onnx")).unwrap();
    let classifier = std::fs::read_to_string(test_models().join("classifier/model.toml")).unwrap();
    // A copy of the tokenizer beside it: a model loaded by path must have every file inside
    // the repository or admin.allowed_paths (this test's folder).
    std::fs::copy(repo().join("models/minilm/tokenizer.json"), misfit.join("tokenizer.json")).unwrap();
    let toml = classifier
        .replace("name = \"classifier\"", "name = \"typed\"")
        .replace("\"../../../models/minilm/tokenizer.json\"", "\"tokenizer.json\"");
    std::fs::write(misfit.join("model.toml"), toml).unwrap();
    let mut command = Command::new(BIN);
    command
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .env("INFERD_TEST_LEAK_BYTES_PER_REQUEST", (400 * 1024).to_string())
        .env("INFERD_TEST_PANIC", "lane:7");
    let mut server = Server::spawn(command, dir, port, None);
    server.wait_ready(Duration::from_secs(60));
    let load = Load::start(server.addr, 8);
    let mut rng = Rng(seed);
    let mut workers = 1;
    let bound = Duration::from_secs(60);
    let mut done = Vec::new();
    // Poison steps come from their own generator: the seed's other steps are unchanged.
    let mut poisons = Rng(seed ^ 0x5eed_0f90_15ed);
    let mut own = 0;
    for step in 0..steps {
        if poisons.below(4) == 0 {
            let what = format!("seed {seed} step {step} (poison) after {done:?}");
            own += poison(&server, &load, &what);
            done.push("poison");
            check(&mut server, &load, workers, &what, bound, own);
        }
        let action = rng.below(9);
        let name = match action {
            0 => {
                let (ok, said) = control(&server, &["reload", "--wait"]);
                assert!(ok, "seed {seed} step {step}: reload failed: {said}\n{}", server.log());
                "reload"
            }
            1 => {
                let (ok, said) = control(&server, &["reload", "--wait", "--path", corrupt.to_str().unwrap()]);
                assert!(!ok && said.contains("reload failed"), "seed {seed} step {step}: a corrupt reload: {said}");
                "corrupt reload"
            }
            8 => {
                let (ok, said) = control(&server, &["reload", "--wait", "--path", misfit.to_str().unwrap()]);
                assert!(!ok && said.contains("reload failed"), "seed {seed} step {step}: a misfit reload: {said}");
                "misfit reload"
            }
            2 => {
                let before = server.status()["generation"].as_u64().unwrap();
                server.signal(Signal::SIGHUP);
                // The reload it starts runs on its own: wait until it has begun.
                let deadline = Instant::now() + bound;
                while server.status()["generation"].as_u64().unwrap() == before {
                    assert!(Instant::now() < deadline, "seed {seed} step {step}: SIGHUP started no reload");
                    std::thread::sleep(Duration::from_millis(10));
                }
                "SIGHUP"
            }
            3 if workers < max_workers => {
                let (ok, said) = control(&server, &["scale", "+1"]);
                assert!(ok, "seed {seed} step {step}: scale +1: {said}");
                workers += 1;
                "scale +1"
            }
            4 if workers > 1 => {
                let (ok, said) = control(&server, &["scale", "-1"]);
                assert!(ok, "seed {seed} step {step}: scale -1: {said}");
                workers -= 1;
                "scale -1"
            }
            5 | 6 => {
                // Its requests in flight would fail by design: the clients pause first.
                load.pause();
                // A worker killed within a second of its start counts as crash-looping and
                // its slot backs off (up to 30 s): kill one that has served a while, as an
                // operator or the OOM killer would.
                let deadline = Instant::now() + bound;
                let pids = loop {
                    let status = server.status();
                    let all = status["workers"].as_array().unwrap();
                    if all.iter().all(|w| w["uptime_secs"].as_f64().is_some_and(|u| u > 1.5)) {
                        break all.iter().filter_map(|w| w["pid"].as_i64()).map(|p| p as i32).collect::<Vec<_>>();
                    }
                    assert!(Instant::now() < deadline, "seed {seed} step {step}: {status:#}");
                    std::thread::sleep(Duration::from_millis(50));
                };
                let victim = pids[rng.below(pids.len() as u64) as usize];
                // SIGSTOP: the supervisor sees the batch timer thread's beat stop, then SIGABRTs and
                // SIGKILLs it (request_timeout_secs = 5 above).
                let signal = if action == 5 { Signal::SIGKILL } else { Signal::SIGSTOP };
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(victim), signal).unwrap();
                let deadline = Instant::now() + bound;
                while process_exists(victim) {
                    assert!(Instant::now() < deadline, "seed {seed} step {step}: the killed worker is still there");
                    std::thread::sleep(Duration::from_millis(10));
                }
                // Its connections died with it: the clients open new ones.
                load.epoch.fetch_add(1, Ordering::SeqCst);
                // The supervisor must have seen the exit before traffic resumes.
                while server.worker_pids().contains(&victim) {
                    assert!(Instant::now() < deadline, "seed {seed} step {step}: the dead worker is still listed");
                    std::thread::sleep(Duration::from_millis(10));
                }
                if action == 5 {
                    "SIGKILL of a worker"
                } else {
                    "SIGSTOP of a worker"
                }
            }
            _ => {
                let socket = server.socket.clone();
                let statuses: Vec<_> = (0..4)
                    .map(|_| {
                        let socket = socket.clone();
                        std::thread::spawn(move || {
                            Command::new(BIN)
                                .args(["status", "--json", "--control-socket"])
                                .arg(&socket)
                                .output()
                                .unwrap()
                        })
                    })
                    .collect();
                let (ok, said) = control(&server, &["reload", "--wait"]);
                for s in statuses {
                    let out = s.join().unwrap();
                    assert!(matches!(out.status.code(), Some(0 | 2)), "seed {seed} step {step}: status: {out:?}");
                }
                assert!(ok, "seed {seed} step {step}: reload beside status clients: {said}");
                "reload with concurrent status clients"
            }
        };
        done.push(name);
        check(&mut server, &load, workers, &format!("seed {seed} step {step} ({name}) after {done:?}"), bound, own);
    }
    let answered = load.answered.load(Ordering::SeqCst);
    load.finish();
    let metrics = server.metrics_text();
    let recycled = metric_value(&metrics, "inferd_worker_recycles_total{reason=\"max_requests\"}");
    let replaced = metric_value(&metrics, "inferd_worker_recycles_total{reason=\"memory\"}");
    let mut kinds = std::collections::BTreeMap::new();
    for name in &done {
        *kinds.entry(*name).or_insert(0) += 1;
    }
    eprintln!(
        "seed {seed}: {steps} steps {kinds:?}, 0 invariant violations, {answered} requests answered, recycled for \
         max_requests: {recycled:?}, replaced for memory: {replaced:?}"
    );
    let killed = metric_value(&metrics, "inferd_worker_restarts_total{reason=\"memory_hard\"}");
    assert_eq!(killed, Some(0.0), "no worker may be killed for memory: {metrics}");
}
