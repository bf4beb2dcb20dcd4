//! How PyTorch 2.15 reads `PYTORCH_CUDA_ALLOC_CONF`, token by token, so that `fit --pytorch-conf`
//! accepts exactly the strings PyTorch accepts, with the values PyTorch takes from them.
//!
//! PyTorch's reading (c10 `ConfigTokenizer`, `AcceleratorAllocatorConfig::parseArgs`, then the
//! CUDA hook `CUDAAllocatorConfig::parseArgs`; checked against the 2.15 wheel over testdrv/ by
//! `python_shim/tests/test_adversarial_fit.py`, which compares both on hundreds of strings):
//! - Tokens: `,` `:` `[` `]` are one-character tokens; bytes C's `isspace` takes (space, `\t`,
//!   `\n`, `\v`, `\f`, `\r`; not a non-breaking space) are dropped; the rest runs together.
//! - Two passes over the tokens, the accelerator's keys then the CUDA keys; each parses its own
//!   keys and skips the other's (`skipKey`: the value, or a `[...]` list). A key neither knows
//!   is refused. After an entry, one token is skipped whatever it is (PyTorch checks that it is
//!   `,` and ignores the answer), and so is the token after a key (meant to be `:`).
//! - Numbers: sizes by C's `stoull` (a leading sign, then digits; what follows is ignored, so
//!   `128abc` is 128 and `-1` wraps to 2^64-1), fractions by `stod` (decimal or hexadecimal,
//!   `inf`, `nan`; out of range, subnormal results included, is refused), booleans `True` /
//!   `False` exactly. An index past the last token fails PyTorch's internal assertion.
//!
//! Invariant: `read` returns the entries PyTorch would set, in order, or the reason it refuses
//! the string; it never panics and holds no more than the input's size.

/// A value as PyTorch read it.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Value {
    Bool(bool),
    Size(u64),
    Double(f64),
    /// `roundup_power2_divisions`: one count, or a list written back in a plain form
    /// (`[256:2,>:4]`: each interval and count as the number PyTorch read).
    Divisions(String),
    /// A value PyTorch takes as text (`backend`) or leaves unchecked (reserve sizes).
    Text(String),
}

/// How a key's value is read.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Bool,
    /// A size, with the check PyTorch makes on it.
    Size(SizeRule),
    /// A fraction: in (0, 1) (`open`) or in [0, 1].
    Double {
        open: bool,
    },
    Divisions,
    Backend,
    /// One token, not checked.
    Lenient,
    /// A list `[name:value, ...]` (`expandable_segments_reserve_by_class`).
    ByClass,
}

#[derive(Clone, Copy, PartialEq)]
enum SizeRule {
    Any,
    /// At least the large segment size (`large_segment_size_mb`, 20 by default).
    AtLeastSegment,
    Over10,
    Positive,
    Threads,
}

/// The accelerator pass's keys and the CUDA pass's (PyTorch 2.15's `getKeys()` of each).
const ACCELERATOR: &[(&str, Kind)] = &[
    ("max_split_size_mb", Kind::Size(SizeRule::AtLeastSegment)),
    ("max_non_split_rounding_mb", Kind::Size(SizeRule::AtLeastSegment)),
    ("garbage_collection_threshold", Kind::Double { open: true }),
    ("roundup_power2_divisions", Kind::Divisions),
    ("expandable_segments", Kind::Bool),
    ("pinned_use_background_threads", Kind::Bool),
    ("large_segment_size_mb", Kind::Size(SizeRule::Over10)),
    ("pinned_max_round_threshold_mb", Kind::Size(SizeRule::Any)),
    ("pinned_max_cached_size_mb", Kind::Size(SizeRule::Any)),
];
const CUDA: &[(&str, Kind)] = &[
    ("backend", Kind::Backend),
    ("release_lock_on_cudamalloc", Kind::Bool),
    ("release_lock_on_hipmalloc", Kind::Bool),
    ("pinned_use_cuda_host_register", Kind::Bool),
    ("pinned_use_hip_host_register", Kind::Bool),
    ("pinned_num_register_threads", Kind::Size(SizeRule::Threads)),
    ("pinned_reserve_segment_size_mb", Kind::Size(SizeRule::Positive)),
    ("graph_capture_record_stream_reuse", Kind::Bool),
    ("per_process_memory_fraction", Kind::Double { open: false }),
    ("pinned_free_catch_all", Kind::Bool),
    ("throw_on_cudamalloc_oom", Kind::Bool),
    ("expandable_segments_reserve", Kind::Lenient),
    ("expandable_segments_reserve_by_class", Kind::ByClass),
];

