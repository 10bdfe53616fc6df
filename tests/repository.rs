//! Triton's model repository and statistics extensions on the admin listener: tritonclient.http
//! lists, loads and unloads models (rolling reloads) and reads the pool's statistics
//! (tests/clients/triton_repository_check.py); load and unload stay off unless
//! admin.model_control turns them on, and need the admin token (admin.token_file); a
//! `parameters.path` outside the repository is refused while the pool serves on; any number
//! of models is served, the first eight counted under their names.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use crate::common::*;

const TOKEN: &str = "admin-token-5e1b9c0d27f4a863";

/// `typed` (the default), `classifier` and `slow` served from a repository that also holds
/// `reranker`; `admin` is added to the [admin] section.
fn server(tag: &str, admin: &str) -> Server {
    let dir = temp_dir(tag);
    let repository = model_repository(dir.path(), &["typed", "classifier", "slow", "reranker"]);
    let port = free_port();
    let config = write_config(dir.path(), port, test_workers(), &repository, "typed", &["classifier", "slow"], "");
    with_admin(&config, admin);
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    server
}

/// `admin` added to `config`'s [admin] section, and the token file it may name
/// (`admin-token`, holding [`TOKEN`]) beside it.
fn with_admin(config: &Path, admin: &str) {
    let token = config.with_file_name("admin-token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let text = std::fs::read_to_string(config).unwrap().replace("[admin]\n", &format!("[admin]\n{admin}\n"));
    std::fs::write(config, text).unwrap();
}

/// What `inferd check` said of `config`, which it must refuse.
fn check_refuses(config: &Path) -> String {
    let out = std::process::Command::new(BIN).args(["check", "--config"]).arg(config).output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "check passed: {text}");
    text
}

fn admin_post(server: &Server, path: &str, body: &str) -> Response {
    request(server.admin_addr(), "POST", path, &[], body.as_bytes()).unwrap()
}

fn admin_post_with(server: &Server, token: &str, path: &str, body: &str) -> Response {
    let auth = format!("Bearer {token}");
    request(server.admin_addr(), "POST", path, &[("Authorization", &auth)], body.as_bytes()).unwrap()
}

#[test]
fn tritonclient_loads_unloads_and_reads_statistics() {
    let server = server("repository", "model_control = true\ntoken_file = \"admin-token\"");
    // Without the token, or with a wrong one, nothing but /metrics answers.
    for token in [None, Some("wrong-token-0123456789abc")] {
        let r = match token {
            None => admin_post(&server, "/v2/repository/models/reranker/load", ""),
            Some(t) => admin_post_with(&server, t, "/v2/repository/models/reranker/load", ""),
        };
        assert_eq!(
            (r.status, r.header("www-authenticate")),
            (401, Some("Bearer")),
            "{}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(admin_post(&server, "/v2/repository/index", "{}").status, 401);
    }
    assert_eq!(request(server.admin_addr(), "GET", "/metrics", &[], b"").unwrap().status, 200, "metrics stay open");
    // A folder outside the repository (here the test models' own), by path: refused.
    let outside = test_models().join("reranker");
    let body = format!("{{\"parameters\": {{\"path\": \"{}\"}}}}", outside.display());
    let r = admin_post_with(&server, TOKEN, "/v2/repository/models/reranker/load", &body);
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.error().contains("is not inside the model repository"), "{}", r.error());
    assert_eq!(server.status()["generation"], 1, "nothing was reloaded");
    let (admin, public) = (server.admin_addr().to_string(), server.addr.to_string());
    client_check("triton_repository_check.py", &[&admin, &public, TOKEN], &server, "repository: all checks passed");
    // Two rolling reloads (load, unload); the refused ones changed nothing.
    let status = server.status();
    assert_eq!(status["generation"], 3, "{status}");
    assert_eq!(status["reloads_succeeded"], 2, "{status}");
    let models: Vec<&str> =
        status["workers"][0]["models"].as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(models, ["typed", "slow", "reranker"], "{status}");
    // The metrics follow the models: classifier's series are gone, typed's counts stayed.
    let metrics = server.metrics_text();
    assert!(!metrics.contains("model=\"classifier\""), "{metrics}");
    let line = "inferd_requests_total{model=\"typed\",endpoint=\"infer\",code=\"200\"}";
    assert_eq!(metric_value(&metrics, line), Some(3.0), "{metrics}");
}

