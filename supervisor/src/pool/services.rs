//! The supervisor's own listeners: the control socket and the admin listener.

use std::os::fd::{AsRawFd, OwnedFd};

use tokio::sync::mpsc;
use tracing::info;

use super::error::SupervisorError;
use super::sockets::dup_high;
use super::upgrade::Inherited;
use crate::event::Event;
use crate::plan::Resolved;
use crate::{admin, control_server};

/// The supervisor's own listeners: the control socket and the admin listener. Served from
/// start, or (a new supervisor started by an upgrade) once the old one hands over; their
/// descriptors are kept to hand to the next upgrade.
pub(super) struct Services {
    pub(super) control: Option<OwnedFd>,
    pub(super) admin: Option<OwnedFd>,
    /// Not served yet.
    pending: Option<(tokio::net::UnixListener, Option<(tokio::net::TcpListener, admin::Admin)>)>,
    /// The tasks that serve them.
    serving: Vec<tokio::task::JoinHandle<()>>,
}

impl Services {
    /// Binds the control socket and the admin listener, or takes the inherited ones.
    pub(super) async fn open(
        resolved: &Resolved,
        inherited: Option<&mut Inherited>,
    ) -> Result<Services, SupervisorError> {
        let config = &resolved.config;
        let (control, admin) = match inherited {
            Some(from) => {
                let control = std::os::unix::net::UnixListener::from(from.control.try_clone()?);
                control.set_nonblocking(true)?;
                (tokio::net::UnixListener::from_std(control)?, from.admin.take())
            }
            None => {
                let control = control_server::bind(&config.control_socket())?;
                // A fresh pool holds no shared-memory region (an upgrade's keeps its own).
                let registry = config.shared_memory_registry();
                inferd_ipc::shm::Registry::new(registry.clone())
                    .reset()
                    .map_err(|e| std::io::Error::new(e.kind(), format!("cannot create {}: {e}", registry.display())))?;
                (control, None)
            }
        };
        let admin_addr = &config.admin.listen;
        let admin = match (admin, admin_addr.is_empty()) {
            (_, true) => None,
            (Some(fd), false) => {
                let listener = std::net::TcpListener::from(fd);
                listener.set_nonblocking(true)?;
                Some(tokio::net::TcpListener::from_std(listener)?)
            }
            (None, false) => Some(tokio::net::TcpListener::bind(admin_addr).await.map_err(|e| {
                std::io::Error::new(e.kind(), format!("cannot listen on admin.listen {admin_addr}: {e}"))
            })?),
        };
        let admin = match admin {
            None => None,
            Some(listener) => {
                let scheme = if config.admin.tls_cert.is_some() { "https" } else { "http" };
                info!("metrics on {scheme}://{admin_addr}/metrics");
                // Refused at start, not at the first request, when it cannot be used.
                config.admin_tokens().map_err(|e| std::io::Error::other(e.to_string()))?;
                let tls = admin::AdminTls::load(config.admin_tls()).map_err(std::io::Error::other)?;
                let routes = admin::Admin {
                    repository: config.model_repository(),
                    model_control: config.admin.model_control,
                    token_file: config.admin.token_file.as_ref().map(|f| config.resolve(f)),
                    protect_metrics: config.admin.protect_metrics,
                    loopback: listener.local_addr().is_ok_and(|a| a.ip().is_loopback()),
                    allowed: config.allowed_model_paths(),
                    tls,
                };
                Some((listener, routes))
            }
        };
        Ok(Services {
            control: Some(dup_high(control.as_raw_fd())?),
            admin: admin.as_ref().map(|(l, _)| dup_high(l.as_raw_fd())).transpose()?,
            pending: Some((control, admin)),
            serving: Vec::new(),
        })
    }

    /// Serves the control socket and the admin listener.
    pub(super) fn start(&mut self, events: &mpsc::UnboundedSender<Event>) {
        if let Some((control, admin)) = self.pending.take() {
            self.serving.push(tokio::spawn(control_server::serve(control, events.clone())));
            if let Some((listener, routes)) = admin {
                self.serving.push(tokio::spawn(admin::serve(listener, events.clone(), routes)));
            }
        }
    }

    /// Stops serving them (handed over to a new supervisor, which serves them now).
    pub(super) fn stop(&mut self) {
        for task in self.serving.drain(..) {
            task.abort();
        }
        self.pending = None;
        self.control = None;
        self.admin = None;
    }
}
