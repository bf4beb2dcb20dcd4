//! The counters the heap updates on the hot path: `PoolCounter` (a statistic split by pool,
//! `all` derived when read) and `ActiveCounter` (active = allocated + pending, only the pending
//! part counted). Each reads as exactly the `PoolStat` the plain update (both `all` and the
//! pool, saturating totals) would hold; the tests below check it step by step.

use super::{PoolStat, Stat};

/// One pool's part of a `PoolCounter`. `current` cannot overflow: each statistic counts blocks
/// (at most 2^32 ids) or bytes within the device's reserve, which `allowed` bounds. The lifetime
/// total `allocated` is a `u128`: a 2^48-byte request at a time, it would take 2^80 of them to
/// wrap, so a plain add is exact; the reader saturates it to `u64`. `freed` is not counted: it
/// is what left, `allocated + base - current`, where `base` is `current` at the last reset.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counter {
    current: u64,
    peak: u64,
    allocated: u128,
    base: u64,
}

impl Counter {
    fn read(&self) -> Stat {
        Stat {
            current: self.current,
            peak: self.peak,
            allocated: saturate(self.allocated),
            freed: saturate(freed(self.allocated, self.base, self.current)),
        }
    }
}

fn saturate(total: u128) -> u64 {
    u64::try_from(total).unwrap_or(u64::MAX)
}

/// Bytes (or blocks) that left since the last reset: all that came, and what was there at the
/// reset, less what is there now (never negative; saturating only guards a counting bug).
fn freed(allocated: u128, base: u64, current: u64) -> u128 {
    (allocated + u128::from(base)).saturating_sub(u128::from(current))
}

/// A `PoolStat` as the heap keeps it, for the hot path: an increase is three adds and two
/// maxima (the pool's figures and the peak of the sum), a decrease one subtraction. `all`'s
/// current value and lifetime totals are the pools' sums, derived when read; its peak is kept
/// (the peak of a sum is not the sum of peaks). `read` gives exactly what a `PoolStat` updated
/// on both `all` and the pool, with saturating totals, would hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolCounter {
    small: Counter,
    large: Counter,
    all_peak: u64,
}

impl PoolCounter {
    /// The adds wrap rather than carry the release profile's overflow checks: `current` is
    /// bounded by the device's reserve (see `Counter`), and `allocated` would need 2^80 requests
    /// of the largest size; a check would only turn an impossible overflow into a panic halfway
    /// through a heap update. Debug builds (the tests) check them.
    #[inline]
    pub fn increase(&mut self, small: bool, amount: u64) {
        let (pool, other) =
            if small { (&mut self.small, self.large.current) } else { (&mut self.large, self.small.current) };
        debug_assert!(pool.current.checked_add(amount).and_then(|c| c.checked_add(other)).is_some());
        pool.current = pool.current.wrapping_add(amount);
        pool.peak = pool.peak.max(pool.current);
        pool.allocated = pool.allocated.wrapping_add(u128::from(amount));
        self.all_peak = self.all_peak.max(pool.current.wrapping_add(other));
    }

    #[inline]
    pub fn decrease(&mut self, small: bool, amount: u64) {
        let pool = if small { &mut self.small } else { &mut self.large };
        debug_assert!(pool.current >= amount, "statistic would go negative");
        pool.current = pool.current.saturating_sub(amount);
    }

    /// `all.current`.
    #[inline]
    pub fn current(&self) -> u64 {
        self.small.current + self.large.current
    }

    /// `all.peak`.
    pub fn peak(&self) -> u64 {
        self.all_peak
    }

    pub fn read(&self) -> PoolStat {
        let allocated = self.small.allocated + self.large.allocated;
        let base = self.small.base + self.large.base;
        let current = self.current();
        PoolStat {
            all: Stat {
                current,
                peak: self.all_peak,
                allocated: saturate(allocated),
                freed: saturate(freed(allocated, base, current)),
            },
            small_pool: self.small.read(),
            large_pool: self.large.read(),
        }
    }

    pub(super) fn reset_peaks(&mut self) {
        self.small.peak = self.small.current;
        self.large.peak = self.large.current;
        self.all_peak = self.current();
    }

    pub(super) fn reset_accumulated(&mut self) {
        for pool in [&mut self.small, &mut self.large] {
            pool.allocated = 0;
            pool.base = pool.current;
        }
    }
}

/// `active` / `active_bytes` as the heap keeps them. A block is active from its malloc until
/// its free completes, so active is what is allocated plus what is pending (freed while other
/// streams' work may still use it), and every increase of active is an allocation's. Only the
/// pending part is counted here; the rest comes from the allocation counter when read: the
/// current value and lifetime totals are allocation's plus the pending part, and the peak is the
/// larger of allocation's peak and the peaks seen after allocations made while something was
/// pending (at any other moment active equals allocation, whose peak covers it). So a malloc
/// updates this only while something is pending, and a free only when its block was pending.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ActiveCounter {
    /// Pending blocks (or bytes), small pool then large.
    pending: [u64; 2],
    /// Per pool, the largest allocated + pending seen while something was pending.
    peak: [u64; 2],
    all_peak: u64,
    /// Per pool, the active value at the last `reset_accumulated` (see `Counter::base`).
    base: [u64; 2],
}

