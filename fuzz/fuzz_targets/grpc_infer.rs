//! A gRPC ModelInfer message as the service receives it: protobuf bytes, its decoded size
//! bounded from the wire (the intake's check before decoding), then decoded and checked.
#![no_main]

use std::mem::size_of;

use inferd_worker::http::grpc::intake::decoded_size;
use inferd_worker::http::grpc::proto::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
use inferd_worker::http::grpc::proto::{InferParameter, InferTensorContents, ModelInferRequest};
use prost::Message;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let (Ok(bound), Ok(request)) = (decoded_size(data), ModelInferRequest::decode(data)) {
        let held = held(&request);
        assert!(held <= bound, "the decoded request holds {held} bytes, more than the bound {bound}");
    }
    if let Ok(parsed) = inferd_worker::http::grpc::parse_message(data) {
        for input in &parsed.inputs {
            let count = inferd_worker::runtime::tensor::element_count(&input.tensor.shape);
            assert_eq!(count, Some(input.tensor.data.len()), "{:?}", input.tensor.shape);
        }
    }
});

/// The bytes a decoded request holds, counted from what it holds: at most what
/// [`decoded_size`] said of its wire form.
fn held(r: &ModelInferRequest) -> u64 {
    let parameters = |p: &std::collections::HashMap<String, InferParameter>| -> usize {
        p.iter()
            .map(|(k, v)| {
                let text = match &v.parameter_choice {
                    Some(inferd_worker::http::grpc::proto::infer_parameter::ParameterChoice::StringParam(s)) => s.len(),
                    _ => 0,
                };
                size_of::<(String, InferParameter)>() + 1 + k.len() + text
            })
            .sum()
    };
    let contents = |c: &InferTensorContents| -> usize {
        c.bool_contents.len()
            + 4 * (c.int_contents.len() + c.uint_contents.len() + c.fp32_contents.len())
            + 8 * (c.int64_contents.len() + c.uint64_contents.len() + c.fp64_contents.len())
            + c.bytes_contents.iter().map(|b| size_of::<Vec<u8>>() + b.len()).sum::<usize>()
    };
    let input = |i: &InferInputTensor| {
        size_of::<InferInputTensor>()
            + i.name.len()
            + i.datatype.len()
            + 8 * i.shape.len()
            + parameters(&i.parameters)
            + i.contents.as_ref().map_or(0, contents)
    };
    let output =
        |o: &InferRequestedOutputTensor| size_of::<InferRequestedOutputTensor>() + o.name.len() + parameters(&o.parameters);
    let total = r.model_name.len()
        + r.model_version.len()
        + r.id.len()
        + parameters(&r.parameters)
        + r.inputs.iter().map(input).sum::<usize>()
        + r.outputs.iter().map(output).sum::<usize>()
        + r.raw_input_contents.iter().map(|b| size_of::<Vec<u8>>() + b.len()).sum::<usize>();
    total as u64
}
