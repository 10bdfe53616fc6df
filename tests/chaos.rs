//! Chaos under load: a random worker SIGKILLed every 2 s for 60 s (INFERD_CHAOS_SECS to
//! change) while closed-loop clients send requests. Only requests in flight on the killed
//! worker may fail, and the pool is back to K ready workers before each next kill.

mod common;

use std::time::{Duration, Instant};

use common::*;

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
        // Back to K ready workers well before the next kill.
        let deadline = Instant::now() + Duration::from_millis(1900);
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
