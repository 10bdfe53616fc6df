//! The CPU budget and how it is split between workers.
//!
//! Usable cores = the CPUs in this process's affinity mask (which already reflects a cpuset
//! cgroup, `taskset` or systemd's `CPUAffinity=`), further capped by the cgroup CPU quota
//! (v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`, the tightest along the cgroup's
//! ancestors), rounded down. Workers x intra-op threads must fit in that number unless the
//! operator allows oversubscription; worker `i` is pinned to CPUs `[i*T, (i+1)*T)` of the
//! usable list. Workers of one thread each may borrow the next worker's core for a run while
//! it is idle (`server.lend_idle_cores`, see `inferd_ipc::cores`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// What the machine lets this process use.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CpuBudget {
    /// CPUs in the affinity mask, ascending.
    pub affinity: Vec<usize>,
    /// Cores allowed by the cgroup quota, if one is set.
    pub quota_cores: Option<f64>,
    /// The file the quota came from.
    pub quota_source: Option<String>,
    /// Whole cores the pool may use: min(affinity, floor(quota)), at least 1.
    pub usable: usize,
}

impl CpuBudget {
    pub fn detect() -> CpuBudget {
        let affinity = affinity_cpus();
        let quota = cgroup_quota();
        CpuBudget::from_parts(affinity, quota)
    }

    pub fn from_parts(affinity: Vec<usize>, quota: Option<(f64, String)>) -> CpuBudget {
        let mut usable = affinity.len().max(1);
        if let Some((cores, _)) = &quota {
            usable = usable.min((cores.floor() as usize).max(1));
        }
        let (quota_cores, quota_source) = match quota {
            Some((c, s)) => (Some(c), Some(s)),
            None => (None, None),
        };
        CpuBudget { affinity, quota_cores, quota_source, usable }
    }

    /// The CPUs workers are pinned to: the first `usable` of the affinity mask.
    pub fn usable_cpus(&self) -> Vec<usize> {
        if self.affinity.is_empty() {
            return (0..self.usable).collect();
        }
        self.affinity.iter().copied().take(self.usable).collect()
    }
}

/// Where one worker runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub index: usize,
    /// CPUs the worker is pinned to; empty = not pinned.
    pub cpus: Vec<usize>,
    /// ORT intra-op threads.
    pub threads: usize,
    /// The CPU this worker may borrow for a run while it is idle: the next worker's
    /// (server.lend_idle_cores).
    #[serde(default)]
    pub borrow: Option<usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Plan {
    pub budget: CpuBudget,
    pub threads_per_worker: usize,
    pub workers: Vec<Placement>,
    pub oversubscribed: bool,
}

impl Plan {
    pub fn total_threads(&self) -> usize {
        self.workers.iter().map(|w| w.threads).sum()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "{workers} workers x {threads} threads = {total} threads, but only {usable} cores are usable \
         ({detail}); lower server.workers or server.threads, or set server.allow_oversubscription = true"
    )]
    Oversubscribed { workers: usize, threads: usize, total: usize, usable: usize, detail: String },
}

/// What the configuration asks of the plan (server.workers, threads, allow_oversubscription,
/// pin_workers, lend_idle_cores).
#[derive(Debug, Clone, Copy)]
pub struct Ask {
    /// 0: derive from the budget (with `threads` 0 too: the default plan).
    pub workers: usize,
    /// 0: derive from the budget.
    pub threads: usize,
    pub allow_oversubscription: bool,
    pub pin: bool,
    pub lend: bool,
}

impl Ask {
    pub fn of(server: &inferd_config::file::ServerConfig) -> Ask {
        Ask {
            workers: server.workers,
            threads: server.threads,
            allow_oversubscription: server.allow_oversubscription,
            pin: server.pin_workers,
            lend: server.lend_idle_cores,
        }
    }
}

