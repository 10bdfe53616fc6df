//! A memfd the supervisor and its workers map read-write and touch only through atomics: the
//! storage under every table they share. Its users: a worker's counters
//! ([`crate::stats::WorkerCounters`], fd 4), the pool's core claims
//! ([`crate::cores::CoreClaims`], fd 9), its connection balance ([`crate::balance::Balance`],
//! fd 10) and its API key limits ([`crate::limits::Limits`], fd 11).

use std::num::NonZeroUsize;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// The atomics a region holds: valid for any bit pattern, so any bytes of the file are one.
pub(crate) trait Atomic {}
impl Atomic for AtomicU32 {}
impl Atomic for AtomicU64 {}

pub(crate) struct Region {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the region is only ever accessed through atomics.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// A new zeroed region of `len` bytes and the descriptor to hand to a worker.
    pub(crate) fn create(name: &str, len: usize) -> std::io::Result<(Region, OwnedFd)> {
        let fd = nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_CLOEXEC)?;
        nix::unistd::ftruncate(&fd, len as i64)?;
        Ok((Region::map(&fd, len)?, fd))
    }

    /// Maps the `len` bytes of a region made by [`Region::create`].
    pub(crate) fn map(fd: impl AsFd, len: usize) -> std::io::Result<Region> {
        use nix::sys::mman::{mmap, MapFlags, ProtFlags};
        let size = NonZeroUsize::new(len).expect("non-empty");
        // SAFETY: a fresh shared mapping of a file of this size; nothing else aliases it in
        // this process, and all access goes through atomics (see `at`).
        let ptr =
            unsafe { mmap(None, size, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE, MapFlags::MAP_SHARED, fd, 0)? };
        Ok(Region { ptr: ptr.cast(), len })
    }

    /// The atomic at byte `offset`.
    pub(crate) fn at<T: Atomic>(&self, offset: usize) -> &T {
        assert!(offset + std::mem::size_of::<T>() <= self.len && offset.is_multiple_of(std::mem::align_of::<T>()));
        // SAFETY: in bounds and aligned (the mapping is page-aligned), valid for any bit
        // pattern, and the mapping lives as long as self.
        unsafe { &*self.ptr.as_ptr().add(offset).cast::<T>() }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        let _ = unsafe { nix::sys::mman::munmap(self.ptr.cast(), self.len) };
    }
}
