//! The one place this crate hands sqlx SQL text that is not a string literal.
//!
//! Statements that name the schema (or repeat placeholders per item) are
//! [`SqlText`]: program text, validated identifiers
//! ([`Ident`](idem_core::ident::Ident)) and integers, nothing else
//! ([`mod@idem_core::sql`]). [`statement`] turns one into the query string sqlx takes; it is
//! the crate's only use of [`sqlx::AssertSqlSafe`]. A handler writing its business rows
//! can use it the same way:
//!
//! ```no_run
//! # async fn demo(tx: &mut idem_store_postgres::PgTx) -> Result<(), Box<dyn std::error::Error>> {
//! use idem_core::{ident::Ident, sql};
//! use idem_store_postgres::sql::statement;
//!
//! let table = Ident::new("disbursements")?;
//! let insert = sql!(
//!     "INSERT INTO {schema}.{table} (award_id) VALUES ($1)",
//!     schema = tx.schema_ident(),
//!     table
//! );
//! sqlx::query(statement(insert))
//!     .bind("A-2026-014")
//!     .execute(tx.conn())
//!     .await?;
//! # Ok(()) }
//! ```

use std::sync::Arc;

use idem_core::sql::SqlText;
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

/// `text` as sqlx's query string. Safe by construction: an [`SqlText`] holds only
/// program text, quoted validated identifiers and integers. The string is shared, so a
/// statement kept for reuse is cheap to clone.
pub fn statement(text: SqlText) -> SqlStr {
    AssertSqlSafe(Arc::<str>::from(text.into_string())).into_sql_str()
}
