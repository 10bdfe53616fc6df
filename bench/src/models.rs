//! Many models for the on-demand tests and `bench/many_models.sh`: small ONNX models of a
//! chosen size with weights of their own (so each model's answers are its own), the answer
//! each must give, and a Zipf-distributed trace of which model each request names.
//!
//! A model is `y = relu(x · W1) · W2` with `x` of shape `[batch, INPUTS]`, `W1`
//! `[INPUTS, hidden]`, `W2` `[hidden, OUTPUTS]`, its weights drawn from a generator seeded
//! by the model's number: 80 bytes of weights per hidden unit.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::http::Connection;
use inferd_worker::protowire::{float_value_info, put_bytes, put_number, Dim};

pub const INPUTS: usize = 16;
pub const OUTPUTS: usize = 4;

/// Weight bytes per hidden unit.
pub const BYTES_PER_HIDDEN: usize = 4 * (INPUTS + OUTPUTS);

/// One generated model: its number (the seed of its weights) and its hidden width.
#[derive(Debug, Clone, Copy)]
pub struct Mlp {
    pub seed: u64,
    pub hidden: usize,
}

impl Mlp {
    /// The model numbered `seed` with about `bytes` of weights.
    pub fn of_size(seed: u64, bytes: usize) -> Mlp {
        Mlp { seed, hidden: (bytes / BYTES_PER_HIDDEN).max(1) }
    }

    /// Its weights, `W1` then `W2`, row-major: values in [-0.5, 0.5) from a SplitMix64 of
    /// the seed.
    pub fn weights(&self) -> (Vec<f32>, Vec<f32>) {
        let mut state = self.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5851_f42d_4c95_7f2d;
        let mut next = move || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let w1 = (0..INPUTS * self.hidden).map(|_| next()).collect();
        let w2 = (0..self.hidden * OUTPUTS).map(|_| next()).collect();
        (w1, w2)
    }

    /// The answer to `x` (one row of [`INPUTS`]), in f64: what ONNX Runtime's f32 answer
    /// must be close to.
    pub fn reference(&self, x: &[f32]) -> Vec<f64> {
        let (w1, w2) = self.weights();
        let mut y = vec![0f64; OUTPUTS];
        for h in 0..self.hidden {
            let a: f64 = (0..INPUTS).map(|i| f64::from(x[i]) * f64::from(w1[i * self.hidden + h])).sum();
            if a > 0.0 {
                for (o, y) in y.iter_mut().enumerate() {
                    *y += a * f64::from(w2[h * OUTPUTS + o]);
                }
            }
        }
        y
    }

    /// Writes the model into `folder` (model.onnx and a model.toml naming it `name`).
    pub fn write(&self, folder: &Path, name: &str) -> std::io::Result<()> {
        std::fs::create_dir_all(folder)?;
        let (w1, w2) = self.weights();
        let mut graph = Vec::new();
        let nodes: [(&[&str], &str, &str); 3] =
            [(&["x", "w1"], "a", "MatMul"), (&["a"], "r", "Relu"), (&["r", "w2"], "y", "MatMul")];
        for (inputs, output, op) in nodes {
            let mut node = Vec::new();
            for input in inputs {
                put_bytes(&mut node, 1, input.as_bytes());
            }
            put_bytes(&mut node, 2, output.as_bytes());
            put_bytes(&mut node, 4, op.as_bytes());
            put_bytes(&mut graph, 1, &node);
        }
        put_bytes(&mut graph, 2, name.as_bytes());
        for (tensor, dims, values) in [("w1", [INPUTS, self.hidden], &w1), ("w2", [self.hidden, OUTPUTS], &w2)] {
            put_bytes(&mut graph, 5, &initializer(tensor, &dims, values));
        }
        put_bytes(&mut graph, 11, &value_info("x", INPUTS));
        put_bytes(&mut graph, 12, &value_info("y", OUTPUTS));
        let mut model = Vec::new();
        put_number(&mut model, 1, 8);
        put_bytes(&mut model, 2, b"inferd-bench");
        put_bytes(&mut model, 7, &graph);
        let mut opset = Vec::new();
        put_number(&mut opset, 2, 13);
        put_bytes(&mut model, 8, &opset);
        std::fs::write(folder.join("model.onnx"), model)?;
        std::fs::write(
            folder.join("model.toml"),
            format!("name = \"{name}\"\nversion = \"1\"\nfile = \"model.onnx\"\n"),
        )
    }
}

