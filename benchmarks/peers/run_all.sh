#!/usr/bin/env bash
# `make bench`: the peers' venv, then every peer benchmark in one run, then the plots and the verdict.
# Results: benchmarks/results/{offline,serving,crosscheck,summary}.json and *.png; logs beside them.
# Pass options through the environment: OFFLINE_ARGS="--repeats 3", SERVING_ARGS="--rates 0.2,0.4",
# PREFILL_ARGS, LOADS_ARGS, INT8_ARGS, PREFIX_ARGS, LLAMACPP_ARGS, SCALING_ARGS (e.g. "--quick").
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
PEERS_PY="${VLLM_VENV:-.venv-vllm}/bin/python"
bash benchmarks/peers/setup_peers.sh
mkdir -p benchmarks/results
# Every system on the same two cores with bound OpenMP threads: vLLM binds its own to 0-1
# (VLLM_CPU_OMP_THREADS_BIND in shared.VLLM_ENV); loraplex, PEFT and HF get the same binding here.
export GOMP_CPU_AFFINITY="${GOMP_CPU_AFFINITY:-0 1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
# shellcheck disable=SC2086
$PY -m benchmarks.peers.offline ${OFFLINE_ARGS:-}
$PY -m benchmarks.peers.prefill ${PREFILL_ARGS:-}
$PY -m benchmarks.peers.crosscheck
# shellcheck disable=SC2086
$PY -m benchmarks.peers.serving ${SERVING_ARGS:-}
# loraplex alone: cold adapter loads and the 1,000-adapter churn; int8 quality and speed
$PY -m benchmarks.adapter_loads --out benchmarks/results/adapter_loads.json ${LOADS_ARGS:-}
$PY -m benchmarks.int8 --out benchmarks/results/int8.json ${INT8_ARGS:-}
# Prefix caching: multi-turn chats, loraplex caching on / off vs vLLM-CPU with its prefix caching on
# shellcheck disable=SC2086
$PY -m benchmarks.prefix_cache ${PREFIX_ARGS:-}
# llama.cpp as a peer: llama-server built once (AVX2) into .peers/, then loraplex f32 / Q4_1 vs llama.cpp
bash benchmarks/peers/setup_llamacpp.sh
# shellcheck disable=SC2086
$PY -m benchmarks.peers.llamacpp_bench ${LLAMACPP_ARGS:-}
# How cost grows (model size, context, concurrency, adapters; llama.cpp on context and concurrency), plots in docs/
# shellcheck disable=SC2086
$PY -m benchmarks.scaling ${SCALING_ARGS:-}
$PY -m benchmarks.scale.plots
"$PEERS_PY" benchmarks/peers/plots.py
"$PEERS_PY" benchmarks/peers/summary.py
