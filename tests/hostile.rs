//! Hostile clients against the release binary (`make test` builds the tests in release, where
//! integer overflow wraps instead of panicking), while well-behaved clients load the same
//! server: every hostile request is answered with a 4xx that names the limit, quickly, and
//! costs no one else anything; a bug that panics costs its own request (or, outside any one
//! request's work, its worker, which is replaced), never a worker that says it is ready but
//! cannot answer.

use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::json;

/// Generous: the bound says "answered, not hung", not how fast.
const ANSWERED_WITHIN: Duration = Duration::from_secs(30);

/// `classifier` by default (so /tokenize and /predict reach its tokenizer), `typed` and `cnn`.
/// A job of 7 rows panics its lane (caught), one of 9 rows the dispatcher (not caught).
fn start(tag: &str) -> Server {
    let tokenizer = repo().join("models/minilm/tokenizer.json");
    assert!(tokenizer.is_file(), "{} is missing: run `make setup`", tokenizer.display());
    let dir = temp_dir(tag);
    let port = free_port();
    let config = write_config(dir.path(), port, test_workers(), &test_models(), "classifier", &["typed", "cnn"], "");
    let mut command = std::process::Command::new(BIN);
    command.arg("serve").arg("--config").arg(&config).env("INFERD_TEST_PANIC", "lane:7,batch:9");
    let mut server = Server::spawn(command, dir, port, None);
    server.wait_ready(Duration::from_secs(60));
    server
}

/// Well-behaved clients, a new connection per request; failures and latencies recorded.
fn typed_load(server: &Server, clients: usize) -> TypedLoad<Duration> {
    TypedLoad::start(server, clients, Duration::from_millis(5), |_, took| took)
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

/// A PNG that is only its signature, a header claiming `width` x `height` (8-bit RGB), no
/// pixels and its end: tiny on the wire, enormous if decoded or resized without a bound.
fn png_header(width: u32, height: u32) -> Vec<u8> {
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let chunk = |png: &mut Vec<u8>, kind: &[u8], data: &[u8]| {
        png.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let mut typed = kind.to_vec();
        typed.extend_from_slice(data);
        png.extend_from_slice(&typed);
        png.extend_from_slice(&crc32(&typed).to_be_bytes());
    };
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&width.to_be_bytes());
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    chunk(&mut png, b"IHDR", &ihdr);
    // Image data: an empty zlib stream (decoders read up to here for the header).
    chunk(&mut png, b"IDAT", &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01]);
    chunk(&mut png, b"IEND", &[]);
    png
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Sends one hostile request and checks it is refused with `status` and `message`, in time.
fn refused(server: &Server, what: &str, path: &str, headers: &[(&str, &str)], body: &[u8], status: u16, message: &str) {
    let started = Instant::now();
    let r =
        request(server.addr, "POST", path, headers, body).unwrap_or_else(|e| panic!("{what}: {e}\n{}", server.log()));
    let took = started.elapsed();
    assert_eq!(r.status, status, "{what}: {}", String::from_utf8_lossy(&r.body));
    assert!(r.error().contains(message), "{what}: {}", r.error());
    assert!(took < ANSWERED_WITHIN, "{what}: answered after {took:?}");
    eprintln!("{what}: {status} in {:.1} ms: {}", took.as_secs_f64() * 1e3, r.error());
}

fn soft_limit_bytes(status: &serde_json::Value) -> u64 {
    let memory = status["memory"].as_str().unwrap();
    let after = memory.split("replace above ").nth(1).unwrap_or_else(|| panic!("no soft limit in: {memory}"));
    after.split(" MiB").next().unwrap().parse::<u64>().unwrap() << 20
}

