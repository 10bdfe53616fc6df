//! What the accuracy guard measured of a model's int8 form ([`Report`]), kept beside the int8
//! file, and the precision served that it says.

use inferd_ipc::spec::Precision as Served;
use serde::{Deserialize, Serialize};

use super::rewrite::Range;
use crate::runtime::cpu::Class;

/// What the guard measured, kept beside the int8 file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Whether int8 is served.
    pub int8: bool,
    /// MatMul and Attention nodes in int8, of how many candidates.
    pub quantized: usize,
    pub candidates: usize,
    /// Kept in fp32 by the guard.
    pub kept: Vec<String>,
    /// Calibration inputs measured, and what they are ("texts", "images", "inputs").
    pub inputs: usize,
    pub of: String,
    /// Embeddings: least and mean cosine to fp32.
    pub min_cosine: Option<f64>,
    pub mean_cosine: Option<f64>,
    /// Classifiers: largest probability difference, and top-1 agreement (0..1).
    pub max_probability_error: Option<f64>,
    pub top1_agreement: Option<f64>,
    /// Raw models: largest and mean relative error of an output.
    pub max_relative_error: Option<f64>,
    pub mean_relative_error: Option<f64>,
    /// Median time of a calibration input, one at a time on one thread.
    pub fp32_ms: f64,
    pub int8_ms: f64,
    /// Why int8 is not served, when it is not.
    pub refused: Option<String>,
    /// The CPU's int8 class it was prepared for (by CPUID), which decides the formulations
    /// measured ([`Range::candidates`]), and the one chosen for every int8 node.
    pub cpu: Class,
    pub formulation: Range,
    /// The other formulations measured, with their figures.
    pub alternatives: Vec<String>,
}

impl Report {
    /// Int8 refused before anything was measured, for `why`.
    pub(super) fn refused(candidates: usize, why: String) -> Report {
        let cpu = Class::detect();
        Report {
            int8: false,
            quantized: 0,
            candidates,
            kept: Vec::new(),
            inputs: 0,
            of: "inputs".into(),
            min_cosine: None,
            mean_cosine: None,
            max_probability_error: None,
            top1_agreement: None,
            max_relative_error: None,
            mean_relative_error: None,
            fp32_ms: 0.0,
            int8_ms: 0.0,
            refused: Some(why),
            cpu,
            formulation: Range::candidates(cpu)[0],
            alternatives: Vec::new(),
        }
    }

    /// One line for the log, `status` and the model's metadata.
    pub fn summary(&self) -> String {
        self.precision().to_string()
    }

    /// The precision served, with what the guard found.
    pub fn precision(&self) -> Served {
        if self.inputs == 0 {
            let why = self.refused.as_deref().unwrap_or("not measured");
            return Served::Fp32 { guard: Some(format!("int8 refused: {why}")) };
        }
        let error = match (self.min_cosine, self.mean_cosine, self.max_probability_error, self.top1_agreement) {
            (Some(min), Some(mean), _, _) => format!("min cosine {min:.4}, mean {mean:.4} to fp32"),
            (_, _, Some(p), Some(top1)) => {
                format!("largest probability error {p:.4}, top-1 agreement {:.1}% with fp32", top1 * 100.0)
            }
            _ => match (self.max_relative_error, self.mean_relative_error) {
                (Some(max), Some(mean)) => format!("relative error to fp32 at most {max:.4}, mean {mean:.4}"),
                _ => "not measured".into(),
            },
        };
        let speed = format!(
            "{:.2}x fp32's speed ({:.2} vs {:.2} ms {})",
            self.fp32_ms / self.int8_ms.max(1e-9),
            self.int8_ms,
            self.fp32_ms,
            match self.of.as_str() {
                "texts" => "a text",
                "images" => "an image",
                _ => "an input",
            }
        );
        let kept = match self.kept.len() {
            0 => String::new(),
            n => format!("; {n} kept in fp32: {}", self.kept.join(", ")),
        };
        let others = match self.alternatives.len() {
            0 => String::new(),
            _ => format!(", chosen over {}", self.alternatives.join("; ")),
        };
        let what = format!(
            "{} of {} MatMul/Gemm/Attention nodes in int8{kept}; {error} over {} {}; {speed}; CPU class {} (CPUID): {}{others}",
            self.quantized,
            self.candidates,
            self.inputs,
            self.of,
            self.cpu,
            self.formulation.formulation()
        );
        match &self.refused {
            None => Served::Int8 {
                guard: what,
                cpu: self.cpu.name().into(),
                weight_type: self.formulation.weight_type().into(),
                weight_bits: self.formulation.bits(),
            },
            Some(why) => Served::Fp32 { guard: Some(format!("int8 refused: {why}; {what}")) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_says_what_was_served_and_what_it_cost() {
        let mut report = Report {
            int8: true,
            quantized: 16,
            candidates: 18,
            kept: vec!["a".into(), "b".into()],
            inputs: 48,
            of: "texts".into(),
            min_cosine: Some(0.9912),
            mean_cosine: Some(0.998),
            max_probability_error: None,
            top1_agreement: None,
            max_relative_error: None,
            mean_relative_error: None,
            fp32_ms: 6.0,
            int8_ms: 3.0,
            refused: None,
            cpu: Class::Avx2,
            formulation: Range::Reduced,
            alternatives: Vec::new(),
        };
        let s = report.summary();
        assert!(
            s.starts_with(
                "int8 (16 of 18 MatMul/Gemm/Attention nodes in int8; 2 kept in fp32: a, b; min cosine 0.9912"
            ),
            "{s}"
        );
        assert!(s.contains("2.00x fp32's speed"), "{s}");
        assert!(
            s.ends_with(
                "; CPU class avx2 (CPUID): u8 activations x s8 weights of 7 bits per output column (reduce_range))"
            ),
            "{s}"
        );
        assert!(
            matches!(report.precision(), Served::Int8 { cpu, weight_type, weight_bits: 7, .. } if cpu == "avx2" && weight_type == "s8")
        );
        report.int8 = false;
        report.refused = Some("too slow".into());
        assert!(report.summary().starts_with("fp32 (int8 refused: too slow;"));
    }
}