/// PyTorch's most pinned-memory registration threads (`pinned_max_register_threads`).
const MAX_REGISTER_THREADS: u64 = 128;
const MIB: u64 = 1 << 20;

/// Every key PyTorch 2.15 knows, in the order of its two passes.
pub(super) fn keys() -> impl Iterator<Item = &'static str> {
    ACCELERATOR.iter().chain(CUDA).map(|&(k, _)| k)
}

/// The entries PyTorch sets from `text` (key, value), in the order it reads them, or why it
/// refuses the string.
pub(super) fn read(text: &str) -> Result<Vec<(&'static str, Value)>, String> {
    let tokens = tokenize(text);
    // PyTorch checks each split size against the large segment size the string sets, wherever
    // it sets it (its last value): read it first.
    let mut first = Vec::new();
    Pass { tokens: &tokens, out: &mut first, segment_mb: None }.run(ACCELERATOR, CUDA)?;
    let segment_mb = first.iter().rev().find_map(|(k, v)| match (k, v) {
        (&"large_segment_size_mb", Value::Size(n)) => Some(mib_capped(*n)),
        _ => None,
    });
    let mut out = Vec::new();
    for (own, other) in [(ACCELERATOR, CUDA), (CUDA, ACCELERATOR)] {
        Pass { tokens: &tokens, out: &mut out, segment_mb: Some(segment_mb.unwrap_or(20)) }.run(own, other)?;
    }
    Ok(out)
}

/// C's `isspace` in the "C" locale.
fn c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

fn tokenize(text: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut buffer = String::new();
    for c in text.chars() {
        if matches!(c, ',' | ':' | '[' | ']') {
            if !buffer.is_empty() {
                tokens.push(std::mem::take(&mut buffer));
            }
            tokens.push(c.to_string());
        } else if !(c.is_ascii() && c_space(c as u8)) {
            buffer.push(c);
        }
    }
    if !buffer.is_empty() {
        tokens.push(buffer);
    }
    tokens
}

struct Pass<'t, 'o> {
    tokens: &'t [String],
    out: &'o mut Vec<(&'static str, Value)>,
    /// The least split size (MiB) PyTorch takes; None: not checked (the first reading).
    segment_mb: Option<u64>,
}

impl Pass<'_, '_> {
    fn run(&mut self, own: &[(&'static str, Kind)], other: &[(&'static str, Kind)]) -> Result<(), String> {
        let n = self.tokens.len();
        let mut i = 0;
        while i < n {
            let bare = self.tokens[i].as_str();
            if let Some(&(name, kind)) = own.iter().find(|(k, _)| *k == bare) {
                i = self.parse(name, kind, i)?;
            } else if other.iter().any(|(k, _)| *k == bare) {
                i = self.skip_key(i)?;
            } else {
                return Err(format!(
                    "`{bare}` is not one of PyTorch 2.15's keys (it would refuse it: \"Unrecognized key '{bare}'\"); \
                     its keys: {}",
                    keys().collect::<Vec<_>>().join(", ")
                ));
            }
            if i + 1 < n {
                i += 1; // the separator, whatever it is
            }
            i += 1;
        }
        Ok(())
    }

    /// The token at `i`; PyTorch's internal assertion past the end.
    fn at(&self, i: usize, key: &str) -> Result<&str, String> {
        match self.tokens.get(i) {
            Some(t) => Ok(t.as_str()),
            None => Err(format!(
                "`{key}` ends before its value or list does (PyTorch would refuse it: its parser reads past the \
                 last token and fails an internal assertion)"
            )),
        }
    }

