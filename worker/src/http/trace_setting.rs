//! Triton's trace extension, over REST (`GET|POST /v2/trace/setting`,
//! `/v2/models/{model}/trace/setting`) and gRPC (TraceSetting) alike: the settings in force, in
//! Triton's names. inferd's traces are OpenTelemetry's, set by [tracing] (docs/operations.md,
//! "Traces") for the whole pool and every model, and changed by `inferd reload`: an update that
//! keeps every setting as it is (or resets a model's to the global ones, which they are) is
//! answered with the settings; one that would change a setting is refused, naming it.

use std::collections::BTreeMap;

use crate::request::app::AppState;
use crate::request::call::Call;
use crate::request::error::ApiError;

/// A setting's values, as Triton's messages carry them (a list of strings).
pub type Settings = BTreeMap<String, Vec<String>>;

/// An update: each setting named, with its new values (None: reset to the global one).
pub type Asked = Vec<(String, Option<Vec<String>>)>;

/// The settings in force when a worker traces a `ratio` of new requests (None: tracing off).
pub fn current(ratio: Option<f64>) -> Settings {
    let (level, rate) = match ratio {
        Some(r) if r > 0.0 => ("TIMESTAMPS", (1.0 / r).round().max(1.0).to_string()),
        _ => ("OFF", "0".to_string()),
    };
    [
        ("trace_level", level),
        ("trace_rate", &rate),
        ("trace_count", "-1"),
        ("log_frequency", "0"),
        ("trace_mode", "opentelemetry"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), vec![v.to_string()]))
    .collect()
}

/// The settings after `asked` (a setting's new values; None: reset to the global one): those in
/// force, when nothing asked changes them.
pub fn update(ratio: Option<f64>, asked: &Asked) -> Result<Settings, ApiError> {
    let settings = current(ratio);
    for (name, values) in asked {
        let Some(now) = settings.get(name) else {
            let known: Vec<&str> = settings.keys().map(String::as_str).collect();
            return Err(ApiError::BadRequest(format!(
                "unknown trace setting '{name}' (inferd's are {})",
                known.join(", ")
            )));
        };
        let Some(values) = values else { continue };
        let same = values.len() == now.len() && values.iter().zip(now).all(|(v, n)| v.trim().eq_ignore_ascii_case(n));
        if !same {
            return Err(ApiError::BadRequest(format!(
                "trace setting '{name}' is {now:?} and does not change at run time: inferd's traces follow \
                 [tracing] in its configuration (endpoint, sample_ratio), which `inferd reload` applies"
            )));
        }
    }
    Ok(settings)
}

/// The settings of `model` (None: the global ones) after `asked` (None: a read), for either
/// protocol: an unknown model is refused as any route refuses it (one loaded on demand is
/// known, and not loaded by being asked about).
pub async fn answer(
    state: &AppState,
    model: Option<&str>,
    call: &Call,
    asked: Option<&Asked>,
) -> Result<Settings, ApiError> {
    if let Some(name) = model.filter(|name| !state.models.loads_on_demand(name)) {
        state.models.find(name, None, call).await?;
    }
    match asked {
        Some(asked) => update(state.trace_ratio, asked),
        None => Ok(current(state.trace_ratio)),
    }
}

/// A REST update's body: each setting a string, a number, a list of them, or null.
pub fn asked_of_json(body: &[u8]) -> Result<Asked, ApiError> {
    use serde_json::Value;
    let bad = |why: String| ApiError::BadRequest(format!("the trace settings are not valid: {why}"));
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Vec::new());
    }
    let Value::Object(object) = serde_json::from_slice::<Value>(body).map_err(|e| bad(e.to_string()))? else {
        return Err(bad("expected a JSON object of settings".into()));
    };
    let text = |name: &str, v: &Value| match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        _ => Err(bad(format!("'{name}' must be a string, a number, a list of them or null"))),
    };
    object
        .iter()
        .map(|(name, value)| {
            let values = match value {
                Value::Null => None,
                Value::Array(items) => Some(items.iter().map(|v| text(name, v)).collect::<Result<_, _>>()?),
                v => Some(vec![text(name, v)?]),
            };
            Ok((name.clone(), values))
        })
        .collect()
}

/// The settings as a REST answer: a setting of one value as a string, trace_level as a list
/// (Triton's shape).
pub fn to_json(settings: &Settings) -> serde_json::Value {
    settings
        .iter()
        .map(|(name, values)| {
            let value = match (name.as_str(), values.as_slice()) {
                ("trace_level", _) | (_, [] | [_, _, ..]) => serde_json::json!(values),
                (_, [one]) => serde_json::json!(one),
            };
            (name.clone(), value)
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_follow_the_ratio_and_only_a_change_is_refused() {
        let on = current(Some(0.25));
        assert_eq!(on["trace_level"], ["TIMESTAMPS"]);
        assert_eq!(on["trace_rate"], ["4"]);
        assert_eq!(current(None)["trace_level"], ["OFF"]);
        assert_eq!(current(Some(0.0))["trace_level"], ["OFF"]);
        assert_eq!(update(Some(1.0), &vec![]).unwrap(), current(Some(1.0)));
        let same = vec![("trace_rate".to_string(), Some(vec!["1".to_string()])), ("trace_count".to_string(), None)];
        assert_eq!(update(Some(1.0), &same).unwrap(), current(Some(1.0)));
        let level = vec![("trace_level".to_string(), Some(vec!["timestamps".to_string()]))];
        assert!(update(Some(1.0), &level).is_ok());
        let change = vec![("trace_rate".to_string(), Some(vec!["10".to_string()]))];
        let e = update(Some(1.0), &change).unwrap_err().to_string();
        assert!(e.contains("'trace_rate'") && e.contains("[tracing]"), "{e}");
        let unknown = vec![("trace_fil".to_string(), None)];
        assert!(update(None, &unknown).unwrap_err().to_string().contains("unknown trace setting 'trace_fil'"));

        let asked = asked_of_json(br#"{"trace_rate": 1, "trace_level": ["OFF"], "trace_count": null}"#).unwrap();
        assert_eq!(asked.len(), 3);
        assert!(update(None, &asked).is_err(), "rate 1 while off (rate 0)");
        assert!(asked_of_json(b"  ").unwrap().is_empty());
        assert!(asked_of_json(b"[1]").is_err());
        assert!(asked_of_json(br#"{"trace_rate": {"a": 1}}"#).is_err());
        let json = to_json(&on);
        assert_eq!(json["trace_level"], serde_json::json!(["TIMESTAMPS"]));
        assert_eq!(json["trace_rate"], serde_json::json!("4"));
    }
}
