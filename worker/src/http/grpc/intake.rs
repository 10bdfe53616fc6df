//! A gRPC request's body before tonic decodes it: read as its frames arrive, each frame charged
//! to the worker's body budget (server.max_body_bytes_in_flight) when it arrives, bounded by
//! server.max_body_bytes and server.body_timeout_secs; a compressed message (`grpc-encoding`
//! gzip or deflate) inflated within the same bounds; and a ModelInfer message's decoded size
//! bounded from its wire bytes ([`decoded_size`]) before prost allocates anything, since a
//! message of many empty entries decodes to a hundred times its size.
//!
//! The budget taken stays with the request ([`Claim`], in its extensions) until it is answered.
//! A refusal does not bypass the counters and the access log: the request goes on to its
//! handler with an empty message and the refusal in its extensions ([`Intake`]).
// Sizes here come from request data: every operation on them is checked.
#![deny(clippy::arithmetic_side_effects)]

use std::mem::size_of;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokio::sync::OwnedSemaphorePermit;

use crate::http::body::{inflate_charged, no_room};
use crate::http::encoding::{DecodeError, Encoding};
use crate::http::grpc::proto::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
use crate::http::grpc::proto::{InferParameter, InferTensorContents};
use crate::protowire as wire;
use crate::request::app::AppState;
use crate::request::error::ApiError;

/// The gRPC path whose message is bounded by its decoded size.
const MODEL_INFER: &str = "/inference.GRPCInferenceService/ModelInfer";