fn pool_index(small: bool) -> usize {
    if small {
        0
    } else {
        1
    }
}

impl ActiveCounter {
    /// Whether any block is pending (the hot path's only test).
    #[inline]
    pub fn any_pending(&self) -> bool {
        (self.pending[0] | self.pending[1]) != 0
    }

    pub fn add_pending(&mut self, small: bool, amount: u64) {
        self.pending[pool_index(small)] += amount;
    }

    pub fn remove_pending(&mut self, small: bool, amount: u64) {
        let pending = &mut self.pending[pool_index(small)];
        debug_assert!(*pending >= amount, "pending statistic would go negative");
        *pending = pending.saturating_sub(amount);
    }

    /// After `allocation` increased while something is pending: a new peak of active may be
    /// one allocation's peak does not show.
    pub fn note_increase(&mut self, allocation: &PoolCounter) {
        for (i, pool) in [&allocation.small, &allocation.large].into_iter().enumerate() {
            self.peak[i] = self.peak[i].max(pool.current + self.pending[i]);
        }
        self.all_peak = self.all_peak.max(self.current(allocation));
    }

    /// `all.current`.
    pub fn current(&self, allocation: &PoolCounter) -> u64 {
        allocation.current() + self.pending[0] + self.pending[1]
    }

    pub fn read(&self, allocation: &PoolCounter) -> PoolStat {
        let pools = [&allocation.small, &allocation.large];
        let stat = |i: usize| {
            let current = pools[i].current + self.pending[i];
            Stat {
                current,
                peak: self.peak[i].max(pools[i].peak),
                allocated: saturate(pools[i].allocated),
                freed: saturate(freed(pools[i].allocated, self.base[i], current)),
            }
        };
        let allocated = allocation.small.allocated + allocation.large.allocated;
        let current = self.current(allocation);
        PoolStat {
            all: Stat {
                current,
                peak: self.all_peak.max(allocation.all_peak),
                allocated: saturate(allocated),
                freed: saturate(freed(allocated, self.base[0] + self.base[1], current)),
            },
            small_pool: stat(0),
            large_pool: stat(1),
        }
    }

    pub(super) fn reset_peaks(&mut self, allocation: &PoolCounter) {
        for (i, pool) in [&allocation.small, &allocation.large].into_iter().enumerate() {
            self.peak[i] = pool.current + self.pending[i];
        }
        self.all_peak = self.current(allocation);
    }

