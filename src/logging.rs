//! Where and how every inferd process logs: text or JSON lines on stderr, or the journal's
//! native protocol under systemd, so that `journalctl -u inferd INFERD_WORKER=1` and
//! `journalctl -p warning` work. `INFERD_LOG` filters (default `info,ort=warn`).
//!
//! The supervisor decides the format (config `log.format`, or INFERD_LOG_FORMAT) and hands it
//! to its workers in INFERD_LOG_FORMAT, with their slot in INFERD_WORKER.

use std::os::fd::AsFd;

use inferd_config::file::LogFormat;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// The format asked for in the environment, if any.
pub fn from_env() -> Option<LogFormat> {
    std::env::var("INFERD_LOG_FORMAT").ok().and_then(|v| LogFormat::parse(v.trim()))
}

/// Starts logging in `format` and returns the format in use (`auto` resolved; `journal`
/// falls back to text when the journal cannot be reached).
pub fn init(format: LogFormat) -> LogFormat {
    let filter = || EnvFilter::try_from_env("INFERD_LOG").unwrap_or_else(|_| EnvFilter::new("info,ort=warn"));
    let format = match format {
        LogFormat::Auto if stderr_is_journal() => LogFormat::Journal,
        LogFormat::Auto => LogFormat::Text,
        other => other,
    };
    let text = || {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_target(false)
    };
    match format {
        LogFormat::Json => {
            let json = tracing_subscriber::fmt::layer()
                .json()
                .flatten_event(true)
                .with_current_span(true)
                .with_span_list(false)
                .with_writer(std::io::stderr);
            tracing_subscriber::registry().with(filter()).with(json).init();
        }
        LogFormat::Journal => match tracing_journald::layer() {
            Ok(journal) => {
                // Event fields become INFERD_<NAME> (INFERD_MODEL, INFERD_REQUEST_ID, ...); a
                // worker's lines read `inferd-worker-N[pid]: ...` in journalctl's default view.
                let worker = std::env::var("INFERD_WORKER").ok();
                let identifier = worker.as_ref().map_or("inferd".to_string(), |w| format!("inferd-worker-{w}"));
                let journal = journal
                    .with_field_prefix(Some("INFERD".into()))
                    .with_syslog_identifier(identifier)
                    .with_custom_fields(worker.map(|w| ("INFERD_WORKER", w)));
                tracing_subscriber::registry().with(filter()).with(journal).init();
            }
            Err(e) => {
                tracing_subscriber::registry().with(filter()).with(text()).init();
                tracing::warn!("log.format = journal, but the journal cannot be reached ({e}); logging text to stderr");
                return LogFormat::Text;
            }
        },
        LogFormat::Text | LogFormat::Auto => tracing_subscriber::registry().with(filter()).with(text()).init(),
    }
    format
}

/// systemd connects a service's stderr to the journal and names that stream in JOURNAL_STREAM
/// (`device:inode`); the journal's own protocol then keeps priorities and fields.
fn stderr_is_journal() -> bool {
    let Some(stream) = std::env::var("JOURNAL_STREAM").ok() else { return false };
    let Ok(stat) = nix::sys::stat::fstat(std::io::stderr().as_fd()) else { return false };
    stream == format!("{}:{}", stat.st_dev, stat.st_ino)
}
