"""Who may do what: ``keys.py`` (the keys file and scopes), ``access.py`` (bearer auth, runtime adapter
paths), ``quotas.py`` (per-key concurrency and tokens per minute)."""