#[test]
fn hostile_requests_cost_only_their_own_answer() {
    let mut server = start("hostile");
    let before = server.status();
    let load = typed_load(&server, 4);
    let infer = "/v2/models/typed/infer";

    // Shapes whose element count times the element size wraps to 0 in a release build, with no
    // data: once two of these shared a batch and panicked both lanes. Many at once, every
    // datatype, other shapes.
    let huge = 2_305_843_009_213_693_952i64; // 2^61: x 8 bytes = 2^64
    let cases: Vec<(&str, &str, serde_json::Value)> = vec![
        ("i64_in", "INT64", json!([1, huge])),
        ("f64_in", "FP64", json!([1, huge])),
        ("f32_in", "FP32", json!([1, huge * 2])),
        ("i32_in", "INT32", json!([huge * 2, 1])),
        ("f16_in", "FP16", json!([2, huge * 4 - 1])),
        ("bool_in", "BOOL", json!([1_i64 << 32, 1_i64 << 32])),
        ("i64_in", "INT64", json!([1_i64 << 31, 1_i64 << 31, 4])),
    ];
    let threads: Vec<_> = (0..32)
        .map(|i| {
            let (name, dtype, shape) = cases[i % cases.len()].clone();
            let addr = server.addr;
            std::thread::spawn(move || {
                let inputs =
                    json!([{"name": name, "shape": shape, "datatype": dtype, "parameters": {"binary_data_size": 0}}]);
                let (body, length) = binary_infer_body(inputs, b"");
                let r = request(
                    addr,
                    "POST",
                    "/v2/models/typed/infer",
                    &[("Inference-Header-Content-Length", &length)],
                    &body,
                );
                (format!("{name} {dtype} {shape}"), r.map(|r| (r.status, r.error())))
            })
        })
        .collect();
    for t in threads {
        let (what, answer) = t.join().unwrap();
        let (status, error) = answer.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(status, 400, "{what}: {error}");
        // Triton's words: the count past i64, or its bytes.
        let named = error.contains("causes total element count to exceed maximum size of")
            || error.contains("byte size overflow for input");
        assert!(named, "{what}: {error}");
    }
    // The same in JSON, and a BYTES element that claims 4 GB of a 4-byte body.
    let body = infer_body(json!([{"name": "i64_in", "shape": [1, huge], "datatype": "INT64", "data": []}]));
    refused(&server, "JSON tensor of 2^61 elements", infer, &[], &body, 400, "byte size overflow for input 'i64_in'");
    let body = infer_body(json!([{"name": "i64_in", "shape": [1, 1_i64 << 40], "datatype": "INT64", "data": []}]));
    refused(&server, "JSON tensor of 2^40 elements", infer, &[], &body, 400, "has more elements than the request's");
    let inputs = json!([{"name": "f32_in", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 4}}]);
    let (body, length) = binary_infer_body(inputs, &u32::MAX.to_le_bytes());
    let headers = [("Inference-Header-Content-Length", length.as_str())];
    refused(&server, "BYTES element claiming 4 GiB", infer, &headers, &body, 400, "claims 4294967295 bytes");
    // A bad value whose description is cut at byte 40, inside a two-byte character.
    let body = infer_body(json!([{"name": "f32_in", "shape": [1, 1], "datatype": "FP32", "data": ["é".repeat(30)]}]));
    refused(&server, "multi-byte value in an error", infer, &[], &body, 400, "éé...");

    // Shared memory: a region of 64 bytes registered, then requests that claim more of it, or
    // more than a request may carry, or offsets and sizes that wrap; none reads past its region.
    let object = format!("inferd-hostile-{}", std::process::id());
    let path = std::path::Path::new("/dev/shm").join(&object);
    std::fs::write(&path, [0u8; 64]).unwrap();
    let register = |name: &str, offset: u64, size: u64| {
        let body = format!(r#"{{"key": "/{object}", "offset": {offset}, "byte_size": {size}}}"#);
        let path = format!("/v2/systemsharedmemory/region/{name}/register");
        request(server.addr, "POST", &path, &[], body.as_bytes()).unwrap()
    };
    assert_eq!(register("r64", 0, 64).status, 200);
    for (offset, size) in [(0, 65), (u64::MAX, 2), (1, u64::MAX), (65, 0)] {
        let r = register("wide", offset, size);
        assert_eq!(r.status, 400, "register {offset}+{size}: {}", String::from_utf8_lossy(&r.body));
        assert!(r.error().contains("invalid args"), "{}", r.error());
    }
    let in_shm = |shape: serde_json::Value, offset: u64, size: u64| {
        let parameters =
            json!({"shared_memory_region": "r64", "shared_memory_offset": offset, "shared_memory_byte_size": size});
        infer_body(json!([{"name": "i64_in", "shape": shape, "datatype": "INT64", "parameters": parameters}]))
    };
    for (what, body, message) in [
        ("2^61 elements from 64 bytes", in_shm(json!([1, huge]), 0, 64), "byte size overflow for input 'i64_in'"),
        ("2^40 elements from 64 bytes", in_shm(json!([1, 1_i64 << 40]), 0, 64), "more elements than the request's 64"),
        ("a size past the region", in_shm(json!([1, 8]), 8, 64), "Invalid offset + byte size"),
        ("a size that wraps", in_shm(json!([1, 1]), 8, u64::MAX), "Invalid offset + byte size"),
        ("an offset that wraps", in_shm(json!([1, 1]), u64::MAX, 8), "Invalid offset for shared memory region"),
        ("8 EiB claimed", in_shm(json!([1, 1]), 0, 1 << 63), "Invalid offset + byte size"),
    ] {
        refused(&server, what, infer, &[], &body, 400, message);
    }
    let r = request(server.addr, "POST", "/v2/systemsharedmemory/unregister", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    std::fs::remove_file(&path).unwrap();

    // Text: 16 MB (within the body limit) is refused before it is tokenized, on every route
    // that tokenizes; with truncation allowed it is cut first and answered at once.
    let text = "many words of text ".repeat(16_000_000 / 19);
    let max = "at most 8192 bytes are tokenized";
    for (path, body) in [
        ("/tokenize", json!({ "inputs": text })),
        ("/predict", json!({ "inputs": text })),
        ("/v2/models/classifier/predict", json!({ "inputs": [text.clone(), "fine"] })),
        (
            "/v2/models/classifier/infer",
            json!({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}]}),
        ),
    ] {
        refused(&server, &format!("16 MB text to {path}"), path, &[], &serde_json::to_vec(&body).unwrap(), 413, max);
    }
    let started = Instant::now();
    let body = serde_json::to_vec(&json!({ "inputs": text, "truncate": true })).unwrap();
    let r = server.request("POST", "/predict", &body);
    assert_eq!(r.status, 200, "a truncated 16 MB text: {}", r.error());
    eprintln!("16 MB text with truncate: 200 in {:.0} ms", started.elapsed().as_secs_f64() * 1e3);

    // Images whose headers are small and whose decoding or resizing is not.
    let cnn = "/v2/models/cnn/predict";
    let side = "no side may be longer than 16384 (image.max_side)";
    for (width, height, status, message) in [
        (39_000_000, 1, 413, side),
        (1, 39_000_000, 413, side),
        (16_385, 2_000, 413, side),
        // Within every bound: decoding starts and finds no image data.
        (16_384, 2_400, 400, "corrupt or truncated"),
    ] {
        let body = serde_json::to_vec(&json!({ "image_b64": b64(&png_header(width, height)) })).unwrap();
        refused(&server, &format!("PNG of {width}x{height}"), cnn, &[], &body, status, message);
    }

    let (answered, failed, mut latencies) = load.finish();
    latencies.sort();
    let p99 = latencies.get(latencies.len() * 99 / 100).copied().unwrap_or_default();
    eprintln!(
        "well-behaved clients: {answered} answers, {} failed, p99 {:.1} ms",
        failed.len(),
        p99.as_secs_f64() * 1e3
    );
    assert!(failed.is_empty(), "{:?}", &failed[..failed.len().min(5)]);
    assert!(answered > 0);
    // Nobody was replaced, everyone is ready and stayed under the memory limit, which exists
    // without any configuration.
    let status = server.wait_ready(Duration::from_secs(10));
    let pids =
        |s: &serde_json::Value| s["workers"].as_array().unwrap().iter().map(|w| w["pid"].clone()).collect::<Vec<_>>();
    assert_eq!(pids(&status), pids(&before), "{status:#}");
    let limit = soft_limit_bytes(&status);
    for w in status["workers"].as_array().unwrap() {
        assert!(w["private_bytes"].as_u64().unwrap() < limit, "{w:#} over {limit}");
        assert_eq!(w["restarts"], 0, "{w:#}");
    }
    assert_eq!(server.request("GET", "/v2/health/ready", b"").status, 200);
    assert_eq!(server.request("POST", infer, &typed_request()).status, 200);
}

