//! HTTP's content codings, both ways.
//!
//! Request bodies sent compressed (`Content-Encoding: gzip` or `deflate`, as
//! `tritonclient.http` sends them with `request_compression_algorithm`): inflated before they
//! are read, within the same `server.max_body_bytes` as a plain body. The limit applies to the
//! inflated bytes, and inflating stops one byte past it: a small body that would inflate to
//! gigabytes (a decompression bomb) costs at most the limit, and is refused with 413.
//!
//! Answers compressed where the client asks (`Accept-Encoding`, as `tritonclient.http` sends it
//! with `response_compression_algorithm`): [`Encoding::accepted`] picks the coding,
//! [`Encoding::encode`] writes it (the answer's side is [`crate::http::compress`]).
// Sizes here come from request data: every operation on them is checked.
#![deny(clippy::arithmetic_side_effects)]

use std::io::Read;

/// How a request body was encoded, from its `Content-Encoding`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Identity,
    Gzip,
    /// HTTP's `deflate`: zlib's format (RFC 1950), what tritonclient and browsers send.
    Deflate,
}

/// Why a body could not be inflated.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("Content-Encoding '{0}' is not supported; send gzip, deflate or no encoding")]
    Unsupported(String),
    #[error("the request body inflates to more than the limit of {0} bytes (server.max_body_bytes)")]
    TooLarge(u64),
    /// The caller had no room for more of it (its share of the worker's body budget).
    #[error("the request body inflates to more than this worker has room for now")]
    NoRoom,
    #[error("the request body is not valid {encoding}: {message}")]
    Corrupt { encoding: &'static str, message: String },
}

/// Why an answer could not be compressed (it is then sent as it is).
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    #[error("compressing the answer with {encoding}: {source}")]
    Write {
        encoding: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("a compressed gRPC message of {0} bytes does not fit the frame's 32-bit length")]
    FrameTooLarge(usize),
}

/// The level answers are compressed at: flate2's fastest. Measured with zlib on 64 embeddings
/// of 384 floats as JSON (540 KB): level 1 gives 2.17x at 41 MB/s, level 6 (the default)
/// 2.35x at 13 MB/s; three times the CPU for 8% fewer bytes is not worth a worker's cores.
/// (Binary FP32 tensors give 1.08x at any level.)
const LEVEL: flate2::Compression = flate2::Compression::fast();

