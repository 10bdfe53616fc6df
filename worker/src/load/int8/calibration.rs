//! What the guard measures int8 with: built-in inputs for each kind of model (texts of 1 to
//! `max_length` tokens in several languages and scripts; generated images; for raw models
//! with float inputs, generated tensors at scales from 0.1 to 10), then the user's own
//! (`[quantization] calibration`: texts, image files, or KServe v2 inference requests, one a
//! line).

use std::path::{Path, PathBuf};

use inferd_config::model::ModelEntry;

use super::error::Int8Error;
use crate::pipeline::Pipeline;
use crate::runtime::model::ModelMeta;
use crate::runtime::tensor::{validate_inputs, DataType, Tensor, TensorData};

/// One calibration input, as the model's pipeline takes it.
#[derive(Clone)]
pub(super) enum Sample {
    Text(String),
    /// An encoded image (PNG or JPEG), decoded and resized as a request's would be.
    Image(Vec<u8>),
    /// A raw model's input tensors.
    Tensors(Vec<Tensor>),
}

/// What the guard measures int8 with.
pub(super) enum Calibration {
    /// The inputs, and what they are ("texts", "images", "inputs").
    Inputs(Vec<Sample>, &'static str),
    /// None, and why: a raw model with inputs other than floats and no calibration file.
    None(String),
}

/// The calibration inputs for `meta`'s model: the built-in ones for its kind, then the user's
/// (`[quantization] calibration`, one per line, empty lines skipped). `Err`: the user's file
/// has a line that cannot be read or does not fit the model.
pub(super) fn calibration(entry: &ModelEntry, meta: &ModelMeta, pipeline: &Pipeline) -> Result<Calibration, Int8Error> {
    let own = match &entry.quantization.calibration {
        Some(path) => std::fs::read_to_string(path).map_err(|error| Int8Error::File {
            action: "read",
            path: path.clone(),
            error,
        })?,
        None => String::new(),
    };
    let lines = || own.lines().map(str::trim).filter(|l| !l.is_empty());
    let file = entry.quantization.calibration.as_deref().unwrap_or(Path::new(""));
    let place = |n: usize| format!("quantization.calibration: {}, line {n}", file.display());
    match pipeline {
        Pipeline::Text(p) => {
            let mut samples: Vec<Sample> = built_in_texts(p.max_length).into_iter().map(Sample::Text).collect();
            samples.extend(lines().map(|l| Sample::Text(l.to_string())));
            Ok(Calibration::Inputs(samples, "texts"))
        }
        Pipeline::Image(p) => {
            let (w, h) = (p.config.width, p.config.height);
            let mut samples: Vec<Sample> = (0..GENERATED).map(|i| Sample::Image(generated_image(i, w, h))).collect();
            // Image files inside the calibration file's folder (which model loading confines to
            // the repository), named relative to it.
            let folder = file.parent().unwrap_or(Path::new("."));
            let root = match own.is_empty() {
                true => PathBuf::new(),
                false => std::fs::canonicalize(folder)
                    .map_err(|error| Int8Error::CalibrationFolder { file: file.to_path_buf(), error })?,
            };
            for (n, line) in lines().enumerate() {
                let path = folder.join(line);
                let bytes = std::fs::canonicalize(&path)
                    .and_then(|real| match real.starts_with(&root) {
                        true => std::fs::read(real),
                        false => Err(std::io::Error::other("it is outside the calibration file's folder")),
                    })
                    .map_err(|e| Int8Error::Calibration {
                        place: place(n + 1),
                        why: format!("cannot read {}: {e}", path.display()),
                    })?;
                samples.push(Sample::Image(bytes));
            }
            Ok(Calibration::Inputs(samples, "images"))
        }
        Pipeline::Raw => {
            // Generated first, then the user's; with no float inputs, the user's alone.
            let mut samples: Vec<Sample> = match generated_tensors(meta, entry.warmup.dynamic_dim) {
                Ok(generated) => generated.into_iter().map(Sample::Tensors).collect(),
                Err(why) if lines().next().is_none() => return Ok(Calibration::None(why.to_string())),
                Err(_) => Vec::new(),
            };
            for (n, line) in lines().enumerate() {
                let unfit = |why: String| Int8Error::Calibration { place: place(n + 1), why };
                let parsed = crate::kserve::json::parse(line.as_bytes(), None, &crate::kserve::SharedMemory::NONE)
                    .map_err(unfit)?;
                let given = parsed.inputs.into_iter().map(|input| input.tensor).collect();
                let tensors =
                    validate_inputs(given, &meta.inputs, &meta.info.name).map_err(|e| unfit(e.to_string()))?;
                samples.push(Sample::Tensors(tensors));
            }
            Ok(Calibration::Inputs(samples, "inputs"))
        }
    }
}

/// How many inputs the guard generates for image and raw models.
const GENERATED: usize = 24;

/// Built-in image `i` of [`GENERATED`], a PNG twice the model's size (so that resizing runs):
/// flat colours, gradients, edges, patterns, smooth and sharp noise, simple scenes.
fn generated_image(i: usize, width: u32, height: u32) -> Vec<u8> {
    let (w, h) = ((width * 2).clamp(16, 512), (height * 2).clamp(16, 512));
    // A fixed pseudo-random value per (seed, x, y): splitmix64.
    let noise = |seed: u64, x: u32, y: u32| -> f32 {
        let mut z = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (u64::from(x) << 32 | u64::from(y));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    };
    // Noise smoothed over cells of `cell` pixels (bilinear between cell corners).
    let smooth = |seed: u64, x: u32, y: u32, cell: u32| -> f32 {
        let (cx, cy) = (x / cell, y / cell);
        let (fx, fy) = ((x % cell) as f32 / cell as f32, (y % cell) as f32 / cell as f32);
        let at = |dx, dy| noise(seed, cx + dx, cy + dy);
        let top = at(0, 0) * (1.0 - fx) + at(1, 0) * fx;
        let bottom = at(0, 1) * (1.0 - fx) + at(1, 1) * fx;
        top * (1.0 - fy) + bottom * fy
    };
    let byte = |v: f32| (v.clamp(0.0, 1.0) * 255.0).round() as u8;
    let (fw, fh) = (w as f32, h as f32);
    let image = image::RgbImage::from_fn(w, h, |x, y| {
        let (u, v) = (x as f32 / fw, y as f32 / fh);
        let rgb: [f32; 3] = match i % GENERATED {
            0 => [0.0, 0.0, 0.0],
            1 => [1.0, 1.0, 1.0],
            2 => [0.5, 0.5, 0.5],
            3 => [0.9, 0.1, 0.1],
            4 => [0.1, 0.8, 0.2],
            5 => [0.1, 0.2, 0.9],
            6 => [u, 0.2, 1.0 - u],
            7 => [v, v, v],
            8 => [(u + v) / 2.0, 1.0 - u, v],
            9 => [((x / 4 + y / 4) % 2) as f32; 3],
            10 => [((x * 8 / w + y * 8 / h) % 2) as f32, 0.3, 0.6],
            11 => [0.8, ((y / 3) % 2) as f32, 0.2],
            12 => [((x / 2) % 2) as f32; 3],
            13 => {
                let r = ((u - 0.5).powi(2) + (v - 0.5).powi(2)).sqrt();
                [(r * 40.0).sin() * 0.5 + 0.5, 0.4, (r * 20.0).cos() * 0.5 + 0.5]
            }
            14 => match (u - 0.5).powi(2) + (v - 0.5).powi(2) < 0.09 {
                true => [0.95, 0.85, 0.1],
                false => [0.1, 0.3, 0.6],
            },
            15 => [noise(1, x, y), noise(2, x, y), noise(3, x, y)],
            16 => [smooth(4, x, y, 4), smooth(5, x, y, 4), smooth(6, x, y, 4)],
            17 => [smooth(7, x, y, 16), smooth(8, x, y, 16), smooth(9, x, y, 16)],
            18 => [smooth(10, x, y, 64); 3],
            // Sky, ground and a sun.
            19 => match (v < 0.55, (u - 0.7).powi(2) + (v - 0.2).powi(2) < 0.01) {
                (_, true) => [1.0, 0.9, 0.4],
                (true, false) => [0.4, 0.6 + 0.3 * v, 0.95],
                (false, false) => [0.2, 0.5 + 0.2 * smooth(11, x, y, 8), 0.15],
            },
            // Blocks of colour.
            20 | 21 => {
                let cell = if i % GENERATED == 20 { w / 3 + 1 } else { w / 7 + 1 };
                let seed = i as u64 * 100;
                [
                    noise(seed, x / cell, y / cell),
                    noise(seed + 1, x / cell, y / cell),
                    noise(seed + 2, x / cell, y / cell),
                ]
            }
            // Dark and bright scenes: smooth noise near the ends of the range.
            22 => [0.15 * smooth(12, x, y, 8), 0.1 * smooth(13, x, y, 8), 0.2 * smooth(14, x, y, 8)],
            _ => [0.85 + 0.15 * smooth(15, x, y, 8), 0.9 + 0.1 * smooth(16, x, y, 8), 0.8 + 0.2 * smooth(17, x, y, 8)],
        };
        image::Rgb(rgb.map(byte))
    });
    let mut png = Vec::new();
    image.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png).expect("PNG into memory");
    png
}

