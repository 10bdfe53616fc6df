//! What inferd refuses, and how it says so: a model that cannot load, a missing ONNX Runtime,
//! an impossible CPU plan, a bad config key, a status query with no server; and with which
//! exit code (docs/operations.md, "Exit codes": 3 a model, 4 booting, 78 the configuration).

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::common::*;

fn inferd(args: &[&str], dir: &TempDir) -> Output {
    Command::new(BIN).args(args).current_dir(dir.path()).env("INFERD_LOG", "info").output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_model_that_fails_to_load_stops_serve_with_its_error_and_no_respawn_loop() {
    let dir = temp_dir("broken");
    let repo_dir = dir.path().join("models");
    std::fs::create_dir_all(repo_dir.join("broken")).unwrap();
    std::fs::write(repo_dir.join("broken/model.toml"), "name = \"broken\"\n").unwrap();
    std::fs::write(repo_dir.join("broken/model.onnx"), b"this is not an onnx protobuf").unwrap();
    let port = free_port();
    write_config(dir.path(), port, test_workers(), &repo_dir, "broken", &[], "");
    let started = Instant::now();
    let mut server = Server::start(dir, port, &[]);
    let status = server.wait_exit(Duration::from_secs(20));
    let log = server.log();
    eprintln!("exited after {:.2} s with {status}", started.elapsed().as_secs_f64());
    assert_eq!(status.code(), Some(3), "model-load failures exit with the reserved code 3; log:\n{log}");
    assert!(log.contains("could not load its model: model 'broken' failed to load from"), "{log}");
    assert!(log.contains("protobuf") || log.contains("parsing"), "the ONNX Runtime message is passed on: {log}");
    // Worker 0 starts alone (the memory plan is measured on it); it fails, so nothing else
    // starts and it is not started again.
    assert_eq!(log.matches("worker 0 started for boot: pid").count(), 1, "never respawned:\n{log}");
    assert_eq!(log.matches(" started for ").count(), 1, "no other worker started:\n{log}");
    assert!(!server.socket.exists(), "the control socket is removed on exit");
}

#[test]
fn a_missing_onnx_runtime_is_explained() {
    let dir = temp_dir("noort");
    let port = free_port();
    write_config(dir.path(), port, 1, &test_models(), "typed", &[], "");
    for command in ["check", "serve"] {
        let out = Command::new(BIN)
            .args([command, "--config", "inferd.toml"])
            .current_dir(dir.path())
            .env("ORT_DYLIB_PATH", "/nonexistent/libonnxruntime.so.1.31.1")
            .output()
            .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(4), "{command}: {err}");
        assert!(
            err.contains("ORT_DYLIB_PATH points to /nonexistent/libonnxruntime.so.1.31.1, which does not exist"),
            "{err}"
        );
    }
    // The same named by the configuration (the unit's RestartPreventExitStatus relies on 4).
    let config = std::fs::read_to_string(dir.path().join("inferd.toml")).unwrap();
    let missing = format!("{config}\n[runtime]\nort_library = \"/nonexistent/libonnxruntime.so\"\n");
    std::fs::write(dir.path().join("missing.toml"), missing).unwrap();
    for command in ["check", "serve"] {
        let out = inferd(&[command, "--config", "missing.toml"], &dir);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(4), "{command}: {err}");
        assert!(err.contains("runtime.ort_library points to /nonexistent/libonnxruntime.so"), "{err}");
    }
    // A path that exists but is not the library: `check` says so, and in `serve` the worker
    // reports it and serve stops.
    std::fs::write(dir.path().join("libonnxruntime.so.1.31.1"), b"not a library").unwrap();
    for command in ["check", "serve"] {
        let out = Command::new(BIN)
            .args([command, "--config", "inferd.toml"])
            .current_dir(dir.path())
            .env("ORT_DYLIB_PATH", dir.path().join("libonnxruntime.so.1.31.1"))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(4), "{command}: {}", stderr(&out));
        assert!(stderr(&out).contains("cannot load ONNX Runtime from"), "{}", stderr(&out));
    }
}

#[test]
fn an_oversubscribed_plan_is_refused_by_check_and_serve() {
    let dir = temp_dir("oversub");
    let port = free_port();
    let cores = std::thread::available_parallelism().unwrap().get();
    write_config(dir.path(), port, cores, &test_models(), "typed", &[], "");
    for command in ["check", "serve"] {
        let out = inferd(&[command, "--config", "inferd.toml", "--threads", "2"], &dir);
        assert_eq!(out.status.code(), Some(78), "{command} accepted {cores} x 2 threads: {}", stderr(&out));
        let err = stderr(&out);
        assert!(err.contains(&format!("{cores} workers x 2 threads = {} threads", cores * 2)), "{err}");
        assert!(err.contains("allow_oversubscription"), "{err}");
    }
    // With the operator's explicit permission it is accepted and flagged.
    let out = inferd(&["check", "--config", "inferd.toml", "--threads", "2"], &dir);
    assert!(!out.status.success());
    std::fs::write(
        dir.path().join("inferd.toml"),
        std::fs::read_to_string(dir.path().join("inferd.toml"))
            .unwrap()
            .replace("[server]\n", "[server]\nallow_oversubscription = true\n"),
    )
    .unwrap();
    let out = inferd(&["check", "--config", "inferd.toml", "--threads", "2"], &dir);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(text.contains("OVERSUBSCRIBED"), "{text}");
}

