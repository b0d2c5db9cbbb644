-- pgbench twin of one batch of 100 in `idem demo --batch-size 100` on the default layout:
-- the statements idem-store-postgres and idem-grant send (src/store.rs: `begin`,
-- `claim_batch_identity`; idem-grant's `record_batch`; src/outbox.rs: `enqueue_many_traced`,
-- the quiet form), on a schema `idem migrate` made. The arrays idem binds as parameters are
-- built here by the server (100 SHA-256s, which idem computes on its side). Run by
-- scripts/bench-postgres with search_path set to that schema.
\set n random(1, 1000000000)
BEGIN;
SET LOCAL lock_timeout = '5000ms';
INSERT INTO processed_messages (idempotency_key, award_id, claimed_at, submission_timestamp)
  SELECT k, a, now(), ts FROM unnest(
    (SELECT array_agg(encode(sha256(convert_to(:n || '/' || g, 'UTF8')), 'hex') ORDER BY g) FROM generate_series(1, 100) g),
    (SELECT array_agg('A-' || :n || '-' || g ORDER BY g) FROM generate_series(1, 100) g),
    (SELECT array_agg('2026-07-01T09:00:00Z'::text) FROM generate_series(1, 100) g))
  WITH ORDINALITY AS u(k, a, ts, n) ORDER BY n
  ON CONFLICT DO NOTHING RETURNING idempotency_key;
INSERT INTO disbursements (award_id, amount_cents, idempotency_key)
  SELECT * FROM unnest(
    (SELECT array_agg('A-' || :n || '-' || g ORDER BY g) FROM generate_series(1, 100) g),
    (SELECT array_agg(125000::int8 + g) FROM generate_series(1, 100) g),
    (SELECT array_agg(encode(sha256(convert_to(:n || '/' || g, 'UTF8')), 'hex') ORDER BY g) FROM generate_series(1, 100) g));
WITH l AS (SELECT pg_advisory_xact_lock(1768187245, h) FROM
    (SELECT DISTINCT hashtext(x) AS h FROM unnest(
      (SELECT array_agg('A-' || :n || '-' || g ORDER BY g) FROM generate_series(1, 100) g)) AS x ORDER BY 1) q),
  ins AS (INSERT INTO outbox (event_id, event_type, subject, idempotency_key, payload, created_at, traceparent)
    SELECT e, t, s, k, p::jsonb, now(), tp FROM unnest(
      (SELECT array_agg(encode(sha256(convert_to('e/' || :n || '/' || g, 'UTF8')), 'hex') ORDER BY g) FROM generate_series(1, 100) g),
      (SELECT array_agg('disbursement.recorded'::text) FROM generate_series(1, 100) g),
      (SELECT array_agg('A-' || :n || '-' || g ORDER BY g) FROM generate_series(1, 100) g),
      (SELECT array_agg(encode(sha256(convert_to(:n || '/' || g, 'UTF8')), 'hex') ORDER BY g) FROM generate_series(1, 100) g),
      (SELECT array_agg('{"award_id":"A-' || :n || '-' || g || '"}' ORDER BY g) FROM generate_series(1, 100) g),
      (SELECT array_agg(NULL::text) FROM generate_series(1, 100) g))
    WITH ORDINALITY AS u(e, t, s, k, p, tp, n)
    WHERE (SELECT count(*) FROM l) >= 0 ORDER BY n
    ON CONFLICT (event_id) DO NOTHING RETURNING 1)
SELECT 1 FROM ins LIMIT 1;
COMMIT;
