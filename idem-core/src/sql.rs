//! SQL text made of nothing but program text, validated identifiers and integers.
//!
//! The SQL stores put schema and table names into their statements (a name cannot be a
//! bind parameter), and some statements repeat a row of placeholders per item. That text
//! is not a string literal, so the driver cannot tell it from text built out of input.
//! [`SqlText`] is how it is assembled instead: its only ingredients are
//!
//! - `&'static str` — text written in the program (a literal, a constant, an
//!   `include_str!` file);
//! - [`Ident`] — a name checked by [`Ident::new`], always written quoted;
//! - integers;
//! - other [`SqlText`].
//!
//! A `String` or a borrowed `&str` is not an ingredient ([`SqlPart`] is sealed), so input
//! cannot reach the text: data goes in bind parameters. Each store hands finished text to
//! its driver in one place (in the sqlx stores, the one use of `sqlx::AssertSqlSafe`).
//!
//! ```
//! use idem_core::ident::Ident;
//! use idem_core::sql;
//!
//! let schema = Ident::new("grants")?;
//! let stmt = sql!("SELECT count(*) FROM {schema}.\"outbox\" WHERE id > $1", schema);
//! assert_eq!(stmt.as_str(), "SELECT count(*) FROM \"grants\".\"outbox\" WHERE id > $1");
//!
//! let mut rows = sql::SqlText::from_static("INSERT INTO t (a) VALUES ");
//! for i in 1..=3_u32 {
//!     rows.push(if i > 1 { ", " } else { "" }).push("($").push(i).push(")");
//! }
//! assert_eq!(rows.as_str(), "INSERT INTO t (a) VALUES ($1), ($2), ($3)");
//! # Ok::<(), idem_core::ident::InvalidIdent>(())
//! ```
//!
//! Text from elsewhere does not compile, whether passed as an argument:
//!
//! ```compile_fail
//! let input = String::from("x; DROP TABLE t");
//! let _ = idem_core::sql!("SELECT * FROM {t}", t = input);
//! ```
//!
//! or borrowed:
//!
//! ```compile_fail
//! fn text(input: &str) -> idem_core::sql::SqlText {
//!     idem_core::sql!("SELECT * FROM {t}", t = input)
//! }
//! ```
//!
//! or captured from the surroundings by name, as `format!` would:
//!
//! ```compile_fail
//! let t = String::from("x; DROP TABLE t");
//! let _ = idem_core::sql!("SELECT * FROM {t}");
//! ```

use std::fmt;

use crate::ident::Ident;

/// SQL text assembled only from [`SqlPart`]s: program text, [`Ident`]s, integers.
///
/// Built with [`sql!`](crate::sql!) (a `format!`-like template whose arguments are
/// parts), [`SqlText::render`] (named placeholders in a program-text template, such as an
/// `include_str!` migration) or [`SqlText::push`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct SqlText(String);

impl SqlText {
    /// Empty text.
    pub const fn new() -> Self {
        Self(String::new())
    }

    /// `text`, which is program text.
    pub fn from_static(text: &'static str) -> Self {
        Self(text.to_owned())
    }

    /// Appends `part`.
    pub fn push(&mut self, part: impl SqlPart) -> &mut Self {
        part.write_sql(&mut self.0);
        self
    }

    /// `template` with every `{name}` of `parts` replaced by its part; other text,
    /// braces included, is kept as it is.
    ///
    /// ```
    /// use idem_core::{ident::Ident, sql::SqlText};
    /// let schema = Ident::new("grants")?;
    /// let ddl = SqlText::render(
    ///     "CREATE TABLE IF NOT EXISTS {schema}.t (k text{extra})",
    ///     &[("schema", &schema), ("extra", &", m date")],
    /// );
    /// assert_eq!(ddl.as_str(), "CREATE TABLE IF NOT EXISTS \"grants\".t (k text, m date)");
    /// # Ok::<(), idem_core::ident::InvalidIdent>(())
    /// ```
    pub fn render(template: &'static str, parts: &[(&str, &dyn SqlPart)]) -> Self {
        let mut out = String::with_capacity(template.len());
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            out.push_str(&rest[..open]);
            let tail = &rest[open..];
            let part = tail.find('}').and_then(|close| {
                let name = &tail[1..close];
                parts
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, p)| (close, *p))
            });
            match part {
                Some((close, p)) => {
                    p.write_sql(&mut out);
                    rest = &tail[close + 1..];
                }
                None => {
                    out.push('{');
                    rest = &tail[1..];
                }
            }
        }
        out.push_str(rest);
        Self(out)
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The text, for the store's one hand-over to its driver.
    pub fn into_string(self) -> String {
        self.0
    }

    /// Not API: the output of [`sql!`](crate::sql!), whose arguments are all parts.
    #[doc(hidden)]
    pub fn __from_parts(text: String) -> Self {
        Self(text)
    }
}

