//! The pool inferd plans inside a pod's limits: cgroup v1 groups shaped like a Kubernetes
//! pod's (a CPU quota, a cpuset, a memory limit) run the container's own configuration
//! (deploy/inferd.toml), and the workers and threads follow the CPU limit as
//! deploy/k8s/deployment.yaml says, while a pool larger than the memory limit is refused or,
//! with server.fit_workers_to_memory, shrunk (docs/guards.md). Needs root and the cgroup v1
//! cpu, cpuset and memory controllers; without them each test prints why and returns.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::*;

const MIB: u64 = 1 << 20;

fn deploy(path: &str) -> PathBuf {
    repo().join("deploy").join(path)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs a command to its end: (success, stdout + stderr).
fn run(command: &mut Command) -> (bool, String) {
    let out = command.output().unwrap_or_else(|e| panic!("{command:?}: {e}"));
    (out.status.success(), String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr))
}

/// `text` with `from` replaced by `to`, which must occur exactly once.
fn edit(text: &str, from: &str, to: &str) -> String {
    assert_eq!(text.matches(from).count(), 1, "`{from}` should occur once in:\n{text}");
    text.replace(from, to)
}

/// cgroup v1 groups shaped like a pod's limits, one per controller (cpu, cpuset, memory);
/// removed on drop, after the processes in them are gone.
struct PodCgroups {
    dirs: [PathBuf; 3],
}

impl PodCgroups {
    /// `cores` of CPU quota (cfs_quota_us over a 100 ms period) on the CPUs `cpus`, and
    /// `memory` bytes if given. None, with a printed skip, without root or the controllers.
    fn new(test: &str, tag: &str, cores: f64, cpus: &str, memory: Option<u64>) -> Option<PodCgroups> {
        let root = Path::new("/sys/fs/cgroup");
        let controllers = ["cpu", "cpuset", "memory"];
        let missing: Vec<&str> = controllers.into_iter().filter(|c| !root.join(c).join("tasks").is_file()).collect();
        let why = if !nix::unistd::geteuid().is_root() {
            "not root".to_string()
        } else if !missing.is_empty() {
            format!("no cgroup v1 {} under {}", missing.join(", "), root.display())
        } else {
            String::new()
        };
        if !why.is_empty() {
            eprintln!("SKIPPED {test}: needs root and the cgroup v1 cpu, cpuset and memory controllers ({why})");
            return None;
        }
        let name = format!("inferd-test-{tag}-{}", std::process::id());
        // Built first, so that a failure below still removes what was made.
        let cgroups = PodCgroups { dirs: controllers.map(|c| root.join(c).join(&name)) };
        for dir in &cgroups.dirs {
            let _ = std::fs::remove_dir(dir);
            std::fs::create_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        }
        let [cpu, cpuset, mem] = &cgroups.dirs;
        let write = |file: PathBuf, value: String| {
            std::fs::write(&file, &value).unwrap_or_else(|e| panic!("{} = {value}: {e}", file.display()))
        };
        write(cpu.join("cpu.cfs_period_us"), "100000".into());
        write(cpu.join("cpu.cfs_quota_us"), ((cores * 100_000.0) as u64).to_string());
        // A cpuset takes no process before it has memory nodes: its parent's.
        write(cpuset.join("cpuset.mems"), read(&root.join("cpuset/cpuset.mems")).trim().to_string());
        write(cpuset.join("cpuset.cpus"), cpus.to_string());
        if let Some(bytes) = memory {
            write(mem.join("memory.limit_in_bytes"), bytes.to_string());
        }
        Some(cgroups)
    }

    /// `program` started inside the three groups: a shell joins them, then execs it.
    fn command(&self, program: &Path) -> Command {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg("for p in \"$1\" \"$2\" \"$3\"; do echo $$ > \"$p\"; done; shift 3; exec \"$@\"")
            .arg("sh");
        command.args(self.dirs.iter().map(|d| d.join("cgroup.procs"))).arg(program);
        command
    }

    fn oom_kills(&self) -> u64 {
        let text = read(&self.dirs[2].join("memory.oom_control"));
        text.lines().find_map(|l| l.strip_prefix("oom_kill ")).map_or(0, |v| v.trim().parse().unwrap())
    }
}

