//! An ONNX model rewritten for int8 execution, at the protobuf wire level: every fp32 `MatMul`
//! whose weight is a 2-D initializer becomes ONNX Runtime's `DynamicQuantizeMatMul`
//! (com.microsoft: the activation quantised to uint8 at run time, the weight int8 per output
//! column, symmetric), and every fused `Attention` (com.microsoft, as ORT's transformer
//! optimiser writes it) a `DynamicQuantizeLinear` of its input feeding a `QAttention` with the
//! same int8 weights and the node's own attributes. Everything else in the file (other nodes, attributes, metadata, value
//! infos, doc strings, fields this code does not know) is copied byte for byte, so nothing a
//! newer exporter wrote is lost in a decode and re-encode.
//!
//! Field numbers are those of onnx.proto: ModelProto graph = 7, opset_import = 8; GraphProto
//! node = 1, initializer = 5, input = 11; NodeProto input = 1, output = 2, name = 3,
//! op_type = 4, attribute = 5, domain = 7; AttributeProto name = 1; TensorProto dims = 1, data_type = 2, float_data = 4, name = 8,
//! raw_data = 9, data_location = 14; OperatorSetIdProto domain = 1, version = 2.

use std::collections::{HashMap, HashSet};

use crate::protowire::{fields, varint, Field};

/// TensorProto.DataType values used here.
const FLOAT: u64 = 1;
const INT8: u64 = 3;

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_bytes(out: &mut Vec<u8>, number: u64, payload: &[u8]) {
    put_varint(out, number << 3 | 2);
    put_varint(out, payload.len() as u64);
    out.extend_from_slice(payload);
}

fn put_number(out: &mut Vec<u8>, number: u64, value: u64) {
    put_varint(out, number << 3);
    put_varint(out, value);
}

fn text(payload: &[u8]) -> String {
    String::from_utf8_lossy(payload).into_owned()
}

/// What a node is, read from its bytes.
struct Node<'a> {
    /// Each attribute's name and its bytes as written (field key included).
    attributes: Vec<(String, &'a [u8])>,
    inputs: Vec<String>,
    outputs: Vec<String>,
    name: String,
    op_type: String,
    domain: String,
}

