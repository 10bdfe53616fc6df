//! The shipped units under a real systemd: scripts/systemd-e2e.sh boots Debian's systemd 252
//! in a systemd-nspawn container (rootfs built once into .cache/), installs this build as
//! docs/systemd.md says, and checks start (returns once every worker is ready), reload under
//! load (zero failed requests), the watchdog restarting a hung supervisor, stop (drains), the
//! journal, socket activation across a restart (zero refused connections), and `inferd upgrade`
//! under load (MainPID the new supervisor, the watchdog quiet, stop clean after and during one).
//! Needs root; a host that cannot run the container (exit 77) is reported as a skip.

use std::process::Command;

#[test]
fn the_units_under_a_real_systemd() {
    let out = Command::new(crate::common::repo().join("scripts/systemd-e2e.sh"))
        .env("INFERD_BIN", env!("CARGO_BIN_EXE_inferd"))
        .output()
        .expect("run scripts/systemd-e2e.sh");
    let said = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => println!("{said}"),
        Some(77) => {
            eprintln!("SKIPPED the_units_under_a_real_systemd: this host cannot run a systemd container\n{said}")
        }
        other => panic!("scripts/systemd-e2e.sh exited {other:?}:\n{said}"),
    }
}
