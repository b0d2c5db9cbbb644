//! W3C Trace Context across the pipeline: a [`TraceParent`] on an incoming delivery is
//! carried onto the outbox events its handler writes, and from there onto the messages
//! the relay publishes, so one trace spans the consumer, the relay and the next consumer.
//!
//! How it travels:
//! 1. the `Gate` reads the delivery's `traceparent` header
//!    ([`TraceParent::from_headers`]); a malformed or repeated one is ignored (never an
//!    error: the delivery is processed untraced);
//! 2. it opens the delivery's span with `trace_id`, `parent_id` (the upstream span) and
//!    `span_id` (a new id for this delivery, [`TraceParent::child`]) fields;
//! 3. while the handler runs, [`OutboxEvent::new`](crate::OutboxEvent::new) picks up the
//!    delivery's context by the event's idempotency key ([`current`]): the event's
//!    [`traceparent`](crate::OutboxEvent::traceparent) is the trace id with this
//!    delivery's `span_id` as parent. In a batch each event gets its own delivery's
//!    context. A handler needs no code for it;
//! 4. the store keeps it in the outbox row's `traceparent` column, the relay reads it back
//!    and every publisher sends it as the `traceparent` header
//!    ([`OutboxEvent::headers`](crate::OutboxEvent::headers)), unchanged: a republished
//!    event is the same message, byte for byte.
//!
//! `tracestate` is not carried.

use std::cell::RefCell;
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher as _, Hasher as _};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::key::IdempotencyKey;

/// The name of the W3C Trace Context header (matched ASCII case-insensitively).
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// A W3C Trace Context `traceparent`: a 16-byte trace id, the 8-byte id of the parent
/// span and the trace flags, written `00-<32 hex>-<16 hex>-<2 hex>` (lower-case).
///
/// Parsing follows the W3C recommendation: version `00` must be exactly 55 characters;
/// a higher version (not `ff`) is read for its first four fields and propagated as `00`.
/// An all-zero trace id or parent id, upper-case hex, or any other deviation is an
/// error. Surrounding spaces and tabs (HTTP's optional white space) are ignored.
///
/// ```
/// use idem_core::trace::TraceParent;
/// let tp: TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse()?;
/// assert_eq!(tp.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
/// assert_eq!(tp.parent_id_hex(), "00f067aa0ba902b7");
/// assert!(tp.sampled());
/// assert_eq!(tp.to_string(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
/// let child = tp.child();
/// assert_eq!(child.trace_id(), tp.trace_id());
/// assert_ne!(child.parent_id(), tp.parent_id());
/// assert!("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01".parse::<TraceParent>().is_err());
/// # Ok::<(), idem_core::trace::TraceParentError>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    trace_id: [u8; 16],
    parent_id: [u8; 8],
    flags: u8,
}

/// Why a `traceparent` value was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TraceParentError {
    /// Not `version-trace_id-parent_id-flags` with the right lengths and dashes.
    #[error("a traceparent is version-traceid-parentid-flags (55 characters for version 00)")]
    Format,
    /// The version is not two lower-case hex digits, or is the forbidden `ff`.
    #[error("invalid traceparent version")]
    Version,
    /// The trace id is not 32 lower-case hex digits, or is all zero.
    #[error("invalid traceparent trace id")]
    TraceId,
    /// The parent id is not 16 lower-case hex digits, or is all zero.
    #[error("invalid traceparent parent id")]
    ParentId,
    /// The flags are not two lower-case hex digits.
    #[error("invalid traceparent flags")]
    Flags,
}

/// Lower-case hex of `bytes`.
fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    s
}

/// Decodes lower-case hex into `out`; `false` on any other character.
fn decode_hex(s: &[u8], out: &mut [u8]) -> bool {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    if s.len() != out.len() * 2 {
        return false;
    }
    for (o, pair) in out.iter_mut().zip(s.chunks_exact(2)) {
        match (nibble(pair[0]), nibble(pair[1])) {
            (Some(h), Some(l)) => *o = (h << 4) | l,
            _ => return false,
        }
    }
    true
}

