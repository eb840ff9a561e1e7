//! The rollout id: what joins one rollout's requests across Gym's servers. Validated once,
//! here; read from a `/ng-rollout/<id>/` path prefix (see `routes`) or from the JSON body
//! of an agent's `/run`.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// Longest id accepted, in bytes. Gym stores use the id as a file name component
/// (`nemo_gym/rollout_correlation.py:36`), and Linux's `NAME_MAX` is 255: an id Gym can
/// store fits. It also bounds what a request can make us keep per span.
pub const MAX_ROLLOUT_ID_BYTES: usize = 255;

/// A rollout id matching Gym's `ROLLOUT_ID_PATTERN`, `^[A-Za-z0-9][A-Za-z0-9._-]*$`
/// (`nemo_gym/rollout_correlation.py:38`), at most [`MAX_ROLLOUT_ID_BYTES`] long.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RolloutId(Arc<str>);

impl RolloutId {
    /// Python's `re.match(r"...$")` also accepts one trailing `\n`; an id that needs it is
    /// refused here, since it cannot be carried in a path segment or an attribute cleanly.
    pub fn parse(text: &str) -> Option<RolloutId> {
        Self::is_valid(text).then(|| RolloutId(text.into()))
    }

    fn is_valid(text: &str) -> bool {
        let bytes = text.as_bytes();
        let first_ok = bytes.first().is_some_and(u8::is_ascii_alphanumeric);
        let rest_ok = bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        first_ok && rest_ok && bytes.len() <= MAX_ROLLOUT_ID_BYTES
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id as every span of its rollout carries it: one allocation for all of them.
    pub fn shared(&self) -> Arc<str> {
        self.0.clone()
    }
}

impl fmt::Display for RolloutId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The rollout id Gym's agent gives a `/run`, from the first bytes of its JSON body:
/// `maybe_rollout_id_from_run_body` (`nemo_gym/rollout_correlation.py:41-81`) applied to
/// the request model the agent builds (`nemo_gym/base_responses_api_agent.py:250-260`).
///
/// `captured` is a prefix of the body, `complete` says whether it is all of it. The answer
/// is an id only when it cannot change with the bytes not seen; anything undecidable,
/// malformed, or an error in Gym gives `None`, never a different id. In Gym's order:
///
/// - `_ng_rollout_id` wins when present, also as `null` (then it counts as unset). The
///   request model declares it as `capture_rollout_id: Optional[str]` with that alias and
///   `populate_by_name=True` (`nemo_gym/base_resources_server.py:92-100`), so a top-level
///   `capture_rollout_id` is used when the alias is absent; a non-string is a 422 and a
///   string off the pattern is a `ValueError`: both `None`.
/// - Else `f"{_ng_task_index}-{_ng_rollout_index}"`. Both are undeclared extras, kept as
///   JSON gave them (`extra="allow"`, e.g. `responses_api_agents/simple_agent/app.py:91`),
///   so they are formatted as Python's `str()` would: integers verbatim, floats by
///   `repr`, `True`/`False`, strings as they are. A missing or `null` one: no id. Gym
///   does not validate this derived id; an id off the pattern is `None` here.
/// - `-a{int(_ng_attempt_index)}` when that is > 0; `int()` of a string is Python's
///   (whitespace, sign, `_` between digits), and a value `int()` refuses is an error in
///   Gym, so `None`.
///
/// Truncation: a key not yet seen may still come, so a truncated body yields an id only
/// when `_ng_rollout_id` and `_ng_attempt_index` were both seen (plus the two indices when
/// the explicit id is `null`). A key seen is taken as final: Gym's callers send a
/// serialized dict, which cannot repeat a key. When the prefix already repeats one of
/// these keys, that reasoning fails, and a truncated body gives `None` (a complete one
/// takes the last, as Python's `json` does). The bytes not captured are assumed to be
/// valid JSON.
///
/// Gym itself only derives this id when its observability or token capture is on
/// (`rollout_id_from_run`, `base_responses_api_agent.py:377-385`); the tracer always does.
pub fn rollout_id_from_run_body(captured: &[u8], complete: bool) -> Option<RolloutId> {
    if !may_name_a_rollout(captured) {
        return None;
    }
    let text = match std::str::from_utf8(captured) {
        Ok(text) => text,
        // Cut inside a multi-byte character: read up to it.
        Err(e) if !complete && e.error_len().is_none() => {
            std::str::from_utf8(&captured[..e.valid_up_to()]).ok()?
        }
        Err(_) => return None,
    };
    // Python's `json.loads` of bytes accepts a UTF-8 byte order mark.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut fields = RunFields::default();
    let mut scanner = Scanner::new(text);
    scanner.skip_ws();
    if scanner.peek().ok()? != b'{' {
        return None;
    }
    let closed = match scanner.object(&mut |key, value| fields.record(key, value)) {
        Ok(()) => {
            scanner.skip_ws();
            if complete && scanner.pos != text.len() {
                return None;
            }
            true
        }
        Err(Stop::Truncated) if !complete => false,
        Err(_) => return None,
    };
    if !closed && fields.repeated {
        return None;
    }
    fields.rollout_id(closed)
}

/// The rollout id from the last bytes of a JSON body: Gym appends its `_ng_*` fields to the
/// dataset row and pydantic dumps them after the declared fields, so they are the body's last
/// members, past any head capture (CAUSALITY.md).
///
/// The tail starts anywhere, so it is read as the longest run of complete `"key": value`
/// members that ends the body's top-level object: `, "k": v, ..., "k": v }` up to the last
/// byte. Gym's rule is then applied to that run as if it were the whole object: a Gym body
/// names its rollout there or nowhere. A run that names none of the fields gives `None`.
pub fn rollout_id_from_body_tail(tail: &[u8]) -> Option<RolloutId> {
    fn members_after(text: &str) -> Option<RunFields<'_>> {
        let mut fields = RunFields::default();
        trailing_members(text, &mut fields).then_some(fields)
    }
    if !may_name_a_rollout(tail) {
        return None;
    }
    // The tail may begin inside a character: it is validated once from the first character
    // boundary (a comma is ASCII, so every comma of valid text starts a valid suffix); a
    // tail with invalid bytes further in is validated per suffix instead.
    let boundary = tail
        .iter()
        .position(|&byte| byte & 0xc0 != 0x80)
        .unwrap_or(tail.len());
    let found = match std::str::from_utf8(&tail[boundary..]) {
        Ok(text) => first_trailing_run(text).and_then(|at| members_after(&text[at + 1..])),
        Err(_) => (0..tail.len())
            .filter(|&at| tail[at] == b',')
            .find_map(|at| members_after(std::str::from_utf8(&tail[at + 1..]).ok()?)),
    };
    found
        .filter(|fields| !fields.repeated && fields.names_a_rollout())
        .and_then(|fields| fields.rollout_id(true))
}

