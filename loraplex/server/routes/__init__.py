"""The routes, one module per concept: ``generate.py`` (completions, chat), ``models.py``, ``adapters.py``
(load, unload, versions), ``tokenize.py``, ``ops.py`` (health, metrics), ``playground.py`` (+ ``static/``)."""