/// [`GENERATED`] inputs for a raw model whose inputs are all floats, shaped as warm-up shapes
/// them (batch 1, other free dimensions `dynamic_dim`): pseudo-random values spread around
/// zero at scales from 0.1 to 10, so the activations' run-time ranges vary as real inputs'
/// do. `Err` names an input that is not a float.
fn generated_tensors(meta: &ModelMeta, dynamic_dim: usize) -> Result<Vec<Vec<Tensor>>, Int8Error> {
    if let Some(spec) =
        meta.inputs.iter().find(|s| !matches!(s.dtype, Some(DataType::F32 | DataType::F64 | DataType::F16)))
    {
        return Err(Int8Error::NotFloat { input: spec.name.clone(), datatype: spec.datatype.clone() });
    }
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        // xorshift64*, two draws summed: a triangular spread around zero.
        let mut draw = || {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32
        };
        draw() + draw() - 1.0
    };
    let mut samples = Vec::with_capacity(GENERATED);
    for i in 0..GENERATED {
        let scale = 10f32.powf((i % 5) as f32 / 2.0 - 1.0);
        let mut tensors = Vec::with_capacity(meta.inputs.len());
        for spec in &meta.inputs {
            let shape = spec.filled(1, dynamic_dim);
            let count = crate::runtime::tensor::element_count(&shape).unwrap_or(0);
            let values: Vec<f32> = (0..count).map(|_| next() * scale).collect();
            let data = match spec.dtype {
                Some(DataType::F64) => TensorData::F64(values.into_iter().map(f64::from).collect()),
                Some(DataType::F16) => TensorData::F16(values.into_iter().map(half::f16::from_f32).collect()),
                _ => TensorData::F32(values),
            };
            tensors.push(Tensor { name: spec.name.clone(), shape, data });
        }
        samples.push(tensors);
    }
    Ok(samples)
}

