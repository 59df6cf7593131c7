"""The layers every family is built from, each reading the step's ``LoRABatch``: ``lora_linear.py`` (a base
projection plus its adapter slots), ``attention.py`` / ``self_attention.py`` (paged attention and the
attention block), ``mlp.py``, ``norms.py``, ``rotary.py``, and the vocabulary ends ``embedding.py``,
``lm_head.py``, ``vocab_slot.py`` (an adapter's own embed_tokens/lm_head rows)."""