    /// PyTorch's `skipKey`: the value, or up to the `]` of a list. Returns the last index.
    fn skip_key(&self, i: usize) -> Result<usize, String> {
        let key = self.tokens[i].as_str();
        self.at(i + 1, key)?;
        let v = i + 2;
        if self.at(v, key)? != "[" {
            return Ok(v);
        }
        let mut j = v + 1;
        while j < self.tokens.len() && self.at(j, key)? != "]" {
            j += 1;
        }
        self.at(j, key)?;
        Ok(j)
    }

    fn parse(&mut self, name: &'static str, kind: Kind, i: usize) -> Result<usize, String> {
        self.at(i + 1, name)?; // meant to be `:`; PyTorch does not check it
        let v = i + 2;
        let text = self.at(v, name)?.to_string();
        let refuse = |why: String| format!("`{name}:{text}`: PyTorch would refuse it ({why})");
        let value = match kind {
            Kind::Bool => match text.as_str() {
                "True" => Value::Bool(true),
                "False" => Value::Bool(false),
                _ => return Err(refuse("it takes `True` or `False` only".into())),
            },
            Kind::Size(rule) => {
                let n = stoull(&text).map_err(|_| refuse("not a number (`stoull`)".into()))?;
                let fails = match rule {
                    SizeRule::Any => None,
                    SizeRule::AtLeastSegment => match self.segment_mb {
                        Some(least) if n < least => {
                            return Err(refuse(format!(
                                "must be at least the large segment size, {least}; read as {n}"
                            )))
                        }
                        _ => None,
                    },
                    SizeRule::Over10 => (n <= 10).then_some("must be more than 10 MB"),
                    SizeRule::Positive => (n == 0).then_some("must be more than 0"),
                    SizeRule::Threads => (!n.is_power_of_two() || n > MAX_REGISTER_THREADS)
                        .then_some("the number of threads must be a power of 2, at most 128"),
                };
                if let Some(why) = fails {
                    return Err(refuse(format!("{why}; read as {n}")));
                }
                Value::Size(n)
            }
            Kind::Double { open } => {
                let x = stod(&text).map_err(|why| refuse(format!("`stod`: {why}")))?;
                let inside = if open { x > 0.0 && x < 1.0 } else { (0.0..=1.0).contains(&x) };
                if !inside {
                    let range = if open { "(0.0, 1.0)" } else { "[0.0, 1.0]" };
                    return Err(refuse(format!("set it in {range}")));
                }
                Value::Double(x)
            }
            Kind::Backend => match text.as_str() {
                "native" | "cudaMallocAsync" => Value::Text(text.clone()),
                _ => return Err(refuse("unknown allocator backend; options are native and cudaMallocAsync".into())),
            },
            Kind::Lenient => Value::Text(text.clone()),
            Kind::Divisions if text != "[" => {
                let n = stoull(&text).map_err(|_| refuse("not a number (`stoull`)".into()))?;
                if !n.is_power_of_two() {
                    return Err(refuse(format!("the divisions must be a power of 2; read as {n}")));
                }
                Value::Divisions(n.to_string())
            }
            Kind::Divisions => return self.divisions_list(name, v),
            Kind::ByClass => {
                // PyTorch takes the value's token as the list's `[` without looking at it.
                let end = self.by_class_list(name, v)?;
                self.out.push((name, Value::Text(String::new())));
                return Ok(end);
            }
        };
        self.out.push((name, value));
        Ok(v)
    }

    /// `roundup_power2_divisions:[interval:count, ...]` from its `[` at `open`; returns the
    /// index of its `]`.
    fn divisions_list(&mut self, name: &'static str, open: usize) -> Result<usize, String> {
        let mut items = Vec::new();
        let mut i = open;
        loop {
            i += 1;
            if i >= self.tokens.len() || self.at(i, name)? == "]" {
                break;
            }
            let interval = self.at(i, name)?.to_string();
            self.at(i + 1, name)?; // meant to be `:`
            i += 2;
            let count_text = self.at(i, name)?;
            let refuse = |why: String| format!("`{name}`: PyTorch would refuse it ({why})");
            let count = stoull(count_text).map_err(|_| refuse(format!("`{count_text}` is not a number")))?;
            if count != 0 && !count.is_power_of_two() {
                return Err(refuse(format!("{count} divisions: a power of 2 or 0")));
            }
            let interval = if interval == ">" {
                ">".to_string()
            } else {
                let mb = stoull(&interval).map_err(|_| refuse(format!("`{interval}` is not a number")))?;
                if !mb.is_power_of_two() {
                    return Err(refuse(format!("interval {mb}: the intervals must be powers of 2")));
                }
                mb.to_string()
            };
            items.push(format!("{interval}:{count}"));
            if self.at(i + 1, name)? != "]" {
                i += 1; // meant to be `,`
            }
        }
        self.at(i, name)?; // the closing `]`
        self.out.push((name, Value::Divisions(format!("[{}]", items.join(",")))));
        Ok(i)
    }

