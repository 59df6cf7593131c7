"""Shared fixtures: tiny random checkpoints and PEFT adapters, written once per session."""

from __future__ import annotations

import os

# OpenMP workers that spin while they wait steal the cores of every other process of the suite (a test
# and the server subprocesses it starts, or other jobs on a shared machine): under that contention a
# 2-thread HF forward ran 10x slower. Read by libgomp when torch loads it, so set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.fixtures import (
    ALL_PROJECTIONS,
    NEW_FAMILIES,
    projections_of,
    write_peft_adapter,
    write_tiny_model,
)

torch.set_num_threads(2)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """``tests/kernels`` runs where Triton kernels run: on CUDA, or in a process started with Triton's
    interpreter on (``tests/test_lora_triton.py`` starts one)."""
    if collection_path.name == "kernels" and collection_path.parent == Path(__file__).parent:
        runnable = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
        return True if not runnable else None
    return None


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_checkpoint(arch)``: the tiny random checkpoint of ``arch`` (``tests.fixtures.tiny_config``),
    written once per session."""
    written: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in written:
            written[arch] = write_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
        return written[arch]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoint: Callable[[str], Path]) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_checkpoint: Callable[[str], Path]) -> Path:
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="session", params=["llama", "llama3", "mistral", "qwen2", *NEW_FAMILIES])
def tiny_model(request: pytest.FixtureRequest, tiny_checkpoint: Callable[[str], Path]) -> Path:
    """Each supported family in turn (qwen2 has q/k/v bias; llama3 has rope scaling; mistral a sliding
    window; qwen3 q/k norms; gemma3 local and global layers; phi3 fused projections and LongRoPE)."""
    return tiny_checkpoint(request.param)


# name -> (rank, target modules); several ranks and target sets, all with non-zero B. Llama's names;
# ``family_targets`` maps them onto fused families (Phi-3: q/k/v -> qkv_proj, gate/up -> gate_up_proj).
ADAPTER_SPECS: dict[str, tuple[int, tuple[str, ...]]] = {
    "r8_all": (8, ALL_PROJECTIONS),
    "r4_attn": (4, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "r16_mlp": (16, ("gate_proj", "up_proj", "down_proj")),
    "r2_qv": (2, ("q_proj", "v_proj")),
}


_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}


def family_targets(base: Path, targets: tuple[str, ...]) -> tuple[str, ...]:
    """``targets`` (Llama names) as the family of the checkpoint in ``base`` names them."""
    if projections_of(base) == ALL_PROJECTIONS:
        return targets
    return tuple(dict.fromkeys(_FUSED.get(t, t) for t in targets))


def make_adapters(base: Path, root: Path) -> dict[str, Path]:
    return {
        name: write_peft_adapter(base, root / name, rank=rank, alpha=2 * rank,
                                 target_modules=family_targets(base, targets), seed=i + 1)
        for i, (name, (rank, targets)) in enumerate(ADAPTER_SPECS.items())
    }


@pytest.fixture(scope="session")
def tiny_llama_adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT adapters for ``tiny_llama``: ``ADAPTER_SPECS`` names -> folders."""
    return make_adapters(tiny_llama, tmp_path_factory.mktemp("tiny-llama-adapters"))


@pytest.fixture(scope="session")
def smollm2_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two random rank-16 PEFT adapters on all seven projections of the embedded SmolLM2 (B std 0.09:
    clearly different from the base, still mostly coherent)."""
    from loraplex.models.embedded import embedded_checkpoint

    base = embedded_checkpoint()
    root = tmp_path_factory.mktemp("smollm2-adapters")
    return {name: write_peft_adapter(base, root / name, rank=16, alpha=16, seed=seed, b_std=0.09)
            for name, seed in (("alpha", 1), ("beta", 2))}


@pytest.fixture(scope="module")
def kernels():  # noqa: ANN201
    """The CPU step kernels (built once), or skip where the CPU lacks AVX2."""
    from loraplex.ops import cpu_kernels

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2: the torch ops serve every case")
    module = cpu_kernels.kernels()
    assert module is not None, "the CPU step kernels must build on an AVX2 machine with a compiler"
    return module
