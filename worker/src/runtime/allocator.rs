//! Where a run's buffers come from (`runtime.allocator`), and handing freed memory back.
//!
//! ONNX Runtime's CPU arena keeps the buffers of the largest batch a session ever ran, for
//! good, in every session: a worker with two lanes and a wide session holds three of them.
//! inferd's default (`shared-arena`) registers one arena with the process's environment,
//! which every session of the worker uses, extended by what a run asks rather than doubled.
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

/// Free memory the allocator may keep after a run: more than batches of short texts reuse,
/// less than batches of long texts leave behind (a mixed stream ~120 MiB, a soak of long
/// texts up to ~500).
pub const FREE_LIMIT: usize = 64 << 20;

/// Readies the environment for `choice`, once, before the first session is built:
/// `shared-arena` registers the arena all its sessions use.
pub(crate) fn configure(choice: Allocator, env: &ort::environment::Environment) -> Result<(), String> {
    if choice == Allocator::SharedArena {
        register_shared_arena(env)?;
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
fn register_shared_arena(env: &ort::environment::Environment) -> Result<(), String> {
    use ort::sys::{OrtAllocatorType, OrtArenaCfg, OrtMemType, OrtMemoryInfo, OrtStatusPtr};
    use ort::AsPointer;
    let api = ort::api();
    // SAFETY: every call below is the C API used as documented: the out-pointers are written
    // on success, the status is released after its message is read, and the memory info and
    // arena configuration are released once the environment has copied what it needs.
    unsafe {
        let check = |status: OrtStatusPtr| -> Result<(), String> {
            if status.0.is_null() {
                return Ok(());
            }
            let message = std::ffi::CStr::from_ptr((api.GetErrorMessage)(status.0)).to_string_lossy().into_owned();
            (api.ReleaseStatus)(status.0);
            Err(format!("cannot register the shared arena: {message}"))
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

/// Returns the allocator's free memory to the system (glibc keeps freed heap pages).
pub fn trim() {
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Returns free memory to the system when more than `limit` of it is held. Reading the
/// totals costs microseconds.
pub fn trim_if_over(limit: usize) {
    // mallinfo, not mallinfo2: the release binary runs on glibc 2.28 (its int fields wrap past
    // 2 GiB, read as "over the limit" then, which is right).
    // SAFETY: mallinfo only reads the allocator's statistics.
    #[allow(deprecated)]
    let free = unsafe { libc::mallinfo() }.fordblks;
    if free < 0 || free as usize > limit {
        trim();
    }
}
