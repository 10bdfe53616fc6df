//! Tensors as the protocol sees them: a KServe v2 datatype, a shape, and flat typed data.
//!
//! One table ([`for_each_type!`]) lists every numeric element type with its Rust type, its v2
//! name and its ONNX Runtime type; the enums, JSON and binary parsing and the ORT conversions
//! are generated from it so a type cannot be half-supported. BYTES (byte strings; ORT strings)
//! is added by hand to each of them.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use half::f16;

/// Why the binary tensor extension's bytes are not `count` elements of their datatype (a
/// request's 400, after the input's name).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BinaryError {
    #[error("{bytes} bytes of binary data for {count} elements of {size} bytes")]
    Length { bytes: usize, count: usize, size: usize },
    #[error("invalid BOOL byte (must be 0 or 1)")]
    Bool,
    #[error("element {index} claims {len} bytes, {left} are left")]
    Element { index: usize, len: usize, left: usize },
    #[error("binary BYTES data holds {whole} whole elements (+{stray} stray bytes), the shape needs {count}")]
    Count { whole: usize, stray: usize, count: usize },
}
use ort::value::{DynValue, TensorElementType, ValueType};
use serde::ser::{Serialize, SerializeSeq, Serializer};

/// A named tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<i64>,
    pub data: TensorData,
}

/// An input or output as the model declares it; -1 marks a dynamic dimension.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TensorSpec {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
    /// `None` when inferd cannot carry this element type.
    #[serde(skip)]
    pub dtype: Option<DataType>,
    /// The first dimension's symbolic name in the graph ("batch"), empty when it has none.
    #[serde(skip)]
    pub first_dim: String,
    /// A request may leave it out (model.toml's `optional_inputs`: a graph input with an
    /// initializer, which ONNX Runtime then feeds).
    #[serde(skip)]
    pub optional: bool,
}

impl TensorSpec {
    /// The declared shape with its dynamic dimensions filled in: the first (the batch) with
    /// `batch`, any other with `other` (warm-up and the int8 guard's generated inputs).
    pub fn filled(&self, batch: usize, other: usize) -> Vec<i64> {
        let fill = |(axis, &d): (usize, &i64)| match (d, axis) {
            (d, _) if d >= 0 => d,
            (_, 0) => batch as i64,
            _ => other as i64,
        };
        self.shape.iter().enumerate().map(fill).collect()
    }
}

/// Calls `$m!` with the table: (variant, rust type, v2 name, ORT element type).
macro_rules! for_each_type {
    ($m:ident) => {
        $m! {
            (Bool, bool, "BOOL", Bool),
            (U8, u8, "UINT8", Uint8),
            (U16, u16, "UINT16", Uint16),
            (U32, u32, "UINT32", Uint32),
            (U64, u64, "UINT64", Uint64),
            (I8, i8, "INT8", Int8),
            (I16, i16, "INT16", Int16),
            (I32, i32, "INT32", Int32),
            (I64, i64, "INT64", Int64),
            (F16, f16, "FP16", Float16),
            (F32, f32, "FP32", Float32),
            (F64, f64, "FP64", Float64),
        }
    };
}

