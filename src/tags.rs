//! Tags: which memory a `pause` gives back. Every allocation carries a tag, the innermost region
//! of the allocating thread (`stepalloc_region_enter`), else "default" (tag 0). Layer: beside
//! the allocator; the heap only sees the small number (`TagId`).
//!
//! Whether a pause backs an allocation up belongs to the allocation, not to its tag's name: the
//! number an allocation carries is its name's number with the bits of its region's backup store
//! set (`Store`: none, pinned host memory, pageable host memory, files on disk). So a name has
//! four numbers, the heap keeps their memory apart (segments, lists) and a pause of the name
//! backs up exactly the memory of the numbers with a store, each into its own; two regions of one
//! name with different backups never change each other's memory.
//!
//! Invariants:
//! - the registry is process-wide and only grows: a name keeps its number for the life of the
//!   process, so every device's heap and every statistic agree on it; at most `MAX_TAGS` names
//!   besides "default" (a bounded label set, like phases);
//! - the current tag is one thread-local byte, read by `malloc` without allocating or locking
//!   (and not at all until some thread has entered a region); the region stack behind it is
//!   only touched by `enter` and `exit`.

pub mod lend;

use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// A tag's number: 0 is "default", 1..=`MAX_TAGS` are registered names, each also with a
/// store's bits set (`STORE_BITS`: its memory made in regions with that backup).
pub type TagId = u8;

/// The bits of a tag number that say where a pause backs its memory up (`Store`).
pub const STORE_BITS: TagId = 0b1100_0000;
/// The number bits of pinned host memory (`enter(_, true)`, `Store::Pinned`).
pub const BACKUP: TagId = Store::Pinned.bits();
/// Tag numbers the heap may see: names and their stores' numbers.
pub const MAX_ID: TagId = STORE_BITS | MAX_TAGS as TagId;

/// Where a pause keeps the bytes of a tag number's live blocks (torch_memory_saver's
/// `enable_cpu_backup` with `cpu_backup_backend` "pinned" or "mmap", and `enable_disk_backup`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    /// Nowhere: a pause discards them.
    None,
    /// Pinned (page-locked) host buffers: the fastest copies, memory the OS cannot page out.
    Pinned,
    /// Pageable anonymous memory (`mmap`), copied through the driver's staging: slower, but
    /// neither pinned nor kept resident by the driver, so the OS may reclaim it.
    Mmap,
    /// One file per block in the backup directory (`heap/backup.rs`), through a pinned staging
    /// buffer: host memory holds no copy.
    Disk,
}

impl Store {
    /// The store's bits in a tag number.
    pub const fn bits(self) -> TagId {
        match self {
            Store::None => 0,
            Store::Pinned => 0b0100_0000,
            Store::Mmap => 0b1000_0000,
            Store::Disk => 0b1100_0000,
        }
    }

    /// The store a tag number's memory is backed up to.
    pub const fn of(tag: TagId) -> Store {
        if base(tag) == DEFAULT {
            return Store::None;
        }
        match tag & STORE_BITS {
            0 => Store::None,
            0b0100_0000 => Store::Pinned,
            0b1000_0000 => Store::Mmap,
            _ => Store::Disk,
        }
    }

    /// The store's name, as the C ABI and Python take it and metrics show it.
    pub const fn name(self) -> &'static str {
        match self {
            Store::None => "none",
            Store::Pinned => "pinned",
            Store::Mmap => "mmap",
            Store::Disk => "disk",
        }
    }

    /// By the C ABI's number (`stepalloc_region_enter`'s `backup`): 0 none, 1 pinned, 2 mmap,
    /// 3 disk.
    pub const fn from_number(n: i32) -> Option<Store> {
        match n {
            0 => Some(Store::None),
            1 => Some(Store::Pinned),
            2 => Some(Store::Mmap),
            3 => Some(Store::Disk),
            _ => None,
        }
    }
}

/// The tag outside any region.
pub const DEFAULT: TagId = 0;
pub const DEFAULT_NAME: &str = "default";
/// Tags a process may name besides "default".
pub const MAX_TAGS: usize = 32;
/// Regions one thread may have entered and not exited.
pub const MAX_DEPTH: usize = 64;
/// Longest tag name, in bytes.
pub const MAX_NAME: usize = 64;

struct Entry {
    name: String,
}

static REGISTRY: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

/// Set once any thread enters a region. Until then every thread's tag is still "default", so
/// `current` need not look up the thread-local (a call to `__tls_get_addr` on every malloc
/// in libstepalloc.so). A thread sets it before its own tag, so its later mallocs see it.
static ANY_REGION: AtomicBool = AtomicBool::new(false);

