//! JSON request bodies read into a route's request type, with errors in the client's terms:
//! the field (its path in the body), what it must be, and what came. Never a Rust type's
//! name: serde says `expected usize` or `data did not match any variant of untagged enum
//! OneOrMany`, which tells a client nothing.
//!
//! A field that takes several shapes (a text or a list of texts, ...) is a [`Shape`], read
//! through a `serde_json::Value` (bounded by the body, which is bounded before it is read) and
//! matched against each shape, instead of serde's `untagged`.

use serde::de::{Deserialize, DeserializeOwned, Error as _};
use serde_json::Value;

/// Reads `body` as a `T`. The error starts with the field's path when there is one:
/// "`inputs`: must be a string or a list of strings, got the number 5 at line 1 column 13".
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    let mut reader = serde_json::Deserializer::from_slice(body);
    let value: T = serde_path_to_error::deserialize(&mut reader).map_err(|e| {
        let message = plain(&e.inner().to_string());
        match e.path().to_string().as_str() {
            "." => message,
            path => format!("`{path}`: {message}"),
        }
    })?;
    reader.end().map_err(|e| plain(&e.to_string()))?;
    Ok(value)
}

/// serde's names of Rust's types and containers, in words.
fn plain(message: &str) -> String {
    let mut message = message.to_string();
    for (rust, words) in [
        ("a sequence", "a list"),
        ("a map", "an object"),
        ("usize", "a whole number, 0 or more"),
        ("u64", "a whole number, 0 or more"),
        ("u32", "a whole number from 0 to 4294967295"),
        ("u16", "a whole number from 0 to 65535"),
        ("u8", "a whole number from 0 to 255"),
        ("i64", "a whole number"),
        ("i32", "a whole number from -2147483648 to 2147483647"),
        ("f32", "a number"),
        ("f64", "a number"),
    ] {
        message = message.replace(&format!("expected {rust}"), &format!("expected {words}"));
    }
    message
}

/// What came, in words: never the value of a string (it may be long, or private).
pub fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => format!("the number {n}"),
        Value::String(_) => "a string".into(),
        Value::Array(items) if items.is_empty() => "an empty list".into(),
        Value::Array(items) => format!("a list of {}", items.len()),
        Value::Object(_) => "an object".into(),
    }
}

/// A field's value of one or more shapes, read from JSON.
pub trait Shape: Sized {
    /// What it must be, as a client reads it: "a string".
    const EXPECTED: &'static str;
    /// The same, many of them: "strings".
    const PLURAL: &'static str;
    fn fits(value: &Value) -> bool;
    /// `value`, which [`Shape::fits`].
    fn take(value: Value) -> Self;
}

impl Shape for String {
    const EXPECTED: &'static str = "a string";
    const PLURAL: &'static str = "strings";
    fn fits(value: &Value) -> bool {
        value.is_string()
    }
    fn take(value: Value) -> Self {
        match value {
            Value::String(s) => s,
            _ => unreachable!("fits"),
        }
    }
}

/// Reads a [`Shape`]: a value that fits none of its shapes is refused naming them.
pub fn read<'de, D: serde::Deserializer<'de>, T: Shape>(deserializer: D) -> Result<T, D::Error> {
    let value = Value::deserialize(deserializer)?;
    match T::fits(&value) {
        true => Ok(T::take(value)),
        false => Err(D::Error::custom(format!("must be {}, got {}", T::EXPECTED, describe(&value)))),
    }
}

/// One value or a list of them (TEI's `inputs`).
#[derive(Debug)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> OneOrMany<T> {
    /// The values, and whether they came as a list.
    pub fn into_vec(self) -> (Vec<T>, bool) {
        match self {
            OneOrMany::One(x) => (vec![x], false),
            OneOrMany::Many(v) => (v, true),
        }
    }
}

impl<'de, T: Shape> Deserialize<'de> for OneOrMany<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        if T::fits(&value) {
            return Ok(OneOrMany::One(T::take(value)));
        }
        let got = match &value {
            Value::Array(items) => match items.iter().position(|item| !T::fits(item)) {
                None => {
                    let Value::Array(items) = value else { unreachable!("an array") };
                    return Ok(OneOrMany::Many(items.into_iter().map(T::take).collect()));
                }
                Some(i) => format!("a list whose item [{i}] is {}", describe(&items[i])),
            },
            other => describe(other),
        };
        Err(D::Error::custom(format!("must be {} or a list of {}, got {got}", T::EXPECTED, T::PLURAL)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[serde(expecting = "a JSON object")]
    #[allow(dead_code)]
    struct Request {
        inputs: OneOrMany<String>,
        #[serde(default)]
        top_k: Option<usize>,
        #[serde(default)]
        normalize: bool,
    }

    fn error(body: &str) -> String {
        parse::<Request>(body.as_bytes()).map(|_| ()).unwrap_err()
    }

    #[test]
    fn a_mistake_names_the_field_what_it_must_be_and_what_came() {
        let inputs = error(r#"{"inputs": 5}"#);
        assert!(inputs.starts_with("`inputs`: must be a string or a list of strings, got the number 5"), "{inputs}");
        let item = error(r#"{"inputs": ["a", {"b": 1}]}"#);
        assert!(
            item.starts_with("`inputs`: must be a string or a list of strings, got a list whose item [1] is an object"),
            "{item}"
        );
        let top_k = error(r#"{"inputs": "a", "top_k": -1}"#);
        assert!(top_k.starts_with("`top_k`: ") && top_k.contains("a whole number, 0 or more"), "{top_k}");
        let normalize = error(r#"{"inputs": "a", "normalize": "yes"}"#);
        assert!(normalize.starts_with("`normalize`: invalid type: string"), "{normalize}");
        assert!(error(r#"{}"#).contains("missing field `inputs`"));
        assert!(error("5").contains("expected a JSON object"));
        assert!(error(r#"{"inputs": "a"} x"#).contains("trailing characters"));
        let read = parse::<Request>(br#"{"inputs": ["a", "b"]}"#).unwrap();
        assert!(matches!(read.inputs, OneOrMany::Many(ref v) if v.len() == 2));
    }
}