/// A float tensor `name` of `dims`, its values raw little-endian.
fn initializer(name: &str, dims: &[usize], values: &[f32]) -> Vec<u8> {
    let mut tensor = Vec::new();
    for &d in dims {
        put_number(&mut tensor, 1, d as u64);
    }
    put_number(&mut tensor, 2, 1);
    put_bytes(&mut tensor, 8, name.as_bytes());
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    put_bytes(&mut tensor, 9, &raw);
    tensor
}

/// A float input or output `name` of shape `[batch, width]`.
fn value_info(name: &str, width: usize) -> Vec<u8> {
    float_value_info(name, &[Dim::Named("batch"), Dim::Fixed(width as u64)])
}

/// Draws model numbers 0..n with probability proportional to 1 / (rank + 1)^s, from a
/// seeded generator: the same trace for every run with the same seed.
pub struct Zipf {
    cumulative: Vec<f64>,
    state: u64,
}

impl Zipf {
    pub fn new(n: usize, s: f64, seed: u64) -> Zipf {
        let mut total = 0.0;
        let cumulative = (0..n)
            .map(|k| {
                total += 1.0 / ((k + 1) as f64).powf(s);
                total
            })
            .collect::<Vec<_>>();
        let cumulative = cumulative.into_iter().map(|c| c / total).collect();
        Zipf { cumulative, state: seed ^ 0x2545_f491_4f6c_dd1d }
    }

