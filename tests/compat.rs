//! The clients users already run work unchanged: OpenAI's `/v1/embeddings` (checked with the
//! real `openai` package and huggingface_hub's InferenceClient, tests/clients/openai_check.py)
//! and the rest of text-embeddings-inference's routes (`/info`, `/tokenize`, `/decode`,
//! `/similarity`, `POST /`, SageMaker's `/invocations` and `/ping`), Cohere's `/v1/rerank` and
//! `/v2/rerank` (the `cohere` SDK and LangChain's CohereRerank, tests/clients/cohere_check.py),
//! each mistake answered with a 4xx in the shape its protocol uses.

use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

/// The default model (minilm), the classifier and the reranker test models, `default` first;
/// two workers where there are two cores.
fn server(tag: &str, default: &str) -> Server {
    let dir = temp_dir(tag);
    let repository = model_repository(dir.path(), &["minilm", "classifier", "reranker"]);
    let others: Vec<&str> = ["minilm", "classifier", "reranker"].into_iter().filter(|&m| m != default).collect();
    let port = free_port();
    write_config(dir.path(), port, test_workers(), &repository, default, &others, "");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(120));
    server
}

fn post(server: &Server, path: &str, body: Value) -> Response {
    server.request("POST", path, &serde_json::to_vec(&body).unwrap())
}

#[test]
fn the_openai_client_and_huggingface_hub_get_the_reference_embeddings() {
    let server = server("openai-client", "minilm");
    client_check("openai_check.py", &[&server.addr.to_string()], &server, "all checks passed");
    // Counted under each route, for the model that answered: OpenAI's route has the answers of
    // openai (five) and LangChain (two) and the two refusals; huggingface_hub's one call goes
    // to TEI's `POST /`, which serves the default model's pipeline as /invocations does.
    let metrics = server.metrics_text();
    for (endpoint, code, n) in
        [("openai_embeddings", 200, 7.0), ("openai_embeddings", 400, 2.0), ("invocations", 200, 1.0)]
    {
        let line = format!("inferd_requests_total{{model=\"minilm\",endpoint=\"{endpoint}\",code=\"{code}\"}}");
        assert_eq!(metric_value(&metrics, &line), Some(n), "{line} in:\n{metrics}");
    }
}

#[test]
fn openai_embeddings_name_each_mistake_in_openais_shape() {
    let server = server("openai-errors", "minilm");
    let cases = [
        (json!({"model": "minilm"}), "missing 'input'"),
        (json!({"input": [1, "a"]}), "'input' must be a text"),
        (json!({"input": [[1, 2], "a"]}), "'input' must be a text"),
        (json!({"input": [-1]}), "token ids are whole numbers"),
        (json!({"input": [4_000_000_000u64]}), "not in the model's vocabulary"),
        (json!({"input": "x", "encoding_format": "hex"}), "'encoding_format'"),
        (json!({"input": "x", "dimensions": 0}), "'dimensions' must be a positive"),
        (json!({"input": "x", "dimensions": 385}), "gives 384"),
        (json!({"input": "x", "model": 3}), "'model' must be a string"),
        (json!({"input": ""}), "is empty"),
        (json!({"input": "x", "model": "classifier"}), "not an embedding model"),
        (json!(["input"]), "must be a JSON object"),
    ];
    for (body, message) in cases {
        let r = post(&server, "/v1/embeddings", body.clone());
        assert_eq!(r.status, 400, "{body}: {}", String::from_utf8_lossy(&r.body));
        let error = &r.json()["error"];
        assert_eq!(error["type"], "invalid_request_error", "{body}: {error}");
        assert!(error["message"].as_str().unwrap().contains(message), "{body}: {error} lacks {message:?}");
    }
    // A text over the model's limit is refused unless the request allows truncation.
    let long = "word ".repeat(400);
    assert_eq!(post(&server, "/v1/embeddings", json!({"input": long})).status, 413);
    let r = post(&server, "/embeddings", json!({"input": long, "truncate": true, "encoding_format": "float"}));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["usage"]["prompt_tokens"], 256);
    // None of it disturbed the pool.
    assert!(server.status()["workers"].as_array().unwrap().iter().all(|w| w["restarts"] == 0));
}

