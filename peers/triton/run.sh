#!/usr/bin/env bash
# Start the PyTriton MiniLM server, wait until ready, run load.py with the given args, stop the server.
# Usage: bash peers/triton/run.sh --rates 20,60,120 --duration 30 --seed 1 --tokens 10 --json out/triton.json
set -u
DIR="$(cd "$(dirname "$0")" && pwd)"
VENV="$(bash "$DIR/setup.sh")" || exit 1
PY="$VENV/bin/python"
HTTP_PORT=${HTTP_PORT:-8000}; GRPC_PORT=${GRPC_PORT:-8001}; METRICS_PORT=${METRICS_PORT:-8002}
WORK="$(mktemp -d -t batchtide-triton-XXXXXX)"
LOG="$WORK/server.log"

export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTRITON_HOME="$WORK/pytriton-home"
# The python-backend stub links libpython3.11.so.1.0; unless the venv's own interpreter library comes
# first it may load the system's (another 3.11.x) against this stdlib and fail at model load
# ("'_thread.RLock' object has no attribute '_recursion_count'").
LIBDIR="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')"
export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

for p in $HTTP_PORT $GRPC_PORT $METRICS_PORT; do
  if (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null; then echo "port $p already in use; is a server still running?" >&2; exit 1; fi
done

# own session/process group so we can clean up everything we started
setsid "$PY" "$DIR/server.py" --http-port $HTTP_PORT --grpc-port $GRPC_PORT --metrics-port $METRICS_PORT \
  --max-queue-delay-us "${TRITON_MAX_QUEUE_DELAY_US:-20000}" >"$LOG" 2>&1 &
SPID=$!
echo "server pid $SPID (log $LOG)"

stop_server() {
  if kill -0 $SPID 2>/dev/null; then
    kill -TERM $SPID 2>/dev/null
    for _ in $(seq 1 90); do kill -0 $SPID 2>/dev/null || break; sleep 0.5; done
    if kill -0 $SPID 2>/dev/null; then echo "server did not exit in 45 s, killing group $SPID" >&2; kill -KILL -- -$SPID 2>/dev/null; fi
  fi
  # leftovers of the group (tritonserver / python stub), if any
  sleep 0.5; kill -KILL -- -$SPID 2>/dev/null || true
  wait $SPID 2>/dev/null
  grep -h "batch sizes seen by infer_fn" "$LOG" | sed 's/^.*INFO: /server: /'
  echo "server stopped"
}
trap stop_server EXIT
trap 'exit 130' INT TERM

ready=0
for _ in $(seq 1 240); do
  if ! kill -0 $SPID 2>/dev/null; then echo "server died during startup; tail of $LOG:" >&2; tail -30 "$LOG" >&2; exit 1; fi
  if curl -sf "http://127.0.0.1:$HTTP_PORT/v2/models/minilm/ready" >/dev/null; then ready=1; break; fi
  sleep 0.5
done
[ $ready = 1 ] || { echo "server not ready after 120 s; tail of $LOG:" >&2; tail -30 "$LOG" >&2; exit 1; }
echo "server ready: $(curl -s http://127.0.0.1:$HTTP_PORT/v2 | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(d["name"], d["version"])')"
curl -s "http://127.0.0.1:$HTTP_PORT/v2/models/minilm/config" | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print("model config: max_batch_size", d["max_batch_size"], "dynamic_batching", {k: d["dynamic_batching"][k] for k in ("preferred_batch_size","max_queue_delay_microseconds")}, "instances", [g["count"] for g in d["instance_group"]])'

HTTP_PORT=$HTTP_PORT GRPC_PORT=$GRPC_PORT METRICS_PORT=$METRICS_PORT "$PY" "$DIR/load.py" "$@"
rc=$?
exit $rc
