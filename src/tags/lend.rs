//! Tags lent to other threads for a while: autograd runs `backward()` on its own device thread,
//! so what backward allocates on behalf of a thread inside a region would otherwise carry
//! "default". The calling thread lends its current tag (`lend`), the device thread borrows it
//! (`borrow`, from a hook that runs there), and the caller ends the lease when backward returns
//! (`end`), which the borrower sees at its next allocation without being told. Layer: beside
//! `tags`; `tags::current` reads `borrowed` on the hot path.
//!
//! Invariants:
//! - a lease is one slot of `LEASES` holding `generation << 8 | tag` (0: free); a token names
//!   the slot and the generation, so a token of an ended lease never matches a later one;
//! - `borrowed` costs one thread-local load on a thread that never borrowed, and one relaxed
//!   atomic load more on one that did; it neither locks nor allocates.

use super::{TagId, DEFAULT};
use crate::error::{Error, Result};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Leases open at once (backward passes of threads inside regions, all devices together).
pub const SLOTS: usize = 64;
const SLOT_SHIFT: u32 = 56;
const GENERATION_MASK: u64 = (1 << SLOT_SHIFT) - 1;

static LEASES: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];
static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// The lease this thread borrowed: (slot + 1, generation); slot 0 means none.
    static BORROWED: Cell<(u32, u64)> = const { Cell::new((0, 0)) };
}

fn decode(token: u64) -> Option<(usize, u64)> {
    let slot = (token >> SLOT_SHIFT) as usize;
    let generation = token & GENERATION_MASK;
    (slot < SLOTS && generation != 0).then_some((slot, generation))
}

/// Lends `tag`; returns the lease's token (never 0). At most `SLOTS` leases are open at once.
pub fn lend(tag: TagId) -> Result<u64> {
    // A borrowed tag is read where regions are (`current`), which skips threads' tags until
    // some region or lease exists.
    super::ANY_REGION.store(true, Ordering::Relaxed);
    let generation = NEXT_GENERATION.fetch_add(1, Ordering::Relaxed) & GENERATION_MASK;
    let value = (generation << 8) | u64::from(tag);
    for (slot, lease) in LEASES.iter().enumerate() {
        if lease.compare_exchange(0, value, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            return Ok(((slot as u64) << SLOT_SHIFT) | generation);
        }
    }
    Err(Error::InvalidArgument(format!(
        "{SLOTS} tags are lent already (backward passes inside regions at once); end one first"
    )))
}

/// The calling thread borrows the tag of lease `token` until the lease ends; what it allocates
/// outside its own regions carries that tag. Refused for a lease that ended.
pub fn borrow(token: u64) -> Result<TagId> {
    let open = decode(token).and_then(|(slot, generation)| {
        let value = LEASES[slot].load(Ordering::Acquire);
        (value != 0 && value >> 8 == generation).then_some((slot, generation, value))
    });
    let Some((slot, generation, value)) = open else {
        return Err(Error::InvalidArgument(format!("lease {token:#x} is not open (it ended, or never was)")));
    };
    BORROWED.with(|b| b.set((slot as u32 + 1, generation)));
    Ok((value & 0xff) as TagId)
}

/// Ends lease `token`: every thread that borrowed it allocates under its own tag again.
pub fn end(token: u64) -> Result<()> {
    if let Some((slot, generation)) = decode(token) {
        let value = LEASES[slot].load(Ordering::Acquire);
        if value != 0
            && value >> 8 == generation
            && LEASES[slot].compare_exchange(value, 0, Ordering::AcqRel, Ordering::Relaxed).is_ok()
        {
            return Ok(());
        }
    }
    Err(Error::InvalidArgument(format!("lease {token:#x} is not open (it ended, or never was)")))
}

/// The tag the calling thread borrowed, if its lease is still open; else "default".
#[inline]
pub fn borrowed() -> TagId {
    let (slot, generation) = BORROWED.with(Cell::get);
    if slot == 0 {
        return DEFAULT;
    }
    let value = LEASES[slot as usize - 1].load(Ordering::Relaxed);
    if value >> 8 == generation {
        (value & 0xff) as TagId
    } else {
        DEFAULT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slots are process-wide: the tests of this module take turns.
    static SERIAL: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

    #[test]
    fn a_borrowed_tag_lasts_until_the_lease_ends() {
        let _turn = SERIAL.lock();
        let tag = super::super::register("lend_test").unwrap();
        let token = lend(tag).unwrap();
        assert_ne!(token, 0);
        let seen = std::thread::spawn(move || {
            assert_eq!(borrowed(), DEFAULT);
            assert_eq!(borrow(token).unwrap(), tag);
            let during = (borrowed(), super::super::current());
            end(token).unwrap();
            let after = (borrowed(), super::super::current());
            (during, after)
        })
        .join()
        .unwrap();
        assert_eq!(seen, ((tag, tag), (DEFAULT, DEFAULT)));
        assert!(end(token).is_err(), "a lease ends once");
        assert!(borrow(token).is_err(), "an ended lease cannot be borrowed");
        assert!(borrow(0).is_err() && end(u64::MAX).is_err());
        // A thread's own region wins over a borrowed tag.
        let other = super::super::register("lend_test_own").unwrap();
        let token = lend(tag).unwrap();
        borrow(token).unwrap();
        super::super::enter("lend_test_own", false).unwrap();
        assert_eq!(super::super::current(), other);
        super::super::exit().unwrap();
        assert_eq!(super::super::current(), tag);
        end(token).unwrap();
        assert_eq!(super::super::current(), DEFAULT);
    }

    #[test]
    fn slots_are_bounded_and_reused() {
        let _turn = SERIAL.lock();
        let tokens: Vec<u64> = (0..SLOTS).map_while(|_| lend(1).ok()).collect();
        assert_eq!(tokens.len(), SLOTS);
        assert!(lend(1).is_err());
        for t in tokens {
            end(t).unwrap();
        }
        let again = lend(1).unwrap();
        end(again).unwrap();
    }
}
