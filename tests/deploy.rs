//! deploy/ (docs/kubernetes.md) against the tools that judge it and the binary it runs: the
//! Kubernetes manifests under `kubernetes-validate --strict`, the custom resources (KEDA's
//! ScaledObject among them) against their vendored CRD schemas, the manifests against each
//! other and the container config, the Containerfile under hadolint (and, as root, built with
//! buildah and `inferd check` run in it), the KServe launcher serving a model under KServe's
//! name, the alert rules under promtool, and every metric the dashboard, rules, adapter and
//! KEDA trigger use against a live inferd's /metrics and a real Prometheus. tests/cgroup_plan.rs runs the container config inside a
//! pod's CPU and memory limits. A missing tool fails the test with what installs it; only
//! missing root skips the image build, saying so.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::{json, Value};

/// Manifests of Kubernetes' own kinds (kubernetes-validate has their schemas) ...
const CORE: [&str; 6] = [
    "k8s/configmap.yaml",
    "k8s/deployment.yaml",
    "k8s/service.yaml",
    "k8s/pdb.yaml",
    "k8s/hpa.yaml",
    "k8s/networkpolicy.yaml",
];
/// ... and custom resources, which it only warns about (deploy/validate_custom_resources.py).
const CUSTOM: [&str; 4] = [
    "k8s/monitoring/servicemonitor.yaml",
    "kserve/servingruntime.yaml",
    "kserve/inferenceservice.yaml",
    "keda/scaledobject.yaml",
];
/// The oldest Kubernetes the manifests are for (autoscaling/v2, policy/v1), and the newest known.
const K8S_VERSIONS: [&str; 2] = ["1.28", "1.37"];

fn deploy(path: &str) -> PathBuf {
    repo().join("deploy").join(path)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A tool from the project's .venv (scripts/requirements.txt).
fn venv_bin(tool: &str) -> PathBuf {
    let path = repo().join(".venv/bin").join(tool);
    assert!(
        path.is_file(),
        "{} is missing: `make test` runs scripts/setup.sh, which installs scripts/requirements.txt into .venv",
        path.display()
    );
    path
}

/// Runs a command to its end: (success, stdout + stderr).
fn run(command: &mut Command) -> (bool, String) {
    let out = command.output().unwrap_or_else(|e| panic!("{command:?}: {e}"));
    (out.status.success(), String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr))
}

/// The documents of a YAML file, or a TOML file, as JSON (PyYAML and tomllib from the .venv).
fn load(path: &Path) -> Vec<Value> {
    let script = "import json, sys, tomllib, yaml\np = sys.argv[1]\n\
                  docs = [tomllib.load(open(p, 'rb'))] if p.endswith('.toml') else yaml.safe_load_all(open(p))\n\
                  print(json.dumps([d for d in docs if d]))";
    let (ok, out) = run(Command::new(venv_bin("python")).args(["-c", script]).arg(path));
    assert!(ok, "cannot read {}: {out}", path.display());
    serde_json::from_str::<Vec<Value>>(&out).unwrap()
}

fn one(path: &str) -> Value {
    let mut docs = load(&deploy(path));
    assert_eq!(docs.len(), 1, "{path}: one document expected");
    docs.remove(0)
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            yaml_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(path);
        }
    }
}

/// `text` with `from` replaced by `to`, which must occur exactly once.
fn edit(text: &str, from: &str, to: &str) -> String {
    assert_eq!(text.matches(from).count(), 1, "`{from}` should occur once in:\n{text}");
    text.replace(from, to)
}

