//! A KServe v2 infer body as REST receives it: JSON, or JSON and binary tensors (the first
//! byte, when it says so, picks where the header ends).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let header = match data.first() {
        Some(&n) if n & 1 == 1 && data.len() > 1 => Some((n as usize >> 1).min(data.len() - 1)),
        _ => None,
    };
    let body = data.get(1..).unwrap_or_default();
    if let Ok(parsed) = inferd_worker::kserve::json::parse(body, header, &inferd_worker::kserve::SharedMemory::NONE) {
        for input in &parsed.inputs {
            // What the parser lets through must agree with its own shape.
            let count = inferd_worker::runtime::tensor::element_count(&input.tensor.shape);
            assert_eq!(count, Some(input.tensor.data.len()), "{:?}", input.tensor.shape);
        }
    }
});
