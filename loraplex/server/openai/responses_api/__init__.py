"""OpenAI's Responses API (``POST /v1/responses``) over the chat path: ``request.py`` turns a Responses body
(and the stored conversation of its ``previous_response_id``) into a chat completion body, ``output.py``
turns the chat answer back into a Response object or its stream of typed events, ``store.py`` keeps
responses per tenant (LRU, size cap, TTL) for ``previous_response_id`` and ``GET``/``DELETE``."""
