//! Triton's statistics and repository index as the supervisor computes them from the pool's
//! counters and repository, and what a worker asks of it to serve them on the main port
//! (HTTP and gRPC): a [`Question`] line on the worker's socketpair (in
//! [`crate::spec::WorkerMessage::Ask`]), an [`Answer`] line back.
//!
//! The types serialise to Triton's JSON shape (the admin listener and the main port write
//! them as they are); the gRPC side converts them to Triton's protobuf messages, field for
//! field.

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
}

/// Why a question has no answer: what Triton answers 404 / NOT_FOUND for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "snake_case")]
pub enum Refused {
    #[error("unknown model '{name}'; this server has {}", served.join(", "))]
    UnknownModel { name: String, served: Vec<String> },
    #[error("model '{name}' has no version '{version}'; it serves version '{serves}'")]
    UnknownVersion { name: String, version: String, serves: String },
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
