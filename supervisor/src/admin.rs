//! The supervisor's HTTP listener (`admin.listen`; loopback by default): Prometheus metrics
//! and Triton's statistics and model repository extensions.
//!
//! - `GET /metrics`: the Prometheus text ([`crate::metrics`]);
//! - `GET /v2/models/stats`, `/v2/models/{name}[/versions/{v}]/stats`: Triton's statistics
//!   (tritonclient's `get_inference_statistics`) from the pool's shared counters;
//! - `POST /v2/repository/index`: every model folder of the repository, READY when the pool
//!   serves it;
//! - `POST /v2/repository/models/{name}/load` and `.../unload`: a rolling reload that adds,
//!   reads again or removes the model (see `pool/reload.rs`), answered once every worker runs
//!   the new list. Only with `admin.model_control = true`: these change what the public port
//!   serves, so they stay off the public port altogether (whose clients are not the operator)
//!   and need the operator's opt-in on this one, as Triton's `--model-control-mode=explicit`.
//!
//! Who may: with `admin.token_file`, every route but `/metrics` (and it too with
//! `admin.protect_metrics`) needs `Authorization: Bearer TOKEN` (the file is read at each such
//! request, so a new token counts at once). Without a token, a loopback listener serves
//! everything but load and unload (model control needs a token), and a listener on any other
//! address serves `/metrics` alone. `load`'s `parameters.path` must lie, symlinks resolved,
//! inside `models.repository` or `admin.allowed_paths`, and so must every file the model's
//! settings name.
//!
//! With `admin.tls_cert`/`tls_key` (and `tls_client_ca` for client certificates) the listener
//! speaks TLS only. Its files are checked at start and looked at again at each connection: a
//! changed certificate counts from the next connection on, without a reload (as the token), and
//! one that cannot be used is logged while the previous one stays in use.

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use inferd_ipc::triton::{load_parameters, not_done, BadParameters};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_util::either::Either;
use tracing::{debug, info, warn};

use crate::confine::{confined, PathFrom, Unconfined};
use crate::event::Event;
use crate::metrics::{self, PoolMetrics};
use crate::{control, control_server, triton};

/// What the admin routes need besides the loop.
pub struct Admin {
    /// models.repository: the folders `repository/index` lists and `load` reads.
    pub repository: PathBuf,
    /// admin.model_control: `load` and `unload` are allowed.
    pub model_control: bool,
    /// admin.token_file, resolved.
    pub token_file: Option<PathBuf>,
    /// admin.protect_metrics.
    pub protect_metrics: bool,
    /// Whether the listener's address is a loopback one.
    pub loopback: bool,
    /// Where `load`'s `parameters.path` may point: the repository and admin.allowed_paths.
    pub allowed: Vec<PathBuf>,
    /// admin.tls_cert and its key: TLS on this listener.
    pub tls: Option<AdminTls>,
}

/// The admin listener's certificate, read again when its files change.
pub struct AdminTls {
    paths: inferd_config::tls::TlsPaths,
    current: Mutex<(Vec<Option<FileStamp>>, tokio_rustls::TlsAcceptor)>,
}

/// What tells that a file changed: its inode, size and modification time.
type FileStamp = (u64, u64, i64, i64);

/// Why the admin listener's certificate cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// Its files: missing, unreadable, not PEM.
    #[error(transparent)]
    Files(#[from] inferd_config::ConfigError),
    /// rustls refused what they hold.
    #[error(transparent)]
    Refused(#[from] inferd_config::tls::TlsError),
}

impl AdminTls {
    /// Reads the files now; None without admin.tls_cert.
    pub fn load(paths: inferd_config::tls::TlsPaths) -> Result<Option<AdminTls>, TlsError> {
        let stamps = stamps(&paths);
        let Some(acceptor) = acceptor(&paths)? else { return Ok(None) };
        Ok(Some(AdminTls { paths, current: Mutex::new((stamps, acceptor)) }))
    }

    /// The acceptor to use for a new connection: the files read again if they changed.
    fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let now = stamps(&self.paths);
        if now != current.0 {
            match acceptor(&self.paths) {
                Ok(Some(acceptor)) => {
                    info!("admin listener: certificate files changed; new connections use them");
                    *current = (now, acceptor);
                }
                Ok(None) => {}
                Err(e) => {
                    warn!("admin listener: keeping the previous certificate: {e}");
                    current.0 = now;
                }
            }
        }
        current.1.clone()
    }
}

fn acceptor(paths: &inferd_config::tls::TlsPaths) -> Result<Option<tokio_rustls::TlsAcceptor>, TlsError> {
    let Some(tls) = paths.load("admin")? else { return Ok(None) };
    let config = tls.server_config(&[inferd_config::tls::ALPN_HTTP1])?;
    Ok(Some(config.into()))
}

