//! A reader of the pickles `torch.cuda.memory._dump_snapshot` writes, for the fast path of
//! `torch::parse_pickle`: the binary opcodes of protocols 2-5 that plain dicts, lists, tuples,
//! sets, strings, bytes, numbers, booleans and None use. Shared objects stay shared (`Rc`):
//! torch's snapshots share each frame dict, and each traceback list, between the entries that
//! have it, which serde_pickle 1.2 cannot read (a memoised object nested in a shared one is
//! handed out once, then as None) and copies where it can.
//!
//! Anything else (globals, reduce, protocol-0 text opcodes, a malformed stream) is an `Err(())`:
//! the caller falls back to serde_pickle, which reads or reports it with a position. Never
//! panics: every read is bounds-checked, every pop checked against underflow. Nesting, memo
//! references included, was bounded by `pickle_depth` before; cycles made through the memo are
//! only walked to fixed depths by the caller (`to_json` takes a depth limit) and taken apart
//! when the value is dropped (`dismantle`).

use std::cell::RefCell;
use std::rc::Rc;

/// A decoded value. Containers are shared, so cloning a value is cheap.
#[derive(Clone, Debug)]
pub enum V {
    None,
    Bool(bool),
    /// Integers up to 16 bytes (LONG1 / LONG4 beyond that are `BigInt`).
    Int(i128),
    BigInt,
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    List(Rc<RefCell<Vec<V>>>),
    Tuple(Rc<[V]>),
    Dict(Rc<RefCell<Vec<(V, V)>>>),
    Set(Rc<RefCell<Vec<V>>>),
}

impl V {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            V::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_u64(&self) -> Option<u64> {
        match self {
            V::Int(i) => u64::try_from(*i).ok(),
            V::Bool(b) => Some(*b as u64),
            _ => None,
        }
    }

    /// The value of `key` in a dict with string keys.
    pub fn get(&self, key: &str) -> Option<V> {
        match self {
            V::Dict(d) => d.borrow().iter().rev().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v.clone()),
            _ => None,
        }
    }

    /// The items of a list or tuple.
    pub fn items(&self) -> Option<Vec<V>> {
        match self {
            V::List(l) => Some(l.borrow().clone()),
            V::Tuple(t) => Some(t.to_vec()),
            _ => None,
        }
    }

    /// As JSON, at most `depth` levels deep and `budget` values in all (shared objects count
    /// each time they are reached); `None` past either.
    pub fn to_json(&self, depth: u32, budget: &mut u64) -> Option<serde_json::Value> {
        use serde_json::Value as J;
        if depth == 0 || *budget == 0 {
            return None;
        }
        *budget -= 1;
        let seq = |items: &[V], budget: &mut u64| -> Option<J> {
            items.iter().map(|v| v.to_json(depth - 1, budget)).collect::<Option<Vec<_>>>().map(J::Array)
        };
        Some(match self {
            V::None | V::BigInt => J::Null,
            V::Bool(b) => J::Bool(*b),
            V::Int(i) => {
                if let Ok(v) = i64::try_from(*i) {
                    J::from(v)
                } else if let Ok(v) = u64::try_from(*i) {
                    J::from(v)
                } else {
                    J::Null
                }
            }
            V::Float(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
            V::Str(s) => J::String(s.to_string()),
            V::Bytes(b) => J::String(String::from_utf8_lossy(b).into_owned()),
            V::List(l) | V::Set(l) => seq(&l.borrow(), budget)?,
            V::Tuple(t) => seq(t, budget)?,
            V::Dict(d) => {
                let mut m = serde_json::Map::new();
                for (k, v) in d.borrow().iter() {
                    let key = match k {
                        V::Str(s) => s.to_string(),
                        other => other.to_json(depth - 1, budget)?.to_string(),
                    };
                    m.insert(key, v.to_json(depth - 1, budget)?);
                }
                J::Object(m)
            }
        })
    }
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<V>,
    /// Positions in `stack` of the open MARKs.
    marks: Vec<usize>,
    memo: Vec<Option<V>>,
}

