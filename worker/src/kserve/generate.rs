//! Triton's generate extension (`POST /v2/models/{model}/generate` and `/generate_stream`):
//! a flat JSON object instead of a tensor list. A member named as one of the model's inputs is
//! that input's data, a scalar or a flat list, shaped into the input's declared shape (fixed
//! dimensions as declared, the innermost variable one takes what is left, the other variable
//! ones 1); `id` is the request's id; `parameters` is an object of parameters; any other member
//! is a parameter too (a string, a number or a boolean). The answer is one object: `id` when
//! the request had one, `model_name`, `model_version`, and each output by name, a lone element
//! as itself, more as a flat list. Errors are in Triton's words, which its QA tests match.
// Sizes here come from request data: every operation on them is checked.
#![deny(clippy::arithmetic_side_effects)]

use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::kserve::{InputTensor, Parsed};
use crate::runtime::tensor::{DataType, Tensor, TensorSpec};

/// The request `body` stands for, given the inputs the model takes (`inputs`) and the bytes
/// its tensors may take in all once decoded (`max_bytes`, the body's own limit, as Triton's
/// `--http-max-input-size` bounds both). An empty body is an object without members.
pub fn parse(body: &[u8], inputs: &[TensorSpec], max_bytes: usize) -> Result<Parsed, String> {
    let members = match body.iter().all(u8::is_ascii_whitespace) {
        true => Vec::new(),
        false => {
            let Members(members) = serde_json::from_slice(body).map_err(|e| {
                format!("failed to parse the request JSON buffer: {e}: a generate request is an object")
            })?;
            members
        }
    };
    let parsed = Parsed { id: None, parameters: Map::new(), inputs: Vec::new(), outputs: None, binary_output: false };
    let mut request = Request { inputs, max_bytes, taken: 0, parsed };
    for (name, value) in members {
        match name.as_str() {
            "id" if request.input(&name).is_none() => {
                let id = value.as_str().ok_or("Unable to parse 'id': attempt to access JSON non-string as string")?;
                // Triton answers an empty id as none.
                request.parsed.id = Some(id.to_string()).filter(|id| !id.is_empty());
            }
            "parameters" if request.input(&name).is_none() => {
                let Value::Object(nested) = value else {
                    return Err("Expected JSON object for keyword: 'parameters'".into());
                };
                for (name, value) in nested {
                    request.member(name, value).map_err(|e| format!("Converting keyword: 'parameters': {e}"))?;
                }
            }
            _ => request.member(name, value)?,
        }
    }
    Ok(request.parsed)
}

/// The answer's body: `id` when the request had one, the model's name and version, and each
/// output by name.
pub fn response(model: &str, version: &str, id: Option<String>, outputs: Vec<Tensor>) -> Vec<u8> {
    let mut body = Map::new();
    if let Some(id) = id {
        body.insert("id".into(), Value::String(id));
    }
    body.insert("model_name".into(), Value::String(model.into()));
    body.insert("model_version".into(), Value::String(version.into()));
    for output in outputs {
        let value = match serde_json::to_value(&output.data).expect("tensor data always serialises") {
            Value::Array(mut items) if items.len() == 1 => items.remove(0),
            data => data,
        };
        body.insert(output.name, value);
    }
    serde_json::to_vec(&body).expect("a JSON object always serialises")
}

/// A request being read: the model's inputs, the bytes its tensors may take and have taken.
struct Request<'a> {
    inputs: &'a [TensorSpec],
    max_bytes: usize,
    taken: usize,
    parsed: Parsed,
}

