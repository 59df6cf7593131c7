"""Model families and their checkpoints: ``base.py`` (what every family shares), one file per family
(``llama.py``, ``qwen3.py``, ``gemma3.py``, ``phi3.py``) and ``registry.py`` (architecture -> family);
``loader.py`` (safetensors into the packed weights), ``embedded.py`` (the default model),
``fingerprint.py`` (a checkpoint's identity), ``fold.py`` / ``slot_writer.py`` (an adapter version
prepared against the base and written into a slot)."""
