//! Request bodies: received whole within the worker's limits ([`receive`]), and JSON bodies read
//! into a route's request type, with errors in the client's terms:
//! the field (its path in the body), what it must be, and what came. Never a Rust type's
//! name: serde says `expected usize` or `data did not match any variant of untagged enum
//! OneOrMany`, which tells a client nothing.
//!
//! A field that takes several shapes (a text or a list of texts, ...) is a [`Shape`], read
//! through a `serde_json::Value` (bounded by the body, which is bounded before it is read) and
//! matched against each shape, instead of serde's `untagged`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::CONTENT_LENGTH;
use hyper::Request;
use opentelemetry::KeyValue;
use serde::de::{Deserialize, DeserializeOwned, Error as _};
use serde_json::Value;

use crate::http::encoding::{DecodeError, Encoding};
use crate::request::app::AppState;
use crate::request::error::ApiError;

/// Set once a request's body has been read whole: a request whose body was left unread is
/// answered with `Connection: close` (see `http::handle`).
#[derive(Clone, Default)]
pub struct Read(pub Arc<AtomicBool>);

impl Read {
    pub fn done(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// A request's whole body, refusing more than `server.max_body_bytes` (early when
/// Content-Length says so), inflated when it came compressed; and its share of the worker's
/// body-bytes budget, held until the request is done.
pub struct Body {
    pub bytes: Bytes,
    _budget: tokio::sync::OwnedSemaphorePermit,
}

impl std::ops::Deref for Body {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

/// `request`'s body ([`Body`]).
pub async fn receive(state: &AppState, request: Request<Incoming>) -> Result<Body, ApiError> {
    let limit = state.max_body_bytes;
    let too_large = || {
        ApiError::TooLarge(format!("request body is larger than the limit of {limit} bytes (server.max_body_bytes)"))
    };
    let declared = request.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Err(too_large());
    }
    let content_encoding = request.headers().get(hyper::header::CONTENT_ENCODING).map(|v| v.to_str().unwrap_or("?"));
    let encoding = Encoding::from_header(content_encoding).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    // Bodies being read or held by this worker may not add up past its budget: many large
    // requests at once get a fast 503 instead of exhausting memory. A compressed body is
    // charged for what it may inflate to: the limit.
    let size = if encoding == Encoding::Identity { declared.unwrap_or(limit) } else { limit };
    let claim = size.max(1).min(u32::MAX as u64) as u32;
    let budget = state.body_budget.clone().try_acquire_many_owned(claim).map_err(|_| {
        ApiError::Overloaded(format!(
            "too many request bytes in flight on this worker (server.max_body_bytes_in_flight = {}); retry shortly",
            state.body_budget_total
        ))
    })?;
    let read = request.extensions().get::<Read>().cloned();
    let mut stage = crate::trace::Stage::start("read body");
    let collect = Limited::new(request.into_body(), limit as usize).collect();
    let timeout = state.body_timeout;
    let bytes = tokio::time::timeout(timeout, collect)
        .await
        .map_err(|_| {
            ApiError::Timeout(format!("the request body did not arrive within {timeout:?} (server.body_timeout_secs)"))
        })?
        .map_err(|e| {
            if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                too_large()
            } else {
                ApiError::BadRequest(format!("could not read the request body: {e}"))
            }
        })?
        .to_bytes();
    if let Some(read) = read {
        read.0.store(true, Ordering::Relaxed);
    }
    stage.set(KeyValue::new("http.request.body.size", bytes.len() as i64));
    let bytes = match encoding {
        Encoding::Identity => bytes,
        // Inflating megabytes takes milliseconds: off the I/O thread.
        _ => tokio::task::spawn_blocking(move || encoding.decode(&bytes, limit))
            .await
            .map_err(|e| ApiError::Internal(format!("inflating the request body: {e}")))?
            .map(Bytes::from)
            .map_err(|e| match e {
                DecodeError::TooLarge(_) => ApiError::TooLarge(e.to_string()),
                _ => ApiError::BadRequest(e.to_string()),
            })?,
    };
    Ok(Body { bytes, _budget: budget })
}

/// Reads `body` as a `T`. The error starts with the field's path when there is one:
/// "`inputs`: must be a string or a list of strings, got the number 5 at line 1 column 13".
pub fn json<T: DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    let mut reader = serde_json::Deserializer::from_slice(body);
    let value: T = serde_path_to_error::deserialize(&mut reader).map_err(|e| {
        let message = plain(&e.inner().to_string());
        match e.path().to_string().as_str() {
            "." => message,
            path => format!("`{path}`: {message}"),
        }
    })?;
    reader.end().map_err(|e| plain(&e.to_string()))?;
    Ok(value)
}

