"""bfloat16 adapter weights (``EngineConfig.lora_dtype="bfloat16"``, ``--lora-dtype``).

The sgmv kernel and the torch ops read bfloat16 A and B under float32 activations and must equal the
float64 oracle of the rounded weights (ranks 1..64, NaN-poisoned unused slots, every popularity). Through
``LoRALinear``, a slot write rounds a float32 adapter exactly as the oracle does, and a rewrite of the slot
shows through (no stale upcast copy). The engine with adapters whose weights are exactly bfloat16 (so the
rounding loses nothing) generates HF + PEFT's greedy tokens, on the host tier at half the bytes; with
float32 adapters that bfloat16 cannot hold, it equals HF + PEFT on the rounded weights within a float32
tolerance (and measurably differs from the unrounded reference).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex import LLM, SamplingParams
from loraplex.cli import build_parser, engine_config
from loraplex.config import EngineConfig
from loraplex.layers.lora_linear import LoRALinear, use_lora_dtype, use_lora_kernels
from loraplex.ops import lora_sgmv
from loraplex.ops.lora_batch import LORA_METHODS, BatchMapping, build_lora_batch
from loraplex.ops.lora_step_buffers import slot_tables
from tests.engine_harness import capture_step_logits
from tests.fixtures import write_peft_adapter
from tests.model_harness import hf_logits
from tests.reference import hf_model, with_adapter
from tests.test_engine_reference import assert_mixed_batch_equals_hf_peft, random_prompts
from tests.test_lora_ops import POPULARITY, check_op, packed_case, reference, stacked_weights
from tests.test_lora_sgmv import check_sgmv, oracle_case, rank_major, sgmv_build  # noqa: F401 (a fixture)


@pytest.fixture(scope="module", autouse=True)
def sgmv_kernel():  # noqa: ANN201
    assert lora_sgmv.kernel() is not None, "the LoRA sgmv kernel must build on an AVX2 machine with a compiler"


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
@pytest.mark.parametrize(("in_f", "out_f"), [(43, 37), (136, 200)])
def test_bfloat16_weights_match_float64_loop(popularity: str, num_tokens: int, in_f: int, out_f: int,
                                             sgmv_build: str) -> None:  # noqa: F811
    """sgmv (each build: widened 8 or 16 bf16 at a time, the tails one by one) and every torch method."""
    # the float64 oracle of the bfloat16 values
    y0, x, a, b, ranks, batch, expected = oracle_case("bf16", popularity, num_tokens, in_f, out_f, torch.bfloat16)
    check_sgmv(y0, x, a, rank_major(b), ranks, batch, None, expected, strided_y=True)
    for method in LORA_METHODS:
        check_op(y0, x, a, b, ranks, batch, expected, method)


@pytest.mark.parametrize("block_ranks", [[(3, 5, 2), (8, 0, 4), (1, 1, 1)], [(0, 0, 0), (16, 16, 16), (0, 0, 0)]])
def test_bfloat16_packed_blocks(block_ranks: list[tuple[int, ...]]) -> None:
    seqs = [(0, 5), (None, 2), (2, 5), (1, 5), (0, 3), (2, 1)]
    y0, x, a, b, ranks, slot_blocks, batch = packed_case(block_ranks, (72, 24, 9), seqs, seed=5)
    a, b = a.bfloat16(), b.bfloat16()
    expected = reference(y0, x, a, b, ranks, batch.token_slots)
    check_sgmv(y0, x, a, rank_major(b), ranks, batch, slot_blocks, expected, strided_y=True)
    for method in LORA_METHODS:
        check_op(y0, x, a, b, ranks, batch, expected, method, slot_blocks=slot_blocks)


def test_mixed_weight_dtypes_run_the_torch_ops() -> None:
    """A bfloat16 A with a float32 B is no layout the kernel reads: the torch ops compute it, upcast."""
    gen = torch.Generator().manual_seed(3)
    a, b = stacked_weights(2, {0, 1}, [4, 6], 8, 16, 12, torch.float32, gen)
    a, b = a.bfloat16(), rank_major(b)
    ranks_table, blocks_table = slot_tables([4, 6], 12, None, 1, "cpu")
    batch = build_lora_batch(BatchMapping((0, None, 1, 1)), {0: 0, 1: 1}, 0)
    x, y0 = torch.randn(4, 16, generator=gen), torch.randn(4, 12, generator=gen)
    assert lora_sgmv.takes(y0, x, a, b.bfloat16()) and not lora_sgmv.takes(y0, x, a, b)
    y = y0.clone()
    lora_sgmv.add_lora_sgmv(y, x, a, b, [4, 6], ranks_table, blocks_table, batch)
    expected = reference(y0, x, a, b, [4, 6], batch.token_slots)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


def test_lora_linear_rounds_on_slot_write_and_rewrites_show_through() -> None:
    gen = torch.Generator().manual_seed(11)
    layer = LoRALinear(64, (48, 16), ("gate_proj", "up_proj"), 3, 16)
    layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / 8)
    model = torch.nn.ModuleList([layer])
    use_lora_dtype(model, torch.bfloat16)
    assert layer.lora_a.dtype is torch.bfloat16 and layer.lora_b.dtype is torch.bfloat16
    assert layer.lora_b.stride(1) == 1, "B stays rank-major"
    batch = build_lora_batch(BatchMapping((0, None, 1, 1, 0)), {0: 0, 1: 2}, 0)
    x = torch.randn(5, 64, generator=gen)
    for _ in range(2):  # the second round rewrites both slots: no cached copy of the first may survive
        pairs = {s: {"gate_proj": (torch.randn(r, 64, generator=gen) / 8, torch.randn(48, r, generator=gen)),
                     "up_proj": (torch.randn(r, 64, generator=gen) / 8, torch.randn(16, r, generator=gen))}
                 for s, r in ((0, 7), (2, 13))}
        for slot, p in pairs.items():
            layer.set_slot(slot, p)
        base = x.double() @ layer.weight.double().t()
        expected = base.clone()
        for row, slot in enumerate((0, None, 2, 2, 0)):
            if slot is not None:
                expected[row] += torch.cat([b.bfloat16().double() @ (a.bfloat16().double() @ x[row].double())
                                            for a, b in pairs[slot].values()])
        for kernels in ("torch", "sgmv"):
            use_lora_kernels(model, kernels, max_tokens=8)
            torch.testing.assert_close(layer(x, batch).double(), expected, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="already holds an adapter"):
        use_lora_dtype(model, torch.float32)


def bfloat16_exact(folder: Path, out: Path) -> Path:
    """A copy of the PEFT adapter at ``folder`` with every weight rounded to bfloat16 (stored as float32).
    Its alpha / r is a power of two, so the scale-folded B is bfloat16-exact too."""
    config = json.loads((folder / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    assert scale == 2.0 ** round(torch.tensor(scale).log2().item()), "the fold must stay exact"
    out.mkdir(parents=True)
    (out / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "adapter_model.safetensors")
    save_file({k: v.bfloat16().float() for k, v in tensors.items()}, out / "adapter_model.safetensors")
    return out


@pytest.fixture(scope="module")
def exact_adapters(tiny_llama_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bf16-exact")
    return {name: bfloat16_exact(folder, root / name) for name, folder in tiny_llama_adapters.items()}


@pytest.mark.parametrize("kernels", ["sgmv", "torch"])
def test_engine_with_bfloat16_adapters_equals_hf_peft(tiny_llama: Path, exact_adapters: dict[str, Path],
                                                      kernels: str) -> None:
    assert_mixed_batch_equals_hf_peft(tiny_llama, exact_adapters, num_prompts=8, lora_dtype="bfloat16",
                                      lora_kernels=kernels)


def test_host_tier_and_slots_hold_bfloat16(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    held = {}
    for dtype in EngineConfig.LORA_DTYPES:
        llm = LLM(model=str(tiny_llama), max_loras=2, kv_cache_blocks=16, lora_dtype=dtype)
        llm.load_adapter("r8_all", tiny_llama_adapters["r8_all"])
        host = llm.engine.adapters.host
        weights = host.get(host.ids()[0])
        assert {t.dtype for pair in weights.modules.values() for t in pair} == {getattr(torch, dtype)}
        linear = next(m for m in llm.engine.model.modules() if isinstance(m, LoRALinear))
        assert linear.lora_a.dtype is getattr(torch, dtype) and linear.dora_scale.dtype is torch.float32
        held[dtype] = host.nbytes
    assert held["bfloat16"] * 2 == held["float32"]


def test_bad_lora_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match=r"EngineConfig.lora_dtype must be one of \('float32', 'bfloat16'\), "
                                         r"got 'float16'"):
        EngineConfig(lora_dtype="float16")
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "m", "--lora-dtype", "bfloat16"])
    assert engine_config(args, parser).lora_dtype == "bfloat16"
    assert engine_config(parser.parse_args(["serve", "--model", "m"]), parser).lora_dtype == "float32"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--lora-dtype", "fp8"])


def bfloat16_as_held(folder: Path, out: Path) -> Path:
    """The PEFT adapter at ``folder`` as ``lora_dtype="bfloat16"`` holds it: A rounded to bfloat16, B rounded
    after its scale (alpha / r) is folded in, then divided by the scale again in float32, so that PEFT (which
    applies the scale) computes with the held values up to float32 rounding."""
    config = json.loads((folder / "adapter_config.json").read_text())
    assert not config.get("use_rslora") and not config.get("alpha_pattern")
    scale = config["lora_alpha"] / config["r"]
    out.mkdir(parents=True)
    (out / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "adapter_model.safetensors")
    save_file({k: v.bfloat16().float() if "lora_A" in k else (v * scale).bfloat16().float() / scale
               for k, v in tensors.items()}, out / "adapter_model.safetensors")
    return out


def test_non_exact_bfloat16_adapters_equal_the_rounded_reference(tiny_llama: Path,
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """float32 adapters whose weights bfloat16 cannot hold, with a scale of 3 (the fold is not exact either):
    the engine's prefill logits are within 1e-4 relative of HF + PEFT on the weights as rounded (and its greedy
    tokens equal that reference's), while the unrounded float32 reference is measurably farther off."""
    root = tmp_path_factory.mktemp("bf16-non-exact")
    originals = {"all": write_peft_adapter(tiny_llama, root / "all", rank=8, alpha=24, seed=5),
                 "attn": write_peft_adapter(tiny_llama, root / "attn", rank=4, alpha=12, seed=6,
                                            target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))}
    held = {name: bfloat16_as_held(folder, root / f"{name}-held") for name, folder in originals.items()}
    llm = LLM(model=str(tiny_llama), max_loras=2, kv_cache_blocks=64, lora_dtype="bfloat16", debug_checks=True)
    for name, folder in originals.items():
        llm.load_adapter(name, folder)
    prompts = random_prompts(2, seed=11)
    captured = capture_step_logits(llm.engine)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                        adapters=list(originals), use_tqdm=False)
    for row, (prompt, name) in enumerate(zip(prompts, originals, strict=True)):
        ours = captured[0][row]
        for folder, close in ((held[name], True), (originals[name], False)):
            model = hf_model(tiny_llama, folder)
            ref = hf_logits(model, prompt)[-1]
            model.unload()
            bound = 1e-4 * float(ref.abs().max())
            assert (float((ours - ref).abs().max()) <= bound) == close, (name, folder.name)
        assert outs[row].token_ids == with_adapter(tiny_llama, held[name], [prompt], 8)[0], name
