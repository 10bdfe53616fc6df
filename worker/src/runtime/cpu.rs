//! The CPU as ONNX Runtime's kernels (MLAS) see it: its int8 class, which of their u8 x s8
//! kernels run an int8 graph here, read as MLAS reads it, from CPUID (through std's feature
//! detection, which also asks the OS whether it saves the wide registers). Never from
//! /proc/cpuinfo: an emulated or masked CPU (a VM's CPU model, `qemu-x86_64 -cpu`) reports its
//! own features through CPUID while /proc/cpuinfo still shows the host's flags.
//!
//! What the class decides: with VNNI (AVX-512 VNNI or AVX-VNNI), the kernels multiply u8 by s8
//! and accumulate in 32 bits. Without, the AVX2 and AVX-512 kernels (`vpmaddubsw`) add each
//! pair of u8 x s8 products into 16 bits with saturation (what the int8 rewrite makes of that:
//! [`crate::load::int8::rewrite::Range`]). The class is also part of the key of a model's
//! prepared weights ([`super::weights`]), whose optimised graph may depend on the kernels.

use serde::{Deserialize, Serialize};

/// The CPU's int8 kernels, most capable first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Class {
    /// AVX-512 VNNI (`vpdpbusd` on 512 bits).
    Avx512Vnni,
    /// AVX-VNNI (`vpdpbusd` on 256 bits, without AVX-512).
    AvxVnni,
    /// AVX-512 without VNNI (`vpmaddubsw` on 512 bits: pairs saturate at 16 bits).
    Avx512,
    /// AVX2 with FMA, no VNNI (`vpmaddubsw` on 256 bits: pairs saturate at 16 bits).
    Avx2,
    /// Older x86 (SSE4.1 kernels) or another architecture.
    Other,
}

impl Class {
    /// This CPU's class, as CPUID says now.
    pub fn detect() -> Class {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512bw") && has!("avx512vnni") {
                return Class::Avx512Vnni;
            }
            if has!("avxvnni") {
                return Class::AvxVnni;
            }
            if has!("avx512bw") {
                return Class::Avx512;
            }
            if has!("avx2") && has!("fma") {
                return Class::Avx2;
            }
        }
        Class::Other
    }

    /// Whether its u8 x s8 kernels accumulate in 32 bits (VNNI), not pairs in 16.
    pub fn vnni(self) -> bool {
        matches!(self, Class::Avx512Vnni | Class::AvxVnni)
    }

    /// Its name, as `inferd check`, status and the metrics say it.
    pub fn name(self) -> &'static str {
        match self {
            Class::Avx512Vnni => "avx512-vnni",
            Class::AvxVnni => "avx-vnni",
            Class::Avx512 => "avx512",
            Class::Avx2 => "avx2",
            Class::Other => "other",
        }
    }
}

impl std::fmt::Display for Class {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a host whose /proc/cpuinfo is its own CPUID (no emulation), both agree on VNNI.
    #[test]
    fn the_class_agrees_with_the_kernels_flags_on_this_host() {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let Some(flags) = cpuinfo.lines().find(|l| l.starts_with("flags")) else {
            eprintln!("skipped: no flags line in /proc/cpuinfo");
            return;
        };
        let flag = |f: &str| flags.split_whitespace().any(|x| x == f);
        let class = Class::detect();
        assert_eq!(class.vnni(), flag("avx512_vnni") && flag("avx512bw") || flag("avx_vnni"), "{class}: {flags}");
        assert_eq!(class == Class::Avx2, !class.vnni() && !flag("avx512bw") && flag("avx2") && flag("fma"), "{flags}");
    }
}
