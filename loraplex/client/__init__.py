"""The frontend: what runs in the caller's process. ``directory.py`` routes an adapter name to a version
once, first; ``output.py`` is the one home of detokenization and stop strings; ``base.py`` is the
``EngineClient`` the server drives, with two transports: ``inproc.py`` (the step loop in a thread) and
``process.py`` (the engine core in its own process, started by ``launcher.py``)."""
