"""The embedding's and lm_head's per-slot adapter parts (``VocabSlot``) against float64 references:
replaced rows (a few, or the whole matrix), added tokens beyond the base vocabulary, LoRA and DoRA,
several slots and base rows in one batch; base rows stay bit for bit the plain embedding / GEMM, and
rows of narrower vocabularies get -inf for the added columns."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.layers.embedding import VocabEmbedding
from loraplex.layers.lm_head import LMHeadSlots
from loraplex.layers.vocab_slot import VocabSlot
from loraplex.ops.lora_batch import BatchMapping, build_lora_batch

V, H, R = 50, 8, 3


def parts(gen: torch.Generator, embed: bool) -> dict[int, dict]:
    """Per slot: vocabulary, replaced/added rows, LoRA (A [r, in], B [out, r]) and DoRA scale."""
    def lora(v: int) -> tuple[torch.Tensor, torch.Tensor]:
        a_in, b_out = (v, H) if embed else (H, v)
        return torch.randn(R, a_in, generator=gen) * 0.3, torch.randn(b_out, R, generator=gen) * 0.3

    ids = torch.tensor([2, 7, 31, 50, 51])  # two added tokens
    return {
        0: dict(vocab=52, ids=ids, rows=torch.randn(5, H, generator=gen), lora=lora(52), scale=None),
        1: dict(vocab=V, ids=torch.arange(V), rows=torch.randn(V, H, generator=gen), lora=None,
                scale=0.5 + torch.rand(H if embed else V, generator=gen)),  # the whole matrix, DoRA
        2: dict(vocab=V, ids=None, rows=None, lora=lora(V), scale=0.5 + torch.rand(H if embed else V, generator=gen)),
    }


def served_matrix(weight: torch.Tensor, p: dict) -> torch.Tensor:
    m = torch.zeros(p["vocab"], H, dtype=torch.float64)
    m[:V] = weight.double()
    if p["rows"] is not None:
        m[p["ids"]] = p["rows"].double()
    return m


def build(p: dict) -> VocabSlot:
    return VocabSlot.build(p["vocab"], p["ids"], p["rows"], p["lora"], p["scale"], torch.float32, "cpu")


def batch(token_slots: list[int]):
    return build_lora_batch(BatchMapping(tuple(None if s < 0 else s for s in token_slots)), {0: 0, 1: 1, 2: 2}, 1)


def test_embedding_slots_equal_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    embedding = VocabEmbedding(V, H, 4, torch.float32, "cpu")
    embedding.weight.copy_(torch.randn(V, H, generator=gen))
    slots = parts(gen, embed=True)
    for s, p in slots.items():
        embedding.set_slot(s, build(p))
    token_slots = [0, 0, -1, 1, 2, 0, -1, 2, 1, 0]
    ids = torch.tensor([2, 51, 4, 7, 9, 3, 11, 31, 49, 50])  # slot 0 reads replaced, base and added rows
    with torch.inference_mode():
        out = embedding(ids, batch(token_slots))
    for t, (s, i) in enumerate(zip(token_slots, ids.tolist(), strict=True)):
        if s < 0:
            assert torch.equal(out[t], F.embedding(ids[t : t + 1], embedding.weight)[0])
            continue
        p = slots[s]
        e = served_matrix(embedding.weight, p)[i]
        if p["lora"] is not None:
            a, b = (w.double() for w in p["lora"])
            e = e + b @ a[:, i]
        if p["scale"] is not None:
            e = e * p["scale"].double()
        torch.testing.assert_close(out[t].double(), e, rtol=1e-6, atol=1e-6)


def test_lm_head_slots_equal_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(V, H, generator=gen)
    head = LMHeadSlots(4)
    slots = parts(gen, embed=False)
    for s, p in slots.items():
        head.set_slot(s, build(p))
    token_slots = [2, -1, 0, 1, 0, -1, 2]  # one logits row per token here
    hidden = torch.randn(len(token_slots), H, generator=gen)
    base = hidden @ weight.t()
    with torch.inference_mode():
        out = head.apply(base.clone(), hidden, torch.arange(len(token_slots)), batch(token_slots))
    assert out.shape == (len(token_slots), 52)
    for t, s in enumerate(token_slots):
        if s < 0:
            assert torch.equal(out[t, :V], base[t]) and bool((out[t, V:] == float("-inf")).all())
            continue
        p = slots[s]
        z = served_matrix(weight, p) @ hidden[t].double()
        if p["lora"] is not None:
            a, b = (w.double() for w in p["lora"])
            z = z + b @ (a @ hidden[t].double())
        if p["scale"] is not None:
            z = z * p["scale"].double()
        torch.testing.assert_close(out[t, : p["vocab"]].double(), z, rtol=1e-6, atol=1e-5)
        assert bool((out[t, p["vocab"] :] == float("-inf")).all())
    assert head.apply(base, hidden, torch.arange(len(token_slots)), batch([-1] * len(token_slots))) is base
