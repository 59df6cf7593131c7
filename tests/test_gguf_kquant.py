"""GGUF K-quants (``Q4_K``, ``Q5_K``, ``Q6_K``) served in their super-blocks: the torch restatement against
``gguf.quants.dequantize`` (bitwise, random bytes with finite float16 scales), each kernel build against the
float64 product on the dequantized weights (every tile shape, odd N, a row's result independent of its batch),
the dispatch of a mixed packed layer, the fallback of a layer holding a type not served natively, and a
truncated K-quant tensor as a clear error. Loading a K-quant file against HF: tests/test_gguf_loading.py."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from loraplex.models.gguf.reader import GGUFError
from loraplex.models.loader import load_model
from loraplex.ops.gguf import block_weight, kquant_kernel
from loraplex.ops.gguf.block_weight import BlockWeight
from loraplex.ops.gguf.formats import K_TYPES, NATIVE_TYPES, dequantize
from tests.fixtures import write_tiny_model
from tests.gguf_fixtures import checked_kernel_product, random_k_blocks, write_tiny_gguf

TYPES = sorted(K_TYPES)
BUILDS = ["avx2", "avx512"] if torch.backends.cpu.get_cpu_capability() == "AVX512" else ["avx2"]


def k_blocks(rows: int, cols: int, qtype: str, seed: int) -> torch.Tensor:
    """Random valid ``qtype`` rows (any bytes, finite float16 scales of either sign)."""
    data = random_k_blocks(rows, cols, qtype, seed)
    blocks = data.reshape(rows, cols // 256, -1)
    sign = np.random.default_rng(seed + 100).choice([-1.0, 1.0], blocks.shape[:2])
    for offset in ((208,) if qtype == "Q6_K" else (0, 2)):
        scale = blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0] * sign * 50
        blocks[..., offset : offset + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(data)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_bitwise_gguf(qtype: str) -> None:
    data = k_blocks(19, 768, qtype, seed=1)
    expected = gguf_dequantize(data.numpy(), getattr(GGMLQuantizationType, qtype))
    assert np.isfinite(expected).all()
    assert torch.equal(dequantize(data, qtype), torch.from_numpy(expected))


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_builds_match_float64_and_do_not_depend_on_the_batch(isa: str, qtype: str) -> None:
    """Odd N (full and partial weight-row tiles), K = 256 and 768, strided x, with and without bias; rows
    1, 2, 5, 7, 32 of a batch bitwise equal to the same rows in a batch of 33."""
    module = kquant_kernel.kernel_build(isa)
    assert module is not None
    type_id = NATIVE_TYPES[qtype][0]
    gen = torch.Generator().manual_seed(7)
    for n, k in ((5, 256), (37, 768), (13, 512)):
        data, bias = k_blocks(n, k, qtype, seed=n), torch.randn(n, generator=gen)
        x = torch.randn(33, k + 3, generator=gen)[:, 3:]
        w = dequantize(data, qtype).double()
        for b in (bias, None):
            full, expected = checked_kernel_product(module, x, data, type_id, w, b)
            for rows in (1, 2, 5, 7, 32):
                part = torch.empty(rows, n)
                module.linear_into(x[:rows], data, type_id, part, b)
                assert torch.equal(part, full[:rows]), (n, k, rows)


def test_mixed_segments_dispatch_to_both_kernels_and_the_fallback_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q4_K_M-like packed q/k/v (Q4_K, Q4_K, Q6_K) and a Q8_0 segment: the float product on the
    concatenated dequantized rows, with the kernels and with the dequantizing fallback."""
    w8 = np.random.default_rng(4).standard_normal((9, 256)).astype(np.float32)
    q8 = torch.from_numpy(gguf_quantize(w8, GGMLQuantizationType.Q8_0))
    parts = [("Q4_K", k_blocks(16, 256, "Q4_K", 1)), ("Q4_K", k_blocks(8, 256, "Q4_K", 2)),
             ("Q6_K", k_blocks(8, 256, "Q6_K", 3)), ("Q8_0", q8)]
    weight = BlockWeight.from_rows(parts, 256)
    assert [s.qtype for s in weight.segments] == ["Q4_K", "Q6_K", "Q8_0"] and weight.out_features == 41
    dense = torch.cat([dequantize(d, t) for t, d in parts])
    x, bias = torch.randn(7, 256), torch.randn(41)
    expected = x.double() @ dense.double().t() + bias.double()
    tol = {"rtol": 1e-5, "atol": 1e-5 * float(expected.abs().max())}
    torch.testing.assert_close(weight.linear(x, bias).double(), expected, **tol)
    monkeypatch.setattr(kquant_kernel, "kernel", lambda: None)
    torch.testing.assert_close(weight.linear(x, bias).double(), expected, **tol)
    monkeypatch.setattr(block_weight, "kernel", lambda: None)
    torch.testing.assert_close(weight.linear(x, bias).double(), expected, **tol)


def test_k_rows_need_whole_super_blocks() -> None:
    with pytest.raises(ValueError, match="not a multiple of Q4_K's 256"):
        BlockWeight.from_rows([("Q4_K", torch.zeros(4, 144 // 2, dtype=torch.uint8))], 128)


@pytest.fixture(scope="module")
def kquant_with_q5_0(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama whose ffn_down is Q5_0 (llama.cpp's fallback where a K type does not fit), the rest K."""
    root = tmp_path_factory.mktemp("gguf-kq")
    hf = write_tiny_model(root / "hf", "llama", hidden_size=256, intermediate_size=256)
    (root / "gguf").mkdir()
    return write_tiny_gguf(hf, root / "gguf" / "m.gguf", {"default": "Q4_K", "ffn_down": "Q5_0",
                                                           "attn_v": "Q6_K", "token_embd": "Q6_K"}, tokenizer=False)


def test_a_layer_of_another_type_is_dequantized_with_a_logged_reason(kquant_with_q5_0: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="loraplex.models.gguf.loader"):
        model = load_model(kquant_with_q5_0, None, 1, 8, torch.float32, "cpu")
    down = model.layers[0].mlp.down_proj
    assert down.int8_weight is None and down.weight is not None
    assert isinstance(model.layers[0].mlp.gate_up_proj.int8_weight, BlockWeight)
    assert model.lm_head_int8.segments[0].qtype == "Q6_K"
    assert "ffn_down.weight is Q5_0, not served natively" in caplog.text


def test_truncated_k_quant_tensor_is_a_clear_error(kquant_with_q5_0: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(kquant_with_q5_0.read_bytes()[:-300])
    with pytest.raises(GGUFError, match=r"truncated: tensor 'output_norm\.weight'|truncated: tensor 'blk\."):
        load_model(bad, None, 1, 8, torch.float32, "cpu")
