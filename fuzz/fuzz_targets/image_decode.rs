//! An encoded image through the image pipeline's decoder and its bounds (PNG, JPEG), with a
//! 224 x 224 model's settings and a 4-million-pixel limit, so that one run stays small.
#![no_main]

use inferd_config::model::ImageConfig;

libfuzzer_sys::fuzz_target!(init: {
    // libFuzzer's hook aborts on every panic; the decoder's own are refused inputs (as in the
    // worker, panics.rs), so only a panic outside them is a crash.
    let abort = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !inferd_worker::panics::contained_now() {
            abort(info)
        }
    }));
}, |data: &[u8]| {
    let config: ImageConfig =
        serde_json::from_str(r#"{"width": 224, "height": 224, "max_pixels": 4000000, "max_side": 4096}"#)
            .expect("valid");
    let _ = inferd_worker::pipeline::decode_image(data, &config);
});
