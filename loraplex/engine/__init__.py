"""The engine core: what runs beside the step loop, in token ids only. ``engine.py`` (add / abort / step =
schedule -> run -> sample -> update), ``intake.py`` (a ``NewRequest`` holding its adapter version ->
a ``Request``), ``scheduler/`` (admission, fair share, KV blocks, prefix keys), ``runner.py`` and
``kv_cache.py`` (one forward over the ragged batch), ``sampling/`` (params, sampler, logits processors,
logprobs, structured outputs), ``wire.py`` (what a frontend and the engine process say to each other),
``core_process.py`` (the engine process's main), ``step_loop.py``, ``invariants.py``, ``stats.py``."""