/// The budget a request's bytes hold until it is answered.
#[derive(Clone)]
pub struct Claim(#[allow(dead_code)] Arc<OwnedSemaphorePermit>);

/// What the intake found, for the handler: refused requests are answered by it (counted and
/// logged as every other answer).
#[derive(Clone)]
pub enum Intake {
    Refused(ApiError),
}

/// The header that names a compressed message's encoding.
const GRPC_ENCODING: &str = "grpc-encoding";

/// The request with its body read, inflated and charged, ready for tonic (which then sees a
/// plain message).
pub async fn read(state: &AppState, request: hyper::Request<Incoming>) -> hyper::Request<Full<Bytes>> {
    let (mut parts, body) = request.into_parts();
    let infer = parts.uri.path() == MODEL_INFER;
    // Whatever comes of it, tonic gets a plain message (or the empty one of a refusal).
    let encoding = parts.headers.remove(GRPC_ENCODING).map(|v| v.to_str().unwrap_or("?").to_string());
    match collect(state, body, infer, encoding.as_deref()).await {
        Ok((bytes, claim)) => {
            parts.extensions.insert(claim);
            hyper::Request::from_parts(parts, Full::new(bytes))
        }
        Err(refused) => {
            parts.extensions.insert(Intake::Refused(refused));
            // An uncompressed message of 0 bytes: the default (empty) request.
            hyper::Request::from_parts(parts, Full::new(Bytes::from_static(&[0, 0, 0, 0, 0])))
        }
    }
}

async fn collect(
    state: &AppState,
    mut body: Incoming,
    infer: bool,
    encoding: Option<&str>,
) -> Result<(Bytes, Claim), ApiError> {
    let limit = state.max_body_bytes;
    // The gRPC frame's own 5 bytes (compressed flag, length) come on top of the message.
    let most = limit.saturating_add(5);
    let too_large = |what: &str| {
        ApiError::TooLarge(format!("{what} is larger than the limit of {limit} bytes (server.max_body_bytes)"))
    };
    let overloaded = || no_room(state);
    let claim_more = |claim: &mut Option<OwnedSemaphorePermit>, bytes: u64| -> Result<(), ApiError> {
        let bytes = u32::try_from(bytes).map_err(|_| overloaded())?;
        if bytes == 0 {
            return Ok(());
        }
        let more = state.body_budget.clone().try_acquire_many_owned(bytes).map_err(|_| overloaded())?;
        match claim {
            Some(held) => held.merge(more),
            None => *claim = Some(more),
        }
        Ok(())
    };
    let mut claim = None;
    claim_more(&mut claim, 1)?;
    let mut read = BytesMut::new();
    let frames = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| ApiError::BadRequest(format!("could not read the request: {e}")))?;
            let Ok(data) = frame.into_data() else { continue };
            let len = data.len() as u64;
            if (read.len() as u64).saturating_add(len) > most {
                return Err(too_large("the gRPC message"));
            }
            claim_more(&mut claim, len)?;
            read.extend_from_slice(&data);
            // The message's length is in its frame's first 5 bytes: refused before the rest.
            if let [_, l0, l1, l2, l3, ..] = read[..] {
                if u64::from(u32::from_be_bytes([l0, l1, l2, l3])) > limit {
                    return Err(too_large("the gRPC message"));
                }
            }
        }
        Ok(())
    };
    let timeout = state.body_timeout;
    tokio::time::timeout(timeout, frames).await.map_err(|_| {
        ApiError::Timeout(format!("the gRPC message did not arrive within {timeout:?} (server.body_timeout_secs)"))
    })??;
    // A compressed message (gzip or deflate, as tritonclient's compression_algorithm sends
    // it) is inflated within server.max_body_bytes, its inflated bytes charged too, and goes
    // on as a plain one: every bound below applies to what it inflates to.
    let read = read.freeze();
    let read = match &read[..] {
        [1, l0, l1, l2, l3, message @ ..] if message.len() == u32::from_be_bytes([*l0, *l1, *l2, *l3]) as usize => {
            let (inflated, grown) = inflate(read.slice(5..), encoding, limit, state).await?;
            if let (Some(held), Some(grown)) = (claim.as_mut(), grown) {
                held.merge(grown);
            }
            let length = u32::try_from(inflated.len()).map_err(|_| too_large("the inflated gRPC message"))?;
            let mut frame = BytesMut::with_capacity(inflated.len().saturating_add(5));
            frame.extend_from_slice(&[0]);
            frame.extend_from_slice(&length.to_be_bytes());
            frame.extend_from_slice(&inflated);
            frame.freeze()
        }
        _ => read,
    };
    // A malformed frame is tonic's to refuse; only a whole, plain ModelInfer message is
    // measured here.
    if let (true, [0, l0, l1, l2, l3, message @ ..]) = (infer, &read[..]) {
        let declared = u32::from_be_bytes([*l0, *l1, *l2, *l3]) as usize;
        if let Some(message) = message.get(..declared) {
            let decoded =
                decoded_size(message).map_err(|e| ApiError::BadRequest(format!("invalid ModelInferRequest: {e}")))?;
            if decoded > limit {
                return Err(too_large(&format!(
                    "the ModelInferRequest of {declared} bytes decodes to about {decoded} bytes, which"
                )));
            }
            // Its wire bytes are held already; the decoded message, at its peak, twice over (but
            // never more than the whole budget, so that the largest message is served alone).
            let held = (read.len() as u64).saturating_add(1);
            claim_more(&mut claim, decoded.saturating_mul(2).min(state.body_budget_total.saturating_sub(held)))?;
        }
    }
    let claim = claim.expect("claimed at least one byte above");
    Ok((read, Claim(Arc::new(claim))))
}

