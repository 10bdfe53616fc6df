//! KServe v2 over real HTTP: every datatype, output selection, request ids, the errors for bad
//! requests, and the real `tritonclient` package against the server.

use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

fn typed_server(tag: &str) -> Server {
    let dir = temp_dir(tag);
    let port = free_port();
    write_config(
        dir.path(),
        port,
        test_workers(),
        &test_models(),
        "typed",
        &["slow", "classifier"],
        "max_body_bytes = 65536",
    );
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    server
}

fn typed_inputs() -> Value {
    json!([
        {"name": "f32_in", "shape": [2, 4], "datatype": "FP32", "data": [[0.5, 1, 2, 3], [4, 5, 6, -7.25]]},
        {"name": "f64_in", "shape": [2, 4], "datatype": "FP64", "data": [1, 2, 3, 4, 5, 6, 7, 8.5]},
        {"name": "i32_in", "shape": [2, 4], "datatype": "INT32", "data": [0, 1, -2, 3, 2147483640, 5, 6, 7]},
        {"name": "i64_in", "shape": [2, 4], "datatype": "INT64", "data": [1, 2, 3, 4, 5, 6, 7, 3000000000i64]},
        {"name": "bool_in", "shape": [2, 4], "datatype": "BOOL", "data": [true, false, true, false, false, false, true, true]},
        {"name": "f16_in", "shape": [2, 4], "datatype": "FP16", "data": [0.5, 1, 1.5, 2, -2, 0, 3, 1024]},
    ])
}

fn output<'a>(answer: &'a Value, name: &str) -> &'a Value {
    answer["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["name"] == name)
        .unwrap_or_else(|| panic!("no output {name} in {answer}"))
}

