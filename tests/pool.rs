//! The pool as the operator sees it: K ready workers on disjoint CPU sets with their share of
//! threads, and a SIGKILLed worker replaced while the others keep answering.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::common::*;
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
        // Documented in worker/src/lib.rs: T intra-op threads -> 2T + 1 OS threads, one more,
        // pinned to the sibling's core, for a worker that borrows it, and one more, the
        // background lane (server.background_lane), for a worker of one thread.
        let borrows = w["borrows"].as_u64().map(|cpu| cpu as usize);
        let expected = 2 * threads as u64 + 1 + borrows.is_some() as u64 + (threads == 1) as u64;
        assert_eq!(w["os_threads"].as_u64(), Some(expected), "{w}");
        if k == 2 && threads == 1 {
            // Two workers of one thread lend each other their cores (server.lend_idle_cores).
            let sibling = &workers[1 - w["index"].as_u64().unwrap() as usize];
            assert_eq!(borrows.map(|cpu| cpu as u64), sibling["cpus"][0].as_u64(), "{w}");
        }
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

/// The CPUs each thread of `pid` may run on (`Cpus_allowed_list` of /proc/PID/task/*/status).
fn thread_cpus(pid: i32) -> Vec<String> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("status")).ok())
        .filter_map(|s| s.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).map(|c| c.trim().to_string()))
        .collect()
}

#[test]
fn workers_of_one_thread_borrow_an_idle_siblings_core_and_a_killed_borrower_stalls_nobody() {
    if test_workers() < 2 {
        eprintln!("skipped: lending needs 2 usable cores, this machine has 1");
        return;
    }
    let server = start("lend");
    let status = server.status();
    let workers = status["workers"].as_array().unwrap().clone();
    for (w, sibling) in [(&workers[0], &workers[1]), (&workers[1], &workers[0])] {
        let (own, theirs) = (w["cpus"][0].as_u64().unwrap(), sibling["cpus"][0].as_u64().unwrap());
        assert_eq!(w["borrows"].as_u64(), Some(theirs), "{status:#}");
        // Every thread runs on the worker's own core but one, ORT's pool thread of the wide
        // session, pinned to the sibling's.
        let mut cpus = thread_cpus(w["pid"].as_i64().unwrap() as i32);
        cpus.sort();
        let mut expected = vec![own.to_string(); cpus.len() - 1];
        expected.push(theirs.to_string());
        expected.sort();
        assert_eq!(cpus, expected, "threads of worker {w}");
    }

    // One request at a time: each has the pool to itself and borrows the sibling's core.
    for _ in 0..50 {
        let r = server.request("POST", "/v2/models/typed/infer", &typed_request());
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
    let borrowed = |server: &Server| {
        metric_value(&server.metrics_text(), "inferd_core_lending_total{event=\"borrowed\"}").unwrap_or(0.0)
    };
    let lent = borrowed(&server);
    assert!(lent > 0.0, "50 lone requests, none borrowed a core:\n{}", server.metrics_text());
    eprintln!("{lent} of 50 lone requests ran on both cores");

    // Under load, a worker that may hold its sibling's core dies: the sibling goes on
    // answering (the supervisor frees what the dead worker held) and the port stays served.
    let load = TypedLoad::start(&server, 2, Duration::ZERO, |_, _| Instant::now());
    std::thread::sleep(Duration::from_millis(500));
    let victim = workers[0]["pid"].as_i64().unwrap() as i32;
    kill(Pid::from_raw(victim), Signal::SIGKILL).unwrap();
    let killed_at = Instant::now();
    let status = loop {
        let status = server.status();
        let w = &status["workers"][0];
        if w["state"] == "ready" && w["pid"].as_i64() != Some(victim as i64) {
            break status;
        }
        assert!(killed_at.elapsed() < Duration::from_secs(20), "no replacement after 20 s: {status:#}");
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(500));
    let (served, failed, answered_at) = load.finish();
    let after = answered_at.iter().filter(|&&t| t > killed_at).count();
    eprintln!("{served} answered ({after} after the SIGKILL), {} failed: {failed:?}", failed.len());
    assert!(after > 0, "nothing answered after the SIGKILL");
    // At most the request each client had in the dead worker fails.
    assert!(failed.len() <= 2, "{failed:?}");
    // The replacement borrows again.
    let replacement = status["workers"][0]["pid"].as_i64().unwrap() as i32;
    assert!(thread_cpus(replacement).contains(&workers[1]["cpus"][0].as_u64().unwrap().to_string()));
}