#[test]
fn kubernetes_manifests_pass_strict_validation() {
    // Every manifest is in CORE or CUSTOM, so none goes unvalidated.
    let mut found = Vec::new();
    yaml_files(&deploy("k8s"), &mut found);
    yaml_files(&deploy("kserve"), &mut found);
    yaml_files(&deploy("keda"), &mut found);
    let listed: BTreeSet<PathBuf> = CORE.iter().chain(&CUSTOM).map(|f| deploy(f)).collect();
    for file in &found {
        assert!(listed.contains(file), "{} is in neither CORE nor CUSTOM of tests/deploy.rs", file.display());
    }

    let tool = venv_bin("kubernetes-validate");
    let mut command = Command::new(&tool);
    command.arg("--strict");
    for version in K8S_VERSIONS {
        command.args(["-k", version]);
    }
    let (ok, out) = run(command.args(CORE.map(deploy)));
    eprintln!("{out}");
    assert!(ok, "kubernetes-validate --strict failed:\n{out}");
    // A kind it has no schema for only gets a WARN and exit 0: count the passes instead.
    assert!(!out.contains("WARN") && !out.contains("ERROR"), "{out}");
    for file in CORE {
        for version in K8S_VERSIONS {
            let passed = format!("INFO {} passed for resource ", deploy(file).display());
            let n = out.lines().filter(|l| l.starts_with(&passed) && l.ends_with(&format!(" {version}"))).count();
            assert_eq!(n, 1, "{file} against Kubernetes {version}:\n{out}");
        }
    }

    // --strict is in force: a misspelt field fails.
    let dir = temp_dir("strict");
    let bad = dir.path().join("deployment.yaml");
    let text = edit(
        &read(&deploy("k8s/deployment.yaml")),
        "failureThreshold: 60",
        "failureThreshold: 60\n            periodSecond: 2",
    );
    std::fs::write(&bad, text).unwrap();
    let (ok, out) = run(Command::new(&tool).arg("--strict").arg(&bad));
    assert!(!ok && out.contains("'periodSecond' was unexpected"), "{out}");
}

#[test]
fn custom_resources_match_their_crd_schemas() {
    let python = venv_bin("python");
    let validator = deploy("validate_custom_resources.py");
    for version in K8S_VERSIONS {
        let (ok, out) = run(Command::new(&python).arg(&validator).args(["-k", version]).args(CUSTOM.map(deploy)));
        eprintln!("{out}");
        assert!(ok, "{out}");
        assert_eq!(out.lines().filter(|l| l.starts_with("PASS ")).count(), CUSTOM.len(), "{out}");
    }
    // The schemas reject what the CRDs do not define, down to the Kubernetes types inside.
    let dir = temp_dir("crd");
    for (file, from, to, says) in [
        (
            "k8s/monitoring/servicemonitor.yaml",
            "scrapeTimeout: 5s",
            "scrapeTimeOut: 5s",
            "'scrapeTimeOut' was unexpected",
        ),
        ("kserve/servingruntime.yaml", "multiModel: false", "multiModel: \"no\"", "'no' is not of type 'boolean'"),
        ("kserve/servingruntime.yaml", "periodSeconds: 5", "periodSecond: 5", "'periodSecond' was unexpected"),
        (
            "kserve/inferenceservice.yaml",
            "runtime: kserve-inferd",
            "runtimeName: kserve-inferd",
            "'runtimeName' was unexpected",
        ),
    ] {
        let bad = dir.path().join(Path::new(file).file_name().unwrap());
        std::fs::write(&bad, edit(&read(&deploy(file)), from, to)).unwrap();
        let (ok, out) = run(Command::new(&python).arg(&validator).arg(&bad));
        assert!(!ok && out.contains(says), "{file} with `{to}`:\n{out}");
    }
}

