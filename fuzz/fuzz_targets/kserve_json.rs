//! A KServe v2 infer body as REST receives it: JSON, or JSON and binary tensors (the first
//! byte, when it says so, picks where the header ends); and the same bytes as a body of
//! Triton's generate extension, for a model of four inputs.
#![no_main]

use std::sync::OnceLock;

use inferd_worker::runtime::tensor::{element_count, DataType, TensorSpec};

/// The generate model's inputs: a string, a flag, a list of ids and pairs of floats.
fn inputs() -> &'static [TensorSpec] {
    static INPUTS: OnceLock<Vec<TensorSpec>> = OnceLock::new();
    INPUTS.get_or_init(|| {
        let spec = |name: &str, dtype: DataType, shape: Vec<i64>| TensorSpec {
            name: name.into(),
            datatype: dtype.name().into(),
            shape,
            dtype: Some(dtype),
            first_dim: String::new(),
            optional: false,
        };
        vec![
            spec("PROMPT", DataType::Bytes, vec![1, 1]),
            spec("STREAM", DataType::Bool, vec![1, 1]),
            spec("ids", DataType::I64, vec![-1, -1]),
            spec("pairs", DataType::F32, vec![-1, 2]),
        ]
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let header = match data.first() {
        Some(&n) if n & 1 == 1 && data.len() > 1 => Some((n as usize >> 1).min(data.len() - 1)),
        _ => None,
    };
    let body = data.get(1..).unwrap_or_default();
    if let Ok(parsed) = inferd_worker::kserve::json::parse(body, header, &inferd_worker::kserve::SharedMemory::NONE) {
        for input in &parsed.inputs {
            // What the parser lets through must agree with its own shape.
            let count = element_count(&input.tensor.shape);
            assert_eq!(count, Some(input.tensor.data.len()), "{:?}", input.tensor.shape);
        }
    }
    if let Ok(parsed) = inferd_worker::kserve::generate::parse(body, inputs(), 1 << 16) {
        for input in &parsed.inputs {
            let count = element_count(&input.tensor.shape);
            assert_eq!(count, Some(input.tensor.data.len()), "{:?}", input.tensor.shape);
        }
    }
});
