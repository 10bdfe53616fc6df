//! Triton's raw binary request: `Inference-Header-Content-Length: 0` says the body holds no
//! JSON, only the binary data of the model's one input, whose datatype comes from the model
//! and whose shape is deduced from the body's size. That takes a model of one input with at
//! most one variable dimension besides its batch (a BYTES input: one element, the whole body).
//! A model with a batch dimension gets a batch of one. Every output goes back as binary data.
// Sizes here come from request data: every operation on them is checked.
#![deny(clippy::arithmetic_side_effects)]

use serde_json::Map;

use crate::kserve::{InputTensor, Parsed};
use crate::runtime::model::ModelMeta;
use crate::runtime::tensor::{shape_text, Tensor, TensorData};

/// The request a raw binary `body` stands for, for `meta`'s model; an error says why the model
/// or the body does not allow it, in the client's terms.
pub fn parse(body: &[u8], meta: &ModelMeta) -> Result<Parsed, String> {
    let [input] = meta.inputs.as_slice() else {
        return Err(format!(
            "Raw request must only have 1 input (found 1) to be deduced but got {} inputs in '{}' model \
             configuration: a raw binary request (Inference-Header-Content-Length: 0) carries one input's bytes",
            meta.inputs.len(),
            meta.info.name
        ));
    };
    let name = &input.name;
    let Some(dtype) = input.dtype else {
        return Err(format!("raw input '{name}': inferd cannot carry its datatype {}", input.datatype));
    };
    // The dimensions the body must fill: the batch dimension, where there is one, is 1.
    let batched = meta.batch_rows().is_ok();
    let rest = match batched {
        true => input.shape.get(1..).unwrap_or_default(),
        false => input.shape.as_slice(),
    };
    let (filled, data) = match dtype.size() {
        None => (bytes_shape(name, rest)?, TensorData::Bytes(vec![body.to_vec()])),
        Some(size) => {
            let filled = fixed_shape(name, rest, size, body.len())?;
            let count = body.len().checked_div(size).unwrap_or(0);
            (filled, dtype.parse_binary(body, count).map_err(|e| format!("raw input '{name}': {e}"))?)
        }
    };
    let shape: Vec<i64> = batched.then_some(1).into_iter().chain(filled).collect();
    let tensor = Tensor { name: name.clone(), shape, data };
    Ok(Parsed {
        id: None,
        parameters: Map::new(),
        inputs: vec![InputTensor { tensor, binary: true }],
        outputs: None,
        binary_output: true,
    })
}

/// A BYTES input takes the body as its one element: its shape (less the batch) must be [1].
fn bytes_shape(name: &str, shape: &[i64]) -> Result<Vec<i64>, String> {
    match shape {
        [1] => Ok(vec![1]),
        _ => Err(format!(
            "For BYTE datatype raw input '{name}', the model must have input shape [1] (besides a batch \
             dimension), not {}",
            shape_text(shape)
        )),
    }
}

/// The shape of `len` bytes of elements of `size` bytes: the model's fixed dimensions as they
/// are, its one variable dimension (if any) what the rest of the bytes make.
fn fixed_shape(name: &str, shape: &[i64], size: usize, len: usize) -> Result<Vec<i64>, String> {
    let variable = shape.iter().filter(|&&d| d < 0).count();
    if variable > 1 {
        return Err(format!(
            "The shape of the raw input '{name}' can not be deduced because there are more than one \
             variable-sized dimension: the model's input shape {} has {variable} besides a batch dimension",
            shape_text(shape)
        ));
    }
    let fixed = shape.iter().filter(|&&d| d >= 0).try_fold(size, |n, &d| n.checked_mul(usize::try_from(d).ok()?));
    let whole = |fixed: usize| fixed != 0 && len.is_multiple_of(fixed);
    match fixed {
        Some(fixed) if variable == 1 && whole(fixed) => {
            let free = len
                .checked_div(fixed)
                .and_then(|n| i64::try_from(n).ok())
                .ok_or_else(|| format!("raw input '{name}' is too large"))?;
            Ok(shape.iter().map(|&d| if d < 0 { free } else { d }).collect())
        }
        Some(fixed) if variable == 0 && fixed == len => Ok(shape.to_vec()),
        _ => Err(format!(
            "raw input '{name}': {len} bytes do not fill the model's input shape {} of {size}-byte elements",
            shape_text(shape)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::tensor::DataType;

    fn model(inputs: &[(&str, DataType, &[i64])], max_batch_size: Option<usize>) -> ModelMeta {
        let mut meta = ModelMeta::for_tests("m", inputs, &inputs[..1]);
        meta.batching.max_batch_size = max_batch_size;
        meta
    }

    #[test]
    fn a_fixed_size_input_takes_its_variable_dimension_from_the_body() {
        let body: Vec<u8> = (0..8).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let parsed = parse(&body, &model(&[("x", DataType::F32, &[-1, -1])], Some(8))).unwrap();
        assert_eq!(parsed.inputs[0].tensor.shape, [1, 8]);
        assert_eq!(parsed.inputs[0].tensor.data, TensorData::F32((0..8).map(|i| i as f32).collect()));
        assert!(parsed.binary_output && parsed.outputs.is_none());
        let parsed = parse(&body, &model(&[("x", DataType::F32, &[2, -1])], Some(0))).unwrap();
        assert_eq!(parsed.inputs[0].tensor.shape, [2, 4]);
        let parsed = parse(&body, &model(&[("x", DataType::F32, &[8])], Some(0))).unwrap();
        assert_eq!(parsed.inputs[0].tensor.shape, [8]);
    }

    #[test]
    fn a_bytes_input_is_the_whole_body_as_one_element() {
        let parsed = parse(b"4\x0027", &model(&[("s", DataType::Bytes, &[-1, 1])], Some(8))).unwrap();
        assert_eq!(parsed.inputs[0].tensor.shape, [1, 1]);
        assert_eq!(parsed.inputs[0].tensor.data, TensorData::Bytes(vec![b"4\x0027".to_vec()]));
        let err = parse(b"427", &model(&[("s", DataType::Bytes, &[-1, -1])], Some(8))).unwrap_err();
        assert!(err.contains("must have input shape [1]"), "{err}");
    }

    #[test]
    fn what_cannot_be_deduced_is_refused_naming_why() {
        let two = model(&[("a", DataType::F32, &[-1]), ("b", DataType::F32, &[-1])], Some(0));
        assert!(parse(&[0; 4], &two)
            .unwrap_err()
            .contains("to be deduced but got 2 inputs in 'm' model configuration"));
        let err = parse(&[0; 8], &model(&[("x", DataType::F16, &[-1, -1])], Some(0))).unwrap_err();
        assert!(err.contains("more than one variable-sized dimension"), "{err}");
        let err = parse(&[0; 6], &model(&[("x", DataType::F32, &[-1, -1])], Some(8))).unwrap_err();
        assert!(err.contains("6 bytes do not fill"), "{err}");
        let err = parse(&[0; 12], &model(&[("x", DataType::F32, &[2])], Some(0))).unwrap_err();
        assert!(err.contains("12 bytes do not fill"), "{err}");
        let err = parse(&[0; 4], &model(&[("x", DataType::F32, &[0, -1])], Some(0))).unwrap_err();
        assert!(err.contains("do not fill"), "{err}");
    }
}
