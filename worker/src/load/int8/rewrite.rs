//! An ONNX model rewritten for int8 execution, at the protobuf wire level: every fp32 `MatMul`
//! whose weight is a 2-D initializer becomes ONNX Runtime's `DynamicQuantizeMatMul`
//! (com.microsoft: the activation quantised to uint8 at run time, the weight int8 per output
//! column, symmetric), and so does every `Gemm` that is such a MatMul plus a bias (its weight
//! transposed first when `transB` says so), and every fused `Attention` (com.microsoft, as ORT's
//! transformer optimiser writes it) a `DynamicQuantizeLinear` of its input feeding a
//! `QAttention` with the same int8 weights and the node's own attributes. Everything else in
//! the file (other nodes, attributes, metadata, value infos, doc strings, fields this code does
//! not know) is copied byte for byte, so nothing a newer exporter wrote is lost in a decode and
//! re-encode. Nodes are read as [`crate::onnx`] reads them.
//!
//! Field numbers are those of onnx.proto: ModelProto graph = 7, opset_import = 8; GraphProto
//! node = 1, initializer = 5, input = 11; NodeProto input = 1, output = 2, name = 3,
//! op_type = 4, attribute = 5, domain = 7; AttributeProto name = 1, f = 2, i = 3; TensorProto
//! dims = 1, data_type = 2, float_data = 4, name = 8, raw_data = 9, data_location = 14;
//! OperatorSetIdProto domain = 1, version = 2.

use std::collections::{HashMap, HashSet};

use crate::onnx::{default_opset, graph_of, initializer_name, subgraph_reads, text, Node, OnnxError};
use crate::protowire::{fields, put_bytes, put_number, varint, Field};

/// TensorProto.DataType values used here.
const FLOAT: u64 = 1;
const UINT8: u64 = 2;
const INT8: u64 = 3;

/// An fp32 initializer's values and shape, when it is stored in the file itself.
struct Weight {
    dims: Vec<u64>,
    values: Vec<f32>,
}

/// An initializer's name, and its values when it is a float tensor in the file itself.
fn initializer(payload: &[u8]) -> Result<(String, Option<Weight>), OnnxError> {
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
    // Dims are the file's word: a product past u64 is no tensor this file holds.
    let count = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
    Ok((name, (count == Some(values.len() as u64)).then_some(Weight { dims, values })))
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

/// How the weights are quantised: the formulation of every node the rewrite quantises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Range {
    /// Int8 in [-127, 127]: for CPUs with VNNI, whose u8 x s8 products do not saturate.
    Full,
    /// Int8 in [-63, 63] (7 bits): without VNNI, the AVX2 u8 x s8 kernels add pairs of
    /// products into 16 bits, which full-range weights can saturate (ORT's `reduce_range`).
    Reduced,
    /// Uint8 in [1, 255] about a zero point of 128 (the full range's 8 bits, shifted): ORT's
    /// u8 x u8 kernels without VNNI widen both to 16 bits before they multiply and add pairs
    /// into 32 bits, so nothing saturates; fewer products a cycle than u8 x s8's.
    Unsigned,
}

impl Range {
    /// The formulations whose products `cpu`'s kernels add exactly, for the guard to measure:
    /// with VNNI the full range; without, 7-bit s8 weights and 8-bit u8 ones.
    pub fn candidates(cpu: crate::runtime::cpu::Class) -> &'static [Range] {
        match cpu.vnni() {
            true => &[Range::Full],
            false => &[Range::Reduced, Range::Unsigned],
        }
    }

    /// The type of its weights.
    pub fn weight_type(self) -> &'static str {
        match self {
            Range::Full | Range::Reduced => "s8",
            Range::Unsigned => "u8",
        }
    }

    /// The bits of its weights.
    pub fn bits(self) -> u8 {
        match self {
            Range::Full | Range::Unsigned => 8,
            Range::Reduced => 7,
        }
    }

    /// The formulation of a node rewritten with weights of this range.
    pub fn formulation(self) -> &'static str {
        match self {
            Range::Full => "u8 activations x s8 weights of 8 bits per output column",
            Range::Reduced => "u8 activations x s8 weights of 7 bits per output column (reduce_range)",
            Range::Unsigned => "u8 activations x u8 weights of 8 bits per output column (zero point 128)",
        }
    }
}