#[test]
fn the_manifests_agree_with_each_other_and_with_the_container_config() {
    let config_text = read(&deploy("inferd.toml"));
    let config = load(&deploy("inferd.toml")).remove(0);
    let configmap = one("k8s/configmap.yaml");
    assert_eq!(
        configmap["data"]["inferd.toml"].as_str(),
        Some(config_text.as_str()),
        "deploy/k8s/configmap.yaml's inferd.toml is not deploy/inferd.toml"
    );
    let deployment = one("k8s/deployment.yaml");
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    let named = |list: &Value, name: &Value| -> Value {
        let list = list.as_array().unwrap();
        list.iter().find(|x| x["name"] == *name).unwrap_or_else(|| panic!("no {name} in {list:?}")).clone()
    };
    let port_of = |address: &Value| -> u64 { address.as_str().unwrap().rsplit(':').next().unwrap().parse().unwrap() };

    // The named ports are the ports inferd listens on.
    assert_eq!(
        named(&container["ports"], &json!("http"))["containerPort"].as_u64(),
        Some(port_of(&config["server"]["listen"]))
    );
    assert_eq!(
        named(&container["ports"], &json!("metrics"))["containerPort"].as_u64(),
        Some(port_of(&config["admin"]["listen"]))
    );
    // Stopping: the preStop sleep and inferd's drain end before the kubelet's SIGKILL.
    let pre_stop: f64 = container["lifecycle"]["preStop"]["exec"]["command"][1].as_str().unwrap().parse().unwrap();
    let drain = config["server"]["graceful_timeout_secs"].as_f64().unwrap();
    let grace = pod["terminationGracePeriodSeconds"].as_f64().unwrap();
    assert!(pre_stop + drain < grace, "preStop {pre_stop} s + drain {drain} s must end before {grace} s");
    // Starting: the startup probe waits as long as inferd lets a worker boot.
    let startup = &container["startupProbe"];
    let patience = startup["periodSeconds"].as_f64().unwrap() * startup["failureThreshold"].as_f64().unwrap();
    assert!(
        patience >= config["server"]["boot_timeout_secs"].as_f64().unwrap(),
        "startupProbe gives up after {patience} s"
    );
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/v2/health/ready");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/v2/health/live");
    // inferd plans its pool from the CPU limit; without one it would plan for the whole node.
    assert!(container["resources"]["limits"]["cpu"].is_string(), "{container:#}");
    // The ConfigMap is the config inferd reads; on a read-only root, /tmp is writable for the
    // control socket and the shared weights.
    assert_eq!(container["args"], json!(["serve", "--config", "/etc/inferd/inferd.toml"]));
    let mount = |path: &str| -> Value {
        let mounts = container["volumeMounts"].as_array().unwrap();
        mounts.iter().find(|m| m["mountPath"] == path).unwrap_or_else(|| panic!("nothing mounted at {path}"))["name"]
            .clone()
    };
    assert_eq!(named(&pod["volumes"], &mount("/etc/inferd"))["configMap"]["name"], configmap["metadata"]["name"]);
    assert!(named(&pod["volumes"], &mount("/tmp"))["emptyDir"].is_object());
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
    for key in [&config["server"]["control_socket"], &config["runtime"]["cache_dir"]] {
        assert!(key.as_str().unwrap().starts_with("/tmp/"), "{key} is not on the /tmp volume");
    }
    // The pod runs as the image's user.
    let containerfile = read(&deploy("Containerfile"));
    let user = containerfile.lines().rev().find_map(|l| l.strip_prefix("USER ")).unwrap();
    let security = &pod["securityContext"];
    assert_eq!(user, format!("{}:{}", security["runAsUser"], security["runAsGroup"]));

    // Every selector finds the pods; every port name the Service and ServiceMonitor use exists.
    let (service, pdb, hpa, monitor) =
        (one("k8s/service.yaml"), one("k8s/pdb.yaml"), one("k8s/hpa.yaml"), one("k8s/monitoring/servicemonitor.yaml"));
    assert_eq!(deployment["spec"]["selector"]["matchLabels"], *labels);
    assert_eq!(service["spec"]["selector"], *labels);
    assert_eq!(pdb["spec"]["selector"]["matchLabels"], *labels);
    assert_eq!(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"]);
    for port in service["spec"]["ports"].as_array().unwrap() {
        named(&container["ports"], &port["targetPort"]);
    }
    named(&service["spec"]["ports"], &monitor["spec"]["endpoints"][0]["port"]);
    // The NetworkPolicy covers the pods and names their ports; no API token is mounted.
    let policy = one("k8s/networkpolicy.yaml");
    assert_eq!(policy["spec"]["podSelector"]["matchLabels"], *labels);
    for rule in policy["spec"]["ingress"].as_array().unwrap() {
        for port in rule["ports"].as_array().unwrap() {
            named(&container["ports"], &port["port"]);
        }
    }
    assert_eq!(pod["automountServiceAccountToken"], false);
    assert_eq!(monitor["spec"]["endpoints"][0]["path"], "/metrics");
    // The HPA scales the Deployment, on a Pods metric the adapter rules serve.
    assert_eq!(hpa["spec"]["scaleTargetRef"]["name"], deployment["metadata"]["name"]);
    let adapter = one("prometheus/adapter-rules.yaml");
    let served: Vec<&Value> = adapter["rules"].as_array().unwrap().iter().map(|r| &r["name"]["as"]).collect();
    let pods: Vec<&Value> = hpa["spec"]["metrics"].as_array().unwrap().iter().filter(|m| m["type"] == "Pods").collect();
    assert!(!pods.is_empty());
    for metric in pods {
        assert!(served.contains(&&metric["pods"]["metric"]["name"]), "{metric} is not among the adapter's {served:?}");
    }

    // KServe: the InferenceService runs on the runtime, in a format and protocol it supports,
    // and the runtime hands KServe's model name and folder to the launcher in the image.
    let (runtime, isvc) = (one("kserve/servingruntime.yaml"), one("kserve/inferenceservice.yaml"));
    let model = &isvc["spec"]["predictor"]["model"];
    assert_eq!(model["runtime"], runtime["metadata"]["name"]);
    assert!(runtime["spec"]["supportedModelFormats"]
        .as_array()
        .unwrap()
        .iter()
        .any(|f| f["name"] == model["modelFormat"]["name"]));
    assert!(runtime["spec"]["protocolVersions"].as_array().unwrap().contains(&model["protocolVersion"]));
    let container = &runtime["spec"]["containers"][0];
    assert_eq!(container["name"], "kserve-container");
    assert_eq!(container["command"], json!(["/usr/local/bin/inferd-kserve"]));
    for arg in ["--model_name={{.Name}}", "--model_dir=/mnt/models"] {
        assert!(container["args"].as_array().unwrap().contains(&json!(arg)), "{arg} missing: {container:#}");
    }
    assert!(containerfile.contains(" deploy/kserve/inferd-kserve /usr/local/bin/inferd-kserve\n"));
}