/// Whether `bytes` can hold a key that names a rollout: one that is, or decodes to, one of
/// Gym's names. Without them or a `\u` escape no field is seen, and Gym's rule gives no id
/// (an unseen field is never an id); most bodies (a model call's, a verify's) are let go
/// after this one search instead of a parse.
fn may_name_a_rollout(bytes: &[u8]) -> bool {
    use memchr::memmem::Finder;
    // Built once: building a searcher cost more than a tail's search.
    static NEEDLES: std::sync::LazyLock<[Finder<'static>; 3]> = std::sync::LazyLock::new(|| {
        [b"\"_ng_".as_slice(), b"\"capture_rollout_id\"", b"\\u"].map(Finder::new)
    });
    NEEDLES.iter().any(|needle| needle.find(bytes).is_some())
}

/// The first comma of `text` after which [`trailing_members`] holds. Each comma is decided
/// once, from the last to the first: the one member after a comma ends at the next comma,
/// whose answer is already known, or at the closing `}`. Trying each comma to the end
/// instead was quadratic in the tail, a fifth of the agent's instructions on Gym's bodies.
fn first_trailing_run(text: &str) -> Option<usize> {
    /// Where the member after a comma at `comma` ends: the run's end, or the next comma.
    enum After {
        End,
        Comma(usize),
    }
    let member_after = |comma: usize| -> Option<After> {
        let mut scanner = Scanner::new(&text[comma + 1..]);
        scanner.skip_ws();
        scanner.string().ok()?;
        scanner.skip_ws();
        scanner.expect(b':').ok()?;
        scanner.skip_ws();
        scanner.value().ok()?;
        scanner.skip_ws();
        match scanner.peek().ok()? {
            b',' => Some(After::Comma(comma + 1 + scanner.pos)),
            b'}' => {
                scanner.pos += 1;
                scanner.skip_ws();
                (scanner.pos == scanner.text.len()).then_some(After::End)
            }
            _ => None,
        }
    };
    // One bit per byte: set where a comma starts a run to the end. A body's tail is
    // TAIL_BYTES long, so the set is on the stack.
    let mut inline = [0u64; tracer_abi::TAIL_BYTES / 64];
    let mut spilled = Vec::new();
    let runs: &mut [u64] = if text.len() <= inline.len() * 64 {
        &mut inline
    } else {
        spilled.resize(text.len().div_ceil(64), 0);
        &mut spilled
    };
    let mut first = None;
    for comma in (0..text.len())
        .rev()
        .filter(|&at| text.as_bytes()[at] == b',')
    {
        let starts_run = match member_after(comma) {
            Some(After::End) => true,
            Some(After::Comma(next)) => runs[next / 64] & (1 << (next % 64)) != 0,
            None => false,
        };
        if starts_run {
            runs[comma / 64] |= 1 << (comma % 64);
            first = Some(comma);
        }
    }
    first
}

/// Whether `text` is `"key": value` members separated by commas, then `}` and whitespace to
/// its end; `fields` sees each member.
fn trailing_members<'a>(text: &'a str, fields: &mut RunFields<'a>) -> bool {
    let mut scanner = Scanner::new(text);
    loop {
        scanner.skip_ws();
        let Ok(key) = scanner.string() else {
            return false;
        };
        scanner.skip_ws();
        if scanner.expect(b':').is_err() {
            return false;
        }
        scanner.skip_ws();
        let Ok(value) = scanner.value() else {
            return false;
        };
        fields.record(key, value);
        scanner.skip_ws();
        match scanner.peek() {
            Ok(b',') => scanner.pos += 1,
            Ok(b'}') => {
                scanner.pos += 1;
                scanner.skip_ws();
                return scanner.pos == text.len();
            }
            _ => return false,
        }
    }
}

/// The top-level members that name a rollout; `None` is "not seen".
#[derive(Default)]
struct RunFields<'a> {
    rollout_id: Option<Value<'a>>,
    capture_rollout_id: Option<Value<'a>>,
    task_index: Option<Value<'a>>,
    rollout_index: Option<Value<'a>>,
    attempt_index: Option<Value<'a>>,
    repeated: bool,
}

impl<'a> RunFields<'a> {
    fn record(&mut self, key: JsonStr<'a>, value: Value<'a>) {
        // Longest escaped form of the longest key: 18 characters as `\uXXXX`.
        if key.raw.len() > 18 * 6 {
            return;
        }
        let Some(key) = key.decode() else { return };
        let slot = match key.as_ref() {
            "_ng_rollout_id" => &mut self.rollout_id,
            "capture_rollout_id" => &mut self.capture_rollout_id,
            "_ng_task_index" => &mut self.task_index,
            "_ng_rollout_index" => &mut self.rollout_index,
            "_ng_attempt_index" => &mut self.attempt_index,
            _ => return,
        };
        self.repeated |= slot.is_some();
        *slot = Some(value);
    }

    fn names_a_rollout(&self) -> bool {
        self.rollout_id.is_some()
            || self.capture_rollout_id.is_some()
            || (self.task_index.is_some() && self.rollout_index.is_some())
    }

