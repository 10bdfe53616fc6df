//! An `inferd` command line run in its own process group, its output kept in memory: the
//! server of a test or of one `inferd tune` candidate. Dropping it kills the group (the
//! supervisor and every worker), so no test or tune run leaves a worker behind.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

pub struct Process {
    pub child: Child,
    /// Everything it wrote to stderr and stdout so far, a line at a time.
    log: Arc<Mutex<String>>,
}

impl Process {
    /// Starts `command` (stdin closed, output collected) as the leader of a new process group.
    pub fn spawn(command: &mut Command) -> std::io::Result<Process> {
        command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
        let mut child = command.spawn()?;
        let log = Arc::new(Mutex::new(String::new()));
        let streams = [
            child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>),
            child.stdout.take().map(|s| Box::new(s) as Box<dyn Read + Send>),
        ];
        for stream in streams.into_iter().flatten() {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    log.lock().unwrap().push_str(&(line + "\n"));
                }
            });
        }
        Ok(Process { child, log })
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The last `lines` lines of the log, joined by `separator`.
    pub fn log_tail(&self, lines: usize, separator: &str) -> String {
        let log = self.log();
        let last: Vec<&str> = log.lines().rev().take(lines).collect();
        last.into_iter().rev().collect::<Vec<_>>().join(separator)
    }

    /// Its exit status, if it has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits up to `timeout` for it to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exited() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends `signal` to the leader alone (the supervisor).
    pub fn signal(&self, signal: Signal) -> nix::Result<()> {
        kill(Pid::from_raw(self.pid()), signal)
    }

    /// SIGTERM to the group (a supervisor drains its workers), SIGKILL after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        let _ = killpg(Pid::from_raw(self.pid()), Signal::SIGTERM);
        if self.wait_exit(grace).is_none() {
            self.kill();
        }
    }

    fn kill(&mut self) {
        let _ = killpg(Pid::from_raw(self.pid()), Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        // The group may outlive the leader (a worker not yet reaped): always killed.
        self.kill();
    }
}