#[test]
fn the_containerfile_lints_clean_and_copies_files_that_exist() {
    let file = deploy("Containerfile");
    let (ok, out) = run(Command::new(venv_bin("hadolint")).arg(&file));
    assert!(ok, "hadolint {}:\n{out}", file.display());
    let text = read(&file);
    // ${NAME} in a COPY source is the ARG's default, as the builder substitutes it.
    let args: Vec<(String, String)> = text
        .lines()
        .filter_map(|l| l.strip_prefix("ARG ")?.split_once('='))
        .map(|(k, v)| (format!("${{{k}}}"), v.to_string()))
        .collect();
    let mut sources = 0;
    for line in text.lines().filter(|l| l.starts_with("COPY ")) {
        let words: Vec<String> = line
            .split_whitespace()
            .skip(1)
            .filter(|w| !w.starts_with("--"))
            .map(|w| args.iter().fold(w.to_string(), |w, (k, v)| w.replace(k, v)))
            .collect();
        let (destination, from) = words.split_last().unwrap();
        assert!(destination.starts_with('/'), "{line}");
        for source in from {
            let path = repo().join(source);
            assert!(
                path.exists(),
                "`{line}` copies {}, which is missing: make setup and make build make it",
                path.display()
            );
            sources += 1;
        }
    }
    assert!(sources >= 6, "{text}");
    // Nothing runs at build time: no package manager, no compiler in the image.
    assert!(!text.lines().any(|l| l.starts_with("RUN ")), "{text}");
    let user = text.lines().rev().find_map(|l| l.strip_prefix("USER ")).expect("a USER line");
    assert!(user.split(':').next().unwrap().parse::<u32>().is_ok_and(|uid| uid != 0), "USER {user}: numeric, not root");
}

#[test]
fn the_image_builds_and_inferd_check_runs_in_it() {
    // deploy/build-image.sh as docs/kubernetes.md gives it, on a Debian base made offline with
    // debootstrap (cached in .cache/image-base after the first run) since no image registry is
    // reachable from here; `--check` runs `inferd check` in a container of the image.
    let tag = format!("localhost/inferd-test:{}", std::process::id());
    let out = Command::new(deploy("build-image.sh"))
        .args(["--offline", "--check", &tag])
        .env("INFERD_BIN", BIN)
        .stdin(Stdio::null())
        .output()
        .expect("run deploy/build-image.sh");
    let _ = Command::new("buildah").args(["rmi", &tag]).output();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.code() == Some(77) {
        eprintln!("SKIPPED the_image_builds_and_inferd_check_runs_in_it: {stderr}");
        return;
    }
    eprintln!("{stderr}{stdout}");
    assert!(out.status.success(), "deploy/build-image.sh failed:\n{stderr}{stdout}");
    // `inferd check` with the image's own configuration, library and model, as its own user.
    for line in [
        "config:          /etc/inferd/inferd.toml",
        "onnx runtime:    /usr/lib/inferd/libonnxruntime.so.",
        "model minilm (version 1",
        "plan OK",
    ] {
        assert!(stdout.contains(line), "no `{line}` in:\n{stdout}");
    }
    assert_eq!(stdout.lines().next_back(), Some("65532"), "{stdout}");
}

