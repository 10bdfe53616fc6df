//! An https:// collector: the CAs trusted and the exporter's own certificate, from [tracing]
//! or the standard variables, and the TLS connector hyper's client uses for OTLP/HTTP (tonic
//! does TLS itself for OTLP/gRPC).

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use inferd_config::file::TracingConfig;
use inferd_config::tls::{ClientTls, TlsError};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// A path from [tracing] `key`, else from the first of `variables` set.
fn path(key: &Option<PathBuf>, variables: [&str; 2]) -> Option<PathBuf> {
    key.clone()
        .or_else(|| variables.iter().find_map(|v| std::env::var_os(v).filter(|p| !p.is_empty()).map(PathBuf::from)))
}

/// Why the exporter has no TLS client for an https:// collector.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ClientError {
    #[error("a client certificate needs its key, and a key its certificate")]
    HalfAnIdentity,
    #[error(transparent)]
    Files(#[from] TlsError),
}

/// What the exporter trusts and presents to an https:// collector.
pub(crate) fn client(config: &TracingConfig) -> Result<ClientTls, ClientError> {
    let roots = path(&config.certificate, ["OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "OTEL_EXPORTER_OTLP_CERTIFICATE"]);
    let chain = path(
        &config.client_certificate,
        ["OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE", "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"],
    );
    let key = path(&config.client_key, ["OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "OTEL_EXPORTER_OTLP_CLIENT_KEY"]);
    let identity = match (&chain, &key) {
        (Some(chain), Some(key)) => Some((chain.as_path(), key.as_path())),
        (None, None) => None,
        _ => return Err(ClientError::HalfAnIdentity),
    };
    Ok(ClientTls::load(roots.as_deref(), identity)?)
}

/// hyper's connector to an https:// collector: TCP by hyper-util's connector, then TLS.
#[derive(Clone)]
pub(crate) struct Connector {
    tcp: HttpConnector,
    tls: TlsConnector,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Connector")
    }
}

impl Connector {
    pub(crate) fn new(tls: &ClientTls) -> Result<Connector, TlsError> {
        let mut tcp = HttpConnector::new();
        tcp.enforce_http(false);
        tcp.set_nodelay(true);
        Ok(Connector { tcp, tls: TlsConnector::from(tls.client_config()?) })
    }
}

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<Tls>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TokioIo<Tls>>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.tcp.poll_ready(cx).map_err(io::Error::other)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (mut tcp, tls) = (self.tcp.clone(), self.tls.clone());
        Box::pin(async move {
            if uri.scheme_str() != Some("https") {
                return Err(io::Error::other(format!("{uri}: the exporter's TLS client takes https:// only")));
            }
            let host = uri.host().unwrap_or_default().trim_start_matches('[').trim_end_matches(']').to_string();
            let name = rustls::pki_types::ServerName::try_from(host)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            let stream = tcp.call(uri).await.map_err(io::Error::other)?.into_inner();
            Ok(TokioIo::new(Tls(tls.connect(name, stream).await?)))
        })
    }
}

/// A TLS connection to the collector (hyper's client asks what its connection is).
pub(crate) struct Tls(TlsStream<TcpStream>);

impl Connection for Tls {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl AsyncRead for Tls {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Tls {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
