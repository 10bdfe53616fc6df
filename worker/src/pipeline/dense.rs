//! Linear layers after pooling (`[[embedding.dense]]`, sentence-transformers' `Dense`
//! modules): each row becomes `activation(W x + b)`, layer after layer, before normalisation.
//! The weights are read when the model loads, from safetensors files only (a pickle cannot be
//! read without running it), and checked against each other and the model's output: a layer
//! that does not fit is refused at load, never met by a request.
// Sizes here come from files: every operation on them is checked.
#![deny(clippy::arithmetic_side_effects)]

use std::path::{Path, PathBuf};

use inferd_config::model::{DenseActivation, DenseLayer};
use safetensors::{Dtype, SafeTensors};
use sha2::{Digest, Sha256};

/// A Dense file larger than this is refused (the largest published Dense layers are a few MiB).
const MAX_FILE_BYTES: u64 = 256 << 20;

/// Why a Dense layer cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("embedding.dense[{index}] ({}): {reason}", file.display())]
pub struct DenseError {
    pub index: usize,
    pub file: PathBuf,
    pub reason: String,
}

#[derive(Debug)]
struct Layer {
    /// `[outputs, inputs]`, row-major (torch's `nn.Linear.weight`).
    weight: Vec<f32>,
    bias: Option<Vec<f32>>,
    inputs: usize,
    outputs: usize,
    activation: DenseActivation,
}

/// The layers of a model, in order (none for most models).
#[derive(Debug, Default)]
pub struct Dense {
    layers: Vec<Layer>,
    /// SHA-256 of the layers' files and activations: part of a cached answer's key.
    pub digest: Option<[u8; 32]>,
}

impl Dense {
    /// Reads `config`'s layers; `width` is the pooled vector's length where the model's output
    /// declares it. Each layer must take what the one before gives.
    pub fn load(config: &[DenseLayer], width: Option<usize>) -> Result<Dense, DenseError> {
        let mut layers = Vec::with_capacity(config.len());
        let mut hash = Sha256::new();
        let mut width = width;
        for (index, layer) in config.iter().enumerate() {
            let fail = |reason: String| DenseError { index, file: layer.file.clone(), reason };
            let bytes = read(&layer.file).map_err(fail)?;
            hash.update(&bytes);
            hash.update(format!("{:?}", layer.activation).as_bytes());
            let read = Layer::read(&bytes, layer.activation).map_err(fail)?;
            if let Some(w) = width.filter(|&w| w != read.inputs) {
                return Err(fail(format!("it takes vectors of {} values, but gets {w}", read.inputs)));
            }
            width = Some(read.outputs);
            layers.push(read);
        }
        let digest = (!layers.is_empty()).then(|| hash.finalize().into());
        Ok(Dense { layers, digest })
    }

    /// `row` through every layer (as it is without any).
    pub fn apply(&self, row: Vec<f32>) -> Vec<f32> {
        self.layers.iter().fold(row, |row, layer| layer.apply(&row))
    }

    /// How many values the first layer takes, if there is one.
    pub fn inputs(&self) -> Option<usize> {
        self.layers.first().map(|l| l.inputs)
    }

    /// How many values the last layer gives, if there is one.
    pub fn outputs(&self) -> Option<usize> {
        self.layers.last().map(|l| l.outputs)
    }
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    let size = std::fs::metadata(path).map_err(|e| e.to_string())?.len();
    if size > MAX_FILE_BYTES {
        return Err(format!("{size} bytes; a Dense layer's file may have at most {MAX_FILE_BYTES}"));
    }
    std::fs::read(path).map_err(|e| e.to_string())
}

/// A tensor's shape and its values as f32.
type Shaped = (Vec<usize>, Vec<f32>);

