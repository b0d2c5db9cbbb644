-- pgbench twin of one delivery in `idem demo --redeliveries 0.25` (one delivery per
-- transaction) on the default layout, with the demo's share of redeliveries: every fifth
-- transaction of a client redelivers its previous message (25 % more deliveries than
-- submissions). A new submission: the statements idem-store-postgres and idem-grant send
-- (src/store/: `begin`, `claim_identity`; idem-grant's handler through src/outbox.rs's
-- `insert_and_enqueue`: the disbursement and its outbox event, the quiet form, in one
-- statement), then `COMMIT`. A redelivery: the claim inserts nothing and, in the same
-- statement, finds the key's row (a duplicate), `ROLLBACK`. On a schema `idem migrate` made;
-- scripts/bench-postgres counts 4 submissions per 5 transactions and runs it with
-- `-D prev=0 -D c=0`. The key and event id idem binds as parameters are computed here by
-- the server. idem sends `BEGIN; SET LOCAL …` as one simple query; pgbench cannot combine
-- them in prepared mode, so the twin spends one round trip more there. Run with
-- search_path set to that schema.
\set c :c + 1
\if :c % 5 = 0
\set k :prev
\else
\set n random(1, 1000000000)
\set k :n
\endif
BEGIN;
SET LOCAL lock_timeout = '5000ms';
WITH ins AS (INSERT INTO processed_messages (idempotency_key, award_id, claimed_at, submission_timestamp)
    VALUES (encode(sha256(convert_to(:k || '/1', 'UTF8')), 'hex'), 'A-' || :k || '-1', now(), '2026-07-01T09:00:00Z')
    ON CONFLICT DO NOTHING RETURNING 1)
SELECT EXISTS (SELECT 1 FROM ins),
  CASE WHEN NOT EXISTS (SELECT 1 FROM ins) THEN
  EXISTS (SELECT 1 FROM processed_messages p WHERE p.idempotency_key = encode(sha256(convert_to(:k || '/1', 'UTF8')), 'hex')) END;
\if :c % 5 = 0
ROLLBACK;
\else
WITH idem_rows AS (INSERT INTO disbursements (award_id, amount_cents, idempotency_key)
    SELECT * FROM unnest(ARRAY['A-' || :n || '-1'], ARRAY[125000::int8], ARRAY[encode(sha256(convert_to(:n || '/1', 'UTF8')), 'hex')])),
  l AS (SELECT pg_advisory_xact_lock(1768187245, h) FROM
    (SELECT DISTINCT hashtext(x) AS h FROM unnest(ARRAY['A-' || :n || '-1']) AS x ORDER BY 1) q),
  ins AS (INSERT INTO outbox (event_id, event_type, subject, idempotency_key, payload, created_at, traceparent)
    SELECT e, t, s, k, p::jsonb, now(), tp FROM unnest(
      ARRAY[encode(sha256(convert_to('e/' || :n || '/1', 'UTF8')), 'hex')],
      ARRAY['disbursement.recorded'::text],
      ARRAY['A-' || :n || '-1'],
      ARRAY[encode(sha256(convert_to(:n || '/1', 'UTF8')), 'hex')],
      ARRAY['{"award_id":"A-' || :n || '-1"}'],
      ARRAY[NULL::text])
    WITH ORDINALITY AS u(e, t, s, k, p, tp, n)
    WHERE (SELECT count(*) FROM l) >= 0 ORDER BY n
    ON CONFLICT (event_id) DO NOTHING RETURNING 1)
SELECT 1 FROM ins LIMIT 1;
COMMIT;
\set prev :n
\endif