#[test]
fn load_and_unload_stay_off_unless_model_control_is_on() {
    let server = server("repository-off", "");
    for action in ["load", "unload"] {
        let r = admin_post(&server, &format!("/v2/repository/models/slow/{action}"), "");
        assert_eq!(r.status, 403, "{action}: {}", String::from_utf8_lossy(&r.body));
        assert!(r.error().contains("admin.model_control = true"), "{}", r.error());
    }
    // Reading stays open: the index and the statistics.
    let r = admin_post(&server, "/v2/repository/index", "{\"ready\": true}");
    assert_eq!(r.status, 200);
    let index = r.json();
    let names: Vec<&str> = index.as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["typed", "classifier", "slow"], "ready only: reranker is not listed");
    let r = request(server.admin_addr(), "GET", "/v2/models/stats", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["model_stats"].as_array().unwrap().len(), 3);
    let r = admin_post(&server, "/v2/repository/index", "[1]");
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.error().contains("JSON object"), "{}", r.error());
    assert_eq!(server.status()["generation"], 1, "nothing was reloaded");
}

#[test]
fn model_control_needs_a_token_and_an_open_address_serves_metrics_alone() {
    let dir = temp_dir("admin-refused");
    let config = write_config(dir.path(), free_port(), 1, &test_models(), "typed", &[], "");
    with_admin(&config, "model_control = true");
    let out = std::process::Command::new(BIN).args(["check", "--config"]).arg(&config).output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("admin.model_control") && said.contains("admin.token_file"),
        "{said}"
    );

    // No token, not loopback: /metrics alone.
    let dir = temp_dir("admin-open");
    let port = free_port();
    let config = write_config(dir.path(), port, 1, &test_models(), "typed", &[], "");
    let text = std::fs::read_to_string(&config).unwrap();
    let admin_port =
        text.split("[admin]\nlisten = \"127.0.0.1:").nth(1).unwrap().split('"').next().unwrap().to_string();
    std::fs::write(&config, text.replace(&format!("127.0.0.1:{admin_port}"), &format!("0.0.0.0:{admin_port}")))
        .unwrap();
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    let admin: std::net::SocketAddr = format!("127.0.0.1:{admin_port}").parse().unwrap();
    assert_eq!(request(admin, "GET", "/metrics", &[], b"").unwrap().status, 200);
    let r = request(admin, "GET", "/v2/models/stats", &[], b"").unwrap();
    assert_eq!(r.status, 401, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.error().contains("serves /metrics alone"), "{}", r.error());
}

/// Any number of models, explicitly loaded: ten at start and one more through the repository's
/// load (Triton's L0 tests load dozens). The first eight have counter rows of their own; the
/// others count together under `model="other"`, as models loaded on demand do.
#[test]
fn more_models_than_counter_rows_are_served_and_counted_as_other() {
    let dir = temp_dir("many-explicit");
    let repository = dir.path().join("repo");
    let file = test_models().join("typed/model.onnx");
    let names: Vec<String> = (0..11).map(|i| format!("m{i}")).collect();
    for name in &names {
        model_of_file(&repository, name, &file, "");
    }
    let load: Vec<&str> = names[1..10].iter().map(String::as_str).collect();
    let port = free_port();
    let config = write_config(dir.path(), port, 1, &repository, "m0", &load, "");
    with_admin(&config, "model_control = true\ntoken_file = \"admin-token\"");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    let r = admin_post_with(&server, TOKEN, "/v2/repository/models/m10/load", "");
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    for name in &names {
        let r = server.request("POST", &format!("/v2/models/{name}/infer"), &typed_request());
        assert_eq!(r.status, 200, "{name}: {}", String::from_utf8_lossy(&r.body));
    }
    let metrics = server.metrics_text();
    let infer = |model: &str| format!("inferd_requests_total{{model=\"{model}\",endpoint=\"infer\",code=\"200\"}}");
    for name in &names[..8] {
        assert_eq!(metric_value(&metrics, &infer(name)), Some(1.0), "{name}: {metrics}");
    }
    assert_eq!(metric_value(&metrics, &infer("other")), Some(3.0), "m8, m9 and m10: {metrics}");
}

