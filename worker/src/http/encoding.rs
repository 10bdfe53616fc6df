//! Request bodies sent compressed (`Content-Encoding: gzip` or `deflate`, as
//! `tritonclient.http` sends them with `request_compression_algorithm`): inflated before they
//! are read, within the same `server.max_body_bytes` as a plain body. The limit applies to the
//! inflated bytes, and inflating stops one byte past it: a small body that would inflate to
//! gigabytes (a decompression bomb) costs at most the limit, and is refused with 413.
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
    #[error("the request body is not valid {encoding}: {message}")]
    Corrupt { encoding: &'static str, message: String },
}

impl Encoding {
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

    /// `body` inflated, at most `limit` bytes of it.
    pub fn decode(self, body: &[u8], limit: u64) -> Result<Vec<u8>, DecodeError> {
        let (reader, encoding): (Box<dyn Read + '_>, &'static str) = match self {
            Encoding::Identity => return Ok(body.to_vec()),
            Encoding::Gzip => (Box::new(flate2::read::MultiGzDecoder::new(body)), "gzip"),
            Encoding::Deflate => (Box::new(flate2::read::ZlibDecoder::new(body)), "deflate (zlib)"),
        };
        let mut out = Vec::new();
        reader
            .take(limit.saturating_add(1))
            .read_to_end(&mut out)
            .map_err(|e| DecodeError::Corrupt { encoding, message: e.to_string() })?;
        if out.len() as u64 > limit {
            return Err(DecodeError::TooLarge(limit));
        }
        Ok(out)
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
        assert_eq!(Encoding::Gzip.decode(&gzip(&text), 1 << 20).unwrap(), text);
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        z.write_all(&text).unwrap();
        assert_eq!(Encoding::Deflate.decode(&z.finish().unwrap(), 1 << 20).unwrap(), text);
        // 64 MiB of zeros gzip to ~64 KiB: refused at a 1 MiB limit, having inflated 1 MiB.
        let bomb = gzip(&vec![0u8; 64 << 20]);
        assert!(bomb.len() < 100 << 10);
        assert!(matches!(Encoding::Gzip.decode(&bomb, 1 << 20), Err(DecodeError::TooLarge(_))));
        assert!(matches!(Encoding::Gzip.decode(b"not gzip", 1 << 20), Err(DecodeError::Corrupt { .. })));
        assert!(matches!(Encoding::from_header(Some("br")), Err(DecodeError::Unsupported(_))));
        assert_eq!(Encoding::from_header(Some(" GZIP ")).unwrap(), Encoding::Gzip);
        assert_eq!(Encoding::from_header(None).unwrap(), Encoding::Identity);
    }
}
