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

-- The row trigger on the parent is cloned by Postgres onto every partition, present and
-- future. A TRUNCATE trigger is statement-level and is not: it is created on the parent and
-- on each of its partitions (the default one, the monthly ones), and PgStore's
-- create_partition adds it to each partition it creates later. Existing triggers are left
-- alone (no DROP and CREATE): a run that finds them all takes no table lock.
DO $idem_append_only$
DECLARE
    part record;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgrelid = '{schema}.processed_messages'::regclass
                     AND tgname = 'idem_append_only') THEN
        CREATE TRIGGER idem_append_only
            BEFORE UPDATE OR DELETE ON {schema}.processed_messages
            FOR EACH ROW EXECUTE FUNCTION {schema}.idem_processed_messages_append_only();
    END IF;
    FOR part IN
        SELECT n.nspname, c.relname, t.relid
        FROM (SELECT '{schema}.processed_messages'::regclass AS relid
              UNION
              SELECT relid FROM pg_partition_tree('{schema}.processed_messages'::regclass)) t
        JOIN pg_class c ON c.oid = t.relid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE NOT EXISTS (SELECT 1 FROM pg_trigger g
                          WHERE g.tgrelid = t.relid AND g.tgname = 'idem_append_only_truncate')
    LOOP
        EXECUTE format(
            'CREATE TRIGGER idem_append_only_truncate BEFORE TRUNCATE ON %I.%I '
            'FOR EACH STATEMENT EXECUTE FUNCTION {schema}.idem_processed_messages_append_only()',
            part.nspname, part.relname);
    END LOOP;
END
$idem_append_only$;
