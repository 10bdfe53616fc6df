//! KServe v2 / Open Inference Protocol over REST: a request body (JSON tensors and the binary
//! tensor data extension) into a [`Parsed`] request, and the response bodies. What a parsed
//! request means (its inputs checked against the model's, its outputs chosen) is the request
//! layer's ([`crate::request::infer`]), shared with gRPC. Below the protocol surface: the
//! int8 guard's calibration file holds such requests too.
//!
//! Every error names the input and says what was expected, e.g. `input 'a': shape [1,2]
//! needs 2 values, got 1`.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::kserve::{place_of, Delivery, InputTensor, Parsed, SharedMemory, WantedOutput};
use crate::runtime::model::ModelMeta;
use crate::runtime::tensor::{element_count, shape_text, DataType, Tensor, TensorData, TensorSpec};

/// Header of the binary tensor data extension: the length of the JSON part of the body.
pub const HEADER_LENGTH: &str = "inference-header-content-length";

#[derive(Debug, Deserialize)]
#[serde(expecting = "a JSON object")]
struct InferRequest {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    inputs: Vec<RequestInput>,
    #[serde(default)]
    outputs: Option<Vec<RequestOutput>>,
}

#[derive(Debug, Deserialize)]
#[serde(expecting = "an input: an object with name, shape, datatype and data")]
struct RequestInput {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    data: Option<Value>,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
}

#[derive(Debug, Deserialize)]
#[serde(expecting = "an output: an object with a name")]
struct RequestOutput {
    name: String,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
}

/// Parses an infer request body. `header_length` is the value of
/// `Inference-Header-Content-Length`: the JSON is that many bytes, binary tensor data follows.
/// The body is read as JSON whatever its Content-Type (tritonclient sends none). An input may
/// instead name a region of `shared` memory its bytes are in.
pub fn parse(body: &[u8], header_length: Option<usize>, shared: &SharedMemory) -> Result<Parsed, String> {
    let (json, mut binary) = match header_length {
        None => (body, &[][..]),
        Some(n) if n <= body.len() => body.split_at(n),
        Some(n) => {
            return Err(format!("Inference-Header-Content-Length is {n}, but the body has {} bytes", body.len()))
        }
    };
    let request: InferRequest =
        crate::jsonbody::parse(json).map_err(|e| format!("request body is not a valid inference request: {e}"))?;
    let mut inputs = Vec::with_capacity(request.inputs.len());
    let mut taken = 0;
    for input in request.inputs {
        let name = input.name;
        let place = place_of(&format!("input '{name}'"), input.parameters.as_ref())?;
        let binary_size = input.parameters.as_ref().and_then(|p| p.get("binary_data_size"));
        let (data, is_binary) = match (place, binary_size, &input.data) {
            (Some(place), None, None) => {
                // Every element takes a byte of the region at least, as of a body.
                let bound = usize::try_from(place.byte_size).unwrap_or(usize::MAX);
                let (dtype, count) = declared(&name, &input.datatype, &input.shape, bound)?;
                let bytes = shared.read(&name, &place, &mut taken)?;
                (dtype.parse_binary(&bytes, count).map_err(|e| format!("input '{name}': {e}"))?, true)
            }
            (None, Some(size), None) => {
                let (dtype, count) = declared(&name, &input.datatype, &input.shape, body.len())?;
                let size = size.as_u64().ok_or_else(|| format!("input '{name}': binary_data_size must be a number"))?;
                if size as usize > binary.len() {
                    return Err(format!(
                        "input '{name}': binary_data_size is {size}, but only {} bytes of binary data are left",
                        binary.len()
                    ));
                }
                let (mine, rest) = binary.split_at(size as usize);
                binary = rest;
                (dtype.parse_binary(mine, count).map_err(|e| format!("input '{name}': {e}"))?, true)
            }
            (None, None, Some(value)) => {
                let (dtype, count) = declared(&name, &input.datatype, &input.shape, body.len())?;
                (json_data(&name, value, dtype, &input.shape, count)?, false)
            }
            (place, size, data) => {
                let set: Vec<&str> = [(data.is_some(), "'data'"), (size.is_some(), "'binary_data_size'")]
                    .into_iter()
                    .chain([(place.is_some(), "'shared_memory_region'")])
                    .filter_map(|(set, field)| set.then_some(field))
                    .collect();
                return Err(format!(
                    "input '{name}': Input must set only one of the following fields: 'data', 'binary_data_size' in \
                     'parameters', 'shared_memory_region' in 'parameters'. But {}",
                    match set.is_empty() {
                        true => "no field is set".to_string(),
                        false => format!("set {}", set.join(" ")),
                    }
                ));
            }
        };
        inputs.push(InputTensor { tensor: Tensor { name, shape: input.shape, data }, binary: is_binary });
    }
    if !binary.is_empty() {
        return Err(format!("{} bytes of binary data are left over after the inputs' binary_data_size", binary.len()));
    }
    let parameters = request.parameters.unwrap_or_default();
    let flag = |p: &Map<String, Value>, key: &str| p.get(key).and_then(Value::as_bool);
    let outputs = match request.outputs {
        None => None,
        Some(outs) => Some(
            outs.into_iter()
                .map(|o| WantedOutput::of(o.name, o.parameters.as_ref()))
                .collect::<Result<Vec<_>, String>>()?,
        ),
    };
    let binary_output = flag(&parameters, "binary_data_output").unwrap_or(false);
    Ok(Parsed { id: request.id, inputs, outputs, binary_output, parameters })
}

