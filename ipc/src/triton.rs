//! Triton's statistics and repository index as the supervisor computes them from the pool's
//! counters and repository, and what a worker asks of it to serve them on the main port
//! (HTTP and gRPC): a [`Question`] line on the worker's socketpair (in
//! [`crate::spec::WorkerMessage::Ask`]), an [`Answer`] line back.
//!
//! The types serialise to Triton's JSON shape (the admin listener and the main port write
//! them as they are); the gRPC side converts them to Triton's protobuf messages, field for
//! field.

use std::path::PathBuf;

use inferd_config::model::ModelOverride;
use serde::{Deserialize, Serialize};

/// What a worker asks the supervisor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "question", rename_all = "snake_case")]
pub enum Question {
    /// Triton's statistics of every model (`model` None) or of one, of one version.
    Statistics {
        #[serde(default)]
        model: Option<String>,
        #[serde(default)]
        version: Option<String>,
    },
    /// Triton's repository index; with `ready`, only the models that can be served now.
    Index { ready: bool },
    /// Triton's repository `load` on the main port (with `admin.model_control_on_main_port`):
    /// `model` read again, or added from the repository or the folder `path`.
    Load {
        model: String,
        #[serde(default)]
        path: Option<PathBuf>,
        /// The settings of its Triton configuration ([`load_parameters`]).
        #[serde(default)]
        config: Option<ModelOverride>,
    },
    /// Triton's repository `unload` on the main port.
    Unload { model: String },
}

/// The supervisor's answer to the worker's question `id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    pub id: u64,
    pub result: Result<Answered, Refused>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Answered {
    Statistics(Vec<ModelStats>),
    Index(Vec<IndexEntry>),
    /// A load or unload done: every worker runs the new model list.
    Done(String),
}

/// Why a question has no answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "snake_case")]
pub enum Refused {
    /// 404 / NOT_FOUND.
    #[error("Request for unknown model: '{name}' is not found; this server has {}", served.join(", "))]
    UnknownModel { name: String, served: Vec<String> },
    /// 404 / NOT_FOUND.
    #[error("model '{name}' has no version '{version}'; it serves version '{serves}'")]
    UnknownVersion { name: String, version: String, serves: String },
    /// 403 / UNAVAILABLE, in Triton's words for a server whose model control is off (its QA
    /// tests match them), then inferd's reason.
    #[error(
        "explicit model load / unload is not allowed if polling is enabled (Triton's words when \
         model control is off; inferd does not poll: load and unload are not allowed on the main \
         port unless the operator sets admin.model_control_on_main_port = true, or on the admin listener)"
    )]
    ModelControlOff,
    /// A load or unload refused before anything changed (400 / INVALID_ARGUMENT: an unknown
    /// model, a path outside the repository, a reload in progress), or failed on the way (500 /
    /// INTERNAL: the new workers failed, and the pool serves what it served).
    #[error("{message}")]
    NotDone { message: String, before_change: bool },
}

/// A repository `load` or `unload` of `model` that was not done, as Triton words it
/// ("failed to load 'm': ..."): its examples look for those words in the error.
pub fn not_done(model: &str, load: bool, why: impl std::fmt::Display) -> String {
    let action = if load { "load" } else { "unload" };
    format!("failed to {action} '{model}': {why}")
}

/// Why the `parameters` of a repository `load` or `unload` ask for nothing inferd can do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BadParameters {
    #[error("'parameters' must be an object, got {0}")]
    NotAnObject(serde_json::Value),
    #[error("parameters.path must be a string, got {0}")]
    Path(serde_json::Value),
    #[error("parameters.config must be a Triton model configuration in JSON: {0}")]
    ConfigNotJson(String),
    #[error(
        "inferd applies max_batch_size and dynamic_batching's max_queue_delay_microseconds and \
         default_queue_policy.max_queue_size of a Triton model configuration, not '{0}': the rest is the \
         model's model.toml (give parameters.path, a folder with it, or put the model in the repository)"
    )]
    TritonConfig(String),
    #[error("parameters.config: '{field}' {why}")]
    ConfigValue { field: &'static str, why: String },
    // Triton's words first (its answer when it cannot write such a file), with its status of
    // a bad request rather than its 500 (its own TODO, TRI-958, says 400).
    #[error(
        "failed to poll from model repository: inferd does not take model files in the request ('{0}'): give \
         parameters.path"
    )]
    Files(String),
}

/// What a repository `load` asks besides its model: the folder it names (`path`), and the
/// settings its Triton configuration (`config`) gives over the model's own until its next
/// load.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadParameters {
    pub path: Option<PathBuf>,
    pub config: Option<ModelOverride>,
}

