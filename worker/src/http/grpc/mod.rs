//! KServe v2 / Open Inference Protocol over gRPC (`inference.GRPCInferenceService`, see
//! worker/proto/grpc_predict_v2.proto): health, metadata and ModelInfer, served on
//! `server.grpc_listen` by every worker beside its HTTP port.
//!
//! A request's bytes are charged to the worker's body budget as they arrive, and a ModelInfer
//! message's decoded size is bounded before it is decoded ([`intake`]). Then it takes the same
//! path as a REST one: the model lookup, the counters (endpoint `infer`), the pipeline or raw
//! tensors ([`crate::request::infer::run_v2`]), deadlines and backpressure. Errors are gRPC status codes carrying the same messages as
//! the REST answers ([`status`]). An answer is compressed as its request was, where the client
//! reads that coding ([`crate::http::compress::grpc_answer`]).
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use std::sync::atomic::Ordering;
use std::sync::Arc;

use inferd_ipc::triton::{self, load_parameters, ModelStats};
use opentelemetry::KeyValue;
use serde_json::{Map, Value};
use tonic::{Request, Response, Status};

use crate::http::model_config::{Config, TensorConfig};
use crate::http::shared_memory::{self, Action, Memory, Registration};
use crate::kserve::json as kserve;
use crate::kserve::{Delivery, InputTensor, Parsed, SharedMemory, WantedOutput};
use crate::request::app::{self, AppState, CountedAs};
use crate::request::call::Call;
use inferd_config::restricted::Api;

use crate::http::trace_setting;
use crate::request::door::{self, Answered, Arrival, Visit};
use crate::request::error::ApiError;
use crate::request::infer::{self, Inferred};
use crate::request::model::Model;
use crate::runtime::tensor::{DataType, Tensor, TensorData};

pub mod intake;
pub mod proto;
pub mod shutdown;

use proto::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use proto::model_infer_response::InferOutputTensor;
use proto::model_metadata_response::TensorMetadata;
use proto::{infer_parameter::ParameterChoice, InferParameter, InferTensorContents};

/// The service one worker serves on each of its gRPC connections.
pub fn service(state: Arc<AppState>) -> GrpcInferenceServiceServer<Grpc> {
    // A message may be as large as a REST body (server.max_body_bytes; the intake refuses a
    // larger one before tonic sees it). Answers are not limited: the model's outputs for an
    // accepted request are sent whatever their size, as over REST.
    let limit = usize::try_from(state.max_body_bytes).unwrap_or(usize::MAX);
    GrpcInferenceServiceServer::new(Grpc { state })
        .max_decoding_message_size(limit)
        .max_encoding_message_size(usize::MAX)
}

pub struct Grpc {
    state: Arc<AppState>,
}

/// A region's name as Triton's shared-memory messages give it: empty means every region.
fn some(name: &str) -> Option<&str> {
    (!name.is_empty()).then_some(name)
}

/// The only place an [`ApiError`] becomes a gRPC status.
pub fn status(e: ApiError) -> Status {
    let message = e.to_string();
    match e {
        ApiError::NotFound(_) => Status::not_found(message),
        ApiError::BadRequest(_) | ApiError::Empty(_) | ApiError::MethodNotAllowed(..) => {
            Status::invalid_argument(message)
        }
        // As grpc-core and grpc-java answer a message larger than the receiver's limit.
        ApiError::TooLarge(_) | ApiError::BodyTooLarge(_) | ApiError::Overloaded(_) | ApiError::TooManyRequests(..) => {
            Status::resource_exhausted(message)
        }
        ApiError::Timeout(_) | ApiError::DeadlineExceeded(_) => Status::deadline_exceeded(message),
        ApiError::Internal(_) => Status::internal(message),
        ApiError::Unauthorized(_) => Status::unauthenticated(message),
        ApiError::Forbidden(_) => Status::permission_denied(message),
        // Triton's code for a server whose model control is off.
        ApiError::ModelControlOff(_) => Status::unavailable(message),
        // Triton's code and words for a restricted protocol.
        ApiError::Restricted { header } => {
            Status::unavailable(format!("This protocol is restricted, expecting header '{header}'"))
        }
    }
}

/// The health RPCs, open without a key unless `[auth] protect_health` (a call's path is
/// `/inference.GRPCInferenceService/NAME`).
pub fn is_health_call(path: &str) -> bool {
    matches!(path.rsplit('/').next(), Some("ServerLive" | "ServerReady" | "ModelReady"))
}

