//! The one HTTP/1.1 client of the tests, `inferd tune` and the benchmarks: enough HTTP for a
//! server whose answers carry a Content-Length (or end with the connection), on keep-alive
//! connections or one request per connection.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

/// How long a connect may take, and a read wait (a model run, a drain) before it is an error.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// An answer, read whole.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The server said `Connection: close`: the next request needs a new connection.
    pub fn closes(&self) -> bool {
        self.header("connection").is_some_and(|v| v.eq_ignore_ascii_case("close"))
    }

    /// The duration of `metric` in `Server-Timing` (`prepare;dur=0.41, ...`), in ms.
    pub fn server_timing(&self, metric: &str) -> Option<f64> {
        let prefix = format!("{metric};dur=");
        self.header("server-timing")?.split(',').find_map(|m| m.trim().strip_prefix(prefix.as_str())?.parse().ok())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// The `error` message of a JSON error body (KServe v2's and inferd's own shape).
    pub fn error(&self) -> String {
        let body = self.json();
        body["error"].as_str().unwrap_or_else(|| panic!("no error message in {body:?}")).to_string()
    }
}

/// One HTTP/1.1 connection, over TCP or a stream on top of it (TLS); requests on it are sent
/// one after another (keep-alive).
pub struct Connection<S: Read + Write = TcpStream> {
    reader: BufReader<S>,
    host: String,
}

impl Connection {
    pub fn open(addr: impl ToSocketAddrs) -> std::io::Result<Connection> {
        let addr: SocketAddr = addr
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "no address"))?;
        let stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(READ_TIMEOUT))?;
        Ok(Connection::over(stream, &addr.to_string()))
    }
}

impl<S: Read + Write> Connection<S> {
    /// HTTP on `stream`, already connected to `host` (the Host header).
    pub fn over(stream: S, host: &str) -> Connection<S> {
        Connection { reader: BufReader::new(stream), host: host.to_string() }
    }

    /// A POST of a JSON body.
    pub fn post(&mut self, path: &str, body: &[u8]) -> std::io::Result<Response> {
        self.send("POST", path, &[("Content-Type", "application/json")], body)
    }

    /// Sends one request and reads its answer. A `Content-Length` header is added unless
    /// `headers` has one (a test may send a wrong one on purpose).
    pub fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> std::io::Result<Response> {
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\n", self.host);
        if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-length")) {
            head.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let stream = self.reader.get_mut();
        stream.write_all(head.as_bytes())?;
        stream.write_all(body)?;
        stream.flush()?;
        self.read_response()
    }

    fn read_response(&mut self) -> std::io::Result<Response> {
        let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            // Distinct from a partial answer: the server closed without answering at all.
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "connection closed before any response",
            ));
        }
        let status =
            line.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad(format!("status line {line:?}")))?;
        let mut headers = Vec::new();
        loop {
            line.clear();
            if self.reader.read_line(&mut line)? == 0 {
                return Err(bad("closed inside the answer's head".into()));
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                headers.push((k.trim().to_string(), v.trim().to_string()));
            }
        }
        let mut response = Response { status, headers, body: Vec::new() };
        match response.header("content-length") {
            Some(length) => {
                let length: usize = length.parse().map_err(|_| bad(format!("Content-Length {length:?}")))?;
                response.body.resize(length, 0);
                self.reader.read_exact(&mut response.body).map_err(|e| match e.kind() {
                    std::io::ErrorKind::UnexpectedEof => bad(format!("truncated body (of {length} bytes)")),
                    _ => e,
                })?;
            }
            // Without a length the answer ends with the connection.
            None => drop(self.reader.read_to_end(&mut response.body)?),
        }
        Ok(response)
    }
}

/// One request on a new connection (`Connection: close`).
pub fn request(
    addr: impl ToSocketAddrs,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Response> {
    let mut all = headers.to_vec();
    all.push(("Connection", "close"));
    Connection::open(addr)?.send(method, path, &all, body)
}