impl TraceParent {
    /// A context from its parts; `None` when either id is all zero (invalid in W3C).
    pub fn new(trace_id: [u8; 16], parent_id: [u8; 8], flags: u8) -> Option<Self> {
        (trace_id != [0; 16] && parent_id != [0; 8]).then_some(Self {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// Parses a `traceparent` value (see the type's docs).
    ///
    /// # Errors
    /// [`TraceParentError`] naming the first field that is wrong.
    pub fn parse(s: &str) -> Result<Self, TraceParentError> {
        let b = s.trim_matches([' ', '\t']).as_bytes();
        if b.len() < 55 {
            return Err(TraceParentError::Format);
        }
        let mut version = [0u8; 1];
        if !decode_hex(&b[0..2], &mut version) || version[0] == 0xff {
            return Err(TraceParentError::Version);
        }
        // Version 00 is exactly 55 characters; a later version may append fields after
        // a dash, which this version ignores.
        let tail_ok = if version[0] == 0 {
            b.len() == 55
        } else {
            b.len() == 55 || b[55] == b'-'
        };
        if b[2] != b'-' || b[35] != b'-' || b[52] != b'-' || !tail_ok {
            return Err(TraceParentError::Format);
        }
        let mut trace_id = [0u8; 16];
        if !decode_hex(&b[3..35], &mut trace_id) || trace_id == [0; 16] {
            return Err(TraceParentError::TraceId);
        }
        let mut parent_id = [0u8; 8];
        if !decode_hex(&b[36..52], &mut parent_id) || parent_id == [0; 8] {
            return Err(TraceParentError::ParentId);
        }
        let mut flags = [0u8; 1];
        if !decode_hex(&b[53..55], &mut flags) {
            return Err(TraceParentError::Flags);
        }
        Ok(Self {
            trace_id,
            parent_id,
            flags: flags[0],
        })
    }

    /// The valid `traceparent` of a message's headers (the name matched ASCII
    /// case-insensitively). `None` when there is none, when it is malformed, or when
    /// there are several (W3C: a repeated `traceparent` is invalid).
    ///
    /// ```
    /// use idem_core::trace::TraceParent;
    /// let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    /// let h = vec![("TraceParent".to_owned(), good.to_owned())];
    /// assert_eq!(TraceParent::from_headers(&h).map(|t| t.to_string()).as_deref(), Some(good));
    /// let bad = vec![("traceparent".to_owned(), "00-xyz".to_owned())];
    /// assert!(TraceParent::from_headers(&bad).is_none());
    /// ```
    pub fn from_headers(headers: &[(String, String)]) -> Option<Self> {
        let mut found = headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(TRACEPARENT_HEADER));
        let (_, value) = found.next()?;
        if found.next().is_some() {
            return None;
        }
        Self::parse(value).ok()
    }

    /// The trace id.
    pub const fn trace_id(&self) -> [u8; 16] {
        self.trace_id
    }

    /// The id of the parent span (the span that sent the message).
    pub const fn parent_id(&self) -> [u8; 8] {
        self.parent_id
    }

    /// The trace flags.
    pub const fn flags(&self) -> u8 {
        self.flags
    }

    /// Whether the `sampled` flag is set.
    pub const fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The trace id as 32 lower-case hex digits.
    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }

    /// The parent id as 16 lower-case hex digits.
    pub fn parent_id_hex(&self) -> String {
        hex(&self.parent_id)
    }

    /// The context of a new span under this one: the same trace id and flags, a new
    /// random, non-zero parent id (the new span's id).
    #[must_use]
    pub fn child(&self) -> Self {
        Self {
            trace_id: self.trace_id,
            parent_id: new_span_id(),
            flags: self.flags,
        }
    }
}

/// A random, non-zero span id (std's per-process random hash keys and a counter: no
/// dependency, unpredictable enough for ids that only need to be unique).
fn new_span_id() -> [u8; 8] {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let id = h.finish();
    id.max(1).to_be_bytes()
}

impl fmt::Display for TraceParent {
    /// The version-00 form, `00-<trace id>-<parent id>-<flags>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            hex(&self.trace_id),
            hex(&self.parent_id),
            self.flags
        )
    }
}

impl fmt::Debug for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TraceParent({self})")
    }
}