type R<T> = Result<T, ()>;

impl<'a> Machine<'a> {
    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        let end = self.pos.checked_add(n).ok_or(())?;
        let data: &'a [u8] = self.data;
        let s = data.get(self.pos..end).ok_or(())?;
        self.pos = end;
        Ok(s)
    }

    fn byte(&mut self) -> R<u8> {
        Ok(self.take(1)?[0])
    }

    fn le<const N: usize>(&mut self) -> R<[u8; N]> {
        self.take(N)?.try_into().map_err(|_| ())
    }

    fn len(&mut self, n: usize) -> R<usize> {
        let v = match n {
            1 => self.byte()? as u64,
            4 => u32::from_le_bytes(self.le()?) as u64,
            _ => u64::from_le_bytes(self.le()?),
        };
        usize::try_from(v).map_err(|_| ())
    }

    fn pop(&mut self) -> R<V> {
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            return Err(());
        }
        self.stack.pop().ok_or(())
    }

    fn top(&self) -> R<&V> {
        self.stack.last().ok_or(())
    }

    /// The items above the last MARK, removed with it.
    fn pop_mark(&mut self) -> R<Vec<V>> {
        let m = self.marks.pop().ok_or(())?;
        if m > self.stack.len() {
            return Err(());
        }
        Ok(self.stack.split_off(m))
    }

    fn put(&mut self, id: usize) -> R<()> {
        // Every memo entry takes two bytes at least (an object and MEMOIZE): a larger id is
        // not one Python's pickler writes, and would only make the memo grow past the input.
        if id > self.data.len() / 2 {
            return Err(());
        }
        if id >= self.memo.len() {
            self.memo.resize(id + 1, None);
        }
        self.memo[id] = Some(self.top()?.clone());
        Ok(())
    }

    fn get(&mut self, id: usize) -> R<()> {
        let v = self.memo.get(id).cloned().flatten().ok_or(())?;
        self.stack.push(v);
        Ok(())
    }

    fn string(&mut self, n: usize) -> R<()> {
        let len = self.len(n)?;
        let s = std::str::from_utf8(self.take(len)?).map_err(|_| ())?;
        self.stack.push(V::Str(Rc::from(s)));
        Ok(())
    }

    fn bytes(&mut self, n: usize) -> R<()> {
        let len = self.len(n)?;
        let b = self.take(len)?;
        self.stack.push(V::Bytes(Rc::from(b)));
        Ok(())
    }

    /// LONG1 / LONG4: little-endian two's complement.
    fn long(&mut self, n: usize) -> R<()> {
        let len = self.len(n)?;
        let b = self.take(len)?;
        let v = if len == 0 {
            V::Int(0)
        } else if len <= 16 {
            let fill = if b[len - 1] & 0x80 != 0 { 0xff } else { 0 };
            let mut full = [fill; 16];
            full[..len].copy_from_slice(b);
            V::Int(i128::from_le_bytes(full))
        } else {
            V::BigInt
        };
        self.stack.push(v);
        Ok(())
    }

    fn set_items(&mut self, items: Vec<V>) -> R<()> {
        if items.len() % 2 != 0 {
            return Err(());
        }
        let V::Dict(d) = self.top()? else { return Err(()) };
        let mut d = d.try_borrow_mut().map_err(|_| ())?;
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            d.push((k, v));
        }
        Ok(())
    }

    fn append(&mut self, items: Vec<V>) -> R<()> {
        match self.top()? {
            V::List(l) | V::Set(l) => l.try_borrow_mut().map_err(|_| ())?.extend(items),
            _ => return Err(()),
        }
        Ok(())
    }

    fn run(&mut self) -> R<V> {
        loop {
            match self.byte()? {
                0x80 => {
                    self.byte()?;
                }
                0x95 => {
                    self.take(8)?;
                }
                b'.' => {
                    let v = self.pop()?;
                    return if self.stack.is_empty() && self.marks.is_empty() { Ok(v) } else { Err(()) };
                }
                b'}' => self.stack.push(V::Dict(Rc::default())),
                b']' => self.stack.push(V::List(Rc::default())),
                b')' => self.stack.push(V::Tuple(Rc::from(Vec::new()))),
                0x8f => self.stack.push(V::Set(Rc::default())),
                b'(' => self.marks.push(self.stack.len()),
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.set_items(vec![k, v])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.set_items(items)?;
                }
                b'a' => {
                    let v = self.pop()?;
                    self.append(vec![v])?;
                }
                b'e' | 0x90 => {
                    let items = self.pop_mark()?;
                    self.append(items)?;
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    self.stack.push(V::Set(Rc::new(RefCell::new(items))));
                }
                b't' => {
                    let items = self.pop_mark()?;
                    self.stack.push(V::Tuple(Rc::from(items)));
                }
                op @ (0x85..=0x87) => {
                    let n = (op - 0x84) as usize;
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.stack.push(V::Tuple(Rc::from(items)));
                }
                0x8c => self.string(1)?,
                b'X' => self.string(4)?,
                0x8d => self.string(8)?,
                b'C' => self.bytes(1)?,
                b'B' => self.bytes(4)?,
                0x8e | 0x96 => self.bytes(8)?,
                b'J' => {
                    let v = i32::from_le_bytes(self.le()?);
                    self.stack.push(V::Int(v as i128));
                }
                b'K' => {
                    let v = self.byte()?;
                    self.stack.push(V::Int(v as i128));
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.le()?);
                    self.stack.push(V::Int(v as i128));
                }
                0x8a => self.long(1)?,
                0x8b => self.long(4)?,
                b'N' => self.stack.push(V::None),
                0x88 => self.stack.push(V::Bool(true)),
                0x89 => self.stack.push(V::Bool(false)),
                b'G' => {
                    let v = f64::from_be_bytes(self.le()?);
                    self.stack.push(V::Float(v));
                }
                0x94 => {
                    let id = self.memo.len();
                    self.put(id)?;
                }
                b'q' => {
                    let id = self.byte()? as usize;
                    self.put(id)?;
                }
                b'r' => {
                    let id = self.len(4)?;
                    self.put(id)?;
                }
                b'h' => {
                    let id = self.byte()? as usize;
                    self.get(id)?;
                }
                b'j' => {
                    let id = self.len(4)?;
                    self.get(id)?;
                }
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?.clone();
                    self.stack.push(v);
                }
                _ => return Err(()),
            }
        }
    }
}

