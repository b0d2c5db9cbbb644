-- bare_batch100.sql on guarded_tables.sql: the bare design's batch of 100 deliveries (the
-- same keys, award ids and redelivery mix: 80 new submissions, 20 of this client's previous
-- batch) in one statement, writing the identity and an event id of the same width as the
-- twin's (64 hex characters). Run with `-D prev=0` and search_path set to the guarded schema.
\set n random(1, 1000000000)
BEGIN;
WITH u AS (SELECT encode(sha256(convert_to(:n || '/' || g, 'UTF8')), 'hex') AS k, 'A-' || :n || '-' || g AS a
           FROM generate_series(1, 80) g
           UNION ALL
           SELECT encode(sha256(convert_to(:prev || '/' || g, 'UTF8')), 'hex'), 'A-' || :prev || '-' || g
           FROM generate_series(1, 20) g),
  ins AS (INSERT INTO processed_messages (idempotency_key, award_id, submission_timestamp, claimed_at)
    SELECT k, a, '2026-07-01T09:00:00Z', now() FROM u ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING idempotency_key, award_id),
  d AS (INSERT INTO disbursements (award_id, amount_cents, idempotency_key)
    SELECT award_id, 125000, idempotency_key FROM ins RETURNING award_id)
INSERT INTO outbox (event_id, event_type, payload, created_at)
  SELECT encode(sha256(convert_to('e/' || award_id, 'UTF8')), 'hex'), 'disbursement.recorded',
         ('{"award_id":"' || award_id || '"}')::jsonb, now() FROM d
  ON CONFLICT (event_id) DO NOTHING;
COMMIT;
\set prev :n
