//! API keys on the public port ([auth] api_keys_file, INFERD_API_KEYS): every protocol route
//! refuses a missing or wrong key in its own shape (KServe v2, TEI, OpenAI, gRPC
//! UNAUTHENTICATED) and serves a right one, checked with the real clients
//! (tests/clients/auth_check.py); refusals counted by reason and logged without the key;
//! keys rotated by reload under load with no failed request; a keys file others can read is
//! refused at start and at reload, the pool keeping its keys.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

const KEY_A: &str = "key-a-7f3c9e2b41d86a05e1f4";
const KEY_B: &str = "key-b-0c5d8a2f9e1b7463ad2c";

fn write_keys(path: &Path, text: &str, mode: u32) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// minilm (default) and typed, keys from `keys` in the test folder, gRPC on, access log on.
fn start(tag: &str, keys: &str) -> (Server, String) {
    let dir = temp_dir(tag);
    write_keys(&dir.path().join("keys"), keys, 0o600);
    let repository = model_repository(dir.path(), &["minilm", "typed"]);
    let port = free_port();
    let grpc = format!("127.0.0.1:{}", free_port());
    let extra = format!("grpc_listen = \"{grpc}\"\n[log]\naccess_log = true\n[auth]\napi_keys_file = \"keys\"");
    write_config(dir.path(), port, 1, &repository, "minilm", &["typed"], &extra);
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(90));
    (server, grpc)
}

fn post(server: &Server, path: &str, key: Option<&str>, body: &Value) -> Response {
    let bearer = key.map(|k| format!("Bearer {k}"));
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(b) = &bearer {
        headers.push(("Authorization", b.as_str()));
    }
    request(server.addr, "POST", path, &headers, &serde_json::to_vec(body).unwrap()).unwrap()
}

fn typed_body() -> Value {
    serde_json::from_slice(&typed_request()).unwrap()
}

#[test]
fn every_route_needs_a_key_and_refuses_in_its_protocols_shape() {
    let (server, grpc) = start("auth-routes", &format!("# two keys, for rotation\n{KEY_A}\n{KEY_B}\n"));
    let embed = json!({"inputs": "hello"});
    let openai = json!({"input": "hello", "model": "minilm"});
    for key in [KEY_A, KEY_B] {
        assert_eq!(post(&server, "/embed", Some(key), &embed).status, 200);
        assert_eq!(post(&server, "/v1/embeddings", Some(key), &openai).status, 200);
        assert_eq!(post(&server, "/v2/models/typed/infer", Some(key), &typed_body()).status, 200);
    }
    let (mut missing, mut invalid) = (0, 0);
    for (key, reason) in [(None, "needs an API key"), (Some("wrong-key-0123456789abcd"), "not valid")] {
        let r = post(&server, "/embed", key, &embed);
        assert_eq!((r.status, r.header("www-authenticate")), (401, Some("Bearer")), "{r:?}");
        assert_eq!(r.json()["error_type"], "Unauthorized", "TEI's shape");
        assert!(r.json()["error"].as_str().unwrap().contains(reason));
        let r = post(&server, "/v1/embeddings", key, &openai);
        assert_eq!(r.status, 401);
        assert_eq!(r.json()["error"]["code"], "invalid_api_key", "OpenAI's shape: {}", r.json());
        let r = post(&server, "/v2/models/typed/infer", key, &typed_body());
        assert_eq!(r.status, 401);
        assert!(r.error().contains(reason), "KServe's shape: {}", r.json());
        match key {
            None => missing += 3,
            Some(_) => invalid += 3,
        }
        let r = request(server.addr, "GET", "/v2/models/typed", &[], b"").unwrap();
        assert_eq!(r.status, 401, "metadata too");
        missing += 1;
    }
    // Health and readiness stay open for probes.
    assert_eq!(request(server.addr, "GET", "/v2/health/ready", &[], b"").unwrap().status, 200);
    assert_eq!(request(server.addr, "GET", "/health", &[], b"").unwrap().status, 200);
    assert_eq!(request(server.addr, "GET", "/v2/models/typed/ready", &[], b"").unwrap().status, 200);
    let metrics = server.metrics_text();
    let count = |reason: &str| {
        metric_value(&metrics, &format!("inferd_auth_refused_total{{reason=\"{reason}\"}}")).unwrap_or(-1.0)
    };
    assert_eq!((count("missing"), count("invalid")), (f64::from(missing), f64::from(invalid)), "{metrics}");

    // The clients users run, with the right key, a wrong one and none.
    client_check("auth_check.py", &[&server.addr.to_string(), &grpc, KEY_A], &server, "auth: all checks passed");
    let log = server.log();
    assert!(log.contains("status=401") && log.contains("auth_refused=\"invalid\""), "access log:\n{log}");
    assert!(!log.contains(KEY_A) && !log.contains(KEY_B), "a key was logged:\n{log}");
}