/// A compressed message inflated, off the I/O thread, at most `limit` bytes of it, each
/// mebibyte charged to the worker's body budget before it is held (the charge comes back with
/// it); refused when its `grpc-encoding` is none inferd reads.
async fn inflate(
    message: Bytes,
    encoding: Option<&str>,
    limit: u64,
    state: &AppState,
) -> Result<(Vec<u8>, Option<OwnedSemaphorePermit>), ApiError> {
    let encoding = match encoding.map(str::trim) {
        Some("gzip") => Encoding::Gzip,
        Some("deflate") => Encoding::Deflate,
        other => {
            return Err(ApiError::BadRequest(format!(
                "the gRPC message is compressed, with grpc-encoding {}; send gzip, deflate or an uncompressed message",
                other.map_or("unset".to_string(), |v| format!("'{}'", v.chars().take(40).collect::<String>()))
            )))
        }
    };
    let budget = state.body_budget.clone();
    let inflated = tokio::task::spawn_blocking(move || inflate_charged(encoding, &message, limit, &budget))
        .await
        .map_err(|e| ApiError::Internal(format!("inflating the gRPC message: {e}")))?;
    inflated.map_err(|e| match e {
        DecodeError::TooLarge(_) => ApiError::TooLarge(e.to_string()),
        DecodeError::NoRoom => no_room(state),
        _ => ApiError::BadRequest(e.to_string()),
    })
}

