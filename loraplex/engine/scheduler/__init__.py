"""What runs each step, and with which cached blocks: ``scheduler.py`` (continuous batching with
adapter-aware admission; owns each request's progress), ``fair_share.py`` (tenants), ``admission.py``
(the waiting bound), ``block_manager.py`` (KV blocks and the prefix-cache index), ``block_hash.py``
(prefix keys: tokens and adapter version)."""
