//! Cohere's API, as the `cohere` SDK, LangChain's `CohereEmbeddings` and `CohereRerank` and the
//! tools built on them call it: rerank ([`rerank`]: `/v1/rerank`, `/v2/rerank`) and embed
//! ([`embed`]: `/v1/embed`, `/v2/embed`). The model is named in the body; a name this server
//! does not serve (a client's default, such as `rerank-v3.5` or `embed-english-v3.0`) means the
//! first model it serves of the kind the route needs, and the answer's `model` says which one
//! answered.
//!
//! Errors come in Cohere's shape: `{"message": "..."}`.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

pub mod embed;
pub mod rerank;

use std::sync::Arc;

use serde_json::{json, Map, Value};

use crate::request::app::AppState;
use crate::request::call::Call;
use crate::request::error::ApiError;
use crate::request::model::Model;

/// Which of Cohere's versions the route is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

impl Version {
    /// `meta.api_version.version` of its answers.
    fn number(self) -> &'static str {
        match self {
            Version::V1 => "1",
            Version::V2 => "2",
        }
    }
}

/// Cohere's error body.
pub fn error_body(e: &ApiError) -> Value {
    json!({ "message": e.to_string() })
}

/// A request's fields, read one by one so that each mistake names its field; `null` counts
/// as left out, as Cohere's SDK sends it.
struct Fields(Map<String, Value>);

fn bad(message: String) -> ApiError {
    ApiError::BadRequest(message)
}

impl Fields {
    fn of(body: &[u8]) -> Result<Fields, ApiError> {
        match serde_json::from_slice(body).map_err(|e| bad(format!("request body: {e}")))? {
            Value::Object(fields) => Ok(Fields(fields)),
            _ => Err(bad("the request body must be a JSON object".into())),
        }
    }

    fn given(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    /// A whole number of at least `min`, if given.
    fn count(&self, name: &str, min: u64) -> Result<Option<usize>, ApiError> {
        match self.given(name) {
            None => Ok(None),
            Some(v) => match v.as_u64().filter(|&n| n >= min) {
                Some(n) => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
                None => Err(bad(format!("'{name}' must be a whole number of at least {min}, not {v}"))),
            },
        }
    }

    /// `model`, the name of the model asked for, if any.
    fn model(&self) -> Result<Option<String>, ApiError> {
        match self.given("model") {
            None => Ok(None),
            Some(Value::String(name)) => Ok(Some(name.clone())),
            Some(_) => Err(bad("'model' must be a string".into())),
        }
    }

    /// v2's `priority`: a whole number, 0 the highest (above 255 counts as 255), as
    /// `x-inferd-priority`, which it overrides.
    fn priority(&self) -> Result<Option<u8>, ApiError> {
        match self.given("priority") {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(p) => Ok(Some(u8::try_from(p).unwrap_or(u8::MAX))),
                None => Err(bad(format!("'priority' must be a whole number, 0 the highest, not {v}"))),
            },
        }
    }
}

/// The model a request names when this server serves it and it `fits` the route (else the
/// route's refusal), or, for a name it does not serve or none, the first loaded model that
/// fits, the default model first; 404 saying `missing` when none does.
async fn model_for(
    state: &AppState,
    call: &Call,
    name: Option<&str>,
    fits: impl Fn(&Model) -> Result<(), ApiError>,
    missing: &str,
) -> Result<(usize, Arc<Model>), ApiError> {
    if let Some(name) = name {
        if let Ok(found) = state.models.find(name, None, call).await {
            fits(&found.1)?;
            return Ok(found);
        }
    }
    state.models.loaded().into_iter().find(|m| fits(m).is_ok()).and_then(|m| state.models.get(&m.info.name)).ok_or_else(
        || {
            let asked = name.map(|n| format!("no model '{n}' is served, and ")).unwrap_or_default();
            ApiError::NotFound(format!("{asked}{missing}"))
        },
    )
}
