//! Two-level bitmap over the free-list bins: one bit per exponent group at the top, one bit per
//! bin in each group. Finding the first non-empty bin at or after a given bin takes two
//! `trailing_zeros`, whatever the number of free blocks.

use crate::sizeclass::{BINS_PER_GROUP, BIN_COUNT, GROUPS};

/// Invariant: bit `g` of `top` is set iff `groups[g] != 0`.
#[derive(Clone, Debug)]
pub struct BinBitmap {
    top: u64,
    groups: [u16; GROUPS],
}

const _: () = assert!(GROUPS <= 64 && BINS_PER_GROUP == 16);

impl Default for BinBitmap {
    fn default() -> Self {
        BinBitmap { top: 0, groups: [0; GROUPS] }
    }
}

impl BinBitmap {
    #[inline(always)]
    pub fn set(&mut self, bin: usize) {
        let (group, bit) = (bin / BINS_PER_GROUP, bin % BINS_PER_GROUP);
        self.groups[group] |= 1 << bit;
        self.top |= 1 << group;
    }

    #[inline(always)]
    pub fn clear(&mut self, bin: usize) {
        let (group, bit) = (bin / BINS_PER_GROUP, bin % BINS_PER_GROUP);
        self.groups[group] &= !(1 << bit);
        if self.groups[group] == 0 {
            self.top &= !(1 << group);
        }
    }

    pub fn is_set(&self, bin: usize) -> bool {
        self.groups[bin / BINS_PER_GROUP] & (1 << (bin % BINS_PER_GROUP)) != 0
    }

    /// The first set bin at or after `bin`, if any.
    #[inline]
    pub fn find_from(&self, bin: usize) -> Option<usize> {
        if bin >= BIN_COUNT {
            return None;
        }
        let (group, bit) = (bin / BINS_PER_GROUP, bin % BINS_PER_GROUP);
        // Step 1: the rest of this bin's own group.
        let rest = self.groups[group] & (u16::MAX << bit);
        if rest != 0 {
            return Some(group * BINS_PER_GROUP + rest.trailing_zeros() as usize);
        }
        // Step 2: the first non-empty group after it, then its first bin.
        let later = if group + 1 >= 64 { 0 } else { self.top & (u64::MAX << (group + 1)) };
        if later == 0 {
            return None;
        }
        let g = later.trailing_zeros() as usize;
        Some(g * BINS_PER_GROUP + self.groups[g].trailing_zeros() as usize)
    }

    /// The last set bin, if any (used to report the largest free block).
    pub fn last(&self) -> Option<usize> {
        if self.top == 0 {
            return None;
        }
        let g = 63 - self.top.leading_zeros() as usize;
        Some(g * BINS_PER_GROUP + 15 - self.groups[g].leading_zeros() as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_first_set_bin_at_or_after() {
        let mut b = BinBitmap::default();
        assert_eq!(b.find_from(0), None);
        assert_eq!(b.last(), None);
        for bin in [3, 17, 200, BIN_COUNT - 1] {
            b.set(bin);
        }
        let table =
            [(0, Some(3)), (3, Some(3)), (4, Some(17)), (18, Some(200)), (201, Some(BIN_COUNT - 1)), (BIN_COUNT, None)];
        for (from, expected) in table {
            assert_eq!(b.find_from(from), expected, "from {from}");
        }
        assert_eq!(b.last(), Some(BIN_COUNT - 1));
        b.clear(BIN_COUNT - 1);
        b.clear(17);
        assert_eq!(b.find_from(4), Some(200));
        assert_eq!(b.last(), Some(200));
        assert!(b.is_set(3) && !b.is_set(17));
    }
}