impl fmt::Display for SqlText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&'static str> for SqlText {
    fn from(text: &'static str) -> Self {
        Self::from_static(text)
    }
}

mod private {
    pub trait Sealed {}
}

/// What may go into [`SqlText`]: program text (`&'static str`), an [`Ident`] (written
/// quoted), an integer, or other [`SqlText`]. Sealed: nothing else can be.
pub trait SqlPart: private::Sealed {
    /// Appends this part to `out`.
    fn write_sql(&self, out: &mut String);
}

impl private::Sealed for &'static str {}
impl SqlPart for &'static str {
    fn write_sql(&self, out: &mut String) {
        out.push_str(self);
    }
}

impl private::Sealed for Ident {}
impl SqlPart for Ident {
    fn write_sql(&self, out: &mut String) {
        out.push_str(&self.quoted());
    }
}

impl private::Sealed for SqlText {}
impl SqlPart for SqlText {
    fn write_sql(&self, out: &mut String) {
        out.push_str(&self.0);
    }
}

impl<T: SqlPart + ?Sized> private::Sealed for &T {}
impl<T: SqlPart + ?Sized> SqlPart for &T {
    fn write_sql(&self, out: &mut String) {
        (**self).write_sql(out);
    }
}

macro_rules! integer_parts {
    ($($t:ty),*) => {$(
        impl private::Sealed for $t {}
        impl SqlPart for $t {
            fn write_sql(&self, out: &mut String) {
                use std::fmt::Write as _;
                let _ = write!(out, "{self}");
            }
        }
    )*};
}
integer_parts!(i32, i64, u32, u64, u128, usize);

/// Not API: shows a part through `format!` for [`sql!`](crate::sql!).
#[doc(hidden)]
pub struct __Part<'a, T: SqlPart + ?Sized>(pub &'a T);

impl<T: SqlPart + ?Sized> fmt::Display for __Part<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = String::new();
        self.0.write_sql(&mut s);
        f.write_str(&s)
    }
}

/// [`SqlText`](crate::sql::SqlText) from a template literal and named
/// [`SqlPart`](crate::sql::SqlPart)s: `sql!("… {name} …", name = part, other)` (`other`
/// alone stands for `other = other`). The template is `format!`'s (`{{` for a brace);
/// every `{name}` needs an argument, every argument a `{name}`, and names are never
/// captured from the surroundings — checked at compile time, like the parts' types.
#[macro_export]
macro_rules! sql {
    ($template:literal $(, $name:ident $(= $value:expr)?)* $(,)?) => {
        $crate::sql::SqlText::__from_parts(::std::format!(
            ::core::concat!($template)
            $(, $name = $crate::sql::__Part(&$crate::__sql_part!($name $(= $value)?)))*
        ))
    };
}

/// Not API: the value of one [`sql!`](crate::sql!) argument.
#[doc(hidden)]
#[macro_export]
macro_rules! __sql_part {
    ($name:ident) => {
        $name
    };
    ($name:ident = $value:expr) => {
        $value
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_macro_quotes_names_and_keeps_program_text() {
        let schema = Ident::new("Grants_2026").unwrap();
        let tail: &'static str = " LIMIT 1";
        let n = 42_u64;
        let inner = sql!("SELECT {n}", n);
        let t = sql!(
            "{inner} FROM {schema}.\"t\" WHERE a = '{{}}'{tail}",
            inner,
            schema,
            tail
        );
        assert_eq!(
            t.as_str(),
            "SELECT 42 FROM \"Grants_2026\".\"t\" WHERE a = '{}' LIMIT 1"
        );
        assert_eq!(sql!("x").as_str(), "x");
    }

    #[test]
    fn render_replaces_only_the_named_placeholders() {
        let s = Ident::new("s").unwrap();
        let t = SqlText::render(
            "{schema}.a {schema}.b '{}' {other} {partition_key}{",
            &[("schema", &s), ("partition_key", &"")],
        );
        assert_eq!(t.as_str(), "\"s\".a \"s\".b '{}' {other} {");
    }

    #[test]
    fn push_appends_parts() {
        let mut t = SqlText::from_static("VALUES ");
        t.push("(").push(-1_i64).push(", ").push(7_usize).push(")");
        assert_eq!(t.to_string(), "VALUES (-1, 7)");
    }
}
