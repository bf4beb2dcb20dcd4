//! The device lock: the allocator's one lock layer (`Allocator::devices`), a mutex whose
//! release is a plain store.
//!
//! malloc and free each take and release this lock, so it is a fixed part of every pair.
//! Taking it is one compare-and-swap (an atomic read-modify-write, which no mutex avoids);
//! releasing it is a release store, not a second read-modify-write as in `parking_lot` or
//! `std` (theirs learns in the same instruction whether a thread sleeps on the lock). Here a
//! waiter that sleeps says so in `parked`, which the release reads after its store.
//!
//! Invariants and why they hold:
//! - mutual exclusion: `locked` goes false -> true only by a compare-and-swap with acquire
//!   ordering, and back only by the holder's release store, so the critical sections are
//!   ordered and each sees the previous one's writes.
//! - no waiter sleeps for ever: a release that sees `parked` wakes one sleeper. The store and
//!   the load of `parked` are not ordered against each other (that would need the fence the
//!   plain store saves), so a waiter that set `parked` just as the holder released can miss
//!   its wake-up; every sleep therefore has a deadline (`PARK_BACKSTOP`), after which the
//!   waiter tries again. Such a miss needs the two threads within a few nanoseconds of each
//!   other; it costs that waiter at most the deadline, never correctness.
//! - the lock word and its parking key never move while anyone waits (a waiter borrows the lock).
//!
//! Waiting: spin a little while nobody sleeps (parking_lot's `SpinWait`: a few rounds of
//! `pause`, then yields), then sleep in parking_lot's parking lot keyed by the lock's address.
//! Spinning behind sleepers cost a third of the throughput of `stepalloc-stress random
//! --threads 8` on two cores; without it the figure matches parking_lot's mutex. No fairness hand-off:
//! a released lock goes to whoever takes it first (as `std`'s mutex).

// parking_lot_core's park and unpark are unsafe functions: each block says why the call is sound.
#![allow(unsafe_code)]

use parking_lot_core::{park, unpark_one, SpinWait, DEFAULT_PARK_TOKEN, DEFAULT_UNPARK_TOKEN};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The longest a waiter sleeps before it looks at the lock again (see the module's invariants).
const PARK_BACKSTOP: Duration = Duration::from_micros(200);

pub struct RawHeapLock {
    locked: AtomicBool,
    /// Some thread sleeps (or is about to) until `locked` is released.
    parked: AtomicBool,
}

/// A mutex over `T` released with a plain store (`RawHeapLock`).
pub type HeapMutex<T> = lock_api::Mutex<RawHeapLock, T>;
pub type HeapGuard<'a, T> = lock_api::MutexGuard<'a, RawHeapLock, T>;

// Safety: `lock` and `try_lock` succeed only by the compare-and-swap that takes `locked` from
// false to true, so at most one holder exists at a time; only the holder calls `unlock` (the
// trait's contract), which stores false with release ordering.
unsafe impl lock_api::RawMutex for RawHeapLock {
    #[allow(clippy::declare_interior_mutable_const)] // the trait's initialiser, copied per mutex
    const INIT: RawHeapLock = RawHeapLock { locked: AtomicBool::new(false), parked: AtomicBool::new(false) };

    type GuardMarker = lock_api::GuardNoSend;

    #[inline]
    fn lock(&self) {
        if self.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            self.lock_slow();
        }
    }

    #[inline]
    fn try_lock(&self) -> bool {
        self.locked.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    #[inline]
    unsafe fn unlock(&self) {
        self.locked.store(false, Ordering::Release);
        if self.parked.load(Ordering::Relaxed) {
            self.wake_one();
        }
    }

    #[inline]
    fn is_locked(&self) -> bool {
        self.locked.load(Ordering::Relaxed)
    }
}

impl RawHeapLock {
    fn key(&self) -> usize {
        &self.locked as *const AtomicBool as usize
    }

    #[cold]
    #[inline(never)]
    fn lock_slow(&self) {
        let mut spin = SpinWait::new();
        loop {
            if !self.locked.load(Ordering::Relaxed) && lock_api::RawMutex::try_lock(self) {
                return;
            }
            // Spin only while nobody sleeps: behind a sleeper, spinning only delays it.
            if !self.parked.load(Ordering::Relaxed) && spin.spin() {
                continue;
            }
            // A sequentially consistent store: it is visible before the check below reads
            // `locked`, so a holder that releases after that check sees it.
            self.parked.store(true, Ordering::SeqCst);
            let deadline = Instant::now() + PARK_BACKSTOP;
            // Safety: the key is this lock's own address, used by no other primitive; the
            // callbacks only load and store this lock's atomics (no panic, no parking_lot call).
            unsafe {
                park(
                    self.key(),
                    || self.locked.load(Ordering::Relaxed) && self.parked.load(Ordering::Relaxed),
                    || {},
                    |_, was_last| {
                        if was_last {
                            self.parked.store(false, Ordering::Relaxed);
                        }
                    },
                    DEFAULT_PARK_TOKEN,
                    Some(deadline),
                );
            }
            spin.reset();
        }
    }

    #[cold]
    #[inline(never)]
    fn wake_one(&self) {
        // Safety: as in `lock_slow`; the callback only stores to this lock's `parked`.
        unsafe {
            unpark_one(self.key(), |result| {
                if !result.have_more_threads {
                    self.parked.store(false, Ordering::Relaxed);
                }
                DEFAULT_UNPARK_TOKEN
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Threads that add to a counter under the lock, with a non-atomic read-then-write inside
    /// and a sleep now and then so that waiters park: every increment counts.
    #[test]
    fn mutual_exclusion_and_wakeups() {
        const THREADS: usize = 6;
        const ROUNDS: u64 = 20_000;
        let mutex = Arc::new(HeapMutex::new((0u64, false)));
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let mutex = Arc::clone(&mutex);
                std::thread::spawn(move || {
                    for i in 0..ROUNDS {
                        let mut guard = mutex.lock();
                        assert!(!guard.1, "two holders at once");
                        guard.1 = true;
                        let seen = guard.0;
                        if (i + t as u64) % 2_000 == 0 {
                            // Hold the lock long enough for the others to park.
                            std::thread::sleep(Duration::from_millis(1));
                        } else {
                            std::hint::spin_loop();
                        }
                        guard.0 = seen + 1;
                        guard.1 = false;
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("no thread panics");
        }
        assert_eq!(mutex.lock().0, THREADS as u64 * ROUNDS);
        assert!(!mutex.is_locked());
    }

    #[test]
    fn try_lock_fails_while_held() {
        let mutex = HeapMutex::new(1);
        let guard = mutex.lock();
        assert!(mutex.try_lock().is_none());
        drop(guard);
        assert_eq!(mutex.try_lock().map(|g| *g), Some(1));
    }
}
