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

/// One worker's memory, as the memory plan counts it: its own (`private`: RssAnon + RssShmem)
/// and what it maps that is in memory once however many workers map it (`shared`: the rest
/// of VmRSS, the libraries and the prepared weights).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerMemory {
    pub private: u64,
    pub shared: u64,
}

impl WorkerMemory {
    /// Read from /proc/PID/status; when it cannot be read, 1 byte private and nothing shared
    /// (the plan then counts the worker as nothing, and its limits' check says so).
    pub fn of(pid: u32) -> WorkerMemory {
        let proc = proc_status(pid);
        let private = proc.private.or(proc.rss).unwrap_or(0).max(1);
        WorkerMemory { private, shared: proc.rss.unwrap_or(0).saturating_sub(private) }
    }
}

/// What the kernel says of a process's memory and threads (bytes; None: not readable).
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcStatus {
    pub rss: Option<u64>,
    /// Pages no other process can share: anonymous and shmem (RssAnon + RssShmem). The
    /// weights a worker maps from the shared artefact are file pages, counted in `rss` of
    /// every worker but in memory once; the guards watch this instead.
    pub private: Option<u64>,
    pub threads: Option<u64>,
}

/// /proc/PID/status's memory and thread counts.
pub fn proc_status(pid: u32) -> ProcStatus {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return ProcStatus::default();
    };
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
    };
    let kb = |name: &str| field(name).map(|kb| kb * 1024);
    ProcStatus {
        rss: kb("VmRSS:"),
        private: kb("RssAnon:").map(|anon| anon + kb("RssShmem:").unwrap_or(0)),
        threads: field("Threads:"),
    }
}

impl MemoryBudget {
    /// The one rule of `serve` (measured on worker 0 after warm-up) and `inferd check` (on its
    /// own process with the models loaded): how many of `k` workers like `one` fit, that one
    /// running already (its memory is out of `room`), and the line that says so. The others
    /// must fit with 10% to spare; under a cgroup limit (which charges the shared pages once),
    /// each also needs a share of it large enough that the soft limit (85% of the share) sits
    /// above a fresh worker's private memory, or workers would be replaced as soon as they
    /// start. Never below 1: whether even that one fits is the limits' check.
    pub fn fit(&self, k: u64, one: WorkerMemory, measured: &str) -> (u64, String) {
        let WorkerMemory { private, shared } = one;
        let mut fit = 1 + self.room() / (private + private / 10);
        if let Some(c) = &self.cgroup {
            fit = fit.min(c.limit.saturating_sub(shared) / (private + private / 4));
        }
        let fit = fit.max(1);
        let mib = |b: u64| b / (1 << 20);
        let plan = format!(
            "{k} {} ~{} MiB ({} MiB private each, {} MiB shared once, measured {measured}); {}; {fit} fit",
            if k == 1 { "worker needs" } else { "workers need" },
            mib(k * private + shared),
            mib(private),
            mib(shared),
            self.describe()
        );
        (fit, plan)
    }
}

/// Without a cgroup limit, the workers share this much of the memory available at start; the
/// rest is left to the host (page cache, the supervisor, other services).
const HOST_SHARE_PERCENT: u64 = 80;

/// Per-worker limits of private memory: replace above `soft`, kill above `hard`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerLimits {
    pub soft: Option<u64>,
    pub hard: Option<u64>,
    /// Where the limits came from, for the log, `status` and `inferd check`.
    pub source: String,
}

impl WorkerLimits {
    /// The configured limits (MiB, 0 = derived), else 85% (soft) and 95% (hard) of each
    /// worker's share: of the cgroup's limit less the memory the workers share (mapped
    /// weights, libraries: charged once), or, with no cgroup limit, of
    /// [`HOST_SHARE_PERCENT`] of what was available, counting the first worker's own `private`
    /// memory back in. So a growing worker is replaced, and then killed, before the
    /// kernel's OOM killer picks a process.
    pub fn derive(budget: &MemoryBudget, workers: u64, private: u64, shared: u64, soft_mb: u64, hard_mb: u64) -> Self {
        let workers = workers.max(1);
        let (pool, source) = match &budget.cgroup {
            Some(c) => (c.limit.saturating_sub(shared), format!("the cgroup's limit less {} MiB shared", shared >> 20)),
            None => (
                budget.available.saturating_add(private) / 100 * HOST_SHARE_PERCENT,
                format!("{HOST_SHARE_PERCENT}% of the memory available at start (no cgroup memory limit)"),
            ),
        };
        let share = pool / workers;
        let limit = |mb: u64, percent: u64| match mb {
            0 => Some(share / 100 * percent),
            mb => Some(mb << 20),
        };
        let derived = match (soft_mb, hard_mb) {
            (0, 0) => format!("85% and 95% of each worker's share ({} MiB) of {source}", share >> 20),
            (_, 0) | (0, _) => format!("as configured, else 85% / 95% of each worker's share of {source}"),
            _ => "as configured".to_string(),
        };
        WorkerLimits { soft: limit(soft_mb, 85), hard: limit(hard_mb, 95), source: derived }
    }

