//! The memory the pool may use: the lower of MemAvailable and what its cgroup still allows
//! (v1 `memory.limit_in_bytes` - `memory.usage_in_bytes`, v2 `memory.max` - `memory.current`,
//! the tightest along the cgroup's ancestors).

use std::path::{Path, PathBuf};

/// Limits at or above this mean "no limit" (v1 reports a huge page-aligned number).
const UNLIMITED: u64 = 1 << 60;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupMemory {
    pub limit: u64,
    pub usage: u64,
    /// The folder the limit came from.
    pub source: String,
    /// v1 `memory.oom_control` or v2 `memory.events`, to read the OOM-kill count from.
    pub events: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryBudget {
    /// MemAvailable from /proc/meminfo.
    pub available: u64,
    pub cgroup: Option<CgroupMemory>,
}

impl MemoryBudget {
    pub fn detect() -> MemoryBudget {
        let available = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| m.lines().find_map(|l| l.strip_prefix("MemAvailable:")).map(str::to_string))
            .and_then(|v| v.split_whitespace().next().and_then(|kb| kb.parse::<u64>().ok()))
            .map_or(u64::MAX, |kb| kb * 1024);
        MemoryBudget { available, cgroup: cgroup_memory() }
    }

    /// Bytes that can still be allocated before the kernel reclaims hard or kills.
    pub fn room(&self) -> u64 {
        let cgroup = self.cgroup.as_ref().map_or(u64::MAX, |c| c.limit.saturating_sub(c.usage));
        self.available.min(cgroup)
    }

    pub fn describe(&self) -> String {
        let mib = |b: u64| b / (1 << 20);
        match &self.cgroup {
            Some(c) => format!(
                "MemAvailable {} MiB, cgroup limit {} MiB with {} MiB used ({})",
                mib(self.available),
                mib(c.limit),
                mib(c.usage),
                c.source
            ),
            None => format!("MemAvailable {} MiB, no cgroup memory limit", mib(self.available)),
        }
    }

    /// OOM kills the kernel has made in the cgroup, if it says.
    pub fn oom_kills(&self) -> Option<u64> {
        let text = std::fs::read_to_string(&self.cgroup.as_ref()?.events).ok()?;
        text.lines().find_map(|l| l.strip_prefix("oom_kill ")).and_then(|v| v.trim().parse().ok())
    }
}

fn read_u64(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let text = text.trim();
    if text == "max" {
        Some(u64::MAX)
    } else {
        text.parse().ok()
    }
}

/// The tightest memory limit on this process's cgroup and its ancestors.
fn cgroup_memory() -> Option<CgroupMemory> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut best: Option<CgroupMemory> = None;
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        let (mount, limit_file, usage_file, events_file) = if controllers.is_empty() {
            ("/sys/fs/cgroup", "memory.max", "memory.current", "memory.events")
        } else if controllers.split(',').any(|c| c == "memory") {
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "memory.oom_control")
        } else {
            continue;
        };
        let mount = Path::new(mount);
        let mut dir = mount.join(path.trim_start_matches('/'));
        loop {
            if let (Some(limit), Some(usage)) = (read_u64(&dir.join(limit_file)), read_u64(&dir.join(usage_file))) {
                if limit < UNLIMITED
                    && best.as_ref().is_none_or(|b| limit.saturating_sub(usage) < b.limit.saturating_sub(b.usage))
                {
                    best = Some(CgroupMemory {
                        limit,
                        usage,
                        source: dir.display().to_string(),
                        events: dir.join(events_file),
                    });
                }
            }
            if dir == mount || !dir.pop() || !dir.starts_with(mount) {
                break;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_is_the_tighter_of_meminfo_and_cgroup() {
        let cgroup = |limit, usage| CgroupMemory { limit, usage, source: "t".into(), events: PathBuf::new() };
        let b = MemoryBudget { available: 1000, cgroup: Some(cgroup(800, 500)) };
        assert_eq!(b.room(), 300);
        let b = MemoryBudget { available: 200, cgroup: Some(cgroup(800, 500)) };
        assert_eq!(b.room(), 200);
        assert_eq!(MemoryBudget { available: 200, cgroup: None }.room(), 200);
        assert!(MemoryBudget::detect().available > 0);
    }
}
