//! inferd-bench: the measuring side of inferd. The library holds the closed-loop HTTP load
//! that both the `inferd-bench` binary and `inferd tune` drive.

pub mod load;
