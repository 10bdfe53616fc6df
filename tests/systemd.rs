//! systemd's side of the protocols, played by the test: the notify socket (`NOTIFY_SOCKET`,
//! `WATCHDOG_USEC`) and socket activation (`LISTEN_FDS`). The real systemd runs the unit in
//! scripts/systemd-e2e.sh.

use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;
use nix::sys::signal::Signal;

/// `inferd serve` through `sh`, which puts its own pid (kept by `exec`) in `variable`:
/// systemd sets WATCHDOG_PID and LISTEN_PID to the service's pid the same way.
fn serve_as_own_pid(dir: &TempDir, variable: &str) -> Command {
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(format!("{variable}=$$; export {variable}; exec \"$0\" \"$@\""))
        .arg(BIN)
        .arg("serve")
        .arg("--config")
        .arg(dir.path().join("inferd.toml"));
    command
}

/// Every datagram the server sent to the notify socket, with when it arrived.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<(Instant, String)>>>);

impl Received {
    fn listen(socket: UnixDatagram) -> Received {
        let received = Received::default();
        let sink = received.0.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            while let Ok(n) = socket.recv(&mut buf) {
                sink.lock().unwrap().push((Instant::now(), String::from_utf8_lossy(&buf[..n]).into_owned()));
            }
        });
        received
    }

    fn all(&self) -> Vec<(Instant, String)> {
        self.0.lock().unwrap().clone()
    }

    /// Index of the first message after `from` that has the line `line`.
    fn find(&self, from: usize, line: &str) -> Option<usize> {
        self.all().iter().skip(from).position(|(_, m)| m.lines().any(|l| l == line)).map(|i| i + from)
    }

    fn wait_for(&self, from: usize, line: &str, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.find(from, line) {
                return i;
            }
            assert!(Instant::now() < deadline, "no {line} within {timeout:?}; got {:#?}", self.lines());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn lines(&self) -> Vec<String> {
        self.all().into_iter().map(|(_, m)| m.replace('\n', " | ")).collect()
    }

    fn pings(&self) -> Vec<Instant> {
        self.all().into_iter().filter(|(_, m)| m.lines().any(|l| l == "WATCHDOG=1")).map(|(t, _)| t).collect()
    }
}

/// A notify socket in `dir` and a server configured to talk to it, with a watchdog of `usec`.
fn notified_server(tag: &str, watchdog: Duration, extra_env: &[(&str, &str)]) -> (Server, Received) {
    let dir = temp_dir(tag);
    let port = free_port();
    write_config(dir.path(), port, test_workers(), &test_models(), "slow", &[], "");
    let path = dir.path().join("notify.sock");
    let received = Received::listen(UnixDatagram::bind(&path).unwrap());
    let mut command = serve_as_own_pid(&dir, "WATCHDOG_PID");
    command.env("NOTIFY_SOCKET", &path).env("WATCHDOG_USEC", watchdog.as_micros().to_string());
    for (k, v) in extra_env {
        command.env(k, v);
    }
    (Server::spawn(command, dir, port, None), received)
}

#[test]
fn notify_ready_after_every_worker_reloading_around_a_reload_stopping_on_sigterm() {
    let watchdog = Duration::from_secs(6);
    let (mut server, received) = notified_server("notify", watchdog, &[]);
    let workers = test_workers();

    // READY=1, and at that moment every worker answers as ready.
    let ready = received.wait_for(0, "READY=1", Duration::from_secs(90));
    let status = server.status();
    let states: Vec<_> = status["workers"].as_array().unwrap().iter().map(|w| w["state"].clone()).collect();
    assert_eq!(states, vec![serde_json::json!("ready"); workers], "READY=1 sent before the pool was ready");
    let before: Vec<String> = received.all()[..ready].iter().map(|(_, m)| m.clone()).collect();
    assert!(
        before.iter().any(|m| m.contains("EXTEND_TIMEOUT_USEC=")),
        "no EXTEND_TIMEOUT_USEC while starting: {before:#?}"
    );
    let ready_message = &received.all()[ready].1;
    assert!(
        ready_message
            .lines()
            .any(|l| l.starts_with("STATUS=ready: ") && l.contains(&format!("{workers}/{workers} workers ready"))),
        "READY=1 comes with a one-line pool status: {ready_message:?}"
    );
    assert!(server.request("POST", "/v2/models/slow/infer", &slow_body(10)).status == 200);

    // A rolling reload: RELOADING=1 with the monotonic time, then READY=1 once it is done.
    let out = Command::new(BIN).args(["reload", "--wait", "--control-socket"]).arg(&server.socket).output().unwrap();
    assert!(out.status.success(), "reload failed: {}\n{}", String::from_utf8_lossy(&out.stderr), server.log());
    let reloading = received.wait_for(ready + 1, "RELOADING=1", Duration::from_secs(10));
    let message = received.all()[reloading].1.clone();
    let usec: u64 = message
        .lines()
        .find_map(|l| l.strip_prefix("MONOTONIC_USEC="))
        .unwrap_or_else(|| panic!("RELOADING=1 without MONOTONIC_USEC: {message:?}"))
        .parse()
        .unwrap();
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
    let now_usec = now.tv_sec() as u64 * 1_000_000 + now.tv_nsec() as u64 / 1000;
    assert!(
        usec <= now_usec && now_usec - usec < 120_000_000,
        "MONOTONIC_USEC {usec} is not CLOCK_MONOTONIC ({now_usec})"
    );
    let ready_again = received.wait_for(reloading + 1, "READY=1", Duration::from_secs(60));
    assert!(
        received.find(reloading + 1, "RELOADING=1").is_none_or(|i| i > ready_again),
        "one RELOADING=1 per reload: {:#?}",
        received.lines()
    );
    assert_eq!(server.status()["generation"], 2);

    // The watchdog is pinged all along, at least every half of WATCHDOG_USEC.
    let deadline = Instant::now() + Duration::from_secs(60);
    while received.pings().len() < 4 {
        assert!(Instant::now() < deadline, "fewer than 4 watchdog pings in 60 s: {:#?}", received.lines());
        std::thread::sleep(Duration::from_millis(100));
    }
    let pings = received.pings();
    let widest = pings.windows(2).map(|w| w[1] - w[0]).max().unwrap();
    assert!(widest <= watchdog / 2, "watchdog pings {widest:?} apart, more than half of {watchdog:?}");

    // SIGTERM: STOPPING=1 before it drains and exits.
    let mark = received.all().len();
    server.signal(Signal::SIGTERM);
    assert!(server.wait_exit(Duration::from_secs(60)).success());
    received.wait_for(mark, "STOPPING=1", Duration::from_secs(5));
    assert!(received.find(mark, "READY=1").is_none(), "READY=1 after SIGTERM: {:#?}", received.lines());
}

