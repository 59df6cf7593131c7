"""The Triton path's host side, in the main test process (no kernel runs here), and the launcher of the
kernel tests: ``tests/kernels`` in a pytest process of its own with Triton's interpreter on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loraplex.config import EngineConfig
from loraplex.layers.lora_linear import LoRALinear, use_lora_kernels
from loraplex.ops import lora_sgmv
from loraplex.ops.lora import resolve_lora_kernels
from loraplex.ops.lora_batch import BatchMapping, build_lora_batch
from loraplex.ops.lora_step_buffers import LoRAStepBuffers, StaleLoRAIndices, slot_tables

ROOT = Path(__file__).resolve().parent.parent


def test_kernel_tests_pass_under_triton_interpreter() -> None:
    """The float64 oracle, the graph-state simulation and the engine's HF + PEFT reference, all on the
    Triton kernels (the interpreter is chosen when Triton is imported, hence the separate process)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("kernel", ["_shrink_kernel", "_expand_kernel"])
def test_kernels_compile_for_an_h200(kernel: str) -> None:
    """No GPU here, but Triton's own compiler (ptxas ships in its wheel) builds both kernels for sm_90 as
    the launcher specialises them for Llama shapes in bf16: what the interpreter accepts, CUDA accepts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from loraplex.ops import lora_triton

    fn = getattr(lora_triton, kernel)
    pointers = {"x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "out_ptr": "*fp32",
                "shrunk_ptr": "*fp32", "scales_ptr": "*fp32"}
    blocks = {"BLOCK_M": lora_triton.BLOCK_M, "BLOCK_R": lora_triton.BLOCK_R, "BLOCK_K": 128, "BLOCK_N": 128}
    constexprs = {name: blocks[name] for name in fn.arg_names if name in blocks}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "*i32" if name.endswith("_ptr")
                                                                                   else "i32")
                 for name in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"], "no cubin"


def test_buffers_refill_in_place_and_empty_their_tails() -> None:
    buffers = LoRAStepBuffers(max_tokens=12, max_loras=3, device="cpu")
    addresses = [t.data_ptr() for t in (buffers.rows, buffers.group_slots, buffers.group_starts)]
    long = build_lora_batch(BatchMapping.from_sequences([(7, 4), (None, 2), (5, 3), (9, 2)]), {5: 0, 7: 2, 9: 1}, 4)
    buffers.fill(long)
    assert buffers.rows.tolist() == [6, 7, 8, 9, 10, 0, 1, 2, 3, -1, -1, -1]
    assert buffers.group_slots.tolist() == [0, 1, 2] and buffers.group_starts.tolist() == [0, 3, 5, 9]
    assert (buffers.num_groups, buffers.max_group_tokens, buffers.slot_version) == (3, 4, 4)
    short = build_lora_batch(BatchMapping.from_sequences([(None, 1), (9, 1)]), {9: 1}, 5)
    buffers.fill(short)
    assert buffers.rows.tolist() == [1] + [-1] * 11, "a stale row stayed in the tail"
    assert buffers.group_slots.tolist() == [1, -1, -1] and buffers.group_starts.tolist() == [0, 1, 1, 1]
    assert addresses == [t.data_ptr() for t in (buffers.rows, buffers.group_slots, buffers.group_starts)]
    too_long = build_lora_batch(BatchMapping.from_sequences([(5, 13)]), {5: 0}, 5)
    with pytest.raises(ValueError, match="exceeds the buffers' capacity of 12 tokens"):
        buffers.fill(too_long)


def test_an_equal_mapping_under_a_new_layout_refills() -> None:
    """The memo is the batch object, which carries (mapping, version): the seed's bug cannot recur here."""
    buffers = LoRAStepBuffers(max_tokens=4, max_loras=2, device="cpu")
    mapping = BatchMapping.from_sequences([(1, 1), (2, 1)])
    before = build_lora_batch(mapping, {1: 0, 2: 1}, slot_version=2)
    buffers.prepare(before)
    buffers.prepare(before)  # same step again: nothing to do
    after = build_lora_batch(mapping, {1: 1, 2: 0}, slot_version=5)
    with pytest.raises(StaleLoRAIndices, match="filled at slot-table version 2, the step serves version 5"):
        buffers.check(after.slot_version)
    buffers.prepare(after)
    assert buffers.rows.tolist()[:2] == [1, 0] and buffers.slot_version == 5


