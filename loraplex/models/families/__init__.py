"""One module per model family (``docs/adding-a-model.md``); ``models.registry`` imports them lazily."""
