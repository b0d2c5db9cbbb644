# scripts/lib/bench-postgres.sh — what scripts/bench-postgres and scripts/bench-price share:
# the idem binary, the schemas of a run, and one measured run of pgbench or of `idem demo`
# with what it cost the database per submission. Sourced after these are set: ROOT, URL,
# TAG (every schema of the run starts with it), SECONDS_PER_RUN (pgbench), SUBMISSIONS and
# BATCH_SUBMISSIONS (demo runs whose name starts with b), TWIN_DIR, TWIN_SCHEMA; NAME, the
# sourcing script's name for its messages.

for f in message.sql batch100.sql bare_tables.sql bare_message.sql bare_batch100.sql \
    guarded_tables.sql; do
  [[ -f "$TWIN_DIR/$f" ]] || { echo "$NAME: missing $TWIN_DIR/$f" >&2; exit 2; }
done
command -v pgbench >/dev/null || { echo "$NAME: pgbench not found" >&2; exit 2; }
command -v psql >/dev/null || { echo "$NAME: psql not found" >&2; exit 2; }

if [[ -z "${IDEM_BIN:-}" ]]; then
  (cd "$ROOT" && cargo build --release -q -p idem-cli)
  TARGET_DIR=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
  IDEM_BIN="$TARGET_DIR/release/idem"
fi
[[ -x "$IDEM_BIN" ]] || { echo "$NAME: no idem binary at $IDEM_BIN" >&2; exit 2; }

# Every schema the run made (each starts with $TAG), dropped on exit.
cleanup() {
  psql "$URL" -qAtX -c "SELECT nspname FROM pg_namespace WHERE starts_with(nspname, '$TAG')" 2>/dev/null \
    | while read -r s; do
        psql "$URL" -qAtX -c "DROP SCHEMA IF EXISTS \"$s\" CASCADE" >/dev/null 2>&1 || true
      done
}
trap cleanup EXIT

# shellcheck source=scripts/lib/pg-cost.sh
source "$ROOT/scripts/lib/pg-cost.sh"

# pgbench SCHEMA SCRIPT CLIENTS [OPTION...] -> "TPS TRANSACTIONS"
pgbench_run() {
  local schema=$1 script=$2 clients=$3 jobs=$(( $3 < 2 ? 1 : 2 ))
  shift 3
  PGOPTIONS="-c search_path=$schema" pgbench -n "$@" -f "$script" -c "$clients" -j "$jobs" \
    -T "$SECONDS_PER_RUN" "$URL" 2>/dev/null \
    | awk '/^number of transactions actually processed: / { n = $6 } /^tps = / { print $3, n; exit }'
}

# demo_run NAME ARGS... -> "MSG_PER_S WAL_BYTES WAL_RECORDS INDEX_ENTRIES SERVER_CPU_US FPI" (per
# submission): idem demo ARGS on the new schema ${TAG}_demoNAME, which must end with
# exactly-once: OK
demo_run() {
  local schema="${TAG}_demo$1" submissions=$SUBMISSIONS
  [[ $1 == b* ]] && submissions=$BATCH_SUBMISSIONS
  shift
  local out before after
  before=$(db_counters "$schema" pre)
  if ! out=$("$IDEM_BIN" demo --store "$URL" --schema "$schema" --submissions "$submissions" \
      --crash-rate 0 --redeliveries 0.25 "$@" 2>/dev/null); then
    echo "$NAME: idem demo $* failed:" >&2
    echo "$out" >&2
    exit 1
  fi
  grep -q '^exactly-once: OK' <<<"$out" || { echo "$NAME: demo $* did not report exactly-once: OK" >&2; echo "$out" >&2; exit 1; }
  after=$(db_counters "$schema" post)
  echo "$(awk -F': *' '/^throughput_msgs_per_s:/ { print $2; exit }' <<<"$out") $(cost "$before" "$after" "$submissions")"
}

ratio() { python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); print(f'{a/b:.2f}' if b else 'n/a')" "$1" "$2"; }

# measured SCHEMA SCRIPT CLIENTS SUBMISSIONS_PER_TX [OPTION...] -> "MSG_PER_S WAL_BYTES
# WAL_RECORDS INDEX_ENTRIES SERVER_CPU_US FPI" (per submission)
measured() {
  local schema=$1 script=$2 clients=$3 per_tx=$4 before after run
  shift 4
  before=$(db_counters "$schema" pre)
  run=$(pgbench_run "$schema" "$script" "$clients" "$@")
  after=$(db_counters "$schema" post)
  python3 -c "import sys; t, n = sys.argv[1].split(); print(float(t) * float(sys.argv[2]), float(n) * float(sys.argv[2]))" "$run" "$per_tx" | {
    read -r rate subs
    echo "$rate $(cost "$before" "$after" "$subs")"
  }
}
# Each idem run sits between its twin runs; the twin's figure is their mean (its costs are
# the first run's). Like each demo run, each twin run starts on a new schema, made by
# `idem migrate` (the default layout). The twins carry the demo's redeliveries:
# message.sql one transaction in five (4 submissions per 5), batch100.sql 20 of each 100
# deliveries (80 submissions); so do the bare design's scripts.
twin() { # SCRIPT CLIENTS SUBMISSIONS_PER_TX -> as measured
  PGOPTIONS="-c client_min_messages=warning" \
    psql "$URL" -qAtX -c "DROP SCHEMA IF EXISTS \"$TWIN_SCHEMA\" CASCADE" >/dev/null
  "$IDEM_BIN" migrate --handler grant --store "$URL" --schema "$TWIN_SCHEMA" >/dev/null
  # Prepared statements, as sqlx sends them (parsed once per connection).
  measured "$TWIN_SCHEMA" "$TWIN_DIR/$1" "$2" "$3" -M prepared -D prev=0 -D c=0
}
# design_run TABLES SCRIPT CLIENTS SUBMISSIONS_PER_TX -> as measured: pgbench SCRIPT on a
# new schema made from TABLES (bare_tables.sql or guarded_tables.sql), dropped after it.
# Like each demo and twin run, each run of a design starts empty: on one schema for every
# run its tables would grow by up to half a million rows a run, and its later runs would
# meet deeper indexes than the idem run they are compared with.
design_run() {
  local tables=$1 script=$2 clients=$3 per_tx=$4 schema="${TAG}_design_${BASHPID}"
  psql "$URL" -qAtX -v ON_ERROR_STOP=1 -c "CREATE SCHEMA \"$schema\"" >/dev/null
  PGOPTIONS="-c search_path=$schema" psql "$URL" -qAtX -v ON_ERROR_STOP=1 -f "$TWIN_DIR/$tables" >/dev/null
  measured "$schema" "$TWIN_DIR/$script" "$clients" "$per_tx" -M prepared -D prev=0 -D c=0
  PGOPTIONS="-c client_min_messages=warning" \
    psql "$URL" -qAtX -c "DROP SCHEMA IF EXISTS \"$schema\" CASCADE" >/dev/null
}
bare() { design_run bare_tables.sql "$@"; }       # SCRIPT CLIENTS SUBMISSIONS_PER_TX
guarded() { design_run guarded_tables.sql "$@"; } # SCRIPT CLIENTS SUBMISSIONS_PER_TX
rate() { cut -d' ' -f1 <<<"$1"; }
mean() { python3 -c "import sys; print((float(sys.argv[1].split()[0]) + float(sys.argv[2].split()[0])) / 2)" "$1" "$2"; }
