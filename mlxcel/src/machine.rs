//! What this machine is and which kernel loops it runs: the record printed
//! beside every figure (`mlxcel bench`) and by `mlxcel inspect`.

use mlx_sys::kernels::{self, KernelPath};

/// The CPU: its model name, and on x86-64 its family/model numbers with the
/// microarchitecture where we know it ("AMD EPYC (family 26 model 2, Zen 5)").
pub fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines().find_map(|l| {
            let (key, value) = l.split_once(':')?;
            (key.trim() == name).then(|| value.trim().to_string())
        })
    };
    let Some(name) = field("model name") else {
        return std::env::consts::ARCH.to_string();
    };
    let vendor = field("vendor_id").unwrap_or_default();
    let (Some(family), Some(model)) =
        (field("cpu family").and_then(|f| f.parse::<u32>().ok()), field("model").and_then(|m| m.parse::<u32>().ok()))
    else {
        return name;
    };
    match microarchitecture(&vendor, family, model) {
        Some(uarch) => format!("{name} (family {family} model {model}, {uarch})"),
        None => format!("{name} (family {family} model {model})"),
    }
}

/// Microarchitectures of the server CPUs we meet (AMD's and Intel's
/// published family/model numbers); None for the rest.
fn microarchitecture(vendor: &str, family: u32, model: u32) -> Option<&'static str> {
    match (vendor, family) {
        ("AuthenticAMD", 23) => Some(if model >= 0x30 { "Zen 2" } else { "Zen / Zen+" }),
        ("AuthenticAMD", 25) => Some(match model {
            0x10..=0x1f | 0x60..=0xaf => "Zen 4",
            _ => "Zen 3",
        }),
        ("AuthenticAMD", 26) => Some("Zen 5"),
        ("GenuineIntel", 6) => match model {
            0x55 => Some("Skylake-SP / Cascade Lake"),
            0x6a | 0x6c => Some("Ice Lake-SP"),
            0x8f => Some("Sapphire Rapids"),
            0xcf => Some("Emerald Rapids"),
            0xad | 0xae => Some("Granite Rapids"),
            _ => None,
        },
        _ => None,
    }
}

/// The loops the kernels run here for `bits`-bit weights: the decode matvec
/// (`MLXCEL_KERNELS` and the CPU's features pick it; with the loop that
/// reads the decoder blocks' interleaved copies where that one differs), the
/// prefill GEMM, and the thread count.
pub struct KernelLoops {
    pub matvec: String,
    pub gemm: String,
    pub threads: usize,
}

impl KernelLoops {
    pub fn for_bits(bits: i32) -> KernelLoops {
        KernelLoops {
            matvec: {
                let path = kernels::path_name(KernelPath::Auto);
                match kernels::copy_loop_name(KernelPath::Auto, bits) {
                    copies if copies.is_empty() || copies == path => path,
                    copies => format!("{path} ({copies} on the copies)"),
                }
            },
            gemm: kernels::gemm_loop_name(KernelPath::Auto, bits),
            threads: kernels::num_threads(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_microarchitectures_we_run_on() {
        assert_eq!(microarchitecture("AuthenticAMD", 25, 0x01), Some("Zen 3"));
        assert_eq!(microarchitecture("AuthenticAMD", 25, 0x11), Some("Zen 4"));
        assert_eq!(microarchitecture("AuthenticAMD", 26, 2), Some("Zen 5"));
        assert_eq!(microarchitecture("GenuineIntel", 6, 0x8f), Some("Sapphire Rapids"));
        assert_eq!(microarchitecture("GenuineIntel", 6, 0x01), None);
        assert!(!cpu_model().is_empty());
    }
}
