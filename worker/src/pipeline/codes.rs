//! Embeddings as the compact codes vector stores keep (Cohere's `embedding_types`): a byte per
//! dimension (`int8`, `uint8`) or a bit (`binary`, `ubinary`).
//!
//! The rule is fixed by the vector alone, so that a code is the same from every worker, after
//! every restart or reload and from every version of inferd, for the same model file (codes
//! already in a store stay comparable with new ones): no calibration, no ranges kept.
//!
//! - `int8`: each value of the vector scaled to unit length, times `127 * sqrt(d) / 4` (d the
//!   vector's dimensions), rounded half away from zero and clamped to -128..127: a unit
//!   vector's values spread around 1/sqrt(d), so +-4/sqrt(d) maps to +-127 (measured on
//!   MiniLM: cosine to float at least 0.9998, docs/protocol.md). In f32 arithmetic.
//! - `uint8`: the `int8` code plus 128.
//! - `ubinary`: the bits `value > 0`, eight to a byte, the first dimension in the most
//!   significant bit (numpy's `packbits`); `binary`: the same bytes minus 128, as signed bytes.
//!   Both need dimensions divisible by 8.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

/// A code's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Int8,
    Uint8,
    Binary,
    Ubinary,
}

impl Code {
    /// Refuses a bit code for a vector whose dimensions are not a multiple of 8 (its bytes
    /// would end in padding that means nothing).
    pub fn fits(self, dimensions: usize) -> Result<(), String> {
        match self {
            Code::Binary | Code::Ubinary if !dimensions.is_multiple_of(8) => {
                Err(format!("binary codes pack 8 dimensions to a byte, and the vectors have {dimensions}"))
            }
            _ => Ok(()),
        }
    }

    /// `row`'s code, as whole numbers (each a byte's value, signed or not).
    pub fn of(self, row: &[f32]) -> Vec<i16> {
        match self {
            Code::Int8 => int8(row).map(i16::from).collect(),
            Code::Uint8 => int8(row).map(|v| i16::from(v).saturating_add(128)).collect(),
            Code::Ubinary => bits(row).map(i16::from).collect(),
            Code::Binary => bits(row).map(|b| i16::from(b).saturating_sub(128)).collect(),
        }
    }
}

/// The `int8` rule (module docs).
fn int8(row: &[f32]) -> impl Iterator<Item = i8> + '_ {
    let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    let scale = 127.0 * (row.len() as f32).sqrt() / 4.0 / norm;
    // `as` saturates a float at the integer type's bounds: the clamp to -128..127.
    row.iter().map(move |x| (x * scale).round() as i8)
}

/// The sign bits, packed (module docs); a last partial byte is padded with zeros.
fn bits(row: &[f32]) -> impl Iterator<Item = u8> + '_ {
    row.chunks(8).map(|eight| {
        let bit = |i: usize| 0x80u8.checked_shr(i as u32).unwrap_or(0);
        eight.iter().enumerate().filter(|(_, x)| **x > 0.0).fold(0u8, |byte, (i, _)| byte | bit(i))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_are_packed_first_dimension_first_and_binary_is_ubinary_less_128() {
        let row = [0.5, -1.0, 0.0, 2.0, -0.1, 0.1, 0.3, -0.3, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0];
        assert_eq!(Code::Ubinary.of(&row), vec![0b1001_0110, 255]);
        assert_eq!(Code::Binary.of(&row), vec![0b1001_0110 - 128, 127]);
        assert!(Code::Binary.fits(16).is_ok());
        assert!(Code::Ubinary.fits(12).unwrap_err().contains("12"));
        assert!(Code::Int8.fits(12).is_ok());
    }

    #[test]
    fn int8_scales_the_unit_vector_by_127_sqrt_d_over_4_and_clamps() {
        // d = 4: the scale is 127 * 2 / 4 = 63.5 on the unit vector.
        let row = [3.0, 0.0, -4.0, 0.0]; // unit: 0.6, 0, -0.8, 0
        assert_eq!(Code::Int8.of(&row), vec![38, 0, -51, 0]);
        assert_eq!(Code::Uint8.of(&row), vec![166, 128, 77, 128]);
        // One dimension holding everything: 1 x 63.5 x ... past 127 is clamped.
        let spike: Vec<f32> = std::iter::once(1.0).chain(std::iter::repeat_n(0.0, 63)).collect();
        assert_eq!(Code::Int8.of(&spike)[0], 127);
        let spike: Vec<f32> = spike.iter().map(|x| -x).collect();
        assert_eq!(Code::Int8.of(&spike)[0], -128);
        // The zero vector stays zero.
        assert_eq!(Code::Int8.of(&[0.0; 8]), vec![0; 8]);
    }
}
