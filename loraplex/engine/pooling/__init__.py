"""Pooling requests (embeddings): ``params.py`` (``PoolingParams``: what a request pools and how, its limits;
a shared type the server imports), ``pooler.py`` (the pooler math over a step's final hidden states, and each
pooled request's running pool across its prefill chunks)."""