fn stamps(paths: &inferd_config::tls::TlsPaths) -> Vec<Option<FileStamp>> {
    use std::os::unix::fs::MetadataExt;
    [&paths.cert, &paths.key, &paths.client_ca]
        .into_iter()
        .flatten()
        .map(|p| std::fs::metadata(p).ok().map(|m| (m.ino(), m.size(), m.mtime(), m.mtime_nsec())))
        .collect()
}

impl Admin {
    /// Whether `request` may use a route (`metrics`: the `/metrics` route).
    // The refusal is the reply itself, sent as it is: boxing it (as clippy's result_large_err
    // asks of a hyper `Response`) would only add an allocation.
    #[allow(clippy::result_large_err)]
    fn authorize(&self, request: &Request<Incoming>, metrics: bool) -> Result<(), Reply> {
        let Some(file) = &self.token_file else {
            return match metrics || self.loopback {
                true => Ok(()),
                false => Err(error(
                    StatusCode::UNAUTHORIZED,
                    "this admin listener is not on a loopback address and has no admin.token_file: it serves /metrics alone"
                        .into(),
                )),
            };
        };
        if metrics && !self.protect_metrics {
            return Ok(());
        }
        let tokens = inferd_config::auth::ApiKeys::from_file(file, false).map_err(|e| {
            warn!("admin.token_file: {e}");
            error(StatusCode::INTERNAL_SERVER_ERROR, format!("admin.token_file cannot be used: {e}"))
        })?;
        let presented = request.headers().get(hyper::header::AUTHORIZATION).map(|v| v.as_bytes());
        tokens.check(presented.and_then(inferd_config::auth::bearer)).map_err(|refusal| {
            let message = match refusal {
                inferd_config::auth::Refusal::Missing => {
                    "this route needs the admin token: Authorization: Bearer TOKEN"
                }
                inferd_config::auth::Refusal::Invalid => "the admin token is not valid",
            };
            let mut reply = error(StatusCode::UNAUTHORIZED, message.into());
            reply.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            reply
        })?;
        Ok(())
    }
}

type Reply = Response<Full<Bytes>>;

/// Connections the admin listener serves at once (scrapers, dashboards, an operator); more
/// wait in the kernel's queue.
const MAX_CONNECTIONS: usize = 128;
/// A connection's request head must arrive within this, and the whole connection (a scrape, a
/// repository call, however many requests it carries) ends after `CONNECTION_LIFETIME`.
const HEADER_TIMEOUT: Duration = Duration::from_secs(3);
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

pub async fn serve(listener: TcpListener, events: mpsc::UnboundedSender<Event>, admin: Admin) {
    let admin = Arc::new(admin);
    // It runs on the supervisor's only thread: bounded in connections and time.
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let permit = slots.clone().acquire_owned().await.expect("never closed");
        let (stream, peer) = control_server::accept_patiently("admin listener", || listener.accept()).await;
        let (events, admin) = (events.clone(), admin.clone());
        tokio::spawn(async move {
            let stream = match admin.tls.as_ref().map(AdminTls::acceptor) {
                None => Either::Left(stream),
                Some(tls) => match tokio::time::timeout(HEADER_TIMEOUT, tls.accept(stream)).await {
                    Ok(Ok(stream)) => Either::Right(stream),
                    Ok(Err(e)) => return debug!("admin listener: TLS handshake with {peer} failed: {e}"),
                    Err(_) => {
                        return debug!("admin listener: TLS handshake with {peer} not done within {HEADER_TIMEOUT:?}")
                    }
                },
            };
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let (events, admin) = (events.clone(), admin.clone());
                async move { Ok::<_, Infallible>(route(request, &events, &admin).await) }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(HEADER_TIMEOUT).max_buf_size(16 * 1024);
            match tokio::time::timeout(CONNECTION_LIFETIME, http.serve_connection(io, service)).await {
                Ok(Err(e)) => warn!("admin connection: {e}"),
                Err(_) => warn!("admin connection closed after {CONNECTION_LIFETIME:?}"),
                Ok(Ok(())) => {}
            }
            drop(permit);
        });
    }
}

