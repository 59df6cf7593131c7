"""GGUF block weights (loraplex.ops.gguf): the torch restatement of the block formats against
``gguf.quants.dequantize`` (bitwise), and each kernel build against the float64 product on the dequantized
weights, every tile shape, with the result of a row independent of its batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from loraplex.ops.gguf import block_weight
from loraplex.ops.gguf.block_weight import BlockWeight, kernel, kernel_build
from loraplex.ops.gguf.formats import NATIVE_TYPES, dequantize
from tests.gguf_fixtures import checked_kernel_product

TYPES = [t for t in NATIVE_TYPES if not t.endswith("_K")]  # K-quants: tests/test_gguf_kquant.py
BUILDS = ["avx2", "avx512"] if torch.backends.cpu.get_cpu_capability() == "AVX512" else ["avx2"]


def blocks(rows: int, cols: int, qtype: str, seed: int) -> torch.Tensor:
    """Random weights quantized by gguf: uint8 ``[rows, cols / 32 * block bytes]``; a zero row and a row of
    large values included."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    w[0] = 0.0
    if rows > 1:
        w[1] *= 40.0
    return torch.from_numpy(gguf_quantize(w, getattr(GGMLQuantizationType, qtype)))


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_bitwise_gguf(qtype: str) -> None:
    data = blocks(19, 96, qtype, seed=1)
    expected = gguf_dequantize(data.numpy(), getattr(GGMLQuantizationType, qtype))
    assert torch.equal(dequantize(data, qtype), torch.from_numpy(expected))


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_builds_match_float64_and_do_not_depend_on_the_batch(isa: str, qtype: str) -> None:
    """Shapes that exercise every tile (1-33 rows: the decode tile, full and partial row tiles, the
    dequantized panels from ``panel_min_rows`` rows on; output rows not a multiple of 4 or 8), strided x,
    with and without bias, each batch against float64; below ``panel_min_rows`` every row of a batch bitwise
    equal to that row multiplied alone."""
    module = kernel_build(isa)
    assert module is not None
    type_id = NATIVE_TYPES[qtype][0]
    gen = torch.Generator().manual_seed(7)
    for n, k in ((5, 32), (37, 96), (64, 64), (131, 160)):
        data, bias = blocks(n, k, qtype, seed=n), torch.randn(n, generator=gen)
        x = torch.randn(33, k + 3, generator=gen)[:, 3:]  # strided rows, as in the model
        w = dequantize(data, qtype).double()
        for b in (bias, None):
            full, expected = checked_kernel_product(module, x, data, type_id, w, b)
            alone = torch.empty(33, n)
            for r in range(33):
                module.linear_into(x[r : r + 1], data, type_id, alone[r : r + 1], b)
            for rows in (1, 2, 3, 4, 5, 7, 8, 12, 32):
                part = torch.empty(rows, n)
                module.linear_into(x[:rows], data, type_id, part, b)
                torch.testing.assert_close(part.double(), expected[:rows], rtol=1e-5,
                                           atol=1e-5 * float(expected.abs().max()))
                if rows < module.panel_min_rows:
                    assert torch.equal(part, alone[:rows]), (n, k, rows)


def test_segments_write_their_own_columns_and_the_fallback_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight joined from rows of three types (q/k/v of a Q4_K_M-like file) equals the float product on the
    concatenated dequantized rows, in the kernel and in the dequantizing fallback (no kernel)."""
    parts = [("Q4_0", blocks(24, 64, "Q4_0", 1)), ("Q4_0", blocks(8, 64, "Q4_0", 2)),
             ("Q8_0", blocks(8, 64, "Q8_0", 3)), ("Q4_1", blocks(13, 64, "Q4_1", 4))]
    weight = BlockWeight.from_rows(parts, 64)
    assert [s.qtype for s in weight.segments] == ["Q4_0", "Q8_0", "Q4_1"] and weight.out_features == 53
    dense = torch.cat([dequantize(d, t) for t, d in parts])
    assert torch.equal(weight.dense(), dense)
    x, bias = torch.randn(6, 64), torch.randn(53)
    expected = x.double() @ dense.double().t() + bias.double()
    got = weight.linear(x, bias)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    monkeypatch.setattr(block_weight, "kernel", lambda: None)
    torch.testing.assert_close(weight.linear(x, bias).double(), expected, rtol=1e-5,
                               atol=1e-5 * float(expected.abs().max()))


def test_kernel_is_used_on_avx2() -> None:
    """On this project's CPUs the kernel must build (the fallback only serves other CPUs)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2: the dequantizing path serves GGUF blocks")
    assert kernel() is kernel_build(BUILDS[-1]) and kernel() is not None


def test_bad_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="uint8"):
        BlockWeight.from_rows([("Q4_0", blocks(4, 64, "Q4_0", 1)[:, :-1])], 64)
    with pytest.raises(ValueError, match="not a natively served"):
        BlockWeight.from_rows([("Q5_0", torch.zeros(4, 176, dtype=torch.uint8))], 256)