#[test]
fn the_kserve_launcher_serves_the_model_under_kserves_name() {
    let dir = temp_dir("kserve");
    let work = dir.path().join("work");
    // What KServe's storage initializer leaves in /mnt/models for a storageUri that holds one
    // model's folder: here the `typed` test model's, which names itself "typed".
    let mnt = dir.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    for file in ["model.toml", "model.onnx"] {
        std::fs::copy(test_models().join("typed").join(file), mnt.join(file)).unwrap();
    }
    let launcher = deploy("kserve/inferd-kserve");
    let kserve = |args: &[String]| {
        let mut command = Command::new(&launcher);
        command.args(args).env("INFERD_BIN", BIN).env("INFERD_KSERVE_DIR", &work);
        command
    };

    // The ServingRuntime's own arguments with KServe's substitutions, and inferd flags after them.
    let runtime = one("kserve/servingruntime.yaml");
    let (port, admin) = (free_port(), free_port());
    let mut args: Vec<String> = runtime["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let a = a.as_str().unwrap().replace("{{.Name}}", "embedder").replace("/mnt/models", mnt.to_str().unwrap());
            a.replace("--http_port=8080", &format!("--http_port={port}"))
        })
        .collect();
    args.extend([format!("--admin_port={admin}"), "--workers".into(), "1".into(), "--threads".into(), "1".into()]);
    assert_eq!(args[0], "serve");
    let socket = work.join("control.sock");
    let mut server = Server::spawn(kserve(&args), temp_dir("kserve-run"), port, Some(socket));
    let status = server.wait_ready(Duration::from_secs(60));
    assert_eq!(status["workers"].as_array().unwrap().len(), 1, "{status:#}");
    // KServe's v2 clients call the model by the InferenceService's name.
    let r = server.request("POST", "/v2/models/embedder/infer", &typed_request());
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(server.request("GET", "/v2/models/embedder", b"").json()["name"], "embedder");
    assert_eq!(server.request("POST", "/v2/models/typed/infer", &typed_request()).status, 404);
    let metrics = request(SocketAddr::from(([127, 0, 0, 1], admin)), "GET", "/metrics", &[], b"").unwrap();
    assert!(String::from_utf8_lossy(&metrics.body).contains("inferd_model_info{model=\"embedder\""));
    server.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(server.wait_exit(Duration::from_secs(30)).code(), Some(0), "{}", server.log());
    drop(server);

    // A storageUri that holds a model repository: served from there as it is.
    let repository = test_models().display().to_string();
    let check = |name: &str| {
        run(&mut kserve(&["check".into(), format!("--model_name={name}"), format!("--model_dir={repository}")]))
    };
    let (ok, out) = check("typed");
    assert!(ok && out.contains("model typed (version 1") && out.contains("plan OK"), "{out}");
    // Neither layout, and a name that cannot be an InferenceService's: refused, saying why.
    let (ok, out) = check("absent");
    assert!(!ok && out.contains("must hold one model's folder or an inferd model repository"), "{out}");
    let (ok, out) = check("Not_A_Name");
    assert!(!ok && out.contains("is not a Kubernetes object name"), "{out}");
}

// --- metrics: the dashboard, the alert rules and the adapter rules ----------------------

/// Every PromQL expression in deploy/ with where it is, Grafana's and the adapter's
/// placeholders replaced by values a plain Prometheus takes.
fn deploy_queries() -> Vec<(String, String)> {
    let mut queries = Vec::new();
    let grafana = |expr: &str| -> String {
        let expr = expr
            .replace("$__rate_interval", "1m")
            .replace("$namespace", ".*")
            .replace("$model", ".*")
            .replace("$pod_memory_limit", "1610612736");
        assert!(!expr.contains('$'), "a dashboard variable this test does not know: {expr}");
        expr
    };
    let dashboard: Value = serde_json::from_str(&read(&deploy("grafana/inferd.json"))).unwrap();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let place = format!("dashboard panel '{}' {}", panel["title"].as_str().unwrap(), target["refId"]);
            queries.push((place, grafana(target["expr"].as_str().unwrap())));
        }
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if variable["type"] == "query" {
            // label_values(SELECTOR, LABEL): the selector is PromQL.
            let query = variable["query"]["query"].as_str().unwrap();
            let selector = query.strip_prefix("label_values(").and_then(|q| q.rsplit_once(',')).unwrap().0;
            queries.push((format!("dashboard variable {}", variable["name"]), grafana(selector)));
        }
    }
    for group in one("prometheus/alerts.yml")["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            queries.push((format!("alert {}", rule["alert"]), rule["expr"].as_str().unwrap().to_string()));
        }
    }
    for rule in one("prometheus/adapter-rules.yaml")["rules"].as_array().unwrap() {
        let series = rule["seriesQuery"].as_str().unwrap();
        let name = series.split('{').next().unwrap();
        let query = rule["metricsQuery"]
            .as_str()
            .unwrap()
            .replace("<<.Series>>", name)
            .replace("<<.LabelMatchers>>", "job=~\".+\"")
            .replace("<<.GroupBy>>", "instance");
        queries.push((format!("adapter seriesQuery {series}"), series.to_string()));
        queries.push((format!("adapter metricsQuery for {name}"), query));
    }
    for trigger in one("keda/scaledobject.yaml")["spec"]["triggers"].as_array().unwrap() {
        let query = trigger["metadata"]["query"].as_str().unwrap().to_string();
        queries.push((format!("KEDA trigger {}", trigger["type"]), query));
    }
    queries
}

