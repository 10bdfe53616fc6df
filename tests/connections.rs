//! Keep-alive connections are handed back to the kernel after `max_requests_per_connection`
//! requests, announced with `Connection: close`, so that SO_REUSEPORT places the client's
//! next connection afresh.

mod common;

use std::time::Duration;

use common::*;
use inferd_bench::load::Connection;

#[test]
fn a_connection_is_closed_after_its_requests_with_notice() {
    let dir = TempDir::new("connections");
    let port = free_port();
    write_config(dir.path(), port, 1, &test_models(), "typed", &[], "max_requests_per_connection = 3");
    let mut server = Server::start(dir, port, &[]);
    server.wait_ready(Duration::from_secs(60));

    // The keep-alive client of inferd-bench and inferd tune, which reads `Connection: close`.
    let addr = server.addr.to_string();
    let mut connection = Connection::open(&addr).unwrap();
    let body = typed_request();
    let path = "/v2/models/typed/infer";
    for _ in 0..2 {
        let answer = connection.post(&addr, path, &body).unwrap();
        assert_eq!((answer.status, answer.close), (200, false));
    }
    // The third answer says so, and the server then closes its side.
    let answer = connection.post(&addr, path, &body).unwrap();
    assert_eq!((answer.status, answer.close), (200, true));
    assert!(connection.post(&addr, path, &body).is_err(), "nothing after the announced close");
    // A new connection is served as usual.
    assert_eq!(server.request("POST", "/v2/models/typed/infer", &body).status, 200);
}
