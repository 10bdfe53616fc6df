//! Tensors as the protocol sees them: a KServe v2 datatype, a shape, and flat typed data.
//!
//! One table ([`for_each_type!`]) lists every element type with its Rust type, its v2 name and
//! its ONNX Runtime type; the enum, the JSON parsing and the ORT conversions are generated from
//! it so a type cannot be half-supported.

use half::f16;
use ort::value::{DynValue, TensorElementType, ValueType};
use serde::ser::{Serialize, SerializeSeq, Serializer};

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
        /// Element types inferd can carry between JSON and ONNX Runtime.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum DataType { $($variant),* }

        /// Flat, row-major tensor contents.
        #[derive(Debug, Clone, PartialEq)]
        pub enum TensorData { $($variant(Vec<$rust>)),* }

        impl DataType {
            /// The KServe v2 name ("FP32", "INT64", ...).
            pub fn name(self) -> &'static str {
                match self { $(DataType::$variant => $name),* }
            }

            pub fn from_name(name: &str) -> Option<DataType> {
                match name { $($name => Some(DataType::$variant),)* _ => None }
            }

            pub fn from_ort(ty: TensorElementType) -> Option<DataType> {
                match ty { $(TensorElementType::$ort => Some(DataType::$variant),)* _ => None }
            }

            /// A tensor of `len` zeros (false for BOOL), for warm-up inputs.
            pub fn zeros(self, len: usize) -> TensorData {
                match self { $(DataType::$variant => TensorData::$variant(vec![<$rust>::default(); len])),* }
            }

            /// Parses flat JSON values; `Err` carries the index and a description of the value.
            pub fn parse_json(self, values: &[&serde_json::Value]) -> Result<TensorData, (usize, String)> {
                match self {
                    $(DataType::$variant => values
                        .iter()
                        .enumerate()
                        .map(|(i, v)| <$rust as FromJson>::from_json(v).ok_or_else(|| (i, describe(v))))
                        .collect::<Result<Vec<_>, _>>()
                        .map(TensorData::$variant),)*
                }
            }
        }

        impl TensorData {
            pub fn dtype(&self) -> DataType {
                match self { $(TensorData::$variant(_) => DataType::$variant),* }
            }

            pub fn len(&self) -> usize {
                match self { $(TensorData::$variant(v) => v.len()),* }
            }

            pub fn is_empty(&self) -> bool {
                self.len() == 0
            }

            /// Hands the data to ONNX Runtime without copying it.
            pub fn into_ort(self, shape: Vec<i64>) -> ort::Result<DynValue> {
                match self {
                    $(TensorData::$variant(v) => Ok(ort::value::Tensor::from_array((shape, v))?.into_dyn()),)*
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
                    _ => Ok(None),
                }
            }
        }

        impl Serialize for TensorData {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                match self {
                    $(TensorData::$variant(v) => {
                        let mut seq = serializer.serialize_seq(Some(v.len()))?;
                        for x in v {
                            seq.serialize_element(&ToJson::to_json(*x))?;
                        }
                        seq.end()
                    })*
                }
            }
        }
    };
}

for_each_type!(define_types);

/// Conversion of one JSON value to an element; `None` when it does not fit the type.
trait FromJson: Sized {
    fn from_json(v: &serde_json::Value) -> Option<Self>;
}

/// What an element becomes in JSON (f16 goes out as f32; everything else as itself).
trait ToJson {
    type Out: Serialize;
    fn to_json(self) -> Self::Out;
}

impl FromJson for bool {
    fn from_json(v: &serde_json::Value) -> Option<bool> {
        v.as_bool()
    }
}

macro_rules! ints {
    ($($t:ty),*) => {$(
        impl FromJson for $t {
            fn from_json(v: &serde_json::Value) -> Option<$t> {
                if let Some(i) = v.as_i64() { return <$t>::try_from(i).ok(); }
                v.as_u64().and_then(|u| <$t>::try_from(u).ok())
            }
        }
    )*};
}
ints!(u8, u16, u32, u64, i8, i16, i32, i64);

impl FromJson for f64 {
    fn from_json(v: &serde_json::Value) -> Option<f64> {
        v.as_f64()
    }
}

impl FromJson for f32 {
    fn from_json(v: &serde_json::Value) -> Option<f32> {
        v.as_f64().map(|x| x as f32)
    }
}

impl FromJson for f16 {
    fn from_json(v: &serde_json::Value) -> Option<f16> {
        v.as_f64().map(f16::from_f64)
    }
}

macro_rules! to_json_identity {
    ($($t:ty),*) => {$(
        impl ToJson for $t {
            type Out = $t;
            fn to_json(self) -> $t { self }
        }
    )*};
}
to_json_identity!(bool, u8, u16, u32, u64, i8, i16, i32, i64, f32, f64);

impl ToJson for f16 {
    type Out = f32;
    fn to_json(self) -> f32 {
        self.to_f32()
    }
}

fn describe(v: &serde_json::Value) -> String {
    let text = v.to_string();
    if text.len() > 40 {
        format!("{}...", &text[..40])
    } else {
        text
    }
}

/// Name of an ORT element type as v2 spells it, also for the types inferd does not carry
/// (they still show up in model metadata).
pub fn ort_type_name(ty: TensorElementType) -> String {
    match (DataType::from_ort(ty), ty) {
        (Some(dt), _) => dt.name().to_string(),
        (None, TensorElementType::String) => "BYTES".to_string(),
        (None, other) => format!("{other:?}").to_uppercase(),
    }
}

/// Number of elements of `shape`, or `None` if a dimension is negative or the product overflows.
pub fn element_count(shape: &[i64]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| usize::try_from(d).ok().and_then(|d| acc.checked_mul(d)))
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
    fn element_count_refuses_negative_and_overflow() {
        assert_eq!(element_count(&[2, 3]), Some(6));
        assert_eq!(element_count(&[]), Some(1));
        assert_eq!(element_count(&[-1, 3]), None);
        assert_eq!(element_count(&[i64::MAX, i64::MAX]), None);
    }
}
