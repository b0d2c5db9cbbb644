-- The bare design with the constraints idem's contract stands on, and nothing else: the
-- bare tables (bare_tables.sql) plus the identity's unique index (a changed resubmission is
-- a conflict, not a second claim), the event id's unique index (an event enqueued twice is
-- one event) and the outbox's ordered id (what a relay reads in order). No audit index, no
-- relay queue, no trigger, no subject lock. Written by guarded_message.sql and
-- guarded_batch100.sql; run with search_path set to an empty schema.
CREATE TABLE processed_messages (idempotency_key text PRIMARY KEY, award_id text,
  submission_timestamp text, claimed_at timestamptz DEFAULT now(),
  UNIQUE (award_id, submission_timestamp));
CREATE TABLE disbursements (award_id text, amount_cents bigint, idempotency_key text);
CREATE TABLE outbox (id bigserial PRIMARY KEY, event_id text UNIQUE, event_type text,
  payload jsonb, created_at timestamptz DEFAULT now());
