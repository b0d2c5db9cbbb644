-- Optional (PgStore::migrate_append_only, `idem migrate --append-only`): makes
-- processed_messages append-only evidence. UPDATE, DELETE and TRUNCATE are refused,
-- except DELETE inside a transaction that has run `SET LOCAL idem.purge = 'on'`, which
-- is what PgStore::purge does. Idempotent. `{schema}` is replaced by the validated,
-- quoted schema name before execution.
--
-- The setting is a guard against accidents and tools, not a permission: a role that may
-- DELETE could set it too. Keep DELETE away from every role but the owner (README,
-- "Evidence and least privilege").

CREATE OR REPLACE FUNCTION {schema}.idem_processed_messages_append_only()
RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('idem.purge', true) = 'on' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'idem: processed_messages is append-only evidence: % refused', TG_OP
        USING ERRCODE = 'IDEM1',
              HINT = 'dedup records are removed only by retention (idem purge)';
END
$fn$;

DROP TRIGGER IF EXISTS idem_append_only ON {schema}.processed_messages;
CREATE TRIGGER idem_append_only
    BEFORE UPDATE OR DELETE ON {schema}.processed_messages
    FOR EACH ROW EXECUTE FUNCTION {schema}.idem_processed_messages_append_only();

DROP TRIGGER IF EXISTS idem_append_only_truncate ON {schema}.processed_messages;
CREATE TRIGGER idem_append_only_truncate
    BEFORE TRUNCATE ON {schema}.processed_messages
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.idem_processed_messages_append_only();
