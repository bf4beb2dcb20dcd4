//! Byte units and their human-readable form. Sizes everywhere in stepalloc are `u64` bytes.

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// Formats a byte count in binary units up to PiB, two decimals ("1.50 GiB"): stepalloc's own
/// reports. PyTorch's out-of-memory sentence uses `format_size`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < KIB {
        return format!("{bytes} bytes");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// Formats a byte count exactly as PyTorch's `format_size` (c10/cuda/CUDACachingAllocator.cpp)
/// does in its out-of-memory message: up to 1024 bytes in bytes, up to 1 MiB in KiB, up to 1 GiB
/// in MiB, anything larger in GiB ("800000000.00 GiB", "1024.00 MiB" for exactly 1 GiB), so that
/// text matched against PyTorch's message matches stepalloc's.
pub fn format_size(bytes: u64) -> String {
    if bytes <= KIB {
        format!("{bytes} bytes")
    } else if bytes <= MIB {
        format!("{:.2} KiB", bytes as f64 / KIB as f64)
    } else if bytes <= GIB {
        format!("{:.2} MiB", bytes as f64 / MIB as f64)
    } else {
        format!("{:.2} GiB", bytes as f64 / GIB as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_bytes_uses_binary_units_up_to_pib() {
        assert_eq!(format_bytes(0), "0 bytes");
        assert_eq!(format_bytes(1023), "1023 bytes");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(20 * MIB), "20.00 MiB");
        assert_eq!(format_bytes(3 * GIB / 2), "1.50 GiB");
    }

    #[test]
    fn format_size_is_pytorchs() {
        // The figures PyTorch 2.15's own allocator printed over testdrv (docs/testing.md).
        assert_eq!(format_size(800_000_000 * GIB), "800000000.00 GiB");
        assert_eq!(format_size(GIB), "1024.00 MiB");
        assert_eq!(format_size(4096), "4.00 KiB");
        assert_eq!(format_size(KIB), "1024 bytes");
        assert_eq!(format_size(MIB), "1024.00 KiB");
        assert_eq!(format_size(2 * MIB), "2.00 MiB");
        assert_eq!(format_size(0), "0 bytes");
    }
}