/// Splits the budget.
pub fn plan(budget: &CpuBudget, ask: Ask) -> Result<Plan, PlanError> {
    let Ask { workers, threads, allow_oversubscription, pin, lend } = ask;
    let usable = budget.usable;
    let (workers, threads) = match (workers, threads) {
        // Two or three cores, lending: a worker per core, each running on its own core and an
        // idle sibling's, so one worker's crash leaves the others serving.
        (0, 0) if lend && pin && (2..4).contains(&usable) => (usable, 1),
        (0, 0) => {
            // Workers of two threads each. A worker runs a lone request on both threads (~0.6x
            // the single-thread time for MiniLM) and, under load, a batch per thread side by side
            // (no thread synchronisation); more threads per run gain little for the small
            // models served on CPUs (docs/tuning.md has the figures), and more workers keep
            // a crash from taking a whole host's capacity. One core: one worker, one thread.
            let workers = (usable / 2).max(1);
            (workers, (usable / workers).max(1))
        }
        (0, t) => ((usable / t).max(1), t),
        (k, 0) => (k, (usable / k).max(1)),
        (k, t) => (k, t),
    };
    let total = workers * threads;
    let oversubscribed = total > usable;
    if oversubscribed && !allow_oversubscription {
        return Err(PlanError::Oversubscribed { workers, threads, total, usable, detail: budget.describe() });
    }
    let cpus = budget.usable_cpus();
    // Past the budget (only with allow_oversubscription) the sets wrap around.
    let pinned = |index: usize| -> Vec<usize> {
        match pin {
            true => (0..threads).map(|j| cpus[(index * threads + j) % cpus.len()]).collect(),
            false => Vec::new(),
        }
    };
    let lending = lend && pin && threads == 1 && workers >= 2 && !oversubscribed;
    let workers = (0..workers)
        .map(|index| Placement {
            index,
            cpus: pinned(index),
            threads,
            borrow: lending.then(|| pinned((index + 1) % workers)[0]),
        })
        .collect();
    Ok(Plan { budget: budget.clone(), threads_per_worker: threads, workers, oversubscribed })
}

impl CpuBudget {
    /// One line saying where the number of usable cores came from.
    pub fn describe(&self) -> String {
        let mut s = format!("affinity {} ({} cpus)", format_cpus(&self.affinity), self.affinity.len());
        match (&self.quota_cores, &self.quota_source) {
            (Some(c), Some(src)) => s.push_str(&format!(", cgroup quota {c:.2} cores from {src}")),
            _ => s.push_str(", no cgroup CPU quota"),
        }
        s
    }
}

/// "0-3,6" style list.
pub fn format_cpus(cpus: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let start = cpus[i];
        let mut end = start;
        while i + 1 < cpus.len() && cpus[i + 1] == end + 1 {
            i += 1;
            end = cpus[i];
        }
        out.push(if start == end { start.to_string() } else { format!("{start}-{end}") });
        i += 1;
    }
    if out.is_empty() {
        "-".into()
    } else {
        out.join(",")
    }
}

fn affinity_cpus() -> Vec<usize> {
    match nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)) {
        Ok(set) => (0..nix::sched::CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect(),
        Err(_) => (0..std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)).collect(),
    }
}

/// The tightest CPU quota on this process's cgroup and its ancestors, as (cores, file).
fn cgroup_quota() -> Option<(f64, String)> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut best: Option<(f64, String)> = None;
    let mut consider = |found: Option<(f64, String)>| {
        if let Some((cores, src)) = found {
            if best.as_ref().is_none_or(|(b, _)| cores < *b) {
                best = Some((cores, src));
            }
        }
    };
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if controllers.is_empty() {
            for dir in cgroup_dirs(Path::new("/sys/fs/cgroup"), path) {
                consider(read_v2_quota(&dir.join("cpu.max")));
            }
        } else if controllers.split(',').any(|c| c == "cpu") {
            for mount in ["/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"] {
                for dir in cgroup_dirs(Path::new(mount), path) {
                    consider(read_v1_quota(&dir));
                }
            }
        }
    }
    best
}

/// The cgroup's own folder and its ancestors up to the mount. Inside a container the path in
/// /proc/self/cgroup may not exist under the mount (the mount *is* the container's cgroup),
/// which the mount root itself covers.
fn cgroup_dirs(mount: &Path, path: &str) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let mut current = mount.join(path.trim_start_matches('/'));
    loop {
        if current.is_dir() {
            dirs.push(current.clone());
        }
        if current == mount || !current.pop() || !current.starts_with(mount) {
            break;
        }
    }
    dirs
}

fn read_v2_quota(file: &Path) -> Option<(f64, String)> {
    let text = std::fs::read_to_string(file).ok()?;
    let mut it = text.split_whitespace();
    let (quota, period) = (it.next()?, it.next()?);
    if quota == "max" {
        return None;
    }
    let cores = quota.parse::<f64>().ok()? / period.parse::<f64>().ok()?;
    Some((cores, file.display().to_string()))
}