    /// The next model's number (0: the most often named).
    pub fn draw(&mut self) -> usize {
        // xorshift64*
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let u = (self.state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64;
        self.cumulative.partition_point(|&c| c < u).min(self.cumulative.len() - 1)
    }
}

/// The KServe v2 request for one row `x` of a generated model.
pub fn request(x: &[f32]) -> Vec<u8> {
    let body = serde_json::json!({"inputs": [{"name": "x", "shape": [1, INPUTS], "datatype": "FP32", "data": x}]});
    body.to_string().into_bytes()
}

/// The output `y` of an answer to [`request`].
pub fn answer(body: &serde_json::Value) -> Option<Vec<f64>> {
    let y = body["outputs"].as_array()?.iter().find(|o| o["name"] == "y")?;
    y["data"].as_array()?.iter().map(|v| v.as_f64()).collect()
}

/// Whether `got` is `want` within float rounding (relative 1e-3 of the largest value, or
/// 1e-4).
pub fn close(got: &[f64], want: &[f64]) -> bool {
    let scale = want.iter().fold(1e-1f64, |m, v| m.max(v.abs()));
    got.len() == want.len() && got.iter().zip(want).all(|(g, w)| (g - w).abs() <= 1e-3 * scale)
}

/// `count` generated models, the k-th of `min + (k * 37) % (max - min + 1)` MiB of weights
/// (sizes spread over the trace's ranks: the most requested is not the smallest).
pub fn set(count: usize, min_mib: usize, max_mib: usize) -> Vec<Mlp> {
    let span = max_mib.saturating_sub(min_mib) + 1;
    (0..count).map(|k| Mlp::of_size(k as u64, (min_mib + (k * 37) % span) << 20)).collect()
}

/// Writes [`set`]'s models into `repository` as `m00`..; returns them in order.
pub fn generate(repository: &Path, count: usize, min_mib: usize, max_mib: usize) -> std::io::Result<Vec<Mlp>> {
    let models = set(count, min_mib, max_mib);
    for (k, mlp) in models.iter().enumerate() {
        mlp.write(&repository.join(name(k)), &name(k))?;
    }
    Ok(models)
}

/// The name of generated model `k`.
pub fn name(k: usize) -> String {
    format!("m{k:02}")
}

/// The row model `k` is asked about in a trace.
pub fn row(k: usize) -> Vec<f32> {
    (0..INPUTS).map(|i| ((k * 7 + i * 3) % 11) as f32 / 11.0 - 0.3).collect()
}

/// One request of a trace: which model, how it ended, how long it took, and how long of that
/// it waited for its model to load (Server-Timing's `load`; None: the model was loaded).
#[derive(Debug, Clone)]
pub struct Sent {
    pub model: usize,
    pub outcome: Outcome,
    pub latency: Duration,
    pub load: Option<Duration>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// 200, with the model's own answer.
    Answered,
    /// 503 with Retry-After.
    Busy,
    /// Anything else: what happened.
    Failed(String),
}

/// `clients` threads, each on a keep-alive connection, sending requests for the generated
/// `models` (by [`name`]) in Zipf order (exponent `s`, each client its own seed) for
/// `seconds`; each 200 is checked against the model's [`Mlp::reference`].
pub fn trace(addr: SocketAddr, models: &[Mlp], clients: usize, seconds: f64, s: f64) -> Vec<Sent> {
    let references: Arc<Vec<Vec<f64>>> =
        Arc::new(models.iter().enumerate().map(|(k, m)| m.reference(&row(k))).collect());
    let bodies: Arc<Vec<Vec<u8>>> = Arc::new((0..models.len()).map(|k| request(&row(k))).collect());
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let threads: Vec<_> = (0..clients as u64)
        .map(|client| {
            let (references, bodies) = (references.clone(), bodies.clone());
            std::thread::spawn(move || {
                let mut zipf = Zipf::new(references.len(), s, client + 1);
                let mut sent = Vec::new();
                let mut connection: Option<Connection> = None;
                while Instant::now() < until {
                    let k = zipf.draw();
                    let path = format!("/v2/models/{}/infer", name(k));
                    let started = Instant::now();
                    let conn = match connection.as_mut() {
                        Some(conn) => conn,
                        None => match Connection::open(addr) {
                            Ok(conn) => connection.insert(conn),
                            Err(e) => {
                                let outcome = Outcome::Failed(format!("connect: {e}"));
                                sent.push(Sent { model: k, outcome, latency: started.elapsed(), load: None });
                                continue;
                            }
                        },
                    };
                    let response = conn.post(&path, &bodies[k]);
                    let latency = started.elapsed();
                    let (outcome, load) = match response {
                        Err(e) => {
                            connection = None;
                            (Outcome::Failed(format!("{path}: {e}")), None)
                        }
                        Ok(response) => {
                            if response.closes() {
                                connection = None;
                            }
                            let load = response.server_timing("load").map(|ms| Duration::from_secs_f64(ms / 1e3));
                            let outcome = match response.status {
                                200 => match serde_json::from_slice(&response.body).ok().as_ref().and_then(answer) {
                                    Some(y) if close(&y, &references[k]) => Outcome::Answered,
                                    y => Outcome::Failed(format!("{path}: {y:?}, not {:?}", references[k])),
                                },
                                503 if response.header("retry-after").is_some() => Outcome::Busy,
                                status => Outcome::Failed(format!(
                                    "{path}: {status} {}",
                                    String::from_utf8_lossy(&response.body)
                                )),
                            };
                            (outcome, load)
                        }
                    };
                    sent.push(Sent { model: k, outcome, latency, load });
                }
                sent
            })
        })
        .collect();
    threads.into_iter().flat_map(|t| t.join().unwrap_or_default()).collect()
}

/// The proportional set size of `pid` and every process below it (its share of every page
/// it maps; smaps_rollup), in bytes.
pub fn tree_pss(pid: u32) -> u64 {
    let own = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let kb = own.lines().find_map(|l| l.strip_prefix("Pss:")).and_then(|v| v.split_whitespace().next()?.parse().ok());
    let children: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|list| list.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<u32>>())
        .collect();
    kb.unwrap_or(0u64) * 1024 + children.into_iter().map(tree_pss).sum::<u64>()
}
