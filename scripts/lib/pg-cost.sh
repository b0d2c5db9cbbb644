# scripts/lib/pg-cost.sh — what a run cost the database per submission: WAL bytes, WAL
# records, index entries written into one schema's tables and the server's CPU. Shared by
# scripts/lib/bench-postgres.sh (bench-postgres, bench-price) and scripts/bench-scale.
# Sourced after ROOT (the repository) and URL (the server) are set.

# The server's CPU so far (µs; "nan" for a server elsewhere): scripts/server-cpu.
server_cpu_us() { "$ROOT/scripts/server-cpu" "$URL"; }

# What the database has written and spent so far, as "WAL_BYTES_LSN WAL_RECORDS
# INDEX_ENTRIES SERVER_CPU_US WAL_FULL_PAGE_IMAGES" for SCHEMA's tables (see the header),
# read before a run (pre) or after it (post): the server's CPU is read after this query
# before a run and before it after, so that its own cost counts in neither. pg_stat_* are flushed by each
# backend at most once a second, and by a client's backend when it exits: read after the
# run's clients exited.
db_counters() {
  sleep 1.2
  local cpu=
  [[ $2 == post ]] && cpu=$(server_cpu_us)
  local counts
  counts=$(psql "$URL" -qAtX -v ON_ERROR_STOP=1 -F ' ' <<SQL
CREATE FUNCTION pg_temp.held_share(rel oid, pred text) RETURNS float8 LANGUAGE plpgsql AS \$f\$
DECLARE r float8;
BEGIN
  IF pred IS NULL THEN RETURN 1; END IF;
  EXECUTE format('SELECT coalesce(avg((%s)::int), 1)::float8 FROM %s', pred, rel::regclass) INTO r;
  RETURN r;
END \$f\$;
SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint,
       (SELECT wal_records FROM pg_stat_wal),
       coalesce((SELECT round(sum(t.n_tup_ins * pg_temp.held_share(i.indrelid, pg_get_expr(i.indpred, i.indrelid))))
                 FROM pg_stat_user_tables t
                 JOIN pg_index i ON i.indrelid = t.relid
                 JOIN pg_class c ON c.oid = i.indexrelid
                 JOIN pg_am a ON a.oid = c.relam
                 WHERE t.schemaname = '$1' AND a.amname <> 'brin'), 0)::bigint,
       (SELECT wal_fpi FROM pg_stat_wal);
SQL
)
  [[ $2 == pre ]] && cpu=$(server_cpu_us)
  local lsn records entries fpi
  read -r lsn records entries fpi <<<"$counts"
  echo "$lsn $records $entries $cpu $fpi"
}

# cost BEFORE AFTER SUBMISSIONS -> "WAL_BYTES WAL_RECORDS INDEX_ENTRIES SERVER_CPU_US
# WAL_FULL_PAGE_IMAGES" per submission
cost() {
  python3 -c "import sys; b=sys.argv[1].split(); a=sys.argv[2].split(); n=float(sys.argv[3]); print(' '.join(f'{(float(y)-float(x))/n:.1f}' for x, y in zip(b, a)))" "$1" "$2" "$3"
}