impl Drop for PodCgroups {
    fn drop(&mut self) {
        for dir in &self.dirs {
            for _ in 0..50 {
                if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// The first two CPUs this process may use, as a cpuset list and as `inferd check` prints them.
fn two_cpus(test: &str) -> Option<(String, String)> {
    let cpus = affinity(0);
    if cpus.len() < 2 {
        eprintln!("SKIPPED {test}: needs two CPUs, this process has {cpus:?}");
        return None;
    }
    let list = format!("{},{}", cpus[0], cpus[1]);
    let shown = if cpus[1] == cpus[0] + 1 { format!("{}-{}", cpus[0], cpus[1]) } else { list.clone() };
    Some((list, shown))
}

#[test]
fn the_pool_is_planned_from_the_pods_cpu_limit() {
    let test = "the_pool_is_planned_from_the_pods_cpu_limit";
    let Some((cpus, shown)) = two_cpus(test) else { return };
    // limits.cpu -> workers x threads, as deploy/k8s/deployment.yaml says: the quota rounded
    // down, within the pod's two CPUs.
    for (cores, workers, threads) in [(1.0, 1, 1), (1.5, 1, 1), (2.0, 1, 2)] {
        let Some(cgroups) = PodCgroups::new(test, "pod-plan", cores, &cpus, None) else { return };
        // The container's own deploy/inferd.toml, unchanged: its repository /mnt/models is this
        // repository's models/, mounted there in a mount namespace of the command's own.
        let mut command = cgroups.command(Path::new("unshare"));
        command
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg("mount -t tmpfs inferd-test /mnt && mkdir /mnt/models && mount --bind \"$1\" /mnt/models && shift && exec \"$@\"")
            .arg("sh")
            .arg(repo().join("models"))
            .arg(BIN)
            .args(["check", "--config"])
            .arg(deploy("inferd.toml"));
        let (ok, out) = run(&mut command);
        eprintln!("limits.cpu {cores}:\n{out}");
        assert!(ok, "{out}");
        let quota = cgroups.dirs[0].join("cpu.cfs_quota_us");
        let usable = format!(
            "usable cores:    {} (affinity {shown} (2 cpus), cgroup quota {cores:.2} cores from {})",
            cores as usize,
            quota.display()
        );
        assert!(out.contains(&usable), "expected `{usable}` in:\n{out}");
        let plan = format!("workers:         {workers} x {threads} intra-op thread(s) = {} threads", workers * threads);
        assert!(out.contains(&plan), "expected `{plan}` in:\n{out}");
        assert!(out.contains("model minilm (version") && out.contains("plan OK"), "{out}");
    }
}

#[test]
fn a_pool_larger_than_the_pods_memory_limit_is_refused_or_shrunk() {
    let test = "a_pool_larger_than_the_pods_memory_limit_is_refused_or_shrunk";
    let Some((cpus, _)) = two_cpus(test) else { return };
    // 70 MiB holds the supervisor and a few workers of the `typed` test model (~8 MiB private
    // each, ~24 MiB shared once; tests/memory.rs), not 8. The CPU plan is not what limits the
    // pool here: 8 workers on 2 cores are allowed (oversubscribed) on purpose.
    let Some(cgroups) = PodCgroups::new(test, "pod-fit", 2.0, &cpus, Some(70 * MIB)) else { return };
    let dir = temp_dir("deploy-fit");
    // The container's configuration, on the test model and with the switch under test.
    let container = read(&deploy("inferd.toml"));
    let config = |fit: bool| -> PathBuf {
        let text =
            edit(&container, "repository = \"/mnt/models\"", &format!("repository = \"{}\"", test_models().display()));
        let text = edit(&text, "default = \"minilm\"", "default = \"typed\"");
        let text = edit(&text, "cache_dir = \"/tmp/inferd/cache\"", "cache_dir = \"cache\"");
        let text = edit(
            &text,
            "[server]\n",
            &format!("[server]\nallow_oversubscription = true\nfit_workers_to_memory = {fit}\n"),
        );
        let path = dir.path().join(format!("fit-{fit}.toml"));
        std::fs::write(&path, text).unwrap();
        path
    };
    let serve = |config: &Path, port: u16, admin: u16| {
        let mut command = cgroups.command(Path::new(BIN));
        command
            .args(["serve", "--workers", "8", "--config"])
            .arg(config)
            .args(["--listen", &format!("127.0.0.1:{port}"), "--admin-listen", &format!("127.0.0.1:{admin}")])
            .arg("--control-socket")
            .arg(dir.path().join(format!("{port}.sock")));
        command
    };

    // `inferd check` says so before anything starts.
    let (ok, out) =
        run(cgroups.command(Path::new(BIN)).args(["check", "--workers", "8", "--config"]).arg(config(false)));
    assert!(ok, "{out}");
    assert!(
        out.contains("cgroup limit 70 MiB") && out.contains("8 workers need ~") && out.contains("DOES NOT FIT"),
        "{out}"
    );

    // serve refuses, with the numbers and the way out (docs/guards.md).
    let port = free_port();
    let mut refused = Server::spawn(serve(&config(false), port, free_port()), temp_dir("deploy-refused"), port, None);
    let status = refused.wait_exit(Duration::from_secs(60));
    let log = refused.log();
    assert!(!status.success(), "{log}");
    assert!(log.contains("memory plan: 8 workers need ~") && log.contains("cgroup limit 70 MiB"), "{log}");
    assert!(log.contains("set server.fit_workers_to_memory = true to start fewer"), "{log}");
    drop(refused);

    // With server.fit_workers_to_memory, it starts as many as fit, and serves.
    let (port, admin) = (free_port(), free_port());
    let socket = dir.path().join(format!("{port}.sock"));
    let mut server = Server::spawn(serve(&config(true), port, admin), temp_dir("deploy-fitted"), port, Some(socket));
    let status = server.wait_ready(Duration::from_secs(60));
    let started = status["workers"].as_array().unwrap().len();
    eprintln!("{started} of 8 workers fit in 70 MiB");
    assert!((1..8).contains(&started), "{status:#}");
    assert!(
        server.log().contains(&format!("starting {started} workers (server.fit_workers_to_memory)")),
        "{}",
        server.log()
    );
    let metrics = request(SocketAddr::from(([127, 0, 0, 1], admin)), "GET", "/metrics", &[], b"").unwrap();
    let metrics = String::from_utf8_lossy(&metrics.body).to_string();
    assert_eq!(metric_value(&metrics, "inferd_workers_desired "), Some(started as f64), "{metrics}");
    for _ in 0..20 {
        assert_eq!(server.request("POST", "/v2/models/typed/infer", &typed_request()).status, 200);
    }
    server.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(server.wait_exit(Duration::from_secs(30)).code(), Some(0), "{}", server.log());
    assert_eq!(cgroups.oom_kills(), 0, "the kernel's OOM killer fired in the pod's cgroup");
}
