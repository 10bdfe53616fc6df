//! A turn that processes take one at a time: an exclusive `flock` on a lock file they share,
//! held for as long as the returned value lives. The kernel drops the lock with its holder, so
//! a process killed during its turn holds nobody up.
//!
//! Workers take turns to prepare a model's shared weights (one lock per artefact in
//! `runtime.cache_dir`) and, within models.memory_budget, to load models on demand (one lock
//! per pool, [`loads`]): two loads at once in two workers would add their transient peaks
//! past the pool's budget.

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

/// The turn at `path`, once every process ahead has let it go. The file is made if missing
/// (mode 0600, never through a link).
pub fn take(path: &Path) -> std::io::Result<Flock<File>> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, errno)| errno.into())
}

/// The pool's lock for loads within models.memory_budget, beside its control socket (the
/// supervisor removes it when the pool stops).
pub fn loads(control_socket: &Path) -> PathBuf {
    let mut path = control_socket.as_os_str().to_owned();
    path.push(".loads");
    PathBuf::from(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_turn_waits_for_the_first_to_end() {
        let dir = std::env::temp_dir().join(format!("inferd-turn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = loads(&dir.join("control.sock"));
        assert!(path.ends_with("control.sock.loads"));
        let first = take(&path).unwrap();
        let (sent, got) = std::sync::mpsc::channel();
        // A second open file description: flock excludes it as it would another process.
        let waiter = std::thread::spawn({
            let path = path.clone();
            move || {
                let turn = take(&path).unwrap();
                sent.send(()).unwrap();
                drop(turn);
            }
        });
        assert!(got.recv_timeout(std::time::Duration::from_millis(200)).is_err(), "took a turn held by another");
        drop(first);
        got.recv_timeout(std::time::Duration::from_secs(30)).expect("the turn once the first let it go");
        waiter.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