/// An input's declared datatype and element count, checked (REST and gRPC alike). Every
/// element takes at least one byte of the request (`1,` in JSON, one byte or more in binary
/// and protobuf), so a shape of more than `request_bytes` elements is refused before any size
/// is computed from it: a count that passes times any element size cannot overflow.
pub fn declared(name: &str, datatype: &str, shape: &[i64], request_bytes: usize) -> Result<(DataType, usize), String> {
    let Some(dtype) = DataType::from_name(datatype) else {
        return Err(format!("input '{name}': unknown datatype '{datatype}'"));
    };
    if let Some(axis) = shape.iter().position(|&d| d < 0) {
        // Triton's words (its JSON reader's, which it answers with 500; a bad request is a 400).
        return Err(format!(
            "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as unsigned-integer: input \
             '{name}': dimension {axis} is {}; dimensions must not be negative",
            shape[axis]
        ));
    }
    // Triton's words where its checks would refuse the shape too (qa/L0_http's overflow tests).
    let count = element_count(shape).filter(|&c| i64::try_from(c).is_ok()).ok_or_else(|| {
        format!(
            "invalid shape for input '{name}': shape {} causes total element count to exceed maximum size of {}",
            shape_text(shape),
            i64::MAX
        )
    })?;
    if let Some(size) = dtype.size().filter(|&size| count.checked_mul(size).is_none_or(|b| i64::try_from(b).is_err())) {
        return Err(format!(
            "byte size overflow for input '{name}': element count ({count}) * data type size ({size}) exceeds \
             maximum allowed size ({})",
            i64::MAX
        ));
    }
    match count <= request_bytes {
        true => Ok((dtype, count)),
        false => Err(format!(
            "input '{name}': shape {} has more elements than the request's {request_bytes} bytes can carry",
            shape_text(shape)
        )),
    }
}

fn json_data(name: &str, value: &Value, dtype: DataType, shape: &[i64], count: usize) -> Result<TensorData, String> {
    // Flatten without allocating for `count`: the shape is only trusted once the data matches it.
    let mut flat = Vec::new();
    flatten(value, &mut flat, 1).map_err(|m| format!("input '{name}': {m}"))?;
    if flat.len() != count {
        return Err(format!("input '{name}': shape {} needs {count} values, got {}", shape_text(shape), flat.len()));
    }
    dtype
        .parse_json(&flat)
        .map_err(|(i, v)| format!("input '{name}': element {i} is {v}, which is not a valid {} value", dtype.name()))
}

/// Accepts both the flat form and nested row-major arrays.
/// How deep a tensor's `data` may nest (Triton's limit for a request's JSON): a shape has no
/// more dimensions than this, and the recursion below stays bounded.
const MAX_DEPTH: usize = 100;

