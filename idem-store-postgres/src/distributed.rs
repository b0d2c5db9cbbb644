//! The distributed layout ([`PgLayout::Distributed`](crate::PgLayout::Distributed)): the
//! tables keyed so that Citus can distribute them by the award id, colocated
//! (`migrations/0009_distributed.sql`; docs/scale.md, "Past one machine: Citus").
//!
//! - `processed_messages` has the primary key `(award_id, idempotency_key)`, `award_id NOT
//!   NULL`; the claim's target is `ON CONFLICT (award_id, idempotency_key)` (with the
//!   identity column of `migrations/0006_claim_identity.sql`, any unique index, as on the
//!   other layouts: the identity's index `(award_id, submission_timestamp)` holds the
//!   award id too).
//! - `disbursements` (the grant pipeline's table) has the primary key `(award_id,
//!   idempotency_key)`.
//! - `outbox` has the primary key `(subject, id)` and the unique `(subject, event_id)`; the
//!   enqueue's target is `ON CONFLICT (subject, event_id)`.
//!
//! Every unique index of the four tables (the three and the relay's queue) holds its [distribution
//! column](DISTRIBUTED_TABLES), which is what Citus requires of a distributed table.
//! Dedup stays exact because the award id is the first field of the key's preimage
//! (`sha256(award_id|timestamp|sha256(payload))`): one key has one award id, so every
//! claim of it meets the earlier one in the same unique index — on Citus, on the same
//! shard.
//!
//! On plain Postgres the layout is complete as it is, and that is how this crate tests it.
//! When the `citus` extension is installed, [`PgStore::migrate`] then distributes the four
//! tables, colocated (`migrations/0009_distributed_citus.sql`, in a transaction of its
//! own); without it, it logs at info level (target `idem::migrate`) that it skipped that
//! step. **The Citus step is untested**: no Citus installation was available where these
//! tests run.

use idem_core::sql::SqlText;
use idem_core::StoreError;

use crate::error::map_sqlx;
use crate::store::PgStore;

/// The tables of the distributed layout and their distribution columns, in the order the
/// Citus step distributes them (the first is the one the others are colocated with).
pub const DISTRIBUTED_TABLES: [(&str, &str); 4] = [
    ("processed_messages", "award_id"),
    ("disbursements", "award_id"),
    ("outbox", "subject"),
    ("outbox_pending", "subject"),
];

/// The Citus step: `create_distributed_table` for each of [`DISTRIBUTED_TABLES`].
const CITUS: &str = include_str!("../migrations/0009_distributed_citus.sql");

impl PgStore {
    /// Whether the database has the `citus` extension (`SELECT 1 FROM pg_extension WHERE
    /// extname = 'citus'`).
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    pub async fn citus_installed(&self) -> Result<bool, StoreError> {
        let found: Option<i32> =
            sqlx::query_scalar("SELECT 1 FROM pg_extension WHERE extname = 'citus'")
                .fetch_optional(self.pool())
                .await
                .map_err(|e| map_sqlx(e, "look for the citus extension"))?;
        Ok(found.is_some())
    }

    /// The distributed layout's last migration step: with Citus, distribute the tables;
    /// without it, say that this was skipped. Returns whether the tables were distributed.
    pub(crate) async fn distribute_tables(&self) -> Result<bool, StoreError> {
        if !self.citus_installed().await? {
            tracing::info!(
                target: "idem::migrate",
                schema = self.schema(),
                "the citus extension is not installed: the distributed layout's tables stay \
                 local (plain Postgres); create_distributed_table skipped"
            );
            return Ok(false);
        }
        // Untested (no Citus where the tests run): docs/scale.md.
        // Rendered before the await: the parts' slice is not Send.
        let script = SqlText::render(CITUS, &[("schema", self.schema_ident())]);
        self.run_script(script).await?;
        tracing::info!(
            target: "idem::migrate",
            schema = self.schema(),
            "citus: processed_messages, disbursements and outbox distributed by award id, colocated"
        );
        Ok(true)
    }
}