#[test]
fn text_embeddings_inference_routes_answer_like_it() {
    let server = server("tei-routes", "minilm");
    let info = server.request("GET", "/info", b"");
    assert_eq!(info.status, 200);
    let info = info.json();
    assert_eq!(info["model_id"], "minilm");
    assert_eq!(info["max_input_length"], 256);
    assert_eq!(info["model_type"]["embedding"]["pooling"], "mean");
    // Every field TEI's OpenAPI marks required in Info.
    for field in [
        "model_id",
        "model_dtype",
        "served_model_name",
        "model_type",
        "max_concurrent_requests",
        "max_input_length",
        "max_batch_tokens",
        "max_client_batch_size",
        "auto_truncate",
        "tokenization_workers",
        "version",
    ] {
        assert!(!info[field].is_null(), "/info lacks {field}: {info}");
    }
    // Of the types TEI's OpenAPI gives them (generated clients refuse others).
    for field in ["max_concurrent_requests", "max_input_length", "max_batch_tokens", "max_client_batch_size"] {
        assert!(info[field].is_u64(), "{field}: {info}");
    }
    for field in ["model_id", "model_dtype", "served_model_name", "version"] {
        assert!(info[field].is_string(), "{field}: {info}");
    }
    assert!(info["auto_truncate"].is_boolean() && info["tokenization_workers"].is_u64(), "{info}");
    assert!(info["max_batch_requests"].is_u64() || info["max_batch_requests"].is_null(), "{info}");
    assert_eq!(
        (info["served_model_name"].as_str(), info["max_concurrent_requests"].as_u64()),
        (Some("minilm"), Some(128))
    );

    // `dimensions` on /embed, as TEI's router test asks it (test_http_embed.rs,
    // test_mrl_embeddings): the first 128 values, normalised after the cut; a batch's
    // vectors equal the single one.
    let full = post(&server, "/embed", json!({"inputs": "test"})).json()[0].clone();
    let one = post(&server, "/embed", json!({"inputs": "test", "dimensions": 128}));
    assert_eq!(one.status, 200, "{}", String::from_utf8_lossy(&one.body));
    let one: Vec<f64> = one.json()[0].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert_eq!(one.len(), 128);
    let prefix: Vec<f64> = full.as_array().unwrap()[..128].iter().map(|v| v.as_f64().unwrap()).collect();
    let norm = prefix.iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!(one.iter().zip(&prefix).all(|(a, b)| (a - b / norm).abs() < 1e-6), "not the normalised prefix");
    assert!((one.iter().map(|x| x * x).sum::<f64>() - 1.0).abs() < 1e-5);
    // And the values TEI's own snapshot of that request holds, within TEI's tolerance: the
    // default model is all-MiniLM-L6-v2 as published (scripts/published_weights.py).
    let snapshot: Value =
        serde_json::from_slice(&std::fs::read(repo().join("tests/fixtures/tei_mrl_embeddings_single.json")).unwrap())
            .unwrap();
    let tolerance = snapshot["tolerance"].as_f64().unwrap();
    let worst = one
        .iter()
        .zip(snapshot["embedding"].as_array().unwrap())
        .map(|(a, b)| (a - b.as_f64().unwrap()).abs())
        .fold(0.0, f64::max);
    assert!(worst <= tolerance, "differs from TEI's snapshot by up to {worst} (tolerance {tolerance})");
    let batch = post(&server, "/embed", json!({"inputs": ["test", "test", "test"], "dimensions": 128})).json();
    for row in batch.as_array().unwrap() {
        let row: Vec<f64> = row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert!(row.iter().zip(&one).all(|(a, b)| (a - b).abs() < 1e-6));
    }
    let raw = post(&server, "/embed", json!({"inputs": "test", "dimensions": 8, "normalize": false})).json();
    let raw_full = post(&server, "/embed", json!({"inputs": "test", "normalize": false})).json();
    assert_eq!(raw[0], json!(raw_full[0].as_array().unwrap()[..8]), "not normalised: the plain prefix");
    for (dimensions, words) in [(0, "`dimensions` should be positive"), (1000, "maximum embedding dimension (384")] {
        let r = post(&server, "/embed", json!({"inputs": "test", "dimensions": dimensions}));
        assert_eq!(r.status, 400, "{dimensions}");
        assert!(r.error().contains(words), "{dimensions}: {}", r.error());
    }

    // /tokenize: one list per input, special tokens marked, offsets into the text.
    let tokens = post(&server, "/tokenize", json!({"inputs": "Hello world"})).json();
    let ids: Vec<u64> = tokens[0].as_array().unwrap().iter().map(|t| t["id"].as_u64().unwrap()).collect();
    assert_eq!(ids, [101, 7592, 2088, 102]);
    assert_eq!(tokens[0][0], json!({"id": 101, "text": "[CLS]", "special": true, "start": null, "stop": null}));
    assert_eq!(tokens[0][2], json!({"id": 2088, "text": "world", "special": false, "start": 6, "stop": 11}));
    let two = post(&server, "/tokenize", json!({"inputs": ["a", "b c"], "add_special_tokens": false})).json();
    assert_eq!(two.as_array().unwrap().len(), 2);
    assert_eq!(two[1].as_array().unwrap().len(), 2);
    let pair = post(&server, "/tokenize", json!({"inputs": [["first", "second"]]})).json();
    let texts: Vec<&str> = pair[0].as_array().unwrap().iter().map(|t| t["text"].as_str().unwrap()).collect();
    assert_eq!(texts, ["[CLS]", "first", "[SEP]", "second", "[SEP]"]);

    // /embed with token ids (TEI's `inputs` as ids): the ids /tokenize gave embed as the text
    // does; one list of numbers is one input, a list of lists several, beside texts too.
    let by_text = post(&server, "/embed", json!({"inputs": ["Hello world"]})).json();
    let by_ids = post(&server, "/embed", json!({"inputs": ids})).json();
    let mixed = post(&server, "/embed", json!({"inputs": [ids, "Hello world", [101, 2088, 102]]})).json();
    let row =
        |v: &Value, i: usize| -> Vec<f64> { v[i].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect() };
    assert_eq!(by_ids.as_array().map(Vec::len), Some(1), "{by_ids}");
    assert_eq!(mixed.as_array().map(Vec::len), Some(3), "{mixed}");
    for (got, what) in [(row(&by_ids, 0), "ids"), (row(&mixed, 0), "ids beside texts"), (row(&mixed, 1), "the text")] {
        let most = got.iter().zip(row(&by_text, 0)).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(most < 1e-4, "{what}: differs from the text's embedding by {most}");
    }
    let other = row(&mixed, 2).iter().zip(row(&by_text, 0)).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(other > 1e-2, "[CLS] world [SEP] is not 'Hello world'");

    // /decode: one text per list of ids.
    assert_eq!(post(&server, "/decode", json!({"ids": [101, 7592, 2088, 102]})).json(), json!(["hello world"]));
    let both = post(&server, "/decode", json!({"ids": [[7592], [2088, 102]], "skip_special_tokens": false})).json();
    assert_eq!(both, json!(["hello", "world [SEP]"]));

    // /similarity: a near-paraphrase scores above an unrelated sentence; the same text scores 1.
    let inputs = json!({"source_sentence": "A cat sits on the mat",
                        "sentences": ["A kitten rests on a rug", "Stock markets fell today", "A cat sits on the mat"]});
    let scores = post(&server, "/similarity", json!({ "inputs": inputs })).json();
    let scores: Vec<f64> = scores.as_array().unwrap().iter().map(|s| s.as_f64().unwrap()).collect();
    assert!(scores[0] > scores[1] + 0.2, "{scores:?}");
    assert!((scores[2] - 1.0).abs() < 1e-4, "{scores:?}");

    // /embed_all: every token's vector; their mean is the pooled embedding before
    // normalisation (onnxruntime's, tests/fixtures/minilm_embed_reference.json).
    let reference: Value =
        serde_json::from_slice(&std::fs::read(repo().join("tests/fixtures/minilm_embed_reference.json")).unwrap())
            .unwrap();
    let case = &reference["cases"][0];
    let all = post(&server, "/embed_all", json!({"inputs": [case["text"]]}));
    assert_eq!(all.status, 200, "{}", String::from_utf8_lossy(&all.body));
    let tokens = all.json()[0].as_array().unwrap().clone();
    assert_eq!(tokens.len() as u64, case["tokens"].as_u64().unwrap());
    let raw = case["embedding_raw"].as_array().unwrap();
    for (d, expected) in raw.iter().enumerate() {
        let mean = tokens.iter().map(|t| t[d].as_f64().unwrap()).sum::<f64>() / tokens.len() as f64;
        assert!((mean - expected.as_f64().unwrap()).abs() < 1e-4, "dimension {d}: {mean} vs {expected}");
    }

    // POST / and /invocations are /embed for an embedding model; /ping is readiness.
    let embed = post(&server, "/embed", json!({"inputs": "route me"})).body;
    assert_eq!(post(&server, "/", json!({"inputs": "route me"})).body, embed);
    assert_eq!(post(&server, "/invocations", json!({"inputs": "route me"})).body, embed);
    assert_eq!(server.request("GET", "/ping", b"").status, 200);

    // Mistakes: a 4xx with TEI's error_type.
    let cases = [
        ("/tokenize", json!({"inputs": 5}), "Validation"),
        ("/decode", json!({"ids": [99_999_999]}), "Validation"),
        ("/decode", json!({"ids": [[1], 2]}), "Validation"),
        ("/decode", json!({"ids": []}), "Validation"),
        ("/similarity", json!({"inputs": {"source_sentence": "a", "sentences": []}}), "Validation"),
        ("/embed", json!({"inputs": ""}), "Empty"),
        ("/embed", json!({"inputs": [101, -1]}), "Validation"),
        ("/embed", json!({"inputs": [[101], [99_999_999]]}), "Validation"),
        ("/embed_all", json!({"inputs": []}), "Validation"),
        ("/", json!({"texts": "a"}), "Validation"),
    ];
    for (path, body, kind) in cases {
        let r = post(&server, path, body.clone());
        assert_eq!(r.status, 400, "{path} {body}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["error_type"], kind, "{path} {body}");
        assert!(!r.error().is_empty());
    }
    assert_eq!(server.request("GET", "/tokenize", b"").status, 405);
}

#[test]
fn post_root_follows_the_default_models_task() {
    let server = server("tei-root-classifier", "classifier");
    let predict = post(&server, "/predict", json!({"inputs": "what a lovely day"}));
    assert_eq!(predict.status, 200);
    assert_eq!(post(&server, "/invocations", json!({"inputs": "what a lovely day"})).body, predict.body);
    let info = server.request("GET", "/info", b"").json();
    assert!(info["model_type"]["classifier"]["id2label"]["0"].is_string(), "{info}");
    // /v1/embeddings still reaches the embedding model when it is named.
    let r = post(&server, "/v1/embeddings", json!({"input": "x", "model": "minilm"}));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["model"], "minilm");
    // The default model is not an embedding model: a name it does not load means it.
    let r = post(&server, "/v1/embeddings", json!({"input": "x", "model": "text-embedding-3-small"}));
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("not an embedding model"));
}

