//! `[models] on_demand = true`: every model of the repository is servable, loaded by a
//! worker on the first request that names it (one load for every request that waits for
//! it), and answers as it would loaded at boot; metadata and readiness answer without loading
//! it; a model that cannot load costs its own requests (500 with the reason, not loaded again
//! on every request), never the worker.

use std::time::Duration;

use crate::common::*;

fn on_demand_server(tag: &str, workers: usize, load: &[&str]) -> Server {
    on_demand_server_with(tag, workers, load, 60.0, "")
}

/// As [`on_demand_server`], with `models.load_timeout_secs = wait` and `admin` lines in
/// `[admin]`.
fn on_demand_server_with(tag: &str, workers: usize, load: &[&str], wait: f64, admin: &str) -> Server {
    let dir = temp_dir(tag);
    // For `token_file = "admin-token"` in `admin`.
    let token = dir.path().join("admin-token");
    std::fs::write(&token, format!("{ADMIN_TOKEN}\n")).unwrap();
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let repository = model_repository(dir.path(), &["typed", "classifier", "mlp"]);
    // A folder whose model.toml reads but whose file ONNX Runtime refuses.
    let broken = repository.join("broken");
    std::fs::create_dir(&broken).unwrap();
    std::fs::write(broken.join("model.toml"), "name = \"broken\"\nversion = \"1\"\nfile = \"model.onnx\"\n").unwrap();
    std::fs::write(broken.join("model.onnx"), b"not an ONNX file").unwrap();
    // And one whose model.toml does not read: not servable, said at start.
    let unreadable = repository.join("unreadable");
    std::fs::create_dir(&unreadable).unwrap();
    std::fs::write(unreadable.join("model.toml"), "name = \"unreadable\"\nversion = 1\nfile = \"model.onnx\"\n")
        .unwrap();
    std::fs::write(unreadable.join("model.onnx"), b"").unwrap();
    let port = free_port();
    let config = write_config(dir.path(), port, workers, &repository, "typed", load, "");
    // [models] is the file's last section.
    let mut text = std::fs::read_to_string(&config).unwrap().replace("[admin]\n", &format!("[admin]\n{admin}"));
    text.push_str(&format!("on_demand = true\nload_timeout_secs = {wait}\n"));
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    server
}

const ADMIN_TOKEN: &str = "admin-token-on-demand-8c41d2";

fn body(response: &Response) -> String {
    String::from_utf8_lossy(&response.body).into_owned()
}

