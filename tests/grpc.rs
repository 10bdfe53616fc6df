//! KServe v2 over gRPC (`server.grpc_listen`, `--grpc-listen`): NVIDIA's tritonclient.grpc and
//! the protocol's raw stub against every worker's gRPC port (tests/clients/triton_grpc_check.py),
//! counted like REST requests; gRPC clients see no failure while the pool reloads, nor a call in
//! progress when a stream opens just as its worker drains; a bug in a call costs that call
//! INTERNAL, not the worker; a gRPC port that cannot be bound stops the start with a message.

use std::process::{Command, Output};
use std::time::Duration;

use crate::common::*;

/// `typed` (the default), `minilm`, `classifier` and `slow`, serving gRPC on a port of its own
/// (given on the command line); two workers where there are two cores.
fn grpc_server(tag: &str) -> (Server, String) {
    grpc_server_with(tag, "")
}

fn grpc_server_with(tag: &str, settings: &str) -> (Server, String) {
    let dir = temp_dir(tag);
    let repository = model_repository(dir.path(), &["minilm", "typed", "classifier", "slow"]);
    let port = free_port();
    let extra = format!("max_body_bytes = 65536\n{settings}");
    let extra = extra.as_str();
    write_config(dir.path(), port, test_workers(), &repository, "typed", &["minilm", "classifier", "slow"], extra);
    let grpc = format!("127.0.0.1:{}", free_port());
    let mut server = Server::start(dir, port, &["--grpc-listen", &grpc]);
    server.wait_ready(Duration::from_secs(120));
    (server, grpc)
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

#[test]
fn tritonclient_grpc_gets_what_rest_and_the_references_give() {
    let (server, grpc) = grpc_server("grpc-client");
    client_check("triton_grpc_check.py", &[&grpc, &server.addr.to_string()], &server, "grpc: all checks passed");
    // Counted with the REST requests, by model and status: `typed` answered the script's four
    // plain requests and two compressed ones (gzip, deflate) and refused its mistakes (wrong
    // datatype, missing input, unknown output, typed FP16, short raw data) with 400s; no
    // worker failed.
    let metrics = server.metrics_text();
    let count = |code: u16| {
        let line = format!("inferd_requests_total{{model=\"typed\",endpoint=\"infer\",code=\"{code}\"}}");
        metric_value(&metrics, &line).unwrap_or(0.0)
    };
    assert_eq!((count(200), count(400), count(500)), (6.0, 5.0, 0.0), "{metrics}");
    let status = server.status();
    assert!(status["workers"].as_array().unwrap().iter().all(|w| w["restarts"] == 0), "{status}");
    assert_eq!(status["grpc_listen"], grpc.as_str(), "{status}");
    // Triton's ModelConfig RPC, read by the real client: what GET .../config says over HTTP.
    let script = format!(
        "import json, urllib.request\nimport tritonclient.grpc as g\nimport tritonclient.grpc.model_config_pb2 as mc\n\
         c = g.InferenceServerClient('{grpc}')\nfor name in ['typed', 'classifier']:\n\
         \x20   m = c.get_model_config(name, as_json=True)['config']\n\
         \x20   h = json.load(urllib.request.urlopen('http://{}/v2/models/' + name + '/config'))\n\
         \x20   for k in ['name', 'platform', 'backend']: assert m[k] == h[k], (k, m, h)\n\
         \x20   assert int(m['max_batch_size']) == h['max_batch_size'], (m, h)\n\
         \x20   for a, b in zip(m['input'] + m['output'], h['input'] + h['output']):\n\
         \x20       assert (a['name'], a['data_type'], [int(d) for d in a.get('dims', [])]) == (b['name'], b['data_type'], b['dims']), (a, b)\n\
         p = c.get_model_config('classifier').config\n\
         assert p.input[0].data_type == mc.TYPE_STRING and list(p.input[0].reshape.shape) == [] and p.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU, p\n\
         print('grpc config ok')\n",
        server.addr
    );
    let out = Command::new(python()).args(["-c", &script]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("grpc config ok"), "{}", text(&out));
    let table = Command::new(BIN).args(["status", "--control-socket"]).arg(&server.socket).output().unwrap();
    let first = String::from_utf8_lossy(&table.stdout).lines().next().unwrap_or_default().to_string();
    assert!(first.contains(&format!("on {} (gRPC on {grpc})", server.addr)), "{first}");
}

/// A message that decodes to far more than its size (many empty entries) is refused before it
/// is decoded, many at once, while well-behaved clients see no failure; the refusals are
/// counted like any answer; an idle connection is closed (GOAWAY) and its client reconnects.
#[test]
fn hostile_grpc_messages_are_refused_before_decoding_and_idle_connections_close() {
    let (server, grpc) = grpc_server_with("grpc-hostile", "idle_timeout_secs = 1");
    let out = client_check("grpc_hostile.py", &[&grpc, "1"], &server, "grpc hostile: all checks passed");
    let refused: f64 = out
        .lines()
        .find_map(|l| l.strip_prefix("hostile: ")?.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no count in {out}"));
    // Counted before they were answered, under "other": the model they name is not read.
    let metrics = server.metrics_text();
    let count = |code: u16| {
        let line = format!("inferd_requests_total{{model=\"other\",endpoint=\"infer\",code=\"{code}\"}}");
        metric_value(&metrics, &line).unwrap_or(0.0)
    };
    assert_eq!((count(413), count(400)), (refused - 1.0, 1.0), "{refused} refused:\n{metrics}");
    let status = server.status();
    assert!(status["workers"].as_array().unwrap().iter().all(|w| w["restarts"] == 0), "{status}");
}

#[test]
fn a_bug_in_a_grpc_call_costs_that_call_not_the_worker() {
    let dir = temp_dir("grpc-panic");
    let repository = model_repository(dir.path(), &["typed"]);
    let port = free_port();
    let config = write_config(dir.path(), port, test_workers(), &repository, "typed", &[], "");
    let grpc = format!("127.0.0.1:{}", free_port());
    let mut command = Command::new(BIN);
    command.arg("serve").arg("--config").arg(&config).args(["--grpc-listen", &grpc]);
    command.env("INFERD_TEST_PANIC", "grpc:3");
    let mut server = Server::spawn(command, dir, port, None);
    server.wait_ready(Duration::from_secs(120));
    client_check("grpc_panic.py", &[&grpc], &server, "grpc panic: all checks passed");
    let log = server.log();
    assert!(log.contains("panicked serving a request") && log.contains("INFERD_TEST_PANIC"), "{log}");
    assert!(!log.contains("the worker exits"), "the panic ended the worker:\n{log}");
}

#[test]
fn grpc_clients_see_no_failure_while_the_pool_reloads() {
    let (server, grpc) = grpc_server("grpc-reload");
    let load = Command::new(python())
        .arg(repo().join("tests/clients/triton_grpc_check.py"))
        .args(["--load", "20", &grpc, &server.addr.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    // Each rolling reload retires every worker: its gRPC connections get GOAWAY after their
    // streams finish, and the clients reconnect to the new workers.
    for round in 0..3 {
        let out =
            Command::new(BIN).args(["reload", "--wait", "--control-socket"]).arg(&server.socket).output().unwrap();
        assert!(out.status.success(), "reload {round}: {}\n{}", text(&out), server.log());
    }
    let out = load.wait_with_output().unwrap();
    let text = text(&out);
    let line = text.lines().find(|l| l.starts_with("load: ")).unwrap_or_else(|| panic!("no summary:\n{text}"));
    let numbers: Vec<u64> = line.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse().ok()).collect();
    assert!(numbers[0] > 0 && numbers[1] == 0, "{text}\nserver log:\n{}", server.log());
    assert_eq!(server.status()["generation"], 4, "three reloads");
}

/// gRPC answers compressed as their request was (worker/src/http/compress.rs), seen on the
/// wire: a ModelInfer call written by hand over hyper's HTTP/2 client, its message gzip- or
/// deflate-compressed as tritonclient.grpc's `compression_algorithm` sends it (grpcio's
/// `grpc-accept-encoding: identity,deflate,gzip`), is answered with `grpc-encoding` of the same
/// coding and a frame whose flag byte is 1, inflating to the right answer; a plain request
/// with the same `grpc-accept-encoding` (what every grpcio call sends) and a compressed one
/// whose answer is under 1 KiB are answered plain. (tritonclient.grpc itself reads compressed
/// answers in triton_grpc_check.py's `check_compressed`.)
#[test]
fn grpc_answers_are_compressed_as_their_requests_were() {
    use http_body_util::BodyExt;
    use inferd_worker::http::encoding::Encoding;
    use inferd_worker::http::grpc::proto;
    use prost::Message;
    let (_server, grpc) = grpc_server("grpc-answer-compression");
    // The typed model's six inputs, `rows` rows of zeros (a right answer is one of shape [rows, 4]).
    let message = |rows: i64| {
        let inputs = [
            ("f32_in", "FP32", 4),
            ("f64_in", "FP64", 8),
            ("i32_in", "INT32", 4),
            ("i64_in", "INT64", 8),
            ("bool_in", "BOOL", 1),
            ("f16_in", "FP16", 2),
        ];
        let request = proto::ModelInferRequest {
            model_name: "typed".into(),
            inputs: inputs
                .iter()
                .map(|(name, datatype, _)| proto::model_infer_request::InferInputTensor {
                    name: (*name).into(),
                    datatype: (*datatype).into(),
                    shape: vec![rows, 4],
                    ..Default::default()
                })
                .collect(),
            raw_input_contents: inputs.iter().map(|(_, _, size)| vec![0u8; rows as usize * 4 * size]).collect(),
            ..Default::default()
        };
        request.encode_to_vec()
    };
    let frame = |flag: u8, message: &[u8]| {
        let mut frame = vec![flag];
        frame.extend((message.len() as u32).to_be_bytes());
        frame.extend(message);
        frame
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let stream = tokio::net::TcpStream::connect(&grpc).await.unwrap();
        let executor = hyper_util::rt::TokioExecutor::new();
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(executor, hyper_util::rt::TokioIo::new(stream)).await.unwrap();
        tokio::spawn(connection);
        // (rows, the request's coding, the answer's coding)
        let cases = [
            (100, Encoding::Gzip, Encoding::Gzip),
            (100, Encoding::Deflate, Encoding::Deflate),
            (100, Encoding::Identity, Encoding::Identity),
            (1, Encoding::Gzip, Encoding::Identity),
        ];
        for (rows, sent, expected) in cases {
            let plain = message(rows);
            let body = match sent {
                Encoding::Identity => frame(0, &plain),
                coding => frame(1, &coding.encode(&plain, Vec::new()).unwrap()),
            };
            let mut call = hyper::Request::post(format!("http://{grpc}/inference.GRPCInferenceService/ModelInfer"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .header("grpc-accept-encoding", "identity,deflate,gzip");
            if sent != Encoding::Identity {
                call = call.header("grpc-encoding", sent.name());
            }
            let call = call.body(http_body_util::Full::new(bytes::Bytes::from(body))).unwrap();
            sender.ready().await.unwrap();
            let answer = sender.send_request(call).await.unwrap();
            let case = format!("{rows} rows, sent {sent:?}");
            assert_eq!(answer.status(), 200, "{case}");
            let encoding = answer.headers().get("grpc-encoding").map(|v| v.to_str().unwrap().to_string());
            let collected = answer.into_body().collect().await.unwrap();
            let trailers = collected.trailers().cloned().unwrap_or_default();
            assert_eq!(trailers.get("grpc-status").map(|v| v.to_str().unwrap()), Some("0"), "{case}: {trailers:?}");
            let data = collected.to_bytes();
            let length = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
            assert_eq!(length, data.len() - 5, "{case}: one whole message");
            let message = match expected {
                Encoding::Identity => {
                    assert_eq!((data[0], encoding), (0, None), "{case}: a plain answer");
                    data[5..].to_vec()
                }
                coding => {
                    assert_eq!((data[0], encoding.as_deref()), (1, Some(coding.name())), "{case}: a compressed answer");
                    coding.decode(&data[5..], 1 << 24, |_| true).unwrap()
                }
            };
            let answer = proto::ModelInferResponse::decode(&message[..]).unwrap();
            assert_eq!(answer.outputs.len(), 7, "{case}: {answer:?}");
            let f32_out = answer.outputs.iter().position(|o| o.name == "f32_out").unwrap();
            assert_eq!(answer.outputs[f32_out].shape, [rows, 4], "{case}");
            assert_eq!(answer.raw_output_contents[f32_out].len(), rows as usize * 16, "{case}");
        }
    });
}

/// One HTTP/2 frame as a client writes it: 9-byte header, then the payload.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    out.extend([kind, flags]);
    out.extend(stream.to_be_bytes());
    out.extend(payload);
    out
}

/// A gRPC call's request headers, as HPACK literals without indexing or Huffman coding.
fn h2_call_headers(method: &str, authority: &str) -> Vec<u8> {
    let path = format!("/inference.GRPCInferenceService/{method}");
    let fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path.as_str()),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ];
    let mut out = Vec::new();
    for (name, value) in fields {
        out.push(0);
        out.push(name.len() as u8);
        out.extend(name.as_bytes());
        out.push(value.len() as u8);
        out.extend(value.as_bytes());
    }
    out
}

/// The next frame from the server (kind, flags, stream, payload), or None at its end.
fn h2_read(socket: &mut std::net::TcpStream) -> Option<(u8, u8, u32, Vec<u8>)> {
    use std::io::Read;
    let mut header = [0u8; 9];
    match socket.read_exact(&mut header) {
        Ok(()) => {}
        Err(e) if matches!(e.kind(), std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset) => {
            return None
        }
        Err(e) => panic!("reading a frame: {e}"),
    }
    let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
    let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
    let mut payload = vec![0; len];
    socket.read_exact(&mut payload).unwrap();
    Some((header[3], header[4], stream, payload))
}

/// The race of a graceful close that grpc-core clients run into (worker/src/http/grpc/shutdown.rs),
/// played frame by frame: a call is in progress when the worker drains; the client answers
/// the shutdown PING with its ACK first, then opens another stream and sends that stream's
/// WINDOW_UPDATE, then the rest of the first call. The call in progress is answered, the
/// late stream is left for the client to retry elsewhere (the final GOAWAY says so), and
/// nothing is a protocol error.
#[test]
fn a_stream_opened_as_a_drain_begins_costs_the_calls_in_progress_nothing() {
    use std::io::Write;
    const END_STREAM: u8 = 0x1;
    const ACK: u8 = 0x1;
    const END_HEADERS: u8 = 0x4;
    let (server, grpc) = grpc_server("grpc-drain-race");
    let mut socket = std::net::TcpStream::connect(&grpc).unwrap();
    socket.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend(h2_frame(0x4, 0, 0, &[]));
    // Stream 1: ServerLive, its message held back, so the call is in progress.
    hello.extend(h2_frame(0x1, END_HEADERS, 1, &h2_call_headers("ServerLive", &grpc)));
    socket.write_all(&hello).unwrap();
    let control = server.socket.clone();
    let reload = std::thread::spawn(move || {
        Command::new(BIN).args(["reload", "--wait", "--control-socket"]).arg(control).output().unwrap()
    });
    // Every worker is retired in turn: this connection's gets GOAWAY(2^31-1) and a PING.
    let mut goaways = Vec::new();
    let shutdown_ping = loop {
        let (kind, flags, stream, payload) = h2_read(&mut socket).expect("the connection ended before its GOAWAY");
        match kind {
            0x4 if flags & ACK == 0 => socket.write_all(&h2_frame(0x4, ACK, 0, &[])).unwrap(),
            0x7 => goaways.push(payload),
            0x6 if flags & ACK == 0 && !goaways.is_empty() => break payload,
            0x6 if flags & ACK == 0 => socket.write_all(&h2_frame(0x6, ACK, 0, &payload)).unwrap(),
            0x4 | 0x6 | 0x8 => {}
            _ => panic!("frame of type {kind} on stream {stream} before the call's message was sent"),
        }
    };
    assert_eq!(goaways, [[0x7f, 0xff, 0xff, 0xff, 0, 0, 0, 0]], "one GOAWAY(2^31-1, NO_ERROR) first");
    assert_eq!(shutdown_ping, inferd_worker::http::grpc::shutdown::H2_SHUTDOWN_PING, "h2's shutdown PING changed");
    // As grpc-core writes them: the ACK ahead of what it had queued.
    let mut late = h2_frame(0x6, ACK, 0, &shutdown_ping);
    late.extend(h2_frame(0x1, END_HEADERS, 3, &h2_call_headers("ServerLive", &grpc)));
    late.extend(h2_frame(0x8, 0, 3, &65535u32.to_be_bytes()));
    late.extend(h2_frame(0x0, END_STREAM, 3, &[0; 5]));
    late.extend(h2_frame(0x0, END_STREAM, 1, &[0; 5]));
    socket.write_all(&late).unwrap();
    let mut answers = Vec::new();
    let mut trailers = false;
    while let Some((kind, flags, stream, payload)) = h2_read(&mut socket) {
        match kind {
            0x7 => goaways.push(payload),
            0x0 => answers.push((stream, payload)),
            0x1 if flags & END_STREAM != 0 => trailers |= stream == 1,
            0x3 => panic!("stream {stream} reset: {payload:?}"),
            _ => {}
        }
    }
    // The final GOAWAY: streams up to 1 taken, NO_ERROR (a PROTOCOL_ERROR here is the race).
    assert_eq!(goaways.last().unwrap(), &[0, 0, 0, 1, 0, 0, 0, 0], "GOAWAYs: {goaways:?}\n{}", server.log());
    // ServerLiveResponse { live: true }, then its trailers; nothing for stream 3.
    assert_eq!(answers, [(1, vec![0, 0, 0, 0, 2, 0x08, 0x01])], "{}", server.log());
    assert!(trailers, "no trailers for stream 1");
    let out = reload.join().unwrap();
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn a_grpc_port_that_cannot_be_bound_stops_the_start_with_a_message() {
    // An address this host does not have (TEST-NET-1): no slot can bind it. (One that another
    // program listens on is refused as a configuration error: tests/ports.rs.)
    let grpc = "192.0.2.1:18998".to_string();
    let dir = temp_dir("grpc-taken");
    let port = free_port();
    write_config(dir.path(), port, 1, &test_models(), "typed", &[], "");
    let out = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(dir.path().join("inferd.toml"))
        .args(["--grpc-listen", &grpc])
        .output()
        .unwrap();
    let log = text(&out);
    assert_eq!(out.status.code(), Some(4), "{log}");
    assert!(log.contains(&format!("cannot listen on {grpc} (gRPC)")), "{log}");
    // And an address that is no address is refused before anything starts.
    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(dir.path().join("inferd.toml"))
        .args(["--grpc-listen", "8001"])
        .output()
        .unwrap();
    let refused = text(&out);
    assert!(!out.status.success() && refused.contains("server.grpc_listen"), "{refused}");
}
