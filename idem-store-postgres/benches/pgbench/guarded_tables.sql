-- The bare design with the constraints idem's contract stands on, and nothing else: the
-- bare tables (bare_tables.sql) plus the identity's unique index (a changed resubmission is
-- a conflict, not a second claim), the event id's unique index (an event enqueued twice is
-- one event) and the outbox's ordered id (what a relay reads in order). No audit index, no
-- relay queue, no trigger, no subject lock. Written by the bare design's own scripts
-- (bare_message.sql, bare_batch100.sql), unchanged: the identity's timestamp is a default,
-- and the event id (64 hex characters, as wide as the twin's) is computed from the
-- payload's award id by a generated column, so the outbox insert is a plain one (a second
-- insert of an event id would be refused with an error where idem's ON CONFLICT ignores
-- it). Run with search_path set to an empty schema.
CREATE TABLE processed_messages (idempotency_key text PRIMARY KEY, award_id text,
  submission_timestamp text DEFAULT '2026-07-01T09:00:00Z', claimed_at timestamptz DEFAULT now(),
  UNIQUE (award_id, submission_timestamp));
CREATE TABLE disbursements (award_id text, amount_cents bigint, idempotency_key text);
CREATE TABLE outbox (id bigserial PRIMARY KEY, event_type text, payload jsonb,
  created_at timestamptz DEFAULT now(),
  event_id text UNIQUE GENERATED ALWAYS AS
    (encode(sha256(('e/' || (payload ->> 'award_id'))::bytea), 'hex')) STORED);
