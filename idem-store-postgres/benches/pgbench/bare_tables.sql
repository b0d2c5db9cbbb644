-- The bare design's tables (the reference design's: a primary key on the claims, no other
-- index, no trigger), written by bare_message.sql and bare_batch100.sql. Run with
-- search_path set to an empty schema.
CREATE TABLE processed_messages (idempotency_key text PRIMARY KEY, award_id text, claimed_at timestamptz DEFAULT now());
CREATE TABLE disbursements (award_id text, amount_cents bigint, idempotency_key text);
CREATE TABLE outbox (event_type text, payload jsonb, created_at timestamptz DEFAULT now());