/// Bit `n` set: a pause of the name numbered `n` keeps its free cached pages' addresses and the
/// resume maps them again (`keep_cached`).
static KEEP_CACHED: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static CURRENT: Cell<TagId> = const { Cell::new(DEFAULT) };
    static STACK: RefCell<Vec<TagId>> = const { RefCell::new(Vec::new()) };
}

/// Checks a tag name: 1..=64 bytes of `[A-Za-z0-9_.:-]`.
pub fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name.bytes().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b':' | b'-'));
    if ok {
        Ok(())
    } else {
        let shown: String = name.chars().take(MAX_NAME + 8).collect();
        Err(Error::InvalidArgument(format!(
            "tag {shown:?} is not 1 to {MAX_NAME} characters of letters, digits, '_', '.', ':' or '-'"
        )))
    }
}

/// The number of a registered tag (or of "default"), without registering it.
pub fn lookup(name: &str) -> Option<TagId> {
    if name == DEFAULT_NAME {
        return Some(DEFAULT);
    }
    REGISTRY.lock().iter().position(|e| e.name == name).map(|i| (i + 1) as TagId)
}

/// Registers `name` (or finds it); returns its number (without store bits). The 33rd name is
/// refused.
pub fn register(name: &str) -> Result<TagId> {
    check_name(name)?;
    if name == DEFAULT_NAME {
        return Ok(DEFAULT);
    }
    let mut registry = REGISTRY.lock();
    if let Some(i) = registry.iter().position(|e| e.name == name) {
        return Ok((i + 1) as TagId);
    }
    if registry.len() >= MAX_TAGS {
        return Err(Error::InvalidArgument(format!(
            "tag {name:?}: a process may name at most {MAX_TAGS} tags besides \"default\" (a bounded label \
             set); reuse one"
        )));
    }
    registry.push(Entry { name: name.to_string() });
    Ok(registry.len() as TagId)
}

/// The name's number of a tag number (store bits cleared).
#[inline]
pub const fn base(tag: TagId) -> TagId {
    tag & !STORE_BITS
}

/// Sets whether a pause of `name` (registered if new) gives its free cached pages back only
/// until the resume, which maps them again as the tag's free cached memory (torch_memory_saver's
/// semantics: its regions' whole segments come back), or for good (the default: a resume maps
/// only the live blocks' pages). "default" cannot be paused and is refused.
pub fn set_keep_cached(name: &str, on: bool) -> Result<()> {
    let id = register(name)?;
    if id == DEFAULT {
        return Err(Error::InvalidArgument("keep_cached of tag \"default\": it cannot be paused".into()));
    }
    let bit = 1u64 << id;
    if on {
        KEEP_CACHED.fetch_or(bit, Ordering::Relaxed);
    } else {
        KEEP_CACHED.fetch_and(!bit, Ordering::Relaxed);
    }
    Ok(())
}

/// Whether a pause of this tag number's name keeps its free cached pages for the resume.
#[inline]
pub fn keeps_cached(tag: TagId) -> bool {
    KEEP_CACHED.load(Ordering::Relaxed) >> base(tag) & 1 != 0
}

/// Whether memory with this tag number is backed up (to the host or to disk) at a pause.
#[inline]
pub fn backup(tag: TagId) -> bool {
    Store::of(tag) != Store::None
}

/// How many numbers one name has: one per backup store (`numbers`).
pub const NUMBERS: usize = 4;

/// The numbers memory of the name numbered `id` carries: backed up first (a pause that cannot
/// back up fails before it discards anything), then discarded.
pub fn numbers(id: TagId) -> [TagId; NUMBERS] {
    let id = base(id);
    [id | Store::Pinned.bits(), id | Store::Mmap.bits(), id | Store::Disk.bits(), id]
}

/// A tag's name ("default" for 0; "tag<N>" for a number never registered).
pub fn name(tag: TagId) -> String {
    let id = base(tag);
    if id == DEFAULT {
        return DEFAULT_NAME.to_string();
    }
    REGISTRY.lock().get(id as usize - 1).map_or_else(|| format!("tag{id}"), |e| e.name.clone())
}

/// Every registered tag besides "default", in registration order.
pub fn registered() -> Vec<(TagId, String)> {
    REGISTRY.lock().iter().enumerate().map(|(i, e)| ((i + 1) as TagId, e.name.clone())).collect()
}

/// The calling thread's current tag: what its allocations carry. Its own innermost region, else
/// a tag it borrowed (`lend`: autograd's thread during a backward of a thread inside a region).
#[inline]
pub fn current() -> TagId {
    if !ANY_REGION.load(Ordering::Relaxed) {
        return DEFAULT;
    }
    current_of_thread()
}