impl Request<'_> {
    fn input(&self, name: &str) -> Option<&TensorSpec> {
        self.inputs.iter().find(|spec| spec.name == name)
    }

    /// A member: an input's data when it names one, a parameter otherwise.
    fn member(&mut self, name: String, value: Value) -> Result<(), String> {
        let Some(spec) = self.input(&name) else {
            return match value {
                Value::String(_) | Value::Number(_) | Value::Bool(_) => {
                    self.parsed.parameters.insert(name, value);
                    Ok(())
                }
                _ => Err(format!(
                    "parameter '{name}' has invalid type. It should be a string, a number or a boolean; \
                     '{name}' is not one of the model's inputs"
                )),
            };
        };
        let Some(dtype) = spec.dtype else {
            return Err(format!("input '{name}' has unsupported datatype {}", spec.datatype));
        };
        let shape_of = spec.shape.clone();
        if self.parsed.inputs.iter().any(|i| i.tensor.name == name) {
            return Err(format!("input '{name}' already exists in request"));
        }
        let items = match &value {
            Value::Array(items) => items.iter().collect(),
            one => vec![one],
        };
        // The tensor's bytes, bounded before it is decoded. As Triton counts a BYTES tensor: each
        // element's bytes and its 4-byte length (an element that is no string fails below).
        let bytes = match dtype.size() {
            None => items.iter().try_fold(0usize, |n, v| n.checked_add(v.as_str().map_or(0, str::len))?.checked_add(4)),
            Some(size) => items.len().checked_mul(size),
        }
        .unwrap_or(usize::MAX);
        let total = self.taken.checked_add(bytes).filter(|&total| total <= self.max_bytes).ok_or_else(|| {
            format!(
                "request size of {} bytes with input '{name}' of size {bytes} bytes exceeds the maximum allowed input \
                 size of {}. Use --http-max-input-size to increase the limit.",
                self.taken, self.max_bytes
            )
        })?;
        self.taken = total;
        let data = dtype.parse_json(&items).map_err(|(i, got)| {
            format!("Unable to parse 'data' of input '{name}': {} (element {i} is {got})", wrong_kind(dtype))
        })?;
        let shape = shape_into(&shape_of, items.len())
            .ok_or_else(|| format!("The schema can not convert input '{name}' to tensor with proper shape"))?;
        let tensor = Tensor { name, shape, data };
        self.parsed.inputs.push(InputTensor { tensor, binary: false });
        Ok(())
    }
}

/// Triton's words for a JSON value that is not of an input's element type.
fn wrong_kind(dtype: DataType) -> &'static str {
    match dtype {
        DataType::Bytes => "attempt to access JSON non-string as string",
        DataType::Bool => "attempt to access JSON non-boolean as boolean",
        DataType::I8 | DataType::I16 | DataType::I32 | DataType::I64 => {
            "attempt to access JSON non-signed-integer as signed-integer"
        }
        DataType::U8 | DataType::U16 | DataType::U32 | DataType::U64 => {
            "attempt to access JSON non-unsigned-integer as unsigned-integer"
        }
        DataType::F16 | DataType::F32 | DataType::F64 => "attempt to access JSON non-number as double",
    }
}

/// `count` elements in `declared`'s shape: its fixed dimensions as they are, the innermost
/// variable one what they leave, the other variable ones 1; None where they cannot hold it.
fn shape_into(declared: &[i64], count: usize) -> Option<Vec<i64>> {
    let fixed =
        declared.iter().filter(|&&d| d >= 0).try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?))?;
    let innermost = declared.iter().rposition(|&d| d < 0);
    let left = match innermost {
        None => return (fixed == count).then(|| declared.to_vec()),
        Some(_) if fixed == 0 => {
            return (count == 0).then(|| declared.iter().map(|&d| if d < 0 { 1 } else { d }).collect())
        }
        Some(_) if !count.is_multiple_of(fixed) => return None,
        Some(_) => i64::try_from(count.checked_div(fixed)?).ok()?,
    };
    let fill = |(axis, &d): (usize, &i64)| match d {
        d if d >= 0 => d,
        _ if Some(axis) == innermost => left,
        _ => 1,
    };
    Some(declared.iter().enumerate().map(fill).collect())
}

