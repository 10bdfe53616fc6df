//! Keep-alive connections are handed back to the kernel after `max_requests_per_connection`
//! requests, announced with `Connection: close`, so that SO_REUSEPORT places the client's
//! next connection afresh.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;

/// Sends one request on `stream` and reads its response: (status, connection header).
fn exchange(reader: &mut BufReader<TcpStream>, body: &[u8]) -> (u16, Option<String>) {
    let head = format!("POST /v2/models/typed/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", body.len());
    reader.get_mut().write_all(head.as_bytes()).unwrap();
    reader.get_mut().write_all(body).unwrap();
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let status = line.split(' ').nth(1).unwrap().parse().unwrap();
    let (mut length, mut connection) = (0, None);
    loop {
        line.clear();
        reader.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l.split_once(':').unwrap();
        if k.eq_ignore_ascii_case("content-length") {
            length = v.trim().parse().unwrap();
        } else if k.eq_ignore_ascii_case("connection") {
            connection = Some(v.trim().to_ascii_lowercase());
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    (status, connection)
}

#[test]
fn a_connection_is_closed_after_its_requests_with_notice() {
    let dir = TempDir::new("connections");
    let port = free_port();
    write_config(dir.path(), port, 1, &test_models(), "typed", &[], "max_requests_per_connection = 3");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));

    let stream = TcpStream::connect(server.addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut reader = BufReader::new(stream);
    let body = typed_request();
    assert_eq!(exchange(&mut reader, &body), (200, None));
    assert_eq!(exchange(&mut reader, &body), (200, None));
    // The third answer says so, and the server then closes its side.
    assert_eq!(exchange(&mut reader, &body), (200, Some("close".into())));
    let mut rest = Vec::new();
    assert_eq!(reader.read_to_end(&mut rest).unwrap(), 0, "nothing after the announced close");
    // A new connection is served as usual.
    assert_eq!(server.request("POST", "/v2/models/typed/infer", &body).status, 200);
}