    /// `expandable_segments_reserve_by_class:[name:reserve, ...]`, not checked further by
    /// PyTorch; returns the index of its `]`.
    fn by_class_list(&self, name: &str, open: usize) -> Result<usize, String> {
        let mut i = open;
        loop {
            i += 1;
            if i >= self.tokens.len() || self.at(i, name)? == "]" {
                break;
            }
            self.at(i + 1, name)?;
            i += 2;
            self.at(i, name)?;
            if i + 1 < self.tokens.len() && self.at(i + 1, name)? == "," {
                i += 1;
            }
        }
        self.at(i, name)?;
        Ok(i)
    }
}

/// C's `stoull` (base 10): a sign, then digits, the rest ignored; `-n` wraps as `strtoull` does.
fn stoull(text: &str) -> Result<u64, ()> {
    let b = text.as_bytes();
    let (negative, digits) = match b.first() {
        Some(b'-') => (true, &b[1..]),
        Some(b'+') => (false, &b[1..]),
        _ => (false, b),
    };
    let len = digits.iter().take_while(|d| d.is_ascii_digit()).count();
    if len == 0 {
        return Err(());
    }
    let mut n: u64 = 0;
    for &d in &digits[..len] {
        n = n.checked_mul(10).and_then(|n| n.checked_add(u64::from(d - b'0'))).ok_or(())?;
    }
    Ok(if negative { n.wrapping_neg() } else { n })
}

/// C's `stod`: the longest prefix `strtod` reads (decimal or hexadecimal with an exponent,
/// `inf`, `infinity`, `nan`, `nan(...)`); none, or a result out of range (overflow, or a
/// non-zero value below the smallest normal double), is an error.
fn stod(text: &str) -> Result<f64, &'static str> {
    let b = text.as_bytes();
    let (sign, rest) = match b.first() {
        Some(b'-') => (-1.0, &b[1..]),
        Some(b'+') => (1.0, &b[1..]),
        _ => (1.0, b),
    };
    let lower: Vec<u8> = rest.iter().map(u8::to_ascii_lowercase).collect();
    if lower.starts_with(b"inf") {
        return Ok(sign * f64::INFINITY);
    }
    if lower.starts_with(b"nan") {
        return Ok(f64::NAN);
    }
    let magnitude = if lower.starts_with(b"0x") && hex_digits_follow(&lower[2..]) {
        hex_float(&lower[2..])?
    } else {
        decimal_float(rest)?
    };
    let x = sign * magnitude;
    if x.is_infinite() || (x != 0.0 && x.abs() < f64::MIN_POSITIVE) {
        return Err("out of range");
    }
    Ok(x)
}

fn hex_digits_follow(b: &[u8]) -> bool {
    match b.first() {
        Some(c) if c.is_ascii_hexdigit() => true,
        Some(b'.') => b.get(1).is_some_and(u8::is_ascii_hexdigit),
        _ => false,
    }
}

