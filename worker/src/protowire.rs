//! The protobuf wire format, read field by field without a schema: what the gRPC intake
//! measures a ModelInfer message with before it is decoded ([`crate::http::grpc::intake`]) and
//! what an ONNX file is walked with ([`crate::onnx`], the int8 rewrite); and written, for the
//! ONNX files inferd makes (the int8 rewrite, the allocator's one-operator model).
// Request bytes come through here: every operation on sizes is checked.
#![deny(clippy::arithmetic_side_effects)]

/// Why bytes are not a protobuf message these readers take. The gRPC intake answers with the
/// message (a 400's text), so each names what was wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("a length is out of range")]
    Length,
    #[error("field {number} has wire type {wire}, which these messages do not use")]
    WireType { number: u64, wire: u64 },
    #[error("a field of {len} bytes runs past the end of its message")]
    PastTheEnd { len: usize },
    #[error("a varint is cut off or longer than 10 bytes")]
    Varint,
}

/// For the gRPC intake, whose errors are still text: `?` turns the error into its message.
impl From<WireError> for String {
    fn from(error: WireError) -> String {
        error.to_string()
    }
}

/// One field: its number, wire type, payload (length-delimited and fixed-width fields) or
/// value (varints), and the bytes it took, key included.
#[derive(Clone, Copy)]
pub struct Field<'a> {
    pub number: u64,
    pub wire: u64,
    pub payload: &'a [u8],
    pub value: u64,
    pub whole: &'a [u8],
}

/// The next field of `bytes`, which move past it. Groups (wire types 3 and 4) are refused:
/// neither KServe's messages nor ONNX files use them.
pub fn next<'a>(bytes: &mut &'a [u8]) -> Result<Field<'a>, WireError> {
    let start = *bytes;
    let key = varint(bytes)?;
    let (number, wire) = (key >> 3, key & 7);
    let (payload, value) = match wire {
        0 => (&[][..], varint(bytes)?),
        1 => (take(bytes, 8)?, 0),
        5 => (take(bytes, 4)?, 0),
        2 => {
            let len = usize::try_from(varint(bytes)?).map_err(|_| WireError::Length)?;
            (take(bytes, len)?, 0)
        }
        _ => return Err(WireError::WireType { number, wire }),
    };
    let used = start.len().saturating_sub(bytes.len());
    Ok(Field { number, wire, payload, value, whole: start.get(..used).unwrap_or_default() })
}

/// Every field of a message, in order.
pub fn fields(mut bytes: &[u8]) -> Result<Vec<Field<'_>>, WireError> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        out.push(next(&mut bytes)?);
    }
    Ok(out)
}

fn take<'a>(bytes: &mut &'a [u8], len: usize) -> Result<&'a [u8], WireError> {
    if len > bytes.len() {
        return Err(WireError::PastTheEnd { len });
    }
    let (head, rest) = bytes.split_at(len);
    *bytes = rest;
    Ok(head)
}

/// A varint, and `bytes` moved past it.
pub fn varint(bytes: &mut &[u8]) -> Result<u64, WireError> {
    let mut value = 0u64;
    for (i, byte) in bytes.iter().take(10).enumerate() {
        value |= u64::from(byte & 0x7f).checked_shl(7u32.saturating_mul(i as u32)).unwrap_or(0);
        if byte & 0x80 == 0 {
            *bytes = bytes.get(i.saturating_add(1)..).unwrap_or_default();
            return Ok(value);
        }
    }
    Err(WireError::Varint)
}

/// Writes `value` as a varint.
pub fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Writes field `number` (below 2^61) as a length-delimited field holding `payload`.
pub fn put_bytes(out: &mut Vec<u8>, number: u64, payload: &[u8]) {
    put_varint(out, number << 3 | 2);
    put_varint(out, payload.len() as u64);
    out.extend_from_slice(payload);
}

/// Writes field `number` (below 2^61) as a varint field holding `value`.
pub fn put_number(out: &mut Vec<u8>, number: u64, value: u64) {
    put_varint(out, number << 3);
    put_varint(out, value);
}

/// A dimension of an ONNX tensor's shape: named (dynamic) or fixed.
pub enum Dim<'a> {
    Named(&'a str),
    Fixed(u64),
}

/// An ONNX `ValueInfoProto`: a float tensor `name` of `dims`, a graph's input or output.
/// Fields of onnx.proto: ValueInfoProto name = 1, type = 2; TypeProto tensor_type = 1, whose
/// elem_type = 1 (FLOAT = 1) and shape = 2; TensorShapeProto dim = 1, its dim_value = 1 or
/// dim_param = 2.
pub fn float_value_info(name: &str, dims: &[Dim]) -> Vec<u8> {
    let mut shape = Vec::new();
    for d in dims {
        let mut dim = Vec::new();
        match d {
            Dim::Named(param) => put_bytes(&mut dim, 2, param.as_bytes()),
            Dim::Fixed(value) => put_number(&mut dim, 1, *value),
        }
        put_bytes(&mut shape, 1, &dim);
    }
    let mut tensor = Vec::new();
    put_number(&mut tensor, 1, 1);
    put_bytes(&mut tensor, 2, &shape);
    let mut kind = Vec::new();
    put_bytes(&mut kind, 1, &tensor);
    let mut info = Vec::new();
    put_bytes(&mut info, 1, name.as_bytes());
    put_bytes(&mut info, 2, &kind);
    info
}
