//! The text pipeline's front end with the default model's tokenizer (tests/models/classifier,
//! max_length 128): any text, single or a pair, tokenized for the model without truncation
//! and truncated on either side, and for `/tokenize`. The bound before tokenizing must hold: no row longer than
//! max_length, whatever the text.
#![no_main]

use std::sync::OnceLock;

use inferd_config::model::ModelEntry;
use inferd_worker::pipeline::{Pipeline, Side, Text};
use inferd_worker::runtime::tensor::{DataType, TensorSpec};

fn pipeline() -> &'static Pipeline {
    static PIPELINE: OnceLock<Pipeline> = OnceLock::new();
    PIPELINE.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/models/classifier");
        let entry = ModelEntry::load_dir(&dir, "classifier").expect("the test classifier (make setup)");
        let spec = |name: &str, datatype: &str, dtype, shape: Vec<i64>| TensorSpec {
            name: name.into(),
            datatype: datatype.into(),
            shape,
            dtype: Some(dtype),
            first_dim: String::new(),
            optional: false,
        };
        let inputs = [
            spec("input_ids", "INT64", DataType::I64, vec![-1, -1]),
            spec("attention_mask", "INT64", DataType::I64, vec![-1, -1]),
        ];
        let outputs = [spec("logits", "FP32", DataType::F32, vec![-1, 3])];
        // Its model.toml names the activation: the graph is not read.
        let producer = |_: &str| Ok(None);
        Pipeline::build(&entry, &inputs, &outputs, &producer).expect("the classifier's pipeline")
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Pipeline::Text(p) = pipeline() else { unreachable!("a text model") };
    let text = String::from_utf8_lossy(data.get(1..).unwrap_or_default()).into_owned();
    let input = match data.first().map(|b| b & 1) {
        Some(1) => {
            let cut = text.floor_char_boundary(text.len() / 2);
            Text::Pair(text[..cut].to_string(), text[cut..].to_string())
        }
        _ => Text::Single(text),
    };
    for truncate in [None, Some(Side::Right), Some(Side::Left)] {
        if let Ok(encoded) = p.encode(std::slice::from_ref(&input), truncate) {
            assert!(encoded.lengths.iter().all(|&n| n <= p.max_length), "{:?}", encoded.lengths);
        }
    }
    let _ = p.tokenize(0, &input, true);
});