/// The metric names a PromQL expression selects: its identifiers, less functions and
/// aggregations (followed by a parenthesis or a grouping), keywords, and what are label names
/// or values or durations (inside {...}, by/without/on/ignoring/group_x (...), quotes, [...]).
fn metric_names(expr: &str) -> BTreeSet<String> {
    const KEYWORDS: [&str; 22] = [
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "inf",
        "nan",
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
        "atan2",
    ];
    const GROUPING: [&str; 6] = ["by", "without", "on", "ignoring", "group_left", "group_right"];
    let mut plain = String::new();
    let (mut quote, mut escaped, mut nesting) = (None, false, 0);
    for c in expr.chars() {
        let blank = match (quote, c) {
            (Some(_), _) if escaped => {
                escaped = false;
                true
            }
            (Some(_), '\\') => {
                escaped = true;
                true
            }
            (Some(q), _) => {
                if c == q {
                    quote = None;
                }
                true
            }
            (None, '"' | '\'' | '`') => {
                quote = Some(c);
                true
            }
            (None, '{' | '[') => {
                nesting += 1;
                true
            }
            (None, '}' | ']') => {
                nesting -= 1;
                true
            }
            _ => nesting > 0,
        };
        plain.push(if blank { ' ' } else { c });
    }
    let chars: Vec<char> = plain.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_ascii_digit() || c == '.' {
            // A number or a duration (1e3, 0.95, 5m): not a name.
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || "._".contains(chars[i])) {
                i += 1;
            }
            continue;
        }
        if !(c.is_ascii_alphabetic() || c == '_' || c == ':') {
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':') {
            i += 1;
        }
        let word: String = chars[start..i].iter().collect();
        let next = chars[i..].iter().position(|c| !c.is_whitespace()).map(|p| i + p);
        let opens = next.is_some_and(|n| chars[n] == '(');
        if GROUPING.contains(&word.as_str()) && opens {
            // The label list: skip to its closing parenthesis.
            i = next.unwrap() + chars[next.unwrap()..].iter().position(|&c| c == ')').unwrap() + 1;
        } else if !opens && !KEYWORDS.contains(&word.as_str()) && !GROUPING.contains(&word.as_str()) {
            names.insert(word);
        }
    }
    names
}

/// The series names a scrape declares: a counter or gauge by its name, a histogram by its
/// _bucket, _sum and _count. Declared with `# TYPE` even before a labelled series has a sample
/// (restarts by reason, say), so this is what a query may name.
fn exported_series(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(declared) = line.strip_prefix("# TYPE ") {
            let (name, kind) = declared.split_once(' ').unwrap();
            match kind {
                "histogram" => names.extend(["_bucket", "_sum", "_count"].map(|s| format!("{name}{s}"))),
                "summary" => names.extend(["", "_sum", "_count"].map(|s| format!("{name}{s}"))),
                _ => {
                    names.insert(name.to_string());
                }
            }
        }
    }
    names
}

/// The query API's answer: Ok(Some(series in the result)), Ok(None) while the server does
/// not answer yet, or Err(what Prometheus said against the query).
fn series(prom: &Prometheus, promql: &str) -> Result<Option<usize>, String> {
    let Some(v) = prom.query(promql) else { return Ok(None) };
    match v["status"].as_str() {
        Some("success") => Ok(Some(v["data"]["result"].as_array().map_or(1, Vec::len))),
        _ => Err(format!("{}: {}", v["errorType"], v["error"])),
    }
}

