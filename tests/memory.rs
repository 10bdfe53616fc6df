//! Memory guards under a real cgroup (v1 `memory` controller, root): workers that grow with
//! every request are replaced gracefully before the kernel's OOM killer fires, and no request
//! fails. Also: a pool that cannot fit is refused at start with the numbers.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::common::*;

const MIB: u64 = 1 << 20;

/// A memory cgroup of its own, removed when dropped (after the processes in it are gone).
struct Cgroup(PathBuf);

impl Cgroup {
    /// None (and a printed skip) where this process cannot make one: no root, or no cgroup v1
    /// memory controller.
    fn new(test: &str, tag: &str, limit: u64) -> Option<Cgroup> {
        let root = PathBuf::from("/sys/fs/cgroup/memory");
        let dir = root.join(format!("inferd-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir(&dir);
        if !root.join("memory.limit_in_bytes").is_file() || std::fs::create_dir(&dir).is_err() {
            eprintln!("SKIPPED {test}: needs root and the cgroup v1 memory controller at {}", root.display());
            return None;
        }
        std::fs::write(dir.join("memory.limit_in_bytes"), limit.to_string()).unwrap();
        Some(Cgroup(dir))
    }

    fn oom_kills(&self) -> u64 {
        let text = std::fs::read_to_string(self.0.join("memory.oom_control")).unwrap();
        text.lines().find_map(|l| l.strip_prefix("oom_kill ")).map_or(0, |v| v.trim().parse().unwrap())
    }

    /// Kernel log lines that name this cgroup (the OOM killer names the memcg it acted in).
    fn kernel_mentions(&self) -> Vec<String> {
        let name = self.0.file_name().unwrap().to_string_lossy().to_string();
        let out = Command::new("dmesg").output().expect("dmesg");
        String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.contains(&name)).map(String::from).collect()
    }

    fn peak(&self) -> u64 {
        std::fs::read_to_string(self.0.join("memory.max_usage_in_bytes")).unwrap().trim().parse().unwrap()
    }

    /// `inferd serve --config <dir>/inferd.toml` started inside this cgroup.
    fn serve(&self, dir: TempDir, port: u16, leak_per_request: u64) -> Server {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg("echo $$ > \"$1\" && shift && exec \"$@\"")
            .arg("sh")
            .arg(self.0.join("cgroup.procs"))
            .arg(BIN)
            .args(["serve", "--config"])
            .arg(dir.path().join("inferd.toml"))
            .env("INFERD_TEST_LEAK_BYTES_PER_REQUEST", leak_per_request.to_string());
        Server::spawn(command, dir, port, None)
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[test]
fn growing_workers_are_replaced_before_the_oom_killer() {
    let Some(cgroup) = Cgroup::new("growing_workers_are_replaced_before_the_oom_killer", "grow", 150 * MIB) else {
        return;
    };
    let dir = temp_dir("grow");
    let port = free_port();
    write_config(dir.path(), port, test_workers(), &test_models(), "typed", &[], "");
    // Each request leaks 256 KiB: 2 workers would pass the 150 MiB limit within ~350 requests.
    let mut server = cgroup.serve(dir, port, 256 * 1024);
    let status = server.wait_ready(Duration::from_secs(60));
    assert!(status["memory"].as_str().unwrap().contains("cgroup limit 150 MiB"), "{status:#}");

    // Paced closed-loop load, ~40 requests/s, for 12 s: ~480 requests, ~120 MiB leaked.
    let load = Clients::start(2, |_| {
        let (addr, body) = (server.addr, typed_request());
        move || {
            let step = post_step(addr, "/v2/models/typed/infer", &body);
            std::thread::sleep(Duration::from_millis(50));
            step
        }
    });
    std::thread::sleep(Duration::from_secs(12));
    let Tally { served: ok, failed } = load.stop();
    let text = server.metrics_text();
    let replaced = metric_value(&text, "inferd_worker_recycles_total{reason=\"memory\"}").unwrap_or(0.0);
    eprintln!(
        "{ok} requests, {} failed; {replaced} workers replaced for memory; cgroup peak {} MiB of 150; OOM kills {}",
        failed.len(),
        cgroup.peak() / MIB,
        cgroup.oom_kills()
    );
    assert_eq!(cgroup.oom_kills(), 0, "the kernel's OOM killer fired\n{}", server.log());
    assert_eq!(cgroup.kernel_mentions(), Vec::<String>::new(), "the kernel log names the cgroup");
    assert!(failed.is_empty(), "{:?}", &failed[..failed.len().min(5)]);
    assert!(replaced >= 1.0, "no worker was replaced for memory\n{}", server.log());
    let killed = metric_value(&text, "inferd_worker_restarts_total{reason=\"memory_hard\"}");
    assert_eq!(killed, Some(0.0), "a worker had to be killed: {text}");
    assert!(server.log().contains("over the soft limit"), "{}", server.log());
    server.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(server.wait_exit(Duration::from_secs(30)).code(), Some(0));
}

#[test]
fn a_pool_that_cannot_fit_is_refused_with_the_numbers() {
    // Room for the supervisor and a few workers, not 8: a worker of the `typed` model holds
    // ~8 MiB of its own, and ~24 MiB of mapped libraries and weights that count once.
    let Some(cgroup) = Cgroup::new("a_pool_that_cannot_fit_is_refused_with_the_numbers", "fit", 70 * MIB) else {
        return;
    };
    let dir = temp_dir("fit");
    let port = free_port();
    write_config(dir.path(), port, 8, &test_models(), "typed", &[], "allow_oversubscription = true");
    let mut server = cgroup.serve(dir, port, 0);
    let status = server.wait_exit(Duration::from_secs(30));
    let log = server.log();
    assert!(!status.success(), "{log}");
    eprintln!("{}", log.lines().find(|l| l.contains("memory plan")).unwrap_or("no memory plan line"));
    assert!(log.contains("memory plan: 8 workers need ~"), "{log}");
    assert!(log.contains("cgroup limit 70 MiB"), "{log}");
    assert!(log.contains("server.fit_workers_to_memory"), "{log}");
    assert_eq!(cgroup.oom_kills(), 0);
}

/// The anonymous memory of `pid` (its heap and the arena's regions), from smaps_rollup.
fn anonymous(pid: i32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
    let kb: u64 =
        text.lines().find_map(|l| l.strip_prefix("Anonymous:")).unwrap().trim_end_matches("kB").trim().parse().unwrap();
    kb * 1024
}

fn embed(server: &Server, inputs: serde_json::Value) -> Vec<serde_json::Value> {
    let r = server.request("POST", "/embed", &serde_json::to_vec(&serde_json::json!({ "inputs": inputs })).unwrap());
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json().as_array().unwrap().clone()
}

/// The default allocator, one arena per worker, keeps what the largest batch needed while
/// batches come; once the worker has been idle a second it hands those buffers back to the
/// system (in a worker that kept them, the idle memory stays where the batch left it), and it
/// then answers as before.
#[test]
fn an_idle_worker_hands_back_what_its_largest_batch_needed() {
    after_a_large_batch("idle-shrink", false);
}

/// And so it does while small requests keep coming, never a second apart: the load has
/// fallen, and the large batch's buffers lie unused.
#[test]
fn a_worker_whose_load_fell_hands_back_what_its_largest_batch_needed() {
    after_a_large_batch("fell-shrink", true);
}

/// One worker serving the default model with a token budget that runs 32 texts of ~250
/// tokens at once; after such a batch, it idles (or, `serving`, embeds a short text every 200
/// ms: never idle a second) until it has handed back two thirds of what the batch grew it by,
/// at most 30 s.
fn after_a_large_batch(test: &str, serving: bool) {
    let doing = if serving { "serving a short text every 200 ms" } else { "idle" };
    let dir = temp_dir(test);
    // The default model's files, with that budget: the arena's share of the growth then dwarfs
    // the heap's (which glibc hands back with or without the arena shrinking).
    let repository = dir.path().join("repo");
    let model = repository.join("minilm");
    std::fs::create_dir_all(&model).unwrap();
    for entry in std::fs::read_dir(repo().join("models/minilm")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap();
        if name == "model.toml" {
            let text = std::fs::read_to_string(&path).unwrap() + "\n[batching]\nmax_batch_tokens = 8192\n";
            std::fs::write(model.join(name), text).unwrap();
        } else {
            std::os::unix::fs::symlink(&path, model.join(name)).unwrap();
        }
    }
    let server = serve(dir, 1, &repository, "minilm", &[], "");
    let pid = server.worker_pids()[0];
    let first = embed(&server, "a short text".into());
    std::thread::sleep(Duration::from_secs(2));
    let ready = anonymous(pid);
    let texts: Vec<String> = (0..32).map(|i| format!("text {i} {}", "model ".repeat(248))).collect();
    assert_eq!(embed(&server, texts.into()).len(), 32);
    let after = anonymous(pid);
    eprintln!("anonymous memory: {} MiB at rest, {} MiB after 32 texts of ~250 tokens", ready / MIB, after / MIB);
    // 32 x 256 tokens in one run: the attention scores alone are 96 MiB.
    assert!(after > ready + 64 * MIB, "the batch did not grow the worker: {} -> {} MiB", ready / MIB, after / MIB);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut answers = Vec::new();
    let now = loop {
        std::thread::sleep(Duration::from_millis(200));
        if serving {
            answers.push(embed(&server, "a short text".into()));
        }
        let now = anonymous(pid);
        // At least two thirds of the growth handed back (the heap's share alone is less).
        if now < ready + (after - ready) / 3 {
            break now;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "30 s {doing} and the worker still holds {} MiB (at rest {} MiB, after the batch {} MiB)",
            now / MIB,
            ready / MIB,
            after / MIB
        );
    };
    eprintln!("anonymous memory after {doing} ({} short requests): {} MiB", answers.len(), now / MIB);
    assert!(answers.iter().all(|a| *a == first), "an answer changed while the arena shrank");
    assert_eq!(embed(&server, "a short text".into()), first, "the answer changed after the arena shrank");
    assert_eq!(server.worker_pids(), vec![pid], "the worker was replaced");
}