#[test]
fn watchdog_pings_stop_when_the_supervisor_loop_hangs() {
    let watchdog = Duration::from_secs(2);
    let (mut server, received) = notified_server("watchdog", watchdog, &[("INFERD_TEST_HANG_ON_SIGUSR2", "1")]);
    server.wait_ready(Duration::from_secs(90));
    // Pings come while the loop runs...
    let deadline = Instant::now() + Duration::from_secs(30);
    while received.pings().len() < 3 {
        assert!(Instant::now() < deadline, "fewer than 3 watchdog pings in 30 s: {:#?}", received.lines());
        std::thread::sleep(Duration::from_millis(100));
    }
    // ...and none once it hangs, although the process and its signal thread are alive.
    server.signal(Signal::SIGUSR2);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server.log().contains("the supervisor's loop hangs now") {
        assert!(Instant::now() < deadline, "the test switch did not hang the loop; log:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    // A ping sent just before the hang may still be on its way to the receiving thread.
    std::thread::sleep(Duration::from_millis(500));
    let hung = Instant::now();
    std::thread::sleep(watchdog * 2);
    let late: Vec<_> = received.pings().into_iter().filter(|t| *t > hung).collect();
    assert!(late.is_empty(), "{} watchdog pings after the loop hung", late.len());
    assert!(server.running(), "the supervisor exited instead of hanging");
    // The workers keep serving meanwhile; systemd (WatchdogSec=) would now restart the service.
    assert_eq!(server.request("POST", "/v2/models/slow/infer", &slow_body(10)).status, 200);
}

/// Starts `inferd serve` with `listener` as fd 3, as systemd does for a socket unit.
fn activated_server(dir: TempDir, listener: &std::net::TcpListener) -> Server {
    let mut command = serve_as_own_pid(&dir, "LISTEN_PID");
    command.env("LISTEN_FDS", "1");
    let fd = listener.as_raw_fd();
    // SAFETY: dup2 and fcntl are async-signal-safe. dup2 leaves the copy without FD_CLOEXEC
    // (so it survives exec), except when the socket is fd 3 already: then the flag is cleared.
    unsafe {
        command.pre_exec(move || {
            let ok = match fd {
                3 => nix::libc::fcntl(3, nix::libc::F_SETFD, 0) != -1,
                _ => nix::libc::dup2(fd, 3) != -1,
            };
            if ok {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let port = listener.local_addr().unwrap().port();
    Server::spawn(command, dir, port, None)
}

#[test]
fn socket_activation_serves_on_the_passed_socket_and_a_restart_refuses_no_connection() {
    // The test holds the socket as systemd does: it outlives every inferd started on it.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // server.listen names another port: nothing may bind it.
    let unused = free_port();
    let config = |tag: &str| {
        let dir = temp_dir(tag);
        write_config(dir.path(), unused, test_workers(), &test_models(), "slow", &[], "");
        dir
    };
    let mut server = activated_server(config("activated-1"), &listener);
    server.wait_ready(Duration::from_secs(90));
    assert_eq!(server.request("POST", "/v2/models/slow/infer", &slow_body(10)).status, 200);
    assert_eq!(server.status()["listen"], addr.to_string());
    assert!(server.log().contains("serving on the socket systemd passed"), "log:\n{}", server.log());
    let refused = std::net::TcpStream::connect(("127.0.0.1", unused)).map_err(|e| e.kind());
    assert_eq!(refused.err(), Some(ErrorKind::ConnectionRefused), "server.listen was bound too");

    // A client connecting over and over, one request per connection, while inferd stops and a
    // new one starts on the same socket: connections made in between wait in its queue.
    let client = Clients::start(1, |_| {
        move || {
            let step = post_step(addr, "/v2/models/slow/infer", &slow_body(10));
            std::thread::sleep(Duration::from_millis(10));
            step
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    server.signal(Signal::SIGTERM);
    assert!(server.wait_exit(Duration::from_secs(60)).success(), "log:\n{}", server.log());
    let mut second = activated_server(config("activated-2"), &listener);
    second.wait_ready(Duration::from_secs(90));
    std::thread::sleep(Duration::from_millis(500));
    client.stop().assert_served(5, "across the restart");
    let served = second.status()["requests_total"].as_u64().unwrap();
    assert!(served >= 1, "the new inferd answered none of them");
}