/// What a repository `load`'s `parameters` ask ([`LoadParameters`]); for an unload (`load`
/// false) nothing, once `parameters` is an object. Triton's `file:` parameters (model files in
/// the request) have no inferd counterpart: a model is a folder with its model.toml, named by
/// `path` or found in the repository. Other parameters (`unload_dependents`: inferd has no
/// ensembles) are ignored.
pub fn load_parameters(parameters: Option<&serde_json::Value>, load: bool) -> Result<LoadParameters, BadParameters> {
    use serde_json::Value;
    let parameters = match parameters {
        None | Some(Value::Null) => return Ok(LoadParameters::default()),
        Some(Value::Object(p)) => p,
        Some(other) => return Err(BadParameters::NotAnObject(other.clone())),
    };
    let mut asked = LoadParameters::default();
    if !load {
        return Ok(asked);
    }
    for (key, value) in parameters {
        match (key.as_str(), value) {
            ("path", Value::String(p)) => asked.path = Some(PathBuf::from(p)),
            ("path", other) => return Err(BadParameters::Path(other.clone())),
            ("config", Value::String(text)) => asked.config = Some(triton_config(text)?),
            ("config", other) => return Err(BadParameters::ConfigNotJson(format!("a string of JSON, got {other}"))),
            (k, _) if k.starts_with("file:") => return Err(BadParameters::Files(key.clone())),
            _ => {}
        }
    }
    Ok(asked)
}

/// The settings a Triton model configuration (protobuf's JSON form, as tritonclient's
/// `load_model(config=...)` sends it) gives that inferd applies: `max_batch_size`, and
/// `dynamic_batching`'s `max_queue_delay_microseconds` (rounded up to whole milliseconds) and
/// `default_queue_policy.max_queue_size`. Its name, platform and backend may be given where
/// they are the model's own kind; anything else is refused, naming it, rather than ignored.
fn triton_config(text: &str) -> Result<ModelOverride, BadParameters> {
    use serde_json::{Map, Value};
    let config: Map<String, Value> =
        serde_json::from_str(text).map_err(|e| BadParameters::ConfigNotJson(e.to_string()))?;
    // Protobuf's JSON writes 64-bit integers as strings, and accepts either.
    let whole = |field: &'static str, v: &Value| -> Result<u64, BadParameters> {
        let n = match v {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s.trim().parse().ok(),
            _ => None,
        };
        n.ok_or_else(|| BadParameters::ConfigValue { field, why: format!("must be a whole number, got {v}") })
    };
    let object = |field: &'static str, v: &Value| -> Result<Map<String, Value>, BadParameters> {
        v.as_object()
            .cloned()
            .ok_or_else(|| BadParameters::ConfigValue { field, why: format!("must be an object, got {v}") })
    };
    let mut settings = ModelOverride::default();
    for (key, value) in &config {
        match key.as_str() {
            "name" => {}
            "platform" | "backend" => match value.as_str() {
                Some("onnxruntime_onnx" | "onnxruntime" | "") => {}
                _ => {
                    return Err(BadParameters::ConfigValue {
                        field: "platform",
                        why: format!("{value}: inferd runs ONNX models"),
                    })
                }
            },
            "max_batch_size" => settings.max_batch_size = Some(whole("max_batch_size", value)? as usize),
            "dynamic_batching" => {
                for (key, value) in object("dynamic_batching", value)? {
                    match key.as_str() {
                        "max_queue_delay_microseconds" => {
                            settings.max_queue_delay_ms =
                                Some(whole("max_queue_delay_microseconds", &value)?.div_ceil(1000))
                        }
                        "default_queue_policy" => {
                            for (key, value) in object("default_queue_policy", &value)? {
                                match key.as_str() {
                                    "max_queue_size" => {
                                        settings.max_queue_size = Some(whole("max_queue_size", &value)? as usize)
                                    }
                                    other => {
                                        return Err(BadParameters::TritonConfig(format!(
                                            "dynamic_batching.default_queue_policy.{other}"
                                        )))
                                    }
                                }
                            }
                        }
                        other => return Err(BadParameters::TritonConfig(format!("dynamic_batching.{other}"))),
                    }
                }
            }
            other => return Err(BadParameters::TritonConfig(other.to_string())),
        }
    }
    Ok(settings)
}

