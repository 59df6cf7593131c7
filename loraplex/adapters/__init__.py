"""Adapters as the engine serves them: names -> versions (``versions.py``), the tiers a version lives in
(host memory ``host_cache.py``, device slots ``slots.py``, pins), ``manager.py`` over all of them, the
per-step slot indices keyed on the slot-table version (``batch_indices.py``), background re-reads and
read-ahead, integrity checks and snapshots. ``reading/`` turns a PEFT folder into validated weights."""
