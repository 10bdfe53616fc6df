//! The JSON bodies of the TEI routes (`/embed`, `/predict`, `/rerank`, `/tokenize`,
//! `/decode`, `/similarity`) and of OpenAI's `/v1/embeddings`, as their handlers parse them.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = inferd_worker::http::tei::parse_bodies(data);
    let _ = inferd_worker::http::openai::parse(data);
});
