//! Read-only questions about an ONNX model file, asked at the protobuf wire level without
//! decoding the whole model: the external data files its weights live in (a model's digest
//! covers them), the lookup tables a run reads a few rows of (mapped, not read, by the shared
//! weights), what computes an output (a classifier's activation), how many nodes of each op
//! type it has. The int8 rewrite ([`crate::load::int8::rewrite`]) reads nodes through the
//! same [`Node`].
//!
//! Field numbers are those of onnx.proto: ModelProto graph = 7, opset_import = 8; GraphProto
//! node = 1, initializer = 5; NodeProto input = 1, output = 2, name = 3, op_type = 4,
//! attribute = 5, domain = 7; AttributeProto name = 1, f = 2, i = 3, g = 6, graphs = 11;
//! TensorProto name = 8, external_data = 13; StringStringEntryProto key = 1, value = 2;
//! OperatorSetIdProto domain = 1, version = 2.

use std::collections::{HashMap, HashSet};

use crate::protowire::{fields, Field, WireError};

/// Why a model file's bytes do not answer a question asked of them.
#[derive(Debug, thiserror::Error)]
pub enum OnnxError {
    #[error("cannot read {}: {error}", path.display())]
    Read { path: std::path::PathBuf, error: std::io::Error },
    #[error("{0}")]
    Wire(#[from] WireError),
    #[error("the file has no graph")]
    NoGraph,
    #[error("the graph's nodes that produce '{0}' form a cycle")]
    Cycle(String),
    #[error("the graph nests subgraphs more than {MAX_NESTING} deep")]
    TooDeep,
}

pub(crate) fn text(payload: &[u8]) -> String {
    String::from_utf8_lossy(payload).into_owned()
}

/// What a node is, read from its bytes.
pub(crate) struct Node<'a> {
    /// Each attribute's name and its bytes as written (field key included).
    pub(crate) attributes: Vec<(String, &'a [u8])>,
    pub(crate) inputs: Vec<String>,
    pub(crate) outputs: Vec<String>,
    pub(crate) name: String,
    pub(crate) op_type: String,
    pub(crate) domain: String,
}

impl<'a> Node<'a> {
    pub(crate) fn read(field: Field<'a>) -> Result<Node<'a>, OnnxError> {
        let mut node = Node {
            attributes: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            name: String::new(),
            op_type: String::new(),
            domain: String::new(),
        };
        for f in fields(field.payload)? {
            match (f.number, f.wire) {
                (1, 2) => node.inputs.push(text(f.payload)),
                (2, 2) => node.outputs.push(text(f.payload)),
                (3, 2) => node.name = text(f.payload),
                (4, 2) => node.op_type = text(f.payload),
                (5, 2) => {
                    let name = fields(f.payload)?.iter().find(|a| a.number == 1).map(|a| text(a.payload));
                    node.attributes.push((name.unwrap_or_default(), f.whole));
                }
                (7, 2) => node.domain = text(f.payload),
                _ => {}
            }
        }
        Ok(node)
    }

    /// An attribute's value as a number (its `i` or its `f`), when the node has it.
    pub(crate) fn number(&self, name: &str) -> Option<f64> {
        let (_, whole) = self.attributes.iter().find(|(n, _)| n == name)?;
        let attribute = fields(whole).ok()?.into_iter().next()?;
        fields(attribute.payload).ok()?.into_iter().find_map(|f| match (f.number, f.wire) {
            (2, 5) => Some(f64::from(f32::from_le_bytes(f.payload.try_into().ok()?))),
            (3, 0) => Some(f.value as i64 as f64),
            _ => None,
        })
    }

    /// How the guard and the report name the node: its name, or its place when it has none.
    pub(crate) fn label(&self, index: usize) -> String {
        match self.name.is_empty() {
            true => format!("#{index} ({})", self.op_type),
            false => self.name.clone(),
        }
    }
}

/// An initializer's name alone (None when it has none), its values not decoded.
pub(crate) fn initializer_name(payload: &[u8]) -> Result<Option<String>, OnnxError> {
    Ok(fields(payload)?.into_iter().find(|f| f.number == 8 && f.wire == 2).map(|f| text(f.payload)))
}

/// The external data files the graph's initializers name (TensorProto external_data = 13,
/// `location` entries), each once, in the order first named. Subgraphs' initializers are not
/// read: exporters put a model's weights in its main graph.
pub fn external_files(model: &[u8]) -> Result<Vec<String>, OnnxError> {
    let (_, graph) = graph_of(model)?;
    let mut files = Vec::new();
    for init in fields(graph)?.into_iter().filter(|f| f.number == 5 && f.wire == 2) {
        if let Some(location) = external_data(init.payload)?.remove("location") {
            if !files.contains(&location) {
                files.push(location);
            }
        }
    }
    Ok(files)
}

/// A tensor's external_data entries (StringStringEntryProto key = 1, value = 2), by key.
fn external_data(tensor: &[u8]) -> Result<HashMap<String, String>, OnnxError> {
    let mut entries = HashMap::new();
    for entry in fields(tensor)?.into_iter().filter(|f| f.number == 13 && f.wire == 2) {
        let parts = fields(entry.payload)?;
        let text_of = |n: u64| parts.iter().find(|p| p.number == n && p.wire == 2).map(|p| text(p.payload));
        if let (Some(key), Some(value)) = (text_of(1), text_of(2)) {
            entries.insert(key, value);
        }
    }
    Ok(entries)
}

/// Where an initializer's bytes lie in an external data file.
#[derive(Debug, PartialEq)]
pub struct Extent {
    pub file: String,
    pub offset: u64,
    pub length: u64,
}

/// The lookup tables among the initializers stored in external data files: tensors of which
/// a run reads a few rows, not the whole (the data input of `Gather`, the embedding tables
/// of com.microsoft `EmbedLayerNormalization`). Each once, in graph order of the initializers.
pub fn lookup_tables(model: &[u8]) -> Result<Vec<Extent>, OnnxError> {
    let (_, graph) = graph_of(model)?;
    let parts = fields(graph)?;
    let mut tables = HashSet::new();
    for f in parts.iter().filter(|f| f.number == 1 && f.wire == 2) {
        let node = Node::read(*f)?;
        let (skip, take) = match (node.op_type.as_str(), node.domain.as_str()) {
            ("Gather", "" | "ai.onnx") => (0, 1),
            // input_ids, segment_ids, then the word, position and segment embeddings.
            ("EmbedLayerNormalization", "com.microsoft") => (2, 3),
            _ => continue,
        };
        tables.extend(node.inputs.iter().skip(skip).take(take).cloned());
    }
    let mut found = Vec::new();
    for init in parts.iter().filter(|f| f.number == 5 && f.wire == 2) {
        let name = initializer_name(init.payload)?;
        if !name.is_some_and(|n| tables.contains(&n)) {
            continue;
        }
        let mut data = external_data(init.payload)?;
        let number = |value: Option<String>| value.and_then(|v| v.parse::<u64>().ok());
        if let (Some(file), offset, Some(length)) =
            (data.remove("location"), number(data.remove("offset")).unwrap_or(0), number(data.remove("length")))
        {
            found.push(Extent { file, offset, length });
        }
    }
    Ok(found)
}

/// Operators that pass their input on without changing its values (shape only).
const PASS_THROUGH: &[&str] = &["Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"];

/// The operator that computes graph value `name`, looking through shape-only operators
/// (exporters often end a graph in Softmax then Identity or Reshape): its op type and label,
/// or None when no node produces it (a graph input or an initializer).
pub fn producer_of(model: &[u8], name: &str) -> Result<Option<(String, String)>, OnnxError> {
    let (_, graph) = graph_of(model)?;
    let mut nodes = Vec::new();
    for (i, f) in fields(graph)?.into_iter().filter(|f| f.number == 1 && f.wire == 2).enumerate() {
        nodes.push((i, Node::read(f)?));
    }
    let mut value = name.to_string();
    // A graph without cycles takes at most one step per node; a file may say otherwise.
    for _ in 0..=nodes.len() {
        let Some((i, node)) = nodes.iter().find(|(_, n)| n.outputs.contains(&value)) else { return Ok(None) };
        match node.inputs.first() {
            Some(input) if PASS_THROUGH.contains(&node.op_type.as_str()) && node.domain.is_empty() => {
                value = input.clone();
            }
            _ => return Ok(Some((node.op_type.clone(), node.label(*i)))),
        }
    }
    Err(OnnxError::Cycle(name.to_string()))
}

pub(crate) fn graph_of(model: &[u8]) -> Result<(Vec<Field<'_>>, &[u8]), OnnxError> {
    let top = fields(model)?;
    let graph = top.iter().find(|f| f.number == 7 && f.wire == 2).ok_or(OnnxError::NoGraph)?.payload;
    Ok((top, graph))
}

/// The model's opset for the default domain ("" or "ai.onnx"); 0 when it names none.
pub(crate) fn default_opset(top: &[Field]) -> Result<u64, OnnxError> {
    let mut version = 0;
    for f in top.iter().filter(|f| f.number == 8 && f.wire == 2) {
        let parts = fields(f.payload)?;
        let domain = parts.iter().find(|p| p.number == 1 && p.wire == 2).map_or(&b""[..], |p| p.payload);
        if domain.is_empty() || domain == b"ai.onnx" {
            version = parts.iter().find(|p| p.number == 2 && p.wire == 0).map_or(0, |p| p.value);
        }
    }
    Ok(version)
}

/// Adds to `read` every value that nodes inside `node`'s subgraphs (the bodies of `If`, `Loop`,
/// `Scan`: AttributeProto g = 6, graphs = 11) take as input, down to [`MAX_NESTING`]: a body
/// may read the outer graph's initializers by name.
pub(crate) fn subgraph_reads(node: &Node, read: &mut HashSet<String>, depth: usize) -> Result<(), OnnxError> {
    if depth > MAX_NESTING {
        return Err(OnnxError::TooDeep);
    }
    for (_, whole) in &node.attributes {
        for attribute in fields(whole)? {
            for body in fields(attribute.payload)?.into_iter().filter(|f| matches!(f.number, 6 | 11) && f.wire == 2) {
                for n in fields(body.payload)?.into_iter().filter(|f| f.number == 1 && f.wire == 2) {
                    let inner = Node::read(n)?;
                    read.extend(inner.inputs.iter().cloned());
                    subgraph_reads(&inner, read, depth + 1)?;
                }
            }
        }
    }
    Ok(())
}

/// How deep [`subgraph_reads`] follows subgraphs (a file could nest them until the stack
/// runs out).
const MAX_NESTING: usize = 64;

/// The op types of a model's nodes, counted (to verify what a rewrite produced).
pub fn op_counts(model: &[u8]) -> Result<HashMap<String, usize>, OnnxError> {
    let (_, graph) = graph_of(model)?;
    let mut counts = HashMap::new();
    for f in fields(graph)?.into_iter().filter(|f| f.number == 1 && f.wire == 2) {
        *counts.entry(Node::read(f)?.op_type).or_default() += 1;
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protowire::{put_bytes, put_number};

    /// A model of just these nodes, named n0, n1, ...: (inputs, outputs, op type).
    fn model_of(nodes: &[(&[&str], &[&str], &str)]) -> Vec<u8> {
        let mut graph = Vec::new();
        for (i, (inputs, outputs, op)) in nodes.iter().enumerate() {
            let mut node = Vec::new();
            for input in *inputs {
                put_bytes(&mut node, 1, input.as_bytes());
            }
            for output in *outputs {
                put_bytes(&mut node, 2, output.as_bytes());
            }
            put_bytes(&mut node, 3, format!("n{i}").as_bytes());
            put_bytes(&mut node, 4, op.as_bytes());
            put_bytes(&mut graph, 1, &node);
        }
        let mut model = Vec::new();
        put_bytes(&mut model, 7, &graph);
        model
    }

    #[test]
    fn lookup_tables_are_the_external_initializers_gather_reads() {
        let mut model = model_of(&[
            (&["table", "ids"], &["rows"], "Gather"),
            (&["rows", "w"], &["y"], "MatMul"),
            (&["small", "ids"], &["z"], "Gather"),
        ]);
        // Initializers after the nodes (the graph is field 7 of the model: append to it).
        let external = |name: &str, entries: &[(&str, &str)]| {
            let mut t = Vec::new();
            put_bytes(&mut t, 8, name.as_bytes());
            for (key, value) in entries {
                let mut e = Vec::new();
                put_bytes(&mut e, 1, key.as_bytes());
                put_bytes(&mut e, 2, value.as_bytes());
                put_bytes(&mut t, 13, &e);
            }
            put_number(&mut t, 14, 1);
            t
        };
        let mut graph = graph_of(&model).unwrap().1.to_vec();
        for t in [
            external("table", &[("location", "w.data"), ("offset", "4096"), ("length", "8192")]),
            external("w", &[("location", "w.data"), ("length", "4096")]),
            // Inside the model file itself: no extent.
            {
                let mut t = Vec::new();
                put_number(&mut t, 1, 2);
                put_number(&mut t, 2, 1); // FLOAT
                put_bytes(&mut t, 8, b"small");
                put_bytes(&mut t, 9, &[0; 8]);
                t
            },
        ] {
            put_bytes(&mut graph, 5, &t);
        }
        model.clear();
        put_bytes(&mut model, 7, &graph);
        let want = Extent { file: "w.data".into(), offset: 4096, length: 8192 };
        assert_eq!(lookup_tables(&model).unwrap(), vec![want], "the MatMul's weight is read whole: not a table");
        assert_eq!(external_files(&model).unwrap(), vec!["w.data".to_string()]);
    }

    #[test]
    fn the_producer_of_an_output_is_found_through_shape_only_operators() {
        let model = model_of(&[
            (&["x", "w"], &["logits"], "MatMul"),
            (&["logits"], &["p"], "Softmax"),
            (&["p", "shape"], &["p2"], "Reshape"),
            (&["p2"], &["probs"], "Identity"),
        ]);
        let found = |name| producer_of(&model, name).unwrap();
        assert_eq!(found("probs"), Some(("Softmax".to_string(), "n1".to_string())));
        assert_eq!(found("logits"), Some(("MatMul".to_string(), "n0".to_string())));
        assert_eq!(found("x"), None, "a graph input");
        // Nodes that feed each other (no valid graph, but a file may say so) end in an error.
        let cycle = model_of(&[(&["b"], &["a"], "Identity"), (&["a"], &["b"], "Identity")]);
        assert!(producer_of(&cycle, "a").unwrap_err().to_string().contains("cycle"));
    }
}