impl<'a> Node<'a> {
    fn read(field: Field<'a>) -> Result<Node<'a>, String> {
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

    /// How the guard and the report name the node: its name, or its place when it has none.
    fn label(&self, index: usize) -> String {
        match self.name.is_empty() {
            true => format!("#{index} ({})", self.op_type),
            false => self.name.clone(),
        }
    }
}

/// An fp32 initializer's values and shape, when it is stored in the file itself.
struct Weight {
    dims: Vec<u64>,
    values: Vec<f32>,
}

/// An initializer's name, and its values when it is a float tensor in the file itself.
fn initializer(payload: &[u8]) -> Result<(String, Option<Weight>), String> {
    let (mut name, mut dims, mut data_type, mut raw, mut floats, mut external) =
        (String::new(), Vec::new(), 0, None, Vec::new(), false);
    for f in fields(payload)? {
        match (f.number, f.wire) {
            (1, 0) => dims.push(f.value),
            (1, 2) => {
                let mut packed = f.payload;
                while !packed.is_empty() {
                    dims.push(varint(&mut packed)?);
                }
            }
            (2, 0) => data_type = f.value,
            (4, 2) => floats.extend(f.payload.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
            (4, 5) => floats.push(f32::from_le_bytes([f.payload[0], f.payload[1], f.payload[2], f.payload[3]])),
            (8, 2) => name = text(f.payload),
            (9, 2) => raw = Some(f.payload),
            (14, 0) => external = f.value == 1,
            _ => {}
        }
    }
    if data_type != FLOAT || external {
        return Ok((name, None));
    }
    let values = match raw {
        Some(raw) => raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        None => floats,
    };
    let count: u64 = dims.iter().product();
    Ok((name, (values.len() as u64 == count).then_some(Weight { dims, values })))
}

fn tensor(name: &str, data_type: u64, dims: &[u64], raw: &[u8]) -> Vec<u8> {
    let mut t = Vec::with_capacity(raw.len() + name.len() + 32);
    for &d in dims {
        put_number(&mut t, 1, d);
    }
    put_number(&mut t, 2, data_type);
    put_bytes(&mut t, 8, name.as_bytes());
    put_bytes(&mut t, 9, raw);
    t
}

/// How the weights are quantised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Range {
    /// Int8 in [-127, 127]: for CPUs with VNNI, whose u8 x s8 products do not saturate.
    Full,
    /// Int8 in [-63, 63] (7 bits): without VNNI, the AVX2 u8 x s8 kernels add pairs of
    /// products into 16 bits, which full-range weights can saturate (ORT's `reduce_range`).
    Reduced,
}

/// Per output column: the largest magnitude maps to the range's end; zero point 0.
fn quantize(weight: &Weight, range: Range) -> (Vec<u8>, Vec<u8>) {
    let (rows, cols) = (weight.dims[0] as usize, weight.dims[1] as usize);
    let top = match range {
        Range::Full => 127.0f32,
        Range::Reduced => 63.0,
    };
    let mut scales = vec![0f32; cols];
    for row in weight.values.chunks_exact(cols) {
        for (s, v) in scales.iter_mut().zip(row) {
            *s = s.max(v.abs());
        }
    }
    for s in &mut scales {
        *s = if *s > 0.0 { *s / top } else { 1.0 };
    }
    let mut q = Vec::with_capacity(rows * cols);
    for row in weight.values.chunks_exact(cols) {
        q.extend(row.iter().zip(&scales).map(|(v, s)| (v / s).round().clamp(-top, top) as i8 as u8));
    }
    (q, scales.iter().flat_map(|s| s.to_le_bytes()).collect())
}

/// The rewritten model and the names of the nodes it quantised.
pub struct Quantized {
    pub bytes: Vec<u8>,
    pub nodes: Vec<String>,
}

/// The fp32 MatMul nodes that can be quantised: their weight is a 2-D float initializer in
/// the file. By name, in graph order.
pub fn candidates(model: &[u8]) -> Result<Vec<String>, String> {
    let (_, graph) = graph_of(model)?;
    let parts = fields(graph)?;
    let weights = float_matrices(&parts)?;
    let mut out = Vec::new();
    for (i, f) in parts.iter().filter(|f| f.number == 1 && f.wire == 2).enumerate() {
        let node = Node::read(*f)?;
        if eligible(&node, &weights) {
            out.push(node.label(i));
        }
    }
    Ok(out)
}

/// The external data files the graph's initializers name (TensorProto external_data = 13,
/// `location` entries), each once, in the order first named. Subgraphs' initializers are not
/// read: exporters put a model's weights in its main graph.
pub fn external_files(model: &[u8]) -> Result<Vec<String>, String> {
    let (_, graph) = graph_of(model)?;
    let mut files = Vec::new();
    for init in fields(graph)?.into_iter().filter(|f| f.number == 5 && f.wire == 2) {
        for entry in fields(init.payload)?.into_iter().filter(|f| f.number == 13 && f.wire == 2) {
            let parts = fields(entry.payload)?;
            let text_of = |n: u64| parts.iter().find(|p| p.number == n && p.wire == 2).map(|p| text(p.payload));
            if let (Some(key), Some(value)) = (text_of(1), text_of(2)) {
                if key == "location" && !files.contains(&value) {
                    files.push(value);
                }
            }
        }
    }
    Ok(files)
}

/// Operators that pass their input on without changing its values (shape only).
const PASS_THROUGH: &[&str] = &["Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"];

/// The operator that computes graph value `name`, looking through shape-only operators
/// (exporters often end a graph in Softmax then Identity or Reshape): its op type and label,
/// or None when no node produces it (a graph input or an initializer).
pub fn producer_of(model: &[u8], name: &str) -> Result<Option<(String, String)>, String> {
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
    Err(format!("the graph's nodes that produce '{name}' form a cycle"))
}

/// What QAttention takes of a fused Attention's attributes (one with any other, such as
/// `qkv_hidden_sizes`, stays fp32).
const QATTENTION_ATTRIBUTES: &[&str] =
    &["num_heads", "unidirectional", "do_rotary", "past_present_share_buffer", "mask_filter_value", "scale"];

fn eligible(node: &Node, weights: &HashSet<String>) -> bool {
    let weight = node.inputs.get(1).is_some_and(|w| weights.contains(w));
    match (node.op_type.as_str(), node.domain.as_str()) {
        ("MatMul", "" | "ai.onnx") => node.inputs.len() == 2 && weight,
        // input, weight, bias and the mask: no past state or attention bias.
        ("Attention", "com.microsoft") => {
            weight
                && (3..=4).contains(&node.inputs.len())
                && !node.inputs[2].is_empty()
                && node.attributes.iter().all(|(name, _)| QATTENTION_ATTRIBUTES.contains(&name.as_str()))
        }
        _ => false,
    }
}

/// A node's bytes: inputs, outputs, name, op type, domain, then the attributes as written.
fn node_bytes(
    inputs: &[&str],
    outputs: &[String],
    name: &str,
    op_type: &str,
    domain: &str,
    attributes: &[&[u8]],
) -> Vec<u8> {
    let mut n = Vec::new();
    for input in inputs {
        put_bytes(&mut n, 1, input.as_bytes());
    }
    for output in outputs {
        put_bytes(&mut n, 2, output.as_bytes());
    }
    put_bytes(&mut n, 3, name.as_bytes());
    put_bytes(&mut n, 4, op_type.as_bytes());
    for a in attributes {
        n.extend_from_slice(a);
    }
    if !domain.is_empty() {
        put_bytes(&mut n, 7, domain.as_bytes());
    }
    n
}

fn graph_of(model: &[u8]) -> Result<(Vec<Field<'_>>, &[u8]), String> {
    let top = fields(model)?;
    let graph = top.iter().find(|f| f.number == 7 && f.wire == 2).ok_or("the file has no graph")?.payload;
    Ok((top, graph))
}

/// Names of the graph's 2-D fp32 initializers stored in the file.
fn float_matrices(parts: &[Field]) -> Result<HashSet<String>, String> {
    let mut names = HashSet::new();
    for f in parts.iter().filter(|f| f.number == 5 && f.wire == 2) {
        if let (name, Some(w)) = initializer(f.payload)? {
            if w.dims.len() == 2 && w.dims.iter().all(|&d| d > 0) {
                names.insert(name);
            }
        }
    }
    Ok(names)
}

/// Quantises every candidate MatMul except those named in `keep`.
pub fn rewrite(model: &[u8], keep: &HashSet<String>, range: Range) -> Result<Quantized, String> {
    let (top, graph) = graph_of(model)?;
    let parts = fields(graph)?;
    let weights = float_matrices(&parts)?;
    let nodes: Vec<Node> =
        parts.iter().filter(|f| f.number == 1 && f.wire == 2).map(|f| Node::read(*f)).collect::<Result<_, _>>()?;
    let chosen: Vec<(usize, &Node)> =
        nodes.iter().enumerate().filter(|(i, n)| eligible(n, &weights) && !keep.contains(&n.label(*i))).collect();
    let quantized: HashSet<usize> = chosen.iter().map(|(i, _)| *i).collect();
    // A weight stays in fp32 as well if anything but a quantised MatMul reads it.
    let mut still_read: HashSet<&str> = HashSet::new();
    for (_, n) in nodes.iter().enumerate().filter(|(i, _)| !quantized.contains(i)) {
        still_read.extend(n.inputs.iter().map(String::as_str));
    }
    for f in parts.iter().filter(|f| matches!(f.number, 11 | 12)) {
        // Graph inputs and outputs (an initializer may be listed as an input in old files).
        if let Some(name) = fields(f.payload)?.iter().find(|v| v.number == 1) {
            still_read.insert(std::str::from_utf8(name.payload).unwrap_or_default());
        }
    }
    let wanted: HashSet<&str> = chosen.iter().map(|(_, n)| n.inputs[1].as_str()).collect();
    let mut new_tensors: HashMap<String, Vec<Vec<u8>>> = HashMap::new();
    let mut out_graph = Vec::with_capacity(graph.len());
    let mut index = 0;
    for f in &parts {
        match (f.number, f.wire) {
            (1, 2) => {
                let node = &nodes[index];
                index += 1;
                if !quantized.contains(&(index - 1)) {
                    out_graph.extend_from_slice(f.whole);
                    continue;
                }
                let w = &node.inputs[1];
                let (w_int8, w_scale, w_zero) = (format!("{w}_int8"), format!("{w}_scale"), format!("{w}_zero"));
                if node.op_type == "MatMul" {
                    let inputs = [node.inputs[0].as_str(), &w_int8, &w_scale, &w_zero];
                    let n =
                        node_bytes(&inputs, &node.outputs, &node.name, "DynamicQuantizeMatMul", "com.microsoft", &[]);
                    put_bytes(&mut out_graph, 1, &n);
                    continue;
                }
                // Attention: its input quantised at run time, then QAttention.
                let base = format!("{}_{}", node.outputs[0], index - 1);
                let quantized =
                    [format!("{base}_input_int8"), format!("{base}_input_scale"), format!("{base}_input_zero")];
                let n = node_bytes(
                    &[node.inputs[0].as_str()],
                    &quantized,
                    &format!("{base}_quantize"),
                    "DynamicQuantizeLinear",
                    "",
                    &[],
                );
                put_bytes(&mut out_graph, 1, &n);
                let mask = node.inputs.get(3).map_or("", String::as_str);
                let inputs =
                    [&quantized[0], &w_int8, &node.inputs[2], &quantized[1], &w_scale, mask, &quantized[2], &w_zero];
                let inputs: Vec<&str> = inputs.iter().map(|s| s.as_ref()).collect();
                let attributes: Vec<&[u8]> = node.attributes.iter().map(|(_, bytes)| *bytes).collect();
                let n = node_bytes(&inputs, &node.outputs, &node.name, "QAttention", "com.microsoft", &attributes);
                put_bytes(&mut out_graph, 1, &n);
            }
            (5, 2) => {
                let (name, weight) = initializer(f.payload)?;
                match weight {
                    Some(weight) if wanted.contains(name.as_str()) => {
                        let (q, scales) = quantize(&weight, range);
                        let cols = weight.dims[1];
                        let made = vec![
                            tensor(&format!("{name}_int8"), INT8, &weight.dims, &q),
                            tensor(&format!("{name}_scale"), FLOAT, &[cols], &scales),
                            tensor(&format!("{name}_zero"), INT8, &[cols], &vec![0u8; cols as usize]),
                        ];
                        new_tensors.insert(name.clone(), made);
                        if still_read.contains(name.as_str()) {
                            out_graph.extend_from_slice(f.whole);
                        }
                    }
                    _ => out_graph.extend_from_slice(f.whole),
                }
            }
            _ => out_graph.extend_from_slice(f.whole),
        }
    }
    let mut names: Vec<&String> = new_tensors.keys().collect();
    names.sort();
    for name in names {
        for t in &new_tensors[name] {
            put_bytes(&mut out_graph, 5, t);
        }
    }
    // The model: every field as it was, the graph replaced, com.microsoft imported.
    let mut out = Vec::with_capacity(out_graph.len() + 1024);
    let mut has_ms = false;
    for f in &top {
        if f.number == 8 && f.wire == 2 {
            has_ms |= fields(f.payload)?.iter().any(|v| v.number == 1 && v.payload == b"com.microsoft");
        }
    }
    for f in &top {
        if f.number == 7 && f.wire == 2 {
            put_bytes(&mut out, 7, &out_graph);
        } else {
            out.extend_from_slice(f.whole);
        }
    }
    if !has_ms && !chosen.is_empty() {
        let mut opset = Vec::new();
        put_bytes(&mut opset, 1, b"com.microsoft");
        put_number(&mut opset, 2, 1);
        put_bytes(&mut out, 8, &opset);
    }
    Ok(Quantized { bytes: out, nodes: chosen.iter().map(|(i, n)| n.label(*i)).collect() })
}

/// The op types of a model's nodes, counted (to verify what a rewrite produced).
pub fn op_counts(model: &[u8]) -> Result<HashMap<String, usize>, String> {
    let (_, graph) = graph_of(model)?;
    let mut counts = HashMap::new();
    for f in fields(graph)?.into_iter().filter(|f| f.number == 1 && f.wire == 2) {
        *counts.entry(Node::read(f)?.op_type).or_default() += 1;
    }
    Ok(counts)
}

/// The weight range that is exact on this CPU: full with VNNI (AVX-512 VNNI or AVX-VNNI, whose
/// u8 x s8 dot products accumulate in 32 bits), reduced without.
pub fn host_range() -> Range {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = cpuinfo.lines().find(|l| l.starts_with("flags")).unwrap_or("");
    match flags.split_whitespace().any(|f| f == "avx512_vnni" || f == "avx_vnni") {
        true => Range::Full,
        false => Range::Reduced,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model of just these nodes: (inputs, outputs, op type).
    fn model_of(nodes: &[(&[&str], &[&str], &str)]) -> Vec<u8> {
        let mut graph = Vec::new();
        for (i, (inputs, outputs, op)) in nodes.iter().enumerate() {
            let outputs: Vec<String> = outputs.iter().map(|o| o.to_string()).collect();
            put_bytes(&mut graph, 1, &node_bytes(inputs, &outputs, &format!("n{i}"), op, "", &[]));
        }
        let mut model = Vec::new();
        put_bytes(&mut model, 7, &graph);
        model
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
        assert!(producer_of(&cycle, "a").unwrap_err().contains("cycle"));
    }

    #[test]
    fn columns_are_scaled_by_their_own_largest_magnitude() {
        let w = Weight { dims: vec![2, 3], values: vec![1.0, -0.5, 0.0, -2.0, 0.25, 0.0] };
        let (q, scales) = quantize(&w, Range::Full);
        let scales: Vec<f32> = scales.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(scales, vec![2.0 / 127.0, 0.5 / 127.0, 1.0]);
        let q: Vec<i8> = q.into_iter().map(|b| b as i8).collect();
        assert_eq!(q, vec![64, -127, 0, -127, 64, 0]);
        let (q, _) = quantize(&w, Range::Reduced);
        assert_eq!(q[3] as i8, -63);
    }

    #[test]
    fn a_model_without_a_graph_is_refused_with_a_reason() {
        assert!(candidates(&[0x08, 0x07]).unwrap_err().contains("no graph"));
        assert!(rewrite(&[0x3a, 0x05, 0x01], &HashSet::new(), Range::Full).is_err());
    }
}
