"""The engine's offline request rate for the serving benchmark's request mix (issue 22's reference).

For each scenario (adapters drawn uniform or Zipf(1.0) over 8 or 64 of them), ``LLM.generate`` runs the
same kind of requests ``serving.py`` sends (chat prompts as token ids, ``--tokens`` new tokens, greedy,
EOS ignored) all at once, with the server's flags (8 slots, 64 adapters in host memory, max rank 16,
32 running requests): req/s = requests / wall time, the best of ``--repeats``. It prints one JSON
object. ``serving.py`` runs it in a subprocess under each OpenMP wait policy (the policy must be set
before torch loads) and takes the better rate as the reference.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m benchmarks.peers.offline_rate --scenarios uniform-8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from transformers import AutoTokenizer

from benchmarks.peers import loadgen, shared
from loraplex import LLM, SamplingParams
from loraplex.models.embedded import embedded_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="uniform-8,zipf-8,uniform-64,zipf-64")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=shared.NEW_TOKENS)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    adapters = shared.adapter_set(64)
    llm = LLM(model=shared.MODEL_NAME, max_loras=8, max_cpu_loras=64, max_lora_rank=16, max_num_seqs=32,
              enable_prefix_caching=False)  # as the servers: vLLM's --no-enable-prefix-caching
    for name, path in adapters.items():
        llm.load_adapter(name, path)
    prompts = shared.prompts(AutoTokenizer.from_pretrained(embedded_checkpoint()), 32)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                 adapters=[f"a{i}" for i in range(8)], use_tqdm=False)
    rates = {}
    for si, scenario in enumerate(args.scenarios.split(",")):
        dist, pool = scenario.split("-")
        draws = loadgen.popularity([f"a{i}" for i in range(int(pool))], dist, args.requests, random.Random(si))
        batch = [prompts[i % len(prompts)] for i in range(args.requests)]
        best = 0.0
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.generate(batch, params, adapters=draws, use_tqdm=False)
            best = max(best, args.requests / (time.perf_counter() - start))
        rates[scenario] = best
    print(json.dumps({"req_s": rates, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
                      "load_avg": os.getloadavg()}))


if __name__ == "__main__":
    main()