/// serde's names of Rust's types and containers, in words.
fn plain(message: &str) -> String {
    let mut message = message.to_string();
    for (rust, words) in [
        ("a sequence", "a list"),
        ("a map", "an object"),
        ("usize", "a whole number, 0 or more"),
        ("u64", "a whole number, 0 or more"),
        ("u32", "a whole number from 0 to 4294967295"),
        ("u16", "a whole number from 0 to 65535"),
        ("u8", "a whole number from 0 to 255"),
        ("i64", "a whole number"),
        ("i32", "a whole number from -2147483648 to 2147483647"),
        ("f32", "a number"),
        ("f64", "a number"),
    ] {
        message = message.replace(&format!("expected {rust}"), &format!("expected {words}"));
    }
    message
}

/// What came, in words: never the value of a string (it may be long, or private).
pub fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => format!("the number {n}"),
        Value::String(_) => "a string".into(),
        Value::Array(items) if items.is_empty() => "an empty list".into(),
        Value::Array(items) => format!("a list of {}", items.len()),
        Value::Object(_) => "an object".into(),
    }
}

/// A field's value of one or more shapes, read from JSON.
pub trait Shape: Sized {
    /// What it must be, as a client reads it: "a string".
    const EXPECTED: &'static str;
    /// The same, many of them: "strings".
    const PLURAL: &'static str;
    fn fits(value: &Value) -> bool;
    /// `value`, which [`Shape::fits`].
    fn take(value: Value) -> Self;
}

impl Shape for String {
    const EXPECTED: &'static str = "a string";
    const PLURAL: &'static str = "strings";
    fn fits(value: &Value) -> bool {
        value.is_string()
    }
    fn take(value: Value) -> Self {
        match value {
            Value::String(s) => s,
            _ => unreachable!("fits"),
        }
    }
}

/// Reads a [`Shape`]: a value that fits none of its shapes is refused naming them.
pub fn read<'de, D: serde::Deserializer<'de>, T: Shape>(deserializer: D) -> Result<T, D::Error> {
    let value = Value::deserialize(deserializer)?;
    match T::fits(&value) {
        true => Ok(T::take(value)),
        false => Err(D::Error::custom(format!("must be {}, got {}", T::EXPECTED, describe(&value)))),
    }
}

/// One value or a list of them (TEI's `inputs`).
#[derive(Debug)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> OneOrMany<T> {
    /// The values, and whether they came as a list.
    pub fn into_vec(self) -> (Vec<T>, bool) {
        match self {
            OneOrMany::One(x) => (vec![x], false),
            OneOrMany::Many(v) => (v, true),
        }
    }
}

impl<'de, T: Shape> Deserialize<'de> for OneOrMany<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        if T::fits(&value) {
            return Ok(OneOrMany::One(T::take(value)));
        }
        let got = match &value {
            Value::Array(items) => match items.iter().position(|item| !T::fits(item)) {
                None => {
                    let Value::Array(items) = value else { unreachable!("an array") };
                    return Ok(OneOrMany::Many(items.into_iter().map(T::take).collect()));
                }
                Some(i) => format!("a list whose item [{i}] is {}", describe(&items[i])),
            },
            other => describe(other),
        };
        Err(D::Error::custom(format!("must be {} or a list of {}, got {got}", T::EXPECTED, T::PLURAL)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[serde(expecting = "a JSON object")]
    #[allow(dead_code)]
    struct Request {
        inputs: OneOrMany<String>,
        #[serde(default)]
        top_k: Option<usize>,
        #[serde(default)]
        normalize: bool,
    }

    fn error(body: &str) -> String {
        json::<Request>(body.as_bytes()).map(|_| ()).unwrap_err()
    }

    #[test]
    fn a_mistake_names_the_field_what_it_must_be_and_what_came() {
        let inputs = error(r#"{"inputs": 5}"#);
        assert!(inputs.starts_with("`inputs`: must be a string or a list of strings, got the number 5"), "{inputs}");
        let item = error(r#"{"inputs": ["a", {"b": 1}]}"#);
        assert!(
            item.starts_with("`inputs`: must be a string or a list of strings, got a list whose item [1] is an object"),
            "{item}"
        );
        let top_k = error(r#"{"inputs": "a", "top_k": -1}"#);
        assert!(top_k.starts_with("`top_k`: ") && top_k.contains("a whole number, 0 or more"), "{top_k}");
        let normalize = error(r#"{"inputs": "a", "normalize": "yes"}"#);
        assert!(normalize.starts_with("`normalize`: invalid type: string"), "{normalize}");
        assert!(error(r#"{}"#).contains("missing field `inputs`"));
        assert!(error("5").contains("expected a JSON object"));
        assert!(error(r#"{"inputs": "a"} x"#).contains("trailing characters"));
        let read = json::<Request>(br#"{"inputs": ["a", "b"]}"#).unwrap();
        assert!(matches!(read.inputs, OneOrMany::Many(ref v) if v.len() == 2));
    }
}
