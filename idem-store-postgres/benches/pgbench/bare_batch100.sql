-- The bare design's batch of 100 deliveries, made comparable with batch100.sql (the twin
-- of idem's): the same keys (64 hex characters of a SHA-256), award ids and redelivery
-- mix (80 new submissions and 20 of this client's previous batch), on the bare tables of
-- scripts/bench-postgres (a primary key on the claims, no other index, no trigger). The
-- claims in one statement; the disbursements and outbox rows of what it inserted in the
-- same statement. Run with `-D prev=0` and search_path set to the bare schema.
\set n random(1, 1000000000)
BEGIN;
WITH u AS (SELECT encode(sha256(convert_to(:n || '/' || g, 'UTF8')), 'hex') AS k, 'A-' || :n || '-' || g AS a
           FROM generate_series(1, 80) g
           UNION ALL
           SELECT encode(sha256(convert_to(:prev || '/' || g, 'UTF8')), 'hex'), 'A-' || :prev || '-' || g
           FROM generate_series(1, 20) g),
  ins AS (INSERT INTO processed_messages (idempotency_key, award_id, claimed_at)
    SELECT k, a, now() FROM u ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING idempotency_key, award_id),
  d AS (INSERT INTO disbursements (award_id, amount_cents, idempotency_key)
    SELECT award_id, 125000, idempotency_key FROM ins RETURNING award_id)
INSERT INTO outbox (event_type, payload, created_at)
  SELECT 'disbursement.recorded', ('{"award_id":"' || award_id || '"}')::jsonb, now() FROM d;
COMMIT;
\set prev :n