    pub fn describe(&self) -> String {
        let mib = |b: Option<u64>| b.map_or("none".to_string(), |b| format!("{} MiB", b >> 20));
        format!("replace above {}, kill above {} ({})", mib(self.soft), mib(self.hard), self.source)
    }
}

/// The memory the pool's models may hold ([models] on_demand), and where the figure comes
/// from: models.memory_budget (`configured`), else 80% of what the default soft limits allow
/// the workers in all (85% of the cgroup's limit, or of 80% of MemAvailable without one), so
/// that a worker within its share of the budget stays below its soft limit whatever it loads.
pub fn models_budget(configured: Option<u64>, budget: &MemoryBudget) -> (u64, String) {
    if let Some(bytes) = configured {
        return (bytes, "models.memory_budget".into());
    }
    let (pool, source) = match &budget.cgroup {
        Some(c) => (c.limit, "the cgroup's memory limit".to_string()),
        None => (budget.available / 100 * HOST_SHARE_PERCENT, format!("{HOST_SHARE_PERCENT}% of MemAvailable")),
    };
    (pool / 100 * 85 / 100 * 80, format!("68% of {source}"))
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
    fn the_fit_counts_private_memory_and_each_workers_share_of_the_cgroup() {
        let mib = 1 << 20;
        let one = WorkerMemory { private: 10 * mib, shared: 30 * mib };
        // No cgroup: 1000 MiB of room at 11 MiB a worker (10% to spare), beside the one running.
        let host = MemoryBudget { available: 1000 * mib, cgroup: None };
        assert_eq!(host.fit(8, one, "here").0, 91);
        // 55 MiB of room fits 5 more; but 70 MiB of limit less what is shared, at 12.5 MiB a
        // worker (its soft limit above a fresh one), allows 5 in all.
        let cgroup = CgroupMemory { limit: 100 * mib, usage: 45 * mib, source: "test".into(), events: PathBuf::new() };
        let pod = MemoryBudget { available: 1000 * mib, cgroup: Some(cgroup) };
        let (fit, line) = pod.fit(8, one, "on worker 0");
        assert_eq!(fit, 5);
        assert!(
            line.starts_with("8 workers need ~110 MiB (10 MiB private each, 30 MiB shared once, measured on worker 0)"),
            "{line}"
        );
        // Never below the one that runs.
        let full = MemoryBudget { available: 0, cgroup: None };
        assert_eq!(full.fit(2, one, "x").0, 1);
    }

    fn cgroup(limit: u64, usage: u64) -> CgroupMemory {
        CgroupMemory { limit, usage, source: "t".into(), events: PathBuf::new() }
    }

    #[test]
    fn room_is_the_tighter_of_meminfo_and_cgroup() {
        let b = MemoryBudget { available: 1000, cgroup: Some(cgroup(800, 500)) };
        assert_eq!(b.room(), 300);
        let b = MemoryBudget { available: 200, cgroup: Some(cgroup(800, 500)) };
        assert_eq!(b.room(), 200);
        assert_eq!(MemoryBudget { available: 200, cgroup: None }.room(), 200);
        assert!(MemoryBudget::detect().available > 0);
    }

    #[test]
    fn every_worker_has_a_limit_even_without_a_cgroup() {
        let gib = 1u64 << 30;
        let host = MemoryBudget { available: 9 * gib, cgroup: None };
        // 80% of (9 GiB available + 1 GiB the first worker holds), 2 workers: 4 GiB each.
        let l = WorkerLimits::derive(&host, 2, gib, 0, 0, 0);
        assert_eq!((l.soft, l.hard), (Some(4 * gib / 100 * 85), Some(4 * gib / 100 * 95)));
        assert!(l.source.contains("no cgroup memory limit"), "{}", l.source);
        // A cgroup: its limit less the shared memory, per worker.
        let boxed = MemoryBudget { available: 100 * gib, cgroup: Some(cgroup(10 * gib, gib)) };
        let l = WorkerLimits::derive(&boxed, 2, gib, 2 * gib, 0, 0);
        assert_eq!(l.soft, Some(4 * gib / 100 * 85));
        // Configured values win.
        let l = WorkerLimits::derive(&host, 2, gib, 0, 512, 1024);
        assert_eq!((l.soft, l.hard, l.source.as_str()), (Some(512 << 20), Some(1024 << 20), "as configured"));
    }
}