/// The built-in calibration texts: [`BUILT_IN`], then long ones up to and past `max_length`
/// tokens (cut by the tokenizer): the sentences run together.
fn built_in_texts(max: usize) -> Vec<String> {
    let mut texts: Vec<String> = BUILT_IN.iter().map(|t| t.to_string()).collect();
    for (i, take) in [8usize, 16, 32].into_iter().enumerate() {
        let words: Vec<&str> = BUILT_IN.iter().skip(i * 5).take(take).copied().collect();
        let mut text = words.join(" ");
        while text.split_whitespace().count() < max * take / 32 {
            text = format!("{text} {text}");
        }
        texts.push(text);
    }
    texts
}

/// Short and long, questions and statements, several languages and scripts, code and numbers.
const BUILT_IN: &[&str] = &[
    "hello",
    "ok",
    "Why?",
    "weather tomorrow",
    "cheap flights to Lisbon in May",
    "How do I reset my password if I no longer have access to my email account?",
    "The committee postponed its decision until the auditors had reviewed the accounts.",
    "Grey clouds gathered over the harbour as the fishing boats came back in.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "She left the keys on the kitchen table before catching the early train.",
    "Der Zug nach Berlin hat wegen eines Signalfehlers zwanzig Minuten Verspätung.",
    "Wie viel kostet eine Monatskarte für den öffentlichen Nahverkehr?",
    "Le musée sera fermé lundi pour des travaux de rénovation.",
    "Pouvez-vous me recommander un bon restaurant près de la gare ?",
    "El partido se suspendió por la lluvia y se jugará el próximo domingo.",
    "¿Cuál es la diferencia entre un virus y una bacteria?",
    "Il gatto dorme sul divano tutto il pomeriggio.",
    "O relatório anual mostra um crescimento de doze por cento nas vendas.",
    "De vergadering begint om negen uur in zaal drie.",
    "Москва является столицей Российской Федерации.",
    "Сколько времени занимает доставка посылки?",
    "東京は日本の首都で、人口が最も多い都市です。",
    "明日の会議は午後三時に始まります。",
    "北京是中国的首都，有着悠久的历史。",
    "我想预订两张去上海的火车票。",
    "서울은 대한민국의 수도입니다.",
    "القاهرة هي عاصمة جمهورية مصر العربية.",
    "नई दिल्ली भारत की राजधानी है।",
    "İstanbul, Avrupa ile Asya arasında yer alan bir şehirdir.",
    "Warszawa jest stolicą Polski.",
    "def add(a, b):\n    return a + b",
    "SELECT name, count(*) FROM orders GROUP BY name ORDER BY 2 DESC;",
    "error: cannot borrow `x` as mutable because it is also borrowed as immutable",
    "Order #48213 shipped on 2024-03-07, total $1,249.99 incl. VAT.",
    "3.14159 2.71828 1.41421 0.57721",
    "https://example.com/search?q=onnx+runtime&lang=en",
    "I absolutely loved this film, the acting was superb!",
    "Terrible service, the food was cold and the waiter was rude.",
    "The product works as described, nothing more, nothing less.",
    "Can you summarise the main arguments of the paper in two sentences?",
    "Mitochondria are the powerhouse of the cell.",
    "The patient reported mild headaches and occasional dizziness after the new medication.",
    "Interest rates rose by a quarter of a percentage point on Wednesday.",
    "Replace the filter every three months to keep the air purifier efficient.",
    "To be, or not to be, that is the question.",
];

