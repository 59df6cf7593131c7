"""Model families and their checkpoints: ``base.py`` (what every family shares), ``families/`` (one module per
family: llama, qwen3, gemma2, gemma3, phi3, granite, smollm3, qwen3_moe, granite_moe) and ``registry.py``
(architecture -> family); ``loader.py`` (safetensors into the packed weights), ``embedded.py`` (the default
model), ``fingerprint.py`` (a checkpoint's identity), ``fold.py`` / ``slot_writer.py`` (an adapter version
prepared against the base and written into a slot)."""