/// Waits until `test` holds for the pool's status.
fn wait_for(server: &Server, what: &str, test: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = server.status();
        if test(&status) {
            return status;
        }
        assert!(Instant::now() < deadline, "{what}: {status:#}\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_panic_costs_its_request_or_its_worker_and_readiness_never_lies() {
    let server = start("panics");
    let infer = "/v2/models/typed/infer";
    assert_eq!(server.request("POST", infer, &typed_rows_request(3)).status, 200);

    // A lane panics running the batch: that request gets a 500, the others nothing; the worker
    // is replaced gap-free.
    let load = typed_load(&server, 3);
    let r = server.request("POST", infer, &typed_rows_request(7));
    assert_eq!(r.status, 500, "{}", r.error());
    let faulty: i64 = r.header("x-inferd-worker").unwrap().parse().unwrap();
    let workers = test_workers();
    let status = wait_for(&server, "the faulty worker is replaced", |s| {
        let all = s["workers"].as_array().unwrap();
        s["phase"] == "ready"
            && all.len() == workers
            && all.iter().all(|w| w["state"] == "ready")
            && all.iter().any(|w| w["index"] == faulty && w["started_for"] == "fault")
    });
    let (answered, failed, _) = load.finish();
    assert!(failed.is_empty(), "a caught panic failed other requests: {failed:?}");
    assert!(answered > 0);
    assert!(status["workers"].as_array().unwrap().iter().all(|w| w["restarts"] == 0), "{status:#}");
    assert!(server.metrics_text().contains("inferd_worker_recycles_total{reason=\"fault\"} 1"));
    assert!(server.log().contains("panicked serving a request"), "{}", server.log());

    // The dispatcher panics (taking the job, on the I/O thread): its state is every request's,
    // not one request's, so the worker exits and is respawned. The clients pause: requests in
    // flight on that worker fail by design.
    let before = server.status();
    let r = request(server.addr, "POST", infer, &[], &typed_rows_request(9));
    assert!(r.as_ref().map_or(true, |r| r.status >= 500), "{:?}", r.map(|r| r.status));
    let status = wait_for(&server, "the dead worker is respawned", |s| {
        s["phase"] == "ready"
            && s["workers"].as_array().unwrap().iter().any(|w| w["started_for"] == "respawn")
            && s["workers"].as_array().unwrap().iter().all(|w| w["state"] == "ready")
            && s["workers"].as_array().unwrap().len() == before["workers"].as_array().unwrap().len()
    });
    assert!(server.metrics_text().contains("inferd_worker_restarts_total{reason=\"panic\"} 1"), "{status:#}");
    assert!(server.log().contains("rows at batch; the worker exits"), "{}", server.log());
    // Ready means answering: every worker, again and again.
    let load = typed_load(&server, 3);
    for _ in 0..50 {
        assert_eq!(server.request("GET", "/v2/health/ready", b"").status, 200);
        assert_eq!(server.request("POST", infer, &typed_rows_request(2)).status, 200);
    }
    let (_, failed, _) = load.finish();
    assert!(failed.is_empty(), "{failed:?}");
}

/// A client that sends a request for a large answer and never reads it holds a connection
/// slot only until server.write_timeout_secs: with one slot in the whole pool, the next client
/// is served once the stalled write times out (without the timeout it would wait forever).
#[test]
fn a_client_that_never_reads_its_answer_frees_its_connection() {
    use std::io::Write;
    let server =
        serve(temp_dir("stalled"), 1, &test_models(), "typed", &[], "max_connections = 1\nwrite_timeout_secs = 1");
    // ~15 MB of request and more of answer: far more than the sockets' buffers hold, with the
    // stalled client's receive buffer made small.
    let body = typed_rows_request(200_000);
    let mut stalled = std::net::TcpStream::connect(server.addr).unwrap();
    nix::sys::socket::setsockopt(&stalled, nix::sys::socket::sockopt::RcvBuf, &4096).unwrap();
    let head = format!("POST /v2/models/typed/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", body.len());
    stalled.write_all(head.as_bytes()).unwrap();
    stalled.write_all(&body).unwrap();
    // The only slot is taken; the next client waits in the kernel's queue until it is freed.
    let started = Instant::now();
    let r = request(server.addr, "POST", "/v2/models/typed/infer", &[], &typed_request())
        .unwrap_or_else(|e| panic!("the next client was never served: {e}\n{}", server.log()));
    assert_eq!(r.status, 200, "{}", r.error());
    eprintln!("next client served after {:.1} s", started.elapsed().as_secs_f64());
    drop(stalled);
}

/// The admin listener runs on the supervisor's only thread: 200 connections that send nothing
/// hold at most its 128 slots, each for at most the 3 s header timeout, and a scrape behind them
/// is still answered; so is the control socket meanwhile.
#[test]
fn idle_admin_connections_cannot_starve_scrapes() {
    let server = serve(temp_dir("admin-idle"), 1, &test_models(), "typed", &[], "");
    let admin = server.admin_addr();
    let idle: Vec<_> = (0..200).map(|_| std::net::TcpStream::connect(admin).unwrap()).collect();
    let started = Instant::now();
    let r = request(admin, "GET", "/metrics", &[], b"").unwrap_or_else(|e| panic!("scrape: {e}\n{}", server.log()));
    assert_eq!(r.status, 200);
    assert!(String::from_utf8_lossy(&r.body).contains("inferd_requests_total"));
    eprintln!("scrape behind 200 idle connections answered after {:.1} s", started.elapsed().as_secs_f64());
    assert_eq!(server.status()["phase"], "ready");
    drop(idle);
}

/// The answers that grow far beyond their request (`/embed_all`: 384 floats a token,
/// `/tokenize`: an object a token) are bounded before they are written and count in the
/// worker's byte budget: past what a worker holds at once (here 1 MiB), a 413 naming the
/// setting; within it, the answer. The pool is undisturbed.
#[test]
fn large_answers_are_bounded_and_counted_in_the_byte_budget() {
    let dir = temp_dir("hostile-answers");
    let repository = model_repository(dir.path(), &["minilm"]);
    let port = free_port();
    let settings = "max_body_bytes = 262144\nmax_body_bytes_in_flight = 1048576";
    write_config(dir.path(), port, 1, &repository, "minilm", &[], settings);
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(120));
    let long = "word ".repeat(250);
    let many = serde_json::to_vec(&json!({"inputs": vec![long.as_str(); 64], "truncate": true})).unwrap();
    // 64 x 256 tokens x 384 floats: ~100 MB of JSON.
    refused(&server, "/embed_all of 64 long texts", "/embed_all", &[], &many, 413, "server.max_body_bytes_in_flight");
    // 64 x ~250 token objects: ~1.8 MB.
    let many = serde_json::to_vec(&json!({"inputs": vec![long.as_str(); 64]})).unwrap();
    refused(&server, "/tokenize of 64 long texts", "/tokenize", &[], &many, 413, "server.max_body_bytes_in_flight");
    // Within the budget: answered, and its share given back once sent. Each of these takes
    // about half the budget (82 tokens x 384 floats x 16 bytes at most): were answers' shares
    // kept, the third would be refused.
    let half = serde_json::to_vec(&json!({"inputs": ["word ".repeat(80)]})).unwrap();
    for _ in 0..20 {
        let r = server.request("POST", "/embed_all", &half);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()[0].as_array().unwrap().len(), 82);
        assert_eq!(r.json()[0][0].as_array().unwrap().len(), 384);
        let r = server.request("POST", "/tokenize", br#"{"inputs": "Hello world"}"#);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
    let status = server.status();
    assert!(status["workers"].as_array().unwrap().iter().all(|w| w["restarts"] == 0), "{status}");
}