/// `value`'s elements in order, `depth` arrays deep.
fn flatten<'a>(value: &'a Value, out: &mut Vec<&'a Value>, depth: usize) -> Result<(), String> {
    if depth > MAX_DEPTH {
        return Err(format!("JSON nesting depth exceeds maximum allowed limit ({MAX_DEPTH})"));
    }
    match value {
        Value::Array(items) => {
            for item in items {
                match item {
                    Value::Array(_) => flatten(item, out, depth.saturating_add(1))?,
                    other => out.push(other),
                }
            }
            Ok(())
        }
        other => Err(format!("'data' must be an array, got {}", kind(other))),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[derive(Serialize)]
struct InferResponse<'a> {
    model_name: &'a str,
    model_version: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    outputs: Vec<ResponseOutput>,
}

#[derive(Serialize)]
struct ResponseOutput {
    name: String,
    datatype: &'static str,
    shape: Vec<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parameters: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<TensorData>,
}

/// The response body, and the JSON part's length when binary data follows it (the value of
/// the `Inference-Header-Content-Length` response header).
pub fn infer_response(
    meta: &ModelMeta,
    id: Option<String>,
    outputs: Vec<Tensor>,
    selection: &[(usize, Delivery)],
) -> (Vec<u8>, Option<usize>) {
    let mut taken: Vec<Option<Tensor>> = outputs.into_iter().map(Some).collect();
    let mut binary = Vec::new();
    let mut json_outputs = Vec::with_capacity(selection.len());
    for (i, delivery) in selection {
        let Some(t) = taken.get_mut(*i).and_then(Option::take) else { continue };
        let datatype = t.data.dtype().name();
        let (parameters, data) = match delivery {
            Delivery::Binary => {
                let bytes = t.data.to_binary();
                binary.extend_from_slice(&bytes);
                (Some(serde_json::json!({ "binary_data_size": bytes.len() })), None)
            }
            Delivery::Json => (None, Some(t.data)),
            // Written there already (`request::infer`): named, as Triton's answer names it.
            Delivery::SharedMemory(_) => (None, None),
        };
        json_outputs.push(ResponseOutput { name: t.name, datatype, shape: t.shape, parameters, data });
    }
    let body =
        InferResponse { model_name: &meta.info.name, model_version: &meta.info.version, id, outputs: json_outputs };
    let mut bytes = serde_json::to_vec(&body).expect("tensor data always serialises");
    if selection.iter().any(|(_, d)| *d == Delivery::Binary) {
        let header = bytes.len();
        bytes.extend_from_slice(&binary);
        (bytes, Some(header))
    } else {
        (bytes, None)
    }
}

#[derive(Debug, Serialize)]
pub struct ModelMetadata<'a> {
    pub name: &'a str,
    pub versions: [&'a str; 1],
    /// inferd's extension: the version label plus a hash of the model file.
    pub inferd_version: String,
    pub platform: &'static str,
    pub inputs: &'a [TensorSpec],
    pub outputs: &'a [TensorSpec],
    /// inferd's extension: the pre/post-processing in front of the model, if any, and the
    /// tensors it takes and returns through `/infer`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<Value>,
}

