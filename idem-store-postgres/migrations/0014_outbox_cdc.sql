-- The outbox read by change data capture (PgStore::migrate with OutboxMode::ChangeDataCapture;
-- every layout). Idempotent. `{schema}` is replaced by the validated, quoted schema name
-- before execution.
--
-- The table's one row records that a change-data-capture connector (Debezium's outbox
-- event router, or any reader of the write-ahead log) publishes this schema's outbox, in
-- commit order, from its inserts. Every store connected to the schema reads it at connect
-- and then writes events with `published_at` set to their transaction's time, queues none
-- for the relay (the trigger of 0010_outbox_pending.sql finds nothing to queue) and takes
-- no subject lock: the log's commit order is the order a subject's events are read in. The
-- relay refuses the schema. migrate writes the row only while the relay's queue is empty
-- (checked in the same transaction, the queue locked against writers), and nothing
-- removes it: an event written for the connector is never the relay's.
CREATE TABLE IF NOT EXISTS {schema}.idem_outbox_cdc (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    since     timestamptz NOT NULL DEFAULT now()
);
LOCK TABLE {schema}.outbox_pending IN SHARE MODE;
DO $cdc$
DECLARE
    queued bigint;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM {schema}.idem_outbox_cdc) THEN
        SELECT count(*) INTO queued FROM {schema}.outbox_pending;
        IF queued > 0 THEN
            RAISE EXCEPTION USING
                ERRCODE = 'object_not_in_prerequisite_state',
                MESSAGE = format('%s events are still queued for the relay: run `idem relay` until its queue is empty, then switch the outbox to change data capture', queued);
        END IF;
        INSERT INTO {schema}.idem_outbox_cdc DEFAULT VALUES;
    END IF;
END
$cdc$;