/// One model's statistics (Triton's `ModelStatistics`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelStats {
    pub name: String,
    pub version: String,
    /// Milliseconds since the epoch of the last answer; 0 before any.
    pub last_inference: u64,
    /// Rows run.
    pub inference_count: u64,
    /// Model calls (batches).
    pub execution_count: u64,
    pub inference_stats: InferStats,
    /// Triton's per-batch-size counts; inferd's batch histogram has buckets, not sizes, so
    /// this stays empty (the histogram is in /metrics).
    pub batch_stats: Vec<BatchStats>,
}

/// Triton's `InferBatchStatistics`: the calls of one batch size.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BatchStats {
    pub batch_size: u64,
    pub compute_input: Duration,
    pub compute_infer: Duration,
    pub compute_output: Duration,
}

/// Triton's `InferStatistics`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InferStats {
    pub success: Duration,
    pub fail: Duration,
    pub queue: Duration,
    pub compute_input: Duration,
    pub compute_infer: Duration,
    pub compute_output: Duration,
    pub cache_hit: Duration,
    pub cache_miss: Duration,
}

/// Triton's `StatisticDuration`: how many, and their nanoseconds together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Duration {
    pub count: u64,
    pub ns: u64,
}

impl Duration {
    pub fn of(count: u64, seconds: f64) -> Duration {
        Duration { count, ns: (seconds.max(0.0) * 1e9).round() as u64 }
    }
}

/// One row of Triton's repository index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexEntry {
    pub name: String,
    pub version: String,
    /// `READY` or `UNAVAILABLE`.
    pub state: String,
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines round-trip, and the JSON is Triton's shape (what the HTTP routes write).
    #[test]
    fn a_triton_configuration_gives_the_settings_inferd_applies_and_names_the_rest() {
        let asked = |config: &str| {
            load_parameters(Some(&serde_json::json!({"parameters": {"config": config}})["parameters"]), true)
        };
        let settings = asked(
            r#"{"name": "m", "backend": "onnxruntime", "max_batch_size": "16",
                "dynamic_batching": {"max_queue_delay_microseconds": 1500, "default_queue_policy": {"max_queue_size": 4}}}"#,
        )
        .unwrap()
        .config
        .unwrap();
        let want = ModelOverride {
            max_batch_size: Some(16),
            max_queue_delay_ms: Some(2),
            max_queue_size: Some(4),
            ..Default::default()
        };
        assert_eq!(settings, want);
        assert_eq!(asked("{}").unwrap().config, Some(ModelOverride::default()));
        let e = asked(r#"{"instance_group": [{"count": 2}]}"#).unwrap_err().to_string();
        assert!(e.contains("not 'instance_group'"), "{e}");
        let e = asked(r#"{"dynamic_batching": {"preferred_batch_size": [4]}}"#).unwrap_err().to_string();
        assert!(e.contains("not 'dynamic_batching.preferred_batch_size'"), "{e}");
        let e = asked(r#"{"max_batch_size": -1}"#).unwrap_err().to_string();
        assert!(e.contains("'max_batch_size' must be a whole number"), "{e}");
        let e = asked(r#"{"platform": "tensorrt_plan"}"#).unwrap_err().to_string();
        assert!(e.contains("inferd runs ONNX models"), "{e}");
        assert!(matches!(asked("{{\"max_batch_size\""), Err(BadParameters::ConfigNotJson(_))));
        // An unload takes none of it.
        let unload = load_parameters(Some(&serde_json::json!({"config": "{}"})), false).unwrap();
        assert_eq!(unload, LoadParameters::default());
    }

    #[test]
    fn answers_round_trip_in_tritons_shape() {
        let stats = ModelStats {
            name: "m".into(),
            version: "1".into(),
            last_inference: 5,
            inference_count: 3,
            execution_count: 2,
            inference_stats: InferStats { success: Duration::of(2, 0.5), ..InferStats::default() },
            batch_stats: vec![],
        };
        let json = serde_json::to_value(&stats).unwrap();
        assert_eq!(json["inference_stats"]["success"], serde_json::json!({"count": 2, "ns": 500000000}));
        assert_eq!(json["inference_stats"]["cache_miss"], serde_json::json!({"count": 0, "ns": 0}));
        for answer in [
            Answer { id: 1, result: Ok(Answered::Statistics(vec![stats])) },
            Answer { id: 2, result: Err(Refused::UnknownModel { name: "x".into(), served: vec!["m".into()] }) },
        ] {
            let line = serde_json::to_string(&answer).unwrap();
            assert_eq!(serde_json::from_str::<Answer>(&line).unwrap(), answer);
        }
        let q = Question::Statistics { model: Some("m".into()), version: None };
        assert_eq!(serde_json::from_str::<Question>(&serde_json::to_string(&q).unwrap()).unwrap(), q);
    }
}
