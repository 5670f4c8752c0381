#!/usr/bin/env bash
# Launch ms-llm pretraining through msrun.
#   bash scripts/pretrain.sh [CONFIG.yaml] [--section.key VALUE ...]
# Environment:
#   NPROC            workers on this machine (one node), default 1
#   NNODES           nodes in the job (MindSpeed's name), default 1
#   NODE_RANK        this node's index, 0 .. NNODES-1 (node 0 hosts the scheduler), default 0
#   NPUS_PER_NODE    workers per node (MindSpeed's name), default NPROC
#   MASTER_ADDR      address of node 0 (127.0.0.1 on one node; required when NNODES > 1),
#                    MASTER_PORT (8118)
#   LOG_DIR          msrun's worker logs (outputs/msrun_logs)
#   CLUSTER_TIME_OUT seconds msrun waits for a lost worker or a missing node (120)
#   MAX_RESTARTS     relaunch a failed job this often with --training.resume auto (default: the
#                    config's training.max_restarts, 0); relaunch k logs to LOG_DIR/restart_k and
#                    uses MASTER_PORT + k (ms_llm/training/restart.py)
# Multi-node: run this on every node with the same NNODES, NPUS_PER_NODE, MASTER_ADDR and
# MASTER_PORT and its own NODE_RANK; global ranks are NODE_RANK * NPUS_PER_NODE + local rank.
# Exits non-zero when any worker fails.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "pretrain.sh: $*" >&2; exit 2; }
is_count() { [[ "$1" =~ ^[0-9]+$ ]]; }

NPROC="${NPROC:-}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
NPUS_PER_NODE="${NPUS_PER_NODE:-${NPROC:-1}}"
if [[ -n "$NPROC" && "$NPROC" != "$NPUS_PER_NODE" ]]; then
  die "NPROC=$NPROC and NPUS_PER_NODE=$NPUS_PER_NODE disagree (set one of them)"
fi
is_count "$NNODES" && (( NNODES >= 1 )) || die "NNODES must be an integer >= 1, got '$NNODES'"
is_count "$NPUS_PER_NODE" && (( NPUS_PER_NODE >= 1 )) \
  || die "NPUS_PER_NODE (or NPROC) must be an integer >= 1, got '$NPUS_PER_NODE'"
is_count "$NODE_RANK" && (( NODE_RANK < NNODES )) \
  || die "NODE_RANK must be an integer in [0, NNODES-1=$((NNODES - 1))], got '$NODE_RANK'"
WORLD_SIZE=$((NNODES * NPUS_PER_NODE))
# One node may default to loopback; on several nodes 127.0.0.1 would make every node its own
# master and leave the job waiting until the cluster time-out, so node 0's address is required.
if (( NNODES > 1 )) && [[ -z "${MASTER_ADDR:-}" ]]; then
  die "NNODES=$NNODES needs MASTER_ADDR set to node 0's address (the same on every node)"
fi
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-8118}"
LOG_DIR="${LOG_DIR:-outputs/msrun_logs}"
CLUSTER_TIME_OUT="${CLUSTER_TIME_OUT:-120}"

CONFIG="${ROOT}/configs/tiny.yaml"
if [[ $# -gt 0 && "$1" != --* ]]; then
  CONFIG="$1"
  shift
fi
if [[ ! -f "$CONFIG" ]]; then
  echo "pretrain.sh: config file not found: $CONFIG" >&2
  exit 2
fi

# This checkout wins over any other installed copy of ms_llm.
export PYTHONPATH="${ROOT}${PYTHONPATH:+:$PYTHONPATH}"
# msrun starts workers with the `python` on PATH: make it the interpreter that has ms_llm.
PY="${PYTHON:-$(command -v python3 || command -v python)}"
BIN_DIR="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")"
export PATH="$BIN_DIR:$PATH"
command -v msrun >/dev/null || { echo "pretrain.sh: msrun not found (is mindspore installed?)" >&2; exit 2; }

# One interpreter start (importing MindSpore costs seconds): check ms_llm imports, validate the
# config (with the launch rules for WORLD_SIZE workers) before spending ~15 s on cluster
# start-up, and print the entry point msrun runs, the config's training.max_restarts and
# checkpoint.save_dir.
set +e
ENTRY="$("$PY" -c "import sys
try:
    import mindspore, ms_llm.cli.train as entry
    from ms_llm.config import load_config, ConfigError
except ImportError as e:
    print(f'pretrain.sh: ms_llm or mindspore is not importable by {sys.executable} ({e}); '
          f\"run 'pip install -e .' first\", file=sys.stderr); sys.exit(2)
try:
    cfg = load_config(sys.argv[2], sys.argv[3:], world_size=int(sys.argv[1]))
except ConfigError as e:
    print(f'config error: {e}', file=sys.stderr); sys.exit(2)
print(entry.__file__, cfg.training.max_restarts, cfg.checkpoint.save_dir or '', sep='\x1f')" \
  "$WORLD_SIZE" "$CONFIG" "$@")"
rc=$?
set -e
(( rc == 0 )) || exit $rc
ENTRY="${ENTRY##*$'\n'}"                 # the last line, should an import print anything
IFS=$'\x1f' read -r ENTRY CONFIG_RESTARTS SAVE_DIR <<< "$ENTRY"
MAX_RESTARTS="${MAX_RESTARTS:-$CONFIG_RESTARTS}"
is_count "$MAX_RESTARTS" || die "MAX_RESTARTS must be an integer >= 0, got '$MAX_RESTARTS'"
if (( MAX_RESTARTS > 0 )) && [[ -z "$SAVE_DIR" ]]; then
  die "MAX_RESTARTS=$MAX_RESTARTS needs checkpoint.save_dir (a restart resumes from it)"
fi

export GLOG_v="${GLOG_v:-3}"             # MindSpore C++ logs: errors only
export PYTHONUNBUFFERED=1
mkdir -p "$LOG_DIR"

# The msrun command is built by ms_llm.launch.msrun; the supervisor (ms_llm/training/restart.py)
# runs it once, and with MAX_RESTARTS > 0 relaunches it on a new port and log folder after a
# failure.
set +e
"$PY" -m ms_llm.training.restart --max-restarts "$MAX_RESTARTS" --save-dir "$SAVE_DIR" \
      --master-port "$MASTER_PORT" --log-dir "$LOG_DIR" --worker-num "$WORLD_SIZE" \
      --local-worker-num "$NPUS_PER_NODE" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" \
      --cluster-time-out "$CLUSTER_TIME_OUT" -- "$ENTRY" "$CONFIG" "$@"
rc=$?
set -e
if [[ $rc -ne 0 ]]; then
  echo "pretrain.sh: training failed (exit $rc); worker logs are in $LOG_DIR" >&2
  exit $rc
fi
