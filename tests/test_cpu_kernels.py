"""The CPU step kernels (``loraplex.ops.cpu_kernels``) against float64 references and against the torch
ops they replace, on shapes that exercise their tails: head groups past the register tile, head dims
and row lengths that are not multiples of the vector width, strided inputs, contexts that start and end
inside a block."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loraplex.layers import rotary as rotary_module
from loraplex.layers.norms import RMSNorm
from loraplex.ops import cpu_kernels


def decode_reference(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, first: list[int], end: list[int],
                     scale: float) -> torch.Tensor:
    """Float64 loop: each sequence's query heads against its keys at positions [first, end)."""
    seqs, heads, d = q.shape
    kv_heads, bs = cache.shape[2], cache.shape[3]
    out = torch.empty(seqs, heads, d, dtype=torch.float64)
    for s in range(seqs):
        at = [(int(tables[s, p // bs]), p % bs) for p in range(first[s], end[s])]
        for h in range(heads):
            k = torch.stack([cache[b, 0, h // (heads // kv_heads), o] for b, o in at]).double()  # [n, d]
            v = torch.stack([cache[b, 1, h // (heads // kv_heads), o] for b, o in at]).double()
            out[s, h] = torch.softmax(k @ q[s, h].double() * scale, 0) @ v
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "d", "bs"), [(9, 3, 64, 16), (4, 4, 12, 4), (10, 2, 20, 8),
                                                             (16, 2, 8, 16), (6, 1, 40, 5)])
def test_paged_decode_attention_matches_float64(kernels, heads: int, kv_heads: int, d: int, bs: int) -> None:  # noqa: ANN001
    """Group sizes 3, 1, 5 (a chunk of 4 then 1), 8 and 6; head dims 64, 12, 20, 8, 40; windows starting
    mid-block; query rows strided as the model's q is (a view of the q/k block)."""
    g = torch.Generator().manual_seed(heads * 100 + d)
    blocks = 40
    cache = torch.randn(blocks, 2, kv_heads, bs, d, generator=g)
    end = [1, bs, bs + 1, 3 * bs + 2, 7 * bs - 1]
    first = [0, 0, 1, bs + 3, 2 * bs]
    tables = torch.randperm(blocks, generator=g)[: 5 * 7].view(5, 7).contiguous()
    q = torch.randn(5, heads + kv_heads, d, generator=g)[:, :heads]
    scale = d**-0.5 * 1.3
    got = kernels.paged_decode_attention(q, cache, tables, torch.tensor(first), torch.tensor(end), scale)
    torch.testing.assert_close(got.double(), decode_reference(q, cache, tables, first, end, scale), rtol=0, atol=1e-5)


def test_paged_decode_attention_rejects_reads_outside_the_table(kernels) -> None:  # noqa: ANN001
    cache = torch.zeros(4, 2, 1, 4, 8)
    q = torch.zeros(1, 2, 8)
    tables = torch.tensor([[3, 9]])
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernels.paged_decode_attention(q, cache, tables, torch.tensor([0]), torch.tensor([6]), 1.0)
    with pytest.raises(RuntimeError, match="outside its table"):
        kernels.paged_decode_attention(q, cache, tables, torch.tensor([0]), torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="q and cache shapes disagree"):
        kernels.paged_decode_attention(torch.zeros(1, 2, 4), cache, tables, torch.tensor([0]), torch.tensor([2]), 1.0)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("n", [576, 13])
def test_rms_norm_matches_float64_and_torch(kernels, offset: float, n: int) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(n)
    x = torch.randn(7, n + 5, generator=g)[:, 5:] * 3  # strided rows
    norm = RMSNorm(n, 1e-6, torch.float32, "cpu", offset=offset)
    norm.weight.copy_(torch.randn(n, generator=g))
    got = kernels.rms_norm(x, norm.weight, norm.eps, norm.offset)
    x64 = x.double()
    expected = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + norm.weight.double())
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(norm(x), got)  # the layer runs the kernel on such rows
    torch.testing.assert_close(norm(x.unsqueeze(0))[0], got, rtol=1e-6, atol=1e-6)  # [1, T, n]: the torch ops


@pytest.mark.parametrize("half", [1536, 21])
def test_silu_mul_matches_float64_and_torch(kernels, half: int) -> None:  # noqa: ANN001
    x = torch.randn(5, 2 * half + 3, generator=torch.Generator().manual_seed(half))[:, 3:] * 4
    got = kernels.silu_mul(x)
    gate, up = x[:, :half].double(), x[:, half:].double()
    torch.testing.assert_close(got.double(), gate * torch.sigmoid(gate) * up, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, F.silu(x[:, :half]) * x[:, half:], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("d", [64, 10])
def test_rotary_matches_float64_and_torch(kernels, d: int, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(d)
    x = torch.randn(6, 5, d, generator=g)[:, 1:4]  # [T, 3, d], strided as a view of the q/k block
    angles = torch.randn(6, 1, d // 2, generator=g)
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((-angles.sin(), angles.sin()), -1)
    got = kernels.rotary(x, cos, sin)
    x1, x2 = x[..., : d // 2].double(), x[..., d // 2 :].double()
    expected = x.double() * cos.double() + torch.cat((-x2, x1), -1) * torch.cat((angles, angles), -1).sin().double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(rotary_module.apply_rotary(x, cos, sin), got)
    monkeypatch.setattr(cpu_kernels, "for_tensors", lambda *tensors: None)
    torch.testing.assert_close(rotary_module.apply_rotary(x, cos, sin), got, rtol=1e-6, atol=1e-6)


FALLBACK_SCRIPT = textwrap.dedent("""
    import torch
    from loraplex.layers.norms import RMSNorm
    from loraplex.ops import cpu_kernels, int8

    assert cpu_kernels.kernels() is None and cpu_kernels.for_tensors(torch.zeros(1)) is None
    assert int8.kernel() is None and not int8.Int8Weight.from_float(torch.randn(4, 8)).packed
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    expected = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    # float32 math against the float64 loop: float32's own tolerances (rtol 1.3e-6, atol 1e-5)
    torch.testing.assert_close(RMSNorm(16, 1e-6, torch.float32, "cpu")(x), expected.float())
""")


def test_a_missing_compiler_leaves_the_torch_ops(tmp_path: Path) -> None:
    """A fresh machine without a C++ compiler (CXX names none, an empty extension cache): both kernel
    modules log why and are None, and the layers run their torch ops (the model-level tests hold those
    to HF, see ``use_decode_path`` in test_runner.py)."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CPU step kernels unavailable" in proc.stderr and "the torch ops run instead" in proc.stderr