impl<'a> ModelMetadata<'a> {
    pub fn of(meta: &'a ModelMeta, pipeline: Option<Value>) -> Self {
        ModelMetadata {
            name: &meta.info.name,
            versions: [&meta.info.version],
            inferd_version: meta.info.full_version(),
            platform: "onnxruntime_onnx",
            inputs: &meta.inputs,
            outputs: &meta.outputs,
            pipeline,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kserve::select_outputs;
    use crate::runtime::tensor::validate_inputs;

    fn meta() -> ModelMeta {
        ModelMeta::for_tests(
            "m",
            &[("a", DataType::F32, &[-1, 2]), ("b", DataType::I64, &[-1])],
            &[("y", DataType::F32, &[-1]), ("z", DataType::F32, &[-1])],
        )
    }

    /// (id, inputs, output selection).
    type Checked = (Option<String>, Vec<Tensor>, Vec<(usize, Delivery)>);

    /// Parses and validates like the raw `/infer` path.
    fn parse_raw(body: &str) -> Result<Checked, String> {
        let meta = meta();
        let parsed = parse(body.as_bytes(), None, &SharedMemory::NONE)?;
        let available: Vec<&str> = meta.outputs.iter().map(|o| o.name.as_str()).collect();
        let selection = select_outputs(&parsed, &available, "m")?;
        let id = parsed.id.clone();
        let given = parsed.inputs.into_iter().map(|input| input.tensor).collect();
        Ok((id, validate_inputs(given, &meta.inputs, "m")?, selection))
    }

    const A: &str = r#"{"name":"a","shape":[1,2],"datatype":"FP32","data":[[1,2]]}"#;
    const B: &str = r#"{"name":"b","shape":[1],"datatype":"INT64","data":[5]}"#;

    #[test]
    fn valid_request_is_ordered_like_the_model() {
        let (id, inputs, outputs) =
            parse_raw(&format!(r#"{{"id":"7","inputs":[{B},{A}],"outputs":[{{"name":"z"}}]}}"#)).unwrap();
        assert_eq!(id.as_deref(), Some("7"));
        assert_eq!(inputs[0].name, "a");
        assert_eq!(inputs[0].data, TensorData::F32(vec![1.0, 2.0]));
        assert_eq!(outputs, vec![(1, Delivery::Json)]);
    }

    #[test]
    fn errors_name_the_input_and_the_expectation() {
        let wrong_type = A.replace("FP32", "INT32");
        let e = parse_raw(&format!(r#"{{"inputs":[{wrong_type},{B}]}}"#)).unwrap_err();
        assert_eq!(e, "input 'a': expected FP32, got INT32");
        let e = parse_raw(&format!(r#"{{"inputs":[{A}]}}"#)).unwrap_err();
        assert!(
            e.contains(
                "expected 2 inputs but got 1 inputs for model 'm'. Got input(s) ['a'], but missing required input(s) \
                 ['b']. Please provide all required input(s). The first missing is input 'b' (INT64 [-1])"
            ),
            "{e}"
        );
        let wider = A.replace("[1,2],", "[1,3],").replace("[[1,2]]", "[[1,2,3]]");
        let e = parse_raw(&format!(r#"{{"inputs":[{wider},{B}]}}"#)).unwrap_err();
        assert!(e.contains("dimension 1 must be 2"), "{e}");
        let e = parse_raw(&format!(r#"{{"inputs":[{},{B}]}}"#, A.replace("[[1,2]]", "[1]"))).unwrap_err();
        assert_eq!(e, "input 'a': shape [1,2] needs 2 values, got 1");
        let e = parse_raw(&format!(r#"{{"inputs":[{A},{B}],"outputs":[{{"name":"q"}}]}}"#)).unwrap_err();
        assert!(e.contains("unknown output 'q'"), "{e}");
        let e = parse_raw("{\"inputs\": [").unwrap_err();
        assert!(e.contains("not a valid inference request"), "{e}");
    }

    #[test]
    fn binary_inputs_and_outputs() {
        let json = r#"{"inputs":[{"name":"a","shape":[1,2],"datatype":"FP32","parameters":{"binary_data_size":8}},
            {"name":"b","shape":[1],"datatype":"INT64","data":[5]}],"parameters":{"binary_data_output":true},
            "outputs":[{"name":"z","parameters":{"binary_data":false}},{"name":"y"}]}"#;
        let mut body = json.as_bytes().to_vec();
        body.extend_from_slice(&TensorData::F32(vec![1.5, -2.0]).to_binary());
        let parsed = parse(&body, Some(json.len()), &SharedMemory::NONE).unwrap();
        assert!(parsed.inputs[0].binary && !parsed.inputs[1].binary);
        assert_eq!(parsed.inputs[0].tensor.data, TensorData::F32(vec![1.5, -2.0]));
        assert_eq!(
            select_outputs(&parsed, &["y", "z"], "m").unwrap(),
            vec![(1, Delivery::Json), (0, Delivery::Binary)]
        );

        // Triton's refusals of an output both in shared memory and binary, or classified.
        for (params, refusal) in [
            (r#""binary_data": true"#, "can't set both 'shared_memory_region' and 'binary_data'"),
            (r#""classification": 2"#, "can't set both 'shared_memory_region' and 'classification'"),
        ] {
            let both = format!(
                r#"{{"inputs": [{B}], "outputs": [{{"name": "y", "parameters": {{"shared_memory_region": "r",
                    "shared_memory_byte_size": 8, {params}}}}}]}}"#
            );
            let parsed = parse(both.as_bytes(), None, &SharedMemory::NONE).unwrap();
            let e = select_outputs(&parsed, &["y", "z"], "m").unwrap_err();
            assert!(e.contains(refusal), "{e}");
        }
        let e = parse(&body[..body.len() - 1], Some(json.len()), &SharedMemory::NONE).unwrap_err();
        assert!(e.contains("binary_data_size is 8, but only 7 bytes"), "{e}");
        let mut extra = body.clone();
        extra.push(0);
        assert!(parse(&extra, Some(json.len()), &SharedMemory::NONE)
            .unwrap_err()
            .contains("1 bytes of binary data are left over"));
        assert!(parse(&body, Some(body.len() + 1), &SharedMemory::NONE)
            .unwrap_err()
            .contains("Inference-Header-Content-Length"));

        let out = vec![
            Tensor { name: "y".into(), shape: vec![1], data: TensorData::F32(vec![3.0]) },
            Tensor { name: "z".into(), shape: vec![1], data: TensorData::F32(vec![4.0]) },
        ];
        let (bytes, header) = infer_response(&meta(), None, out, &[(1, Delivery::Json), (0, Delivery::Binary)]);
        let header = header.unwrap();
        let head: Value = serde_json::from_slice(&bytes[..header]).unwrap();
        assert_eq!(head["outputs"][0]["data"], serde_json::json!([4.0]));
        assert_eq!(head["outputs"][1]["parameters"]["binary_data_size"], 4);
        assert_eq!(&bytes[header..], &3.0f32.to_le_bytes());
    }

    #[test]
    fn a_huge_shape_does_not_allocate() {
        let big = B.replace("\"shape\":[1]", "\"shape\":[1000000000]");
        let body = format!(r#"{{"inputs":[{A},{big}]}}"#);
        let e = parse_raw(&body).unwrap_err();
        let want = format!(
            "input 'b': shape [1000000000] has more elements than the request's {} bytes can carry",
            body.len()
        );
        assert_eq!(e, want);
        // Within the request's size, a shape the data does not fill is still named.
        let short = B.replace("\"shape\":[1]", "\"shape\":[3]");
        let e = parse_raw(&format!(r#"{{"inputs":[{A},{short}]}}"#)).unwrap_err();
        assert_eq!(e, "input 'b': shape [3] needs 3 values, got 1");
    }

    #[test]
    fn binary_sizes_that_overflow_are_refused() {
        // 2^61 elements of 8 bytes: their byte count wraps to 0 in a release build.
        assert!(DataType::I64.parse_binary(&[], 1 << 61).is_err());
        assert!(DataType::Bytes.parse_binary(&u32::MAX.to_le_bytes(), 1).is_err());
        // Triton's words for a count past i64, and for bytes past it (qa/L0_http's overflow test).
        let e = declared("x", "FP32", &[16, (1 << 60) + 2], 1 << 20).unwrap_err();
        assert!(e.contains("causes total element count to exceed maximum size of"), "{e}");
        let e = declared("x", "INT64", &[1, 1 << 61], 1 << 20).unwrap_err();
        assert!(
            e.starts_with("byte size overflow for input 'x': element count (2305843009213693952) * data type"),
            "{e}"
        );
        let e = declared("x", "INT64", &[1, 1 << 40], 1 << 20).unwrap_err();
        assert!(e.contains("more elements than the request's 1048576 bytes"), "{e}");
    }

    #[test]
    fn data_nested_past_the_limit_is_refused() {
        let nested = |depth: usize| format!("{}5{}", "[".repeat(depth), "]".repeat(depth));
        let body = |depth| {
            format!(r#"{{"inputs":[{A},{{"name":"b","shape":[1],"datatype":"INT64","data":{}}}]}}"#, nested(depth))
        };
        assert!(parse_raw(&body(50)).is_ok());
        let e = parse_raw(&body(101)).unwrap_err();
        assert_eq!(e, "input 'b': JSON nesting depth exceeds maximum allowed limit (100)");
    }
}