/// Out of line: inlined, the compiler computes the thread-local's address before the test.
#[inline(never)]
fn current_of_thread() -> TagId {
    match CURRENT.with(Cell::get) {
        DEFAULT => lend::borrowed(),
        own => own,
    }
}

/// Enters a region of `name` on the calling thread (registering the name): what the thread
/// allocates until the matching `exit` is backed up at a pause when `backup` (to pinned host
/// memory). Returns the number its allocations carry.
pub fn enter(name: &str, backup: bool) -> Result<TagId> {
    enter_with(name, if backup { Store::Pinned } else { Store::None })
}

/// Enters a region of `name` whose allocations a pause backs up to `store`. Returns the number
/// they carry (the name's with the store's bits; "default" never has them).
pub fn enter_with(name: &str, store: Store) -> Result<TagId> {
    if STACK.with(|s| s.borrow().len()) >= MAX_DEPTH {
        return Err(Error::InvalidArgument(format!(
            "region {name:?}: this thread is already {MAX_DEPTH} regions deep; exit one first"
        )));
    }
    let id = register(name)?;
    let tag = if id != DEFAULT { id | store.bits() } else { id };
    ANY_REGION.store(true, Ordering::Relaxed);
    STACK.with(|s| s.borrow_mut().push(tag));
    CURRENT.with(|c| c.set(tag));
    Ok(tag)
}

/// Exits the calling thread's innermost region; the one around it (or "default") is current
/// again. Returns the tag exited.
pub fn exit() -> Result<TagId> {
    let popped = STACK.with(|s| {
        let mut s = s.borrow_mut();
        let popped = s.pop();
        CURRENT.with(|c| c.set(s.last().copied().unwrap_or(DEFAULT)));
        popped
    });
    popped.ok_or_else(|| Error::InvalidArgument("region exit without a region entered on this thread".into()))
}

/// The calling thread's region depth.
pub fn depth() -> usize {
    STACK.with(|s| s.borrow().len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        for bad in ["", "a b", "ü", &"x".repeat(65), "a/b"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        for good in ["kv_cache", "weights", "a.b:c-d_0", &"x".repeat(64)] {
            check_name(good).unwrap();
        }
    }

    #[test]
    fn a_block_class_keeps_every_tag_number_and_pool_apart() {
        use crate::segment::BlockClass;
        // A name's number with the backup bit and the largest pool both fit in the class word.
        for tag in [DEFAULT, 1, MAX_TAGS as TagId, BACKUP | 1, Store::Mmap.bits() | 1, MAX_ID] {
            for pool in [0, 1, BlockClass::MAX_POOL] {
                let c = BlockClass::new(pool, true, true).in_lane(true).with_tag(tag);
                assert_eq!((c.tag(), c.pool(), c.small(), c.expandable(), c.lane()), (tag, pool, true, true, true));
            }
        }
    }

    #[test]
    fn regions_nest_per_thread() {
        assert_eq!(current(), DEFAULT);
        let a = enter("tags_test_a", true).unwrap();
        assert_eq!(current(), a);
        let b = enter("tags_test_b", false).unwrap();
        assert_eq!(current(), b);
        assert!(backup(a) && !backup(b));
        assert_eq!(name(a), "tags_test_a");
        // The same name without a backup: another number, one name.
        let a2 = enter("tags_test_a", false).unwrap();
        assert!(!backup(a2) && base(a2) == base(a) && a2 != a);
        assert_eq!(current(), a2);
        assert_eq!(exit().unwrap(), a2);
        std::thread::spawn(|| assert_eq!(current(), DEFAULT)).join().unwrap();
        assert_eq!(exit().unwrap(), b);
        assert_eq!(current(), a);
        assert_eq!(exit().unwrap(), a);
        assert_eq!(current(), DEFAULT);
        assert!(exit().is_err());
        assert_eq!(lookup("tags_test_a"), Some(base(a)));
        assert_eq!(numbers(base(a)), [a, base(a) | Store::Mmap.bits(), base(a) | Store::Disk.bits(), base(a)]);
        // Each store's region gives its own number of the name, and says its store.
        for store in [Store::None, Store::Pinned, Store::Mmap, Store::Disk] {
            let t = enter_with("tags_test_a", store).unwrap();
            assert_eq!((base(t), Store::of(t), backup(t)), (base(a), store, store != Store::None));
            assert!(numbers(base(a)).contains(&t));
            exit().unwrap();
        }
        assert_eq!(Store::of(enter_with("default", Store::Disk).unwrap()), Store::None);
        exit().unwrap();
        assert_eq!(name(a), "tags_test_a");
        assert_eq!(lookup("default"), Some(DEFAULT));
        assert_eq!(enter("default", true).unwrap(), DEFAULT);
        exit().unwrap();
    }
}