impl Layer {
    fn read(bytes: &[u8], activation: DenseActivation) -> Result<Layer, String> {
        let tensors = SafeTensors::deserialize(bytes).map_err(|e| format!("not a safetensors file: {e}"))?;
        let floats = |name: &str| -> Result<Option<Shaped>, String> {
            let Ok(view) = tensors.tensor(name) else { return Ok(None) };
            let data = view.data();
            let values: Vec<f32> = match view.dtype() {
                Dtype::F32 => data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
                Dtype::F16 => data.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
                Dtype::BF16 => data.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
                other => return Err(format!("'{name}' is {other:?}; Dense weights are F32, F16 or BF16")),
            };
            Ok(Some((view.shape().to_vec(), values)))
        };
        // sentence-transformers' Dense saves its torch.nn.Linear as `linear`; a bare
        // torch.nn.Linear's state (BGE-M3's heads) has `weight` and `bias`.
        let prefix = if tensors.tensor("linear.weight").is_ok() { "linear." } else { "" };
        let (shape, weight) = floats(&format!("{prefix}weight"))?.ok_or("it has no 'linear.weight' (nor 'weight')")?;
        let [outputs, inputs] = shape[..] else {
            return Err(format!("'linear.weight' has shape {shape:?}; it must be [out_features, in_features]"));
        };
        if outputs == 0 || inputs == 0 || outputs.checked_mul(inputs) != Some(weight.len()) {
            return Err(format!("'linear.weight' has shape {shape:?}: no values"));
        }
        let bias = match floats(&format!("{prefix}bias"))? {
            None => None,
            Some((shape, bias)) if shape == [outputs] => Some(bias),
            Some((shape, _)) => return Err(format!("'linear.bias' has shape {shape:?}; it must be [{outputs}]")),
        };
        Ok(Layer { weight, bias, inputs, outputs, activation })
    }

    fn apply(&self, row: &[f32]) -> Vec<f32> {
        self.weight
            .chunks_exact(self.inputs)
            .enumerate()
            .map(|(o, weights)| {
                let sum =
                    weights.iter().zip(row).map(|(w, x)| w * x).sum::<f32>() + self.bias.as_ref().map_or(0.0, |b| b[o]);
                match self.activation {
                    DenseActivation::Identity => sum,
                    DenseActivation::Tanh => sum.tanh(),
                    DenseActivation::Relu => sum.max(0.0),
                    DenseActivation::Sigmoid => 1.0 / (1.0 + (-sum).exp()),
                    DenseActivation::Gelu => 0.5 * sum * (1.0 + erf(sum / std::f32::consts::SQRT_2)),
                }
            })
            .collect()
    }
}

/// The error function (Abramowitz and Stegun 7.1.26, within 1.5e-7): torch's exact GELU.
fn erf(x: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.327_591_1 * x.abs());
    let poly = t * (0.254_829_6 + t * (-0.284_496_7 + t * (1.421_413_8 + t * (-1.453_152 + t * 1.061_405_4))));
    (1.0 - poly * (-x * x).exp()).copysign(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_activation_is_torchs() {
        // One layer of one input and one output, weight 1, no bias: the activation alone.
        let layer = |activation| Layer { weight: vec![1.0], bias: None, inputs: 1, outputs: 1, activation };
        // (x, identity, tanh, relu, sigmoid, gelu) as torch computes them (GELU's exact form).
        let cases = [
            (-2.0, -2.0, -0.9640276, 0.0, 0.11920292, -0.04550026),
            (-0.5, -0.5, -0.46211717, 0.0, 0.37754068, -0.15426877),
            (0.0, 0.0, 0.0, 0.0, 0.5, 0.0),
            (1.0, 1.0, 0.7615942, 1.0, 0.7310586, 0.8413447),
            (3.0, 3.0, 0.9950548, 3.0, 0.95257413, 2.9959502),
        ];
        for (x, identity, tanh, relu, sigmoid, gelu) in cases {
            for (activation, want) in [
                (DenseActivation::Identity, identity),
                (DenseActivation::Tanh, tanh),
                (DenseActivation::Relu, relu),
                (DenseActivation::Sigmoid, sigmoid),
                (DenseActivation::Gelu, gelu),
            ] {
                let got = layer(activation).apply(&[x])[0];
                assert!((got - want).abs() < 1e-6, "{activation:?}({x}) = {got}, torch says {want}");
            }
        }
    }

    #[test]
    fn weights_are_applied_row_by_row_with_the_bias() {
        let layer = Layer {
            weight: vec![1.0, 2.0, 3.0, -1.0, 0.5, 0.0],
            bias: Some(vec![0.5, -1.0]),
            inputs: 3,
            outputs: 2,
            activation: DenseActivation::Identity,
        };
        assert_eq!(layer.apply(&[1.0, 1.0, 2.0]), vec![1.0 + 2.0 + 6.0 + 0.5, -1.0 + 0.5 - 1.0]);
    }
}