impl Encoding {
    /// The name of this coding in `Content-Encoding` and `grpc-encoding` (`identity` for none).
    pub fn name(self) -> &'static str {
        match self {
            Encoding::Identity => "identity",
            Encoding::Gzip => "gzip",
            Encoding::Deflate => "deflate",
        }
    }

    /// The coding to answer with, from the request's `Accept-Encoding` values (RFC 9110
    /// section 12.5.3): gzip or deflate, whichever has the higher q-value (gzip when equal), `*`
    /// standing for either when it is not named; `q=0` is "not acceptable". Identity when
    /// neither is acceptable, when no header asks, or when `identity` itself is named with a
    /// higher q-value than both. An element that cannot be parsed is ignored.
    pub fn accepted<'a>(values: impl IntoIterator<Item = &'a str>) -> Encoding {
        let (mut gzip, mut deflate, mut any, mut identity) = (None, None, None, None);
        for element in values.into_iter().flat_map(|v| v.split(',')) {
            let mut parts = element.split(';');
            let coding = parts.next().unwrap_or_default().trim().to_ascii_lowercase();
            let mut q = Some(1000);
            for param in parts {
                if let Some((name, value)) = param.split_once('=') {
                    if name.trim().eq_ignore_ascii_case("q") {
                        q = qvalue(value.trim());
                    }
                }
            }
            let Some(q) = q else { continue };
            match coding.as_str() {
                "gzip" | "x-gzip" => gzip = Some(q),
                "deflate" => deflate = Some(q),
                "*" => any = Some(q),
                "identity" => identity = Some(q),
                _ => {}
            }
        }
        let (gzip, deflate) = (gzip.or(any).unwrap_or(0), deflate.or(any).unwrap_or(0));
        let (best, q) = match deflate > gzip {
            true => (Encoding::Deflate, deflate),
            false => (Encoding::Gzip, gzip),
        };
        match q > 0 && identity.is_none_or(|identity| identity <= q) {
            true => best,
            false => Encoding::Identity,
        }
    }

    /// `data` compressed in this coding, appended to `out`; identity appends it as it is. Gzip
    /// is RFC 1952, deflate zlib's format (RFC 1950) as HTTP's `deflate` and gRPC's mean it.
    pub fn encode(self, data: &[u8], out: Vec<u8>) -> Result<Vec<u8>, EncodeError> {
        use std::io::Write;
        let write = |e: std::io::Error| EncodeError::Write { encoding: self.name(), source: e };
        match self {
            Encoding::Identity => {
                let mut out = out;
                out.extend_from_slice(data);
                Ok(out)
            }
            Encoding::Gzip => {
                let mut encoder = flate2::write::GzEncoder::new(out, LEVEL);
                encoder.write_all(data).map_err(write)?;
                encoder.finish().map_err(write)
            }
            Encoding::Deflate => {
                let mut encoder = flate2::write::ZlibEncoder::new(out, LEVEL);
                encoder.write_all(data).map_err(write)?;
                encoder.finish().map_err(write)
            }
        }
    }

    /// The most bytes `len` bytes take compressed in this coding: zlib's `compressBound`
    /// (`len + len/4096 + len/16384 + 13`, stored blocks at worst) rounded up, with room for
    /// gzip's larger header and trailer.
    pub fn bound(len: u64) -> u64 {
        len.saturating_add(len / 1024).saturating_add(64)
    }

    /// The encoding a `Content-Encoding` value names (one coding; `identity` or none is plain).
    pub fn from_header(value: Option<&str>) -> Result<Encoding, DecodeError> {
        let Some(value) = value.map(str::trim).filter(|v| !v.is_empty()) else {
            return Ok(Encoding::Identity);
        };
        match value.to_ascii_lowercase().as_str() {
            "identity" => Ok(Encoding::Identity),
            "gzip" | "x-gzip" => Ok(Encoding::Gzip),
            "deflate" => Ok(Encoding::Deflate),
            _ => Err(DecodeError::Unsupported(value.chars().take(40).collect())),
        }
    }

    /// `body` inflated, at most `limit` bytes of it. `room` is asked before each mebibyte the
    /// output may hold ([`GROWTH`]); where it says no, inflating stops ([`DecodeError::NoRoom`]).
    pub fn decode(self, body: &[u8], limit: u64, mut room: impl FnMut(u64) -> bool) -> Result<Vec<u8>, DecodeError> {
        let (reader, encoding): (Box<dyn Read + '_>, &'static str) = match self {
            Encoding::Identity => return Ok(body.to_vec()),
            Encoding::Gzip => (Box::new(flate2::read::MultiGzDecoder::new(body)), "gzip"),
            Encoding::Deflate => (Box::new(flate2::read::ZlibDecoder::new(body)), "deflate (zlib)"),
        };
        let mut reader = reader.take(limit.saturating_add(1));
        let mut out = Vec::new();
        loop {
            if !room(GROWTH) {
                return Err(DecodeError::NoRoom);
            }
            let read = (&mut reader)
                .take(GROWTH)
                .read_to_end(&mut out)
                .map_err(|e| DecodeError::Corrupt { encoding, message: e.to_string() })?;
            if (read as u64) < GROWTH {
                break;
            }
        }
        if out.len() as u64 > limit {
            return Err(DecodeError::TooLarge(limit));
        }
        Ok(out)
    }
}

/// The steps an inflated body grows by, each asked of the caller first.
pub const GROWTH: u64 = 1 << 20;