impl Drop for Machine<'_> {
    fn drop(&mut self) {
        let memo = std::mem::take(&mut self.memo);
        dismantle(std::mem::take(&mut self.stack).into_iter().chain(memo.into_iter().flatten()).collect());
    }
}

/// Drops values by emptying every container reached, without recursion: a container the
/// memo made hold itself (a cycle, which `pickle_depth` cuts rather than refuses) would
/// otherwise never be freed, and nothing here depends on the nesting bound holding.
fn dismantle(mut pending: Vec<V>) {
    while let Some(v) = pending.pop() {
        match v {
            V::List(c) | V::Set(c) => {
                if let Ok(mut items) = c.try_borrow_mut() {
                    pending.extend(items.drain(..));
                }
            }
            V::Dict(d) => {
                if let Ok(mut items) = d.try_borrow_mut() {
                    for (k, v) in items.drain(..) {
                        pending.push(k);
                        pending.push(v);
                    }
                }
            }
            // The last holder of a tuple takes its items; others only drop a reference.
            V::Tuple(t) if Rc::strong_count(&t) == 1 => pending.extend(t.iter().cloned()),
            _ => {}
        }
    }
}

/// A decoded pickle and its memo, taken apart together without recursion when dropped (see
/// `dismantle`; the memo shares the value's containers, so neither is taken apart before the
/// value is used).
pub struct Decoded(pub V, Vec<V>);

