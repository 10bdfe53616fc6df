//! The request parsers against random and mutated input: valid requests for every protocol
//! (KServe v2 JSON, v2 with binary tensor data, TEI, OpenAI), mutated byte by byte and value by
//! value, sent on keep-alive connections to the real server. Every answer must come (no hang),
//! be below 500 with a message when it is an error, and leave the connection usable unless it
//! says `Connection: close`; the pool must end with no worker restarted.
//!
//! Seeded and reproducible: INFERD_PARSER_SEED picks the seed (printed on failure),
//! INFERD_PARSER_CASES the number of requests (default 1500; 20000 for a long run).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

/// xorshift64*: enough randomness for mutations, and the same sequence for the same seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One request to mutate: path, extra headers, body.
#[derive(Clone)]
struct Case {
    path: &'static str,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

fn json_case(path: &'static str, body: Value) -> Case {
    Case { path, headers: Vec::new(), body: serde_json::to_vec(&body).unwrap() }
}

/// A v2 request for `typed` whose FP32 input travels as binary tensor data.
fn binary_case() -> Case {
    let mut inputs = serde_json::from_slice::<Value>(&typed_request()).unwrap()["inputs"].clone();
    let f32_in = &mut inputs[0];
    f32_in.as_object_mut().unwrap().remove("data");
    f32_in["parameters"] = json!({"binary_data_size": 16});
    let header = serde_json::to_vec(&json!({ "inputs": inputs })).unwrap();
    let mut body = header.clone();
    for x in [1.0f32, 2.0, 3.0, 4.0] {
        body.extend_from_slice(&x.to_le_bytes());
    }
    Case {
        path: "/v2/models/typed/infer",
        headers: vec![("Inference-Header-Content-Length".into(), header.len().to_string())],
        body,
    }
}

fn seeds() -> Vec<Case> {
    vec![
        Case { path: "/v2/models/typed/infer", headers: Vec::new(), body: typed_request() },
        binary_case(),
        json_case(
            "/v2/models/minilm/infer",
            json!({"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["a b", "c"]}]}),
        ),
        json_case("/embed", json!({"inputs": ["first text", "second"], "normalize": true, "truncate": false})),
        json_case(
            "/v2/models/classifier/predict",
            json!({"inputs": [["a", "b"], "c"], "raw_scores": true, "top_k": 2}),
        ),
        json_case(
            "/v1/embeddings",
            json!({"input": [[101, 7592, 102], [101, 102]], "model": "minilm", "dimensions": 384}),
        ),
        json_case("/v1/embeddings", json!({"input": "text", "encoding_format": "base64"})),
        json_case("/tokenize", json!({"inputs": ["a", ["b", "c"]], "add_special_tokens": false})),
        json_case("/decode", json!({"ids": [[101, 7592], [2088]], "skip_special_tokens": true})),
        json_case("/similarity", json!({"inputs": {"source_sentence": "a", "sentences": ["b", "c"]}})),
        json_case("/embed_all", json!({"inputs": ["a b", "c"], "truncate": true})),
        json_case("/v2/models/reranker/rerank", json!({"query": "q", "texts": ["a", "b c"], "return_text": true})),
    ]
}

/// Values that stress a parser where a valid one stood.
fn odd_value(rng: &mut Rng) -> Value {
    let long = "x".repeat(1 + rng.below(5000));
    let choices = [
        json!(null),
        json!(true),
        json!(-1),
        json!(0),
        json!(1e308),
        json!(-9.3e18),
        json!(18446744073709551615u64),
        json!(0.5),
        json!(""),
        json!(long),
        json!([]),
        json!({}),
        json!([[[[]]]]),
        json!([1, "a", null]),
        json!({"name": "x"}),
        json!(["\u{0}", "\u{ffff}"]),
        json!([-1, -2]),
        json!([4294967296u64]),
    ];
    choices[rng.below(choices.len())].clone()
}

/// Replaces, removes or adds one value somewhere in `value`.
fn mutate_json(value: &mut Value, rng: &mut Rng) {
    let depth_choice = rng.below(4);
    match value {
        Value::Object(map) if !map.is_empty() && depth_choice > 0 => {
            let key = map.keys().nth(rng.below(map.len())).unwrap().clone();
            match rng.below(6) {
                0 => {
                    map.remove(&key);
                }
                1 => {
                    map.insert(format!("unknown_{}", rng.below(100)), odd_value(rng));
                }
                2 => {
                    map.insert(key, odd_value(rng));
                }
                _ => mutate_json(map.get_mut(&key).unwrap(), rng),
            }
        }
        Value::Array(items) if !items.is_empty() && depth_choice > 0 => match rng.below(5) {
            0 => {
                items.remove(rng.below(items.len()));
            }
            1 => {
                let copy = items[rng.below(items.len())].clone();
                for _ in 0..rng.below(200) {
                    items.push(copy.clone());
                }
            }
            2 => items.push(odd_value(rng)),
            _ => {
                let i = rng.below(items.len());
                mutate_json(&mut items[i], rng)
            }
        },
        other => *other = odd_value(rng),
    }
}

/// Flips, cuts, inserts or repeats bytes.
fn mutate_bytes(body: &mut Vec<u8>, rng: &mut Rng) {
    if body.is_empty() {
        body.push(rng.next() as u8);
        return;
    }
    match rng.below(5) {
        0 => {
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(body.len());
                body[i] = rng.next() as u8;
            }
        }
        1 => body.truncate(rng.below(body.len())),
        2 => {
            let (a, b) = (rng.below(body.len()), rng.below(body.len()));
            body.drain(a.min(b)..a.max(b));
        }
        3 => {
            let at = rng.below(body.len());
            let bytes: Vec<u8> = (0..1 + rng.below(16)).map(|_| rng.next() as u8).collect();
            body.splice(at..at, bytes);
        }
        _ => {
            let (a, b) = (rng.below(body.len()), rng.below(body.len()));
            let piece = body[a.min(b)..a.max(b)].to_vec();
            let at = rng.below(body.len());
            body.splice(at..at, piece);
        }
    }
}

fn mutate(case: &Case, rng: &mut Rng) -> Case {
    let mut case = case.clone();
    let binary = !case.headers.is_empty();
    match rng.below(if binary { 4 } else { 3 }) {
        0 => mutate_bytes(&mut case.body, rng),
        3 => {
            let values = ["0", "-1", "abc", "99999999999999999999", "", " 12", "1.5"];
            let value = match rng.below(2) {
                0 => values[rng.below(values.len())].to_string(),
                _ => rng.below(case.body.len() + 8).to_string(),
            };
            case.headers[0].1 = value;
        }
        _ => {
            // A JSON mutation (on the JSON part of a binary request).
            let split = case.headers.first().and_then(|(_, v)| v.parse::<usize>().ok()).unwrap_or(case.body.len());
            let (head, tail) = case.body.split_at(split.min(case.body.len()));
            let Ok(mut value) = serde_json::from_slice::<Value>(head) else { return case };
            mutate_json(&mut value, rng);
            let head = serde_json::to_vec(&value).unwrap();
            if binary {
                case.headers[0].1 = head.len().to_string();
            }
            case.body = [head, tail.to_vec()].concat();
        }
    }
    case
}

/// A keep-alive connection that reads one response at a time.
struct Conn {
    addr: SocketAddr,
    stream: Option<TcpStream>,
}

impl Conn {
    fn send(&mut self, case: &Case) -> Result<Response, String> {
        if self.stream.is_none() {
            let stream = TcpStream::connect_timeout(&self.addr, Duration::from_secs(5)).map_err(|e| e.to_string())?;
            // Far above any answer here: a request that takes this long hangs.
            stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            self.stream = Some(stream);
        }
        let stream = self.stream.as_mut().unwrap();
        let mut head = format!(
            "POST {} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            case.path,
            case.body.len()
        );
        for (k, v) in &case.headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        // One write: a head and a body written apart wait on Nagle and a delayed ACK.
        let request = [head.as_bytes(), &case.body].concat();
        stream.write_all(&request).map_err(|e| format!("sending: {e}"))?;
        let response = read_response(stream)?;
        if response.header("connection").is_some_and(|v| v.eq_ignore_ascii_case("close")) {
            self.stream = None;
        }
        Ok(response)
    }
}

fn read_response(stream: &mut TcpStream) -> Result<Response, String> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 65536];
    let end = loop {
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        let n = stream.read(&mut buf).map_err(|e| format!("reading the answer: {e}"))?;
        if n == 0 {
            return Err(format!("connection closed after {} bytes of an answer", raw.len()));
        }
        raw.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&raw[..end]).to_string();
    let status: u16 = head.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or("no status line")?;
    let headers: Vec<(String, String)> = head
        .split("\r\n")
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let length = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse::<usize>().ok())
        .ok_or("an answer without Content-Length")?;
    let mut body = raw[end + 4..].to_vec();
    while body.len() < length {
        let n = stream.read(&mut buf).map_err(|e| format!("reading the body: {e}"))?;
        if n == 0 {
            return Err("connection closed inside the body".into());
        }
        body.extend_from_slice(&buf[..n]);
    }
    Ok(Response { status, headers, body })
}

