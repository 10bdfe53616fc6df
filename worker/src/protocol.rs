//! KServe v2 / Open Inference Protocol, REST with JSON tensors: request parsing, validation
//! against the model's declared inputs, and response bodies.
//!
//! Every validation error names the input or output and says what was expected, e.g.
//! `input 'input_ids': expected INT64, got FP32`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::model::{ModelMeta, Tensor, TensorSpec};
use crate::tensor::{element_count, DataType, TensorData};

#[derive(Debug, Deserialize)]
pub struct InferRequest {
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub parameters: Option<Map<String, Value>>,
    pub inputs: Vec<RequestInput>,
    #[serde(default)]
    pub outputs: Option<Vec<RequestOutput>>,
}

#[derive(Debug, Deserialize)]
pub struct RequestInput {
    pub name: String,
    pub shape: Vec<i64>,
    pub datatype: String,
    pub data: Value,
    #[serde(default)]
    pub parameters: Option<Map<String, Value>>,
}

#[derive(Debug, Deserialize)]
pub struct RequestOutput {
    pub name: String,
    #[serde(default)]
    pub parameters: Option<Map<String, Value>>,
}

#[derive(Debug, Serialize)]
pub struct InferResponse<'a> {
    pub model_name: &'a str,
    pub model_version: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub outputs: Vec<ResponseOutput>,
}

#[derive(Debug, Serialize)]
pub struct ResponseOutput {
    pub name: String,
    pub datatype: &'static str,
    pub shape: Vec<i64>,
    pub data: TensorData,
}

#[derive(Debug, Serialize)]
pub struct ModelMetadata<'a> {
    pub name: &'a str,
    pub versions: [&'a str; 1],
    pub platform: &'static str,
    pub inputs: &'a [TensorSpec],
    pub outputs: &'a [TensorSpec],
}

impl<'a> ModelMetadata<'a> {
    pub fn of(meta: &'a ModelMeta) -> Self {
        ModelMetadata {
            name: &meta.info.name,
            versions: [&meta.info.version],
            platform: "onnxruntime_onnx",
            inputs: &meta.inputs,
            outputs: &meta.outputs,
        }
    }
}

/// A request checked against the model: inputs in the model's order, and the outputs to return.
#[derive(Debug)]
pub struct ValidRequest {
    pub id: Option<String>,
    pub inputs: Vec<Tensor>,
    /// Indices into the model's outputs, in the order the client asked for them.
    pub outputs: Vec<usize>,
}

/// Parses the body of `POST /v2/models/{name}/infer`. The client may send no Content-Type
/// (tritonclient does not), so the body is always read as JSON.
pub fn parse_infer(body: &[u8], meta: &ModelMeta) -> Result<ValidRequest, String> {
    let request: InferRequest =
        serde_json::from_slice(body).map_err(|e| format!("request body is not a valid inference request: {e}"))?;
    validate(request, meta)
}

fn validate(request: InferRequest, meta: &ModelMeta) -> Result<ValidRequest, String> {
    let model = &meta.info.name;
    let names = |specs: &[TensorSpec]| specs.iter().map(|s| format!("'{}'", s.name)).collect::<Vec<_>>().join(", ");
    let mut given: Vec<Option<RequestInput>> = meta.inputs.iter().map(|_| None).collect();
    for input in request.inputs {
        let Some(i) = meta.inputs.iter().position(|s| s.name == input.name) else {
            return Err(format!("unknown input '{}'; model '{model}' has inputs {}", input.name, names(&meta.inputs)));
        };
        if given[i].is_some() {
            return Err(format!("input '{}' is given twice", input.name));
        }
        given[i] = Some(input);
    }
    let mut inputs = Vec::with_capacity(given.len());
    for (spec, input) in meta.inputs.iter().zip(given) {
        let Some(input) = input else {
            return Err(format!(
                "missing input '{}' ({} {}); model '{model}' needs {}",
                spec.name,
                spec.datatype,
                shape_text(&spec.shape),
                names(&meta.inputs)
            ));
        };
        inputs.push(tensor_from_request(input, spec)?);
    }
    let outputs = match request.outputs {
        None => (0..meta.outputs.len()).collect(),
        Some(wanted) => {
            let mut indices = Vec::with_capacity(wanted.len());
            for out in wanted {
                let Some(i) = meta.outputs.iter().position(|s| s.name == out.name) else {
                    return Err(format!(
                        "unknown output '{}'; model '{model}' has outputs {}",
                        out.name,
                        names(&meta.outputs)
                    ));
                };
                if !indices.contains(&i) {
                    indices.push(i);
                }
            }
            indices
        }
    };
    Ok(ValidRequest { id: request.id, inputs, outputs })
}