/// How a message's field is decoded (the part of the schema that allocates).
#[derive(Clone, Copy)]
enum Kind {
    /// A string or bytes: its length (plus a `Vec` when repeated).
    Bytes,
    /// Repeated fixed-width numbers: their bytes as sent.
    Fixed,
    /// Repeated varints decoded to `n` bytes each.
    Varint(usize),
    /// A message of this schema (inline when singular; `n` bytes each in a `Vec` or map when
    /// repeated).
    Message(&'static [Field], usize),
}

#[derive(Clone, Copy)]
struct Field {
    number: u64,
    kind: Kind,
    repeated: bool,
}

const fn field(number: u64, kind: Kind, repeated: bool) -> Field {
    Field { number, kind, repeated }
}

/// A map entry as a hash map holds it: the pair and a control byte.
const fn entry<V>() -> usize {
    size_of::<(String, V)>().saturating_add(1)
}

const PARAMETER: &[Field] = &[field(3, Kind::Bytes, false)];
const PARAMETERS: &[Field] = &[field(1, Kind::Bytes, false), field(2, Kind::Message(PARAMETER, 0), false)];
const CONTENTS: &[Field] = &[
    field(1, Kind::Varint(size_of::<bool>()), true),
    field(2, Kind::Varint(size_of::<i32>()), true),
    field(3, Kind::Varint(size_of::<i64>()), true),
    field(4, Kind::Varint(size_of::<u32>()), true),
    field(5, Kind::Varint(size_of::<u64>()), true),
    field(6, Kind::Fixed, true),
    field(7, Kind::Fixed, true),
    field(8, Kind::Bytes, true),
];
const INPUT: &[Field] = &[
    field(1, Kind::Bytes, false),
    field(2, Kind::Bytes, false),
    field(3, Kind::Varint(size_of::<i64>()), true),
    field(4, Kind::Message(PARAMETERS, entry::<InferParameter>()), true),
    field(5, Kind::Message(CONTENTS, size_of::<InferTensorContents>()), false),
];
const OUTPUT: &[Field] =
    &[field(1, Kind::Bytes, false), field(2, Kind::Message(PARAMETERS, entry::<InferParameter>()), true)];
const REQUEST: &[Field] = &[
    field(1, Kind::Bytes, false),
    field(2, Kind::Bytes, false),
    field(3, Kind::Bytes, false),
    field(4, Kind::Message(PARAMETERS, entry::<InferParameter>()), true),
    field(5, Kind::Message(INPUT, size_of::<InferInputTensor>()), true),
    field(6, Kind::Message(OUTPUT, size_of::<InferRequestedOutputTensor>()), true),
    field(7, Kind::Bytes, true),
];

/// The bytes a ModelInferRequest's wire form decodes to: every string and bytes field, every
/// number of every repeated field at its decoded width, every repeated element's struct (a
/// map entry's pair). Linear in the message, and allocates nothing. Fields unknown to the
/// schema are skipped by prost and cost nothing. While a `Vec` grows by doubling it may hold up
/// to twice its elements: the budget is charged for that ([`collect`]).
pub fn decoded_size(message: &[u8]) -> Result<u64, String> {
    walk(message, REQUEST)
}

fn walk(mut bytes: &[u8], schema: &[Field]) -> Result<u64, String> {
    let mut total = 0u64;
    while !bytes.is_empty() {
        let wire::Field { number, wire, payload, .. } = wire::next(&mut bytes)?;
        let Some(field) = schema.iter().find(|f| f.number == number) else { continue };
        let element = |size: usize| if field.repeated { size as u64 } else { 0 };
        let cost = match (field.kind, wire) {
            (Kind::Bytes, _) => (payload.len() as u64).saturating_add(element(size_of::<Vec<u8>>())),
            // Packed numbers: their bytes when fixed-width; one number per byte that ends a
            // varint.
            (Kind::Fixed, 2) => payload.len() as u64,
            (Kind::Varint(width), 2) => {
                let count = payload.iter().filter(|b| **b < 0x80).count();
                (count as u64).saturating_mul(width as u64)
            }
            // One number, not packed.
            (Kind::Fixed, _) => 8,
            (Kind::Varint(width), _) => width as u64,
            (Kind::Message(inner, size), _) => walk(payload, inner)?.saturating_add(element(size)),
        };
        total = total.saturating_add(cost);
    }
    Ok(total)
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use crate::http::grpc::proto::ModelInferRequest;
    use prost::Message;

    fn tensor(name: &str, contents: InferTensorContents) -> InferInputTensor {
        InferInputTensor {
            name: name.into(),
            datatype: "FP32".into(),
            shape: vec![1, contents.fp32_contents.len() as i64],
            parameters: Default::default(),
            contents: Some(contents),
        }
    }

    #[test]
    fn an_ordinary_request_costs_about_its_size() {
        let contents = InferTensorContents { fp32_contents: vec![0.5; 100_000], ..Default::default() };
        let request =
            ModelInferRequest { model_name: "m".into(), inputs: vec![tensor("x", contents)], ..Default::default() };
        let wire = request.encode_to_vec();
        let size = decoded_size(&wire).unwrap();
        assert!(size >= 400_000 && size < wire.len() as u64 * 11 / 10, "{size} for {} bytes", wire.len());
    }

    #[test]
    fn many_empty_entries_are_counted_as_what_they_decode_to() {
        // 2 bytes on the wire each, a whole InferInputTensor decoded.
        let inputs = vec![InferInputTensor::default(); 10_000];
        let wire = ModelInferRequest { inputs, ..Default::default() }.encode_to_vec();
        let size = decoded_size(&wire).unwrap();
        let decoded = 10_000 * size_of::<InferInputTensor>() as u64;
        assert!(size >= decoded, "{size} < {decoded}");
        // Empty bytes entries: a Vec each.
        let contents = InferTensorContents { bytes_contents: vec![Vec::new(); 10_000], ..Default::default() };
        let wire = ModelInferRequest { inputs: vec![tensor("x", contents)], ..Default::default() }.encode_to_vec();
        assert!(decoded_size(&wire).unwrap() >= 10_000 * size_of::<Vec<u8>>() as u64);
        // Packed int64s of one byte each decode to 8.
        let contents = InferTensorContents { int64_contents: vec![1; 10_000], ..Default::default() };
        let wire = ModelInferRequest { inputs: vec![tensor("x", contents)], ..Default::default() }.encode_to_vec();
        assert!(decoded_size(&wire).unwrap() >= 80_000);
    }

    #[test]
    fn malformed_messages_are_named_not_walked_past_their_end() {
        assert!(decoded_size(&[0x2a, 0xff, 0xff, 0x03]).unwrap_err().contains("runs past the end"));
        assert!(decoded_size(&[0x08]).unwrap_err().contains("varint"));
        assert!(decoded_size(&[0x0b]).unwrap_err().contains("wire type 3"));
        // Unknown fields cost nothing.
        assert_eq!(decoded_size(&[0x78, 0x01]).unwrap(), 0);
    }
}