    /// Gym's rule over the fields. `closed`: the object ended, so an unseen key is absent.
    fn rollout_id(&self, closed: bool) -> Option<RolloutId> {
        // The alias wins whenever it is present, even as `null`; unseen in an open object,
        // it may still come.
        let explicit = if self.rollout_id.is_some() || !closed {
            known(&self.rollout_id, closed)?
        } else {
            known(&self.capture_rollout_id, closed)?
        };
        let mut id = match explicit {
            Some(Value::Str(s)) => {
                let id = s.decode()?;
                RolloutId::is_valid(&id).then(|| id.into_owned())?
            }
            Some(_) => return None,
            None => {
                let task = python_str(known(&self.task_index, closed)??)?;
                let rollout = python_str(known(&self.rollout_index, closed)??)?;
                format!("{task}-{rollout}")
            }
        };
        if let Some(attempt) = known(&self.attempt_index, closed)?
            && let Some(n) = python_positive_int(attempt)?
        {
            id.push_str("-a");
            id.push_str(&n);
        }
        RolloutId::parse(&id)
    }
}

/// A field as Python's `.get()`/`getattr(.., None)` sees it: absent and `null` are both
/// `None`. The outer `None` means it cannot be known yet (unseen in an open object).
fn known<'s, 'a>(field: &'s Option<Value<'a>>, closed: bool) -> Option<Option<&'s Value<'a>>> {
    match field {
        Some(Value::Null) => Some(None),
        Some(value) => Some(Some(value)),
        None => closed.then_some(None),
    }
}

/// Python's `str(value)` for a JSON scalar as `json.loads` builds it. Containers (whose
/// repr holds spaces and quotes, never a valid id) give `None`.
fn python_str<'a>(value: &Value<'a>) -> Option<Cow<'a, str>> {
    match *value {
        Value::Str(s) => s.decode(),
        Value::Int("-0") => Some(Cow::Borrowed("0")),
        Value::Int(text) => Some(Cow::Borrowed(text)),
        Value::Float(text) => Some(Cow::Owned(python_float_repr(text.parse().ok()?))),
        Value::Bool(true) => Some(Cow::Borrowed("True")),
        Value::Bool(false) => Some(Cow::Borrowed("False")),
        Value::Null | Value::Container => None,
    }
}

/// `int(value)`, as decimal digits when > 0. Outer `None`: `int()` raises (or the value
/// is beyond what is worth reproducing); inner `None`: the value is <= 0.
fn python_positive_int(value: &Value<'_>) -> Option<Option<String>> {
    match *value {
        Value::Bool(b) => Some(b.then(|| "1".to_owned())),
        Value::Int(text) => Some(positive_digits(text, false)),
        Value::Float(text) => {
            let x: f64 = text.parse().ok()?;
            if !x.is_finite() {
                return None;
            }
            Some((x >= 1.0).then(|| format!("{:.0}", x.trunc())))
        }
        Value::Str(s) => {
            let s = s.decode()?;
            // Python strips whitespace; these are the ASCII characters it counts.
            let s = s.trim_matches([' ', '\t', '\n', '\r', '\x0b', '\x0c']);
            let (negative, digits) = match s.as_bytes().first()? {
                b'-' => (true, &s[1..]),
                b'+' => (false, &s[1..]),
                _ => (false, s),
            };
            // Digit groups joined by single underscores, as `int()` accepts them.
            let groups_ok = digits
                .split('_')
                .all(|g| !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit()));
            groups_ok.then(|| positive_digits(&digits.replace('_', ""), negative))
        }
        Value::Null | Value::Container => None,
    }
}

fn positive_digits(text: &str, negative: bool) -> Option<String> {
    let (negative, digits) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (negative, text),
    };
    let digits = digits.trim_start_matches('0');
    (!negative && !digits.is_empty()).then(|| digits.to_owned())
}

/// Python's `repr(float)`: the shortest round-trip digits (as Rust's `{:e}` gives them),
/// fixed notation for exponents -4..16, else `1e+16` style with at least two exponent
/// digits.
fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".to_owned();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.to_owned();
    }
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits = mantissa.replace('.', "");
    let magnitude = exp.unsigned_abs() as usize;
    if (-4..16).contains(&exp) {
        if exp < 0 {
            let zeros = "0".repeat(magnitude - 1);
            format!("{sign}0.{zeros}{digits}")
        } else {
            let point = magnitude + 1;
            if digits.len() <= point {
                let zeros = "0".repeat(point - digits.len());
                format!("{sign}{digits}{zeros}.0")
            } else {
                format!("{sign}{}.{}", &digits[..point], &digits[point..])
            }
        }
    } else {
        let (lead, frac) = digits.split_at(1);
        let dot = if frac.is_empty() { "" } else { "." };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{lead}{dot}{frac}e{exp_sign}{magnitude:02}")
    }
}

// ---------------------------------------------------------------------------------------
// A streaming JSON scanner over a possibly truncated document. It validates what it reads
// and keeps only slices of the input: nothing is allocated for the values it skips.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    /// The input ended before the value did.
    Truncated,
    /// Not JSON as Python's `json` reads it.
    Malformed,
}

type Step<T> = Result<T, Stop>;

/// Where the first byte that ends a string's plain run is (a quote, a backslash or a
/// control character), eight bytes at a time: a request's last bytes are mostly string
/// contents, and scanning them byte by byte was a third of the time spent on a body's tail.
pub(crate) fn plain_run(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    // A high bit in each byte that is zero (exact for the lowest such byte, which is all
    // that is read: a borrow only carries towards higher bytes).
    let zero_bytes = |word: u64| word.wrapping_sub(ONES) & !word & HIGHS;
    let mut chunks = bytes.chunks_exact(8);
    let mut at = 0;
    for chunk in &mut chunks {
        let word = u64::from_le_bytes(chunk.try_into().expect("a chunk of 8"));
        let stops = zero_bytes(word ^ (ONES * u64::from(b'"')))
            | zero_bytes(word ^ (ONES * u64::from(b'\\')))
            | (word.wrapping_sub(ONES * 0x20) & !word & HIGHS);
        if stops != 0 {
            return Some(at + stops.trailing_zeros() as usize / 8);
        }
        at += 8;
    }
    let rest = chunks.remainder();
    rest.iter()
        .position(|&byte| byte == b'"' || byte == b'\\' || byte < 0x20)
        .map(|index| at + index)
}