/// Triton's statistics and repository index on the main port too, over HTTP and gRPC, so that
/// an unmodified client needs one URL (tests/clients/triton_main_port_check.py: what each call
/// must answer, and which of Triton's examples and QA tests make it); the workers ask the
/// supervisor, whose counters and repository the admin listener reads.
#[test]
fn statistics_and_the_index_answer_on_the_main_port_over_http_and_grpc() {
    let dir = temp_dir("repository-main-port");
    let repository = model_repository(dir.path(), &["typed", "classifier", "slow", "reranker"]);
    let port = free_port();
    write_config(dir.path(), port, test_workers(), &repository, "typed", &["classifier", "slow"], "");
    let grpc = format!("127.0.0.1:{}", free_port());
    let mut server = Server::start(dir, port, &["--grpc-listen", &grpc]);
    server.wait_ready(Duration::from_secs(60));
    let (admin, public) = (server.admin_addr().to_string(), server.addr.to_string());
    client_check("triton_main_port_check.py", &[&admin, &public, &grpc], &server, "main port: all checks passed");
    // Bad bodies are refused naming the problem, in Triton's words (its L0_http
    // test_repository_index_deeply_nested_json: a `ready` nested 250000 lists deep, refused at
    // the first); the routes are not inference (not counted).
    let nested = format!("{{\"ready\":{}true{}}}", "[".repeat(250_000), "]".repeat(250_000));
    for body in [&b"{\"ready\": 3}"[..], nested.as_bytes()] {
        let r = request(server.addr, "POST", "/v2/repository/index", &[], body).unwrap();
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
        assert!(r.error().contains("Invalid value for 'ready': expected a boolean"), "{}", r.error());
    }
    assert_eq!(server.request("GET", "/v2/health/live", b"").status, 200);
    let r = request(server.addr, "GET", "/v2/repository/index", &[], b"").unwrap();
    assert_eq!(r.status, 405);
    let r = request(server.addr, "GET", "/v2/models/nosuch/stats", &[], b"").unwrap();
    assert_eq!((r.status, r.error().contains("unknown model: 'nosuch'")), (404, true), "{}", r.error());
}

/// With admin.model_control_on_main_port, Triton's model control examples load and unload on
/// the main port, over HTTP and gRPC (tests/clients/triton_main_port_check.py `control`):
/// rolling reloads answered once every worker runs the new list, though the worker that took
/// the call is among those replaced; a load's body past server.max_body_bytes (1 MiB here) is
/// refused in Triton's words. The switch alone, without admin.model_control, is
/// refused at start.
#[test]
fn the_main_port_loads_and_unloads_with_its_switch_on() {
    let dir = temp_dir("repository-main-control");
    let repository = model_repository(dir.path(), &["typed", "classifier", "slow", "reranker"]);
    let port = free_port();
    let extra = "max_body_bytes = 1048576";
    let config = write_config(dir.path(), port, test_workers(), &repository, "typed", &["classifier", "slow"], extra);
    let original = std::fs::read_to_string(&config).unwrap();
    with_admin(&config, "model_control_on_main_port = true");
    let text = check_refuses(&config);
    assert!(text.contains("needs admin.model_control = true"), "{text}");
    std::fs::write(&config, original).unwrap();
    with_admin(&config, "model_control = true\ntoken_file = \"admin-token\"\nmodel_control_on_main_port = true");
    let grpc = format!("127.0.0.1:{}", free_port());
    let mut server = Server::start(dir, port, &["--grpc-listen", &grpc]);
    server.wait_ready(Duration::from_secs(60));
    let (admin, public) = (server.admin_addr().to_string(), server.addr.to_string());
    let args = [admin.as_str(), public.as_str(), grpc.as_str(), "control", TOKEN];
    client_check("triton_main_port_check.py", &args, &server, "main port: all checks passed");
    let status = server.status();
    // Four rolling reloads: reranker loaded, classifier unloaded, typed loaded with a Triton
    // configuration and again without; the refused loads changed nothing.
    assert_eq!((status["generation"].as_u64(), status["reloads_succeeded"].as_u64()), (Some(5), Some(4)), "{status}");
}

