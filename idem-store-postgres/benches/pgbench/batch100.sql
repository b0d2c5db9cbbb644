-- pgbench twin of one batch of 100 deliveries in `idem demo --batch-size 100
-- --redeliveries 0.25` on the default layout: 80 new submissions and 20 redeliveries
-- (this client's previous batch's, already committed: the demo's 25 % more deliveries
-- than submissions), and the statements idem-store-postgres and idem-grant send for them
-- (src/store/: `begin`, the classifying `claim_batch_identity`; idem-grant's
-- `record_batch` through src/outbox.rs's `insert_and_enqueue`: the 80 disbursements and
-- their outbox events, the quiet form, in one statement), on a schema `idem migrate`
-- made. scripts/bench-postgres counts 80 submissions per transaction and runs it with
-- `-D prev=0` (the first batch's "redeliveries" are then new keys, once per client).
-- The arrays idem binds as parameters are built here by the server (the SHA-256s idem
-- computes on its side). idem sends `BEGIN; SET LOCAL …` as one simple query; pgbench
-- cannot combine them in prepared mode, so the twin spends one round trip more there.
-- Run with search_path set to that schema.
\set n random(1, 1000000000)
BEGIN;
SET LOCAL lock_timeout = '5000ms';
WITH u AS (SELECT * FROM unnest(
    ((SELECT array_agg(encode(sha256(convert_to(:n || '/' || g, 'UTF8')), 'hex') ORDER BY g) FROM generate_series(1, 80) g) || (SELECT array_agg(encode(sha256(convert_to(:prev || '/' || g, 'UTF8')), 'hex') ORDER BY g) FROM generate_series(1, 20) g)),
    ((SELECT array_agg('A-' || :n || '-' || g ORDER BY g) FROM generate_series(1, 80) g) || (SELECT array_agg('A-' || :prev || '-' || g ORDER BY g) FROM generate_series(1, 20) g)),
    (SELECT array_agg('2026-07-01T09:00:00Z'::text) FROM generate_series(1, 100) g))
  WITH ORDINALITY AS t(k, a, ts, n)),
  ins AS (INSERT INTO processed_messages (idempotency_key, award_id, claimed_at, submission_timestamp)
    SELECT k, a, now(), ts FROM u ORDER BY n
    ON CONFLICT DO NOTHING RETURNING idempotency_key)
SELECT u.k, i.idempotency_key IS NOT NULL, d.found IS NOT NULL
  FROM u LEFT JOIN ins i ON i.idempotency_key = u.k
  LEFT JOIN LATERAL (SELECT true AS found FROM processed_messages p
    WHERE i.idempotency_key IS NULL AND p.idempotency_key = u.k
    LIMIT 1) d ON true
  ORDER BY u.n;
WITH idem_rows AS (INSERT INTO disbursements (award_id, amount_cents, idempotency_key)
    SELECT * FROM unnest(
      (SELECT array_agg('A-' || :n || '-' || g ORDER BY g) FROM generate_series(1, 80) g),
      (SELECT array_agg(125000::int8 + g) FROM generate_series(1, 80) g),
      (SELECT array_agg(encode(sha256(convert_to(:n || '/' || g, 'UTF8')), 'hex') ORDER BY g) FROM generate_series(1, 80) g))),
  l AS (SELECT pg_advisory_xact_lock(1768187245, h) FROM
    (SELECT DISTINCT hashtext(x) AS h FROM unnest(
      (SELECT array_agg('A-' || :n || '-' || g ORDER BY g) FROM generate_series(1, 80) g)) AS x ORDER BY 1) q),
  ins AS (INSERT INTO outbox (event_id, event_type, subject, idempotency_key, payload, created_at, traceparent)
    SELECT e, t, s, k, p::jsonb, now(), tp FROM unnest(
      (SELECT array_agg(encode(sha256(convert_to('e/' || :n || '/' || g, 'UTF8')), 'hex') ORDER BY g) FROM generate_series(1, 80) g),
      (SELECT array_agg('disbursement.recorded'::text) FROM generate_series(1, 80) g),
      (SELECT array_agg('A-' || :n || '-' || g ORDER BY g) FROM generate_series(1, 80) g),
      (SELECT array_agg(encode(sha256(convert_to(:n || '/' || g, 'UTF8')), 'hex') ORDER BY g) FROM generate_series(1, 80) g),
      (SELECT array_agg('{"award_id":"A-' || :n || '-' || g || '"}' ORDER BY g) FROM generate_series(1, 80) g),
      (SELECT array_agg(NULL::text) FROM generate_series(1, 80) g))
    WITH ORDINALITY AS u(e, t, s, k, p, tp, n)
    WHERE (SELECT count(*) FROM l) >= 0 ORDER BY n
    ON CONFLICT (event_id) DO NOTHING RETURNING 1)
SELECT 1 FROM ins LIMIT 1;
COMMIT;
\set prev :n