#[test]
fn check_prints_the_plan_with_models_and_runtime() {
    let dir = temp_dir("check");
    let port = free_port();
    write_config(dir.path(), port, 1, &test_models(), "typed", &["slow"], "");
    let out = inferd(&["check", "--config", "inferd.toml"], &dir);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", stderr(&out));
    for expected in [
        "usable cores:",
        "worker 0:      cpus",
        "onnx runtime:",
        "model typed",
        "input  f16_in",
        "FP16",
        "model slow",
        "output y",
        "plan OK",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
}

#[test]
fn bad_config_values_are_refused_naming_the_key() {
    let dir = temp_dir("badkey");
    std::fs::write(dir.path().join("inferd.toml"), "[server]\nworkerz = 2\n").unwrap();
    let out = inferd(&["check", "--config", "inferd.toml"], &dir);
    assert_eq!(out.status.code(), Some(78), "{}", stderr(&out));
    assert!(stderr(&out).contains("unknown field `workerz`"), "{}", stderr(&out));
    std::fs::write(dir.path().join("inferd.toml"), "[server]\nlisten = \"8000\"\n").unwrap();
    let out = inferd(&["serve", "--config", "inferd.toml"], &dir);
    assert_eq!(out.status.code(), Some(78), "{}", stderr(&out));
    assert!(stderr(&out).contains("config key `server.listen`"), "{}", stderr(&out));
    // A file that cannot be read, for both commands.
    for command in ["check", "serve"] {
        let out = inferd(&[command, "--config", "absent.toml"], &dir);
        assert_eq!(out.status.code(), Some(78), "{}", stderr(&out));
        assert!(stderr(&out).contains("cannot read config"), "{}", stderr(&out));
    }
    // A model the configuration names that is not there is a model that cannot load.
    std::fs::write(dir.path().join("inferd.toml"), "[models]\ndefault = \"absent\"\n").unwrap();
    for command in ["check", "serve"] {
        let out = inferd(&[command, "--config", "inferd.toml"], &dir);
        assert_eq!(out.status.code(), Some(3), "{command}: {}", stderr(&out));
        assert!(stderr(&out).contains("model 'absent'"), "{}", stderr(&out));
    }
}

/// A public address that cannot be bound (one this host does not have: 192.0.2.1, TEST-NET-1):
/// `serve` exits 4 with the reason (as for the gRPC port, tests/grpc.rs). A port another
/// server listens on is a configuration error instead (78, tests/ports.rs).
#[test]
fn a_port_that_cannot_be_bound_exits_4() {
    let dir = temp_dir("port-unbindable");
    write_config(dir.path(), free_port(), 1, &test_models(), "typed", &[], "");
    let listen = "192.0.2.1:18999";
    let out = inferd(&["serve", "--config", "inferd.toml", "--listen", listen], &dir);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(stderr(&out).contains(&format!("cannot listen on {listen}")), "{}", stderr(&out));
}

#[test]
fn status_without_a_server_says_so_and_fails() {
    let dir = temp_dir("nostatus");
    let socket = dir.path().join("none.sock");
    for command in [&["status"][..], &["reload"], &["scale", "+1"]] {
        let out = Command::new(BIN).args(command).arg("--control-socket").arg(&socket).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{command:?}: {}", stderr(&out));
        assert!(stderr(&out).contains("inferd is not running"), "{}", stderr(&out));
    }
}

/// A model.toml whose pipeline does not fit the model is refused with the reason, by `check`
/// and by `serve` (exit code 3, like any model that cannot load).
#[test]
fn a_pipeline_that_does_not_fit_its_model_is_refused() {
    let dir = temp_dir("misfit");
    let models = dir.path().join("models");
    let variants = [
        ("cnn", "labels = [\"red\", \"green\", \"blue\"]", "3 labels, but output 'logits' has 4 logits per row"),
        ("cnn", "width = 64", "image settings (64x32, Nchw) need FP32 [-1, 3, 32, 64]"),
        ("cnn", "output = \"scores\"", "output 'scores' is not an output of the model (logits)"),
        ("typed", "", "input 'f32_in' is not one the text pipeline produces"),
    ];
    for (i, (source, change, message)) in variants.iter().enumerate() {
        let name = format!("misfit{i}");
        let folder = models.join(&name);
        std::fs::create_dir_all(&folder).unwrap();
        std::fs::copy(test_models().join(source).join("model.onnx"), folder.join("model.onnx")).unwrap();
        let toml = if *source == "cnn" {
            let original = std::fs::read_to_string(test_models().join("cnn/model.toml")).unwrap();
            let key = change.split(' ').next().unwrap();
            let line = original.lines().find(|l| l.starts_with(&format!("{key} ="))).unwrap().to_string();
            original.replace("name = \"cnn\"", &format!("name = \"{name}\"")).replace(&line, change)
        } else {
            format!(
                "name = \"{name}\"\ntask = \"embedding\"\n[tokenizer]\nfile = \"{}\"\n",
                repo().join("models/minilm/tokenizer.json").display()
            )
        };
        std::fs::write(folder.join("model.toml"), toml).unwrap();
        let port = free_port();
        write_config(dir.path(), port, 1, &models, &name, &[], "");
        let out = inferd(&["check", "--config", "inferd.toml"], &dir);
        assert!(!out.status.success(), "{name} ({change}) was accepted");
        assert!(stderr(&out).contains(message), "{name}: {}", stderr(&out));
        if i == 0 {
            let out = inferd(&["serve", "--config", "inferd.toml"], &dir);
            assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
            assert!(stderr(&out).contains(message), "{}", stderr(&out));
        }
    }
}

/// A worker memory limit that a fresh worker already passes is refused at start, instead of
/// replacing workers forever.
#[test]
fn a_worker_memory_limit_below_a_fresh_worker_is_refused() {
    let dir = temp_dir("softlimit");
    let port = free_port();
    write_config(dir.path(), port, 1, &test_models(), "typed", &[], "worker_memory_soft_limit_mb = 5");
    let out = inferd(&["serve", "--config", "inferd.toml"], &dir);
    assert_eq!(out.status.code(), Some(78), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the soft worker memory limit (5 MiB) is not above a fresh worker's private memory"),
        "{}",
        stderr(&out)
    );
}

/// A graph that cannot take the default warm-up's zeros (tests/fixtures/digits.onnx casts
/// strings of digits to numbers, as Triton's `simple_string`; an empty string fails) stops
/// `serve` naming the warm-up's inputs and what to set; `[warmup.inputs]` gives it values it
/// takes, `[warmup] enabled = false` serves without a warm-up, and a warm-up input the model
/// does not have is refused by name.
#[test]
fn warm_up_takes_sample_inputs_or_can_be_turned_off_and_says_which_input_failed() {
    // A folder serving the model with `warmup` in its model.toml, and its port.
    let setup = |warmup: &str| {
        let dir = temp_dir("warmup");
        let models = dir.path().join("models");
        std::fs::create_dir_all(models.join("digits")).unwrap();
        let file = repo().join("tests/fixtures/digits.onnx");
        let toml = format!("name = \"digits\"\nfile = \"{}\"\n{warmup}", file.display());
        std::fs::write(models.join("digits/model.toml"), toml).unwrap();
        let port = free_port();
        write_config(dir.path(), port, 1, &models, "digits", &[], "");
        (dir, port)
    };

    let (dir, _) = setup("");
    let out = inferd(&["serve", "--config", "inferd.toml"], &dir);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("model 'digits' failed its warm-up run"), "{err}");
    assert!(err.contains("INPUT0 BYTES [1, 16] of \"\"") && err.contains("[warmup.inputs]"), "{err}");

    let (dir, _) = setup("[warmup.inputs]\nINPUT1 = \"7\"\n");
    let out = inferd(&["serve", "--config", "inferd.toml"], &dir);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("[warmup.inputs] names 'INPUT1', which is not an input of the model (its inputs: INPUT0)"),
        "{err}"
    );

    let (dir, _) = setup("[warmup.inputs]\nINPUT0 = 7\n");
    let out = inferd(&["serve", "--config", "inferd.toml"], &dir);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(stderr(&out).contains("[warmup.inputs] INPUT0 = 7: not a BYTES value"), "{}", stderr(&out));

    // Digits to warm up on, or no warm-up: it serves.
    let digits: Vec<String> = (0..16).map(|i| i.to_string()).collect();
    let body =
        infer_body(serde_json::json!([{"name": "INPUT0", "shape": [1, 16], "datatype": "BYTES", "data": digits}]));
    for (warmup, said) in [
        ("[warmup.inputs]\nINPUT0 = \"7\"\n", "warmed up in"),
        ("[warmup]\nenabled = false\n", "no warm-up ([warmup] enabled = false)"),
    ] {
        let (dir, port) = setup(warmup);
        let mut server = Server::start(dir, port, &[]);
        server.wait_ready(Duration::from_secs(60));
        let r = server.request("POST", "/v2/models/digits/infer", &body);
        assert_eq!(r.status, 200, "{warmup}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["outputs"][0]["data"], serde_json::json!((0..16).collect::<Vec<i32>>()));
        assert!(server.log().contains(said), "{warmup}: {}", server.log());
    }
}