#[test]
fn dashboard_alerts_and_adapter_use_only_metrics_a_live_inferd_exports() {
    let promtool = system_bin("promtool", "prometheus");
    let (ok, out) = run(Command::new(&promtool).args(["check", "rules"]).arg(deploy("prometheus/alerts.yml")));
    assert!(ok, "promtool check rules:\n{out}");
    // alerts_test.yml: each alert fires (and stays quiet) when it should, with its text.
    let (ok, out) = run(Command::new(&promtool).args(["test", "rules"]).arg(deploy("prometheus/alerts_test.yml")));
    assert!(ok, "promtool test rules:\n{out}");

    // A live inferd that answered and refused requests and lost a worker, so that the series
    // by code and by reason exist too.
    let server = serve(temp_dir("deploy-metrics"), test_workers(), &test_models(), "typed", &[], "");
    for _ in 0..20 {
        assert_eq!(server.request("POST", "/v2/models/typed/infer", &typed_request()).status, 200);
    }
    assert_eq!(server.request("POST", "/v2/models/typed/infer", b"{\"inputs\": 1}").status, 400);
    let victim = server.worker_pids()[0];
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(victim), nix::sys::signal::Signal::SIGKILL).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.status()["phase"] != "ready" || server.worker_pids().contains(&victim) {
        assert!(Instant::now() < deadline, "worker {victim} not replaced:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let text = server.metrics_text();
    let exported = exported_series(&text);
    // A histogram is queried by its _bucket, _sum and _count series, never by its own name.
    assert!(exported.contains("inferd_requests_total") && exported.contains("inferd_batch_size_bucket"), "{text}");
    assert!(!exported.contains("inferd_batch_size"), "{exported:?}");

    let queries = deploy_queries();
    // The restart and recycle reasons' labels, as `RestartReason::as_str` and
    // `RecycleReason::as_str` write them.
    let reasons = read(&repo().join("supervisor/src/metrics.rs"));
    for (place, query) in &queries {
        let names = metric_names(query);
        assert!(!names.is_empty(), "{place}: no metric found in `{query}`");
        for name in &names {
            assert!(exported.contains(name), "{place}: `{name}` is not in a live inferd's /metrics\n{query}\n{text}");
        }
        // A reason's series appears only once it happened: its value must be one the pool uses.
        for part in query.split("reason=\"").skip(1) {
            let reason = part.split('"').next().unwrap();
            assert!(
                reasons.contains(&format!("=> \"{reason}\"")),
                "{place}: no worker restart or recycle reason \"{reason}\""
            );
        }
    }
    eprintln!(
        "{} queries use {:?}",
        queries.len(),
        queries.iter().flat_map(|(_, q)| metric_names(q)).collect::<BTreeSet<_>>()
    );

    // A real Prometheus scraping that inferd takes every query, and every dashboard panel has
    // data (rate() and increase() need two scrapes; rate-based quantiles may then be NaN).
    let prom_dir = temp_dir("deploy-prometheus");
    let prom = Prometheus::start(prom_dir.path(), server.admin_addr());
    let deadline = Instant::now() + Duration::from_secs(45);
    loop {
        for _ in 0..5 {
            assert_eq!(server.request("POST", "/v2/models/typed/infer", &typed_request()).status, 200);
        }
        let answers: Vec<(&String, &String, Option<usize>)> = queries
            .iter()
            .map(|(place, q)| {
                (place, q, series(&prom, q).unwrap_or_else(|e| panic!("Prometheus refuses {place}: {e}\n{q}")))
            })
            .collect();
        let panels_without_data: BTreeSet<&str> = answers
            .iter()
            .filter(|(place, _, _)| place.starts_with("dashboard panel"))
            .map(|(place, _, _)| place.rsplit_once(' ').unwrap().0)
            .filter(|panel| !answers.iter().any(|(p, _, n)| p.starts_with(panel) && n.is_some_and(|n| n > 0)))
            .collect();
        if answers.iter().all(|(_, _, n)| n.is_some()) && panels_without_data.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "after 45 s, dashboard panels without data: {panels_without_data:?}");
        std::thread::sleep(Duration::from_millis(500));
    }
}