/// Deeper nesting is refused rather than recursed into; Gym's bodies are a few levels deep.
const MAX_DEPTH: usize = 128;

/// A JSON string as it appears between its quotes, escapes already checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct JsonStr<'a> {
    raw: &'a str,
    escaped: bool,
}

impl<'a> JsonStr<'a> {
    /// `None` only for an escape that cannot be decoded (checked while scanning, so not
    /// expected). A lone surrogate becomes U+FFFD, which no id accepts either way.
    fn decode(self) -> Option<Cow<'a, str>> {
        if !self.escaped {
            return Some(Cow::Borrowed(self.raw));
        }
        let mut out = String::with_capacity(self.raw.len());
        let mut rest = self.raw;
        while let Some(i) = rest.find('\\') {
            out.push_str(&rest[..i]);
            let escape = rest.get(i + 1..i + 2)?;
            rest = &rest[i + 2..];
            let c = match escape {
                "\"" => '"',
                "\\" => '\\',
                "/" => '/',
                "b" => '\u{8}',
                "f" => '\u{c}',
                "n" => '\n',
                "r" => '\r',
                "t" => '\t',
                "u" => {
                    let unit = u16::from_str_radix(rest.get(..4)?, 16).ok()?;
                    rest = &rest[4..];
                    let low = rest
                        .strip_prefix("\\u")
                        .and_then(|r| u16::from_str_radix(r.get(..4)?, 16).ok())
                        .filter(|low| (0xdc00..0xe000).contains(low));
                    match (unit, low) {
                        (0xd800..0xdc00, Some(low)) => {
                            rest = &rest[6..];
                            let code = 0x10000
                                + ((u32::from(unit) - 0xd800) << 10)
                                + (u32::from(low) - 0xdc00);
                            char::from_u32(code)?
                        }
                        _ => char::from_u32(u32::from(unit)).unwrap_or('\u{fffd}'),
                    }
                }
                _ => return None,
            };
            out.push(c);
        }
        out.push_str(rest);
        Some(Cow::Owned(out))
    }
}

