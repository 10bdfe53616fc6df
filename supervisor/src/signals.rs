//! Signals become events. signal-hook's iterator runs on its own thread (its handler only
//! writes to a self-pipe); that thread only forwards each signal number to the loop.

use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGTTIN, SIGTTOU, SIGUSR2};
use tokio::sync::mpsc;

use crate::event::Event;

pub fn forward(events: mpsc::UnboundedSender<Event>) -> std::io::Result<()> {
    let mut signals =
        signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGQUIT, SIGHUP, SIGTTIN, SIGTTOU, SIGUSR2])?;
    std::thread::Builder::new().name("inferd-signals".into()).spawn(move || {
        for signal in signals.forever() {
            if events.send(Event::Signal(signal)).is_err() {
                break;
            }
        }
    })?;
    Ok(())
}
