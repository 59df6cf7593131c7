"""A CPU ``loraplex serve`` never imports Triton (issue 29: importing it made Ctrl-C print ~30 lines of nanobind
"leaked" warnings): Triton is imported only where its kernels are chosen (``lora_kernels="triton"``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SERVE_PATH = """
import sys
import loraplex.cli, loraplex.server.app, loraplex.engine.core_process, loraplex.client.process
from loraplex import LLM, SamplingParams
llm = LLM(model={model!r}, kv_cache_blocks=16)  # lora_kernels="auto": sgmv or torch on a CPU
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
print(sorted(m for m in sys.modules if m == "triton" or m.startswith("triton.")))
"""


def test_a_cpu_engine_and_server_never_import_triton(tiny_llama: Path) -> None:
    code = textwrap.dedent(SERVE_PATH.format(model=str(tiny_llama)))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
