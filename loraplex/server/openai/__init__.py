"""OpenAI's wire format: request bodies (``protocol.py``, ``strict_fields.py``, ``structured.py``,
``tools.py``, ``tool_parsers/``), response bodies (``responses.py``, ``schemas.py``), the OpenAPI
document (``openapi.py``) and the error body (``errors.py``)."""