    pub(super) fn reset_accumulated(&mut self, allocation: &PoolCounter) {
        for (i, pool) in [&allocation.small, &allocation.large].into_iter().enumerate() {
            self.base[i] = pool.current + self.pending[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `PoolStat` updated the plain way: both `all` and the pool, saturating totals.
    fn reference_increase(p: &mut PoolStat, small: bool, amount: u64) {
        p.all.increase(amount);
        if small {
            p.small_pool.increase(amount)
        } else {
            p.large_pool.increase(amount)
        }
    }

    fn reference_decrease(p: &mut PoolStat, small: bool, amount: u64) {
        p.all.decrease(amount);
        if small {
            p.small_pool.decrease(amount)
        } else {
            p.large_pool.decrease(amount)
        }
    }

    /// The hot-path counter reads exactly what the plain update gives, step by step, across
    /// resets of peaks and totals and past 2^64 lifetime bytes (where the totals saturate).
    #[test]
    fn pool_counter_reads_as_the_plain_update() {
        let big = 1u64 << 48;
        // (small, +amount / -amount); 0 = reset peaks, 1 = reset accumulated.
        let mut program: Vec<(bool, i64)> = vec![
            (true, 10),
            (false, 30),
            (true, -4),
            (false, -30),
            (true, 7),
            (false, 0),
            (true, 2),
            (true, -15),
            (false, 1),
            (false, 5),
            (true, 3),
        ];
        // 2^17 huge allocate/free pairs pass 2^64 bytes in total.
        for _ in 0..(1 << 17) {
            program.push((false, big as i64));
            program.push((false, -(big as i64)));
        }
        program.extend([(true, 1), (false, 9), (true, 5), (false, -9), (true, -6)]);
        let mut counter = PoolCounter::default();
        let mut plain = PoolStat::default();
        for (step, &(small, amount)) in program.iter().enumerate() {
            match (small, amount) {
                (false, 0) => {
                    counter.reset_peaks();
                    for s in [&mut plain.all, &mut plain.small_pool, &mut plain.large_pool] {
                        s.peak = s.current;
                    }
                }
                (false, 1) => {
                    counter.reset_accumulated();
                    for s in [&mut plain.all, &mut plain.small_pool, &mut plain.large_pool] {
                        s.allocated = 0;
                        s.freed = 0;
                    }
                }
                (_, a) if a > 0 => {
                    counter.increase(small, a as u64);
                    reference_increase(&mut plain, small, a as u64);
                }
                (_, a) => {
                    counter.decrease(small, a.unsigned_abs());
                    reference_decrease(&mut plain, small, a.unsigned_abs());
                }
            }
            if step < 20 || step % 4096 == 0 || step + 6 > program.len() {
                assert_eq!(counter.read(), plain, "after step {step}");
            }
            assert_eq!(counter.current(), plain.all.current);
        }
        assert_eq!(plain.all.allocated, u64::MAX, "the program passes 2^64 bytes");
        assert_eq!(plain.large_pool.freed, u64::MAX);
        assert_eq!(counter.read(), plain);
        assert_eq!(counter.peak(), plain.all.peak);
    }

    /// What happens to one block in `active_counter_reads_as_the_plain_update`.
    #[derive(Clone, Debug)]
    enum ActiveOp {
        Malloc {
            small: bool,
            size: u64,
        },
        /// Free the `pick`-th live block; `pending`: it waits for other streams first.
        Free {
            pick: usize,
            pending: bool,
        },
        /// The `pick`-th pending block's free completes.
        Complete {
            pick: usize,
        },
        ResetPeaks,
        ResetAccumulated,
    }

    fn active_op() -> impl proptest::strategy::Strategy<Value = ActiveOp> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (any::<bool>(), 1u64..1 << 30).prop_map(|(small, size)| ActiveOp::Malloc { small, size }),
            3 => (any::<usize>(), any::<bool>()).prop_map(|(pick, pending)| ActiveOp::Free { pick, pending }),
            2 => any::<usize>().prop_map(|pick| ActiveOp::Complete { pick }),
            1 => Just(ActiveOp::ResetPeaks),
            1 => Just(ActiveOp::ResetAccumulated),
        ]
    }

    proptest::proptest! {
        /// `active` / `active_bytes` kept as allocation plus pending (updated on the hot path
        /// only while something is pending) read exactly what updating them on every malloc
        /// and completed free gives: current, peaks and totals, per pool and overall.
        #[test]
        fn active_counter_reads_as_the_plain_update(ops in proptest::collection::vec(active_op(), 1..200)) {
            let (mut allocation, mut allocated_bytes) = (PoolCounter::default(), PoolCounter::default());
            let (mut active, mut active_bytes) = (ActiveCounter::default(), ActiveCounter::default());
            let (mut plain, mut plain_bytes) = (PoolStat::default(), PoolStat::default());
            let mut live: Vec<(bool, u64)> = Vec::new();
            let mut pending: Vec<(bool, u64)> = Vec::new();
            for op in ops {
                match op {
                    ActiveOp::Malloc { small, size } => {
                        allocation.increase(small, 1);
                        allocated_bytes.increase(small, size);
                        if active.any_pending() {
                            active.note_increase(&allocation);
                            active_bytes.note_increase(&allocated_bytes);
                        }
                        reference_increase(&mut plain, small, 1);
                        reference_increase(&mut plain_bytes, small, size);
                        live.push((small, size));
                    }
                    ActiveOp::Free { pick, pending: waits } if !live.is_empty() => {
                        let (small, size) = live.swap_remove(pick % live.len());
                        allocation.decrease(small, 1);
                        allocated_bytes.decrease(small, size);
                        if waits {
                            active.add_pending(small, 1);
                            active_bytes.add_pending(small, size);
                            pending.push((small, size));
                        } else {
                            reference_decrease(&mut plain, small, 1);
                            reference_decrease(&mut plain_bytes, small, size);
                        }
                    }
                    ActiveOp::Complete { pick } if !pending.is_empty() => {
                        let (small, size) = pending.swap_remove(pick % pending.len());
                        active.remove_pending(small, 1);
                        active_bytes.remove_pending(small, size);
                        reference_decrease(&mut plain, small, 1);
                        reference_decrease(&mut plain_bytes, small, size);
                    }
                    ActiveOp::ResetPeaks => {
                        active.reset_peaks(&allocation);
                        active_bytes.reset_peaks(&allocated_bytes);
                        allocation.reset_peaks();
                        allocated_bytes.reset_peaks();
                        for p in [&mut plain, &mut plain_bytes] {
                            for s in [&mut p.all, &mut p.small_pool, &mut p.large_pool] {
                                s.peak = s.current;
                            }
                        }
                    }
                    ActiveOp::ResetAccumulated => {
                        active.reset_accumulated(&allocation);
                        active_bytes.reset_accumulated(&allocated_bytes);
                        allocation.reset_accumulated();
                        allocated_bytes.reset_accumulated();
                        for p in [&mut plain, &mut plain_bytes] {
                            for s in [&mut p.all, &mut p.small_pool, &mut p.large_pool] {
                                s.allocated = 0;
                                s.freed = 0;
                            }
                        }
                    }
                    _ => {}
                }
                proptest::prop_assert_eq!(active.read(&allocation), plain);
                proptest::prop_assert_eq!(active_bytes.read(&allocated_bytes), plain_bytes);
                proptest::prop_assert_eq!(active_bytes.current(&allocated_bytes), plain_bytes.all.current);
            }
        }
    }
}