/// The value of a decimal prefix of `b` (at least one digit), or an error when there is none
/// or its non-zero digits underflow to zero.
fn decimal_float(b: &[u8]) -> Result<f64, &'static str> {
    let int = b.iter().take_while(|c| c.is_ascii_digit()).count();
    let mut end = int;
    let mut frac = 0;
    if b.get(end) == Some(&b'.') {
        frac = b[end + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
        end += 1 + frac;
    }
    if int + frac == 0 {
        return Err("not a number");
    }
    if matches!(b.get(end), Some(b'e' | b'E')) {
        let mut k = end + 1;
        if matches!(b.get(k), Some(b'+' | b'-')) {
            k += 1;
        }
        let digits = b[k.min(b.len())..].iter().take_while(|c| c.is_ascii_digit()).count();
        if digits > 0 {
            end = k + digits;
        }
    }
    let text = std::str::from_utf8(&b[..end]).map_err(|_| "not a number")?;
    let x: f64 = text.parse().map_err(|_| "not a number")?;
    let nonzero = b[..int + usize::from(frac > 0) + frac].iter().any(|c| matches!(c, b'1'..=b'9'));
    if x == 0.0 && nonzero {
        return Err("out of range");
    }
    Ok(x)
}

/// The value of a hexadecimal float prefix after `0x` (digits, a point, a binary exponent).
fn hex_float(b: &[u8]) -> Result<f64, &'static str> {
    let (mut mantissa, mut scale, mut i, mut nonzero) = (0.0f64, 0i64, 0, false);
    let mut point = false;
    while let Some(&c) = b.get(i) {
        if c == b'.' && !point {
            point = true;
        } else if let Some(d) = (c as char).to_digit(16) {
            nonzero |= d != 0;
            mantissa = mantissa * 16.0 + f64::from(d);
            if point {
                scale -= 4;
            }
        } else {
            break;
        }
        i += 1;
    }
    if b.get(i) == Some(&b'p') {
        let mut k = i + 1;
        let negative = b.get(k) == Some(&b'-');
        if matches!(b.get(k), Some(b'+' | b'-')) {
            k += 1;
        }
        let digits = b[k.min(b.len())..].iter().take_while(|c| c.is_ascii_digit()).count();
        if digits > 0 {
            let e: i64 =
                b[k..k + digits].iter().fold(0i64, |e, d| e.saturating_mul(10).saturating_add(i64::from(d - b'0')));
            scale = scale.saturating_add(if negative { -e } else { e });
        }
    }
    let x = mantissa * 2f64.powi(scale.clamp(-2000, 2000) as i32);
    if x == 0.0 && nonzero {
        return Err("out of range");
    }
    Ok(x)
}

/// A size in MiB as PyTorch keeps it: at most what bytes can count.
pub(super) fn mib_capped(n: u64) -> u64 {
    n.min(u64::MAX / MIB)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_and_numbers_as_c_reads_them() {
        assert_eq!(tokenize(" a : b\t,c\u{a0}"), vec!["a", ":", "b", ",", "c\u{a0}"]);
        assert_eq!(tokenize("1 2\x0b8"), vec!["128"]);
        assert_eq!(stoull("128abc"), Ok(128));
        assert_eq!(stoull("-1"), Ok(u64::MAX));
        assert_eq!(stoull("+-5"), Err(()));
        assert_eq!(stoull("18446744073709551616"), Err(()));
        assert_eq!(stod("0.5abc"), Ok(0.5));
        assert_eq!(stod("0x1p-1"), Ok(0.5));
        assert_eq!(stod("0x"), Ok(0.0));
        assert_eq!(stod(".5"), Ok(0.5));
        assert!(stod("1e-310").is_err() && stod("1e400").is_err() && stod(".").is_err());
        assert!(stod("nan(123)").unwrap().is_nan());
    }

    #[test]
    fn pytorchs_quirks_are_kept() {
        // The separator and the colon are not checked; an entry may end in any token.
        assert_eq!(read("max_split_size_mb,128").unwrap(), vec![("max_split_size_mb", Value::Size(128))]);
        assert!(read("expandable_segments:True]").is_ok());
        assert!(read(",expandable_segments:True").unwrap_err().contains("Unrecognized key ','"));
        assert!(read("expandable_segments:True,,").is_err());
        assert!(read("roundup_power2_divisions:[256:1,").is_err());
        assert_eq!(
            read("roundup_power2_divisions:[256abc,2]").unwrap(),
            vec![("roundup_power2_divisions", Value::Divisions("[256:2]".into()))]
        );
        assert!(read("pinned_num_register_threads:3").is_err());
        assert!(read("expandable_segments:\u{a0}True").is_err());
    }
}