impl FromStr for TraceParent {
    type Err = TraceParentError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// The trace contexts of the deliveries whose handler is running: what an engine sets
/// around a handler's future ([`scoped`]) so that [`current`] finds them.
pub type Scope = Arc<ScopeOf>;

/// See [`Scope`].
#[derive(Debug)]
pub struct ScopeOf {
    /// Each traced submission's key and its delivery's context.
    entries: Vec<(IdempotencyKey, TraceParent)>,
    /// One delivery is handled: its context is every event's, whatever the event's key.
    single: bool,
}

thread_local! {
    static CURRENT: RefCell<Option<Scope>> = const { RefCell::new(None) };
}

/// Restores the previous scope when dropped (even on a panic).
struct Enter(Option<Scope>);

impl Enter {
    fn new(scope: Scope) -> Self {
        Self(CURRENT.with(|c| c.replace(Some(scope))))
    }
}

impl Drop for Enter {
    fn drop(&mut self) {
        let prev = self.0.take();
        CURRENT.with(|c| *c.borrow_mut() = prev);
    }
}

/// The trace context of the delivery being handled, for an event of submission `key`:
/// the gate sets it while a handler runs (on each poll of the handler's future, like a
/// tracing span), and [`OutboxEvent::new`](crate::OutboxEvent::new) reads it. `None`
/// outside a handler, for an untraced delivery, or for a key that is not one of the
/// batch's (when a single delivery is handled, every event gets its context, whatever its
/// key). Work the handler spawns onto other tasks does not see it.
pub fn current(key: &IdempotencyKey) -> Option<TraceParent> {
    CURRENT.with(|c| {
        let scope = c.borrow();
        let scope = scope.as_deref()?;
        scope
            .entries
            .iter()
            .find(|(k, _)| k == key)
            .or(match scope.entries.as_slice() {
                [only] if scope.single => Some(only),
                _ => None,
            })
            .map(|(_, t)| *t)
    })
}

/// Runs `fut` with `scope` as the [`current`] trace contexts on every poll; without a
/// scope it runs `fut` as it is. An engine wraps each handler's future in it.
pub async fn scoped<F: Future>(scope: Option<Scope>, fut: F) -> F::Output {
    let Some(scope) = scope else {
        return fut.await;
    };
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(move |cx| {
        let _enter = Enter::new(Arc::clone(&scope));
        fut.as_mut().poll(cx)
    })
    .await
}

/// The scope of one delivery's handler: its context applies to every event.
pub fn single(key: IdempotencyKey, trace: Option<TraceParent>) -> Option<Scope> {
    trace.map(|t| {
        Arc::new(ScopeOf {
            entries: vec![(key, t)],
            single: true,
        })
    })
}

/// The scope of a batch's handler: each event gets the context of its own key's delivery
/// (none for a key not in `entries`). `None` when `entries` is empty.
pub fn batch(entries: impl IntoIterator<Item = (IdempotencyKey, TraceParent)>) -> Option<Scope> {
    let entries: Vec<_> = entries.into_iter().collect();
    (!entries.is_empty()).then(|| {
        Arc::new(ScopeOf {
            entries,
            single: false,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_the_w3c_example() {
        let tp = TraceParent::parse(GOOD).expect("valid");
        assert_eq!(tp.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(tp.parent_id_hex(), "00f067aa0ba902b7");
        assert_eq!(tp.flags(), 1);
        assert_eq!(tp.to_string(), GOOD);
        assert_eq!(TraceParent::parse(&format!(" {GOOD}\t")), Ok(tp));
    }

    #[test]
    fn refuses_malformed_values() {
        use TraceParentError::{Flags, Format, ParentId, TraceId, Version};
        let g = |from: &str, to: &str| GOOD.replacen(from, to, 1);
        let cases: Vec<(String, TraceParentError)> = vec![
            (String::new(), Format),
            ("00".into(), Format),
            // one character short, one too many, fields after version 00
            (GOOD[..54].into(), Format),
            (format!("{GOOD}0"), Format),
            (format!("{GOOD}-00"), Format),
            (g("00-4b", "ff-4b"), Version),
            (g("00-4b", "0g-4b"), Version),
            (g("00-4b", "0A-4b"), Version),
            (g("4bf9", "4BF9"), TraceId),
            (g("4bf9", "4bz9"), TraceId),
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01".into(),
                TraceId,
            ),
            (g("00f0", "00F0"), ParentId),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01".into(),
                ParentId,
            ),
            (g("b7-01", "b7-0x"), Flags),
            (g("b7-01", "b7-0A"), Flags),
            (g("36-00", "36_00"), Format),
            (g("00-4b", "00_4b"), Format),
        ];
        for (s, want) in cases {
            assert_eq!(TraceParent::parse(&s), Err(want), "{s:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_for_its_first_fields() {
        let later = GOOD.replacen("00", "cc", 1);
        let tp = TraceParent::parse(&later).expect("version cc");
        assert_eq!(tp.to_string(), GOOD);
        let extended = format!("{later}-what-the-future-will-bring");
        assert_eq!(TraceParent::parse(&extended), Ok(tp));
        assert_eq!(
            TraceParent::parse(&format!("{later}x")),
            Err(TraceParentError::Format)
        );
    }

    #[test]
    fn headers_need_exactly_one_valid_traceparent() {
        let h = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        assert!(TraceParent::from_headers(&h(&[("TRACEPARENT", GOOD)])).is_some());
        assert!(TraceParent::from_headers(&h(&[("x", GOOD)])).is_none());
        assert!(
            TraceParent::from_headers(&h(&[("traceparent", GOOD), ("traceparent", GOOD)]))
                .is_none()
        );
        assert!(TraceParent::from_headers(&h(&[("traceparent", "00-1-2-3")])).is_none());
    }

    #[test]
    fn a_child_keeps_the_trace_and_gets_a_fresh_span() {
        let tp = TraceParent::parse(GOOD).expect("valid");
        let a = tp.child();
        let b = tp.child();
        assert_eq!((a.trace_id(), a.flags()), (tp.trace_id(), tp.flags()));
        assert_ne!(a.parent_id(), b.parent_id());
        assert_ne!(a.parent_id(), [0; 8]);
        assert_eq!(TraceParent::parse(&a.to_string()), Ok(a));
    }

    #[test]
    fn current_is_set_only_inside_the_scope() {
        let k1 = IdempotencyKey::derive("A-1", "t", b"1").expect("key");
        let k2 = IdempotencyKey::derive("A-2", "t", b"2").expect("key");
        let k3 = IdempotencyKey::derive("A-3", "t", b"3").expect("key");
        let t1 = TraceParent::parse(GOOD).expect("valid");
        let t2 = t1.child();
        assert_eq!(current(&k1), None);
        let got = futures::executor::block_on(scoped(batch([(k1, t1), (k2, t2)]), async {
            (current(&k1), current(&k2), current(&k3))
        }));
        assert_eq!(got, (Some(t1), Some(t2), None));
        // A batch with one traced delivery: the others' events stay untraced.
        let got = futures::executor::block_on(scoped(batch([(k1, t1)]), async {
            (current(&k1), current(&k3))
        }));
        assert_eq!(got, (Some(t1), None));
        // One delivery: every event is its own.
        let got = futures::executor::block_on(scoped(single(k1, Some(t1)), async { current(&k3) }));
        assert_eq!(got, Some(t1));
        assert_eq!(current(&k1), None, "the scope ends with the future");
    }

    proptest! {
        /// Every well-formed version-00 value parses and prints back as it was.
        #[test]
        fn well_formed_values_round_trip(
            trace in any::<[u8; 16]>(), parent in any::<[u8; 8]>(), flags in any::<u8>()
        ) {
            let s = format!("00-{}-{}-{flags:02x}", hex(&trace), hex(&parent));
            let parsed = TraceParent::parse(&s);
            if trace == [0; 16] || parent == [0; 8] {
                prop_assert!(parsed.is_err());
            } else {
                let tp = parsed.expect("valid");
                prop_assert_eq!(tp.to_string(), s);
                prop_assert_eq!(Some(tp), TraceParent::new(trace, parent, flags));
            }
        }

        /// No string makes the parser panic, and whatever it accepts prints as a valid
        /// version-00 value of the same trace.
        #[test]
        fn arbitrary_strings_never_panic(s in ".{0,70}") {
            if let Ok(tp) = TraceParent::parse(&s) {
                let again = TraceParent::parse(&tp.to_string()).expect("reparse");
                prop_assert_eq!(again, tp);
                prop_assert!(s.contains(&tp.trace_id_hex()));
            }
        }

        /// Changing any one character of a valid value to an upper-case letter or a
        /// character that is not hex makes it invalid.
        #[test]
        fn a_corrupted_character_is_refused(pos in 0usize..55, c in prop::sample::select(vec!['G', 'A', 'z', '-', ' ', '_'])) {
            let mut s: Vec<char> = GOOD.chars().collect();
            if s[pos] == c { return Ok(()); }
            s[pos] = c;
            let s: String = s.into_iter().collect();
            prop_assert!(TraceParent::parse(&s).is_err(), "{}", s);
        }
    }
}