fn text_request(text: &str) -> Vec<u8> {
    infer_body(serde_json::json!([{"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}]))
}

/// The class probabilities of an answer to [`text_request`].
fn probabilities(response: &Response) -> Vec<f64> {
    assert_eq!(response.status, 200, "{}", body(response));
    let body = response.json();
    let outputs = body["outputs"].as_array().unwrap();
    let probabilities = outputs.iter().find(|o| o["name"] == "probabilities").expect("probabilities");
    probabilities["data"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect()
}

fn loads_logged(server: &Server, model: &str, what: &str) -> usize {
    server.log().lines().filter(|l| l.contains(what) && l.contains(&format!("model=\"{model}\""))).count()
}

#[test]
fn a_model_is_loaded_by_its_first_requests_once_and_answers_as_one_loaded_at_boot() {
    let workers = test_workers();
    let server = on_demand_server("on-demand", workers, &[]);
    // Known before it is loaded, and not loaded by being asked about.
    let metadata = server.request("GET", "/v2/models/classifier", b"");
    assert_eq!(metadata.status, 200, "{}", body(&metadata));
    assert_eq!(metadata.json()["loaded"], false, "{}", body(&metadata));
    let ready = server.request("GET", "/v2/models/classifier/ready", b"");
    assert_eq!((ready.status, ready.json()["loaded"].clone()), (200, serde_json::json!(false)), "{}", body(&ready));
    let listed = server.request("GET", "/v2", b"").json();
    assert!(listed["loadable"].as_array().unwrap().iter().any(|m| m == "classifier"), "{listed}");
    assert_eq!(loads_logged(&server, "classifier", "loaded on demand"), 0, "{}", server.log());
    assert!(server.status()["workers"].as_array().unwrap().iter().all(|w| w["models"].as_array().unwrap().len() == 1));

    // Many requests for it at once, none loaded: each is answered, and each worker loads it
    // once, whatever number of its requests waited.
    let clients: Vec<_> = (0..8)
        .map(|i| {
            let addr = server.addr;
            std::thread::spawn(move || {
                let text = format!("request {i}: the service was quick and friendly");
                request(addr, "POST", "/v2/models/classifier/infer", &[], &text_request(&text)).unwrap()
            })
        })
        .collect();
    for client in clients {
        let response = client.join().unwrap();
        assert_eq!(response.status, 200, "{}", body(&response));
    }
    // Status shows it on each worker that loaded it, once the worker has said so (after its
    // requests were answered), and each of those loaded it once.
    let holding = || {
        let status = server.status();
        let workers = status["workers"].as_array().unwrap().iter();
        workers.filter(|w| w["models"].as_array().unwrap().iter().any(|m| m["name"] == "classifier")).count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while holding() == 0 || loads_logged(&server, "classifier", "loaded on demand") < holding() {
        assert!(std::time::Instant::now() < deadline, "no load seen:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let loads = loads_logged(&server, "classifier", "loaded on demand");
    assert!((1..=workers).contains(&loads), "{loads} loads for {workers} workers:\n{}", server.log());
    assert_eq!(holding(), loads, "{}", server.status());
    // Loaded now: its metadata is the model's own.
    let metadata = server.request("GET", "/v2/models/classifier", b"").json();
    assert!(metadata["inputs"].as_array().is_some_and(|i| !i.is_empty()), "{metadata}");

    // The same answer as from a server that loads it at boot.
    let text = "the parcel arrived late and damaged";
    let on_demand = probabilities(&server.request("POST", "/v2/models/classifier/infer", &text_request(text)));
    let pinned = on_demand_server("on-demand-pinned", 1, &["classifier"]);
    let at_boot = probabilities(&pinned.request("POST", "/v2/models/classifier/infer", &text_request(text)));
    assert_eq!(on_demand.len(), 3);
    for (a, b) in on_demand.iter().zip(&at_boot) {
        assert!((a - b).abs() < 1e-6, "{on_demand:?} on demand, {at_boot:?} loaded at boot");
    }

    // Counted in /metrics under model="other" (each worker numbers the models it loads on
    // demand in its own order), none lost. The counters are read at each scrape, and the
    // answered requests were counted before they were answered.
    let metrics = server.metrics_text();
    let other = "inferd_requests_total{model=\"other\",endpoint=\"infer\",code=\"200\"}";
    assert_eq!(metric_value(&metrics, other), Some(9.0), "{metrics}");

    // Not in the repository: unknown, as without on_demand.
    let unknown = server.request("POST", "/v2/models/nope/infer", &typed_request());
    assert_eq!(unknown.status, 404, "{}", body(&unknown));
}

#[test]
fn a_model_that_cannot_load_fails_its_requests_only_and_is_not_loaded_again_at_once() {
    let workers = test_workers();
    let server = on_demand_server("on-demand-broken", workers, &[]);
    for _ in 0..6 {
        let response = server.request("POST", "/v2/models/broken/infer", &typed_request());
        assert_eq!(response.status, 500, "{}", body(&response));
        assert!(body(&response).contains("model 'broken' could not be loaded"), "{}", body(&response));
        // The worker serves on.
        assert_eq!(server.request("POST", "/v2/models/typed/infer", &typed_request()).status, 200);
    }
    // A folder whose model.toml does not read is no model to load: unknown, and named by
    // `inferd check` and in the log.
    assert_eq!(server.request("POST", "/v2/models/unreadable/infer", &typed_request()).status, 404);
    assert!(server.log().contains("model folder 'unreadable' cannot be loaded on demand"), "{}", server.log());
    let said = server.check();
    assert!(said.contains("on demand:       broken, classifier, mlp"), "{said}");
    assert!(said.contains("unreadable: cannot be loaded on demand"), "{said}");
    // Each worker tried once; the next requests were answered with that failure.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while loads_logged(&server, "broken", "cannot load on demand") == 0 {
        assert!(std::time::Instant::now() < deadline, "no failed load logged:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let tries = loads_logged(&server, "broken", "cannot load on demand");
    assert!((1..=workers).contains(&tries), "{tries} loads for {workers} workers:\n{}", server.log());
    assert!(server.status()["workers"].as_array().unwrap().iter().all(|w| w["restarts"] == 0));
}

#[test]
fn a_request_that_waits_past_the_load_timeout_is_answered_503_and_the_load_goes_on() {
    // A load takes milliseconds at least (ONNX Runtime's session, the warm-up): longer than
    // this timeout on any machine.
    let server = on_demand_server_with("on-demand-timeout", 1, &[], 0.000001, "");
    let response = server.request("POST", "/v2/models/classifier/infer", &text_request("late"));
    assert_eq!(response.status, 503, "{}", body(&response));
    assert!(response.header("retry-after").is_some(), "{:?}", response.headers);
    assert!(response.error().contains("models.load_timeout_secs"), "{}", body(&response));
    // The load went on: the model is served without another load.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while server.request("POST", "/v2/models/classifier/infer", &text_request("late")).status != 200 {
        assert!(std::time::Instant::now() < deadline, "never served:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    // Its log line was written before it served (read here a moment later, through a pipe).
    while loads_logged(&server, "classifier", "loaded on demand") == 0 {
        assert!(std::time::Instant::now() < deadline, "no load logged:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(loads_logged(&server, "classifier", "loaded on demand"), 1, "{}", server.log());
}

/// A deadline bounds the wait for a load on demand as it bounds the wait for a lane: 504 at
/// the deadline, naming the load; the load goes on for the requests after it.
#[test]
fn a_request_whose_deadline_passes_while_its_model_loads_is_answered_504_and_the_load_goes_on() {
    let server = on_demand_server("on-demand-deadline", 1, &[]);
    let body_of = text_request("in a hurry");
    // A load takes milliseconds at least (ONNX Runtime's session, the warm-up).
    let hurried =
        request(server.addr, "POST", "/v2/models/classifier/infer", &[("X-Inferd-Deadline-Ms", "1")], &body_of)
            .unwrap();
    assert_eq!(hurried.status, 504, "{}", body(&hurried));
    assert!(hurried.error().contains("while model 'classifier' loaded"), "{}", body(&hurried));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while server.request("POST", "/v2/models/classifier/infer", &body_of).status != 200 {
        assert!(std::time::Instant::now() < deadline, "never served:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    // Counted under "other", as every model loaded on demand is (rows are for pinned models).
    let metrics = server.metrics_text();
    let timed_out = "inferd_requests_total{model=\"other\",endpoint=\"infer\",code=\"504\"}";
    assert_eq!(metric_value(&metrics, timed_out), Some(1.0), "{metrics}");
}

#[test]
fn a_folder_added_while_serving_is_servable_after_a_reload() {
    let server = on_demand_server("on-demand-reload", test_workers(), &[]);
    let repository = server.dir.path().join("repo");
    let x: Vec<f32> = (0..16).map(|i| i as f32 / 16.0).collect();
    let raw = infer_body(serde_json::json!([{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": x}]));
    // What may be loaded was read at start: a folder added since is unknown...
    let late = std::fs::read_to_string(test_models().join("mlp/model.toml")).unwrap().replace("\"mlp\"", "\"late\"");
    std::fs::create_dir(repository.join("late")).unwrap();
    std::fs::write(repository.join("late/model.toml"), late).unwrap();
    std::fs::copy(test_models().join("mlp/model.onnx"), repository.join("late/model.onnx")).unwrap();
    assert_eq!(server.request("POST", "/v2/models/late/infer", &raw).status, 404);
    // ... until a reload reads the repository again.
    let out = std::process::Command::new(BIN)
        .args(["reload", "--wait", "--control-socket"])
        .arg(&server.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let response = server.request("POST", "/v2/models/late/infer", &raw);
    assert_eq!(response.status, 200, "{}", body(&response));
}

#[test]
fn with_on_demand_the_admin_load_pins_a_model_and_unload_leaves_it_servable_on_demand() {
    let workers = test_workers();
    let admin = "model_control = true\ntoken_file = \"admin-token\"\n";
    let server = on_demand_server_with("on-demand-pin", workers, &["classifier"], 60.0, admin);
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let admin = |path: &str| request(server.admin_addr(), "POST", path, &[("Authorization", &auth)], b"{}").unwrap();
    let settled = |generation: u64| {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let status = server.status();
            if status["generation"] == generation && status["reload"].is_null() {
                return status;
            }
            assert!(std::time::Instant::now() < deadline, "no generation {generation}: {status}");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    // Among the workers of the status's generation (those of the last one may still drain).
    let holding = |status: &serde_json::Value, model: &str| {
        let workers = status["workers"].as_array().unwrap().iter().filter(|w| w["generation"] == status["generation"]);
        workers.filter(|w| w["models"].as_array().unwrap().iter().any(|m| m["name"] == model)).count()
    };
    // Unpinned: no worker holds it after the reload, and it is still served, on demand.
    let unloaded = admin("/v2/repository/models/classifier/unload");
    assert_eq!(unloaded.status, 200, "{}", body(&unloaded));
    assert_eq!(holding(&settled(2), "classifier"), 0);
    let metadata = server.request("GET", "/v2/models/classifier", b"").json();
    assert_eq!(metadata["loaded"], false, "{metadata}");
    assert_eq!(probabilities(&server.request("POST", "/v2/models/classifier/infer", &text_request("fine"))).len(), 3);
    // Pinned: every worker loads it as it starts, and no request had to.
    let loaded = admin("/v2/repository/models/mlp/load");
    assert_eq!(loaded.status, 200, "{}", body(&loaded));
    let status = settled(3);
    assert_eq!(holding(&status, "mlp"), workers, "{status}");
    assert_eq!(loads_logged(&server, "mlp", "loaded on demand"), 0, "{}", server.log());
}