/// A JSON value as far as the rollout id cares: scalars as their text, containers skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Value<'a> {
    Null,
    Bool(bool),
    /// JSON integer text, which is also how Python prints the `int` it becomes.
    Int(&'a str),
    /// A number with a fraction or exponent, or Python's `NaN`/`Infinity`/`-Infinity`.
    Float(&'a str),
    Str(JsonStr<'a>),
    Container,
}

struct Scanner<'a> {
    text: &'a str,
    pos: usize,
    depth: usize,
}

impl<'a> Scanner<'a> {
    fn new(text: &'a str) -> Self {
        Scanner {
            text,
            pos: 0,
            depth: 0,
        }
    }

    fn bytes(&self) -> &'a [u8] {
        self.text.as_bytes()
    }

    fn peek(&self) -> Step<u8> {
        self.bytes().get(self.pos).copied().ok_or(Stop::Truncated)
    }

    fn skip_ws(&mut self) {
        while matches!(
            self.bytes().get(self.pos),
            Some(b' ' | b'\t' | b'\n' | b'\r')
        ) {
            self.pos += 1;
        }
    }

    fn expect(&mut self, byte: u8) -> Step<()> {
        if self.peek()? != byte {
            return Err(Stop::Malformed);
        }
        self.pos += 1;
        Ok(())
    }

    /// An object at `{`; `member` sees each member once its value is complete.
    fn object(&mut self, member: &mut dyn FnMut(JsonStr<'a>, Value<'a>)) -> Step<()> {
        self.expect(b'{')?;
        self.skip_ws();
        if self.peek()? == b'}' {
            self.pos += 1;
            return Ok(());
        }
        loop {
            self.skip_ws();
            let key = self.string()?;
            self.skip_ws();
            self.expect(b':')?;
            self.skip_ws();
            let value = self.value()?;
            member(key, value);
            self.skip_ws();
            match self.peek()? {
                b',' => self.pos += 1,
                b'}' => {
                    self.pos += 1;
                    return Ok(());
                }
                _ => return Err(Stop::Malformed),
            }
        }
    }

    fn array(&mut self) -> Step<()> {
        self.expect(b'[')?;
        self.skip_ws();
        if self.peek()? == b']' {
            self.pos += 1;
            return Ok(());
        }
        loop {
            self.skip_ws();
            self.value()?;
            self.skip_ws();
            match self.peek()? {
                b',' => self.pos += 1,
                b']' => {
                    self.pos += 1;
                    return Ok(());
                }
                _ => return Err(Stop::Malformed),
            }
        }
    }

    fn value(&mut self) -> Step<Value<'a>> {
        match self.peek()? {
            b'"' => self.string().map(Value::Str),
            b'{' | b'[' => {
                if self.depth == MAX_DEPTH {
                    return Err(Stop::Malformed);
                }
                self.depth += 1;
                let skipped = if self.peek()? == b'{' {
                    self.object(&mut |_, _| {})
                } else {
                    self.array()
                };
                self.depth -= 1;
                skipped.map(|()| Value::Container)
            }
            b't' => self.literal("true", Value::Bool(true)),
            b'f' => self.literal("false", Value::Bool(false)),
            b'n' => self.literal("null", Value::Null),
            b'N' => self.literal("NaN", Value::Float("NaN")),
            b'I' => self.literal("Infinity", Value::Float("Infinity")),
            b'-' if self.bytes().get(self.pos + 1) == Some(&b'I') => {
                self.literal("-Infinity", Value::Float("-Infinity"))
            }
            b'-' | b'0'..=b'9' => self.number(),
            _ => Err(Stop::Malformed),
        }
    }

    fn literal(&mut self, word: &str, value: Value<'a>) -> Step<Value<'a>> {
        let available = &self.bytes()[self.pos..];
        let n = available.len().min(word.len());
        if available[..n] != word.as_bytes()[..n] {
            return Err(Stop::Malformed);
        }
        if n < word.len() {
            return Err(Stop::Truncated);
        }
        self.pos += n;
        Ok(value)
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`. A number running into the end of
    /// the input is truncated: more digits may follow.
    fn number(&mut self) -> Step<Value<'a>> {
        let start = self.pos;
        if self.peek()? == b'-' {
            self.pos += 1;
        }
        match self.peek()? {
            b'0' => self.pos += 1,
            b'1'..=b'9' => self.digits()?,
            _ => return Err(Stop::Malformed),
        }
        let mut float = false;
        if self.peek()? == b'.' {
            self.pos += 1;
            self.digits()?;
            float = true;
        }
        if matches!(self.peek()?, b'e' | b'E') {
            self.pos += 1;
            if matches!(self.peek()?, b'+' | b'-') {
                self.pos += 1;
            }
            self.digits()?;
            float = true;
        }
        // Ends on ASCII, so the slice is on character boundaries.
        let text = &self.text[start..self.pos];
        Ok(if float {
            Value::Float(text)
        } else {
            Value::Int(text)
        })
    }

    /// One or more digits, and something after them.
    fn digits(&mut self) -> Step<()> {
        if !self.peek()?.is_ascii_digit() {
            return Err(Stop::Malformed);
        }
        while self.peek()?.is_ascii_digit() {
            self.pos += 1;
        }
        Ok(())
    }

    /// A string at `"`: checks its escapes and refuses raw control characters, as
    /// Python's strict `json` does.
    fn string(&mut self) -> Step<JsonStr<'a>> {
        self.expect(b'"')?;
        let start = self.pos;
        let mut escaped = false;
        loop {
            // Plain characters in one pass, up to a quote, an escape or a control character.
            match plain_run(&self.bytes()[self.pos..]) {
                Some(plain) => self.pos += plain,
                None => {
                    self.pos = self.text.len();
                    return Err(Stop::Truncated);
                }
            }
            match self.peek()? {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    self.pos += 1;
                    match self.peek()? {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.pos += 1,
                        b'u' => {
                            self.pos += 1;
                            for _ in 0..4 {
                                if !self.peek()?.is_ascii_hexdigit() {
                                    return Err(Stop::Malformed);
                                }
                                self.pos += 1;
                            }
                        }
                        _ => return Err(Stop::Malformed),
                    }
                }
                0..0x20 => return Err(Stop::Malformed),
                _ => self.pos += 1,
            }
        }
        let raw = &self.text[start..self.pos];
        self.pos += 1;
        Ok(JsonStr { raw, escaped })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(body: &str) -> Option<String> {
        rollout_id_from_run_body(body.as_bytes(), true).map(|id| id.as_str().to_owned())
    }

    fn some(s: &str) -> Option<String> {
        Some(s.to_owned())
    }

    fn from_tail(body: &str, tail_bytes: usize) -> Option<String> {
        let bytes = body.as_bytes();
        rollout_id_from_body_tail(&bytes[bytes.len().saturating_sub(tail_bytes)..])
            .map(|id| id.as_str().to_string())
    }

    #[test]
    fn the_first_trailing_run_is_the_first_comma_whose_suffix_is_members_to_the_end() {
        // The definition, tried comma by comma, against the one-pass answer, on every suffix
        // of bodies shaped as Gym's (nested input, strings holding commas and braces).
        let bodies = [
            r#"{"responses_create_params": {"input": [{"role": "user", "content": "a, b}, \"c\": 1}"}, {"role": "assistant", "content": [1, 2, {"x": [3, 4]}]}], "tools": []}, "expected": "x, y", "_ng_task_index": 12, "_ng_rollout_index": 3, "_ng_attempt_index": 0}"#,
            r#"{"a": {"b": {"c": {"d": 1, "e": 2}, "f": 3}, "g": 4}, "_ng_rollout_id": "r-1"}  "#,
            r#"{"a": 1, "b": [1, 2], "c": {"d": 1}"#,
            r#", , "k": 1}, "l": 2}"#,
        ];
        for body in bodies {
            for start in 0..body.len() {
                let Some(text) = body.get(start..) else {
                    continue;
                };
                let naive = (0..text.len())
                    .filter(|&at| text.as_bytes()[at] == b',')
                    .find(|&at| trailing_members(&text[at + 1..], &mut RunFields::default()));
                assert_eq!(first_trailing_run(text), naive, "{text}");
            }
        }
    }

    #[test]
    fn a_tail_cut_inside_a_character_or_with_invalid_bytes_still_names_its_rollout() {
        let members = r#", "_ng_task_index": 3, "_ng_rollout_index": 1}"#;
        let id = |tail: Vec<u8>| rollout_id_from_body_tail(&tail).map(|id| id.as_str().to_owned());
        // "é" is two bytes: the tail begins at its second.
        let cut = [&"é".as_bytes()[1..], b"x\"", members.as_bytes()].concat();
        assert_eq!(id(cut), some("3-1"));
        let invalid = [b"\"a\xff\xfe\"".as_slice(), members.as_bytes()].concat();
        assert_eq!(id(invalid), some("3-1"));
        let invalid_after = [members.as_bytes(), b"\xff"].concat();
        assert_eq!(id(invalid_after), None, "the object must end the tail");
    }

    #[test]
    fn the_tail_of_a_gym_body_names_its_rollout() {
        let prompt = "x".repeat(11_000);
        let body = format!(
            r#"{{"responses_create_params": {{"input": [{{"role": "user", "content": "{prompt}, \"_ng_task_index\": 9}}"}}]}}, "_ng_task_index": 3, "_ng_rollout_index": 1}}"#
        );
        assert_eq!(from_tail(&body, 128), some("3-1"));
        assert_eq!(from_tail(&(body.clone() + "\r\n"), 128), some("3-1"));
        let attempt = body.replace("1}", "1, \"_ng_attempt_index\": 2}");
        assert_eq!(from_tail(&attempt, 128), some("3-1-a2"));
        let explicit = body.replace(
            "}, \"_ng_task",
            "}, \"_ng_rollout_id\": \"run.7\", \"_ng_task",
        );
        assert_eq!(from_tail(&explicit, 128), some("run.7"));
        // Cut inside the run: the part that is left still ends the object.
        assert_eq!(from_tail(&body, 27), None, "only _ng_rollout_index is left");
        assert_eq!(from_tail(&body, 50), some("3-1"));
        // Not Gym's shape: no id rather than a wrong one.
        assert_eq!(
            from_tail(
                r#"{"a": {"_ng_task_index": 1, "_ng_rollout_index": 2}}"#,
                128
            ),
            None
        );
        assert_eq!(
            from_tail(r#"{"_ng_task_index": 1, "_ng_rollout_index": 2"#, 128),
            None
        );
        assert_eq!(
            from_tail(
                r#"{"a": 1, "_ng_task_index": 1, "_ng_task_index": 2, "_ng_rollout_index": 2}"#,
                128
            ),
            None
        );
        assert_eq!(from_tail(r#"{"a": 1, "b": 2}"#, 128), None);
    }

    #[test]
    fn parse_validates_the_pattern() {
        for ok in [
            "a",
            "0",
            "r-1",
            "3-0-a2",
            "A.b_c-D",
            &"x".repeat(MAX_ROLLOUT_ID_BYTES),
        ] {
            assert_eq!(RolloutId::parse(ok).unwrap().as_str(), ok);
        }
        let too_long = "x".repeat(MAX_ROLLOUT_ID_BYTES + 1);
        for bad in [
            "", ".a", "-a", "_a", "a b", "a/b", "a\n", "é", "a%2F", &too_long,
        ] {
            assert_eq!(RolloutId::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn explicit_id_wins() {
        assert_eq!(id(r#"{"_ng_rollout_id": "r-1"}"#), some("r-1"));
        assert_eq!(
            id(r#"{"_ng_task_index": 3, "_ng_rollout_index": 1, "_ng_rollout_id": "r-1"}"#),
            some("r-1")
        );
    }

    #[test]
    fn indices_derive_the_id() {
        assert_eq!(
            id(r#"{"_ng_task_index": 3, "_ng_rollout_index": 1}"#),
            some("3-1")
        );
        assert_eq!(
            id(r#"{"_ng_task_index":0,"_ng_rollout_index":0}"#),
            some("0-0")
        );
        assert_eq!(id(r#"{"_ng_task_index": 3}"#), None);
        assert_eq!(id(r#"{"_ng_rollout_index": 1}"#), None);
        assert_eq!(
            id(r#"{"_ng_task_index": null, "_ng_rollout_index": 1}"#),
            None
        );
        assert_eq!(id(r#"{}"#), None);
    }

    #[test]
    fn attempt_suffix_only_above_zero() {
        let body = |attempt: &str| {
            format!(
                r#"{{"_ng_task_index": 3, "_ng_rollout_index": 1, "_ng_attempt_index": {attempt}}}"#
            )
        };
        assert_eq!(id(&body("0")), some("3-1"));
        assert_eq!(id(&body("-0")), some("3-1"));
        assert_eq!(id(&body("-2")), some("3-1"));
        assert_eq!(id(&body("null")), some("3-1"));
        assert_eq!(id(&body("2")), some("3-1-a2"));
        assert_eq!(
            id(&body("12345678901234567890")),
            some("3-1-a12345678901234567890")
        );
        assert_eq!(
            id(r#"{"_ng_rollout_id": "r", "_ng_attempt_index": 1}"#),
            some("r-a1")
        );
    }

    #[test]
    fn attempt_follows_python_int() {
        let body =
            |attempt: &str| format!(r#"{{"_ng_rollout_id": "r", "_ng_attempt_index": {attempt}}}"#);
        assert_eq!(id(&body("true")), some("r-a1"));
        assert_eq!(id(&body("false")), some("r"));
        assert_eq!(id(&body("2.9")), some("r-a2"));
        assert_eq!(id(&body("0.5")), some("r"));
        assert_eq!(id(&body("1e2")), some("r-a100"));
        assert_eq!(id(&body(r#""3""#)), some("r-a3"));
        assert_eq!(id(&body(r#"" +0_3\n""#)), some("r-a3"));
        assert_eq!(id(&body(r#""-4""#)), some("r"));
        assert_eq!(id(&body(r#""000""#)), some("r"));
        // `int()` raises on these, so Gym's /run fails: no id.
        for bad in [
            r#""""#,
            r#""2.5""#,
            r#""1__0""#,
            r#""_1""#,
            r#""x""#,
            "[]",
            "{}",
            "NaN",
        ] {
            assert_eq!(id(&body(bad)), None, "{bad}");
        }
        assert_eq!(id(&body("Infinity")), None);
    }

    #[test]
    fn indices_format_as_python_str() {
        let body =
            |t: &str, r: &str| format!(r#"{{"_ng_task_index": {t}, "_ng_rollout_index": {r}}}"#);
        assert_eq!(id(&body(r#""7""#, r#""b""#)), some("7-b"));
        assert_eq!(id(&body("1.0", "1e2")), some("1.0-100.0"));
        assert_eq!(id(&body("1.5", "-0.0")), some("1.5--0.0"));
        assert_eq!(id(&body("1e-5", "0.5")), some("1e-05-0.5"));
        assert_eq!(id(&body("true", "false")), some("True-False"));
        assert_eq!(id(&body("-0", "NaN")), some("0-nan"));
        assert_eq!(
            id(&body("123456789012345678901234567890", "0")),
            some("123456789012345678901234567890-0")
        );
        // Valid for Gym, off the pattern here: no id rather than another one.
        assert_eq!(id(&body(r#""a b""#, "0")), None);
        assert_eq!(id(&body("-1", "0")), None);
        assert_eq!(id(&body("1e16", "0")), None, "1e+16 holds a `+`");
        assert_eq!(id(&body("[1]", "0")), None);
        assert_eq!(id(&body("{}", "0")), None);
        assert_eq!(id(&body("-Infinity", "0")), None);
    }

    #[test]
    fn float_repr_matches_python() {
        // Values from CPython 3.13's repr().
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (123.456, "123.456"),
            (1e15, "1000000000000000.0"),
            (9999999999999998.0, "9999999999999998.0"),
            (1e16, "1e+16"),
            (1.5e300, "1.5e+300"),
            (-2.5e-7, "-2.5e-07"),
            (1e-100, "1e-100"),
            (1.0 / 3.0, "0.3333333333333333"),
            (5e-324, "5e-324"),
            (f64::MAX, "1.7976931348623157e+308"),
            (f64::INFINITY, "inf"),
            (f64::NEG_INFINITY, "-inf"),
            (f64::NAN, "nan"),
        ];
        for (x, want) in cases {
            assert_eq!(python_float_repr(x), want, "{x:e}");
        }
    }

    #[test]
    fn explicit_id_malformed_or_not_a_string_gives_none() {
        for bad in [
            r#""""#, r#"".r""#, r#""a b""#, r#""a/b""#, "5", "true", "[]", "{}",
        ] {
            let body = format!(
                r#"{{"_ng_rollout_id": {bad}, "_ng_task_index": 1, "_ng_rollout_index": 2}}"#
            );
            assert_eq!(id(&body), None, "{body}");
        }
    }

    #[test]
    fn explicit_null_falls_back_to_indices() {
        assert_eq!(
            id(r#"{"_ng_rollout_id": null, "_ng_task_index": 1, "_ng_rollout_index": 2}"#),
            some("1-2")
        );
    }

    #[test]
    fn capture_rollout_id_by_name_unless_alias_present() {
        let base = r#""_ng_task_index": 1, "_ng_rollout_index": 2"#;
        assert_eq!(
            id(&format!(r#"{{"capture_rollout_id": "n", {base}}}"#)),
            some("n")
        );
        assert_eq!(
            id(&format!(r#"{{"capture_rollout_id": null, {base}}}"#)),
            some("1-2")
        );
        assert_eq!(id(&format!(r#"{{"capture_rollout_id": 5, {base}}}"#)), None);
        // Pydantic takes the alias whenever it is present, in either order, even as null.
        assert_eq!(
            id(r#"{"capture_rollout_id": "n", "_ng_rollout_id": "a"}"#),
            some("a")
        );
        assert_eq!(
            id(r#"{"_ng_rollout_id": "a", "capture_rollout_id": 5}"#),
            some("a")
        );
        assert_eq!(
            id(&format!(
                r#"{{"_ng_rollout_id": null, "capture_rollout_id": "n", {base}}}"#
            )),
            some("1-2")
        );
    }

    #[test]
    fn only_top_level_keys_count() {
        let body = r#"{"responses_create_params": {"_ng_rollout_id": "decoy",
            "input": [{"_ng_task_index": 9, "_ng_rollout_index": 9}], "metadata": {"x": {"_ng_attempt_index": 4}}},
            "_ng_task_index": 3, "_ng_rollout_index": 1}"#;
        assert_eq!(id(body), some("3-1"));
        let nested_only = r#"{"a": {"_ng_rollout_id": "decoy", "_ng_attempt_index": 1}}"#;
        assert_eq!(id(nested_only), None);
    }

    #[test]
    fn keys_inside_strings_do_not_count() {
        let body = r#"{"prompt": "\"_ng_rollout_id\": \"decoy\", \\", "_ng_rollout_id": "real", "x": "}"}"#;
        assert_eq!(id(body), some("real"));
        let body = r#"{"prompt": "{\"_ng_rollout_id\": \"decoy\"}"}"#;
        assert_eq!(id(body), None);
    }

    #[test]
    fn escaped_keys_and_values_are_decoded() {
        assert_eq!(id(r#"{"_ng\u005frollout_id": "r\u002d1"}"#), some("r-1"));
        assert_eq!(id(r#"{"_ng_rollout_id": "r\/1"}"#), None);
        assert_eq!(
            id(r#"{"_ng_task_index": "\ud83d\ude00", "_ng_rollout_index": 1}"#),
            None
        );
    }

    #[test]
    fn duplicate_keys_take_the_last_when_complete() {
        assert_eq!(
            id(r#"{"_ng_rollout_id": "a", "_ng_attempt_index": 1, "_ng_rollout_id": "b"}"#),
            some("b-a1")
        );
        let truncated =
            br#"{"_ng_rollout_id": "a", "_ng_attempt_index": 1, "_ng_rollout_id": "b", "x""#;
        assert_eq!(rollout_id_from_run_body(truncated, false), None);
    }

    #[test]
    fn json_structure_and_values_accepted() {
        let body = r#" {"a": [1, -2.5e+3, true, false, null, NaN, -Infinity, Infinity, "s", {}, []],
            "b": {"c": {"d": [[]]}}, "e": 0, "f": "\b\f\n\r\t\\\/\u00e9",
            "_ng_rollout_id": "r"} 
"#;
        assert_eq!(id(body), some("r"));
        assert_eq!(id("\u{feff}{\"_ng_rollout_id\": \"r\"}"), some("r"));
    }

    #[test]
    fn malformed_json_gives_none() {
        let good = r#""_ng_rollout_id": "r""#;
        for bad in [
            format!("[{good}]"),
            format!("x{{{good}}}"),
            format!("{{{good}}} x"),
            format!("{{{good}}}}}"),
            format!("{{{good},}}"),
            format!("{{{good} \"a\" 1}}"),
            format!("{{{good}, \"a\": 01}}"),
            format!("{{{good}, \"a\": 1.}}"),
            format!("{{{good}, \"a\": .5}}"),
            format!("{{{good}, \"a\": +1}}"),
            format!("{{{good}, \"a\": tru}}"),
            format!("{{{good}, \"a\": \"\\x\"}}"),
            format!("{{{good}, \"a\": \"\\u12g4\"}}"),
            format!("{{{good}, \"a\": \"tab\there\"}}"),
            format!("{{{good}, 'a': 1}}"),
            format!("{{{good}, \"a\": [1,]}}"),
            format!("{{{good}, \"a\": [1 2]}}"),
            format!("{{{good}"),
            String::new(),
            "   ".to_owned(),
        ] {
            assert_eq!(id(&bad), None, "{bad}");
        }
        assert_eq!(
            rollout_id_from_run_body(b"{\"_ng_rollout_id\": \"r\", \"a\": \"\xff\"}", true),
            None
        );
    }

    #[test]
    fn nesting_is_bounded() {
        let deep = format!(
            "{{\"a\": {}{}, \"_ng_rollout_id\": \"r\"}}",
            "[".repeat(500),
            "]".repeat(500)
        );
        assert_eq!(id(&deep), None);
        let ok = format!(
            "{{\"a\": {}{}, \"_ng_rollout_id\": \"r\"}}",
            "[".repeat(100),
            "]".repeat(100)
        );
        assert_eq!(id(&ok), some("r"));
    }

    /// Every cut of `body` gives `None` or `want`, and `want` from `ready` bytes on.
    fn assert_truncation_safe(body: &str, want: &str, ready: Option<usize>) {
        assert_eq!(id(body).as_deref(), Some(want), "complete body");
        let bytes = body.as_bytes();
        for cut in 0..=bytes.len() {
            let got = rollout_id_from_run_body(&bytes[..cut], false);
            let got = got.as_ref().map(RolloutId::as_str);
            assert!(got.is_none() || got == Some(want), "cut {cut}: {got:?}");
            if let Some(ready) = ready {
                assert_eq!(
                    got.is_some(),
                    cut >= ready,
                    "cut {cut} of {:?}",
                    &body[..cut]
                );
            }
        }
    }

    #[test]
    fn truncated_explicit_id_needs_the_attempt() {
        let body = r#"{"_ng_rollout_id": "r-7", "responses_create_params": {"input": "\"_ng_attempt_index\": 9, é"}, "_ng_attempt_index": 2, "more": [1, 2, {"x": "y"}]}"#;
        // Once the attempt's value is followed by a byte: `2` could have been `23`.
        let ready = body.find(r#"2, "more""#).unwrap() + 2;
        assert_truncation_safe(body, "r-7-a2", Some(ready));
    }

    #[test]
    fn truncated_indices_never_decide() {
        // `_ng_rollout_id` could still come and win.
        let body =
            r#"{"_ng_task_index": 12, "_ng_rollout_index": 3, "_ng_attempt_index": 0, "x": "é"}"#;
        assert_truncation_safe(body, "12-3", None);
        for cut in 0..body.len() {
            assert_eq!(
                rollout_id_from_run_body(&body.as_bytes()[..cut], false),
                None
            );
        }
    }

    #[test]
    fn truncated_null_explicit_id_then_indices() {
        let body = r#"{"_ng_rollout_id": null, "_ng_attempt_index": "1", "_ng_task_index": 4, "_ng_rollout_index": "x", "y": 1}"#;
        let ready = body.find(r#", "y""#).unwrap();
        assert_truncation_safe(body, "4-x-a1", Some(ready));
    }

    #[test]
    fn truncated_without_attempt_never_decides() {
        let body = r#"{"_ng_rollout_id": "r", "input": [{"role": "user", "content": "hi"}]}"#;
        assert_truncation_safe(body, "r", None);
        for cut in 0..body.len() {
            assert_eq!(
                rollout_id_from_run_body(&body.as_bytes()[..cut], false),
                None
            );
        }
    }

    #[test]
    fn truncated_but_closed_object_is_final() {
        assert_eq!(
            rollout_id_from_run_body(br#"{"_ng_task_index": 1, "_ng_rollout_index": 2}"#, false),
            Some(RolloutId::parse("1-2").unwrap())
        );
    }

    #[test]
    fn truncated_inside_a_multibyte_character() {
        let body = "{\"_ng_rollout_id\": \"r\", \"_ng_attempt_index\": 0, \"p\": \"é\"}";
        let cut = body.find('é').unwrap() + 1;
        let got = rollout_id_from_run_body(&body.as_bytes()[..cut], false);
        assert_eq!(got.unwrap().as_str(), "r");
        assert_eq!(
            rollout_id_from_run_body(&body.as_bytes()[..cut], true),
            None
        );
    }

    #[test]
    fn the_plain_run_scan_stops_where_a_byte_by_byte_scan_does() {
        let naive = |bytes: &[u8]| {
            bytes
                .iter()
                .position(|&byte| byte == b'"' || byte == b'\\' || byte < 0x20)
        };
        // Every stop byte and its neighbours, at every offset of words and remainders,
        // among plain ASCII and the high bytes of UTF-8.
        let fillers = [
            b'a', b'!', 0x7f, 0x80, 0x9f, 0xa0, 0xdf, 0xff, b'#', b'[', b']',
        ];
        let stops = [b'"', b'\\', 0x00, 0x01, 0x1f, 0x20, 0x21, 0x5b, 0x5d];
        for len in 0..40 {
            for &filler in &fillers {
                let plain = vec![filler; len];
                assert_eq!(plain_run(&plain), naive(&plain));
                for at in 0..len {
                    for &stop in &stops {
                        let mut bytes = plain.clone();
                        bytes[at] = stop;
                        // A second stop further on must not hide the first.
                        if at + 3 < len {
                            bytes[at + 3] = b'"';
                        }
                        assert_eq!(plain_run(&bytes), naive(&bytes), "{bytes:?}");
                    }
                }
            }
        }
    }
}
