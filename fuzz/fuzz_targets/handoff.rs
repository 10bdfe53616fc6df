//! A hand-off message as a sibling receives it (the tag and the bytes the retiring worker had
//! read, with how many descriptors came and whether it was cut), then the connection read
//! through `Prefixed` in reads of varying size: the bytes come back whole and in order, and
//! what is left of the prefix after a partial read is exactly what was not read.
#![no_main]

use inferd_worker::http::handoff::{prefix, Prefixed};
use tokio::io::AsyncReadExt;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let [flags, split, chunk, data @ ..] = data else { return };
    let (descriptors, truncated) = (usize::from(flags & 3), flags & 4 != 0);
    let (message, rest) = data.split_at(usize::from(*split).min(data.len()));
    let Some(read) = prefix(message, descriptors, truncated) else { return };
    assert!(descriptors == 1 && !truncated && read.len() + 1 == message.len());
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    runtime.block_on(async {
        let chunk = usize::from(*chunk).max(1);
        let mut stream = Prefixed::new(read.to_vec(), rest);
        let mut got = Vec::new();
        let mut buf = vec![0u8; chunk];
        // Part of the prefix first: what is left of it is the rest, unread.
        let n = stream.read(&mut buf).await.unwrap();
        got.extend_from_slice(&buf[..n]);
        let (inner, left) = stream.into_parts();
        if n <= read.len() {
            assert_eq!(left, &read[n..]);
        }
        let mut stream = Prefixed::new(left, inner);
        loop {
            let n = stream.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, [read, rest].concat());
    });
});
