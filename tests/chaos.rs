//! Chaos under load: a random worker SIGKILLed 2 s after the pool is whole again, for 60 s
//! (INFERD_CHAOS_SECS to change), while closed-loop clients send requests. Only requests in
//! flight on the killed worker may fail, and the pool comes back to K ready workers after each
//! kill. And every
//! worker killed at once, again and again: the port never refuses a connection while the
//! supervisor lives (clients wait in the queue of the last socket listening).

use std::time::{Duration, Instant};

use crate::common::*;

#[test]
fn random_kills_every_two_seconds_cost_only_the_requests_in_flight() {
    let seconds: u64 = std::env::var("INFERD_CHAOS_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    let workers = test_workers();
    let server = serve(temp_dir("chaos"), workers, &test_models(), "slow", &[], "");
    let clients: u64 = 4;
    let addr = server.addr;
    // ~2 ms of compute each.
    let load = Clients::start(clients as usize, |_| move || post_step(addr, "/v2/models/slow/infer", &slow_body(500)));
    let started = Instant::now();
    let mut kills = 0u64;
    let mut seed = std::process::id() as u64;
    while started.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_secs(2));
        let pids = server.worker_pids();
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let victim = pids[(seed >> 33) as usize % pids.len()];
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(victim), nix::sys::signal::Signal::SIGKILL).unwrap();
        kills += 1;
        // Back to K ready workers (in ~0.1 s on a 2-core machine; bounded generously: the
        // replacement boots at a low priority beside the serving worker, on a CPU of any speed).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = server.status();
            let ready = s["workers"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|w| w["state"] == "ready" && w["pid"].as_i64() != Some(victim as i64))
                .count();
            if ready == workers && s["phase"] == "ready" {
                break;
            }
            assert!(Instant::now() < deadline, "not back to {workers} ready workers after kill {kills}: {s:#}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let tally = load.stop();
    let (ok, failed) = (tally.served as u64, tally.failed.len() as u64);
    let share = failed as f64 / (ok + failed) as f64;
    eprintln!(
        "{seconds} s, {kills} kills: {ok} requests answered, {failed} failed ({:.3}%), {:.2} failed per kill",
        share * 100.0,
        failed as f64 / kills as f64
    );
    // A killed worker can only have the requests of the clients connected to it in flight.
    assert!(failed <= kills * clients, "{failed} failures for {kills} kills of at most {clients} requests in flight");
    assert!(ok > 1000);
}

/// Waits (60 s at most) until every slot has a ready worker none of whose pids is in `gone`;
/// their pids.
fn ready_workers(server: &Server, workers: usize, gone: &[i32]) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = server.status();
        let ready: Vec<i32> = s["workers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|w| w["state"] == "ready")
            .filter_map(|w| w["pid"].as_i64().map(|p| p as i32))
            .filter(|p| !gone.contains(p))
            .collect();
        if ready.len() == workers && s["phase"] == "ready" {
            return ready;
        }
        assert!(Instant::now() < deadline, "not back to {workers} ready workers: {s:#}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn killing_every_worker_at_once_queues_connections_instead_of_refusing_them() {
    let workers = test_workers();
    let server = serve(temp_dir("all-down"), workers, &test_models(), "slow", &[], "");
    let clients: usize = 4;
    let addr = server.addr;
    // A new connection per request, so that every step asks the kernel for a listener.
    let load = Clients::start(clients, |_| move || post_step(addr, "/v2/models/slow/infer", &slow_body(500)));
    let rounds = 5;
    let mut pids = ready_workers(&server, workers, &[]);
    for _ in 0..rounds {
        // Served for long enough that the respawn does not back off (it would only lengthen
        // the wait, not change the outcome).
        std::thread::sleep(Duration::from_millis(1500));
        for pid in &pids {
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), nix::sys::signal::Signal::SIGKILL).unwrap();
        }
        pids = ready_workers(&server, workers, &pids);
    }
    std::thread::sleep(Duration::from_millis(500));
    let tally = load.stop();
    let refused: Vec<&String> = tally.failed.iter().filter(|f| f.starts_with("ConnectionRefused")).collect();
    eprintln!(
        "{rounds} rounds of {workers} workers killed at once: {} requests answered, {} failed ({} refused): {:?}",
        tally.served,
        tally.failed.len(),
        refused.len(),
        tally.failed
    );
    assert!(refused.is_empty(), "{} connections refused while the supervisor lived: {refused:?}", refused.len());
    // Only the requests in flight on the killed workers may fail: one per client per round.
    assert!(
        tally.failed.len() <= rounds * clients,
        "{} failures for {rounds} rounds of at most {clients} requests in flight: {:?}",
        tally.failed.len(),
        tally.failed
    );
    assert!(tally.served > 100, "{} answered", tally.served);
}