impl Drop for Decoded {
    fn drop(&mut self) {
        let mut all = std::mem::take(&mut self.1);
        all.push(std::mem::replace(&mut self.0, V::None));
        dismantle(all);
    }
}

/// Decodes a whole pickle; `Err(())` for anything outside the subset (see the module docs).
pub fn decode(data: &[u8]) -> Result<Decoded, ()> {
    let mut m = Machine { data, pos: 0, stack: Vec::new(), marks: Vec::new(), memo: Vec::new() };
    let v = m.run()?;
    let memo = std::mem::take(&mut m.memo).into_iter().flatten().collect();
    let decoded = Decoded(v, memo);
    // Trailing bytes: not a single pickle.
    if m.pos != data.len() {
        return Err(());
    }
    Ok(decoded)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int(data: &[u8]) -> Option<i128> {
        match decode(data).ok()?.0 {
            V::Int(i) => Some(i),
            _ => None,
        }
    }

    #[test]
    fn integers_of_every_width() {
        assert_eq!(int(b"\x80\x04K\x07."), Some(7));
        assert_eq!(int(b"\x80\x04M\x00\x01."), Some(256));
        assert_eq!(int(b"\x80\x04J\xff\xff\xff\xff."), Some(-1));
        assert_eq!(int(b"\x80\x04\x8a\x00."), Some(0));
        assert_eq!(int(b"\x80\x04\x8a\x01\xff."), Some(-1));
        // 2^64 - 1 (stepalloc's max_split_size) takes nine bytes.
        assert_eq!(int(b"\x80\x04\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\x00."), Some(u64::MAX as i128));
        assert!(matches!(
            decode(b"\x80\x04\x8a\x11\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01\x01.")
                .map(|d| d.0.clone()),
            Ok(V::BigInt)
        ));
    }

    /// A dict memoised once and fetched twice is the same object in both places, with its keys.
    #[test]
    fn shared_objects_stay_shared() {
        // [{"a": 1}, <memo 1>]: EMPTY_LIST MEMOIZE MARK EMPTY_DICT MEMOIZE "a" MEMOIZE 1 SETITEM
        // BINGET 1 APPENDS STOP
        let data = b"\x80\x04]\x94(}\x94\x8c\x01a\x94K\x01sh\x01e.";
        let d = decode(data).unwrap();
        let items = d.0.items().unwrap();
        assert_eq!(items.len(), 2);
        for item in &items {
            assert_eq!(item.get("a").and_then(|v| v.as_u64()), Some(1));
        }
        let (V::Dict(a), V::Dict(b)) = (&items[0], &items[1]) else { panic!("two dicts") };
        assert!(Rc::ptr_eq(a, b));
    }

    #[test]
    fn malformed_or_foreign_pickles_are_refused() {
        for bad in [
            &b""[..],
            b"\x80\x04",                    // no STOP
            b"\x80\x04K\x01K\x02.",         // two values left
            b"\x80\x04s.",                  // SETITEM on an empty stack
            b"\x80\x04(K\x01a.",            // APPEND across a MARK
            b"\x80\x04h\x05.",              // memo entry never put
            b"\x80\x04\x8c\x05ab.",         // string past the end
            b"\x80\x04K\x01.extra",         // trailing bytes
            b"\x80\x04cos\nsystem\n.",      // a global
            b"\x80\x04]r\xff\xff\xff\x7f.", // a memo id beyond the input
        ] {
            assert!(decode(bad).is_err(), "{bad:?}");
        }
    }

    /// A list made to hold itself through the memo is taken apart when dropped.
    #[test]
    fn a_list_holding_itself_is_freed() {
        let d = decode(b"\x80\x04]\x94h\x00a.").unwrap();
        let V::List(l) = &d.0 else { panic!("a list") };
        let weak = Rc::downgrade(l);
        drop(d);
        assert!(weak.upgrade().is_none());
    }
}
