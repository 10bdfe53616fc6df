//! Encoded images (PNG, JPEG) into a model's input tensor: the pixel count checked from the
//! header before anything is decoded, resized as model.toml's `[image]` says, normalised into
//! the model's layout.
// Sizes here come from request data: every operation on them is checked (issue: a
// wrapped `count * size` once let a 2^61-element tensor through in release builds).
#![deny(clippy::arithmetic_side_effects)]

use std::io::Cursor;

use image::{ImageFormat, ImageReader};
use inferd_config::model::{ChannelOrder, ImageConfig, Layout, Resample, Resize};

use super::error::{BuildError, PipelineError};
use super::head::Head;
use crate::runtime::tensor::{DataType, Tensor, TensorData, TensorSpec};

#[derive(Debug)]
pub struct ImagePipeline {
    pub config: ImageConfig,
    input: String,
    pub head: Head,
}

impl ImagePipeline {
    /// The image pipeline `config` (model.toml's `[image]`) asks for, feeding the model's one
    /// input, in front of `head`.
    pub(super) fn build(config: ImageConfig, inputs: &[TensorSpec], head: Head) -> Result<ImagePipeline, BuildError> {
        if inputs.len() != 1 {
            return Err(BuildError::ImageInputs(inputs.len()));
        }
        let spec = match &config.input {
            Some(name) => {
                inputs.iter().find(|i| &i.name == name).ok_or_else(|| BuildError::NotAnInput(name.clone()))?
            }
            None => &inputs[0],
        };
        let (h, w) = (config.height as i64, config.width as i64);
        let want = match config.layout {
            Layout::Nchw => [-1, 3, h, w],
            Layout::Nhwc => [-1, h, w, 3],
        };
        let fits =
            spec.shape.len() == 4 && spec.shape.iter().zip(want).skip(1).all(|(&have, want)| have < 0 || have == want);
        if spec.dtype != Some(DataType::F32) || !fits {
            return Err(BuildError::ImageInput {
                name: spec.name.clone(),
                datatype: spec.datatype.clone(),
                shape: spec.shape.clone(),
                width: config.width,
                height: config.height,
                layout: config.layout,
                want,
            });
        }
        Ok(ImagePipeline { input: spec.name.clone(), config, head })
    }
}

impl ImagePipeline {
    /// Decodes, resizes and normalises a batch of encoded images into the model's input.
    pub fn preprocess(&self, images: &[Vec<u8>]) -> Result<Vec<Tensor>, PipelineError> {
        let c = &self.config;
        let (w, h) = (c.width as usize, c.height as usize);
        // The model's own size (model.toml) times at most server.max_batch_inputs images.
        let too_large = || PipelineError::Output("image batch too large".into());
        let plane = w.checked_mul(h).ok_or_else(too_large)?;
        let per_image = plane.checked_mul(3).ok_or_else(too_large)?;
        let mut data = vec![0f32; images.len().checked_mul(per_image).ok_or_else(too_large)?];
        let source = match c.channels {
            ChannelOrder::Rgb => [0, 1, 2],
            ChannelOrder::Bgr => [2, 1, 0],
        };
        for (n, (bytes, out)) in images.iter().zip(data.chunks_mut(per_image.max(1))).enumerate() {
            let rgb = decode(n, bytes, c)?;
            let resized = resize(&rgb, c);
            let value =
                |pixel: &image::Rgb<u8>, ch: usize| (pixel.0[source[ch]] as f32 * c.scale - c.mean[ch]) / c.std[ch];
            match c.layout {
                Layout::Nchw => {
                    for (ch, channel) in out.chunks_mut(plane.max(1)).enumerate() {
                        channel.iter_mut().zip(resized.pixels()).for_each(|(slot, p)| *slot = value(p, ch));
                    }
                }
                Layout::Nhwc => {
                    for (slots, p) in out.chunks_mut(3).zip(resized.pixels()) {
                        slots.iter_mut().enumerate().for_each(|(ch, slot)| *slot = value(p, ch));
                    }
                }
            }
        }
        let shape = match c.layout {
            Layout::Nchw => vec![images.len() as i64, 3, h as i64, w as i64],
            Layout::Nhwc => vec![images.len() as i64, h as i64, w as i64, 3],
        };
        Ok(vec![Tensor { name: self.input.clone(), shape, data: TensorData::F32(data) }])
    }
}

/// `rgb` brought to the model's size as model.toml's `[image]` says: stretched, or its shorter
/// side resized and the centre cut out (both sides of the resized image are at least the
/// crop's: model.toml's check).
fn resize(rgb: &image::RgbImage, c: &ImageConfig) -> image::RgbImage {
    use image::imageops::FilterType;
    let filter = match c.resample {
        Resample::Nearest => FilterType::Nearest,
        Resample::Bilinear => FilterType::Triangle,
        Resample::Bicubic => FilterType::CatmullRom,
        Resample::Lanczos => FilterType::Lanczos3,
    };
    let (width, height) = c.resized_size(rgb.width(), rgb.height());
    let resized = image::imageops::resize(rgb, width, height, filter);
    match c.resize {
        Resize::Stretch => resized,
        // As Hugging Face's center_crop: the offsets rounded down.
        Resize::ShortestEdge => {
            let (left, top) = (width.saturating_sub(c.width) / 2, height.saturating_sub(c.height) / 2);
            image::imageops::crop_imm(&resized, left, top, c.width, c.height).to_image()
        }
    }
}

