-- The relay's queue (PgStore::migrate; every layout). Idempotent. `{schema}` is replaced
-- by the validated, quoted schema name before execution.
--
-- `outbox_pending` holds one small row (id, subject) per outbox event still to publish.
-- The relay leases from it (`ORDER BY id ... FOR UPDATE SKIP LOCKED`), checks a subject's
-- earlier events in it, and on a confirmed publish deletes the rows and sets
-- `outbox.published_at` in the same transaction. Why a queue beside the outbox rather than
-- partial indexes on `published_at`: an index that names `published_at` (as a key or in
-- its predicate) makes every mark a non-HOT update, a new row version plus an entry in
-- each of the outbox's indexes (two of them 64-character keys). With no index naming
-- `published_at` and room left on each page (fillfactor 50),
-- the mark is a HOT update, and the queue rows are only deleted: the database's work per
-- relayed event about halves (docs/scale.md, "The relay").
--
-- Every writer fills the queue without knowing of it: a statement-level trigger on the
-- outbox inserts the queue rows of the rows the statement inserted (those with an event id,
-- not published, not moved aside), in the writer's transaction, so that another program
-- writing idem's columns never writes an event that no relay would see. The trigger
-- function runs as its owner (SECURITY DEFINER): consumers need no privilege on the queue.
--
-- The first run creates the trigger and sets the outbox's fillfactor for new pages; later
-- runs find the trigger and change nothing.

CREATE TABLE IF NOT EXISTS {schema}.outbox_pending (
    id      bigint PRIMARY KEY,
    subject text COLLATE "C"
);
-- A subject's earlier unpublished events (the relay's order check).
CREATE INDEX IF NOT EXISTS outbox_pending_subject_idx
    ON {schema}.outbox_pending (subject, id);

CREATE OR REPLACE FUNCTION {schema}.idem_outbox_pending() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
    INSERT INTO {schema}.outbox_pending (id, subject)
    SELECT id, subject FROM idem_new_outbox_rows
    WHERE event_id IS NOT NULL AND published_at IS NULL AND failed_at IS NULL;
    RETURN NULL;
END
$fn$;

DO $trigger$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgrelid = '{schema}.outbox'::regclass
                     AND tgname = 'idem_outbox_pending') THEN
        CREATE TRIGGER idem_outbox_pending AFTER INSERT ON {schema}.outbox
            REFERENCING NEW TABLE AS idem_new_outbox_rows
            FOR EACH STATEMENT EXECUTE FUNCTION {schema}.idem_outbox_pending();
        ALTER TABLE {schema}.outbox SET (fillfactor = 50);
    END IF;
END
$trigger$;

-- Retention finds old published rows by age: BRIN, a few pages for years of rows, and
-- cheap to keep up on insert (created_at follows the insert order).
CREATE INDEX IF NOT EXISTS outbox_created_at_brin
    ON {schema}.outbox USING brin (created_at);
-- The events moved aside (`idem inspect`, the relay's metrics): few rows. It names
-- failed_at, not published_at, so a mark stays a HOT update.
CREATE INDEX IF NOT EXISTS outbox_moved_aside_idx
    ON {schema}.outbox (id) WHERE failed_at IS NOT NULL;