fn read_v1_quota(dir: &Path) -> Option<(f64, String)> {
    let quota: i64 = std::fs::read_to_string(dir.join("cpu.cfs_quota_us")).ok()?.trim().parse().ok()?;
    let period: i64 = std::fs::read_to_string(dir.join("cpu.cfs_period_us")).ok()?.trim().parse().ok()?;
    if quota <= 0 || period <= 0 {
        return None;
    }
    Some((quota as f64 / period as f64, dir.join("cpu.cfs_quota_us").display().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(cpus: usize, quota: Option<f64>) -> CpuBudget {
        CpuBudget::from_parts((0..cpus).collect(), quota.map(|q| (q, "test".into())))
    }

    /// Pinned, lending, no oversubscription: the configuration's defaults.
    fn ask(workers: usize, threads: usize) -> Ask {
        Ask { workers, threads, allow_oversubscription: false, pin: true, lend: true }
    }

    #[test]
    fn quota_caps_affinity_rounding_down() {
        assert_eq!(budget(8, None).usable, 8);
        assert_eq!(budget(8, Some(2.5)).usable, 2);
        assert_eq!(budget(8, Some(0.5)).usable, 1);
        assert_eq!(budget(2, Some(4.0)).usable, 2);
    }

    #[test]
    fn auto_plan_uses_every_core_once() {
        let p = plan(&budget(4, None), ask(0, 0)).unwrap();
        assert_eq!((p.workers.len(), p.threads_per_worker), (2, 2));
        assert_eq!(p.total_threads(), 4);
        assert_eq!(p.workers[1].cpus, vec![2, 3]);
        for (cores, workers, threads) in [(1, 1, 1), (2, 2, 1), (3, 3, 1), (5, 2, 2), (16, 8, 2)] {
            let p = plan(&budget(cores, None), ask(0, 0)).unwrap();
            assert_eq!((p.workers.len(), p.threads_per_worker), (workers, threads), "{cores} cores");
        }
        // Without lending, two or three cores make one worker of all of them.
        for (cores, threads) in [(2, 2), (3, 3)] {
            let p = plan(&budget(cores, None), Ask { lend: false, ..ask(0, 0) }).unwrap();
            assert_eq!((p.workers.len(), p.threads_per_worker), (1, threads), "{cores} cores");
        }
        let p = plan(&budget(8, None), ask(2, 0)).unwrap();
        assert_eq!(p.threads_per_worker, 4);
        assert_eq!(p.workers[1].cpus, vec![4, 5, 6, 7]);
        let p = plan(&budget(8, Some(3.0)), ask(0, 2)).unwrap();
        assert_eq!((p.workers.len(), p.threads_per_worker), (1, 2));
    }

    #[test]
    fn one_thread_workers_borrow_the_next_workers_core() {
        let p = plan(&budget(2, None), ask(0, 0)).unwrap();
        let lent: Vec<_> = p.workers.iter().map(|w| (w.cpus.clone(), w.borrow)).collect();
        assert_eq!(lent, [(vec![0], Some(1)), (vec![1], Some(0))]);
        let p = plan(&budget(3, None), ask(0, 0)).unwrap();
        assert_eq!(p.workers.iter().map(|w| w.borrow).collect::<Vec<_>>(), [Some(1), Some(2), Some(0)]);
        // Nothing to borrow: one worker, workers of several threads, unpinned, oversubscribed
        // or lending off.
        let none = |p: Plan| p.workers.iter().all(|w| w.borrow.is_none());
        assert!(none(plan(&budget(1, None), ask(0, 0)).unwrap()));
        assert!(none(plan(&budget(4, None), ask(0, 0)).unwrap()));
        assert!(none(plan(&budget(2, None), Ask { pin: false, ..ask(2, 1) }).unwrap()));
        assert!(none(plan(&budget(2, None), Ask { allow_oversubscription: true, ..ask(3, 1) }).unwrap()));
        assert!(none(plan(&budget(2, None), Ask { lend: false, ..ask(2, 1) }).unwrap()));
    }

    #[test]
    fn cpu_sets_are_disjoint_within_budget() {
        let p = plan(&budget(6, None), ask(3, 2)).unwrap();
        let mut all: Vec<usize> = p.workers.iter().flat_map(|w| w.cpus.clone()).collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 6);
    }

    #[test]
    fn oversubscription_is_refused_unless_allowed() {
        let err = plan(&budget(2, None), ask(2, 2)).unwrap_err();
        assert!(err.to_string().contains("2 workers x 2 threads = 4 threads"), "{err}");
        let p = plan(&budget(2, None), Ask { allow_oversubscription: true, ..ask(2, 2) }).unwrap();
        assert!(p.oversubscribed);
        assert_eq!(p.workers[1].cpus, vec![0, 1]);
    }

    #[test]
    fn cpu_lists_are_compact() {
        assert_eq!(format_cpus(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(format_cpus(&[]), "-");
    }
}
