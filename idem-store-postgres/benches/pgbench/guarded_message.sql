-- bare_message.sql on guarded_tables.sql: the bare design's one delivery per transaction
-- (the same keys, award ids and redelivery mix), writing the identity and an event id of
-- the same width as the twin's (64 hex characters). Run with `-D prev=0 -D c=0` and
-- search_path set to the guarded schema.
\set c :c + 1
\if :c % 5 = 0
BEGIN;
INSERT INTO processed_messages (idempotency_key, award_id, submission_timestamp, claimed_at)
  VALUES (encode(sha256(convert_to(:prev || '/1', 'UTF8')), 'hex'), 'A-' || :prev || '-1', '2026-07-01T09:00:00Z', now())
  ON CONFLICT (idempotency_key) DO NOTHING;
ROLLBACK;
\else
\set n random(1, 1000000000)
BEGIN;
INSERT INTO processed_messages (idempotency_key, award_id, submission_timestamp, claimed_at)
  VALUES (encode(sha256(convert_to(:n || '/1', 'UTF8')), 'hex'), 'A-' || :n || '-1', '2026-07-01T09:00:00Z', now())
  ON CONFLICT (idempotency_key) DO NOTHING;
INSERT INTO disbursements (award_id, amount_cents, idempotency_key)
  VALUES ('A-' || :n || '-1', 125000, encode(sha256(convert_to(:n || '/1', 'UTF8')), 'hex'));
INSERT INTO outbox (event_id, event_type, payload, created_at)
  VALUES (encode(sha256(convert_to('e/' || :n || '/1', 'UTF8')), 'hex'), 'disbursement.recorded',
          ('{"award_id":"A-' || :n || '-1"}')::jsonb, now())
  ON CONFLICT (event_id) DO NOTHING;
COMMIT;
\set prev :n
\endif