/// A call's API category, as Triton groups its RPCs ([[auth.restricted]]); None: an RPC this
/// server does not know (UNIMPLEMENTED either way).
fn api(path: &str) -> Option<Api> {
    Some(match path.rsplit('/').next()? {
        "ServerLive" | "ServerReady" | "ModelReady" => Api::Health,
        "ServerMetadata" | "ModelMetadata" => Api::Metadata,
        "ModelInfer" | "ModelStreamInfer" => Api::Inference,
        "ModelConfig" => Api::ModelConfig,
        "ModelStatistics" => Api::Statistics,
        "RepositoryIndex" | "RepositoryModelLoad" | "RepositoryModelUnload" => Api::ModelRepository,
        "TraceSetting" => Api::Trace,
        "LogSettings" => Api::Logging,
        rpc if rpc.starts_with("SystemSharedMemory") || rpc.starts_with("CudaSharedMemory") => Api::SharedMemory,
        _ => return None,
    })
}

/// A model by name; an empty version means the one served.
async fn find<T>(
    state: &AppState,
    request: &Request<T>,
    name: &str,
    version: &str,
) -> Result<(usize, Arc<Model>), ApiError> {
    state.models.find(name, Some(version).filter(|v| !v.is_empty()), &called(request)?).await
}

/// What the door learned of a call ([`serve`] puts it in the call's extensions).
fn called<T>(request: &Request<T>) -> Result<Call, ApiError> {
    let call = request.extensions().get::<Call>().cloned();
    call.ok_or_else(|| ApiError::Internal("internal error: a call reached its handler without passing the door".into()))
}

/// Every gRPC call: let in by the door ([`crate::request::door`]) on its headers, before its
/// message is read; read and charged ([`intake`]); served by `service`, a bug that panics
/// costing that call (INTERNAL), not the worker; its failure logged, its access line written
/// and its span ended, as the HTTP routes' are.
pub async fn serve(
    state: &AppState,
    peer: std::net::SocketAddr,
    mut service: GrpcInferenceServiceServer<Grpc>,
    mut request: hyper::Request<hyper::body::Incoming>,
) -> Result<hyper::Response<tonic::body::Body>, std::convert::Infallible> {
    use tonic::codegen::Service;
    let path = request.uri().path().to_string();
    let rpc = path.trim_start_matches('/');
    let visit = Visit::open(state, request.headers(), |id| {
        let (service, method) = rpc.split_once('/').unwrap_or(("", rpc));
        let attributes = vec![
            KeyValue::new("rpc.system", "grpc"),
            KeyValue::new("rpc.service", service.to_string()),
            KeyValue::new("rpc.method", method.to_string()),
            KeyValue::new("inferd.request_id", id.to_str().unwrap_or_default().to_string()),
        ];
        (rpc.to_string(), attributes)
    });
    // Read before the intake takes the request's grpc-encoding off it.
    let encoding = crate::http::compress::grpc_accepted(request.headers());
    let arrival = Arrival {
        headers: request.headers(),
        probe: is_health_call(&path),
        forwarded: false,
        api: api(&path),
        grpc: true,
    };
    let (answer, call) = match door::enter(state, &visit, &arrival) {
        Err(e) => (Err(e), None),
        Ok(entered) => {
            request.extensions_mut().insert(entered.call.clone());
            let served = visit.serve(async {
                // An RPC the service lacks is answered at once: a streaming call's client keeps its
                // side open, and reading the call whole would hold it until its deadline.
                if matches!(path.rsplit('/').next(), Some("ModelStreamInfer" | "LogSettings")) || api(&path).is_none() {
                    let message = format!("inferd does not serve {rpc} (docs/protocol.md)");
                    return Ok(Status::unimplemented(message).into_http());
                }
                let request = intake::read(state, request).await;
                Ok(service.call(request).await.unwrap_or_else(|never| match never {}))
            });
            (served.await, Some(entered.call))
        }
    };
    let mut refused = "";
    let answer = answer.unwrap_or_else(|e| {
        if let ApiError::Unauthorized(refusal) = &e {
            refused = refusal.as_str();
        }
        visit.failed("POST", rpc, &e);
        status(e).into_http()
    });
    // Compressed as its request was, where the client reads that coding.
    let answer = crate::http::compress::grpc_answer(state, encoding, answer).await;
    // A call's own failure is in the headers of its trailers-only answer.
    let code = answer
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok()?.parse::<i32>().ok())
        .map_or(tonic::Code::Ok, tonic::Code::from);
    let answered = Answered {
        peer: Some(peer),
        method: "grpc",
        path: rpc,
        model: call.as_ref().and_then(Call::model).unwrap_or_default(),
        status: http_status(code),
        bytes: 0,
        key: call.as_ref().and_then(|c| c.key.as_deref()),
        refused,
    };
    // RPC conventions: these codes are the server's errors.
    let server_error = matches!(
        code,
        tonic::Code::Unknown
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Unimplemented
            | tonic::Code::Internal
            | tonic::Code::Unavailable
            | tonic::Code::DataLoss
    );
    let error = server_error.then(|| format!("{code:?}"));
    visit.close(state, answered, vec![KeyValue::new("rpc.grpc.status_code", code as i64)], error);
    Ok(answer)
}

