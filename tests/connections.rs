//! Keep-alive connections are handed back to the kernel after `max_requests_per_connection`
//! requests, announced with `Connection: close`, so that SO_REUSEPORT places the client's
//! next connection afresh.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn a_connection_is_closed_after_its_requests_with_notice() {
    let server = serve(temp_dir("connections"), 1, &test_models(), "typed", &[], "max_requests_per_connection = 3");

    // The keep-alive client of inferd-bench and inferd tune, which reads `Connection: close`.
    let mut connection = Connection::open(server.addr).unwrap();
    let body = typed_request();
    let path = "/v2/models/typed/infer";
    for _ in 0..2 {
        let answer = connection.post(path, &body).unwrap();
        assert_eq!((answer.status, answer.closes()), (200, false));
    }
    // The third answer says so, and the server then closes its side.
    let answer = connection.post(path, &body).unwrap();
    assert_eq!((answer.status, answer.closes()), (200, true));
    assert!(connection.post(path, &body).is_err(), "nothing after the announced close");
    // A new connection is served as usual.
    assert_eq!(server.request("POST", "/v2/models/typed/infer", &body).status, 200);
}

/// Sends one request on `stream` and reads its answer: (status, headers lower-cased).
fn exchange(stream: &mut std::net::TcpStream, extra: &str, body: &[u8]) -> std::io::Result<(u16, Vec<String>)> {
    use std::io::{BufRead, BufReader, Read, Write};
    let head =
        format!("POST /v2/models/typed/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n{extra}\r\n", body.len());
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    let status = line.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let mut headers = Vec::new();
    loop {
        line.clear();
        reader.read_line(&mut line)?;
        if line.trim().is_empty() {
            break;
        }
        headers.push(line.trim().to_ascii_lowercase());
    }
    let length: usize = headers.iter().find_map(|h| h.strip_prefix("content-length:")).unwrap().trim().parse().unwrap();
    reader.read_exact(&mut vec![0; length])?;
    Ok((status, headers))
}

#[test]
fn an_answer_before_the_body_is_read_says_the_connection_closes() {
    let server = serve(temp_dir("unread-body"), 1, &test_models(), "typed", &[], "");
    let body = typed_request();
    let mut stream = std::net::TcpStream::connect(server.addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();

    // A 400 found after the body was read keeps the connection: the next request is served.
    let (status, headers) = exchange(&mut stream, "", b"{\"inputs\": []}").unwrap();
    assert_eq!(status, 400);
    assert!(!headers.contains(&"connection: close".to_string()), "{headers:?}");
    assert_eq!(exchange(&mut stream, "", &body).unwrap().0, 200, "the connection was kept");

    // A 400 answered before the body is read (a bad binary-header length): the server cannot
    // reuse the connection, and says so, so the client opens a new one for its next request.
    let (status, headers) = exchange(&mut stream, "Inference-Header-Content-Length: x\r\n", &body).unwrap();
    assert_eq!(status, 400);
    assert!(headers.contains(&"connection: close".to_string()), "no Connection: close: {headers:?}");
    assert_eq!(server.request("POST", "/v2/models/typed/infer", &body).status, 200);
}
