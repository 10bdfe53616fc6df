//! TLS on the public port and the admin listener ([server] and [admin] tls_cert, tls_key,
//! tls_client_ca): HTTPS and gRPC over TLS with the real clients (curl,
//! tests/clients/tls_check.py: openai, tritonclient.http and .grpc); plain HTTP on the TLS
//! port answered 400; client certificates required with tls_client_ca (mTLS); the certificate
//! rotated by `inferd reload` and by SIGHUP under a keep-alive load with no failed request;
//! files that cannot be used refused at start and at reload, the pool keeping its certificate.
//! Certificates are made here (rcgen): a CA per test, and a leaf for `localhost`/127.0.0.1.

use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// A certificate authority of one test.
pub(crate) struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Ca {
    pub(crate) fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        Ca { issuer: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap() }
    }

    fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A certificate for localhost and 127.0.0.1 (a server's, or a client's): (chain, key).
    fn leaf(&self, name: &str) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// Writes this CA's leaf as `<name>.pem` and `<name>.key` (mode 0600) in `dir`.
    pub(crate) fn write_leaf(&self, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let (cert, key) = self.leaf(name);
        let (cert_file, key_file) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
        std::fs::write(&cert_file, cert).unwrap();
        write_private(&key_file, &key);
        (cert_file, key_file)
    }

    pub(crate) fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, self.pem()).unwrap();
        path
    }
}

fn write_private(path: &Path, text: &str) {
    // Replaced by a rename, as a deployment tool would: a reader never sees half a file.
    let partial = path.with_extension("partial");
    std::fs::write(&partial, text).unwrap();
    std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::rename(&partial, path).unwrap();
}

