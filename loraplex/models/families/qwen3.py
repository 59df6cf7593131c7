"""Qwen3 (dense: 0.6B to 32B): a Llama-style block with a per-head RMSNorm on q and k before rope.

No q/k/v bias (``attention_bias`` is false in every released config), tied (0.6B-4B) or untied
embeddings, ``head_dim`` set explicitly (128, not ``hidden / heads``), and Qwen's sliding-window
switch (``use_sliding_window`` + ``max_window_layers``, off in the released checkpoints) handled by
``ModelConfig``. The seven projections, and their PEFT target names, are Llama's.
"""

from __future__ import annotations

from loraplex.models.families.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Serves ``Qwen3ForCausalLM`` checkpoints: modules ``layers.N.self_attn.{q,k}_norm`` besides Llama's."""

    qk_norm = True