/// The HTTP status a gRPC code stands for in the access line (as the HTTP routes would have
/// answered the same error).
fn http_status(code: tonic::Code) -> u16 {
    use tonic::Code::*;
    match code {
        Ok => 200,
        InvalidArgument | FailedPrecondition | OutOfRange => 400,
        Unauthenticated => 401,
        PermissionDenied => 403,
        NotFound => 404,
        AlreadyExists | Aborted => 409,
        ResourceExhausted => 429,
        Cancelled => 499,
        Unimplemented => 501,
        Unavailable => 503,
        DeadlineExceeded => 504,
        Unknown | Internal | DataLoss => 500,
    }
}

#[tonic::async_trait]
impl GrpcInferenceService for Grpc {
    async fn server_live(
        &self,
        _: Request<proto::ServerLiveRequest>,
    ) -> Result<Response<proto::ServerLiveResponse>, Status> {
        Ok(Response::new(proto::ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _: Request<proto::ServerReadyRequest>,
    ) -> Result<Response<proto::ServerReadyResponse>, Status> {
        Ok(Response::new(proto::ServerReadyResponse { ready: self.state.ready.load(Ordering::Relaxed) }))
    }

    async fn model_ready(
        &self,
        request: Request<proto::ModelReadyRequest>,
    ) -> Result<Response<proto::ModelReadyResponse>, Status> {
        let message = request.get_ref();
        // A model loaded on demand is ready before its first request: that request loads it.
        // One this server does not serve (unknown, unloaded, no such version) is not ready,
        // which is an answer, not an error (Triton's ModelReady; HTTP says it with 404).
        if !(message.version.is_empty() && self.state.models.loads_on_demand(&message.name)) {
            match find(&self.state, &request, &message.name, &message.version).await {
                Ok(_) => {}
                Err(ApiError::NotFound(_)) => return Ok(Response::new(proto::ModelReadyResponse { ready: false })),
                Err(e) => return Err(status(e)),
            }
        }
        Ok(Response::new(proto::ModelReadyResponse { ready: self.state.ready.load(Ordering::Relaxed) }))
    }

    async fn server_metadata(
        &self,
        _: Request<proto::ServerMetadataRequest>,
    ) -> Result<Response<proto::ServerMetadataResponse>, Status> {
        Ok(Response::new(proto::ServerMetadataResponse {
            name: self.state.server_name.clone(),
            version: inferd_ipc::version().into(),
            extensions: crate::http::v2::EXTENSIONS.map(String::from).to_vec(),
        }))
    }

    async fn model_metadata(
        &self,
        request: Request<proto::ModelMetadataRequest>,
    ) -> Result<Response<proto::ModelMetadataResponse>, Status> {
        let message = request.get_ref();
        // What a model loaded on demand takes and gives is known once it is loaded: this loads it.
        let (_, meta) = find(&self.state, &request, &message.name, &message.version).await.map_err(status)?;
        Ok(Response::new(metadata(&meta)))
    }

    async fn model_config(
        &self,
        request: Request<proto::ModelConfigRequest>,
    ) -> Result<Response<proto::ModelConfigResponse>, Status> {
        let message = request.get_ref();
        let (_, meta) = find(&self.state, &request, &message.name, &message.version).await.map_err(status)?;
        let config = Config::of(&meta, self.state.max_batch_inputs);
        Ok(Response::new(proto::ModelConfigResponse { config: Some(config_message(&config)) }))
    }

    async fn model_statistics(
        &self,
        request: Request<proto::ModelStatisticsRequest>,
    ) -> Result<Response<proto::ModelStatisticsResponse>, Status> {
        let message = request.get_ref();
        let name = Some(message.name.as_str()).filter(|n| !n.is_empty());
        let version = Some(message.version.as_str()).filter(|v| !v.is_empty());
        let stats = self.state.supervisor.statistics(name, version).await.map_err(|e| status(e.into()))?;
        Ok(Response::new(proto::ModelStatisticsResponse {
            model_stats: stats.iter().map(statistics_message).collect(),
        }))
    }

    async fn repository_index(
        &self,
        request: Request<proto::RepositoryIndexRequest>,
    ) -> Result<Response<proto::RepositoryIndexResponse>, Status> {
        let index = self.state.supervisor.index(request.get_ref().ready).await.map_err(|e| status(e.into()))?;
        let models = index
            .into_iter()
            .map(|e| proto::repository_index_response::ModelIndex {
                name: e.name,
                version: e.version,
                state: e.state,
                reason: e.reason,
            })
            .collect();
        Ok(Response::new(proto::RepositoryIndexResponse { models }))
    }

    async fn trace_setting(
        &self,
        request: Request<proto::TraceSettingRequest>,
    ) -> Result<Response<proto::TraceSettingResponse>, Status> {
        let message = request.get_ref();
        // A setting without values resets a model's to the global one (Triton's rule).
        let asked: trace_setting::Asked =
            message.settings.iter().map(|(k, v)| (k.clone(), (!v.value.is_empty()).then(|| v.value.clone()))).collect();
        let call = called(&request).map_err(status)?;
        let model = some(&message.model_name);
        let settings = trace_setting::answer(&self.state, model, &call, Some(&asked)).await.map_err(status)?;
        let settings =
            settings.into_iter().map(|(k, value)| (k, proto::trace_setting_response::SettingValue { value })).collect();
        Ok(Response::new(proto::TraceSettingResponse { settings }))
    }

    async fn repository_model_load(
        &self,
        request: Request<proto::RepositoryModelLoadRequest>,
    ) -> Result<Response<proto::RepositoryModelLoadResponse>, Status> {
        let message = request.into_inner();
        self.change_repository(&message.model_name, true, &message.parameters).await?;
        Ok(Response::new(proto::RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        request: Request<proto::RepositoryModelUnloadRequest>,
    ) -> Result<Response<proto::RepositoryModelUnloadResponse>, Status> {
        let message = request.into_inner();
        self.change_repository(&message.model_name, false, &message.parameters).await?;
        Ok(Response::new(proto::RepositoryModelUnloadResponse {}))
    }

    async fn system_shared_memory_status(
        &self,
        request: Request<proto::SystemSharedMemoryStatusRequest>,
    ) -> Result<Response<proto::SystemSharedMemoryStatusResponse>, Status> {
        let name = &request.get_ref().name;
        let regions = self.shared_memory(Action::Status(some(name)), None)?;
        let regions = regions
            .into_iter()
            .map(|r| {
                let status = proto::system_shared_memory_status_response::RegionStatus {
                    name: r.name.clone(),
                    key: r.key,
                    offset: r.offset,
                    byte_size: r.byte_size,
                };
                (r.name, status)
            })
            .collect();
        Ok(Response::new(proto::SystemSharedMemoryStatusResponse { regions }))
    }

    async fn system_shared_memory_register(
        &self,
        request: Request<proto::SystemSharedMemoryRegisterRequest>,
    ) -> Result<Response<proto::SystemSharedMemoryRegisterResponse>, Status> {
        let proto::SystemSharedMemoryRegisterRequest { name, key, offset, byte_size } = request.into_inner();
        self.shared_memory(Action::Register(&name), Some(Registration { key, offset, byte_size }))?;
        Ok(Response::new(proto::SystemSharedMemoryRegisterResponse {}))
    }

    async fn system_shared_memory_unregister(
        &self,
        request: Request<proto::SystemSharedMemoryUnregisterRequest>,
    ) -> Result<Response<proto::SystemSharedMemoryUnregisterResponse>, Status> {
        let name = &request.get_ref().name;
        self.shared_memory(Action::Unregister(some(name)), None)?;
        Ok(Response::new(proto::SystemSharedMemoryUnregisterResponse {}))
    }

    async fn cuda_shared_memory_status(
        &self,
        request: Request<proto::CudaSharedMemoryStatusRequest>,
    ) -> Result<Response<proto::CudaSharedMemoryStatusResponse>, Status> {
        let name = &request.get_ref().name;
        shared_memory::answer(None, Memory::Cuda, Action::Status(some(name)), None).map_err(status)?;
        Ok(Response::new(proto::CudaSharedMemoryStatusResponse::default()))
    }

    async fn cuda_shared_memory_register(
        &self,
        request: Request<proto::CudaSharedMemoryRegisterRequest>,
    ) -> Result<Response<proto::CudaSharedMemoryRegisterResponse>, Status> {
        shared_memory::answer(None, Memory::Cuda, Action::Register(&request.get_ref().name), None).map_err(status)?;
        Ok(Response::new(proto::CudaSharedMemoryRegisterResponse {}))
    }

    async fn cuda_shared_memory_unregister(
        &self,
        request: Request<proto::CudaSharedMemoryUnregisterRequest>,
    ) -> Result<Response<proto::CudaSharedMemoryUnregisterResponse>, Status> {
        let name = &request.get_ref().name;
        shared_memory::answer(None, Memory::Cuda, Action::Unregister(some(name)), None).map_err(status)?;
        Ok(Response::new(proto::CudaSharedMemoryUnregisterResponse {}))
    }

    async fn model_infer(
        &self,
        request: Request<proto::ModelInferRequest>,
    ) -> Result<Response<proto::ModelInferResponse>, Status> {
        crate::trace::attribute(KeyValue::new("inferd.model", request.get_ref().model_name.clone()));
        self.infer(request).await
    }
}

/// One model's statistics as Triton's protobuf message, field for field.
fn statistics_message(s: &ModelStats) -> proto::ModelStatistics {
    let d = |d: &triton::Duration| Some(proto::StatisticDuration { count: d.count, ns: d.ns });
    let i = &s.inference_stats;
    proto::ModelStatistics {
        name: s.name.clone(),
        version: s.version.clone(),
        last_inference: s.last_inference,
        inference_count: s.inference_count,
        execution_count: s.execution_count,
        inference_stats: Some(proto::InferStatistics {
            success: d(&i.success),
            fail: d(&i.fail),
            queue: d(&i.queue),
            compute_input: d(&i.compute_input),
            compute_infer: d(&i.compute_infer),
            compute_output: d(&i.compute_output),
            cache_hit: d(&i.cache_hit),
            cache_miss: d(&i.cache_miss),
        }),
        batch_stats: s
            .batch_stats
            .iter()
            .map(|b| proto::InferBatchStatistics {
                batch_size: b.batch_size,
                compute_input: d(&b.compute_input),
                compute_infer: d(&b.compute_infer),
                compute_output: d(&b.compute_output),
            })
            .collect(),
    }
}

impl Grpc {
    /// Triton's system shared memory through the pool's registry ([`shared_memory`]).
    fn shared_memory(
        &self,
        action: Action,
        registration: Option<Registration>,
    ) -> Result<Vec<inferd_ipc::shm::Region>, Status> {
        shared_memory::answer(self.state.shared_memory.as_ref(), Memory::System, action, registration).map_err(status)
    }

    /// RepositoryModelLoad (`load`) and RepositoryModelUnload: their parameters read as the
    /// HTTP route reads its JSON ones ([`load_parameters`]), then the supervisor's reload.
    async fn change_repository(
        &self,
        model: &str,
        load: bool,
        parameters: &std::collections::HashMap<String, proto::ModelRepositoryParameter>,
    ) -> Result<(), Status> {
        use proto::model_repository_parameter::ParameterChoice;
        let parameters: Map<String, Value> = parameters
            .iter()
            .map(|(key, p)| {
                let value = match &p.parameter_choice {
                    Some(ParameterChoice::BoolParam(b)) => Value::Bool(*b),
                    Some(ParameterChoice::Int64Param(n)) => Value::from(*n),
                    Some(ParameterChoice::StringParam(s)) => Value::String(s.clone()),
                    // Only model files (`file:` keys, refused by name) are bytes.
                    Some(ParameterChoice::BytesParam(_)) | None => Value::Null,
                };
                (key.clone(), value)
            })
            .collect();
        let asked = load_parameters(Some(&Value::Object(parameters)), load)
            .map_err(|e| status(ApiError::BadRequest(triton::not_done(model, load, e))))?;
        self.state.supervisor.change_repository(model, load, asked).await.map_err(|e| status(e.into()))?;
        Ok(())
    }

    /// ModelInfer itself.
    async fn infer(
        &self,
        mut request: Request<proto::ModelInferRequest>,
    ) -> Result<Response<proto::ModelInferResponse>, Status> {
        let state = &*self.state;
        let call = called(&request).map_err(status)?;
        let refused = request.extensions_mut().remove::<intake::Intake>();
        // Held until the answer is sent: the request's bytes, as they arrived and decoded.
        let _budget = request.extensions_mut().remove::<intake::Claim>();
        let request = request.into_inner();
        let (model, version) = (request.model_name.clone(), request.model_version.clone());
        let found = state.models.find(&model, Some(version.as_str()).filter(|v| !v.is_empty()), &call).await;
        let row = app::found_index(state, &found);
        let work = async {
            if let Some(intake::Intake::Refused(e)) = refused {
                return Err(e);
            }
            let (index, meta) = found?;
            let rows = request.inputs.first().and_then(|i| usize::try_from(*i.shape.first()?).ok());
            crate::panics::test_switch("grpc", rows);
            let shared = state.shared_memory_reader();
            let parsed = parse(request, &shared).map_err(ApiError::BadRequest)?;
            let inferred = infer::run_v2(state, &call, index, &meta, parsed).await?;
            Ok(Infer(encode(&meta, inferred)))
        };
        let result = app::counted(state, row, inferd_ipc::stats::Endpoint::Infer, work).await;
        result.map(|Infer(response)| Response::new(response)).map_err(status)
    }
}

struct Infer(proto::ModelInferResponse);

impl CountedAs for Infer {
    fn code(&self) -> u16 {
        200
    }
}

/// What a client sends the model: a pipelined model's BYTES input and outputs (as
/// `/v2/models/{name}` lists under `pipeline`), else the model's own tensors.
fn metadata(meta: &Model) -> proto::ModelMetadataResponse {
    let tensor = |name: &str, datatype: &str, shape: &[i64]| TensorMetadata {
        name: name.into(),
        datatype: datatype.into(),
        shape: shape.to_vec(),
    };
    // A text model's BYTES in and out; an image model's own tensors, as its configuration
    // lists them (Triton's image clients send the pixel tensor).
    let pipelined =
        infer::pipeline_io(meta).filter(|_| !matches!(&*meta.pipeline, crate::pipeline::Pipeline::Image(_)));
    let (inputs, outputs) = match pipelined {
        Some((input, outputs)) => (
            vec![tensor(input, "BYTES", &[-1])],
            outputs.iter().map(|(name, datatype, shape)| tensor(name, datatype, shape)).collect(),
        ),
        None => (
            meta.inputs.iter().map(|s| tensor(&s.name, &s.datatype, &s.shape)).collect(),
            meta.outputs.iter().map(|s| tensor(&s.name, &s.datatype, &s.shape)).collect(),
        ),
    };
    proto::ModelMetadataResponse {
        name: meta.info.name.clone(),
        versions: vec![meta.info.version.clone()],
        platform: "onnxruntime_onnx".into(),
        inputs,
        outputs,
    }
}

/// A model's configuration as Triton's `ModelConfig` message ([`Config`]).
fn config_message(config: &Config) -> proto::ModelConfig {
    let data_type = |t: &TensorConfig| {
        proto::DataType::from_str_name(&t.triton_type()).unwrap_or(proto::DataType::TypeInvalid) as i32
    };
    let reshape = |t: &TensorConfig| t.reshape.clone().map(|shape| proto::ModelTensorReshape { shape });
    proto::ModelConfig {
        name: config.name.clone(),
        platform: "onnxruntime_onnx".into(),
        backend: "onnxruntime".into(),
        version_policy: Some(proto::ModelVersionPolicy {
            latest: Some(proto::model_version_policy::Latest { num_versions: 1 }),
        }),
        max_batch_size: i32::try_from(config.max_batch_size).unwrap_or(i32::MAX),
        input: config
            .inputs
            .iter()
            .map(|t| proto::ModelInput {
                name: t.name.clone(),
                data_type: data_type(t),
                format: match t.format {
                    None => proto::model_input::Format::None,
                    Some(inferd_config::model::Layout::Nchw) => proto::model_input::Format::Nchw,
                    Some(inferd_config::model::Layout::Nhwc) => proto::model_input::Format::Nhwc,
                } as i32,
                dims: t.dims.clone(),
                reshape: reshape(t),
                optional: t.optional,
            })
            .collect(),
        output: config
            .outputs
            .iter()
            .map(|t| proto::ModelOutput {
                name: t.name.clone(),
                data_type: data_type(t),
                dims: t.dims.clone(),
                reshape: reshape(t),
            })
            .collect(),
        instance_group: vec![proto::ModelInstanceGroup {
            name: config.name.clone(),
            count: 1,
            kind: proto::model_instance_group::Kind::Cpu as i32,
        }],
        default_model_filename: "model.onnx".into(),
        dynamic_batching: config
            .batching_delay_us
            .map(|delay| proto::ModelDynamicBatching { max_queue_delay_microseconds: delay }),
    }
}

/// A ModelInfer message's bytes, decoded and parsed as [`parse`] does (the fuzz target's
/// entry: fuzz/fuzz_targets/grpc_infer.rs).
pub fn parse_message(bytes: &[u8]) -> Result<Parsed, String> {
    let request = <proto::ModelInferRequest as prost::Message>::decode(bytes).map_err(|e| e.to_string())?;
    parse(request, &SharedMemory::NONE)
}

/// A ModelInferRequest as the REST parser's [`Parsed`]: every input typed and checked against
/// its own shape, from `raw_input_contents` (one entry per input not in shared memory), its
/// typed `contents` or a region of `shared` memory.
fn parse(request: proto::ModelInferRequest, shared: &SharedMemory) -> Result<Parsed, String> {
    let bytes = prost::Message::encoded_len(&request);
    let proto::ModelInferRequest { id, parameters, inputs, outputs, raw_input_contents, .. } = request;
    let params = |p: std::collections::HashMap<String, InferParameter>| -> Map<String, Value> {
        p.into_iter().map(|(k, v)| (k, parameter(v))).collect()
    };
    let mut placed = Vec::with_capacity(inputs.len());
    for mut input in inputs {
        let parameters = params(std::mem::take(&mut input.parameters));
        let place = crate::kserve::place_of(&format!("input '{}'", input.name), Some(&parameters))?;
        placed.push((input, place));
    }
    let unplaced = placed.iter().filter(|(_, place)| place.is_none()).count();
    if !raw_input_contents.is_empty() && raw_input_contents.len() != unplaced {
        return Err(format!(
            "raw_input_contents has {} entries for {unplaced} inputs not in shared memory; send one per such \
             input, in order, or none",
            raw_input_contents.len(),
        ));
    }
    let mut raw = raw_input_contents.into_iter();
    let mut tensors = Vec::with_capacity(placed.len());
    let mut taken = 0;
    for (input, place) in placed {
        let name = input.name;
        let data = match place {
            Some(place) => {
                if input.contents.is_some() {
                    return Err(format!("input '{name}' has contents and a shared memory region; send one of them"));
                }
                let bound = usize::try_from(place.byte_size).unwrap_or(usize::MAX);
                let (dtype, count) = kserve::declared(&name, &input.datatype, &input.shape, bound)?;
                let bytes = shared.read(&name, &place, &mut taken)?;
                dtype.parse_binary(&bytes, count).map_err(|e| format!("input '{name}': {e}"))?
            }
            None => {
                let (dtype, count) = kserve::declared(&name, &input.datatype, &input.shape, bytes)?;
                match (raw.next(), input.contents) {
                    (Some(bytes), None) => {
                        dtype.parse_binary(&bytes, count).map_err(|e| format!("input '{name}': {e}"))?
                    }
                    (Some(_), Some(_)) => {
                        return Err(format!(
                            "input '{name}' has both contents and raw_input_contents; send one of them"
                        ))
                    }
                    (None, Some(contents)) => typed(&name, dtype, count, contents)?,
                    (None, None) => {
                        return Err(format!("input '{name}' has no contents (and there are no raw_input_contents)"))
                    }
                }
            }
        };
        // gRPC carries bytes as bytes: an image pipeline takes them as they are (no base64).
        tensors.push(InputTensor { tensor: Tensor { name, shape: input.shape, data }, binary: true });
    }
    let outputs = match outputs.is_empty() {
        true => None,
        false => Some(
            outputs
                .into_iter()
                .map(|o| WantedOutput::of(o.name, Some(&params(o.parameters))))
                .collect::<Result<Vec<_>, String>>()?,
        ),
    };
    Ok(Parsed {
        id: Some(id).filter(|id| !id.is_empty()),
        parameters: params(parameters),
        inputs: tensors,
        outputs,
        binary_output: false,
    })
}

fn parameter(p: InferParameter) -> Value {
    match p.parameter_choice {
        Some(ParameterChoice::BoolParam(b)) => Value::from(b),
        Some(ParameterChoice::Int64Param(i)) => Value::from(i),
        Some(ParameterChoice::StringParam(s)) => Value::from(s),
        Some(ParameterChoice::DoubleParam(d)) => Value::from(d),
        Some(ParameterChoice::Uint64Param(u)) => Value::from(u),
        None => Value::Null,
    }
}

/// Typed contents: the field the datatype names, with exactly `count` values in range.
fn typed(name: &str, dtype: DataType, count: usize, c: InferTensorContents) -> Result<TensorData, String> {
    fn narrow<S: Copy + std::fmt::Display, T: TryFrom<S>>(
        name: &str,
        values: Vec<S>,
        kind: &str,
    ) -> Result<Vec<T>, String> {
        values
            .into_iter()
            .enumerate()
            .map(|(i, v)| {
                T::try_from(v)
                    .map_err(|_| format!("input '{name}': element {i} is {v}, which is not a valid {kind} value"))
            })
            .collect()
    }
    let (field, data) = match dtype {
        DataType::Bool => ("bool_contents", TensorData::Bool(c.bool_contents)),
        DataType::I8 => ("int_contents", TensorData::I8(narrow(name, c.int_contents, "INT8")?)),
        DataType::I16 => ("int_contents", TensorData::I16(narrow(name, c.int_contents, "INT16")?)),
        DataType::I32 => ("int_contents", TensorData::I32(c.int_contents)),
        DataType::I64 => ("int64_contents", TensorData::I64(c.int64_contents)),
        DataType::U8 => ("uint_contents", TensorData::U8(narrow(name, c.uint_contents, "UINT8")?)),
        DataType::U16 => ("uint_contents", TensorData::U16(narrow(name, c.uint_contents, "UINT16")?)),
        DataType::U32 => ("uint_contents", TensorData::U32(c.uint_contents)),
        DataType::U64 => ("uint64_contents", TensorData::U64(c.uint64_contents)),
        DataType::F32 => ("fp32_contents", TensorData::F32(c.fp32_contents)),
        DataType::F64 => ("fp64_contents", TensorData::F64(c.fp64_contents)),
        DataType::Bytes => ("bytes_contents", TensorData::Bytes(c.bytes_contents)),
        DataType::F16 => {
            return Err(format!("input '{name}': FP16 has no typed contents; send it in raw_input_contents"))
        }
    };
    if data.len() != count {
        return Err(format!("input '{name}': {} has {} values, the shape needs {count}", field, data.len()));
    }
    Ok(data)
}

/// The answer: every output in `raw_output_contents`, whatever the request used, as Triton
/// answers (its clients, the explicit-content examples included, read the outputs there).
fn encode(meta: &Model, inferred: Inferred) -> proto::ModelInferResponse {
    let Inferred { id, outputs, selection, .. } = inferred;
    let mut taken: Vec<Option<Tensor>> = outputs.into_iter().map(Some).collect();
    let mut response = proto::ModelInferResponse {
        model_name: meta.info.name.clone(),
        model_version: meta.info.version.clone(),
        id: id.unwrap_or_default(),
        ..Default::default()
    };
    for (i, delivery) in selection {
        let Some(t) = taken.get_mut(i).and_then(Option::take) else { continue };
        // An output written into shared memory keeps its (empty) place, as Triton's answer.
        response.raw_output_contents.push(match delivery {
            Delivery::SharedMemory(_) => Vec::new(),
            Delivery::Json | Delivery::Binary => t.data.to_binary(),
        });
        response.outputs.push(InferOutputTensor {
            name: t.name,
            datatype: t.data.dtype().name().into(),
            shape: t.shape,
            ..Default::default()
        });
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(
        name: &str,
        datatype: &str,
        shape: Vec<i64>,
        contents: Option<InferTensorContents>,
    ) -> proto::model_infer_request::InferInputTensor {
        proto::model_infer_request::InferInputTensor {
            name: name.into(),
            datatype: datatype.into(),
            shape,
            contents,
            ..Default::default()
        }
    }

    #[test]
    fn typed_and_raw_inputs_parse_alike() {
        let typed_request = proto::ModelInferRequest {
            inputs: vec![input(
                "x",
                "INT16",
                vec![1, 2],
                Some(InferTensorContents { int_contents: vec![-3, 300], ..Default::default() }),
            )],
            ..Default::default()
        };
        let raw_request = proto::ModelInferRequest {
            inputs: vec![input("x", "INT16", vec![1, 2], None)],
            raw_input_contents: vec![[(-3i16).to_le_bytes(), 300i16.to_le_bytes()].concat()],
            ..Default::default()
        };
        for request in [typed_request, raw_request] {
            let parsed = parse(request, &SharedMemory::NONE).unwrap();
            assert_eq!(parsed.inputs[0].tensor.data, TensorData::I16(vec![-3, 300]));
            assert_eq!(parsed.inputs[0].tensor.shape, vec![1, 2]);
        }
    }

    #[test]
    fn each_bad_input_is_named() {
        let contents = |v: Vec<i32>| Some(InferTensorContents { int_contents: v, ..Default::default() });
        let cases = [
            (vec![input("x", "INT8", vec![2], contents(vec![1, 200]))], vec![], "element 1 is 200"),
            (
                vec![input("x", "INT32", vec![3], contents(vec![1, 2]))],
                vec![],
                "int_contents has 2 values, the shape needs 3",
            ),
            (vec![input("x", "FP32", vec![2], contents(vec![1, 2]))], vec![], "fp32_contents has 0 values"),
            (vec![input("x", "FP16", vec![1], contents(vec![1]))], vec![], "raw_input_contents"),
            (vec![input("x", "FLOAT", vec![1], None)], vec![vec![0; 4]], "unknown datatype 'FLOAT'"),
            (vec![input("x", "FP32", vec![-1], None)], vec![vec![0; 4]], "must not be negative"),
            (vec![input("x", "FP32", vec![2], None)], vec![vec![0; 4]], "4 bytes of binary data for 2 elements"),
            (vec![input("x", "FP32", vec![1], None)], vec![], "has no contents"),
            (vec![input("x", "FP32", vec![1], contents(vec![]))], vec![vec![0; 4]], "both contents and raw"),
            (
                vec![input("x", "FP32", vec![1], None), input("y", "FP32", vec![1], None)],
                vec![vec![0; 4]],
                "1 entries for 2 inputs not in shared memory",
            ),
        ];
        for (inputs, raw_input_contents, message) in cases {
            let err = parse(
                proto::ModelInferRequest { inputs, raw_input_contents, ..Default::default() },
                &SharedMemory::NONE,
            )
            .unwrap_err();
            assert!(err.contains(message), "{err} (wanted {message})");
        }
    }

    #[test]
    fn every_output_goes_raw_as_triton_answers() {
        let t = |name: &str, data| Tensor { name: name.into(), shape: vec![1], data };
        let meta = crate::runtime::model::ModelMeta::for_tests("m", &[], &[]);
        let meta = Model { meta, pipeline: Arc::new(crate::pipeline::Pipeline::Raw) };
        let inferred = |outputs| Inferred {
            id: None,
            outputs,
            selection: vec![(0, Delivery::Json), (1, Delivery::Json)],
            outcome: None,
        };
        // Every output raw, as Triton answers, FP16 (which has no typed field) too.
        let half = TensorData::F16(vec![half::f16::from_f32(0.5)]);
        let raw = encode(&meta, inferred(vec![t("a", TensorData::F32(vec![1.0])), t("b", half)]));
        assert_eq!(
            raw.raw_output_contents,
            vec![1f32.to_le_bytes().to_vec(), half::f16::from_f32(0.5).to_le_bytes().to_vec()]
        );
        assert!(raw.outputs.iter().all(|o| o.contents.is_none()));
        let ints = encode(&meta, inferred(vec![t("a", TensorData::F32(vec![1.0])), t("b", TensorData::I64(vec![2]))]));
        assert_eq!(ints.raw_output_contents[1], 2i64.to_le_bytes().to_vec());
    }
}
