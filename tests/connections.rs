//! Keep-alive connections are handed back to the kernel, announced with `Connection: close`,
//! so that SO_REUSEPORT places the client's next connection afresh: after
//! `max_requests_per_connection` requests, and while a worker holds two or more connections
//! beyond its sibling's (`balance_connections`).

use std::time::Duration;

use crate::common::*;

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

/// The kernel places each connection on a worker at random; a worker with two or more beyond
/// its sibling's announces `Connection: close` on its next answer, and the client's next
/// connection is placed afresh. The client here holds every connection to the server, so it
/// knows what each worker counts: every answer must announce a close exactly when its worker
/// holds two more than the other (no other reason applies: no request limit), and once a
/// round of requests goes by without one, the connections are spread within one.
#[test]
fn connections_piled_on_one_worker_are_spread_over_both() {
    let server = serve(temp_dir("balance"), 2, &test_models(), "typed", &[], "max_requests_per_connection = 0");
    // The live connections, each with the worker that answered on it last (None: not asked yet).
    let mut live: Vec<(Connection, Option<usize>)> = Vec::new();
    let held = |live: &[(Connection, Option<usize>)], w: usize| live.iter().filter(|(_, at)| *at == Some(w)).count();
    // Asks on connection `i`, checks the answer against what each worker holds, and drops the
    // connection when it is told to close; returns whether it was.
    let ask = |live: &mut Vec<(Connection, Option<usize>)>, i: usize| -> bool {
        let answer = live[i].0.post("/v2/models/typed/infer", &typed_request()).unwrap();
        assert_eq!(answer.status, 200);
        let worker: usize = answer.header("x-inferd-worker").unwrap().parse().unwrap();
        live[i].1 = Some(worker);
        let (mine, other) = (held(live, worker), held(live, 1 - worker));
        assert_eq!(answer.closes(), mine >= other + 2, "worker {worker} holds {mine}, its sibling {other}");
        if answer.closes() {
            live.remove(i);
        }
        answer.closes()
    };
    // Up to ten connections, opened one after another and each asked once: those placed where
    // the other worker has fewer are closed, and replaced. Returns the closes.
    let fill = |live: &mut Vec<(Connection, Option<usize>)>| {
        let mut closes = 0;
        while live.len() < 10 {
            live.push((Connection::open(server.addr).unwrap(), None));
            closes += ask(live, live.len() - 1) as usize;
        }
        closes
    };
    let mut closes = fill(&mut live);
    // Rounds over every connection until one goes by without a close.
    let mut rounds = 0;
    loop {
        rounds += 1;
        assert!(rounds <= 200, "still closing connections after 200 rounds");
        let (before, mut i) = (closes, 0);
        while i < live.len() {
            match ask(&mut live, i) {
                true => closes += 1,
                false => i += 1,
            }
        }
        closes += fill(&mut live);
        if closes == before {
            break;
        }
    }
    let (on0, on1) = (held(&live, 0), held(&live, 1));
    assert!(on0.abs_diff(on1) <= 1, "spread {on0} / {on1}");
    eprintln!("10 connections spread {on0} / {on1} after {closes} closes and {rounds} rounds");
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
