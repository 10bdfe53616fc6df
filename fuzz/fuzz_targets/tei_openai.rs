//! The JSON bodies of the TEI routes (`/embed`, `/predict`, `/rerank`, `/tokenize`,
//! `/decode`, `/similarity`, `/embed_chunks`), of OpenAI's `/v1/embeddings` and of Cohere's
//! `/v1/rerank`, `/v2/rerank`, `/v1/embed` and `/v2/embed`, as their handlers parse them.
#![no_main]

use inferd_worker::http::cohere::{embed, rerank, Version};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = inferd_worker::http::tei::parse_bodies(data);
    let _ = inferd_worker::http::openai::parse(data);
    for version in [Version::V1, Version::V2] {
        let _ = rerank::parse(data, version);
        let _ = embed::parse(data, version);
    }
});