/// The error message of an error body in any of the three shapes.
fn message(body: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let error = &value["error"];
    error.as_str().or_else(|| error["message"].as_str()).map(str::to_string)
}

#[test]
fn mutated_requests_get_a_4xx_with_a_message_never_a_5xx_a_panic_or_a_hang() {
    let seed: u64 = std::env::var("INFERD_PARSER_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
    });
    let cases: usize = std::env::var("INFERD_PARSER_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(1500);
    let dir = temp_dir("parsers");
    let repository = model_repository(dir.path(), &["minilm", "typed", "classifier", "reranker"]);
    let port = free_port();
    write_config(dir.path(), port, test_workers(), &repository, "minilm", &["typed", "classifier", "reranker"], "");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(120));

    let seeds = seeds();
    // Every seed is valid as it stands: the mutations start from requests that work.
    let mut conn = Conn { addr: server.addr, stream: None };
    for case in &seeds {
        let r = conn.send(case).unwrap();
        assert_eq!(r.status, 200, "seed {}: {}", case.path, String::from_utf8_lossy(&r.body));
    }
    let mut rng = Rng(seed);
    let (mut answered, mut refused) = (0, 0);
    for n in 0..cases {
        let mut case = mutate(&seeds[rng.below(seeds.len())], &mut rng);
        for _ in 0..rng.below(3) {
            case = mutate(&case, &mut rng);
        }
        let shown = String::from_utf8_lossy(&case.body[..case.body.len().min(600)]).to_string();
        let context = || format!("seed {seed}, request {n}: POST {} {:?} {shown}", case.path, case.headers);
        let r = conn.send(&case).unwrap_or_else(|e| panic!("{e}\n{}\nserver log:\n{}", context(), server.log()));
        assert!(r.status < 500, "{} answered {}: {}", context(), r.status, String::from_utf8_lossy(&r.body));
        if r.status >= 400 {
            refused += 1;
            assert!(message(&r.body).is_some_and(|m| !m.is_empty()), "{}: no message in {:?}", context(), r.body);
        } else {
            answered += 1;
        }
    }
    eprintln!("seed {seed}: {cases} mutated requests, {answered} answered, {refused} refused with a 4xx");
    assert!(refused > cases / 4, "seed {seed}: only {refused} of {cases} mutations were refused: are they mutating?");
    let status = server.status();
    for w in status["workers"].as_array().unwrap() {
        assert_eq!(w["restarts"], 0, "seed {seed}: {w:#}");
    }
    assert_eq!(status["phase"], "ready", "seed {seed}: {status:#}");
}
