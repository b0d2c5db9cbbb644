-- pgbench twin of one message in `idem demo` (one delivery per transaction) on the default
-- layout: the statements idem-store-postgres and idem-grant send (src/store.rs: `begin`,
-- `claim_identity`; idem-grant's `record_disbursement`; src/outbox.rs: `enqueue_traced`,
-- the quiet form), on a schema `idem migrate` made. The key and event id idem binds as
-- parameters are computed here by the server. Run by scripts/bench-postgres with
-- search_path set to that schema.
\set n random(1, 1000000000)
BEGIN;
SET LOCAL lock_timeout = '5000ms';
INSERT INTO processed_messages (idempotency_key, award_id, claimed_at, submission_timestamp)
  VALUES (encode(sha256(convert_to(:n || '/1', 'UTF8')), 'hex'), 'A-' || :n || '-1', now(), '2026-07-01T09:00:00Z')
  ON CONFLICT DO NOTHING;
INSERT INTO disbursements (award_id, amount_cents, idempotency_key)
  VALUES ('A-' || :n || '-1', 125000, encode(sha256(convert_to(:n || '/1', 'UTF8')), 'hex'));
WITH l AS (SELECT pg_advisory_xact_lock(1768187245, hashtext('A-' || :n || '-1'))),
  ins AS (INSERT INTO outbox (event_id, event_type, subject, idempotency_key, payload, created_at, traceparent)
    SELECT encode(sha256(convert_to('e/' || :n || '/1', 'UTF8')), 'hex'), 'disbursement.recorded',
      'A-' || :n || '-1', encode(sha256(convert_to(:n || '/1', 'UTF8')), 'hex'),
      ('{"award_id":"A-' || :n || '-1"}')::jsonb, now(), NULL FROM l
    ON CONFLICT (event_id) DO NOTHING RETURNING 1)
SELECT 1 FROM ins LIMIT 1;
COMMIT;