/// [`decode`] for one image: what the fuzz target (fuzz/fuzz_targets/image_decode.rs) drives.
pub fn decode_image(bytes: &[u8], config: &ImageConfig) -> Result<image::RgbImage, PipelineError> {
    decode(0, bytes, config)
}

/// PNG or JPEG to RGB, refusing anything else, and checking the pixel count from the header
/// before a single pixel is decoded.
fn decode(index: usize, bytes: &[u8], c: &ImageConfig) -> Result<image::RgbImage, PipelineError> {
    let bad = |message: String| PipelineError::NotAnImage { index, message };
    if bytes.is_empty() {
        return Err(bad("empty".into()));
    }
    let reader = || -> Result<ImageReader<Cursor<&[u8]>>, PipelineError> {
        let reader = ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| bad(e.to_string()))?;
        match reader.format() {
            Some(ImageFormat::Png | ImageFormat::Jpeg) => Ok(reader),
            _ => Err(bad("not a PNG or JPEG image".into())),
        }
    };
    let header = reader()?;
    // The JPEG decoder fills a cut-off image with grey instead of failing: a complete JPEG has
    // its end-of-image marker after the last start-of-scan (entropy-coded data never contains
    // an unescaped 0xFF 0xD9).
    if header.format() == Some(ImageFormat::Jpeg) && !jpeg_complete(bytes) {
        return Err(bad("corrupt or truncated: the JPEG data ends before its end-of-image marker".into()));
    }
    let (width, height) = header.into_dimensions().map_err(|e| bad(format!("unreadable header: {e}")))?;
    let pixels = u64::from(width).saturating_mul(u64::from(height));
    if pixels > c.max_pixels {
        return Err(PipelineError::ImageTooLarge { index, width, height, pixels, max: c.max_pixels });
    }
    if width.max(height) > c.max_side {
        return Err(PipelineError::ImageTooLong { index, width, height, max: c.max_side });
    }
    resize_cost(index, width, height, c)?;
    let mut decoder = reader()?;
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(width);
    limits.max_image_height = Some(height);
    limits.max_alloc = Some(pixels.saturating_mul(8).saturating_add(1 << 20));
    decoder.limits(limits);
    let decoded = crate::panics::contained(|| decoder.decode())
        .map_err(|panic| bad(format!("corrupt: the decoder failed on it ({panic})")))?
        .map_err(|e| bad(format!("corrupt or truncated: {e}")))?;
    Ok(decoded.to_rgb8())
}

/// The most one image's resize may allocate: a 16,384-pixel-wide source resized to 1024 rows.
const MAX_RESIZE_BYTES: u64 = 256 << 20;

/// What `image::imageops::resize` allocates for a `width` x `height` source: it resamples the
/// rows first, into a `width` x (resized height) buffer of four f32 channels, then the columns
/// (the resized size is the model's, or with `shortest_edge` one that follows the source's
/// aspect ratio). Refused when over [`MAX_RESIZE_BYTES`], from the header, before anything is
/// decoded.
fn resize_cost(index: usize, width: u32, height: u32, c: &ImageConfig) -> Result<(), PipelineError> {
    let (to_width, to_height) = c.resized_size(width, height);
    let bytes = u64::from(width.max(to_width)).saturating_mul(u64::from(to_height)).saturating_mul(16);
    match bytes > MAX_RESIZE_BYTES {
        true => Err(PipelineError::ImageTooCostly {
            index,
            width,
            height,
            to_width,
            to_height,
            mib: bytes >> 20,
            max_mib: MAX_RESIZE_BYTES >> 20,
        }),
        false => Ok(()),
    }
}

fn jpeg_complete(bytes: &[u8]) -> bool {
    let last_scan = bytes.windows(2).rposition(|w| w == [0xFF, 0xDA]).unwrap_or(0);
    bytes[last_scan..].windows(2).any(|w| w == [0xFF, 0xD9])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jpeg_without_its_end_marker_is_incomplete() {
        assert!(jpeg_complete(&[0xFF, 0xD8, 0xFF, 0xDA, 1, 2, 0xFF, 0x00, 0xFF, 0xD9]));
        assert!(!jpeg_complete(&[0xFF, 0xD8, 0xFF, 0xDA, 1, 2, 0xFF, 0x00]));
        // An end marker before the last scan (a thumbnail's) does not count.
        assert!(!jpeg_complete(&[0xFF, 0xD8, 0xFF, 0xD9, 0xFF, 0xDA, 1, 2]));
    }

    #[test]
    fn a_shortest_edge_resize_is_bounded_from_the_header() {
        let c: ImageConfig = serde_json::from_value(serde_json::json!(
            {"width": 224, "height": 224, "resize": "shortest_edge", "shortest_edge": 256}
        ))
        .unwrap();
        assert!(resize_cost(0, 640, 480, &c).is_ok());
        // 1 x 16384: its short side to 256 makes the long one 4,194,304 (a 16 GiB buffer).
        let e = resize_cost(0, 1, 16_384, &c).unwrap_err().to_string();
        assert!(e.contains("256x4194304"), "{e}");
    }
}
