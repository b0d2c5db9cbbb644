-- The W3C trace context of each outbox event (PgStore::migrate; both layouts). Idempotent.
-- `{schema}` is replaced by the validated, quoted schema name before execution.
--
-- `traceparent` holds the `00-<trace id>-<parent id>-<flags>` value the relay publishes as
-- the event's `traceparent` header: the trace of the delivery that caused the event, with
-- that delivery's span as parent (idem_core::trace). NULL for an untraced delivery and for
-- every row written before this column existed.
--
-- Both layouts share one outbox (only processed_messages is partitioned), so the statement
-- is the same for both. Adding a nullable column without a default only changes the
-- catalogue: an outbox of any size made by another program (the reference design's) takes
-- it at once. A store connected before the column existed keeps writing rows without it
-- until it reconnects (PgStore::connect looks for the column).

ALTER TABLE {schema}.outbox ADD COLUMN IF NOT EXISTS traceparent text;
