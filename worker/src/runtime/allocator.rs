//! Where a run's buffers come from (`runtime.allocator`), and handing freed memory back.
//!
//! ONNX Runtime's CPU arena keeps the buffers of the largest batch a session ever ran, for
//! good, in every session: a worker with two lanes and a wide session holds three of them.
//! inferd's default (`shared-arena`) registers one arena with the process's environment,
//! which every session of the worker uses, extended by what a run asks rather than doubled;
//! once the worker has been idle a second (or its load has fallen: `engine::dispatch`), the
//! regions no tensor uses go back to the system ([`trim`]), so a burst of large batches does
//! not keep its buffers for good.
//! Without an arena (`malloc`), each run mallocs its tensors and frees them; glibc keeps what
//! was freed (it raises its mmap threshold to the largest block freed), so after each run
//! memory goes back to the system when more than [`FREE_LIMIT`] lies free, and all of it after
//! a second idle (`engine::dispatch`): the least memory, for page faults on every large batch.
//!
//! Measured by `bench/allocator.sh` and `bench/soak.sh` in one sitting (docs/configuration.md,
//! "Memory"): on a mixed stream (1 in 8 texts of 256 tokens) the shared arena answers 119
//! req/s with 219 MiB PSS after it, one arena per session 115 with 310, malloc 89 with 134;
//! under the 2-minute soak of long texts 649 requests at a 580 MiB plateau, 645 at 1000 MiB,
//! 525 at 137-461 MiB. Short texts run at the same speed with all three.

use inferd_config::file::Allocator;

use crate::protowire::{float_value_info, put_bytes, put_number, Dim};

/// Free memory the allocator may keep after a run: more than batches of short texts reuse,
/// less than batches of long texts leave behind (a mixed stream ~120 MiB, a soak of long
/// texts up to ~500).
pub const FREE_LIMIT: usize = 64 << 20;

/// Readies the environment for `choice`, once, before the first session is built:
/// `shared-arena` registers the arena all its sessions use.
/// ONNX Runtime refused the shared arena (the worker does not start).
#[derive(Debug, thiserror::Error)]
#[error("cannot register the shared arena: {message}")]
pub struct ArenaError {
    /// ONNX Runtime's own message.
    pub message: String,
}

pub(crate) fn configure(choice: Allocator, env: &ort::environment::Environment) -> Result<(), ArenaError> {
    if choice == Allocator::SharedArena {
        register_shared_arena(env)?;
        // Without it the arena keeps what the largest batches needed, as before.
        match Shrinker::new(env) {
            Ok(shrinker) => drop(SHRINKER.set(std::sync::Mutex::new(shrinker))),
            Err(e) => tracing::warn!("the shared arena cannot be shrunk when idle: {e}"),
        }
    }
    Ok(())
}

/// How much larger than a request a free chunk of the shared arena may be before it is split
/// (ORT's default, 128 MiB, lets a small tensor hold a chunk a large batch left).
const DEAD_BYTES_PER_CHUNK: usize = 4 << 20;

/// Registers a CPU arena with the environment (sessions opt in with
/// `session.use_env_allocators`), extended by what each allocation asks
/// (`arena_extend_strategy` 1, kSameAsRequested) instead of doubling. Through the C API: ort
/// 2.0.0-rc.15 does not wrap it.
fn register_shared_arena(env: &ort::environment::Environment) -> Result<(), ArenaError> {
    use ort::sys::{OrtAllocatorType, OrtArenaCfg, OrtMemType, OrtMemoryInfo, OrtStatusPtr};
    use ort::AsPointer;
    let api = ort::api();
    // SAFETY: every call below is the C API used as documented: the out-pointers are written
    // on success, the status is released after its message is read, and the memory info and
    // arena configuration are released once the environment has copied what it needs.
    unsafe {
        let check = |status: OrtStatusPtr| -> Result<(), ArenaError> {
            if status.0.is_null() {
                return Ok(());
            }
            let message = std::ffi::CStr::from_ptr((api.GetErrorMessage)(status.0)).to_string_lossy().into_owned();
            (api.ReleaseStatus)(status.0);
            Err(ArenaError { message })
        };
        let mut info: *mut OrtMemoryInfo = std::ptr::null_mut();
        check((api.CreateCpuMemoryInfo)(
            OrtAllocatorType::OrtArenaAllocator,
            OrtMemType::OrtMemTypeDefault,
            &mut info,
        ))?;
        let keys = [c"arena_extend_strategy".as_ptr(), c"max_dead_bytes_per_chunk".as_ptr()];
        let values = [1usize, DEAD_BYTES_PER_CHUNK];
        let mut config: *mut OrtArenaCfg = std::ptr::null_mut();
        let made = check((api.CreateArenaCfgV2)(keys.as_ptr(), values.as_ptr(), keys.len(), &mut config));
        let registered =
            made.and_then(|()| check((api.CreateAndRegisterAllocator)(env.ptr().cast_mut(), info, config)));
        if !config.is_null() {
            (api.ReleaseArenaCfg)(config);
        }
        (api.ReleaseMemoryInfo)(info);
        registered
    }
}

