//! An encoded image through the image pipeline's decoder and its bounds (PNG, JPEG), with a
//! 224 x 224 model's settings and a 4-million-pixel limit, so that one run stays small.
#![no_main]

use inferd_config::model::ImageConfig;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let config: ImageConfig =
        serde_json::from_str(r#"{"width": 224, "height": 224, "max_pixels": 4000000, "max_side": 4096}"#).expect("valid");
    let _ = inferd_worker::pipeline::decode_image(data, &config);
});
