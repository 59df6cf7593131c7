"""The OpenAI-compatible HTTP server: ``app.py`` (wiring), ``context.py`` (what routes share; the one
place ``model`` becomes a version), ``routes/`` (by concept), ``openai/`` (the wire format),
``prepare/`` (parsing, templates, tokenization in workers), ``tenancy/`` (keys, access, quotas),
``generation.py`` (submit and answer), lifecycle, limits and metrics."""
