-- The bare design's one delivery per transaction, made comparable with message.sql (the
-- twin of idem's): the same keys (64 hex characters of a SHA-256), the same award ids and
-- the same redelivery mix (every fifth transaction of a client redelivers its previous
-- message: the claim inserts nothing, ROLLBACK), on the bare tables of
-- scripts/bench-postgres (a primary key on the claims, no other index, no trigger): the
-- reference design's key, business row and outbox row, and nothing else. Run with
-- `-D prev=0 -D c=0` and search_path set to the bare schema.
\set c :c + 1
\if :c % 5 = 0
BEGIN;
INSERT INTO processed_messages (idempotency_key, award_id, claimed_at)
  VALUES (encode(sha256(convert_to(:prev || '/1', 'UTF8')), 'hex'), 'A-' || :prev || '-1', now())
  ON CONFLICT (idempotency_key) DO NOTHING;
ROLLBACK;
\else
\set n random(1, 1000000000)
BEGIN;
INSERT INTO processed_messages (idempotency_key, award_id, claimed_at)
  VALUES (encode(sha256(convert_to(:n || '/1', 'UTF8')), 'hex'), 'A-' || :n || '-1', now())
  ON CONFLICT (idempotency_key) DO NOTHING;
INSERT INTO disbursements (award_id, amount_cents, idempotency_key)
  VALUES ('A-' || :n || '-1', 125000, encode(sha256(convert_to(:n || '/1', 'UTF8')), 'hex'));
INSERT INTO outbox (event_type, payload, created_at)
  VALUES ('disbursement.recorded', ('{"award_id":"A-' || :n || '-1"}')::jsonb, now());
COMMIT;
\set prev :n
\endif