/// A JSON object's members in the order written, a name given twice kept twice (Triton refuses
/// an input given twice, where a map would keep the last silently).
struct Members(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Members {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Members, D::Error> {
        struct Each;
        impl<'de> Visitor<'de> for Each {
            type Value = Members;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry::<String, Value>()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(Each)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::tensor::TensorData;

    fn spec(name: &str, dtype: DataType, shape: &[i64]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            datatype: dtype.name().into(),
            shape: shape.to_vec(),
            dtype: Some(dtype),
            first_dim: String::new(),
            optional: false,
        }
    }

    fn llm() -> Vec<TensorSpec> {
        vec![spec("PROMPT", DataType::Bytes, &[1, 1]), spec("STREAM", DataType::Bool, &[1, 1])]
    }

    #[test]
    fn members_are_inputs_shaped_as_declared_or_parameters() {
        let body = br#"{"PROMPT": "hello", "STREAM": false, "id": "42", "REPETITION": 3, "parameters": {"t": 0.5}}"#;
        let parsed = parse(body, &llm(), 1 << 20).unwrap();
        assert_eq!(parsed.id.as_deref(), Some("42"));
        assert_eq!(parsed.inputs[0].tensor.shape, [1, 1]);
        assert_eq!(parsed.inputs[0].tensor.data, TensorData::Bytes(vec![b"hello".to_vec()]));
        assert_eq!(parsed.inputs[1].tensor.data, TensorData::Bool(vec![false]));
        assert_eq!(parsed.parameters["REPETITION"], 3);
        assert_eq!(parsed.parameters["t"], 0.5);
        let ids = [spec("ids", DataType::I64, &[-1, -1]), spec("pair", DataType::F32, &[-1, 2])];
        let parsed = parse(br#"{"ids": [1, 2, 3], "pair": [1, 2, 3, 4]}"#, &ids, 1 << 20).unwrap();
        assert_eq!(parsed.inputs[0].tensor.shape, [1, 3]);
        assert_eq!(parsed.inputs[1].tensor.shape, [2, 2]);
        assert_eq!(parse(b" ", &llm(), 1 << 20).unwrap().inputs.len(), 0);
        assert_eq!(parse(br#"{"PROMPT": "x", "id": ""}"#, &llm(), 1 << 20).unwrap().id, None);
    }

    #[test]
    fn what_does_not_fit_is_refused_in_tritons_words() {
        let err = |body: &str| parse(body.as_bytes(), &llm(), 1 << 20).unwrap_err();
        assert!(err(r#"{"PROMPT": 123}"#).contains("attempt to access JSON non-string as string"));
        assert!(err(r#"{"PROMPT": "x", "STREAM": "false"}"#).contains("non-boolean as boolean"));
        assert!(err(r#"{"PROMPT": {"USER": "x"}}"#).contains("non-string as string"));
        assert!(err(r#"{"PROMPT": "a", "PROMPT": "b"}"#).contains("input 'PROMPT' already exists in request"));
        assert!(err(r#"{"P": {"a": 1}}"#).contains("parameter 'P' has invalid type"));
        assert!(err(r#"{"parameters": 1}"#).contains("Expected JSON object for keyword: 'parameters'"));
        let nested = err(r#"{"parameters": {"nested": {"twice": 1}}}"#);
        assert!(nested.contains("Converting keyword: 'parameters': parameter 'nested' has invalid type."), "{nested}");
        assert!(err(r#"{"PROMPT": ["a", "b"]}"#).contains("can not convert input 'PROMPT' to tensor with proper shape"));
        assert!(err("[1]").contains("failed to parse the request JSON buffer"));
        let wide = [spec("x", DataType::I64, &[-1])];
        let over = parse(br#"{"x": [1, 2, 3]}"#, &wide, 16).unwrap_err();
        assert!(over.contains("input 'x' of size 24 bytes exceeds the maximum allowed input size of 16"), "{over}");
    }

    #[test]
    fn shapes_fill_the_innermost_variable_dimension() {
        assert_eq!(shape_into(&[-1, -1], 5), Some(vec![1, 5]));
        assert_eq!(shape_into(&[-1, 3, -1], 6), Some(vec![1, 3, 2]));
        assert_eq!(shape_into(&[2, 2], 4), Some(vec![2, 2]));
        assert_eq!(shape_into(&[2, 2], 3), None);
        assert_eq!(shape_into(&[-1, 4], 6), None);
        assert_eq!(shape_into(&[-1, 0], 0), Some(vec![1, 0]));
        assert_eq!(shape_into(&[-1], 0), Some(vec![0]));
    }

    #[test]
    fn the_answer_names_each_output_a_lone_element_as_itself() {
        let text = Tensor { name: "TEXT".into(), shape: vec![1, 1], data: TensorData::Bytes(vec![b"hi".to_vec()]) };
        let sum = Tensor { name: "SUM".into(), shape: vec![2], data: TensorData::I32(vec![1, 2]) };
        let body: Value = serde_json::from_slice(&response("m", "1", Some("7".into()), vec![text, sum])).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"id": "7", "model_name": "m", "model_version": "1", "TEXT": "hi", "SUM": [1, 2]})
        );
    }
}
