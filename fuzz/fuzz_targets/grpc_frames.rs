//! A gRPC client's bytes read through `ShutdownFrames`, cut into reads of varying size on
//! both sides: what h2 reads is what one scan of the whole gives, as long as the input,
//! changed only in the type byte of the WINDOW_UPDATE frames it hid, and nothing is hidden
//! unless the bytes carry h2's shutdown PING payload.
#![no_main]

use inferd_worker::http::grpc::shutdown::{Frames, ShutdownFrames, H2_SHUTDOWN_PING};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let [step, chunk, data @ ..] = data else { return };
    let mut whole = data.to_vec();
    let mut frames = Frames::new();
    let decided = frames.scan(&mut whole);
    assert!(data.len() - decided < 9);
    let changed = (0..data.len()).filter(|&i| whole[i] != data[i]).count();
    assert_eq!(changed as u64, frames.hidden);
    assert!(frames.hidden == 0 || data.windows(8).any(|w| w == H2_SHUTDOWN_PING));
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    runtime.block_on(async {
        let (mut near, far) = tokio::io::duplex(usize::from(*step).max(1));
        let input = data.to_vec();
        let writer = tokio::spawn(async move { near.write_all(&input).await.unwrap() });
        let mut socket = ShutdownFrames::new(far);
        let mut got = Vec::new();
        let mut buf = vec![0u8; usize::from(*chunk).max(1)];
        loop {
            let n = socket.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        writer.await.unwrap();
        assert_eq!(got, whole);
    });
});