/// Hands the shared arena's unused regions back: ONNX Runtime shrinks an arena only at the end
/// of a run that asks it to (`memory.enable_memory_arena_shrinkage`; its C API gives no other
/// way for an arena it made), so a one-operator model that uses the environment's allocators
/// is run with that option. Its run takes microseconds and touches no model's session.
struct Shrinker {
    session: ort::session::Session,
    options: ort::session::RunOptions,
}

static SHRINKER: std::sync::OnceLock<std::sync::Mutex<Shrinker>> = std::sync::OnceLock::new();

impl Shrinker {
    fn new(env: &ort::environment::Environment) -> ort::Result<Shrinker> {
        let mut options = ort::session::RunOptions::new()?;
        options.set("memory.enable_memory_arena_shrinkage", "cpu:0")?;
        let plain = |r: ort::session::builder::BuilderResult| r.map_err(ort::Error::<()>::from);
        let builder = plain(ort::session::Session::builder(env)?.with_intra_threads(1))?;
        let builder = plain(builder.with_inter_threads(1))?;
        let builder = plain(builder.with_config_entry("session.use_env_allocators", "1"))?;
        let mut builder = plain(builder.with_memory_pattern(false))?;
        let session = builder.commit_from_memory(&doubling_model())?;
        Ok(Shrinker { session, options })
    }

    fn shrink(&mut self) -> ort::Result<()> {
        let x = ort::value::Tensor::from_array(([1usize], vec![0f32]))?;
        self.session.run_with_options(ort::inputs!["x" => x], &self.options).map(drop)
    }
}

/// A model of one operator, `y = x + x` on a float tensor of one element (opset 13): run by
/// [`Shrinker`]. Fields of onnx.proto: ModelProto ir_version = 1, graph = 7, opset_import = 8;
/// GraphProto node = 1, name = 2, input = 11, output = 12; NodeProto input = 1, output = 2,
/// op_type = 4; OperatorSetIdProto version = 2; the inputs and outputs
/// ([`float_value_info`]) of one element.
fn doubling_model() -> Vec<u8> {
    let value = |name: &str| float_value_info(name, &[Dim::Fixed(1)]);
    let mut node = Vec::new();
    put_bytes(&mut node, 1, b"x");
    put_bytes(&mut node, 1, b"x");
    put_bytes(&mut node, 2, b"y");
    put_bytes(&mut node, 4, b"Add");
    let mut graph = Vec::new();
    put_bytes(&mut graph, 1, &node);
    put_bytes(&mut graph, 2, b"double");
    put_bytes(&mut graph, 11, &value("x"));
    put_bytes(&mut graph, 12, &value("y"));
    let mut opset = Vec::new();
    put_number(&mut opset, 2, 13);
    let mut model = Vec::new();
    put_number(&mut model, 1, 8);
    put_bytes(&mut model, 7, &graph);
    put_bytes(&mut model, 8, &opset);
    model
}

/// Returns free memory to the system: the shared arena's regions that no tensor uses (the
/// largest batches' buffers, kept for good otherwise; the next large runs allocate theirs
/// again), then what glibc keeps of freed heap.
pub fn trim() {
    if let Some(shrinker) = SHRINKER.get() {
        let mut shrinker = shrinker.lock().unwrap_or_else(|e| e.into_inner());
        static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if let Err(e) = shrinker.shrink() {
            if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!("the shared arena cannot be shrunk (it keeps what the largest runs needed): {e}");
            }
        }
    }
    trim_heap();
}

/// Returns glibc's free heap to the system.
fn trim_heap() {
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Returns free memory to the system when more than `limit` of it is held. Reading the
/// totals walks glibc's free chunks: microseconds, or milliseconds once many small blocks were
/// freed (callers look now and then, not after every run).
pub fn trim_if_over(limit: usize) {
    // mallinfo, not mallinfo2: the release binary runs on glibc 2.28 (its int fields wrap past
    // 2 GiB, read as "over the limit" then, which is right).
    // SAFETY: mallinfo only reads the allocator's statistics.
    #[allow(deprecated)]
    let free = unsafe { libc::mallinfo() }.fordblks;
    if free < 0 || free as usize > limit {
        trim_heap();
    }
}
