//! Request rounding (PyTorch's rules) and the size-class ("bin") mapping used by the free lists.
//!
//! Rounding decides how many bytes a block holds; binning decides where a free block is filed.
//! Bins are a small floating-point number over 512-byte granules: 4 mantissa bits, so each
//! power-of-two range is split into 16 bins and a bin's sizes differ by at most 1/16.
//! A free block is filed in the bin that rounds its size *down*; a search starts at the bin that
//! rounds the request *up*, so any block found there fits without looking at its size.

use crate::config::Config;
use crate::units::MIB;

/// Every block size is a multiple of this (PyTorch's `kMinBlockSize`).
pub const GRANULE: u64 = 512;
/// Requests up to this size use the small pool (`kSmallSize`).
pub const SMALL_REQUEST: u64 = MIB;
/// Segment size of the small pool (`kSmallBuffer`).
pub const SMALL_SEGMENT: u64 = 2 * MIB;
/// Segment size for 1–10 MiB requests (`kLargeBuffer`).
pub const LARGE_SEGMENT: u64 = 20 * MIB;
/// Requests at least this large get a segment of their own size (`kMinLargeAlloc`).
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// Large segments are rounded to this (`kRoundLarge`).
pub const LARGE_ROUNDING: u64 = 2 * MIB;
/// Largest request stepalloc accepts at all (256 TiB); anything larger is out of memory at once.
pub const MAX_REQUEST: u64 = 1 << 48;

const MANTISSA_BITS: u32 = 4;
const MANTISSA_VALUES: u64 = 1 << MANTISSA_BITS;
const MANTISSA_MASK: u64 = MANTISSA_VALUES - 1;
/// Bins per exponent group; a group is one bit of the top-level bitmap.
pub const BINS_PER_GROUP: usize = MANTISSA_VALUES as usize;
/// Exponent groups needed for sizes up to `MAX_REQUEST` (2^39 granules).
pub const GROUPS: usize = 40;
pub const BIN_COUNT: usize = GROUPS * BINS_PER_GROUP;

/// Rounds a request the way PyTorch does: to 512 B, or with `roundup_power2_divisions` to the
/// next of N equal divisions of its power-of-two interval. `size` must be at most `MAX_REQUEST`.
#[inline]
pub fn round_size(size: u64, config: &Config) -> u64 {
    if size < GRANULE {
        return GRANULE;
    }
    let divisions = config.divisions_for(size);
    // Saturating: PyTorch accepts any power of two as a division count, up to 2^63.
    if divisions > 1 && size > GRANULE.saturating_mul(divisions) {
        next_division(size, divisions)
    } else {
        size.div_ceil(GRANULE) * GRANULE
    }
}

/// The next multiple of (power-of-two floor of `size`) / `divisions` at or above `size`.
fn next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> divisions.trailing_zeros();
    if step == 0 {
        return floor << 1;
    }
    let rounded_down = size & !(step - 1);
    if rounded_down == size {
        size
    } else {
        rounded_down + step
    }
}

/// Whether a rounded request is served from the small pool.
#[inline]
pub fn is_small(rounded: u64) -> bool {
    rounded <= SMALL_REQUEST
}

/// Bytes to reserve from the device for a new segment that will serve `rounded` bytes.
pub fn segment_size(rounded: u64) -> u64 {
    if rounded <= SMALL_REQUEST {
        SMALL_SEGMENT
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_SEGMENT
    } else {
        rounded.div_ceil(LARGE_ROUNDING) * LARGE_ROUNDING
    }
}

/// The bin a free block of `size` bytes is filed in (rounds down). `size` is a multiple of
/// `GRANULE`, at least one granule.
#[inline(always)]
pub fn bin_down(size: u64) -> usize {
    let units = size / GRANULE;
    if units < MANTISSA_VALUES {
        return units as usize;
    }
    let high_bit = 63 - units.leading_zeros();
    let exponent = high_bit - MANTISSA_BITS + 1;
    let mantissa = (units >> (exponent - 1)) & MANTISSA_MASK;
    ((exponent as u64) * MANTISSA_VALUES + mantissa) as usize
}

/// The first bin whose every block holds at least `size` bytes (rounds up).
#[inline(always)]
pub fn bin_up(size: u64) -> usize {
    let down = bin_down(size);
    if bin_start(down) == size.div_ceil(GRANULE) * GRANULE {
        down
    } else {
        down + 1
    }
}