fn tensor_from_request(input: RequestInput, spec: &TensorSpec) -> Result<Tensor, String> {
    let name = &input.name;
    let expected = spec.dtype.expect("models with inputs inferd cannot feed are refused at load");
    let Some(got) = DataType::from_name(&input.datatype) else {
        let hint = if input.datatype == "BYTES" { " (BYTES tensors are not supported yet)" } else { "" };
        return Err(format!(
            "input '{name}': unknown datatype '{}'{hint}; expected {}",
            input.datatype,
            expected.name()
        ));
    };
    if got != expected {
        return Err(format!("input '{name}': expected {}, got {}", expected.name(), got.name()));
    }
    if input.shape.len() != spec.shape.len() {
        return Err(format!(
            "input '{name}': expected shape {} (rank {}), got {} (rank {})",
            shape_text(&spec.shape),
            spec.shape.len(),
            shape_text(&input.shape),
            input.shape.len()
        ));
    }
    for (axis, (&want, &have)) in spec.shape.iter().zip(&input.shape).enumerate() {
        if have < 0 {
            return Err(format!("input '{name}': dimension {axis} is {have}; dimensions must not be negative"));
        }
        if want >= 0 && want != have {
            return Err(format!(
                "input '{name}': dimension {axis} must be {want} (model shape {}), got {} ",
                shape_text(&spec.shape),
                shape_text(&input.shape)
            )
            .trim_end()
            .to_string());
        }
    }
    let Some(count) = element_count(&input.shape) else {
        return Err(format!("input '{name}': shape {} is too large", shape_text(&input.shape)));
    };
    // Flatten without allocating for `count`: the shape is only trusted once the data matches it.
    let mut flat = Vec::new();
    flatten(&input.data, &mut flat).map_err(|m| format!("input '{name}': {m}"))?;
    if flat.len() != count {
        return Err(format!(
            "input '{name}': shape {} needs {count} values, got {}",
            shape_text(&input.shape),
            flat.len()
        ));
    }
    let data = expected.parse_json(&flat).map_err(|(i, v)| {
        format!("input '{name}': element {i} is {v}, which is not a valid {} value", expected.name())
    })?;
    Ok(Tensor { name: input.name, shape: input.shape, data })
}

/// Accepts both the flat form and nested row-major arrays.
fn flatten<'a>(value: &'a Value, out: &mut Vec<&'a Value>) -> Result<(), String> {
    match value {
        Value::Array(items) => {
            for item in items {
                match item {
                    Value::Array(_) => flatten(item, out)?,
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

pub fn shape_text(shape: &[i64]) -> String {
    format!("[{}]", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(","))
}

/// Builds the response body from the model's outputs.
pub fn infer_response(meta: &ModelMeta, id: Option<String>, wanted: &[usize], mut outputs: Vec<Tensor>) -> Vec<u8> {
    let mut taken: Vec<Option<Tensor>> = outputs.drain(..).map(Some).collect();
    let outputs = wanted
        .iter()
        .filter_map(|&i| taken.get_mut(i).and_then(Option::take))
        .map(|t| ResponseOutput { datatype: t.data.dtype().name(), name: t.name, shape: t.shape, data: t.data })
        .collect();
    let body = InferResponse { model_name: &meta.info.name, model_version: &meta.info.version, id, outputs };
    serde_json::to_vec(&body).expect("tensor data always serialises")
}

#[cfg(test)]
mod tests {
    use super::*;
    use inferd_config::spec::ModelInfo;

    fn meta() -> ModelMeta {
        let spec = |name: &str, dt: DataType, shape: Vec<i64>| TensorSpec {
            name: name.into(),
            datatype: dt.name().into(),
            shape,
            dtype: Some(dt),
        };
        ModelMeta {
            info: ModelInfo { name: "m".into(), version: "1".into(), sha256: "00".into() },
            inputs: vec![spec("a", DataType::F32, vec![-1, 2]), spec("b", DataType::I64, vec![-1])],
            outputs: vec![spec("y", DataType::F32, vec![-1]), spec("z", DataType::F32, vec![-1])],
        }
    }

    fn parse(body: &str) -> Result<ValidRequest, String> {
        parse_infer(body.as_bytes(), &meta())
    }

    const A: &str = r#"{"name":"a","shape":[1,2],"datatype":"FP32","data":[[1,2]]}"#;
    const B: &str = r#"{"name":"b","shape":[1],"datatype":"INT64","data":[5]}"#;

    #[test]
    fn valid_request_is_ordered_like_the_model() {
        let r = parse(&format!(r#"{{"id":"7","inputs":[{B},{A}],"outputs":[{{"name":"z"}}]}}"#)).unwrap();
        assert_eq!(r.id.as_deref(), Some("7"));
        assert_eq!(r.inputs[0].name, "a");
        assert_eq!(r.inputs[0].data, TensorData::F32(vec![1.0, 2.0]));
        assert_eq!(r.outputs, vec![1]);
    }

    #[test]
    fn errors_name_the_input_and_the_expectation() {
        let wrong_type = A.replace("FP32", "INT32");
        let e = parse(&format!(r#"{{"inputs":[{wrong_type},{B}]}}"#)).unwrap_err();
        assert_eq!(e, "input 'a': expected FP32, got INT32");
        let e = parse(&format!(r#"{{"inputs":[{A}]}}"#)).unwrap_err();
        assert!(e.starts_with("missing input 'b' (INT64 [-1])"), "{e}");
        let e = parse(&format!(r#"{{"inputs":[{},{B}]}}"#, A.replace("[1,2]", "[1,3]"))).unwrap_err();
        assert!(e.contains("dimension 1 must be 2"), "{e}");
        let e = parse(&format!(r#"{{"inputs":[{},{B}]}}"#, A.replace("[[1,2]]", "[1]"))).unwrap_err();
        assert_eq!(e, "input 'a': shape [1,2] needs 2 values, got 1");
        let e = parse(&format!(r#"{{"inputs":[{A},{B}],"outputs":[{{"name":"q"}}]}}"#)).unwrap_err();
        assert!(e.contains("unknown output 'q'"), "{e}");
        let e = parse("{\"inputs\": [").unwrap_err();
        assert!(e.contains("not a valid inference request"), "{e}");
    }

    #[test]
    fn a_huge_shape_does_not_allocate() {
        let big = B.replace("\"shape\":[1]", "\"shape\":[1000000000]");
        let e = parse(&format!(r#"{{"inputs":[{A},{big}]}}"#)).unwrap_err();
        assert_eq!(e, "input 'b': shape [1000000000] needs 1000000000 values, got 1");
    }
}
