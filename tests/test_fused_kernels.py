"""The fused CPU step kernels against the unfused ops they replace, on random inputs: ``add_rms_norm`` (the
residual add and the next RMSNorm in one pass) and ``decode_attention_qkv`` (rotary, the K/V write and
decode attention from the packed q/k/v output). Both must round exactly as the separate kernels do (the
model's outputs do not move), and stay within float32 rounding of the torch ops and float64."""

from __future__ import annotations

import pytest
import torch

from loraplex.config import ModelConfig
from loraplex.engine.runner import StepEntry, prepare_step
from loraplex.layers import attention as attention_module
from loraplex.layers.norms import RMSNorm
from loraplex.layers.rotary import apply_rotary
from loraplex.ops import cpu_kernels
from tests.fixtures import tiny_config


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("n", [576, 13])
def test_add_rms_norm_equals_the_add_then_the_norm(kernels, offset: float, n: int) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(n + int(offset))
    residual = torch.randn(7, n + 3, generator=g)[:, 3:] * 2  # strided rows
    x = torch.randn(7, n, generator=g)
    norm = RMSNorm(n, 1e-5, torch.float32, "cpu", offset=offset)
    norm.weight.copy_(torch.randn(n, generator=g))
    hidden = residual + x
    expected = kernels.rms_norm(hidden, norm.weight, norm.eps, norm.offset)
    x_in = x.clone()
    got = kernels.add_rms_norm(x_in, residual, norm.weight, norm.eps, norm.offset)
    assert torch.equal(x_in, hidden) and torch.equal(got, expected)  # x holds the new residual, bit for bit
    h64 = residual.double() + x.double()
    ref = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5) * (offset + norm.weight.double())
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    h, normed = norm.add_and_norm(x.clone(), residual)  # the layer's entry point runs the kernel
    assert torch.equal(h, hidden) and torch.equal(normed, expected)


def test_add_and_norm_torch_path_matches(kernels, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(3)
    residual, x = torch.randn(5, 40, generator=g), torch.randn(5, 40, generator=g)
    norm = RMSNorm(40, 1e-6, torch.float32, "cpu")
    norm.weight.copy_(torch.randn(40, generator=g))
    fused_h, fused = norm.add_and_norm(x.clone(), residual)
    monkeypatch.setattr(cpu_kernels, "for_tensors", lambda *tensors: None)
    x_in = x.clone()
    h, normed = norm.add_and_norm(x_in, residual)
    assert torch.equal(x_in, x)  # the torch path leaves x alone
    assert torch.equal(h, fused_h)
    torch.testing.assert_close(normed, fused, rtol=1e-6, atol=1e-6)


def test_add_rms_norm_rejects_mismatched_rows(kernels) -> None:  # noqa: ANN001
    with pytest.raises(RuntimeError, match="x and residual shapes differ"):
        kernels.add_rms_norm(torch.zeros(3, 8), torch.zeros(2, 8), torch.ones(8), 1e-6, 0.0)


def decode_case(heads: int, kv_heads: int, d: int, window: int | None):  # noqa: ANN201
    """A decode-only step of four sequences (contexts ending inside and at block edges) and its inputs."""
    bs = 4
    raw = tiny_config("mistral", hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      sliding_window=window).to_dict()
    cfg = ModelConfig.from_hf(raw)
    entries = [StepEntry((1,), 9, (7, 2, 11)), StepEntry((1,), 0, (9,)), StepEntry((1,), 4, (5, 3)),
               StepEntry((1,), 11, (4, 0, 6))]
    step = prepare_step(entries, bs, cfg, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(heads * 10 + d)
    qkv = torch.randn(len(entries), (heads + 2 * kv_heads) * d + 5, generator=g)[:, 5:]  # strided rows
    angles = torch.randn(len(entries), 1, d // 2, generator=g)
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((-angles.sin(), angles.sin()), -1)
    cache = torch.randn(13, 2, kv_heads, bs, d, generator=g)
    return step.attn, qkv, cos, sin, cache


@pytest.mark.parametrize(("heads", "kv_heads", "d", "window"), [(9, 3, 64, None), (6, 2, 10, 3), (5, 5, 8, None),
                                                                 (8, 1, 16, 6)])
def test_decode_attention_qkv_equals_rotary_then_attention(kernels, heads: int, kv_heads: int, d: int,  # noqa: ANN001
                                                           window: int | None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Bit for bit the rotary kernel and paged_attention's decode kernel (output and cache); within float32
    rounding of the torch ops (rotary, the gather path)."""
    attn, qkv, cos, sin, cache = decode_case(heads, kv_heads, d, window)
    t = qkv.shape[0]
    qk = apply_rotary(qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d), cos, sin)
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    expect_cache = cache.clone()
    expected = attention_module.paged_attention(qk[:, :heads], qk[:, heads:], v, expect_cache, attn, window)
    got = attention_module.fused_decode_attention(qkv, cos, sin, cache, attn, heads, window)
    assert got.shape == (t, heads * d)
    assert torch.equal(cache, expect_cache) and torch.equal(got, expected.reshape(t, heads * d))
    monkeypatch.setattr(cpu_kernels, "for_tensors", lambda *tensors: None)
    assert attention_module.fused_decode_attention(qkv, cos, sin, cache, attn, heads, window) is None
    torch_cache = cache.clone()
    qk_torch = apply_rotary(qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d), cos, sin)
    torch_out = attention_module.paged_attention(qk_torch[:, :heads], qk_torch[:, heads:], v, torch_cache, attn, window)
    torch.testing.assert_close(got, torch_out.reshape(t, heads * d), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, torch_cache, rtol=1e-6, atol=1e-6)


def test_decode_attention_qkv_rejects_bad_shapes(kernels) -> None:  # noqa: ANN001
    attn, qkv, cos, sin, cache = decode_case(6, 2, 10, None)
    keys = attn.plan(None).decode
    with pytest.raises(RuntimeError, match="not \\(heads \\+ 2 KV heads\\) \\* head_dim"):
        kernels.decode_attention_qkv(qkv, cos, sin, cache, keys.block_tables, keys.first, keys.end, 1.0, 5)
    with pytest.raises(RuntimeError, match="cos and signed_sin"):
        kernels.decode_attention_qkv(qkv, cos[:2], sin, cache, keys.block_tables, keys.first, keys.end, 1.0, 6)