macro_rules! define_types {
    ($(($variant:ident, $rust:ty, $name:literal, $ort:ident)),* $(,)?) => {
        /// Element types inferd can carry between the protocol and ONNX Runtime.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum DataType { $($variant,)* Bytes }

        /// Flat, row-major tensor contents. BYTES elements are raw byte strings.
        #[derive(Debug, Clone, PartialEq)]
        pub enum TensorData { $($variant(Vec<$rust>),)* Bytes(Vec<Vec<u8>>) }

        impl DataType {
            /// The KServe v2 name ("FP32", "INT64", "BYTES", ...).
            pub fn name(self) -> &'static str {
                match self { $(DataType::$variant => $name,)* DataType::Bytes => "BYTES" }
            }

            pub fn from_name(name: &str) -> Option<DataType> {
                match name { $($name => Some(DataType::$variant),)* "BYTES" => Some(DataType::Bytes), _ => None }
            }

            pub fn from_ort(ty: TensorElementType) -> Option<DataType> {
                match ty {
                    $(TensorElementType::$ort => Some(DataType::$variant),)*
                    TensorElementType::String => Some(DataType::Bytes),
                    _ => None,
                }
            }

            /// The bytes of one element in the binary tensor extension; None for BYTES, whose
            /// elements carry their own lengths.
            pub fn size(self) -> Option<usize> {
                match self {
                    $(DataType::$variant => Some(std::mem::size_of::<$rust>()),)*
                    DataType::Bytes => None,
                }
            }

            /// A tensor of `len` zeros (false, empty strings), for warm-up inputs.
            pub fn zeros(self, len: usize) -> TensorData {
                match self {
                    $(DataType::$variant => TensorData::$variant(vec![<$rust>::default(); len]),)*
                    DataType::Bytes => TensorData::Bytes(vec![Vec::new(); len]),
                }
            }

            /// Parses flat JSON values; `Err` carries the index and a description of the value.
            pub fn parse_json(self, values: &[&serde_json::Value]) -> Result<TensorData, (usize, String)> {
                fn all<T>(values: &[&serde_json::Value], f: impl Fn(&serde_json::Value) -> Option<T>) -> Result<Vec<T>, (usize, String)> {
                    values.iter().enumerate().map(|(i, v)| f(v).ok_or_else(|| (i, describe(v)))).collect()
                }
                match self {
                    $(DataType::$variant => all(values, <$rust as Element>::from_json).map(TensorData::$variant),)*
                    DataType::Bytes => all(values, |v| v.as_str().map(|s| s.as_bytes().to_vec())).map(TensorData::Bytes),
                }
            }

            /// Decodes `count` elements of the binary tensor extension: little-endian, row-major;
            /// BOOL one byte each; BYTES each a u32 little-endian length and that many bytes.
            pub fn parse_binary(self, bytes: &[u8], count: usize) -> Result<TensorData, BinaryError> {
                fn fixed<T: Element>(bytes: &[u8], count: usize) -> Result<Vec<T>, BinaryError> {
                    let size = std::mem::size_of::<T>();
                    if count.checked_mul(size) != Some(bytes.len()) {
                        return Err(BinaryError::Length { bytes: bytes.len(), count, size });
                    }
                    bytes.chunks_exact(size).map(T::from_le).collect::<Option<Vec<T>>>().ok_or(BinaryError::Bool)
                }
                match self {
                    $(DataType::$variant => fixed::<$rust>(bytes, count).map(TensorData::$variant),)*
                    DataType::Bytes => {
                        let mut items = Vec::with_capacity(count.min(bytes.len() / 4));
                        let mut rest = bytes;
                        while rest.len() >= 4 {
                            let (head, tail) = rest.split_at(4);
                            let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
                            let item = tail.get(..len).ok_or(BinaryError::Element { index: items.len(), len, left: tail.len() })?;
                            items.push(item.to_vec());
                            rest = &tail[len..];
                        }
                        if !rest.is_empty() || items.len() != count {
                            return Err(BinaryError::Count { whole: items.len(), stray: rest.len(), count });
                        }
                        Ok(TensorData::Bytes(items))
                    }
                }
            }
        }

        impl TensorData {
            pub fn dtype(&self) -> DataType {
                match self { $(TensorData::$variant(_) => DataType::$variant,)* TensorData::Bytes(_) => DataType::Bytes }
            }

            pub fn len(&self) -> usize {
                match self { $(TensorData::$variant(v) => v.len(),)* TensorData::Bytes(v) => v.len() }
            }

            pub fn is_empty(&self) -> bool {
                self.len() == 0
            }

            /// Appends `rows` rows of `src`, each `from` elements long, each padded with zeros
            /// (false, empty strings) to `to` elements: how a batch is assembled from requests
            /// whose rows differ in length. `false` when the element types differ.
            pub fn extend_rows(&mut self, src: &TensorData, rows: usize, from: usize, to: usize) -> bool {
                debug_assert!(to >= from && rows.checked_mul(from).is_some_and(|n| src.len() >= n));
                let pad = to.saturating_sub(from);
                match (self, src) {
                    $((TensorData::$variant(d), TensorData::$variant(s)) => {
                        d.reserve(rows.saturating_mul(to));
                        for row in s.chunks_exact(from.max(1)).take(rows) {
                            d.extend_from_slice(row);
                            d.extend(std::iter::repeat_n(<$rust>::default(), pad));
                        }
                    })*
                    (TensorData::Bytes(d), TensorData::Bytes(s)) => {
                        for row in s.chunks_exact(from.max(1)).take(rows) {
                            d.extend_from_slice(row);
                            d.extend(std::iter::repeat_n(Vec::new(), pad));
                        }
                    }
                    _ => return false,
                }
                true
            }

            /// Elements `range` (a run of whole rows when splitting a batch's output).
            pub fn slice(&self, range: std::ops::Range<usize>) -> TensorData {
                match self {
                    $(TensorData::$variant(v) => TensorData::$variant(v[range].to_vec()),)*
                    TensorData::Bytes(v) => TensorData::Bytes(v[range].to_vec()),
                }
            }

            /// The binary tensor extension's encoding of this data (see [`DataType::parse_binary`]).
            pub fn to_binary(&self) -> Vec<u8> {
                let mut out = Vec::new();
                match self {
                    $(TensorData::$variant(v) => v.iter().for_each(|x| x.write_le(&mut out)),)*
                    TensorData::Bytes(v) => v.iter().for_each(|item| {
                        out.extend_from_slice(&(item.len() as u32).to_le_bytes());
                        out.extend_from_slice(item);
                    }),
                }
                out
            }

            /// Hands the data to ONNX Runtime (numbers without copying; byte strings as they
            /// are, any byte included).
            pub fn into_ort(self, shape: Vec<i64>) -> ort::Result<DynValue> {
                match self {
                    $(TensorData::$variant(v) => Ok(ort::value::Tensor::from_array((shape, v))?.into_dyn()),)*
                    TensorData::Bytes(v) => super::strings::to_ort(shape, &v),
                }
            }

            /// Copies an ORT output out; `None` for element types inferd does not carry.
            pub fn from_ort(value: &DynValue) -> ort::Result<Option<(Vec<i64>, TensorData)>> {
                let ty = match value.dtype() {
                    ValueType::Tensor { ty, .. } => *ty,
                    _ => return Ok(None),
                };
                match ty {
                    $(TensorElementType::$ort => {
                        let (shape, data) = value.try_extract_tensor::<$rust>()?;
                        Ok(Some((shape.to_vec(), TensorData::$variant(data.to_vec()))))
                    })*
                    TensorElementType::String => {
                        let ValueType::Tensor { shape, .. } = value.dtype() else { return Ok(None) };
                        let items = super::strings::from_ort(value, shape.num_elements())?;
                        Ok(Some((shape.to_vec(), TensorData::Bytes(items))))
                    }
                    _ => Ok(None),
                }
            }
        }

        impl Serialize for TensorData {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let mut seq = serializer.serialize_seq(Some(self.len()))?;
                match self {
                    $(TensorData::$variant(v) => for x in v { seq.serialize_element(&Element::to_json(*x))?; },)*
                    TensorData::Bytes(v) => for x in v { seq.serialize_element(&String::from_utf8_lossy(x))?; },
                }
                seq.end()
            }
        }
    };
}