/// The smallest size filed in `bin`.
#[inline]
pub fn bin_start(bin: usize) -> u64 {
    let exponent = bin as u64 / MANTISSA_VALUES;
    let mantissa = bin as u64 & MANTISSA_MASK;
    let units = if exponent == 0 { mantissa } else { (MANTISSA_VALUES + mantissa) << (exponent - 1) };
    units * GRANULE
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::GIB;

    #[test]
    fn rounding_table_default() {
        let c = Config::default();
        let table: &[(u64, u64)] = &[
            (0, 512),
            (1, 512),
            (512, 512),
            (513, 1024),
            (1000, 1024),
            (1 << 20, 1 << 20),
            ((1 << 20) + 1, (1 << 20) + 512),
            (10 * MIB + 100, 10 * MIB + 512),
        ];
        for &(size, rounded) in table {
            assert_eq!(round_size(size, &c), rounded, "size {size}");
        }
    }

    #[test]
    fn rounding_table_power2_divisions() {
        let c = Config::parse("roundup_power2_divisions:4").unwrap();
        let table: &[(u64, u64)] = &[
            (100, 512),               // below one granule
            (1500, 1536),             // <= 512*4: plain 512 rounding
            (2049, 2560),             // 2048 + 2048/4
            (3000, 3072),             // 2048 + 2*512
            (4096, 4096),             // power of two stays
            (5 * MIB, 5 * MIB),       // 4 MiB + 1 MiB exactly on a division
            (5 * MIB + 1, 6 * MIB),   // next division of the 4 MiB interval
            (1200 * MIB, 1280 * MIB), // 1 GiB interval in quarters
            (GIB + 1, GIB + GIB / 4),
        ];
        for &(size, rounded) in table {
            assert_eq!(round_size(size, &c), rounded, "size {size}");
        }
        let c = Config::parse("roundup_power2_divisions:[1:1,>:2]").unwrap();
        assert_eq!(round_size(1000, &c), 1024); // 1 division below 1 MiB: plain rounding
        assert_eq!(round_size(3 * MIB + 1, &c), 4 * MIB); // halves of the 2 MiB interval
    }

    #[test]
    fn pools_and_segment_sizes() {
        assert!(is_small(MIB));
        assert!(!is_small(MIB + 512));
        let table: &[(u64, u64)] = &[
            (512, 2 * MIB),
            (MIB, 2 * MIB),
            (MIB + 512, 20 * MIB),
            (10 * MIB - 512, 20 * MIB),
            (10 * MIB, 10 * MIB),
            (10 * MIB + 512, 12 * MIB),
            (101 * MIB, 102 * MIB),
        ];
        for &(rounded, segment) in table {
            assert_eq!(segment_size(rounded), segment, "rounded {rounded}");
        }
    }

    #[test]
    fn bin_table() {
        // (size, bin_down, bin_up, bin_start(bin_down))
        let table: &[(u64, usize, usize, u64)] = &[
            (512, 1, 1, 512),
            (15 * 512, 15, 15, 15 * 512),
            (16 * 512, 16, 16, 16 * 512),
            (31 * 512, 31, 31, 31 * 512),
            (32 * 512, 32, 32, 32 * 512),
            (33 * 512, 32, 33, 32 * 512),
            (34 * 512, 33, 33, 34 * 512),
            (MIB, 128, 128, MIB), // 2048 granules: exponent 8, mantissa 0
            (MIB + 512, 128, 129, MIB),
            (20 * MIB, 196, 196, 20 * MIB), // 40960 granules = 2^15 * 1.25: exponent 12, mantissa 4
            (1 << 48, 576, 576, 1 << 48),
        ];
        for &(size, down, up, start) in table {
            assert_eq!(bin_down(size), down, "bin_down({size})");
            assert_eq!(bin_up(size), up, "bin_up({size})");
            assert_eq!(bin_start(down), start, "bin_start({down})");
        }
        assert!(bin_down(MAX_REQUEST) < BIN_COUNT);
    }

    #[test]
    fn bins_are_monotone_and_round_correctly() {
        let mut size = GRANULE;
        while size < (1 << 40) {
            for s in [size, size + GRANULE, size * 3 / 2 / GRANULE * GRANULE] {
                let down = bin_down(s);
                let up = bin_up(s);
                assert!(bin_start(down) <= s && s < bin_start(down + 1), "down {s}");
                assert!(bin_start(up) >= s, "up {s}");
                assert!(up == down || up == down + 1);
            }
            size *= 2;
        }
    }
}