async fn route(request: Request<Incoming>, events: &mpsc::UnboundedSender<Event>, admin: &Admin) -> Reply {
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let get = method == Method::GET || method == Method::HEAD;
    if let Err(refused) = admin.authorize(&request, segments == ["metrics"]) {
        return refused;
    }
    match (get, method == Method::POST, segments.as_slice()) {
        (true, _, ["metrics"]) => match snapshot(events).await {
            Some(m) => text_reply(StatusCode::OK, metrics::render(&m)),
            None => stopping(),
        },
        (true, _, ["v2", "models", "stats"]) => statistics(events, None, None).await,
        (true, _, ["v2", "models", name, "stats"]) => statistics(events, Some(name), None).await,
        (true, _, ["v2", "models", name, "versions", v, "stats"]) => statistics(events, Some(name), Some(v)).await,
        (_, true, ["v2", "repository", "index"]) => match read_json(request).await {
            Ok(body) => index(events, admin, body.get("ready").and_then(Value::as_bool).unwrap_or(false)).await,
            Err(e) => e,
        },
        (_, true, ["v2", "repository", "models", name, action @ ("load" | "unload")]) => {
            let name = name.to_string();
            let load = *action == "load";
            if !admin.model_control {
                return error(
                    StatusCode::FORBIDDEN,
                    format!("model control is off: set admin.model_control = true to {action} models here"),
                );
            }
            let body = match read_json(request).await {
                Ok(body) => body,
                Err(e) => return e,
            };
            let request = match load_request(name.clone(), load, &body, admin) {
                Ok(r) => r,
                Err(bad) => return error(StatusCode::BAD_REQUEST, not_done(&name, load, bad)),
            };
            match control_request(events, request).await {
                Ok(reply) => reply,
                Err((status, why)) => error(status, not_done(&name, load, why)),
            }
        }
        (false, false, _) => error(StatusCode::METHOD_NOT_ALLOWED, format!("method {method} is not allowed on {path}")),
        _ => error(
            StatusCode::NOT_FOUND,
            format!("no route for {method} {path} (try /metrics, /v2/models/stats, /v2/repository/index)"),
        ),
    }
}

/// The pool's counters and models, from the loop.
async fn snapshot(events: &mpsc::UnboundedSender<Event>) -> Option<PoolMetrics> {
    let (tx, rx) = oneshot::channel();
    events.send(Event::Scrape(tx)).ok()?;
    rx.await.ok()
}