for_each_type!(define_types);

/// What each element type needs: JSON in and out, little-endian bytes in and out.
trait Element: Sized + Copy {
    /// JSON value to element; `None` when it does not fit the type.
    type Json: Serialize;
    fn from_json(v: &serde_json::Value) -> Option<Self>;
    /// What the element becomes in JSON (f16 goes out as f32).
    fn to_json(self) -> Self::Json;
    fn from_le(bytes: &[u8]) -> Option<Self>;
    fn write_le(&self, out: &mut Vec<u8>);
}

impl Element for bool {
    type Json = bool;
    fn from_json(v: &serde_json::Value) -> Option<bool> {
        v.as_bool()
    }
    fn to_json(self) -> bool {
        self
    }
    fn from_le(bytes: &[u8]) -> Option<bool> {
        match bytes[0] {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }
    fn write_le(&self, out: &mut Vec<u8>) {
        out.push(*self as u8);
    }
}

macro_rules! numbers {
    ($($t:ty => $json:ty, $from:expr, $to:expr);* $(;)?) => {$(
        impl Element for $t {
            type Json = $json;
            fn from_json(v: &serde_json::Value) -> Option<$t> {
                let from: fn(&serde_json::Value) -> Option<$t> = $from;
                from(v)
            }
            fn to_json(self) -> $json {
                let to: fn($t) -> $json = $to;
                to(self)
            }
            fn from_le(bytes: &[u8]) -> Option<$t> {
                Some(<$t>::from_le_bytes(bytes.try_into().ok()?))
            }
            fn write_le(&self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
        }
    )*};
}

macro_rules! integers {
    ($($t:ty),*) => {
        numbers! {$(
            $t => $t,
            |v| match v.as_i64() { Some(i) => <$t>::try_from(i).ok(), None => v.as_u64().and_then(|u| <$t>::try_from(u).ok()) },
            |x| x;
        )*}
    };
}
integers!(u8, u16, u32, u64, i8, i16, i32, i64);

numbers! {
    f32 => f32, |v| v.as_f64().map(|x| x as f32), |x| x;
    f64 => f64, |v| v.as_f64(), |x| x;
    f16 => f32, |v| v.as_f64().map(f16::from_f64), |x| x.to_f32();
}

fn describe(v: &serde_json::Value) -> String {
    let text = v.to_string();
    // Cut at a character boundary: the value may hold any UTF-8.
    match text.len() > 40 {
        true => format!("{}...", &text[..text.floor_char_boundary(40)]),
        false => text,
    }
}

/// Name of an ORT element type as v2 spells it, also for the types inferd does not carry
/// (they still show up in model metadata).
pub fn ort_type_name(ty: TensorElementType) -> String {
    match DataType::from_ort(ty) {
        Some(dt) => dt.name().to_string(),
        None => format!("{ty:?}").to_uppercase(),
    }
}

/// Number of elements of `shape`, or `None` if a dimension is negative or the product overflows.
pub fn element_count(shape: &[i64]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| usize::try_from(d).ok().and_then(|d| acc.checked_mul(d)))
}

/// `[1,-1,384]`: a shape as messages show it.
pub fn shape_text(shape: &[i64]) -> String {
    format!("[{}]", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(","))
}

/// Checks a request's tensors against `specs`, the inputs model `model` declares, and returns
/// them in the model's order: each named once, of its declared type, rank and fixed
/// dimensions, none missing but optional ones (which the graph then feeds itself). Every error
/// names the input and says what was expected, e.g. `input 'input_ids': expected INT64, got
/// FP32`.
pub fn validate_inputs(inputs: Vec<Tensor>, specs: &[TensorSpec], model: &str) -> Result<Vec<Tensor>, String> {
    let mut given: Vec<Option<Tensor>> = specs.iter().map(|_| None).collect();
    for tensor in inputs {
        let Some(i) = specs.iter().position(|s| s.name == tensor.name) else {
            return Err(format!("unknown input '{}'; model '{model}' has inputs {}", tensor.name, names(specs)));
        };
        if given[i].is_some() {
            return Err(format!("input '{}' is given twice", tensor.name));
        }
        specs[i].check(&tensor)?;
        given[i] = Some(tensor);
    }
    let missing: Vec<&TensorSpec> =
        specs.iter().zip(&given).filter(|(s, t)| t.is_none() && !s.optional).map(|(s, _)| s).collect();
    if let Some(first) = missing.first() {
        // Triton's sentence first (its QA tests match it whole), then which input is what.
        let got: Vec<&TensorSpec> = specs.iter().zip(&given).filter(|(_, t)| t.is_some()).map(|(s, _)| s).collect();
        let required = specs.iter().filter(|s| !s.optional).count();
        let expected = match required == specs.len() {
            true => format!("expected {required} inputs"),
            false => format!("expected number of inputs between {required} and {}", specs.len()),
        };
        let quoted =
            |specs: &[&TensorSpec]| specs.iter().map(|s| format!("'{}'", s.name)).collect::<Vec<_>>().join(",");
        return Err(format!(
            "{expected} but got {} inputs for model '{model}'. Got input(s) [{}], but missing required input(s) \
             [{}]. Please provide all required input(s). The first missing is input '{}' ({} {}); model '{model}' takes {}",
            got.len(),
            quoted(&got),
            quoted(&missing),
            first.name,
            first.datatype,
            shape_text(&first.shape),
            names(specs)
        ));
    }
    // Every required input is there: the model's order, optional ones left out where not given.
    Ok(given.into_iter().flatten().collect())
}

fn names(specs: &[TensorSpec]) -> String {
    let name = |s: &TensorSpec| format!("'{}'{}", s.name, if s.optional { " (optional)" } else { "" });
    specs.iter().map(name).collect::<Vec<_>>().join(", ")
}

impl TensorSpec {
    /// Whether `tensor` fits this input: its type, its rank and every fixed dimension.
    fn check(&self, tensor: &Tensor) -> Result<(), String> {
        let name = &tensor.name;
        let expected = self.dtype.expect("models with inputs inferd cannot feed are refused at load");
        let got = tensor.data.dtype();
        if got != expected {
            return Err(format!("input '{name}': expected {}, got {}", expected.name(), got.name()));
        }
        if tensor.shape.len() != self.shape.len() {
            return Err(format!(
                "input '{name}': expected shape {} (rank {}), got {} (rank {})",
                shape_text(&self.shape),
                self.shape.len(),
                shape_text(&tensor.shape),
                tensor.shape.len()
            ));
        }
        for (axis, (&want, &have)) in self.shape.iter().zip(&tensor.shape).enumerate() {
            if want >= 0 && want != have {
                return Err(format!(
                    "input '{name}': dimension {axis} must be {want} (model shape {}), got {}",
                    shape_text(&self.shape),
                    shape_text(&tensor.shape)
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(dt: DataType, v: serde_json::Value) -> Result<TensorData, (usize, String)> {
        let items: Vec<&serde_json::Value> = v.as_array().unwrap().iter().collect();
        dt.parse_json(&items)
    }

    #[test]
    fn names_round_trip() {
        for name in ["BOOL", "UINT8", "INT32", "INT64", "FP16", "FP32", "FP64"] {
            assert_eq!(DataType::from_name(name).unwrap().name(), name);
        }
        assert!(DataType::from_name("fp32").is_none());
        assert_eq!(DataType::from_name("BYTES"), Some(DataType::Bytes));
    }

    #[test]
    fn integers_are_range_checked() {
        assert_eq!(parse(DataType::I8, json!([1, -128])).unwrap(), TensorData::I8(vec![1, -128]));
        assert_eq!(parse(DataType::I8, json!([1, 128])).unwrap_err().0, 1);
        assert_eq!(parse(DataType::I32, json!([1.5])).unwrap_err(), (0, "1.5".to_string()));
        assert!(parse(DataType::U64, json!([-1])).is_err());
        assert_eq!(parse(DataType::U64, json!([u64::MAX])).unwrap(), TensorData::U64(vec![u64::MAX]));
    }

    #[test]
    fn floats_bools_and_half() {
        assert_eq!(parse(DataType::F32, json!([1, 2.5])).unwrap(), TensorData::F32(vec![1.0, 2.5]));
        assert!(parse(DataType::F32, json!(["1"])).is_err());
        assert!(parse(DataType::Bool, json!([1])).is_err());
        let h = parse(DataType::F16, json!([0.5])).unwrap();
        assert_eq!(serde_json::to_string(&h).unwrap(), "[0.5]");
    }

    #[test]
    fn binary_round_trips_every_type() {
        let cases = [
            TensorData::Bool(vec![true, false]),
            TensorData::U16(vec![1, 65535]),
            TensorData::I64(vec![-1, 1 << 40]),
            TensorData::F16(vec![f16::from_f32(0.5), f16::from_f32(-2.0)]),
            TensorData::F32(vec![1.5, -0.25]),
            TensorData::F64(vec![1e300, -0.0]),
            TensorData::Bytes(vec![b"Hi there".to_vec(), "Größe 🙂".as_bytes().to_vec()]),
        ];
        for data in cases {
            let bytes = data.to_binary();
            assert_eq!(data.dtype().parse_binary(&bytes, 2).unwrap(), data);
            assert!(data.dtype().parse_binary(&bytes, 3).is_err(), "{data:?} with a wrong count");
            assert!(data.dtype().parse_binary(&bytes[..bytes.len() - 1], 2).is_err(), "{data:?} cut short");
        }
        assert_eq!(TensorData::Bytes(vec![b"ab".to_vec()]).to_binary(), vec![2, 0, 0, 0, b'a', b'b']);
        assert!(DataType::Bool.parse_binary(&[2], 1).is_err());
        assert!(DataType::Bytes.parse_binary(&[200, 0, 0, 0, 1], 1).is_err());
    }

    #[test]
    fn element_count_refuses_negative_and_overflow() {
        assert_eq!(element_count(&[2, 3]), Some(6));
        assert_eq!(element_count(&[]), Some(1));
        assert_eq!(element_count(&[-1, 3]), None);
        assert_eq!(element_count(&[i64::MAX, i64::MAX]), None);
    }
}
