//! How deeply a pickle's values nest, found without building them: the pickle reader
//! (`serde_pickle`) builds its values iteratively but converts and drops them recursively, so a
//! pickle nesting thousands of levels (a few bytes per level) would overflow the stack.
//!
//! The scan walks the opcodes once, keeping only the shape: every container (list, tuple,
//! dict, set, object) is a node, an element that is a container is an edge. Memo entries name
//! nodes, so a container filled after it was memoized (or referenced twice) is one node, as in
//! the reader. The nesting depth is the longest path of that graph (cycles, which the reader
//! replaces by `None`, are cut). Opcodes the scan does not know, and malformed or truncated
//! input, end the scan: the reader reports those itself, and the depth of what was built so far
//! is still checked.
//!
//! The same graph gives the pickle's size once the reader has copied every shared value (it
//! copies what DUP and memo references share): a few bytes of DUP over a shared container can
//! stand for billions of values. `shape` reports it, so that such a pickle is refused before
//! the reader runs out of memory.

use std::collections::HashMap;

/// A value on the pickle machine's stack: a container node, or anything else.
#[derive(Clone, Copy)]
enum Item {
    Scalar,
    Node(u32),
}

#[derive(Default)]
struct Scan {
    stack: Vec<Item>,
    marks: Vec<usize>,
    memo: HashMap<u32, Item>,
    nodes: u32,
    /// (parent, child) for every container held by a container.
    edges: Vec<(u32, u32)>,
    /// By node: the scalars it holds (each copy of the node copies them too).
    scalars: Vec<u64>,
}

impl Scan {
    fn node(&mut self) -> Option<u32> {
        let id = self.nodes;
        self.nodes = self.nodes.checked_add(1)?;
        self.scalars.push(0);
        Some(id)
    }

    fn pop(&mut self) -> Option<Item> {
        if self.stack.len() <= self.marks.last().copied().unwrap_or(0) {
            return None;
        }
        self.stack.pop()
    }

    fn pop_mark(&mut self) -> Option<Vec<Item>> {
        let at = self.marks.pop()?;
        Some(self.stack.split_off(at.min(self.stack.len())))
    }

    fn link(&mut self, parent: u32, children: &[Item]) {
        for c in children {
            match c {
                Item::Node(c) => self.edges.push((parent, *c)),
                Item::Scalar => self.scalars[parent as usize] += 1,
            }
        }
    }

    /// A new container holding `children`, pushed.
    fn push_container(&mut self, children: &[Item]) -> Option<()> {
        let id = self.node()?;
        self.link(id, children);
        self.stack.push(Item::Node(id));
        Some(())
    }

    /// Adds `children` to the container on top of the stack.
    fn extend_top(&mut self, children: &[Item]) -> Option<()> {
        match self.stack.last().copied()? {
            Item::Node(top) => {
                self.link(top, children);
                Some(())
            }
            Item::Scalar => None,
        }
    }
}

/// Reads `n` bytes at `*pos`.
fn take<'a>(data: &'a [u8], pos: &mut usize, n: usize) -> Option<&'a [u8]> {
    let end = pos.checked_add(n)?;
    let bytes = data.get(*pos..end)?;
    *pos = end;
    Some(bytes)
}

fn line<'a>(data: &'a [u8], pos: &mut usize) -> Option<&'a [u8]> {
    let len = data.get(*pos..)?.iter().position(|&b| b == b'\n')?;
    let l = take(data, pos, len)?;
    *pos += 1;
    Some(l)
}

fn le(bytes: &[u8]) -> u64 {
    bytes.iter().rev().fold(0u64, |acc, &b| (acc << 8) | b as u64)
}

/// Skips a length-prefixed argument whose length takes `width` bytes.
fn counted(data: &[u8], pos: &mut usize, width: usize) -> Option<()> {
    let n = usize::try_from(le(take(data, pos, width)?)).ok()?;
    take(data, pos, n).map(|_| ())
}

fn ascii_id(bytes: &[u8]) -> Option<u32> {
    std::str::from_utf8(bytes).ok()?.trim().parse().ok()
}

