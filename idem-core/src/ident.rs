//! Names from configuration (schemas, tables) that go into SQL: checked in one place.
//!
//! Every SQL store takes schema and table names from configuration and must put them into
//! statements as identifiers (they cannot be bound as parameters). [`Ident`] accepts only
//! plain identifiers — `[A-Za-z_][A-Za-z0-9_]{0,62}`, which every SQL database reads the
//! same way quoted or not — and quotes them, so a name can never break out of its place.
//! The statements they go into are assembled with [`mod@crate::sql`].

use std::fmt;

/// A validated plain SQL identifier.
///
/// ```
/// use idem_core::ident::Ident;
/// let schema = Ident::new("grants")?;
/// assert_eq!(schema.quoted(), "\"grants\"");
/// assert!(Ident::new("grants; DROP TABLE x").is_err());
/// assert!(Ident::new("1st").is_err());
/// assert!(Ident::new(&"a".repeat(64)).is_err());
/// # Ok::<(), idem_core::ident::InvalidIdent>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Ident(String);

/// A name that is not a plain SQL identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid name {name:?}: use letters, digits and _ (at most 63, not starting with a digit)")]
pub struct InvalidIdent {
    /// The name (its first 80 characters).
    pub name: String,
}

/// Whether `name` is a plain SQL identifier: `[A-Za-z_][A-Za-z0-9_]{0,62}`.
pub fn is_identifier(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && (bytes[0].is_ascii_alphabetic() || bytes[0] == b'_')
        && bytes[1..]
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'_')
}

impl Ident {
    /// Validates `name`.
    ///
    /// # Errors
    /// [`InvalidIdent`] unless [`is_identifier`].
    pub fn new(name: &str) -> Result<Self, InvalidIdent> {
        if is_identifier(name) {
            Ok(Self(name.to_owned()))
        } else {
            Err(InvalidIdent {
                name: name.chars().take(80).collect(),
            })
        }
    }

    /// A name written in the program (a table of the store, a column).
    ///
    /// # Panics
    /// When `name` is not a plain identifier: a bug in the program, not bad input.
    ///
    /// ```
    /// let t = idem_core::ident::Ident::from_static("processed_messages");
    /// assert_eq!(t.as_str(), "processed_messages");
    /// ```
    pub fn from_static(name: &'static str) -> Self {
        match Self::new(name) {
            Ok(ident) => ident,
            Err(e) => panic!("{e}"),
        }
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name in double quotes, for SQL.
    pub fn quoted(&self) -> String {
        // A valid identifier holds no quote; nothing to escape.
        format!("\"{}\"", self.0)
    }
}

impl AsRef<str> for Ident {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_identifiers_only() {
        for ok in ["a", "_", "grants", "Grants_2026", &"x".repeat(63)] {
            assert!(is_identifier(ok), "{ok}");
        }
        for bad in [
            "",
            "1a",
            "a-b",
            "a b",
            "a\"b",
            "a;b",
            "é",
            &"x".repeat(64),
            "a.b",
        ] {
            assert!(!is_identifier(bad), "{bad}");
            assert!(Ident::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    #[should_panic(expected = "invalid name")]
    fn from_static_refuses_a_bad_constant() {
        let _ = Ident::from_static("a-b");
    }
}