/// A matrix's transpose (`Gemm`'s `transB`: the weight stored as [columns, rows]).
fn transpose(weight: &Weight) -> Weight {
    let (rows, cols) = (weight.dims[0] as usize, weight.dims[1] as usize);
    let mut values = vec![0f32; rows * cols];
    for (r, row) in weight.values.chunks_exact(cols).enumerate() {
        for (c, v) in row.iter().enumerate() {
            values[c * rows + r] = *v;
        }
    }
    Weight { dims: vec![weight.dims[1], weight.dims[0]], values }
}

/// Per output column: the largest magnitude maps to the range's end; zero point 0 (128 for
/// [`Range::Unsigned`], whose values are the full range's plus 128).
fn quantize(weight: &Weight, range: Range) -> (Vec<u8>, Vec<u8>) {
    let (rows, cols) = (weight.dims[0] as usize, weight.dims[1] as usize);
    let top = match range {
        Range::Full | Range::Unsigned => 127.0f32,
        Range::Reduced => 63.0,
    };
    let shift = if range == Range::Unsigned { 128 } else { 0 };
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
        q.extend(row.iter().zip(&scales).map(|(v, s)| ((v / s).round().clamp(-top, top) as i32 + shift) as u8));
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
pub fn candidates(model: &[u8]) -> Result<Vec<String>, OnnxError> {
    let (top, graph) = graph_of(model)?;
    let opset = default_opset(&top)?;
    let parts = fields(graph)?;
    let weights = float_tensors(&parts)?;
    let mut out = Vec::new();
    for (i, f) in parts.iter().filter(|f| f.number == 1 && f.wire == 2).enumerate() {
        let node = Node::read(*f)?;
        if eligible(&node, &weights, opset) {
            out.push(node.label(i));
        }
    }
    Ok(out)
}

/// What QAttention takes of a fused Attention's attributes (one with any other, such as
/// `qkv_hidden_sizes`, stays fp32).
const QATTENTION_ATTRIBUTES: &[&str] =
    &["num_heads", "unidirectional", "do_rotary", "past_present_share_buffer", "mask_filter_value", "scale"];

/// Whether `node` can be quantised, `weights` the dims of the float initializers in the file,
/// `opset` the model's default-domain opset (a fused Attention's input is quantised by
/// `DynamicQuantizeLinear`, which needs 11).
fn eligible(node: &Node, weights: &HashMap<String, Vec<u64>>, opset: u64) -> bool {
    let dims = |i: usize| node.inputs.get(i).and_then(|w| weights.get(w));
    let weight = dims(1).is_some_and(|d| d.len() == 2 && d.iter().all(|&n| n > 0));
    match (node.op_type.as_str(), node.domain.as_str()) {
        ("MatMul", "" | "ai.onnx") => node.inputs.len() == 2 && weight,
        // A MatMul plus a bias of one value per output column: alpha and beta 1, A as it is.
        ("Gemm", "" | "ai.onnx") => {
            let attribute = |name, default| node.number(name).unwrap_or(default);
            let columns = dims(1).map(|d| d.get(usize::from(attribute("transB", 0.0) == 0.0)).copied().unwrap_or(0));
            let bias = match node.inputs.get(2).filter(|c| !c.is_empty()) {
                None => true,
                Some(_) => {
                    attribute("beta", 1.0) == 1.0 && dims(2).is_some_and(|d| d.len() == 1 && Some(d[0]) == columns)
                }
            };
            weight
                && node.inputs.len() <= 3
                && attribute("alpha", 1.0) == 1.0
                && attribute("transA", 0.0) == 0.0
                && bias
        }
        // input, weight, bias and the mask: no past state or attention bias.
        ("Attention", "com.microsoft") => {
            weight
                && opset >= 11
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

/// Names ending in each of `suffixes` after one stem, `stem` itself when none of them is in
/// `taken`, else `stem_1`, `stem_2`, ...; `taken` then holds them too.
fn fresh<const N: usize>(stem: &str, suffixes: [&str; N], taken: &mut HashSet<String>) -> [String; N] {
    let mut n = 0;
    loop {
        let base = if n == 0 { stem.to_string() } else { format!("{stem}_{n}") };
        let names = suffixes.map(|s| format!("{base}_{s}"));
        if names.iter().all(|name| !taken.contains(name)) {
            taken.extend(names.iter().cloned());
            return names;
        }
        n += 1;
    }
}

/// The graph's fp32 initializers stored in the file: their dims, by name.
fn float_tensors(parts: &[Field]) -> Result<HashMap<String, Vec<u64>>, OnnxError> {
    let mut found = HashMap::new();
    for f in parts.iter().filter(|f| f.number == 5 && f.wire == 2) {
        if let (name, Some(w)) = initializer(f.payload)? {
            found.insert(name, w.dims);
        }
    }
    Ok(found)
}

/// Whether a quantised node reads its weight transposed (a `Gemm` with `transB`).
fn transposed(node: &Node) -> bool {
    node.op_type == "Gemm" && node.number("transB").is_some_and(|t| t != 0.0)
}

/// Quantises every candidate MatMul except those named in `keep`.
pub fn rewrite(model: &[u8], keep: &HashSet<String>, range: Range) -> Result<Quantized, OnnxError> {
    let (top, graph) = graph_of(model)?;
    let opset = default_opset(&top)?;
    let parts = fields(graph)?;
    let weights = float_tensors(&parts)?;
    let nodes: Vec<Node> =
        parts.iter().filter(|f| f.number == 1 && f.wire == 2).map(|f| Node::read(*f)).collect::<Result<_, _>>()?;
    let chosen: Vec<(usize, &Node)> = nodes
        .iter()
        .enumerate()
        .filter(|(i, n)| eligible(n, &weights, opset) && !keep.contains(&n.label(*i)))
        .collect();
    let quantized: HashSet<usize> = chosen.iter().map(|(i, _)| *i).collect();
    // A weight stays in fp32 as well if anything but a quantised MatMul reads it.
    let mut still_read: HashSet<String> = HashSet::new();
    for (_, n) in nodes.iter().enumerate().filter(|(i, _)| !quantized.contains(i)) {
        still_read.extend(n.inputs.iter().cloned());
        subgraph_reads(n, &mut still_read, 1)?;
    }
    for f in parts.iter().filter(|f| matches!(f.number, 11 | 12)) {
        // Graph inputs and outputs (an initializer may be listed as an input in old files).
        if let Some(name) = fields(f.payload)?.iter().find(|v| v.number == 1) {
            still_read.insert(text(name.payload));
        }
    }
    // Every name in use, so that the new ones clash with none: initializers, values read or
    // written (subgraphs' reads included), graph inputs and outputs.
    let mut taken: HashSet<String> = still_read.clone();
    for f in parts.iter().filter(|f| f.number == 5 && f.wire == 2) {
        taken.extend(initializer_name(f.payload)?);
    }
    for n in &nodes {
        taken.extend(n.inputs.iter().chain(&n.outputs).cloned());
    }
    // Each weight to quantise, as it is and/or transposed, and the names of its int8 values,
    // scales and zero points (`<weight>[_t]_int8`, `_scale`, `_zero` unless taken).
    let mut wanted: Vec<(&str, bool)> = chosen.iter().map(|(_, n)| (n.inputs[1].as_str(), transposed(n))).collect();
    wanted.sort();
    wanted.dedup();
    let mut quantized_names: HashMap<(&str, bool), [String; 3]> = HashMap::new();
    for &(weight, t) in &wanted {
        let stem = if t { format!("{weight}_t") } else { weight.to_string() };
        quantized_names.insert((weight, t), fresh(&stem, ["int8", "scale", "zero"], &mut taken));
    }
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
                let [w_int8, w_scale, w_zero] = &quantized_names[&(node.inputs[1].as_str(), transposed(node))];
                if node.op_type != "Attention" {
                    // MatMul, or Gemm with its bias (the optional fifth input).
                    let mut inputs = vec![node.inputs[0].as_str(), w_int8, w_scale, w_zero];
                    inputs.extend(node.inputs.get(2).filter(|c| !c.is_empty()).map(String::as_str));
                    let n =
                        node_bytes(&inputs, &node.outputs, &node.name, "DynamicQuantizeMatMul", "com.microsoft", &[]);
                    put_bytes(&mut out_graph, 1, &n);
                    continue;
                }
                // Attention: its input quantised at run time, then QAttention.
                let base = format!("{}_{}", node.outputs[0], index - 1);
                let quantized = fresh(&base, ["input_int8", "input_scale", "input_zero"], &mut taken);
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
                    [&quantized[0], w_int8, &node.inputs[2], &quantized[1], w_scale, mask, &quantized[2], w_zero];
                let inputs: Vec<&str> = inputs.iter().map(|s| s.as_ref()).collect();
                let attributes: Vec<&[u8]> = node.attributes.iter().map(|(_, bytes)| *bytes).collect();
                let n = node_bytes(&inputs, &node.outputs, &node.name, "QAttention", "com.microsoft", &attributes);
                put_bytes(&mut out_graph, 1, &n);
            }
            (5, 2) => {
                let (name, weight) = initializer(f.payload)?;
                match weight {
                    Some(weight) if wanted.iter().any(|(w, _)| *w == name) => {
                        let mut made = Vec::new();
                        let forms = wanted.iter().filter(|(w, _)| *w == name).map(|(_, t)| *t);
                        for t in forms {
                            let turned;
                            let weight = match t {
                                true => {
                                    turned = transpose(&weight);
                                    &turned
                                }
                                false => &weight,
                            };
                            let (q, scales) = quantize(weight, range);
                            let cols = weight.dims[1];
                            let [w_int8, w_scale, w_zero] = &quantized_names[&(name.as_str(), t)];
                            let (data_type, zero) = match range {
                                Range::Unsigned => (UINT8, 128u8),
                                Range::Full | Range::Reduced => (INT8, 0),
                            };
                            made.push(tensor(w_int8, data_type, &weight.dims, &q));
                            made.push(tensor(w_scale, FLOAT, &[cols], &scales));
                            made.push(tensor(w_zero, data_type, &[cols], &vec![zero; cols as usize]));
                        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::onnx::op_counts;
    use crate::protowire::put_varint;

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
        // Unsigned: the full range's values about 128.
        let (q, unsigned_scales) = quantize(&w, Range::Unsigned);
        assert_eq!(q, vec![192, 1, 128, 1, 192, 128]);
        assert_eq!(unsigned_scales, quantize(&w, Range::Full).1);
    }

    /// An INT (`i`) or FLOAT (`f`) attribute's bytes, field key included.
    fn attribute(name: &str, i: Option<u64>, f: Option<f32>) -> Vec<u8> {
        let mut a = Vec::new();
        put_bytes(&mut a, 1, name.as_bytes());
        if let Some(f) = f {
            put_varint(&mut a, 2 << 3 | 5);
            a.extend_from_slice(&f.to_le_bytes());
        }
        if let Some(i) = i {
            put_number(&mut a, 3, i);
        }
        let mut whole = Vec::new();
        put_bytes(&mut whole, 5, &a);
        whole
    }

    #[test]
    fn a_gemm_that_is_a_matmul_plus_bias_is_quantised_with_its_weight_transposed() {
        let mut graph = Vec::new();
        let gemm = |name: &str, bias: &str, attributes: &[Vec<u8>]| {
            let attributes: Vec<&[u8]> = attributes.iter().map(Vec::as_slice).collect();
            node_bytes(&["x", "w", bias], &["y".to_string()], name, "Gemm", "", &attributes)
        };
        let trans_b = attribute("transB", Some(1), None);
        put_bytes(&mut graph, 1, &gemm("plain", "b", std::slice::from_ref(&trans_b)));
        put_bytes(&mut graph, 1, &gemm("scaled", "b", &[trans_b.clone(), attribute("alpha", None, Some(2.0))]));
        put_bytes(&mut graph, 1, &gemm("wide_bias", "b2", std::slice::from_ref(&trans_b)));
        // w is [2, 3] read transposed: 3 inputs, 2 outputs; b has one value per output.
        put_bytes(&mut graph, 5, &tensor("w", FLOAT, &[2, 3], &floats(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])));
        put_bytes(&mut graph, 5, &tensor("b", FLOAT, &[2], &floats(&[0.5, -0.5])));
        put_bytes(&mut graph, 5, &tensor("b2", FLOAT, &[2, 2], &floats(&[0.0; 4])));
        let mut model = Vec::new();
        put_bytes(&mut model, 7, &graph);
        assert_eq!(candidates(&model).unwrap(), vec!["plain".to_string()], "alpha 2 and a 2-D bias are not");
        let rewritten = rewrite(&model, &HashSet::new(), Range::Full).unwrap();
        let counts = op_counts(&rewritten.bytes).unwrap();
        assert_eq!((counts["DynamicQuantizeMatMul"], counts["Gemm"]), (1, 2), "{counts:?}");
        // The int8 weight is the transpose, [3, 2], scaled per output column (3 and 6 map to 127).
        let (_, graph) = graph_of(&rewritten.bytes).unwrap();
        let stored = fields(graph).unwrap().into_iter().filter(|f| f.number == 5).find_map(|f| {
            let parts = fields(f.payload).unwrap();
            let named = parts.iter().any(|p| p.number == 8 && p.payload == b"w_t_int8");
            let dims: Vec<u64> = parts.iter().filter(|p| p.number == 1).map(|p| p.value).collect();
            named.then(|| (dims, parts.iter().find(|p| p.number == 9).unwrap().payload.to_vec()))
        });
        let (dims, raw) = stored.expect("w_t_int8 stored");
        assert_eq!(dims, vec![3, 2]);
        assert_eq!(raw.iter().map(|b| *b as i8).collect::<Vec<_>>(), vec![42, 85, 85, 106, 127, 127]);
        // The node reads the quantised weight and keeps its bias.
        let node = fields(graph).unwrap().into_iter().find(|f| f.number == 1).map(|f| Node::read(f).unwrap()).unwrap();
        assert_eq!(node.op_type, "DynamicQuantizeMatMul");
        assert_eq!(node.inputs, vec!["x", "w_t_int8", "w_t_scale", "w_t_zero", "b"]);
    }

    /// The model: `graph` as field 7, and the default-domain opset `opset` when given.
    fn model_with(graph: &[u8], opset: Option<u64>) -> Vec<u8> {
        let mut model = Vec::new();
        put_bytes(&mut model, 7, graph);
        if let Some(version) = opset {
            let mut o = Vec::new();
            put_bytes(&mut o, 1, b"");
            put_number(&mut o, 2, version);
            put_bytes(&mut model, 8, &o);
        }
        model
    }

    fn floats(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// The names of a model's initializers, in order.
    fn initializer_names(model: &[u8]) -> Vec<String> {
        let (_, graph) = graph_of(model).unwrap();
        fields(graph)
            .unwrap()
            .into_iter()
            .filter(|f| f.number == 5)
            .map(|f| initializer_name(f.payload).unwrap().unwrap_or_default())
            .collect()
    }

    #[test]
    fn new_names_clash_with_none_the_model_has() {
        // MatMul reads w_t; Gemm reads w transposed: both would store "w_t_int8".
        let mut graph = Vec::new();
        let trans_b = attribute("transB", Some(1), None);
        put_bytes(&mut graph, 1, &node_bytes(&["x", "w_t"], &["y".to_string()], "mm", "MatMul", "", &[]));
        put_bytes(&mut graph, 1, &node_bytes(&["y", "w"], &["z".to_string()], "g", "Gemm", "", &[&trans_b]));
        put_bytes(&mut graph, 5, &tensor("w_t", FLOAT, &[2, 2], &floats(&[1.0, 2.0, 3.0, 4.0])));
        put_bytes(&mut graph, 5, &tensor("w", FLOAT, &[2, 2], &floats(&[5.0, 6.0, 7.0, 8.0])));
        let model = model_with(&graph, Some(13));
        let rewritten = rewrite(&model, &HashSet::new(), Range::Full).unwrap();
        let names = initializer_names(&rewritten.bytes);
        let unique: HashSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        assert_eq!(names.len(), 6, "three tensors for each weight, the fp32 ones gone: {names:?}");
    }

    #[test]
    fn a_weight_a_subgraph_reads_stays_in_fp32_too() {
        // An If whose then-branch reads w by its outer name.
        let mut body = Vec::new();
        put_bytes(&mut body, 1, &node_bytes(&["w"], &["w_copy".to_string()], "inner", "Identity", "", &[]));
        let mut branch = Vec::new();
        put_bytes(&mut branch, 1, b"then_branch");
        put_bytes(&mut branch, 6, &body);
        let mut then_branch = Vec::new();
        put_bytes(&mut then_branch, 5, &branch);
        let mut graph = Vec::new();
        put_bytes(&mut graph, 1, &node_bytes(&["x", "w"], &["y".to_string()], "mm", "MatMul", "", &[]));
        put_bytes(&mut graph, 1, &node_bytes(&["cond"], &["out".to_string()], "if", "If", "", &[&then_branch]));
        put_bytes(&mut graph, 5, &tensor("w", FLOAT, &[2, 2], &floats(&[1.0, 2.0, 3.0, 4.0])));
        let rewritten = rewrite(&model_with(&graph, Some(13)), &HashSet::new(), Range::Full).unwrap();
        assert!(initializer_names(&rewritten.bytes).contains(&"w".to_string()), "the If's body still reads w");
    }

    #[test]
    fn attention_is_quantised_only_where_the_opset_has_dynamic_quantize_linear() {
        let mut graph = Vec::new();
        let heads = attribute("num_heads", Some(1), None);
        let inputs = ["x", "w", "b", "mask"];
        put_bytes(
            &mut graph,
            1,
            &node_bytes(&inputs, &["y".to_string()], "att", "Attention", "com.microsoft", &[&heads]),
        );
        put_bytes(&mut graph, 5, &tensor("w", FLOAT, &[2, 6], &floats(&[0.5; 12])));
        put_bytes(&mut graph, 5, &tensor("b", FLOAT, &[6], &floats(&[0.0; 6])));
        assert_eq!(candidates(&model_with(&graph, Some(11))).unwrap(), vec!["att".to_string()]);
        assert!(candidates(&model_with(&graph, Some(10))).unwrap().is_empty(), "opset 10");
        assert!(candidates(&model_with(&graph, None)).unwrap().is_empty(), "no default opset named");
    }

    #[test]
    fn malformed_weights_are_no_candidates_and_no_panic() {
        let trans_b = attribute("transB", Some(1), None);
        // A Gemm whose B is a scalar, read transposed.
        let mut graph = Vec::new();
        put_bytes(&mut graph, 1, &node_bytes(&["x", "s", "c"], &["y".to_string()], "g", "Gemm", "", &[&trans_b]));
        put_bytes(&mut graph, 5, &tensor("s", FLOAT, &[], &floats(&[1.0])));
        put_bytes(&mut graph, 5, &tensor("c", FLOAT, &[1], &floats(&[1.0])));
        assert!(candidates(&model_with(&graph, Some(13))).unwrap().is_empty());
        // Dims whose product wraps to 0 in u64, with no values: not an empty tensor.
        let mut graph = Vec::new();
        put_bytes(&mut graph, 1, &node_bytes(&["x", "huge"], &["y".to_string()], "mm", "MatMul", "", &[]));
        put_bytes(&mut graph, 5, &tensor("huge", FLOAT, &[1 << 32, 1 << 32], &[]));
        assert!(candidates(&model_with(&graph, Some(13))).unwrap().is_empty());
    }

    #[test]
    fn a_model_without_a_graph_is_refused_with_a_reason() {
        assert!(candidates(&[0x08, 0x07]).unwrap_err().to_string().contains("no graph"));
        assert!(rewrite(&[0x3a, 0x05, 0x01], &HashSet::new(), Range::Full).is_err());
    }
}
