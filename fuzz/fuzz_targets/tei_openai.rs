//! The JSON bodies of the TEI routes (`/embed`, `/predict`, `/rerank`, `/tokenize`,
//! `/decode`, `/similarity`), of OpenAI's `/v1/embeddings` and of Cohere's `/v1/rerank` and
//! `/v2/rerank`, as their handlers parse them.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = inferd_worker::http::tei::parse_bodies(data);
    let _ = inferd_worker::http::openai::parse(data);
    for version in [inferd_worker::http::cohere::Version::V1, inferd_worker::http::cohere::Version::V2] {
        let _ = inferd_worker::http::cohere::parse(data, version);
    }
});