/// Triton's restricted APIs ([[auth.restricted]], as qa/L0_http and qa/L0_grpc start Triton
/// with --http-restricted-api and --grpc-restricted-protocol), the server's name (server.name)
/// and its trace settings, with tritonclient over HTTP and gRPC
/// (tests/clients/triton_restricted_check.py: each call and its answer). A group that repeats
/// a category or names an unknown one is refused at start in Triton's words.
#[test]
fn restricted_apis_need_their_header_the_server_has_its_name_and_trace_settings_read() {
    let dir = temp_dir("repository-restricted");
    let repository = model_repository(dir.path(), &["typed"]);
    let port = free_port();
    let config = write_config(dir.path(), port, test_workers(), &repository, "typed", &[], "name = \"triton\"");
    let base = std::fs::read_to_string(&config).unwrap();
    let group = |apis: &str, header: &str, value: &str| {
        format!("[[auth.restricted]]\napis = [{apis}]\nheader = \"{header}\"\nvalue = \"{value}\"\n")
    };
    for (groups, refusal) in [
        (
            group("\"model-repository\", \"health\"", "k1", "v1") + &group("\"metadata\", \"health\"", "k2", "v2"),
            "api 'health' can not be specified in multiple config groups",
        ),
        (group("\"model-reposit\", \"health\"", "k1", "v1"), "unknown restricted api 'model-reposit'"),
        (group("\"health\"", "authorization", "v1"), "auth.restricted"),
    ] {
        std::fs::write(&config, format!("{base}{groups}")).unwrap();
        let text = check_refuses(&config);
        assert!(text.contains(refusal), "{refusal}: {text}");
    }
    let groups = group("\"model-repository\"", "admin-key", "admin-value")
        + &group("\"inference\", \"health\"", "infer-key", "infer-value");
    std::fs::write(&config, format!("{base}{groups}")).unwrap();
    let grpc = format!("127.0.0.1:{}", free_port());
    let mut server = Server::start(dir, port, &["--grpc-listen", &grpc]);
    server.wait_ready(Duration::from_secs(60));
    let public = server.addr.to_string();
    client_check("triton_restricted_check.py", &[&public, &grpc], &server, "restricted: all checks passed");
    // TEI's routes are inference; its /info metadata, open.
    let r = request(server.addr, "POST", "/embed", &[], b"{\"inputs\": \"x\"}").unwrap();
    assert_eq!(r.status, 403, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(request(server.addr, "GET", "/v2", &[], b"").unwrap().status, 200);
}

/// Triton's system shared memory, pool-wide: tritonclient's own shm utilities register
/// regions, infer from them and into them, over HTTP and gRPC, and meet Triton's refusals
/// (tests/clients/triton_shm_check.py: the calls of Triton's four shm examples). Then, on
/// raw connections of their own, a region registered through one worker is listed and read by
/// every worker of the pool (the `x-inferd-worker` header says which answered); a fresh start
/// forgets it.
#[test]
fn system_shared_memory_regions_serve_every_worker_over_http_and_grpc() {
    let dir = temp_dir("repository-shm");
    let repository = model_repository(dir.path(), &["typed", "classifier"]);
    let port = free_port();
    write_config(dir.path(), port, test_workers(), &repository, "typed", &["classifier"], "");
    let grpc = format!("127.0.0.1:{}", free_port());
    let mut server = Server::start(dir, port, &["--grpc-listen", &grpc]);
    server.wait_ready(Duration::from_secs(60));
    let public = server.addr.to_string();
    client_check("triton_shm_check.py", &[&public, &grpc], &server, "shm: all checks passed");

    // Triton's BYTES layout: each element's length (u32, little-endian), then its bytes.
    let text = "a fine day";
    let object = format!("inferd-repository-shm-{}", std::process::id());
    let path = Path::new("/dev/shm").join(&object);
    let mut bytes = (text.len() as u32).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let register = format!(r#"{{"key": "/{object}", "offset": 0, "byte_size": {}}}"#, bytes.len());
    let r = request(server.addr, "POST", "/v2/systemsharedmemory/region/words/register", &[], register.as_bytes());
    assert_eq!(r.as_ref().map(|r| r.status).ok(), Some(200), "{r:?}");
    let infer = format!(
        r#"{{"inputs": [{{"name": "text", "shape": [1], "datatype": "BYTES",
            "parameters": {{"shared_memory_region": "words", "shared_memory_byte_size": {}}}}}]}}"#,
        bytes.len()
    );
    let plain = format!(r#"{{"inputs": [{{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["{text}"]}}]}}"#);
    let want = request(server.addr, "POST", "/v2/models/classifier/infer", &[], plain.as_bytes()).unwrap().json();
    let mut answered = std::collections::BTreeSet::new();
    for _ in 0..200 {
        let status = request(server.addr, "GET", "/v2/systemsharedmemory/region/words/status", &[], b"").unwrap();
        assert_eq!(status.status, 200, "{}", String::from_utf8_lossy(&status.body));
        assert_eq!(status.json()[0]["key"], format!("/{object}"), "{}", String::from_utf8_lossy(&status.body));
        let r = request(server.addr, "POST", "/v2/models/classifier/infer", &[], infer.as_bytes()).unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["outputs"], want["outputs"]);
        answered
            .extend([status.header("x-inferd-worker"), r.header("x-inferd-worker")].map(|w| w.unwrap().to_string()));
        if answered.len() == test_workers() {
            break;
        }
    }
    assert_eq!(answered.len(), test_workers(), "workers that read the region: {answered:?}");
    // The registry is the pool's, and outlives no pool: stopped and started again, the server
    // holds no region.
    server.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(server.wait_exit(Duration::from_secs(60)).success(), "{}", server.log());
    assert!(!server.dir.path().join("control.sock.shm").exists(), "the registry outlived its pool");
    let dir = std::mem::replace(&mut server.dir, temp_dir("repository-shm-spare"));
    drop(server);
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    let r = request(server.addr, "GET", "/v2/systemsharedmemory/status", &[], b"").unwrap();
    assert_eq!(r.json(), serde_json::json!([]));
    std::fs::remove_file(&path).unwrap();
}

/// Triton's image clients (image_client.py, grpc_image_client.py: their checks and calls in
/// tests/clients/triton_image_check.py) against an image classification model: its
/// configuration gives the pixel tensor's layout as Triton's `format`, and outputs asked for
/// as classes (Triton's classification extension) come back as `value:index:label`, equal to
/// the model's own logits, over HTTP and gRPC.
#[test]
fn triton_image_clients_read_the_layout_and_get_classes_over_http_and_grpc() {
    let dir = temp_dir("repository-image");
    let repository = model_repository(dir.path(), &["typed", "cnn", "classifier"]);
    let port = free_port();
    write_config(dir.path(), port, test_workers(), &repository, "typed", &["cnn", "classifier"], "");
    let grpc = format!("127.0.0.1:{}", free_port());
    let mut server = Server::start(dir, port, &["--grpc-listen", &grpc]);
    server.wait_ready(Duration::from_secs(60));
    let public = server.addr.to_string();
    client_check("triton_image_check.py", &[&public, &grpc], &server, "image: all checks passed");
}
