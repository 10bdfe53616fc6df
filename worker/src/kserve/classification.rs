//! Triton's classification extension: an output asked for with the parameter
//! `classification: N` is answered, instead of its values, as the N largest values of each of
//! its rows (each batch row, or the whole tensor for a model without a batch dimension),
//! largest first, as BYTES `value:index` or `value:index:label`: shape `[rows, N]` (`[N]`
//! without a batch dimension). Values are written as Triton writes them (C++'s
//! `std::to_string`: six decimals for floating point), so its clients (image_client.py's
//! `value (index) = label`) read them unchanged. Labels are the model's `[classification]`
//! labels where a row has as many values as there are labels.

use serde_json::{Map, Value};

use crate::runtime::tensor::{Tensor, TensorData};

/// The most values a row may have (Triton's bound).
pub const MAX_ELEMENTS: usize = 1_000_000;

/// The classes an output's parameters ask for (`classification`), None when it asks for none
/// (absent, or 0 as tritonclient's default).
pub fn count_of(what: &str, parameters: Option<&Map<String, Value>>) -> Result<Option<usize>, String> {
    let Some(value) = parameters.and_then(|p| p.get("classification")) else { return Ok(None) };
    let count = value
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| format!("{what}: Unable to set 'classification' ({value}): a whole number of classes"))?;
    Ok((count > 0).then_some(count))
}

/// `tensor`'s top `classes` of each row as Triton's BYTES; `batched`: its first dimension is
/// the batch.
pub fn classify(tensor: Tensor, classes: usize, batched: bool, labels: Option<&[String]>) -> Result<Tensor, String> {
    let name = tensor.name;
    let (keys, text) = keyed(&tensor.data).ok_or_else(|| {
        format!("class result not available for output '{name}' due to unsupported type '{}'", {
            tensor.data.dtype().name()
        })
    })?;
    let rows = match (batched, tensor.shape.first()) {
        (true, Some(&rows)) => usize::try_from(rows).unwrap_or(0),
        _ => 1,
    };
    let per = keys.len().checked_div(rows).unwrap_or(0);
    if per > MAX_ELEMENTS {
        return Err(format!("output '{name}': classification output tensor too large"));
    }
    let labels = labels.filter(|labels| labels.len() == per);
    let k = classes.min(per);
    let mut data = Vec::with_capacity(rows.saturating_mul(k));
    for row in 0..rows {
        let start = row * per;
        let mut order: Vec<usize> = (0..per).collect();
        // Largest first; equal values in index order.
        order.sort_by(|&a, &b| keys[start + b].total_cmp(&keys[start + a]));
        for &i in &order[..k] {
            let mut class = format!("{}:{i}", text(start + i));
            if let Some(label) = labels.and_then(|l| l.get(i)) {
                class.push(':');
                class.push_str(label);
            }
            data.push(class.into_bytes());
        }
    }
    let k = k as i64;
    let shape = match batched {
        true => vec![rows as i64, k],
        false => vec![k],
    };
    Ok(Tensor { name, shape, data: TensorData::Bytes(data) })
}

/// Each value as a sort key, and each written as Triton writes it; None for BOOL and BYTES.
#[allow(clippy::type_complexity)]
fn keyed(data: &TensorData) -> Option<(Vec<f64>, Box<dyn Fn(usize) -> String + '_>)> {
    fn ints<T: Copy + Into<f64> + ToString>(v: &[T]) -> (Vec<f64>, Box<dyn Fn(usize) -> String + '_>) {
        (v.iter().map(|&x| x.into()).collect(), Box::new(move |i| v[i].to_string()))
    }
    Some(match data {
        TensorData::F32(v) => (v.iter().map(|&x| f64::from(x)).collect(), Box::new(move |i| format!("{:.6}", v[i]))),
        TensorData::F64(v) => (v.clone(), Box::new(move |i| format!("{:.6}", v[i]))),
        TensorData::F16(v) => {
            (v.iter().map(|&x| f64::from(x.to_f32())).collect(), Box::new(move |i| format!("{:.6}", v[i].to_f32())))
        }
        TensorData::I8(v) => ints(v),
        TensorData::I16(v) => ints(v),
        TensorData::I32(v) => ints(v),
        TensorData::U8(v) => ints(v),
        TensorData::U16(v) => ints(v),
        TensorData::U32(v) => ints(v),
        // 64-bit integers sort by their nearest f64 and are written exactly.
        TensorData::I64(v) => (v.iter().map(|&x| x as f64).collect(), Box::new(move |i| v[i].to_string())),
        TensorData::U64(v) => (v.iter().map(|&x| x as f64).collect(), Box::new(move |i| v[i].to_string())),
        TensorData::Bool(_) | TensorData::Bytes(_) => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(t: &Tensor) -> Vec<String> {
        let TensorData::Bytes(items) = &t.data else { panic!() };
        items.iter().map(|b| String::from_utf8(b.clone()).unwrap()).collect()
    }

    #[test]
    fn each_row_gives_its_largest_values_with_their_index_and_label() {
        let t =
            Tensor { name: "y".into(), shape: vec![2, 3], data: TensorData::F32(vec![0.1, 0.7, 0.2, 5.0, -1.0, 5.0]) };
        let labels = ["a".to_string(), "b".to_string(), "c".to_string()];
        let out = classify(t.clone(), 2, true, Some(&labels)).unwrap();
        assert_eq!(out.shape, vec![2, 2]);
        assert_eq!(texts(&out), ["0.700000:1:b", "0.200000:2:c", "5.000000:0:a", "5.000000:2:c"]);
        // Without a batch dimension the whole tensor is one row; labels that do not fit are left out.
        let out = classify(t.clone(), 10, false, Some(&labels)).unwrap();
        assert_eq!(out.shape, vec![6]);
        assert_eq!(texts(&out)[..2], ["5.000000:3".to_string(), "5.000000:5".to_string()]);
        let ints = Tensor { name: "n".into(), shape: vec![3], data: TensorData::I64(vec![-4, 9, 1 << 60]) };
        assert_eq!(texts(&classify(ints, 1, false, None).unwrap()), [format!("{}:2", 1i64 << 60)]);
        let words = Tensor { name: "w".into(), shape: vec![1], data: TensorData::Bytes(vec![b"x".to_vec()]) };
        let e = classify(words, 1, false, None).unwrap_err();
        assert!(e.contains("unsupported type 'BYTES'"), "{e}");
    }

    #[test]
    fn the_count_is_a_whole_number_and_zero_asks_for_none() {
        let params = |v: Value| serde_json::json!({ "classification": v }).as_object().cloned();
        assert_eq!(count_of("output 'y'", params(3.into()).as_ref()), Ok(Some(3)));
        assert_eq!(count_of("output 'y'", params(0.into()).as_ref()), Ok(None));
        assert_eq!(count_of("output 'y'", None), Ok(None));
        assert!(count_of("output 'y'", params("3".into()).as_ref())
            .unwrap_err()
            .contains("Unable to set 'classification'"));
    }
}