#[test]
fn keys_rotate_by_reload_under_load_with_no_failed_request() {
    let (server, _) = start("auth-rotate", &format!("{KEY_A}\n"));
    let keys = server.dir.path().join("keys");
    let key = Arc::new(Mutex::new(KEY_A.to_string()));
    let load = Clients::start(3, |_| {
        let (key, addr, body) = (key.clone(), server.addr, serde_json::to_vec(&typed_body()).unwrap());
        move || {
            let auth = format!("Bearer {}", key.lock().unwrap());
            match request(addr, "POST", "/v2/models/typed/infer", &[("Authorization", &auth)], &body) {
                Ok(r) if r.status == 200 => Step::Served,
                Ok(r) => Step::Failed(format!("{}: {}", r.status, String::from_utf8_lossy(&r.body))),
                Err(e) => Step::Failed(e.to_string()),
            }
        }
    });
    let reload = |server: &Server| {
        let out =
            Command::new(BIN).args(["reload", "--wait", "--control-socket"]).arg(&server.socket).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    };
    std::thread::sleep(Duration::from_millis(500));
    // Add B beside A; once every worker has both, the clients move to B; then A goes.
    write_keys(&keys, &format!("{KEY_A}\n{KEY_B}\n"), 0o600);
    let (ok, said) = reload(&server);
    assert!(ok, "{said}");
    *key.lock().unwrap() = KEY_B.to_string();
    std::thread::sleep(Duration::from_millis(500));
    write_keys(&keys, &format!("{KEY_B}\n"), 0o600);
    let (ok, said) = reload(&server);
    assert!(ok, "{said}");
    // A retired worker may take a connection or two before it stops accepting: wait
    // (bounded) until A is refused, as every new worker refuses it.
    let started = std::time::Instant::now();
    while post(&server, "/v2/models/typed/infer", Some(KEY_A), &typed_body()).status != 401 {
        assert!(started.elapsed() < Duration::from_secs(20), "key A still served after its reload");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(300));
    load.stop().assert_served(20, "while the keys rotated");

    // A keys file others can read refuses the reload; the pool keeps its keys.
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (ok, said) = reload(&server);
    assert!(!ok && said.contains("reload refused") && said.contains("mode 644"), "{said}");
    assert_eq!(post(&server, "/v2/models/typed/infer", Some(KEY_B), &typed_body()).status, 200);
}

#[test]
fn keys_that_cannot_be_trusted_refuse_the_start() {
    let dir = temp_dir("auth-refused");
    let config =
        write_config(dir.path(), free_port(), 1, &test_models(), "typed", &[], "[auth]\napi_keys_file = \"keys\"");
    let check = |env: Option<&str>| {
        let mut command = Command::new(BIN);
        command.args(["check", "--config"]).arg(&config).env_remove("INFERD_API_KEYS");
        if let Some(v) = env {
            command.env("INFERD_API_KEYS", v);
        }
        let out = command.output().unwrap();
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    };
    let keys = dir.path().join("keys");
    for (text, mode, message) in [
        (format!("{KEY_A}\n"), 0o640, "mode 640"),
        ("short-key\n".to_string(), 0o600, "at least 16"),
        ("# nothing yet\n".to_string(), 0o600, "holds no key"),
    ] {
        write_keys(&keys, &text, mode);
        let (ok, out) = check(None);
        assert!(!ok && out.contains("auth.api_keys_file") && out.contains(message), "{message}: {out}");
    }
    write_keys(&keys, &format!("{KEY_A}\n"), 0o600);
    let (ok, out) = check(Some(&format!("{KEY_B}, {KEY_B}")));
    assert!(ok && out.contains("2 API keys, health routes open"), "file and environment, one key twice: {out}");
    assert!(!out.contains(KEY_A) && !out.contains(KEY_B), "{out}");
}
