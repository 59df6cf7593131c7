#!/usr/bin/env bash
# `make bench`: the peers' venv, then every peer benchmark in one run, then the plots and the verdict.
# Results: benchmarks/results/{offline,serving,crosscheck,summary}.json and *.png; logs beside them.
# Pass options through the environment: OFFLINE_ARGS="--repeats 3", SERVING_ARGS="--rates 0.2,0.4".
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
PEERS_PY="${VLLM_VENV:-.venv-vllm}/bin/python"
bash benchmarks/peers/setup_peers.sh
mkdir -p benchmarks/results
# shellcheck disable=SC2086
$PY -m benchmarks.peers.offline ${OFFLINE_ARGS:-}
$PY -m benchmarks.peers.crosscheck
# shellcheck disable=SC2086
$PY -m benchmarks.peers.serving ${SERVING_ARGS:-}
"$PEERS_PY" benchmarks/peers/plots.py
"$PEERS_PY" benchmarks/peers/summary.py
