//! Where a run's buffers come from (`runtime.allocator`), and handing freed memory back.
//!
//! ONNX Runtime's CPU arena keeps the buffers of the largest batch a session ever ran, for
//! good, in every session of every worker. inferd's default (`malloc`) runs without it: each
//! run mallocs its tensors and frees them. glibc keeps what was freed as well (it raises its
//! mmap threshold to the largest block freed, so a batch of long texts leaves its buffers on
//! the heap): so after each run, memory goes back to the system when more than [`FREE_LIMIT`]
//! lies free, and all of it after a second idle (`engine::dispatch`).
//!
//! Measured by `bench/allocator.sh` and `bench/soak.sh` (docs/configuration.md, "Memory"):
//! the pool's PSS right after a mixed load went from ~250 to ~135 MiB at the same speed on
//! short texts, and under a soak of long texts from 600-665 to 310-490 MiB, for ~15% of its
//! throughput (pages faulted in again). ORT's arena is ~30% faster on long texts and holds
//! ~175 MiB more per worker (`runtime.allocator = "arena"`).

use std::sync::OnceLock;

use inferd_config::file::Allocator;

/// Free memory the allocator may keep after a run: more than batches of short texts reuse,
/// less than batches of long texts leave behind (a mixed stream ~120 MiB, a soak of long
/// texts up to ~500).
pub const FREE_LIMIT: usize = 64 << 20;

static CHOICE: OnceLock<Allocator> = OnceLock::new();

/// Sets this process's allocator, once, before the first session is built.
pub fn configure(choice: Allocator) {
    let _ = CHOICE.set(choice);
}

/// This process's choice (`malloc` where nothing was configured, as in `inferd check`).
pub fn current() -> Allocator {
    CHOICE.get().copied().unwrap_or_default()
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