def test_batch_moves_its_index_tensors_to_the_device() -> None:
    """The runner hands the layers a batch on the model's device (the ops index x, y and the slots with it)."""
    batch = build_lora_batch(BatchMapping.from_sequences([(3, 2), (None, 1), (4, 1)]), {3: 1, 4: 0}, 7)
    assert batch.to(torch.device("cpu")) is batch
    moved = batch.to(torch.device("meta"))
    assert {t.device.type for t in (moved.token_slots, moved.order)} == {"meta"}
    assert (moved.group_slots, moved.group_offsets, moved.slot_version) == ((0, 1), (0, 1, 3), 7)


def test_device_slot_tables_follow_slot_writes() -> None:
    def pair(r: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(r, 8), torch.randn(out, r)

    layer = LoRALinear(8, (4, 2, 2), ("q_proj", "k_proj", "v_proj"), max_loras=3, max_lora_rank=4)
    layer.set_slot(0, {"q_proj": pair(3, 4), "v_proj": pair(2, 2)})
    layer.set_slot(2, {"k_proj": pair(4, 2)})
    ranks, blocks = slot_tables(layer.slot_ranks, 8, layer.slot_blocks, 3, "cpu")
    assert torch.equal(layer.slot_ranks_dev, ranks) and torch.equal(layer.slot_blocks_dev, blocks)
    assert layer.slot_blocks_dev[0].tolist() == [[0, 4, 0, 3], [4, 6, 3, 3], [6, 8, 3, 5]]
    layer.clear_slot(0)
    assert layer.slot_ranks_dev.tolist() == [0, 0, 4] and not layer.slot_blocks_dev[0].any()


def test_use_lora_kernels_shares_one_set_of_buffers() -> None:
    model = torch.nn.ModuleList([LoRALinear(8, (4,), ("o_proj",), 2, 4),
                                 LoRALinear(8, (4, 4), ("gate_proj", "up_proj"), 2, 4)])
    use_lora_kernels(model, "triton", max_tokens=64)
    first, second = model
    assert first.step_buffers is second.step_buffers and first.step_buffers.max_tokens == 64
    use_lora_kernels(model, "torch", max_tokens=64)
    assert first.step_buffers is None and second.step_buffers is None
    with pytest.raises(ValueError, match="'torch', 'sgmv' or 'triton'"):
        use_lora_kernels(model, "auto", max_tokens=64)


def test_lora_kernels_are_chosen_per_device() -> None:
    assert resolve_lora_kernels("auto", torch.device("cpu")) == ("sgmv" if lora_sgmv.kernel() else "torch")
    assert resolve_lora_kernels("auto", torch.device("cuda")) == "triton"  # Triton is in the dev install
    assert resolve_lora_kernels("torch", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="needs Triton's interpreter"):
        resolve_lora_kernels("triton", torch.device("cpu"))  # make test's main process: no TRITON_INTERPRET
    with pytest.raises(ValueError, match="lora_kernels must be one of"):
        EngineConfig(lora_kernels="cuda")


def test_loraplex_works_without_triton() -> None:
    """A CPU user's install has no Triton: importing loraplex and choosing kernels must not need it."""
    code = """
import sys
sys.modules["triton"] = None  # any import of triton now fails
import torch
from loraplex import LLM
from loraplex.ops import lora_sgmv
from loraplex.ops.lora import resolve_lora_kernels
assert resolve_lora_kernels("auto", torch.device("cpu")) == ("sgmv" if lora_sgmv.kernel() else "torch")
assert resolve_lora_kernels("auto", torch.device("cuda")) == "torch"
try:
    resolve_lora_kernels("triton", torch.device("cuda"))
except ValueError as e:
    assert "loraplex[gpu]" in str(e), e
else:
    raise AssertionError("no error")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
