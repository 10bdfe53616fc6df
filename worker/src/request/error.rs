//! The one error type of every request handler, whatever its protocol, and the only place an
//! error becomes a status code ([`ApiError::status`]; gRPC maps the same variants to its
//! codes in `http::grpc`).

use hyper::header::HeaderValue;
use hyper::{Method, StatusCode};

use inferd_config::auth::Refusal;
use inferd_ipc::shm::ShmError;
use inferd_ipc::triton::Refused;

use crate::request::link::AskError;
use crate::runtime::engine::EngineError;
use crate::runtime::model::ModelError;

/// The headers of an answer to a key with a rate (draft-ietf-httpapi-ratelimit-headers):
/// `RateLimit-Policy` (the burst, and the seconds it takes to come back whole) and `RateLimit`
/// (what is left of it, and the seconds until it is whole again); and Retry-After on a 429.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RateHeaders {
    pub policy: String,
    pub state: String,
    pub retry_after: Option<u64>,
}

impl RateHeaders {
    pub fn apply(&self, headers: &mut hyper::HeaderMap) {
        for (name, value) in [("ratelimit-policy", &self.policy), ("ratelimit", &self.state)] {
            match HeaderValue::from_str(value) {
                Ok(value) if !value.is_empty() => drop(headers.insert(name, value)),
                _ => {}
            }
        }
        if let Some(seconds) = self.retry_after {
            headers.insert(hyper::header::RETRY_AFTER, HeaderValue::from(seconds));
        }
    }
}

/// A body past `server.max_body_bytes`: announced so (`declared`, refused unread), or past it
/// as it arrived, or as it inflated (`inflated`).
#[derive(Debug, Clone, thiserror::Error)]
#[error("request body is {} than the limit of {limit} bytes (server.max_body_bytes)", if *.inflated { "inflates to more" } else { "larger" })]
pub struct OverLimit {
    pub declared: Option<u64>,
    pub inflated: bool,
    pub limit: u64,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    BadRequest(String),
    /// An input with nothing in it (an empty text): 400, TEI's `error_type: Empty`.
    #[error("{0}")]
    Empty(String),
    #[error("{0}")]
    TooLarge(String),
    /// A request body past `server.max_body_bytes` (413; KServe's infer route answers it as
    /// Triton does, `http::v2`).
    #[error(transparent)]
    BodyTooLarge(#[from] OverLimit),
    #[error("method {0} is not allowed on {1}")]
    MethodNotAllowed(Method, String),
    /// Backpressure: answered at once with 503 and Retry-After.
    #[error("{0}")]
    Overloaded(String),
    #[error("{0}")]
    Timeout(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("{0}")]
    Internal(String),
    /// Not allowed here, whoever asks (an operator's switch is off): 403.
    #[error("{0}")]
    Forbidden(String),
    /// Model control is off on this port: 403, and gRPC's UNAVAILABLE, Triton's code for it.
    #[error("{0}")]
    ModelControlOff(String),
    /// A restricted API category without its header ([[auth.restricted]]): 403, in Triton's
    /// words (gRPC's are its own, `http::grpc::status`).
    #[error("This API is restricted, expecting header '{header}'")]
    Restricted { header: String },
    /// No API key, or not one of the server's ([auth]).
    #[error("{}", match .0 {
        Refusal::Missing => "this server needs an API key: send it as `Authorization: Bearer KEY`",
        Refusal::Invalid => "the API key is not valid",
    })]
    Unauthorized(Refusal),
    /// Over its API key's rate or concurrency: 429, with Retry-After and `RateLimit` headers.
    #[error("{0}")]
    TooManyRequests(String, RateHeaders),
}

impl ApiError {
    /// The only place an error becomes a status code.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::BadRequest(_) | ApiError::Empty(_) => StatusCode::BAD_REQUEST,
            ApiError::TooLarge(_) | ApiError::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::MethodNotAllowed(..) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::DeadlineExceeded(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Forbidden(_) | ApiError::ModelControlOff(_) | ApiError::Restricted { .. } => {
                StatusCode::FORBIDDEN
            }
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::TooManyRequests(..) => StatusCode::TOO_MANY_REQUESTS,
        }
    }
}

impl From<AskError> for ApiError {
    fn from(e: AskError) -> Self {
        match e {
            AskError::Refused(Refused::ModelControlOff) => ApiError::ModelControlOff(e.to_string()),
            AskError::Refused(Refused::NotDone { before_change: true, .. }) => ApiError::BadRequest(e.to_string()),
            AskError::Refused(Refused::NotDone { before_change: false, .. }) => ApiError::Internal(e.to_string()),
            AskError::Refused(Refused::UnknownModel { .. } | Refused::UnknownVersion { .. }) => {
                ApiError::NotFound(e.to_string())
            }
            AskError::Timeout(_) | AskError::Unreachable(_) => ApiError::Overloaded(e.to_string()),
            AskError::Mismatched(_) => ApiError::Internal(e.to_string()),
        }
    }
}

impl From<ShmError> for ApiError {
    fn from(e: ShmError) -> Self {
        match e {
            ShmError::NotFound(_) => ApiError::NotFound(e.to_string()),
            ShmError::AlreadyExists(_) | ShmError::Invalid(_) => ApiError::BadRequest(e.to_string()),
            ShmError::Failed(_) => ApiError::Internal(e.to_string()),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Model(ModelError::InvalidInput { .. }) => ApiError::BadRequest(e.to_string()),
            EngineError::Overloaded { .. } | EngineError::ModelQueueFull { .. } | EngineError::Unloaded => {
                ApiError::Overloaded(e.to_string())
            }
            EngineError::DeadlineExceeded { .. } | EngineError::Stopped { .. } => {
                ApiError::DeadlineExceeded(e.to_string())
            }
            EngineError::Model(_) | EngineError::Gone | EngineError::Bug => ApiError::Internal(e.to_string()),
        }
    }
}