/// Runs the opcodes of `data` until STOP, an unknown opcode or malformed input.
fn walk(data: &[u8], s: &mut Scan) -> Option<()> {
    let mut pos = 0usize;
    loop {
        let op = *take(data, &mut pos, 1)?.first()?;
        match op {
            b'.' => return Some(()), // STOP
            0x80 => counted_fixed(data, &mut pos, 1)?,
            0x95 => counted_fixed(data, &mut pos, 8)?,
            b'(' => s.marks.push(s.stack.len()),
            b'0' => {
                if s.pop().is_none() {
                    s.pop_mark()?;
                }
            }
            b'1' => {
                s.pop_mark()?;
            }
            b'2' => s.stack.push(*s.stack.last()?),
            // Scalars with a newline-terminated, fixed or counted argument.
            b'I' | b'L' | b'F' | b'S' | b'V' => {
                line(data, &mut pos)?;
                s.stack.push(Item::Scalar);
            }
            b'N' | 0x88 | 0x89 => s.stack.push(Item::Scalar),
            b'J' | b'K' | b'M' | b'G' => {
                let n = match op {
                    b'J' => 4,
                    b'K' => 1,
                    b'M' => 2,
                    _ => 8,
                };
                take(data, &mut pos, n)?;
                s.stack.push(Item::Scalar);
            }
            0x8a | b'U' | b'C' | 0x8c => {
                counted(data, &mut pos, 1)?;
                s.stack.push(Item::Scalar);
            }
            0x8b | b'T' | b'B' | b'X' => {
                counted(data, &mut pos, 4)?;
                s.stack.push(Item::Scalar);
            }
            0x8d | 0x8e | 0x96 => {
                counted(data, &mut pos, 8)?;
                s.stack.push(Item::Scalar);
            }
            // Memo.
            b'p' | b'q' | b'r' | 0x94 => {
                let id = match op {
                    b'p' => ascii_id(line(data, &mut pos)?)?,
                    b'q' => le(take(data, &mut pos, 1)?) as u32,
                    b'r' => le(take(data, &mut pos, 4)?) as u32,
                    _ => u32::try_from(s.memo.len()).ok()?,
                };
                let top = *s.stack.last()?;
                s.memo.insert(id, top);
            }
            b'g' | b'h' | b'j' => {
                let id = match op {
                    b'g' => ascii_id(line(data, &mut pos)?)?,
                    b'h' => le(take(data, &mut pos, 1)?) as u32,
                    _ => le(take(data, &mut pos, 4)?) as u32,
                };
                let item = *s.memo.get(&id)?;
                s.stack.push(item);
            }
            // Containers.
            b')' | b']' | b'}' | 0x8f => s.push_container(&[])?,
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(s.pop()?);
                }
                s.push_container(&items)?;
            }
            b't' | b'l' | b'd' | 0x91 => {
                let items = s.pop_mark()?;
                s.push_container(&items)?;
            }
            b'a' => {
                let v = s.pop()?;
                s.extend_top(&[v])?;
            }
            b's' => {
                let v = s.pop()?;
                let k = s.pop()?;
                s.extend_top(&[k, v])?;
            }
            b'e' | b'u' | 0x90 => {
                let items = s.pop_mark()?;
                s.extend_top(&items)?;
            }
            // Globals and objects: whatever they are built from is held by them.
            b'c' => {
                line(data, &mut pos)?;
                line(data, &mut pos)?;
                s.stack.push(Item::Scalar);
            }
            0x93 => {
                s.pop()?;
                s.pop()?;
                s.stack.push(Item::Scalar);
            }
            b'R' | 0x81 | 0x92 => {
                let n = if op == 0x92 { 3 } else { 2 };
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(s.pop()?);
                }
                s.push_container(&items)?;
            }
            b'i' | b'o' => {
                if op == b'i' {
                    line(data, &mut pos)?;
                    line(data, &mut pos)?;
                }
                let items = s.pop_mark()?;
                s.push_container(&items)?;
            }
            b'b' => {
                let state = s.pop()?;
                if s.extend_top(&[state]).is_none() {
                    s.pop()?;
                    s.push_container(&[state])?;
                }
            }
            _ => return None,
        }
    }
}

/// Skips a fixed-width argument.
fn counted_fixed(data: &[u8], pos: &mut usize, n: usize) -> Option<()> {
    take(data, pos, n).map(|_| ())
}

/// What reading a pickle would build: its deepest nesting of containers (0: none) and its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// The deepest nesting of containers, exact up to the limit given, `limit + 1` above.
    pub depth: u32,
    /// Containers and the scalars in them once every shared container is copied where it is
    /// used (saturating; cycles cut), as a reader that copies shared values builds them; 0
    /// when `depth` is over the limit (the pickle is refused for that).
    pub expanded: u64,
}

/// The depth (counted to `limit + 1`) and expanded size of the pickle `data`.
pub fn shape(data: &[u8], limit: u32) -> Shape {
    let mut s = Scan::default();
    let _ = walk(data, &mut s);
    longest_path(s.nodes as usize, &mut s.edges, &s.scalars, limit)
}