/// A q-value (`0`, `0.5`, `1`, `1.000`) in thousandths; None when it is not one.
fn qvalue(text: &str) -> Option<u16> {
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    if fraction.len() > 3 || !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let thousandths = format!("{fraction:0<3}").parse::<u16>().ok()?;
    match whole {
        "0" => Some(thousandths),
        "1" if thousandths == 0 => Some(1000),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn bodies_inflate_within_the_limit_and_a_bomb_stops_at_it() {
        let text = b"{\"inputs\": \"hello\"}".repeat(100);
        assert_eq!(Encoding::Gzip.decode(&gzip(&text), 1 << 20, |_| true).unwrap(), text);
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        z.write_all(&text).unwrap();
        assert_eq!(Encoding::Deflate.decode(&z.finish().unwrap(), 1 << 20, |_| true).unwrap(), text);
        // 64 MiB of zeros gzip to ~64 KiB: refused at a 1 MiB limit, having inflated 1 MiB.
        let bomb = gzip(&vec![0u8; 64 << 20]);
        assert!(bomb.len() < 100 << 10);
        assert!(matches!(Encoding::Gzip.decode(&bomb, 1 << 20, |_| true), Err(DecodeError::TooLarge(_))));
        assert!(matches!(Encoding::Gzip.decode(b"not gzip", 1 << 20, |_| true), Err(DecodeError::Corrupt { .. })));
        // Room is asked a mebibyte at a time: a bomb stops where the caller's room does.
        let mut asked = 0;
        let no_room = Encoding::Gzip.decode(&bomb, 64 << 20, |n| {
            asked += n;
            asked <= 2 * GROWTH
        });
        assert!(matches!(no_room, Err(DecodeError::NoRoom)), "{no_room:?}");
        assert_eq!(asked, 3 * GROWTH);
        assert!(matches!(Encoding::from_header(Some("br")), Err(DecodeError::Unsupported(_))));
        assert_eq!(Encoding::from_header(Some(" GZIP ")).unwrap(), Encoding::Gzip);
        assert_eq!(Encoding::from_header(None).unwrap(), Encoding::Identity);
    }

    #[test]
    fn the_answer_coding_follows_accept_encoding_and_its_q_values() {
        let pick = |v: &str| Encoding::accepted([v]);
        // What tritonclient.http sends (response_compression_algorithm), and browsers.
        assert_eq!(pick("gzip"), Encoding::Gzip);
        assert_eq!(pick("deflate"), Encoding::Deflate);
        assert_eq!(pick("gzip, deflate, br"), Encoding::Gzip);
        assert_eq!(pick("deflate, gzip"), Encoding::Gzip, "gzip when both are as welcome");
        assert_eq!(pick("gzip;q=0.5, deflate"), Encoding::Deflate);
        assert_eq!(pick("GZIP ; Q=0.9 , deflate;q=0.8"), Encoding::Gzip);
        // q=0 is "not acceptable"; identity, none, or what inferd does not write: plain.
        assert_eq!(pick("gzip;q=0"), Encoding::Identity);
        assert_eq!(pick("gzip;q=0.000, deflate;q=0"), Encoding::Identity);
        assert_eq!(pick("identity"), Encoding::Identity);
        assert_eq!(pick("br, zstd"), Encoding::Identity);
        assert_eq!(pick(""), Encoding::Identity);
        assert_eq!(Encoding::accepted([]), Encoding::Identity);
        assert_eq!(pick("identity;q=1, gzip;q=0.5"), Encoding::Identity, "identity preferred");
        assert_eq!(pick("identity;q=0.5, gzip"), Encoding::Gzip);
        // `*` stands for what is not named.
        assert_eq!(pick("*"), Encoding::Gzip);
        assert_eq!(pick("gzip;q=0, *"), Encoding::Deflate);
        assert_eq!(pick("*;q=0"), Encoding::Identity);
        // A malformed q-value drops its element, not the header.
        assert_eq!(pick("gzip;q=2, deflate"), Encoding::Deflate);
        assert_eq!(pick("gzip;q=0.5x"), Encoding::Identity);
        // Several header lines are one list.
        assert_eq!(Encoding::accepted(["gzip;q=0.1", "deflate;q=0.2"]), Encoding::Deflate);
        assert_eq!(
            (qvalue("1.000"), qvalue("0.25"), qvalue("1.5"), qvalue("0.1234")),
            (Some(1000), Some(250), None, None)
        );
    }

    #[test]
    fn answers_compress_within_their_bound_and_inflate_back() {
        let text = b"{\"outputs\": [0.0123, -0.0456]}".repeat(1000);
        for encoding in [Encoding::Gzip, Encoding::Deflate] {
            let packed = encoding.encode(&text, Vec::new()).unwrap();
            assert!(packed.len() < text.len() / 4, "{encoding:?}: {}", packed.len());
            assert_eq!(encoding.decode(&packed, 1 << 20, |_| true).unwrap(), text);
            // After a prefix (a gRPC frame's 5 bytes), which stays as it was.
            let framed = encoding.encode(&text, vec![1, 0, 0, 0, 0]).unwrap();
            assert_eq!(
                (&framed[..5], encoding.decode(&framed[5..], 1 << 20, |_| true).unwrap()),
                (&[1, 0, 0, 0, 0][..], text.to_vec())
            );
        }
        // What does not compress stays within the bound.
        let noise: Vec<u8> = (0..50_000u32).flat_map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()).collect();
        for encoding in [Encoding::Gzip, Encoding::Deflate] {
            let packed = encoding.encode(&noise, Vec::new()).unwrap();
            assert!(packed.len() as u64 <= Encoding::bound(noise.len() as u64), "{encoding:?}: {}", packed.len());
        }
        assert_eq!(Encoding::Identity.encode(b"abc", b"x".to_vec()).unwrap(), b"xabc");
    }
}
