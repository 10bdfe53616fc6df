//! A gRPC ModelInfer message as the service receives it: protobuf bytes, decoded and checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(parsed) = inferd_worker::grpc::parse_message(data) {
        for input in &parsed.inputs {
            let count = inferd_worker::tensor::element_count(&input.tensor.shape);
            assert_eq!(count, Some(input.tensor.data.len()), "{:?}", input.tensor.shape);
        }
    }
});
