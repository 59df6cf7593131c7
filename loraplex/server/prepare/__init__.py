"""Request preparation off the event loop: ``preparer.py`` (the worker pool), ``worker.py`` (parse; then
template and tokenize with the routed version), ``prompt_bound.py`` (refuse a too-long prompt untokenized)."""
