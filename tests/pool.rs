//! The pool as the operator sees it: K ready workers on disjoint CPU sets with their share of
//! threads, and a SIGKILLed worker replaced while the others keep answering.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

fn start(tag: &str) -> Server {
    serve(temp_dir(tag), test_workers(), &test_models(), "typed", &[], "")
}

#[test]
fn status_lists_k_ready_workers_pinned_to_disjoint_cpus_within_the_budget() {
    let server = start("status");
    let k = test_workers();
    let status = server.status();
    let workers = status["workers"].as_array().unwrap();
    assert_eq!(workers.len(), k, "{status:#}");
    let usable = status["usable_cores"].as_u64().unwrap() as usize;
    let mut seen = HashSet::new();
    let mut total_threads = 0;
    for w in workers {
        assert_eq!(w["state"], "ready", "{w}");
        let pid = w["pid"].as_i64().unwrap() as i32;
        let cpus: Vec<usize> = w["cpus"].as_array().unwrap().iter().map(|c| c.as_u64().unwrap() as usize).collect();
        // The kernel's view of the process agrees with what status says.
        assert_eq!(affinity(pid), cpus, "worker {w}");
        for cpu in &cpus {
            assert!(seen.insert(*cpu), "cpu {cpu} is given to two workers: {status:#}");
        }
        let threads = w["threads"].as_u64().unwrap() as usize;
        assert_eq!(threads, status["threads_per_worker"].as_u64().unwrap() as usize);
        assert_eq!(threads, usable / k, "each worker's intra-op threads are its share of the cores");
        // Documented in worker/src/lib.rs: T intra-op threads -> 2T + 1 OS threads.
        assert_eq!(w["os_threads"].as_u64(), Some(2 * threads as u64 + 1), "{w}");
        assert!(w["rss_bytes"].as_u64().unwrap() > 1 << 20);
        assert_eq!(w["models"][0]["name"], "typed");
        total_threads += threads;
    }
    assert!(total_threads <= usable, "{total_threads} threads > {usable} usable cores");

    // The table form has the same rows.
    let out =
        std::process::Command::new(BIN).args(["status", "--control-socket"]).arg(&server.socket).output().unwrap();
    assert!(out.status.success());
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.contains(&format!("{k}/{k} workers ready")), "{table}");
    assert_eq!(table.lines().filter(|l| l.contains("typed:1")).count(), k, "{table}");
}

#[test]
fn a_killed_worker_is_replaced_while_the_others_keep_answering() {
    let mut server = start("kill");
    let before = server.status();
    let victim = before["workers"][0]["pid"].as_i64().unwrap() as i32;
    kill(Pid::from_raw(victim), Signal::SIGKILL).unwrap();
    let killed_at = Instant::now();
    while process_exists(victim) {
        assert!(killed_at.elapsed() < Duration::from_secs(5), "worker {victim} survived SIGKILL");
        std::thread::sleep(Duration::from_millis(10));
    }

    // Until the replacement is ready, every request goes to the remaining worker(s) and succeeds.
    let mut answered = 0;
    let replacement = loop {
        if test_workers() > 1 {
            let r = server.request("POST", "/v2/models/typed/infer", &typed_request());
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            answered += 1;
        }
        let status = server.status();
        let w = &status["workers"][0];
        if w["state"] == "ready" && w["pid"].as_i64() != Some(victim as i64) {
            break status;
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(10),
            "no replacement after 10 s: {status:#}\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!(
        "replacement ready {:.2} s after SIGKILL; {answered} requests answered meanwhile",
        killed_at.elapsed().as_secs_f64()
    );
    let w = &replacement["workers"][0];
    assert_eq!(w["restarts"], 1);
    assert!(w["last_exit"].as_str().unwrap().contains("SIGKILL"), "{w}");
    assert_eq!(replacement["phase"], "ready");
    assert_eq!(
        replacement["workers"][0]["cpus"], before["workers"][0]["cpus"],
        "the replacement keeps the slot's CPUs"
    );
    let pid = w["pid"].as_i64().unwrap() as i32;
    assert_eq!(
        affinity(pid),
        before["workers"][0]["cpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_u64().unwrap() as usize)
            .collect::<Vec<_>>()
    );
    // Other workers were not restarted.
    for (i, w) in replacement["workers"].as_array().unwrap().iter().enumerate().skip(1) {
        assert_eq!(w["pid"], before["workers"][i]["pid"]);
        assert_eq!(w["restarts"], 0);
    }
    // The new worker takes traffic: some request is served by worker 0.
    let served_by_0 = (0..200).any(|_| {
        let r = server.request("POST", "/v2/models/typed/infer", &typed_request());
        assert_eq!(r.status, 200);
        r.header("x-inferd-worker") == Some("0")
    });
    assert!(served_by_0, "the replacement never served a request");
    drop(server.wait_ready(Duration::from_secs(1)));
}
