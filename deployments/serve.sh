#!/usr/bin/env bash
# `make server`: a Prefect server and an MLflow tracking server on 127.0.0.1 until Ctrl-C.
# State lives in $DLLM_SERVER_DIR (default work/server). Both databases are created/migrated once
# here, before any worker or pipeline opens them (concurrent first starts of sqlite race).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STATE=${DLLM_SERVER_DIR:-$ROOT/work/server}
PREFECT_PORT=${PREFECT_PORT:-4200}
MLFLOW_PORT=${MLFLOW_PORT:-5000}
BIN=${VENV_BIN:-$ROOT/.venv/bin}
mkdir -p "$STATE/prefect"
export PREFECT_HOME="$STATE/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=true \
       MLFLOW_DISABLE_TELEMETRY=true
unset PREFECT_API_URL
"$BIN/prefect" server database upgrade -y >"$STATE/migrate.log" 2>&1 || { tail -20 "$STATE/migrate.log"; exit 1; }
"$BIN/prefect" server start --host 127.0.0.1 --port "$PREFECT_PORT" &
PREFECT_PID=$!
"$BIN/mlflow" server --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 \
    --backend-store-uri "sqlite:///$STATE/mlflow.db" --artifacts-destination "$STATE/mlartifacts" &
MLFLOW_PID=$!
trap 'kill $PREFECT_PID $MLFLOW_PID 2>/dev/null || true; wait' EXIT INT TERM
echo "Prefect API  http://127.0.0.1:$PREFECT_PORT/api   (export PREFECT_API_URL=http://127.0.0.1:$PREFECT_PORT/api)"
echo "MLflow       http://127.0.0.1:$MLFLOW_PORT        (pipelines: --set tracking.uri=http://127.0.0.1:$MLFLOW_PORT)"
wait