#[test]
fn rerank_orders_texts_as_onnxruntime_scores_them() {
    let reference: Value =
        serde_json::from_slice(&std::fs::read(repo().join("tests/fixtures/reranker_reference.json")).unwrap()).unwrap();
    let cases = reference["cases"].as_array().unwrap();
    let texts: Vec<&str> = cases.iter().map(|c| c["text"].as_str().unwrap()).collect();
    let query = &reference["query"];
    let server = server("rerank", "reranker");
    // /info calls a cross-encoder a reranker, as TEI does.
    let info = server.request("GET", "/info", b"").json();
    assert!(info["model_type"]["reranker"]["id2label"]["0"].is_string(), "{info}");
    let r = post(&server, "/rerank", json!({"query": query, "texts": texts, "return_text": true}));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let ranks = r.json();
    let ranks = ranks.as_array().unwrap();
    assert_eq!(ranks.len(), texts.len());
    let mut previous = f64::INFINITY;
    for rank in ranks {
        let i = rank["index"].as_u64().unwrap() as usize;
        let score = rank["score"].as_f64().unwrap();
        assert!((score - cases[i]["score"].as_f64().unwrap()).abs() < 1e-4, "{rank} vs {}", cases[i]);
        assert_eq!(rank["text"], cases[i]["text"]);
        assert!(score <= previous, "not best first: {ranks:?}");
        previous = score;
    }
    // raw_scores: the logits; without return_text no text; any model by name.
    let raw = post(&server, "/v2/models/reranker/rerank", json!({"query": query, "texts": texts, "raw_scores": true}));
    for rank in raw.json().as_array().unwrap() {
        let i = rank["index"].as_u64().unwrap() as usize;
        assert!((rank["score"].as_f64().unwrap() - cases[i]["logit"].as_f64().unwrap()).abs() < 1e-4, "{rank}");
        assert!(rank.get("text").is_none(), "{rank}");
    }
    // Mistakes: the wrong kind of model, nothing to rank, a text over the limit.
    let long = "word ".repeat(200);
    let cases = [
        ("/v2/models/classifier/rerank", json!({"query": "q", "texts": ["a"]}), 400, "one label"),
        ("/v2/models/minilm/rerank", json!({"query": "q", "texts": ["a"]}), 400, "classification"),
        ("/rerank", json!({"query": "q", "texts": []}), 400, "empty"),
        ("/rerank", json!({"texts": ["a"]}), 400, "query"),
        ("/rerank", json!({"query": "q", "texts": [long]}), 413, "truncate"),
    ];
    for (path, body, status, message) in cases {
        let r = post(&server, path, body.clone());
        assert_eq!(r.status, status, "{path} {body}: {}", String::from_utf8_lossy(&r.body));
        assert!(r.error().contains(message), "{path}: {:?} lacks {message:?}", r.error());
        assert_eq!(r.json()["error_type"], "Validation", "{path}");
    }
    let r = post(&server, "/rerank", json!({"query": "q", "texts": [long], "truncate": true}));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

#[test]
fn coheres_sdk_and_langchains_reranker_get_onnxruntimes_scores_long_documents_by_their_best_window() {
    let server = server("cohere-client", "minilm");
    client_check("cohere_check.py", &[&server.addr.to_string()], &server, "all checks passed");
    // Counted under Cohere's route, for the cross-encoder that answered: v1 twice, v2 once,
    // LangChain once, and the long documents once each by v1 and v2.
    let line = "inferd_requests_total{model=\"reranker\",endpoint=\"cohere_rerank\",code=\"200\"}";
    let metrics = server.metrics_text();
    assert_eq!(metric_value(&metrics, line), Some(6.0), "{line} in:\n{metrics}");
}

#[test]
fn cohere_rerank_names_each_mistake_in_coheres_shape() {
    let server = server("cohere-errors", "minilm");
    let docs = json!(["a", "b"]);
    // 1000 sentences of 11 tokens: more windows of the 128-token model (~125 tokens each beside
    // the query) than max_batch_inputs (64).
    let huge = "The weather was lovely on the first day of spring. ".repeat(1000);
    let cases = [
        ("/v1/rerank", json!({"documents": docs}), 400, "missing 'query'"),
        ("/v1/rerank", json!({"query": "", "documents": docs}), 400, "'query' is empty"),
        ("/v1/rerank", json!({"query": "q", "documents": []}), 400, "'documents' is an empty list"),
        ("/v1/rerank", json!({"query": "q", "documents": "a"}), 400, "'documents' must be a list"),
        ("/v1/rerank", json!({"query": "q", "documents": [{"title": "a"}]}), 400, "'documents[0]' has no 'text'"),
        ("/v1/rerank", json!({"query": "q", "documents": [3]}), 400, "'documents[0]' must be a text"),
        ("/v2/rerank", json!({"query": "q", "documents": [{"text": "a"}]}), 400, "v2 rerank takes documents as texts"),
        ("/v2/rerank", json!({"query": "q", "documents": docs, "rank_fields": ["text"]}), 400, "not part of v2"),
        ("/v1/rerank", json!({"query": "q", "documents": docs, "top_n": 0}), 400, "'top_n' must be a whole number"),
        ("/v1/rerank", json!({"query": "q", "documents": docs, "return_documents": "yes"}), 400, "'return_documents'"),
        ("/v2/rerank", json!({"query": "q", "documents": docs, "priority": -1}), 400, "'priority'"),
        ("/v2/rerank", json!({"query": "q", "documents": docs, "max_tokens_per_doc": 0}), 400, "'max_tokens_per_doc'"),
        ("/v1/rerank", json!({"model": "classifier", "query": "q", "documents": docs}), 400, "one label"),
        ("/v1/rerank", json!({"model": "minilm", "query": "q", "documents": docs}), 400, "not one"),
        ("/v1/rerank", json!({"query": "word ".repeat(120), "documents": docs}), 413, "the query has 120 tokens"),
        ("/v1/rerank", json!({"query": "q", "documents": [huge], "max_chunks_per_doc": 100}), 413, "max_batch_inputs"),
        ("/v1/rerank", json!(["q"]), 400, "must be a JSON object"),
    ];
    for (path, body, status, message) in cases {
        let r = post(&server, path, body.clone());
        let text = String::from_utf8_lossy(&r.body).to_string();
        let body = body.to_string();
        let body = &body[..body.floor_char_boundary(300)];
        assert_eq!(r.status, status, "{path} {body}: {text}");
        let message_field = r.json()["message"].as_str().map(str::to_string);
        assert!(message_field.as_deref().is_some_and(|m| m.contains(message)), "{path}: {text} lacks {message:?}");
    }
    // The same huge document within Cohere's default of 10 windows is answered.
    let r = post(&server, "/v1/rerank", json!({"model": "reranker", "query": "q", "documents": [huge]}));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let answer = r.json();
    assert_eq!(answer["results"][0]["index"], 0, "{answer}");
    assert_eq!(answer["model"], "reranker");
    // Ten windows of at most 128 tokens were read.
    let tokens = answer["usage"]["total_tokens"].as_u64().unwrap();
    assert!(tokens > 9 * 100 && tokens <= 10 * 128, "{answer}");
}

#[test]
fn coheres_sdk_and_langchains_embeddings_get_the_vectors_and_codes_of_the_rule() {
    let server = server("cohere-embed", "minilm");
    client_check("cohere_embed_check.py", &[&server.addr.to_string()], &server, "all checks passed");
    // Counted under Cohere's embed route for minilm: v1 three times, v2 three and the refused
    // NONE (413), LangChain twice.
    let metrics = server.metrics_text();
    for (code, n) in [(200, 8.0), (413, 1.0)] {
        let line = format!("inferd_requests_total{{model=\"minilm\",endpoint=\"cohere_embed\",code=\"{code}\"}}");
        assert_eq!(metric_value(&metrics, &line), Some(n), "{line} in:\n{metrics}");
    }
}

#[test]
fn cohere_embed_names_each_mistake_in_coheres_shape_and_cuts_dimensions_where_trained() {
    // minilm, and the same files told they were trained for Matryoshka.
    let dir = temp_dir("cohere-embed-errors");
    let repository = model_repository(dir.path(), &["minilm", "classifier"]);
    let mrl = repository.join("minilm-mrl");
    std::fs::create_dir_all(&mrl).unwrap();
    for file in ["model.onnx", "tokenizer.json"] {
        std::os::unix::fs::symlink(repo().join("models/minilm").join(file), mrl.join(file)).unwrap();
    }
    let toml = std::fs::read_to_string(repo().join("models/minilm/model.toml")).unwrap();
    let toml = toml
        .replace("name = \"minilm\"", "name = \"minilm-mrl\"")
        .replace("normalize = true", "normalize = true\nmatryoshka = true");
    std::fs::write(mrl.join("model.toml"), toml).unwrap();
    let port = free_port();
    write_config(dir.path(), port, test_workers(), &repository, "minilm", &["classifier", "minilm-mrl"], "");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(120));

    let texts = json!(["a", "b"]);
    let long = "word ".repeat(300);
    let cases = [
        ("/v1/embed", json!({}), 400, "missing 'texts'"),
        ("/v1/embed", json!({"texts": []}), 400, "'texts' is an empty list"),
        ("/v1/embed", json!({"texts": "a"}), 400, "'texts' must be a list"),
        ("/v1/embed", json!({"texts": ["a", 3]}), 400, "'texts[1]' must be a text"),
        ("/v1/embed", json!({"texts": [""]}), 400, "empty"),
        ("/v1/embed", json!({"texts": texts, "embedding_types": ["int4"]}), 400, "each must be one of float, int8"),
        (
            "/v1/embed",
            json!({"texts": texts, "embedding_types": []}),
            400,
            "'embedding_types' must be a non-empty list",
        ),
        ("/v1/embed", json!({"texts": texts, "input_type": "poem"}), 400, "'input_type' must be one of"),
        ("/v1/embed", json!({"texts": texts, "input_type": "image"}), 400, "takes texts"),
        ("/v1/embed", json!({"texts": texts, "images": ["data:image/png;base64,AA=="]}), 400, "'images' is not served"),
        ("/v2/embed", json!({"inputs": [{"content": []}]}), 400, "'inputs' is not served"),
        ("/v1/embed", json!({"texts": texts, "truncate": "MIDDLE"}), 400, "'truncate' must be NONE, START or END"),
        ("/v1/embed", json!({"texts": [long], "truncate": "NONE"}), 413, "truncate"),
        ("/v1/embed", json!({"texts": texts, "output_dimension": 128}), 400, "part of v2 embed"),
        ("/v2/embed", json!({"texts": texts, "output_dimension": 0}), 400, "'output_dimension' must be a whole number"),
        ("/v2/embed", json!({"texts": texts, "output_dimension": 128}), 400, "not trained to give fewer"),
        ("/v2/embed", json!({"texts": texts, "model": "minilm-mrl", "output_dimension": 385}), 400, "gives 384"),
        ("/v2/embed", json!({"texts": texts, "max_tokens": 10}), 400, "'max_tokens'"),
        ("/v2/embed", json!({"texts": texts, "priority": -1}), 400, "'priority'"),
        ("/v2/embed", json!({"texts": texts, "model": "classifier"}), 400, "does not embed texts"),
        ("/v2/embed", json!({"texts": texts, "model": 3}), 400, "'model' must be a string"),
        (
            "/v2/embed",
            json!({"texts": texts, "model": "minilm-mrl", "output_dimension": 100, "embedding_types": ["int8", "ubinary"]}),
            400,
            "binary codes pack 8 dimensions to a byte, and the vectors have 100",
        ),
        ("/v2/embed", json!(["a"]), 400, "must be a JSON object"),
    ];
    for (path, body, status, message) in cases {
        let r = post(&server, path, body.clone());
        let text = String::from_utf8_lossy(&r.body).to_string();
        assert_eq!(r.status, status, "{path} {body}: {text}");
        let message_field = r.json()["message"].as_str().map(str::to_string);
        assert!(
            message_field.as_deref().is_some_and(|m| m.contains(message)),
            "{path} {body}: {text} lacks {message:?}"
        );
    }
    // A model trained for it gives fewer dimensions, normalised again, as TEI's /embed cuts them;
    // its codes are those of the shorter vector.
    let body =
        json!({"texts": texts, "model": "minilm-mrl", "output_dimension": 96, "embedding_types": ["float", "ubinary"]});
    let r = post(&server, "/v2/embed", body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let answer = r.json();
    let cut = post(&server, "/embed", json!({"inputs": texts, "dimensions": 96})).json();
    for (got, want) in answer["embeddings"]["float"].as_array().unwrap().iter().zip(cut.as_array().unwrap()) {
        let (got, want) = (got.as_array().unwrap(), want.as_array().unwrap());
        assert_eq!(got.len(), 96);
        let d =
            got.iter().zip(want).map(|(a, b)| (a.as_f64().unwrap() - b.as_f64().unwrap()).abs()).fold(0.0, f64::max);
        assert!(d < 1e-6, "output_dimension 96 vs /embed dimensions 96: {d}");
    }
    assert_eq!(answer["embeddings"]["ubinary"][0].as_array().unwrap().len(), 12, "{answer}");
    assert_eq!(answer["model"], "minilm-mrl");
    // A name it does not serve means the default model; nothing refused counts as a 200.
    let r = post(&server, "/v1/embed", json!({"texts": texts, "model": "embed-english-v3.0"}));
    assert_eq!((r.status, r.json()["model"].clone()), (200, json!("minilm")));
}

/// What tests/clients/late_chunking_reference.py computes for `spans` of `text`.
fn late_reference(text: &str, spans: &Value) -> Vec<Vec<f64>> {
    let out = std::process::Command::new(python())
        .arg(repo().join("tests/clients/late_chunking_reference.py"))
        .args([text, &spans.to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "late_chunking_reference.py: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn vector(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

#[test]
fn late_chunking_pools_each_chunk_from_the_whole_texts_token_states() {
    let server = server("late-chunking", "minilm");
    let text = "Berlin is the capital of Germany. Its population is about 3.8 million! \
                The city is also one of the states of the country?  It has many museums";
    // Given spans, in characters: the first and the third sentence.
    let spans = json!([[0, 33], [71, 121]]);
    let r = post(&server, "/embed_chunks", json!({"inputs": text, "chunks": spans}));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let got = r.json();
    let want = late_reference(text, &spans);
    for (chunk, want) in got.as_array().unwrap().iter().zip(&want) {
        let d = vector(&chunk["embedding"]).iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(d < 1e-5, "{chunk}: {d}");
    }
    // The chunk keeps its context: "Its population" embedded alone differs (the late vector
    // knows "Its" is Berlin's).
    let alone = post(&server, "/embed", json!({"inputs": &text[34..70]})).json();
    let late = post(&server, "/embed_chunks", json!({"inputs": text, "chunks": [[34, 70]]})).json();
    let cosine: f64 = vector(&alone[0]).iter().zip(vector(&late[0]["embedding"])).map(|(a, b)| a * b).sum();
    assert!(cosine < 0.99, "late and alone alike: {cosine}");

    // By sentences: the spans end at each . ! ? before a space, and the last runs to the end.
    let r = post(&server, "/embed_chunks", json!({"inputs": text, "chunk_by": "sentence"}));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let got = r.json();
    let spans: Vec<(u64, u64)> =
        got.as_array().unwrap().iter().map(|c| (c["start"].as_u64().unwrap(), c["end"].as_u64().unwrap())).collect();
    assert_eq!(spans, vec![(0, 33), (34, 70), (71, 121), (123, 142)], "{got}");
    let want = late_reference(text, &json!(spans));
    for (chunk, want) in got.as_array().unwrap().iter().zip(&want) {
        let d = vector(&chunk["embedding"]).iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(d < 1e-5, "{chunk}: {d}");
    }
    // By tokens: groups of 5 of the text's tokens, the last one shorter.
    let got = post(&server, "/embed_chunks", json!({"inputs": text, "chunk_tokens": 5})).json();
    let tokens: Vec<u64> = got.as_array().unwrap().iter().map(|c| c["tokens"].as_u64().unwrap()).collect();
    assert!(tokens.len() > 3 && tokens[..tokens.len() - 1].iter().all(|&t| t == 5), "{tokens:?}");
    assert!(*tokens.last().unwrap() <= 5);

    let long = "word ".repeat(300);
    let cases = [
        (json!({"inputs": text}), 400, "give exactly one of 'chunks'"),
        (json!({"inputs": text, "chunks": [[0, 5]], "chunk_tokens": 3}), 400, "give exactly one of 'chunks'"),
        (json!({"inputs": text, "chunk_tokens": 0}), 400, "'chunk_tokens' must be at least 1"),
        (json!({"inputs": text, "chunks": [[0, 500]]}), 400, "'chunks[0]' is [0, 500]"),
        (json!({"inputs": text, "chunks": [[5, 5]]}), 400, "start < end"),
        (json!({"inputs": text, "chunks": [[0, 20], [10, 30]]}), 400, "inside the chunk before it"),
        (json!({"inputs": text, "chunks": [[0, -1]]}), 400, "chunks"),
        (json!({"inputs": text, "chunk_by": "paragraph"}), 400, "chunk_by"),
        (json!({"inputs": "", "chunk_by": "sentence"}), 400, "'inputs' is empty"),
        (json!({"inputs": long, "chunk_by": "sentence"}), 413, "reads it whole"),
    ];
    for (body, status, message) in cases {
        let r = post(&server, "/embed_chunks", body.clone());
        assert_eq!(r.status, status, "{body}: {}", String::from_utf8_lossy(&r.body));
        assert!(r.error().contains(message), "{body}: {:?} lacks {message:?}", r.error());
    }
    let r = post(&server, "/v2/models/classifier/embed_chunks", json!({"inputs": text, "chunk_by": "sentence"}));
    assert_eq!(r.status, 400, "{}", r.error());
}