/// A TLS client trusting `roots`, presenting `identity` (chain, key) when given.
fn client(roots: &[&Ca], identity: Option<&(String, String)>) -> Arc<rustls::ClientConfig> {
    let mut store = rustls::RootCertStore::empty();
    for ca in roots {
        store.add(CertificateDer::from_pem_slice(ca.pem().as_bytes()).unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(store);
    let mut config = match identity {
        Some((chain, key)) => builder
            .with_client_auth_cert(
                CertificateDer::pem_slice_iter(chain.as_bytes()).collect::<Result<Vec<_>, _>>().unwrap(),
                PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

/// HTTP over a TLS session (the shared client of tests/common, on a rustls stream).
type Tls = Connection<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>;

fn connect(addr: SocketAddr, config: &Arc<rustls::ClientConfig>) -> std::io::Result<Tls> {
    let tcp = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    tcp.set_read_timeout(Some(Duration::from_secs(60)))?;
    let name = ServerName::try_from("localhost").unwrap();
    let connection = rustls::ClientConnection::new(config.clone(), name).map_err(std::io::Error::other)?;
    let mut tls = rustls::StreamOwned::new(connection, tcp);
    // The handshake now, so that its failure is this call's.
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock)?;
    }
    Ok(Connection::over(tls, "localhost"))
}

/// One request on a connection of its own.
fn https(addr: SocketAddr, config: &Arc<rustls::ClientConfig>, path: &str, body: &[u8]) -> std::io::Result<Response> {
    connect(addr, config)?.post(path, body)
}

const EMBED: &[u8] = br#"{"inputs": "hello"}"#;

/// minilm on HTTPS and gRPC over TLS with `cert.pem`/`cert.key` of `ca` in the test folder,
/// `extra` appended to the config ([server] continues first).
fn start(tag: &str, ca: &Ca, extra: &str) -> (Server, SocketAddr) {
    let dir = temp_dir(tag);
    ca.write_leaf(dir.path(), "cert");
    let repository = model_repository(dir.path(), &["minilm"]);
    let port = free_port();
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let extra = format!("grpc_listen = \"{grpc}\"\ntls_cert = \"cert.pem\"\ntls_key = \"cert.key\"\n{extra}");
    write_config(dir.path(), port, 2, &repository, "minilm", &[], &extra);
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(90));
    (server, grpc)
}

fn run(mut command: Command) -> (bool, String) {
    let out = command.output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

fn reload(server: &Server) -> (bool, String) {
    let mut command = Command::new(BIN);
    command.args(["reload", "--wait", "--control-socket"]).arg(&server.socket);
    run(command)
}

fn curl() -> Option<&'static str> {
    let found = Command::new("curl").arg("--version").output().is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("SKIPPED: the curl checks (no curl on this machine); the other clients ran");
    }
    found.then_some("curl")
}

#[test]
fn https_and_grpc_over_tls_serve_the_real_clients() {
    let (ca, stranger) = (Ca::new("inferd test CA"), Ca::new("another CA"));
    let (server, grpc) = start("tls-serve", &ca, "");
    let dir = server.dir.path().to_path_buf();
    let ca_file = ca.write(&dir, "ca.pem");
    let port = server.addr.port();

    let answer = https(server.addr, &client(&[&ca], None), "/embed", EMBED).unwrap();
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    let vectors: Vec<Vec<f32>> = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(vectors[0].len(), 384);
    // A client that does not trust the certificate's CA cannot connect.
    let err = connect(server.addr, &client(&[&stranger], None)).err().expect("an untrusted certificate");
    assert!(err.to_string().contains("certificate"), "{err}");
    // Plain HTTP on the TLS port is told what to do, in plain HTTP, every time (its body is
    // read before the socket closes, so no reset can cut the answer off).
    for _ in 0..20 {
        let plain = request(server.addr, "POST", "/embed", &[], EMBED).unwrap();
        assert_eq!(plain.status, 400);
        let text = String::from_utf8_lossy(&plain.body);
        assert!(text.contains("speaks TLS"), "{text}");
    }

    if let Some(curl) = curl() {
        let mut command = Command::new(curl);
        command.args(["-sS", "--fail", "--cacert"]).arg(&ca_file);
        command.args(["-d", "{\"inputs\": \"hello\"}", &format!("https://localhost:{port}/embed")]);
        let (ok, out) = run(command);
        assert!(ok && out.starts_with("[["), "curl over https: {out}");
    }
    let grpc = format!("localhost:{}", grpc.port());
    let ca_path = ca_file.to_string_lossy();
    client_check("tls_check.py", &[&format!("localhost:{port}"), &grpc, &ca_path], &server, "tls: all checks passed");

    let mut command = Command::new(BIN);
    command.args(["check", "--config"]).arg(dir.join("inferd.toml"));
    let (ok, out) = run(command);
    assert!(ok && out.contains("tls:") && out.contains("cert.pem (HTTP/1.1 and gRPC)"), "{out}");
}

#[test]
fn client_certificates_are_required_with_a_client_ca() {
    let (ca, clients, stranger) = (Ca::new("server CA"), Ca::new("client CA"), Ca::new("another CA"));
    let dir_ca = temp_dir("tls-mtls-ca");
    let client_ca = clients.write(dir_ca.path(), "clients.pem");
    let (server, grpc) = start("tls-mtls", &ca, &format!("tls_client_ca = \"{}\"", client_ca.display()));
    let dir = server.dir.path().to_path_buf();

    let identity = clients.leaf("client");
    let answer = https(server.addr, &client(&[&ca], Some(&identity)), "/embed", EMBED).unwrap();
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    // Without a certificate, or with one another CA signed: no answer. (In TLS 1.3 the client
    // learns of the refusal at its first read.)
    for identity in [None, Some(stranger.leaf("intruder"))] {
        let refused = https(server.addr, &client(&[&ca], identity.as_ref()), "/embed", EMBED);
        assert!(refused.is_err(), "served without an accepted client certificate");
    }

    let ca_file = ca.write(&dir, "ca.pem");
    let (cert, key) = clients.write_leaf(&dir, "client");
    let port = server.addr.port();
    if let Some(curl) = curl() {
        for with_cert in [true, false] {
            let mut command = Command::new(curl);
            command.args(["-sS", "--fail", "--cacert"]).arg(&ca_file);
            if with_cert {
                command.arg("--cert").arg(&cert).arg("--key").arg(&key);
            }
            command.args(["-d", "{\"inputs\": \"hello\"}", &format!("https://localhost:{port}/embed")]);
            let (ok, out) = run(command);
            assert_eq!(ok, with_cert, "curl, client certificate {with_cert}: {out}");
        }
    }
    let grpc = format!("localhost:{}", grpc.port());
    let paths = [ca_file, cert, key].map(|p| p.to_string_lossy().into_owned());
    let mut args = vec![format!("localhost:{port}"), grpc];
    args.extend(paths);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    client_check("tls_check.py", &args, &server, "tls: all checks passed");
}

#[test]
fn the_certificate_rotates_by_reload_and_sighup_under_load_with_no_failed_request() {
    let (old, new) = (Ca::new("old CA"), Ca::new("new CA"));
    let (server, _) = start("tls-rotate", &old, "");
    let dir = server.dir.path().to_path_buf();
    // The load's clients trust both CAs and keep their connections alive, as a pool does, with
    // pauses of up to 30 ms between requests: a connection is often idle when its worker
    // retires. They do not look whether the server closed a connection before reusing it (as
    // some clients do not): a connection closed while idle would fail their next request.
    let both = client(&[&old, &new], None);
    let load = Clients::start(3, |_| {
        let (config, addr) = (both.clone(), server.addr);
        let (mut connection, mut round): (Option<Tls>, u64) = (None, 0);
        move || {
            round += 1;
            std::thread::sleep(Duration::from_millis(round * 7 % 31));
            let result = match connection.take() {
                Some(tls) => Ok(tls),
                None => connect(addr, &config),
            }
            .and_then(|mut tls| tls.post("/embed", EMBED).map(|a| (tls, a)));
            match result {
                Ok((tls, answer)) if answer.status == 200 => {
                    // Kept unless the server announced it closes.
                    connection = (!answer.closes()).then_some(tls);
                    Step::Served
                }
                Ok((_, answer)) => {
                    Step::Failed(format!("{}: {}", answer.status, String::from_utf8_lossy(&answer.body)))
                }
                Err(e) => Step::Failed(e.to_string()),
            }
        }
    });
    // New connections are served with the new certificate once the server's chain is `ca`'s.
    let served_by = |ca: &Ca| https(server.addr, &client(&[ca], None), "/embed", EMBED).is_ok_and(|a| a.status == 200);
    let wait_for = |ca: &Ca, what: &str| {
        let started = Instant::now();
        while !served_by(ca) {
            assert!(started.elapsed() < Duration::from_secs(30), "{what}: not served after 30 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    std::thread::sleep(Duration::from_millis(500));
    new.write_leaf(&dir, "cert");
    let (ok, said) = reload(&server);
    assert!(ok, "{said}");
    wait_for(&new, "the reloaded certificate");
    // A retired worker may take a connection for a few ms while it leaves the port: bounded.
    let started = Instant::now();
    while served_by(&old) {
        assert!(started.elapsed() < Duration::from_secs(20), "the old certificate still served after the reload");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(500));
    // SIGHUP is a reload too.
    old.write_leaf(&dir, "cert");
    server.signal(nix::sys::signal::Signal::SIGHUP);
    wait_for(&old, "the certificate after SIGHUP");
    std::thread::sleep(Duration::from_millis(500));
    let tally = load.stop();
    tally.assert_served(20, "through two certificate rotations");
    eprintln!("two certificate rotations under load: {} requests, 0 failed", tally.served);

    // A key that is not the certificate's refuses the reload; the pool keeps serving. (Once
    // SIGHUP's reload has replaced every worker: one reload at a time.)
    let started = Instant::now();
    while server.try_status().is_none_or(|s| s["phase"] != "ready") {
        assert!(started.elapsed() < Duration::from_secs(60), "SIGHUP's reload not done after 60 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (_, other_key) = new.leaf("other");
    write_private(&dir.join("cert.key"), &other_key);
    let (ok, said) = reload(&server);
    assert!(!ok && said.contains("reload refused") && said.contains("server.tls_key"), "{said}");
    assert!(served_by(&old), "the pool keeps its certificate");
}

#[test]
fn the_admin_listener_has_its_own_certificate() {
    let (public, admin) = (Ca::new("public CA"), Ca::new("admin CA"));
    let dir = temp_dir("tls-admin");
    admin.write_leaf(dir.path(), "admin");
    public.write_leaf(dir.path(), "cert");
    let port = free_port();
    let repository = model_repository(dir.path(), &["minilm"]);
    let config = write_config(
        dir.path(),
        port,
        1,
        &repository,
        "minilm",
        &[],
        "tls_cert = \"cert.pem\"\ntls_key = \"cert.key\"",
    );
    // The [admin] section write_config wrote gains the listener's own files.
    let text = std::fs::read_to_string(&config).unwrap();
    let text = text.replacen("[admin]\n", "[admin]\ntls_cert = \"admin.pem\"\ntls_key = \"admin.key\"\n", 1);
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(90));
    let admin_addr = server.admin_addr();
    let metrics = |ca: &Ca| connect(admin_addr, &client(&[ca], None))?.send("GET", "/metrics", &[], b"");
    let answer = metrics(&admin).unwrap();
    assert!(answer.status == 200 && String::from_utf8_lossy(&answer.body).contains("inferd_requests_total"));
    assert!(metrics(&public).is_err(), "the admin listener serves its own certificate, not the public port's");
    // Its files are looked at again for each connection: a new certificate counts at once.
    let renewed = Ca::new("renewed admin CA");
    renewed.write_leaf(server.dir.path(), "admin");
    assert_eq!(metrics(&renewed).unwrap().status, 200);
    // One that cannot be used is logged, and the last good one stays.
    std::fs::write(server.dir.path().join("admin.pem"), "not a certificate\n").unwrap();
    assert_eq!(metrics(&renewed).unwrap().status, 200);
    // The supervisor's log reaches the test through a pipe: the warning may show a moment later.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !server.log().contains("keeping the previous certificate") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(server.log().contains("keeping the previous certificate"), "{}", server.log());
}

#[test]
fn tls_files_that_cannot_be_used_refuse_the_start() {
    let ca = Ca::new("inferd test CA");
    let dir = temp_dir("tls-refused");
    let (_, key) = ca.write_leaf(dir.path(), "cert");
    let check = |extra: &str| {
        let config = write_config(dir.path(), free_port(), 1, &test_models(), "typed", &[], extra);
        let mut command = Command::new(BIN);
        command.args(["check", "--config"]).arg(config);
        run(command)
    };
    let (ok, out) = check("tls_cert = \"cert.pem\"");
    assert!(!ok && out.contains("server.tls_key"), "{out}");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (ok, out) = check("tls_cert = \"cert.pem\"\ntls_key = \"cert.key\"");
    assert!(!ok && out.contains("server.tls_key") && out.contains("mode 644"), "{out}");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (ok, out) = check("tls_cert = \"cert.key\"\ntls_key = \"cert.key\"");
    assert!(!ok && out.contains("server.tls_cert") && out.contains("no CERTIFICATE"), "{out}");
    let (ok, out) = check("tls_cert = \"cert.pem\"\ntls_key = \"cert.key\"");
    assert!(ok && out.contains("tls:"), "{out}");
}
