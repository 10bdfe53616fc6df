//! What a model's load needs of the worker's share of models.memory_budget: the room its load
//! takes at its peak (the worker's own pages at their highest while its sessions load, and the
//! weights it maps). Once a model has loaded here, the highest peak its loads measured; before,
//! [`FIRST_LOAD_FACTOR`] times its file. Only loads that mapped the model's shared weights are
//! recorded: the one load of a model version that prepares them (an optimising session, 4 to
//! 6 times the file) peaks once, never again.
//!
//! Scaling another model's measured peak to this one's file was tried (bench/many_models.sh,
//! the tight row) and left out: under traffic, the peaks sampled for one model's loads ranged
//! from 1.2 to 4 times what it held, and a single neighbour's figure evicted too little
//! before first loads (the pool's peak rose past the budget's 1.1x in tests/model_budget.rs).

use std::collections::HashMap;
use std::fmt;

/// Before any load was measured, the room a model is given: this many times its file. A first
/// load may prepare the model's shared weights (an optimising session of its own, which holds
/// the weights, their pre-packed form and the file it writes), and that is its peak: measured
/// on generated MLPs of 24 MiB, the worker's PSS rose by 4.1 times the file during the load,
/// and stayed 1.5 to 3 times the file above where it was once the model was warm.
pub const FIRST_LOAD_FACTOR: u64 = 5;

/// The peaks of the loads measured in this worker.
#[derive(Debug, Default)]
pub struct Needs {
    /// By model: the highest peak its loads took, and what it held once loaded, as it last
    /// loaded.
    loads: HashMap<String, (u64, u64)>,
}

/// A load's need, and where it comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Need {
    pub bytes: u64,
    pub basis: Basis,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Basis {
    /// The model's own loads here: the highest peak they took.
    Measured,
    /// Not loaded here yet: [`FIRST_LOAD_FACTOR`] times the file.
    Guess,
    /// Its file: the least its load needs.
    File,
    /// What the model holds once loaded, measured by a load that prepared its shared weights
    /// (whose peak says nothing of a later load's, which maps them).
    Held,
}

impl Needs {
    /// `name`'s load peaked at `peak` and left it holding `held`. The need kept is the highest
    /// peak measured: one model's loads under traffic peak from 1.2 to 4 times what it holds,
    /// and a need taken from a low one let the next load past the share (the pool's PSS at
    /// 1.105x the budget in a busy CI run of tests/model_budget.rs).
    pub fn record(&mut self, name: &str, peak: u64, held: u64) {
        let highest = self.loads.get(name).map_or(peak, |&(before, _)| before.max(peak));
        self.loads.insert(name.to_string(), (highest, held));
    }

    /// What `name` held once loaded, when a load of it was measured.
    pub fn held(&self, name: &str) -> Option<u64> {
        self.loads.get(name).map(|&(_, held)| held)
    }

    /// What a load of `name`, whose file has `file` bytes, needs.
    pub fn of(&self, name: &str, file: u64) -> Need {
        match self.loads.get(name) {
            Some(&(peak, _)) => Need { bytes: peak, basis: Basis::Measured },
            None => Need { bytes: file.saturating_mul(FIRST_LOAD_FACTOR), basis: Basis::Guess },
        }
    }
}

impl fmt::Display for Basis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Basis::Measured => write!(f, "the highest peak its loads here took"),
            Basis::Guess => write!(f, "{FIRST_LOAD_FACTOR} times its file, before its first load here"),
            Basis::File => write!(f, "its file, the least its load needs"),
            Basis::Held => write!(f, "what it holds once loaded, measured as it loaded"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_need_is_the_highest_peak_its_loads_measured_or_a_multiple_of_its_file() {
        let mut needs = Needs::default();
        assert_eq!(needs.of("a", 10 << 20), Need { bytes: 50 << 20, basis: Basis::Guess });
        needs.record("a", 30 << 20, 20 << 20);
        assert_eq!(needs.of("a", 10 << 20), Need { bytes: 30 << 20, basis: Basis::Measured });
        assert_eq!((needs.held("a"), needs.held("b")), (Some(20 << 20), None));
        // Measured again lower: the highest peak stays; what it holds is the latest.
        needs.record("a", 25 << 20, 18 << 20);
        assert_eq!(needs.of("a", 10 << 20).bytes, 30 << 20);
        assert_eq!(needs.held("a"), Some(18 << 20));
        needs.record("a", 40 << 20, 20 << 20);
        assert_eq!(needs.of("a", 10 << 20).bytes, 40 << 20);
        assert_eq!(needs.of("b", 4 << 20).bytes, 20 << 20);
    }
}