/// Why a `load` or `unload` body asks for nothing inferd can do (400).
#[derive(Debug, thiserror::Error)]
enum BadLoad {
    #[error(transparent)]
    Parameters(#[from] BadParameters),
    #[error(transparent)]
    Unconfined(#[from] Unconfined),
}

/// The control request a `load` or `unload` body asks for ([`load_parameters`]), its path
/// confined to the repository and admin.allowed_paths.
fn load_request(model: String, load: bool, body: &Value, admin: &Admin) -> Result<control::Request, BadLoad> {
    let asked = load_parameters(body.get("parameters"), load)?;
    if !load {
        return Ok(control::Request::Unload { model });
    }
    let path = asked.path.map(|p| confined(&p, &model, &admin.allowed, PathFrom::AdminLoad)).transpose()?;
    Ok(control::Request::Load { model, path, config: asked.config })
}

/// Sends a control request to the loop and answers with its final response; a refusal or
/// failure as its status and reason.
async fn control_request(
    events: &mpsc::UnboundedSender<Event>,
    request: control::Request,
) -> Result<Reply, (StatusCode, String)> {
    let (replies, mut answers) = mpsc::unbounded_channel();
    if events.send(Event::Control(request, replies)).is_err() {
        return Ok(stopping());
    }
    let mut last = None;
    while let Some(answer) = answers.recv().await {
        if answer.progress.is_none() {
            last = Some(answer);
            break;
        }
    }
    match last {
        Some(control::Response { ok: true, message, .. }) => {
            let message = message.unwrap_or_default();
            info!("admin: {message}");
            Ok(json_reply(StatusCode::OK, &json!({ "message": message })))
        }
        // Refused before anything changed (unknown model, a reload in progress, ...), or the
        // new workers failed and the pool keeps what it served.
        Some(control::Response { error: Some(error), refused, .. }) => {
            let status = if refused { StatusCode::BAD_REQUEST } else { StatusCode::INTERNAL_SERVER_ERROR };
            Err((status, error))
        }
        _ => Ok(stopping()),
    }
}

/// Triton's repository index ([`triton::index`]).
async fn index(events: &mpsc::UnboundedSender<Event>, admin: &Admin, ready_only: bool) -> Reply {
    let Some(m) = snapshot(events).await else { return stopping() };
    json_reply(StatusCode::OK, &json!(triton::index(&m, &admin.repository, ready_only)))
}

/// Triton's statistics of one model (or every model) and version ([`triton::statistics`]).
async fn statistics(events: &mpsc::UnboundedSender<Event>, name: Option<&str>, version: Option<&str>) -> Reply {
    let Some(m) = snapshot(events).await else { return stopping() };
    match triton::statistics(&m, name, version) {
        Ok(stats) => json_reply(StatusCode::OK, &json!({ "model_stats": stats })),
        Err(refused) => error(StatusCode::NOT_FOUND, refused.to_string()),
    }
}

/// A small JSON body (an empty one is `{}`).
async fn read_json(request: Request<Incoming>) -> Result<Value, Reply> {
    let bytes = Limited::new(request.into_body(), 64 * 1024)
        .collect()
        .await
        .map_err(|e| error(StatusCode::BAD_REQUEST, format!("could not read the request body (at most 64 KiB): {e}")))?
        .to_bytes();
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(error(StatusCode::BAD_REQUEST, "the request body must be a JSON object".into())),
        Err(e) => Err(error(StatusCode::BAD_REQUEST, format!("the request body is not JSON: {e}"))),
    }
}

fn json_reply(status: StatusCode, body: &Value) -> Reply {
    let mut response = Response::new(Full::new(Bytes::from(serde_json::to_vec(body).expect("json"))));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn text_reply(status: StatusCode, body: String) -> Reply {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    response
}

/// Triton's error shape.
fn error(status: StatusCode, message: String) -> Reply {
    json_reply(status, &json!({ "error": message }))
}

fn stopping() -> Reply {
    error(StatusCode::SERVICE_UNAVAILABLE, "the supervisor is stopping".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use inferd_config::model::ModelOverride;

    fn routes(allowed: Vec<PathBuf>) -> Admin {
        Admin {
            repository: allowed[0].clone(),
            model_control: true,
            token_file: None,
            protect_metrics: false,
            loopback: true,
            allowed,
            tls: None,
        }
    }

    /// `root/name` with a model.toml (`extra` appended) and a model file.
    fn model_dir(root: &std::path::Path, name: &str, extra: &str) -> PathBuf {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("model.toml"), format!("name = \"m\"\n{extra}")).unwrap();
        std::fs::write(dir.join("model.onnx"), b"x").unwrap();
        dir
    }

    #[test]
    fn load_bodies_become_control_requests_or_name_the_problem() {
        let root = std::env::temp_dir().join(format!("inferd-admin-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (repo, outside) = (root.join("repo"), root.join("outside"));
        let inside = model_dir(&repo, "m", "");
        let admin = routes(vec![repo.clone()]);
        let r = load_request("m".into(), true, &json!({}), &admin).unwrap();
        assert!(matches!(r, control::Request::Load { ref model, path: None, config: None } if model == "m"));
        // A Triton configuration's settings travel with the load; what inferd does not apply is named.
        let body = json!({"parameters": {"config": "{\"max_batch_size\": \"16\"}"}});
        let r = load_request("m".into(), true, &body, &admin).unwrap();
        let sixteen = ModelOverride { max_batch_size: Some(16), ..Default::default() };
        assert!(matches!(r, control::Request::Load { config: Some(c), .. } if c == sixteen));
        let body = json!({"parameters": {"path": inside.to_str().unwrap()}});
        let r = load_request("m".into(), true, &body, &admin).unwrap();
        let real = std::fs::canonicalize(&inside).unwrap();
        assert!(matches!(r, control::Request::Load { path: Some(ref p), .. } if p == &real));
        let r = load_request("m".into(), false, &json!({"parameters": {"unload_dependents": true}}), &admin).unwrap();
        assert!(matches!(r, control::Request::Unload { ref model } if model == "m"));

        // Out of the repository: directly, through a link, or by a file the settings name.
        let away = model_dir(&outside, "m", "");
        std::os::unix::fs::symlink(&away, repo.join("link")).unwrap();
        std::fs::write(outside.join("tokenizer.json"), "{}").unwrap();
        let named =
            model_dir(&repo, "named", "task = \"embedding\"\n[tokenizer]\nfile = \"../../outside/tokenizer.json\"\n");
        // A model.toml that is a FIFO would block the reader: refused as not a regular file.
        let fifo = repo.join("fifo");
        std::fs::create_dir_all(&fifo).unwrap();
        nix::unistd::mkfifo(&fifo.join("model.toml"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let path = |p: &std::path::Path| json!({"parameters": {"path": p.to_str().unwrap()}});
        for (body, words) in [
            (path(&away), "is not inside the model repository"),
            (path(&repo.join("link")), "is not inside the model repository"),
            (path(&named), "names"),
            (path(&fifo), "is not a regular file"),
            (json!({"parameters": {"config": "{\"instance_group\": []}"}}), "not 'instance_group'"),
            (json!({"parameters": {"file:1/model.onnx": "AAAA"}}), "'file:1/model.onnx'"),
            (json!({"parameters": {"path": 3}}), "parameters.path must be a string"),
            (json!({"parameters": []}), "'parameters' must be an object"),
        ] {
            let err = load_request("m".into(), true, &body, &admin).unwrap_err().to_string();
            assert!(err.contains(words), "{words}: {err}");
        }
        // admin.allowed_paths lets an operator name another folder.
        let wider = routes(vec![repo.clone(), outside.clone()]);
        assert!(load_request("m".into(), true, &path(&away), &wider).is_ok());
        let _ = std::fs::remove_dir_all(&root);
    }
}
