//! Idempotency keys: a pure function of a submission's identity and its payload.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest, Sha256};

use crate::error::KeyError;

/// The separator of the seed-compatible derivation. An identity part that contains it
/// would let two different identities produce the same preimage, so it is refused.
pub const SEPARATOR: char = '|';

/// A 32-byte idempotency key.
///
/// It is a pure function of the submission's *identity* (business id and submission
/// timestamp) and the SHA-256 of its raw payload — never of a broker message id or a
/// delivery time — so every redelivery of one submission derives the same key.
///
/// [`Display`](fmt::Display) prints 64 lowercase hex characters (the form stored in
/// `processed_messages.idempotency_key`); [`IdempotencyKey::short`] is the 12-character
/// prefix used in logs and audit events.
///
/// ```
/// use idem_core::IdempotencyKey;
///
/// let key = IdempotencyKey::derive("A-2026-014", "2026-07-01T09:00:00Z", b"{...}")?;
/// assert_eq!(
///     key.to_string(),
///     "d3ed6c4d8acb11aa58dcdb03e400559b1e415626580e4a00466ae631bea74acd"
/// );
/// assert_eq!(key.short(), "d3ed6c4d8acb");
/// // The hex form parses back to the same key.
/// assert_eq!(key.to_string().parse::<IdempotencyKey>()?, key);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey([u8; 32]);

impl IdempotencyKey {
    /// The seed-compatible derivation:
    /// `sha256_hex(format!("{subject_id}|{submission_timestamp}|{sha256_hex(payload)}"))`.
    ///
    /// It matches the reference implementation byte for byte, so consumers written in
    /// other languages and this one can share one dedup table.
    ///
    /// # Errors
    /// [`KeyError::EmptySubject`] or [`KeyError::EmptyTimestamp`] for an empty part, and
    /// [`KeyError::SeparatorInSubject`] for a subject id that contains `|`. A timestamp may
    /// contain `|`: the subject ends at the first separator and the payload hash has a
    /// fixed length, so the preimage stays unambiguous.
    pub fn derive(
        subject_id: &str,
        submission_timestamp: &str,
        payload: &[u8],
    ) -> Result<Self, KeyError> {
        if subject_id.is_empty() {
            return Err(KeyError::EmptySubject);
        }
        if submission_timestamp.is_empty() {
            return Err(KeyError::EmptyTimestamp);
        }
        if subject_id.contains(SEPARATOR) {
            return Err(KeyError::SeparatorInSubject);
        }
        let payload_hex = hex_array(&Sha256::digest(payload).into());
        let mut outer = Sha256::new();
        outer.update(subject_id.as_bytes());
        outer.update([b'|']);
        outer.update(submission_timestamp.as_bytes());
        outer.update([b'|']);
        outer.update(payload_hex);
        Ok(Self(outer.finalize().into()))
    }

    /// Wraps 32 raw bytes (for keys read back from a store).
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The raw 32 bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The 64-character lowercase hex form (the same as `to_string()`).
    pub fn to_hex(&self) -> String {
        hex_lower(&self.0)
    }

    /// The first 12 hex characters: enough to find a key, short enough for a log line.
    pub fn short(&self) -> String {
        hex_lower(&self.0)[..12].to_owned()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex_lower(&self.0))
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({})", self.short())
    }
}

impl FromStr for IdempotencyKey {
    type Err = KeyError;

    /// Parses 64 hex characters (either case).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_hex32(s).map(Self).ok_or(KeyError::InvalidHex)
    }
}

/// Lowercase hex of 32 bytes.
pub(crate) fn hex_lower(bytes: &[u8; 32]) -> String {
    let hex = hex_array(bytes);
    // Only ASCII hex digits: always UTF-8.
    String::from_utf8_lossy(&hex).into_owned()
}

/// Lowercase hex of 32 bytes, on the stack (the key derivation allocates nothing).
pub(crate) fn hex_array(bytes: &[u8; 32]) -> [u8; 64] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 64];
    for (pair, b) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0x0f)];
    }
    out
}

/// Parses exactly 64 hex characters into 32 bytes.
pub(crate) fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    let s = s.as_bytes();
    if s.len() != 64 {
        return None;
    }
    let nibble = |c: u8| -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    };
    let mut out = [0u8; 32];
    for (i, pair) in s.chunks_exact(2).enumerate() {
        out[i] = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
}

/// Lowercase hex SHA-256 of `bytes` (the inner hash of the seed derivation).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex_lower(&Sha256::digest(bytes).into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn refuses_bad_identities() {
        assert_eq!(
            IdempotencyKey::derive("", "t", b"x"),
            Err(KeyError::EmptySubject)
        );
        assert_eq!(
            IdempotencyKey::derive("a", "", b"x"),
            Err(KeyError::EmptyTimestamp)
        );
        assert_eq!(
            IdempotencyKey::derive("a|b", "t", b"x"),
            Err(KeyError::SeparatorInSubject)
        );
        assert!(IdempotencyKey::derive("a", "t|1", b"x").is_ok());
    }

    #[test]
    fn hex_parsing_rejects_garbage() {
        assert!("zz".parse::<IdempotencyKey>().is_err());
        assert!("g".repeat(64).parse::<IdempotencyKey>().is_err());
        let k = IdempotencyKey::derive("a", "t", b"").unwrap();
        assert_eq!(
            k.to_hex().to_uppercase().parse::<IdempotencyKey>().unwrap(),
            k
        );
    }

    fn ident() -> impl Strategy<Value = String> {
        "[^|]{1,24}"
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn deterministic(a in ident(), t in ident(), p in proptest::collection::vec(any::<u8>(), 0..256)) {
            prop_assert_eq!(IdempotencyKey::derive(&a, &t, &p), IdempotencyKey::derive(&a, &t, &p));
        }

        #[test]
        fn any_payload_byte_changes_the_key(
            a in ident(), t in ident(),
            p in proptest::collection::vec(any::<u8>(), 1..256),
            idx in any::<proptest::sample::Index>(),
            flip in 1u8..=255,
        ) {
            let mut q = p.clone();
            let i = idx.index(q.len());
            q[i] ^= flip;
            prop_assert_ne!(IdempotencyKey::derive(&a, &t, &p).unwrap(), IdempotencyKey::derive(&a, &t, &q).unwrap());
        }

        #[test]
        fn subject_and_timestamp_change_the_key(a in ident(), b in ident(), t in ident(), u in ident(), p in proptest::collection::vec(any::<u8>(), 0..64)) {
            let k = IdempotencyKey::derive(&a, &t, &p).unwrap();
            if a != b {
                prop_assert_ne!(k, IdempotencyKey::derive(&b, &t, &p).unwrap());
            }
            if t != u {
                prop_assert_ne!(k, IdempotencyKey::derive(&a, &u, &p).unwrap());
            }
        }

        #[test]
        fn hex_round_trips(bytes in any::<[u8; 32]>()) {
            let k = IdempotencyKey::from_bytes(bytes);
            prop_assert_eq!(k.to_string().parse::<IdempotencyKey>().unwrap(), k);
            prop_assert_eq!(k.short().len(), 12);
        }
    }
}