/// The number of nodes on the longest path of the graph, cycles cut, capped at `limit + 1`,
/// and the size of the roots' trees with shared nodes copied (`Shape::expanded`; 0 when the
/// depth is over the limit, where the search stops).
fn longest_path(nodes: usize, edges: &mut [(u32, u32)], scalars: &[u64], limit: u32) -> Shape {
    edges.sort_unstable();
    // Adjacency in compressed form: children of n are edges[start[n]..start[n + 1]].
    let mut start = vec![0usize; nodes + 1];
    for &(p, _) in edges.iter() {
        start[p as usize + 1] += 1;
    }
    for i in 0..nodes {
        start[i + 1] += start[i];
    }
    const NEW: u8 = 0;
    const OPEN: u8 = 1;
    const DONE: u8 = 2;
    let mut state = vec![NEW; nodes];
    let mut depth = vec![1u32; nodes];
    // By node: its tree's size with shared nodes copied (itself, its scalars, its children's).
    let mut size: Vec<u64> = (0..nodes).map(|n| scalars.get(n).copied().unwrap_or(0).saturating_add(1)).collect();
    let mut deepest = 0;
    let mut expanded = 0u64;
    let over = Shape { depth: limit + 1, expanded: 0 };
    // The path from the root being searched: (node, index of its next edge).
    let mut path: Vec<(usize, usize)> = Vec::new();
    for root in 0..nodes {
        if state[root] != NEW {
            continue;
        }
        state[root] = OPEN;
        path.push((root, start[root]));
        while let Some(&(n, next)) = path.last() {
            if path.len() > limit as usize {
                return over;
            }
            if next < start[n + 1] {
                if let Some(top) = path.last_mut() {
                    top.1 += 1;
                }
                let child = edges[next].1 as usize;
                match state[child] {
                    NEW => {
                        state[child] = OPEN;
                        path.push((child, start[child]));
                    }
                    DONE => {
                        depth[n] = depth[n].max(depth[child] + 1);
                        size[n] = size[n].saturating_add(size[child]);
                    }
                    // A cycle: cut, as the reader does (it leaves a None there).
                    _ => size[n] = size[n].saturating_add(1),
                }
            } else {
                state[n] = DONE;
                path.pop();
                if depth[n] > limit {
                    return over;
                }
                if let Some(&(parent, _)) = path.last() {
                    depth[parent] = depth[parent].max(depth[n] + 1);
                    size[parent] = size[parent].saturating_add(size[n]);
                }
            }
        }
        deepest = deepest.max(depth[root]);
    }
    // Every tree the reader builds hangs from a container no other holds (the result, or one
    // it dropped along the way). Containers the memo made part of a cycle may have no such
    // container above them: the largest single tree bounds those from below.
    let mut held = vec![false; nodes];
    for &(_, child) in edges.iter() {
        held[child as usize] = true;
    }
    for n in (0..nodes).filter(|&n| !held[n]) {
        expanded = expanded.saturating_add(size[n]);
    }
    expanded = expanded.max(size.iter().copied().max().unwrap_or(0));
    Shape { depth: deepest.min(limit + 1), expanded }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nesting_is_measured_through_memo_and_later_appends() {
        // [] : 1 level.
        assert_eq!(shape(b"\x80\x04]\x94.", 100).depth, 1);
        // [[[]]] built inside out: EMPTY_LIST, EMPTY_LIST, EMPTY_LIST, APPEND, APPEND.
        assert_eq!(shape(b"]]]aa.", 100).depth, 3);
        // x = [] memoized, y = [x], then [[]] appended to x through the memo: y > x > [] > [].
        assert_eq!(shape(b"]\x94]h\x00a0h\x00]]aa.", 100).depth, 4);
        // A dict holding a list: {"k": [()]}.
        assert_eq!(shape(b"}\x8c\x01k])as.", 100).depth, 3);
        // Scalars nest nothing.
        assert_eq!(shape(b"K\x01.", 100).depth, 0);
    }

    #[test]
    fn shared_containers_count_once_per_use() {
        // [1, 2] alone: the list and its two scalars.
        assert_eq!(shape(b"](K\x01K\x02e.", 100).expanded, 3);
        // x = [1, 2]; [x, x, x] through DUP: 1 + 3 * 3 values once copied.
        assert_eq!(shape(b"(](K\x01K\x02e22l.", 100).expanded, 10);
        // The same through the memo.
        assert_eq!(shape(b"(](K\x01K\x02e\x94h\x00h\x00l.", 100).expanded, 10);
        // Sharing nested 40 times over, two uses per level: 2^40 copies of the innermost list,
        // in 60 bytes, saturating rather than wrapping past 2^64 at 70 levels.
        let doubling = |levels: usize| {
            let mut p = vec![b']'];
            for _ in 0..levels {
                p.extend_from_slice(b"2\x86");
            }
            p.push(b'.');
            p
        };
        assert_eq!(shape(&doubling(40), 100).expanded, (1u64 << 41) - 1);
        assert_eq!(shape(&doubling(70), 100).expanded, u64::MAX);
        // The same held by a list the memo then puts inside itself: no container is outside
        // every other, and the copies still count.
        let mut cycle = b"]\x94".to_vec();
        cycle.extend_from_slice(&doubling(40)[..81]);
        cycle.extend_from_slice(b"ah\x00a.");
        assert!(shape(&cycle, 100).expanded >= (1u64 << 41) - 1);
    }

    #[test]
    fn deep_nesting_is_capped_at_the_limit_plus_one() {
        let mut p = vec![0x80, 0x04];
        p.extend(std::iter::repeat_n(b']', 20_000));
        p.extend(std::iter::repeat_n(b'a', 19_999));
        p.push(b'.');
        assert_eq!(shape(&p, 100).depth, 101);
        // Tuples nesting through TUPLE1, and a truncated file (no STOP): still measured.
        let mut t = vec![b')'];
        t.extend(std::iter::repeat_n(0x85, 50_000));
        assert_eq!(shape(&t, 100).depth, 101);
    }
}