#[test]
fn every_datatype_round_trips_through_the_model() {
    let server = typed_server("dtypes");
    let body = serde_json::to_vec(&json!({"id": "req-42", "inputs": typed_inputs()})).unwrap();
    let response = server.request("POST", "/v2/models/typed/infer", &body);
    assert_eq!(response.status, 200, "{}", String::from_utf8_lossy(&response.body));
    let a = response.json();
    assert_eq!(a["id"], "req-42");
    assert_eq!(a["model_name"], "typed");
    assert_eq!(a["outputs"].as_array().unwrap().len(), 7);
    let f32_out = output(&a, "f32_out");
    assert_eq!((f32_out["datatype"].as_str(), &f32_out["shape"]), (Some("FP32"), &json!([2, 4])));
    assert_eq!(f32_out["data"], json!([2.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0, -13.5]));
    assert_eq!(output(&a, "f64_out")["data"], json!([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.25]));
    assert_eq!(output(&a, "i32_out")["data"], json!([7, 8, 5, 10, 2147483647, 12, 13, 14]));
    assert_eq!(output(&a, "i64_out")["data"], json!([-3, -6, -9, -12, -15, -18, -21, -9000000000i64]));
    assert_eq!(output(&a, "bool_out")["data"], json!([false, true, false, true, true, true, false, false]));
    assert_eq!(output(&a, "f16_out")["datatype"], "FP16");
    assert_eq!(output(&a, "f16_out")["data"], json!([1.0, 2.0, 3.0, 4.0, -4.0, 0.0, 6.0, 2048.0]));
    assert_eq!(output(&a, "f32_sum")["data"], json!([6.5, 7.75]));
    assert_eq!(output(&a, "f32_sum")["shape"], json!([2]));

    // Output selection returns only what was asked for, in the order asked.
    let body =
        serde_json::to_vec(&json!({"inputs": typed_inputs(), "outputs": [{"name": "f32_sum"}, {"name": "bool_out"}]}))
            .unwrap();
    let a = server.request("POST", "/v2/models/typed/infer", &body).json();
    let names: Vec<&str> = a["outputs"].as_array().unwrap().iter().map(|o| o["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["f32_sum", "bool_out"]);
    assert!(a.get("id").is_none());
}

#[test]
fn metadata_and_health_endpoints() {
    let server = typed_server("meta");
    assert_eq!(server.request("GET", "/v2/health/live", b"").status, 200);
    assert_eq!(server.request("GET", "/v2/health/ready", b"").status, 200);
    assert_eq!(server.request("GET", "/v2/models/typed/ready", b"").status, 200);
    assert_eq!(server.request("GET", "/v2/models/typed/versions/1/ready", b"").status, 200);
    let meta = server.request("GET", "/v2", b"").json();
    assert_eq!(meta["name"], "inferd");
    let m = server.request("GET", "/v2/models/slow", b"").json();
    assert_eq!(m["name"], "slow");
    assert_eq!(m["versions"], json!(["1"]));
    assert_eq!(m["inputs"][0], json!({"name": "x", "datatype": "FP32", "shape": [-1, 256]}));
    assert_eq!(m["inputs"][1], json!({"name": "iterations", "datatype": "INT64", "shape": [1]}));
    let missing = server.request("GET", "/v2/models/nope", b"");
    assert_eq!(missing.status, 404);
    assert!(missing.error().contains("unknown model: 'nope'"), "{}", missing.error());
    assert_eq!(server.request("GET", "/v2/models/typed/versions/9", b"").status, 404);
}

#[test]
fn bad_requests_get_a_4xx_naming_the_problem_and_change_nothing() {
    let server = typed_server("bad");
    let with = |f: &dyn Fn(&mut Vec<Value>)| {
        let mut inputs = typed_inputs().as_array().unwrap().clone();
        f(&mut inputs);
        infer_body(Value::Array(inputs))
    };
    // (case, method, path, body, status, words of the error)
    type Case<'a> = (&'a str, &'a str, &'a str, Vec<u8>, u16, &'a str);
    let twice = serde_json::to_vec(&json!({
        "inputs": typed_inputs(),
        "outputs": [{"name": "f32_out"}, {"name": "f64_out"}, {"name": "f32_out"}]
    }))
    .unwrap();
    let sequence = serde_json::to_vec(&json!({
        "inputs": typed_inputs(),
        "parameters": {"sequence_id": 7, "sequence_start": true, "sequence_end": false}
    }))
    .unwrap();
    let cases: Vec<Case> = vec![
        ("a request of a sequence", "POST", "/v2/models/typed/infer", sequence, 400, "inferd has no sequence batcher"),
        (
            "an output asked for twice (Triton: 400)",
            "POST",
            "/v2/models/typed/infer",
            twice,
            400,
            "output 'f32_out' already exists in request",
        ),
        (
            "wrong dtype",
            "POST",
            "/v2/models/typed/infer",
            with(&|i| i[0]["datatype"] = json!("FP64")),
            400,
            "input 'f32_in': expected FP32, got FP64",
        ),
        (
            "unknown dtype",
            "POST",
            "/v2/models/typed/infer",
            with(&|i| i[0]["datatype"] = json!("FLOAT")),
            400,
            "unknown datatype 'FLOAT'",
        ),
        (
            "wrong rank",
            "POST",
            "/v2/models/typed/infer",
            with(&|i| i[0]["shape"] = json!([8])),
            400,
            "input 'f32_in': expected shape [-1,4] (rank 2)",
        ),
        (
            "wrong fixed dim",
            "POST",
            "/v2/models/typed/infer",
            with(&|i| i[0]["shape"] = json!([4, 2])),
            400,
            "input 'f32_in': dimension 1 must be 4",
        ),
        (
            "data length",
            "POST",
            "/v2/models/typed/infer",
            with(&|i| i[1]["data"] = json!([1, 2, 3])),
            400,
            "input 'f64_in': shape [2,4] needs 8 values, got 3",
        ),
        (
            "huge shape",
            "POST",
            "/v2/models/typed/infer",
            with(&|i| i[1]["shape"] = json!([1000000000, 4])),
            400,
            "shape [1000000000,4] has more elements than the request's",
        ),
        (
            "bad element",
            "POST",
            "/v2/models/typed/infer",
            with(&|i| i[2]["data"][0] = json!(1.5)),
            400,
            "input 'i32_in': element 0 is 1.5",
        ),
        (
            "missing input",
            "POST",
            "/v2/models/typed/infer",
            with(&|i| {
                i.remove(3);
            }),
            400,
            "missing required input(s) ['i64_in']. Please provide all required input(s). The first missing is input 'i64_in'",
        ),
        (
            "unknown input",
            "POST",
            "/v2/models/typed/infer",
            with(&|i| i.push(json!({"name": "zz", "shape": [1], "datatype": "FP32", "data": [1]}))),
            400,
            "unknown input 'zz'",
        ),
        ("unknown model", "POST", "/v2/models/nope/infer", with(&|_| {}), 404, "unknown model: 'nope'"),
        (
            "malformed JSON",
            "POST",
            "/v2/models/typed/infer",
            b"{\"inputs\": [".to_vec(),
            400,
            "not a valid inference request",
        ),
        ("no inputs field", "POST", "/v2/models/typed/infer", b"{}".to_vec(), 400, "missing field `inputs`"),
        (
            "unknown output",
            "POST",
            "/v2/models/typed/infer",
            serde_json::to_vec(&json!({"inputs": typed_inputs(), "outputs": [{"name": "nope"}]})).unwrap(),
            400,
            "unknown output 'nope'",
        ),
        (
            "oversized body",
            "POST",
            "/v2/models/typed/infer",
            vec![b' '; 70000],
            400,
            "request JSON size of 70000 bytes exceeds the maximum allowed input size of 65536 bytes",
        ),
        ("wrong method", "GET", "/v2/models/typed/infer", Vec::new(), 405, "method GET is not allowed"),
        ("no route", "GET", "/v1/models", Vec::new(), 404, "no route for GET /v1/models"),
    ];
    for (what, method, path, body, status, message) in cases {
        let r = server.request(method, path, &body);
        assert_eq!(r.status, status, "{what}: {}", String::from_utf8_lossy(&r.body));
        assert!(r.error().contains(message), "{what}: {:?} does not contain {message:?}", r.error());
        assert_eq!(r.header("content-type"), Some("application/json"), "{what}");
    }
    // A body announced as too large is refused before it is read.
    let r = request(server.addr, "POST", "/v2/models/typed/infer", &[("Content-Length", "99999999")], b"")
        .map(|r| r.status);
    assert!(matches!(r, Ok(400)), "{r:?}");
    // Elsewhere, a body past the limit is a 413.
    let r = request(server.addr, "POST", "/v2/models/typed/predict", &[], &[b' '; 70000]).unwrap();
    assert_eq!(r.status, 413, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.error().contains("larger than the limit of 65536 bytes (server.max_body_bytes)"), "{}", r.error());

    // The workers are still ready and serve a good request on every worker.
    assert_eq!(server.request("GET", "/v2/health/ready", b"").status, 200);
    let status = server.status();
    assert_eq!(status["phase"], "ready");
    assert!(status["workers"].as_array().unwrap().iter().all(|w| w["restarts"] == 0));
    let ok = server.request("POST", "/v2/models/typed/infer", &infer_body(typed_inputs()));
    assert_eq!(ok.status, 200);
}

fn tritonclient_check(mode: &[&str]) {
    let server = typed_server("triton");
    let addr = server.addr.to_string();
    let args: Vec<&str> = mode.iter().copied().chain([addr.as_str()]).collect();
    client_check("tritonclient_check.py", &args, &server, "all checks passed");
}

#[test]
fn tritonclient_speaks_to_inferd_with_json_tensors() {
    tritonclient_check(&[]);
}

/// The binary tensor data extension (tritonclient's default) and BYTES tensors in and out.
#[test]
fn tritonclient_speaks_to_inferd_with_binary_tensors() {
    tritonclient_check(&["--binary"]);
}

/// BYTES are byte strings, as in Triton: any byte, NUL included, goes in and comes back out
/// unchanged (an identity over BYTES, tests/fixtures/bytes_identity.onnx): in JSON (a string
/// with `\u0000`) and through the binary extension (bytes that are not UTF-8 at all), in a
/// batch with other requests' elements too.
#[test]
fn bytes_with_any_byte_value_round_trip_through_the_model() {
    let dir = temp_dir("bytes");
    let repository = dir.path().join("models");
    model_of_file(&repository, "identity", &fixture("bytes_identity"), "");
    let server = serve(dir, 1, &repository, "identity", &[], "");

    // JSON: a NUL inside a string, an empty string, text beyond ASCII.
    let texts = ["he\u{0}llo", "", "Wörld\u{0}"];
    let body = infer_body(json!([{"name": "INPUT0", "shape": [3], "datatype": "BYTES", "data": texts}]));
    let r = server.request("POST", "/v2/models/identity/infer", &body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(output(&r.json(), "OUTPUT0")["data"], json!(texts));

    // Binary in and out: each element a 4-byte little-endian length and its bytes.
    let items: [&[u8]; 4] = [b"\xff\x00\xfe", b"", b"\x00", b"plain"];
    let mut data = Vec::new();
    for item in items {
        data.extend_from_slice(&(item.len() as u32).to_le_bytes());
        data.extend_from_slice(item);
    }
    let inputs = json!([{"name": "INPUT0", "shape": [4], "datatype": "BYTES",
                         "parameters": {"binary_data_size": data.len()}}]);
    let mut head = serde_json::to_vec(&json!({
        "inputs": inputs,
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": true}}]
    }))
    .unwrap();
    let length = head.len().to_string();
    head.extend_from_slice(&data);
    let headers = [("Inference-Header-Content-Length", length.as_str())];
    let r = request(server.addr, "POST", "/v2/models/identity/infer", &headers, &head).unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let json_len: usize = r.header("inference-header-content-length").expect("a binary answer").parse().unwrap();
    let answer: Value = serde_json::from_slice(&r.body[..json_len]).unwrap();
    assert_eq!(answer["outputs"][0]["parameters"]["binary_data_size"], json!(data.len()), "{answer}");
    assert_eq!(&r.body[json_len..], &data[..], "the bytes came back changed");
}

/// Triton's model configuration extension (`GET /v2/models/{name}/config`), read by the real
/// `tritonclient.http` as its image_client does: a raw model's tensors without the batch
/// dimension and its rows a run; a pipelined model's one BYTES input per row.
#[test]
fn model_configuration_in_tritons_shape() {
    let server = typed_server("config");
    let config = server.request("GET", "/v2/models/typed/config", b"");
    assert_eq!(config.status, 200, "{}", String::from_utf8_lossy(&config.body));
    let config = config.json();
    assert_eq!((config["name"].as_str(), config["max_batch_size"].as_u64()), (Some("typed"), Some(32)), "{config}");
    assert_eq!(config["platform"], "onnxruntime_onnx");
    assert_eq!(
        config["input"][0],
        json!({"name": "f32_in", "data_type": "TYPE_FP32", "format": "FORMAT_NONE", "dims": [4], "optional": false})
    );
    assert_eq!(config["output"][6], json!({"name": "f32_sum", "data_type": "TYPE_FP32", "dims": []}));
    assert_eq!(config["dynamic_batching"]["max_queue_delay_microseconds"], 0);
    let classifier = server.request("GET", "/v2/models/classifier/versions/1/config", b"").json();
    assert_eq!(classifier["input"][0]["data_type"], "TYPE_STRING", "{classifier}");
    assert_eq!(
        (&classifier["input"][0]["dims"], &classifier["input"][0]["reshape"]),
        (&json!([1]), &json!({"shape": []}))
    );
    assert_eq!(classifier["output"][2], json!({"name": "probabilities", "data_type": "TYPE_FP32", "dims": [3]}));
    assert_eq!(server.request("GET", "/v2/models/nope/config", b"").status, 404);

    // The real client reads it.
    let script = format!(
        "import tritonclient.http as h\nc = h.InferenceServerClient('{}')\nm = c.get_model_config('typed')\n\
         assert m['max_batch_size'] == 32 and m['input'][0]['dims'] == [4], m\nprint('config ok')\n",
        server.addr
    );
    let out = std::process::Command::new(python()).args(["-c", &script]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("config ok"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Compressed request bodies, as `tritonclient.http` sends them (`request_compression_algorithm`
/// gzip and deflate): inflated within `server.max_body_bytes` (64 KiB here), so a gzip of 64 MiB
/// of zeros (64 KiB on the wire) is refused (400 in Triton's words on its route, 413 on
/// another) having inflated at most the limit, and an
/// encoding inferd does not speak is refused naming it.
#[test]
fn compressed_request_bodies_inflate_within_the_body_limit() {
    let server = typed_server("compressed");
    let script = format!(
        r#"
import gzip, json, urllib.request, urllib.error
import numpy as np
import tritonclient.http as h
c = h.InferenceServerClient('{addr}')
x = h.InferInput('f32_in', [2, 4], 'FP32')
x.set_data_from_numpy(np.arange(8, dtype=np.float32).reshape(2, 4))
inputs = [x]
for name, dtype in [('f64_in', np.float64), ('i32_in', np.int32), ('i64_in', np.int64), ('bool_in', np.bool_), ('f16_in', np.float16)]:
    t = h.InferInput(name, [2, 4], {{np.float64: 'FP64', np.int32: 'INT32', np.int64: 'INT64', np.bool_: 'BOOL', np.float16: 'FP16'}}[dtype])
    t.set_data_from_numpy(np.ones((2, 4), dtype=dtype))
    inputs.append(t)
for algorithm in ['gzip', 'deflate']:
    r = c.infer('typed', inputs, request_compression_algorithm=algorithm)
    assert r.as_numpy('f32_sum').tolist() == [6.0, 22.0], r.as_numpy('f32_sum')
def post(body, encoding):
    req = urllib.request.Request('http://{addr}/v2/models/typed/infer', data=body, headers={{'Content-Encoding': encoding}})
    try:
        urllib.request.urlopen(req)
        return 200, ''
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
bomb = gzip.compress(b'0' * (64 << 20))
assert len(bomb) < 1 << 20, len(bomb)
status, text = post(bomb, 'gzip')
assert status == 400 and 'Decompressed data size exceeds the maximum allowed value of 65536 bytes' in text, (status, text)
req = urllib.request.Request('http://{addr}/v2/models/typed/predict', data=bomb, headers={{'Content-Encoding': 'gzip'}})
try:
    urllib.request.urlopen(req)
    raise AssertionError('a bomb was served')
except urllib.error.HTTPError as e:
    text = e.read().decode()
    assert e.code == 413 and 'inflates to more than the limit of 65536 bytes' in text, (e.code, text)
status, text = post(b'{{}}', 'br')
assert status == 400 and "Content-Encoding 'br' is not supported" in text, (status, text)
status, text = post(b'not gzip', 'gzip')
assert status == 400 and 'not valid gzip' in text, (status, text)
print('compression ok')
"#,
        addr = server.addr
    );
    let out = std::process::Command::new(python()).args(["-c", &script]).output().unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("compression ok"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Compressed answers where the client asks (`Accept-Encoding`, worker/src/http/compress.rs):
/// a large answer comes gzip- or deflate-compressed as the header's q-values choose, with
/// `Content-Encoding`, `Vary: Accept-Encoding` and the compressed length, and inflates to the
/// plain answer; `identity`, `gzip;q=0`, a coding inferd does not write, no header, a small
/// answer and an error all come plain. (inferd has no streamed or SSE route; every answer is
/// whole before it is sent.)
#[test]
fn answers_are_compressed_where_the_client_asks() {
    use inferd_worker::http::encoding::Encoding;
    let server = typed_server("answer-compression");
    let body = typed_rows_request(100);
    let infer = |accept: Option<&str>, body: &[u8]| {
        let headers: Vec<(&str, &str)> = accept.map(|a| ("Accept-Encoding", a)).into_iter().collect();
        let r = request(server.addr, "POST", "/v2/models/typed/infer", &headers, body).unwrap();
        let length: usize = r.header("content-length").expect("a Content-Length").parse().unwrap();
        assert_eq!(length, r.body.len(), "Content-Length is the body's as sent");
        r
    };
    let plain = infer(None, &body);
    assert_eq!(plain.status, 200, "{}", String::from_utf8_lossy(&plain.body));
    assert!(plain.body.len() > 4096, "the answer is large enough to be compressed: {}", plain.body.len());
    assert_eq!((plain.header("content-encoding"), plain.header("vary")), (None, Some("accept-encoding")));
    let cases = [
        // tritonclient.http's response_compression_algorithm='gzip' and 'deflate' send these.
        ("gzip", Some("gzip")),
        ("deflate", Some("deflate")),
        // A browser's list; q-values; gzip when both are as welcome.
        ("gzip, deflate, br", Some("gzip")),
        ("deflate, gzip", Some("gzip")),
        ("gzip;q=0.5, deflate", Some("deflate")),
        ("*", Some("gzip")),
        // Not acceptable, not asked for, or not a coding inferd writes.
        ("gzip;q=0", None),
        ("gzip;q=0, deflate;q=0", None),
        ("identity", None),
        ("br", None),
        ("", None),
    ];
    for (accept, coding) in cases {
        let r = infer(Some(accept), &body);
        assert_eq!(r.status, 200, "{accept}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!((r.header("content-encoding"), r.header("vary")), (coding, Some("accept-encoding")), "{accept}");
        let Some(coding) = coding else {
            assert_eq!(r.body, plain.body, "{accept}: a plain answer");
            continue;
        };
        assert!(r.body.len() * 3 < plain.body.len(), "{accept}: {} of {} bytes", r.body.len(), plain.body.len());
        let inflated = Encoding::from_header(Some(coding)).unwrap().decode(&r.body, 1 << 24, |_| true).unwrap();
        assert_eq!(inflated, plain.body, "{accept}: inflates to the plain answer");
    }
    // Not an inference: statistics go as they are, however large (tritonclient.http.aio asks
    // for gzip on every call and inflates only infer answers).
    let stats = request(server.addr, "GET", "/v2/models/stats", &[("Accept-Encoding", "gzip, deflate")], b"").unwrap();
    assert_eq!((stats.status, stats.header("content-encoding")), (200, None));
    assert!(stats.body.len() as u64 >= inferd_worker::http::compress::MIN_BYTES, "{} bytes", stats.body.len());
    assert!(serde_json::from_slice::<serde_json::Value>(&stats.body).is_ok());
    // A small answer (under 1 KiB) and an error are sent as they are.
    let ready = request(server.addr, "GET", "/v2/health/ready", &[("Accept-Encoding", "gzip")], b"").unwrap();
    assert_eq!((ready.status, ready.header("content-encoding")), (200, None));
    assert_eq!(ready.body, b"{\"ready\":true}");
    let error = infer(Some("gzip"), &typed_rows_request(100)[..100]);
    assert_eq!(
        (error.status, error.header("content-encoding")),
        (400, None),
        "{}",
        String::from_utf8_lossy(&error.body)
    );
    assert!(String::from_utf8_lossy(&error.body).starts_with("{\"error\""));

    // The real client: tritonclient.http's response_compression_algorithm, JSON and binary
    // outputs (the binary answer's Inference-Header-Content-Length counts the inflated JSON).
    let script = format!(
        r#"
import gzip, zlib
import numpy as np
import tritonclient.http as h
inflated = []
for module in (gzip, zlib):
    def counted(data, _inflate=module.decompress, _name=module.__name__):
        inflated.append(_name)
        return _inflate(data)
    module.decompress = counted
c = h.InferenceServerClient('{addr}')
rows = np.arange(400, dtype=np.float32).reshape(100, 4)
inputs = []
for name, datatype, dtype in [('f32_in', 'FP32', np.float32), ('f64_in', 'FP64', np.float64), ('i32_in', 'INT32', np.int32), ('i64_in', 'INT64', np.int64), ('bool_in', 'BOOL', np.bool_), ('f16_in', 'FP16', np.float16)]:
    t = h.InferInput(name, [100, 4], datatype)
    t.set_data_from_numpy(rows.astype(dtype), binary_data=False)
    inputs.append(t)
plain = c.infer('typed', inputs)
for algorithm, module in [('gzip', 'gzip'), ('deflate', 'zlib')]:
    for binary in (False, True):
        outputs = [h.InferRequestedOutput(n, binary_data=binary) for n in ('f32_out', 'i64_out', 'f32_sum')]
        inflated.clear()
        r = c.infer('typed', inputs, outputs=outputs, response_compression_algorithm=algorithm)
        assert inflated == [module], (algorithm, inflated)
        for n in ('f32_out', 'i64_out', 'f32_sum'):
            assert np.array_equal(r.as_numpy(n), plain.as_numpy(n)), (algorithm, binary, n)
print('answer compression ok')
"#,
        addr = server.addr
    );
    let out = std::process::Command::new(python()).args(["-c", &script]).output().unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("answer compression ok"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The body limit as Triton's HTTP QA tests probe it (server qa/L0_http/
/// http_input_size_limit_test.py: the default-limit, large-string, compressed and header-length
/// cases, with `requests` as they send; tests/clients/triton_input_size_check.py): Triton's
/// 64 MiB unless set, one byte past it a 400 in Triton's words on KServe's infer route and the
/// limit itself served, for JSON, raw binary and gzip bodies; `--http-max-input-size` (Triton's
/// flag, inferd's `--max-body-bytes`) moves it.
#[test]
fn the_body_limit_is_tritons_on_kserve_infer() {
    for (tag, flag) in [("input-size", None), ("input-size-flag", Some("1048576"))] {
        let dir = temp_dir(tag);
        let repository = dir.path().join("models");
        model_of_file(&repository, "cumsum", &fixture("cumsum"), "");
        model_of_file(&repository, "one_string", &fixture("one_string"), "");
        let port = free_port();
        write_config(dir.path(), port, 1, &repository, "cumsum", &["one_string"], "");
        let args: Vec<&str> = flag.map(|bytes| vec!["--http-max-input-size", bytes]).unwrap_or_default();
        let mut server = Server::start(dir, port, &args);
        server.wait_ready(Duration::from_secs(60));
        let limit = flag.unwrap_or("67108864");
        let worker = server.worker_pids()[0].to_string();
        let addr = server.addr.to_string();
        let said =
            client_check("triton_input_size_check.py", &[&addr, limit, "--leak", &worker], &server, "input size ok");
        eprintln!("{tag}: {said}");
    }
}

/// Triton's generate extension as its own QA tests call it (server qa/L0_http/
/// generate_endpoint_test.py: `test_generate`, `test_generate_with_all_inputs`, `test_request_id`,
/// `test_missing_inputs`, `test_invalid_input_types`, `test_duplicate_inputs`,
/// `test_complex_schema`, `test_one_response`; http_input_size_limit_test.py's
/// `test_json_dtype_size_expansion_exceeds_limit_error`), on an ONNX `mock_llm`
/// (tests/fixtures/prompt_echo.onnx) and a running sum: members are inputs shaped as the model
/// declares them, one JSON answer or one server-sent event, refusals in Triton's words that
/// change nothing.
#[test]
fn tritons_generate_extension_answers_one_object() {
    let dir = temp_dir("generate");
    let repository = dir.path().join("models");
    model_of_file(&repository, "mock_llm", &fixture("prompt_echo"), "optional_inputs = [\"input_ids\"]");
    model_of_file(&repository, "cumsum", &fixture("cumsum"), "");
    let server = serve(dir, 1, &repository, "cumsum", &["mock_llm"], "max_body_bytes = 4096");
    let post = |path: &str, body: &str| {
        request(server.addr, "POST", path, &[("Content-Type", "application/json")], body.as_bytes()).unwrap()
    };
    let answer = |r: &Response| -> Value {
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        serde_json::from_slice(&r.body).unwrap()
    };

    // The prompt back, with the request's id, and the parameters taken without a complaint.
    let hello = r#"{"PROMPT": "hello world", "STREAM": false, "id": "42", "temperature": 0}"#;
    let r = post("/v2/models/mock_llm/generate", hello);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let said = answer(&r);
    assert_eq!(
        (&said["TEXT"], &said["id"], &said["model_name"]),
        (&json!("hello world"), &json!("42"), &json!("mock_llm"))
    );
    assert_eq!(said["model_version"], "1", "{said}");
    let said = answer(&post("/v2/models/mock_llm/versions/1/generate", r#"{"PROMPT": "x", "STREAM": true, "id": ""}"#));
    assert!(said.get("id").is_none() && said["TEXT"] == "x", "an empty id is none: {said}");
    // The optional input, given: its sum (left out, its initializer's 7).
    assert_eq!(said["IDS"], 7, "{said}");
    let all = r#"{"PROMPT": "x", "STREAM": false, "input_ids": [100, 200]}"#;
    assert_eq!(answer(&post("/v2/models/mock_llm/generate", all))["IDS"], 300);
    // A list fills the innermost variable dimension: the running sum proves the order.
    assert_eq!(
        answer(&post("/v2/models/cumsum/generate", r#"{"x": [1, 2, 3, 4]}"#))["y"],
        json!([1.0, 3.0, 6.0, 10.0])
    );

    // generate_stream: the same answer as one event.
    let r = post("/v2/models/mock_llm/generate_stream", hello);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream; charset=utf-8"));
    let event = String::from_utf8(r.body.clone()).unwrap();
    let data = event.strip_prefix("data: ").and_then(|e| e.strip_suffix("\n\n")).unwrap_or_else(|| panic!("{event:?}"));
    assert_eq!(serde_json::from_str::<Value>(data).unwrap()["TEXT"], "hello world");

    // Refusals, each in Triton's words, on both routes as JSON errors.
    let long = format!(r#"{{"PROMPT": "{}", "STREAM": false}}"#, "a".repeat(5000));
    let ones = format!(r#"{{"x": [{}]}}"#, vec!["1"; 1200].join(","));
    let refused = [
        ("mock_llm", "{}", "expected number of inputs between 2 and 3 but got 0 inputs for model 'mock_llm'"),
        ("mock_llm", r#"{"PROMPT": "hello"}"#, "expected number of inputs between 2 and 3 but got 1 inputs"),
        ("cumsum", "{}", "expected 1 inputs but got 0 inputs for model 'cumsum'"),
        ("mock_llm", r#"{"PROMPT": 123, "STREAM": false}"#, "attempt to access JSON non-string as string"),
        ("mock_llm", r#"{"PROMPT": "hello", "STREAM": "false"}"#, "attempt to access JSON non-boolean as boolean"),
        ("mock_llm", r#"{"PROMPT": {"USER": "a"}, "STREAM": true}"#, "attempt to access JSON non-string as string"),
        ("mock_llm", r#"{"PROMPT": "a", "STREAM": false, "PROMPT": "b"}"#, "input 'PROMPT' already exists in request"),
        ("mock_llm", r#"{"PROMPT": "a", "STREAM": true, "PARAMS": {"P": 0}}"#, "parameter 'PARAMS' has invalid type"),
        ("mock_llm", r#"{"PROMPT": "a", "parameters": 1}"#, "Expected JSON object for keyword: 'parameters'"),
        ("mock_llm", r#"{"PROMPT": ["a", "b"], "STREAM": false}"#, "can not convert input 'PROMPT' to tensor"),
        ("mock_llm", &long, "exceeds the maximum allowed input size of 4096 bytes. Use --http-max-input-size"),
        // 2.4 kB of JSON that would take 4.8 kB as FP32: bounded before it is decoded.
        ("cumsum", &ones, "with input 'x' of size 4800 bytes exceeds the maximum allowed input size of 4096"),
    ];
    for route in ["generate", "generate_stream"] {
        for (model, body, says) in refused {
            let r = post(&format!("/v2/models/{model}/{route}"), body);
            let text = String::from_utf8_lossy(&r.body);
            assert_eq!(
                (r.status, r.header("content-type")),
                (400, Some("application/json")),
                "{route} {body:.80}: {text}"
            );
            let error: Value = serde_json::from_slice(&r.body).unwrap();
            assert!(error["error"].as_str().unwrap().contains(says), "{route} {body:.80}: {text}");
        }
    }
    // Nothing changed: the models still answer.
    assert_eq!(answer(&post("/v2/models/mock_llm/generate", hello))["TEXT"], "hello world");
    assert_eq!(answer(&post("/v2/models/cumsum/generate", r#"{"x": 5}"#))["y"], json!(5.0));
}

/// Optional inputs (Triton's `optional: true`; its L0_input_validation cases
/// `test_input_validation_optional*`): model.toml's `optional_inputs` names graph inputs that
/// have an initializer; a request may give one or leave it out (the graph then runs with the
/// initializer), over REST and gRPC, the model's configuration says which, a request without
/// a required input is refused in Triton's words, and a name that is no such input is refused
/// at start naming those the graph has.
#[test]
fn optional_inputs_may_be_given_or_left_out() {
    let dir = temp_dir("optional");
    let repository = dir.path().join("models");
    model_of_file(&repository, "echo", &fixture("prompt_echo"), "optional_inputs = [\"input_ids\"]");
    let server = serve(dir, 1, &repository, "echo", &[], "");
    let infer = |inputs: Value| {
        let body = json!({"inputs": inputs}).to_string();
        let r = server.request("POST", "/v2/models/echo/infer", body.as_bytes());
        (r.status, serde_json::from_slice::<Value>(&r.body).unwrap())
    };
    let prompt = json!({"name": "PROMPT", "datatype": "BYTES", "shape": [1, 1], "data": ["hi"]});
    let stream = json!({"name": "STREAM", "datatype": "BOOL", "shape": [1, 1], "data": [false]});
    let ids = json!({"name": "input_ids", "datatype": "INT32", "shape": [1, 3], "data": [1, 2, 3]});
    let sum = |answer: &Value| {
        answer["outputs"].as_array().unwrap().iter().find(|o| o["name"] == "IDS").unwrap()["data"].clone()
    };
    let (status, answer) = infer(json!([prompt, stream]));
    assert_eq!((status, sum(&answer)), (200, json!([7])), "left out: the initializer's value; {answer}");
    let (status, answer) = infer(json!([prompt, stream, ids]));
    assert_eq!((status, sum(&answer)), (200, json!([6])), "given: its own; {answer}");
    let (status, answer) = infer(json!([ids]));
    assert_eq!(status, 400, "{answer}");
    let error = answer["error"].as_str().unwrap();
    assert!(error.contains("expected number of inputs between 2 and 3 but got 1 inputs for model 'echo'"), "{error}");
    let config: Value = serde_json::from_slice(&server.request("GET", "/v2/models/echo/config", b"").body).unwrap();
    let optional: Vec<(&str, bool)> = config["input"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| (i["name"].as_str().unwrap(), i["optional"] == true))
        .collect();
    assert_eq!(optional, [("PROMPT", false), ("STREAM", false), ("input_ids", true)], "{config}");
    let addr = server.addr.to_string();
    let said = client_check("triton_optional_check.py", &[&addr], &server, "optional ok");
    eprintln!("{said}");

    // A name that is no graph input with an initializer: refused by check, naming those there are.
    let dir = temp_dir("optional-bad");
    let repository = dir.path().join("models");
    model_of_file(&repository, "echo", &fixture("prompt_echo"), "optional_inputs = [\"PROMPT\"]");
    write_config(dir.path(), free_port(), 1, &repository, "echo", &[], "");
    let out = std::process::Command::new(BIN)
        .args(["check", "--config", "inferd.toml"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "accepted: {said}");
    assert!(said.contains("optional_inputs names 'PROMPT', which is no graph input with an initializer"), "{said}");
    assert!(said.contains("(those the graph has: input_ids)"), "{said}");
}

/// A chunked body is refused past Triton's 65536 non-empty chunks, in its words (server
/// qa/L0_http/http_request_many_chunks.py, sent as it sends them: one-byte chunks on a raw
/// socket, a raw binary infer request): exactly 65536 are served, 65537 and a million are 400,
/// and the worker is the same one, answering, after a run of them.
#[test]
fn a_chunked_body_past_tritons_chunk_count_is_refused() {
    use std::io::{Read, Write};
    let dir = temp_dir("chunks");
    let repository = dir.path().join("models");
    model_of_file(&repository, "cumsum", &fixture("cumsum"), "");
    let server = serve(dir, 1, &repository, "cumsum", &[], "");
    let send = |chunks: usize| {
        let mut socket = std::net::TcpStream::connect(server.addr).unwrap();
        socket.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let head = "POST /v2/models/cumsum/infer HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length: 0\r\n\
                    Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
        socket.write_all(head.as_bytes()).unwrap();
        let mut body = b"1\r\nA\r\n".repeat(chunks);
        body.extend_from_slice(b"0\r\n\r\n");
        // The server may answer and close before the body is all sent, as Triton's test allows.
        let _ = socket.write_all(&body);
        let mut answer = Vec::new();
        let _ = socket.read_to_end(&mut answer);
        String::from_utf8_lossy(&answer).into_owned()
    };
    let pid = server.worker_pids()[0];
    // 65536 bytes of 'A': 16384 floats, their running sum.
    let answer = send(65536);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:.300}");
    let past = "Chunked request body exceeds maximum of 65536 non-empty chunks. Send fewer or larger HTTP chunks.";
    for chunks in [65537, 1_000_000, 1_000_000, 1_000_000] {
        let answer = send(chunks);
        assert!(answer.starts_with("HTTP/1.1 400") && answer.contains(past), "{chunks}: {answer:.300}");
    }
    assert_eq!(server.worker_pids(), [pid], "the worker was replaced");
    assert!(send(65536).starts_with("HTTP/1.1 200"));
}

/// Triton's raw binary request (`Inference-Header-Content-Length: 0`: the body is the one
/// input's bytes), as Triton's own L0_http tests send it (http_test.py: `test_raw_binary`,
/// `test_byte`, `test_byte_too_many_elements`): the shape deduced from the body's size, a
/// string input's whole body one element, every output back as binary data; a model it
/// cannot serve so is a 400 that says why.
#[test]
fn raw_binary_requests_carry_one_inputs_bytes() {
    let dir = temp_dir("raw-binary");
    let repository = dir.path().join("models");
    for (name, file) in [("cumsum", "cumsum"), ("one_string", "one_string"), ("identity", "bytes_identity")] {
        model_of_file(&repository, name, &fixture(file), "");
    }
    let server = serve(dir, 1, &repository, "cumsum", &["one_string", "identity"], "");
    let raw = |model: &str, body: &[u8]| {
        let headers = [("Inference-Header-Content-Length", "0"), ("Content-Type", "application/octet-stream")];
        request(server.addr, "POST", &format!("/v2/models/{model}/infer"), &headers, body).unwrap()
    };
    // Split the answer into its JSON part and its binary data.
    let split = |r: &Response| {
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let n: usize = r.header("inference-header-content-length").expect("a binary answer").parse().unwrap();
        (serde_json::from_slice::<Value>(&r.body[..n]).unwrap(), r.body[n..].to_vec())
    };

    // A running sum over 8 floats: the shape [8] comes from 32 bytes, the sum proves the order.
    let values: Vec<f32> = (0..8).map(|i| i as f32).collect();
    let body: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let (answer, data) = split(&raw("cumsum", &body));
    assert_eq!(answer["outputs"][0]["shape"], json!([8]), "{answer}");
    let sums: Vec<f32> = data.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    assert_eq!(sums, [0.0, 1.0, 3.0, 6.0, 10.0, 15.0, 21.0, 28.0]);

    // One string a row: the body, NUL and all, is the one element of a batch of one.
    let (answer, data) = split(&raw("one_string", b"4\x0027"));
    assert_eq!(answer["outputs"][0]["shape"], json!([1, 1]), "{answer}");
    assert_eq!(data, b"\x04\x00\x00\x004\x0027", "a BYTES output is its length and its bytes");

    // What cannot be deduced: a string input of any length, a body that is no whole number of
    // elements (a model of several inputs: kserve/raw.rs's unit tests).
    for (model, body, says) in
        [("identity", &b"427"[..], "must have input shape [1]"), ("cumsum", &[0u8; 6][..], "6 bytes do not fill")]
    {
        let r = raw(model, body);
        assert_eq!(r.status, 400, "{model}: {}", String::from_utf8_lossy(&r.body));
        assert!(String::from_utf8_lossy(&r.body).contains(says), "{model}: {}", String::from_utf8_lossy(&r.body));
    }
    // Nothing changed: the model still answers a raw request right.
    assert_eq!(split(&raw("cumsum", &body)).1.len(), 32);
}