#[cfg(test)]
mod tests {
    use super::*;

    /// A raw model's metadata with inputs of these (name, datatype, shape).
    fn raw_model(inputs: &[(&str, DataType, &[i64])]) -> ModelMeta {
        ModelMeta::for_tests("m", inputs, &[])
    }

    #[test]
    fn raw_inputs_are_generated_for_float_models_at_several_scales_and_refused_otherwise() {
        let meta = raw_model(&[("x", DataType::F32, &[-1, -1, 3]), ("y", DataType::F64, &[2])]);
        let samples = generated_tensors(&meta, 5).unwrap();
        assert_eq!(samples.len(), GENERATED);
        let largest = |t: &Tensor| match &t.data {
            TensorData::F32(v) => v.iter().fold(0f32, |m, x| m.max(x.abs())),
            other => panic!("{other:?}"),
        };
        for sample in &samples {
            assert_eq!((sample[0].shape.as_slice(), sample[1].shape.as_slice()), (&[1, 5, 3][..], &[2][..]));
            assert!(matches!(sample[1].data, TensorData::F64(_)));
        }
        // Sample 0 at scale 0.1, sample 4 at 10.
        assert!(largest(&samples[0][0]) <= 0.1 && largest(&samples[4][0]) > 1.0);
        let meta = raw_model(&[("x", DataType::F32, &[-1, 4]), ("ids", DataType::I64, &[-1, 4])]);
        let why = generated_tensors(&meta, 5).unwrap_err().to_string();
        assert!(why.contains("input 'ids' is INT64") && why.contains("[quantization] calibration"), "{why}");
    }

    #[test]
    fn generated_images_are_distinct_pngs_twice_the_models_size() {
        let images: Vec<Vec<u8>> = (0..GENERATED).map(|i| generated_image(i, 20, 12)).collect();
        for (i, png) in images.iter().enumerate() {
            let decoded = image::load_from_memory_with_format(png, image::ImageFormat::Png).unwrap();
            assert_eq!((decoded.width(), decoded.height()), (40, 24), "image {i}");
            assert!(!images[..i].contains(png), "image {i} repeats an earlier one");
        }
    }
}
