-- The Citus step of the distributed layout (PgLayout::Distributed), run by PgStore::migrate
-- after 0009_distributed.sql and the other migrations have committed, in a transaction of
-- its own, and only when the citus extension is installed
-- (`SELECT 1 FROM pg_extension WHERE extname = 'citus'`); on plain Postgres it is skipped
-- and says so in an info-level log line. Idempotent: a table Citus already distributes is
-- left alone. `{schema}` is replaced by the validated, quoted schema name before execution.
--
-- UNTESTED: no Citus installation was available where this crate is tested (docs/scale.md).
--
-- processed_messages by award_id; disbursements by award_id and outbox by subject (the
-- award id), both colocated with it, so that the claim, the disbursement and the outbox row
-- of one message are on one shard and its transaction commits there, without two-phase
-- commit. idem_store_identity and idem_outcome_counts stay local tables of the coordinator.
DO $citus$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition
                   WHERE logicalrelid = '{schema}.processed_messages'::regclass) THEN
        PERFORM create_distributed_table('{schema}.processed_messages', 'award_id');
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition
                   WHERE logicalrelid = '{schema}.disbursements'::regclass) THEN
        PERFORM create_distributed_table('{schema}.disbursements', 'award_id',
                                         colocate_with => '{schema}.processed_messages');
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition
                   WHERE logicalrelid = '{schema}.outbox'::regclass) THEN
        PERFORM create_distributed_table('{schema}.outbox', 'subject',
                                         colocate_with => '{schema}.processed_messages');
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition
                   WHERE logicalrelid = '{schema}.outbox_pending'::regclass) THEN
        PERFORM create_distributed_table('{schema}.outbox_pending', 'subject',
                                         colocate_with => '{schema}.processed_messages');
    END IF;
END
$citus$;
