"""A grammar-compile worker process: ``python -m loraplex.engine.sampling.structured.compile_worker FD``.

Started by ``compile_pool.CompilePool``, one per worker; it talks over the socket FD with pickled
messages. It first sends ``"ready"`` (once xgrammar, and torch with it, are imported: seconds, never
counted against a compile's time budget), then answers each ``CompileJob`` with ``("ok", seconds)`` or
``("error", message)``. The worker *vets* a compile: a constraint compiles here first, where it can be
killed, and only a constraint that compiled within its budget is compiled again in the engine, as fast.
The compiled grammar itself does not come back: its JSON serialization is far bigger and slower than the
compile (512 integer properties: compiled in 0.15 s to 4 MB; serialized in 22 s to 246 MB). A compiled
grammar whose memory passes ``MAX_COMPILED_BYTES`` is an error (the engine would hold it).

The process runs at a lower priority (``NICENESS``) so a compile yields the CPU to the step loop; it
ignores SIGINT (the engine coordinates shutdown), ends at end of file on the socket, and exits when its
parent goes away even mid-compile (a watcher thread). The pool kills it (SIGKILL) to stop a compile.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

NICENESS = 10
MAX_COMPILED_BYTES = 64 << 20
TOKENIZER = "tokenizer"  # a job's kind that only loads its tokenizer (sent before the first compile for it)


@dataclass(frozen=True)
class CompileJob:
    """One constraint to compile: ``kind`` ("json", "json_object", "regex" or "grammar") and its ``source``
    (``StructuredOutputsParams.source``), for the tokenizer ``info_id``; ``info_json`` is that tokenizer's
    serialized ``xgrammar.TokenizerInfo`` the first time this worker sees the id (else None)."""

    info_id: int
    info_json: str | None
    kind: str
    source: str
    options: dict[str, Any] = field(default_factory=dict)  # compile_json_schema's keyword arguments


def compile_job(compilers: dict[int, Any], job: CompileJob) -> float:
    """Compile ``job`` (``compilers``: this worker's, by tokenizer id); the seconds it took. ``ValueError``
    when the compiled grammar passes ``MAX_COMPILED_BYTES``."""
    import xgrammar as xgr

    if job.info_json is not None:
        info = xgr.TokenizerInfo.deserialize_json(job.info_json)
        compilers[job.info_id] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    if job.kind == TOKENIZER:
        return 0.0
    start = time.perf_counter()
    compiled = compile_with(compilers[job.info_id], job.kind, job.source, job.options)
    size = compiled.memory_size_bytes
    if size > MAX_COMPILED_BYTES:
        raise ValueError(f"the compiled grammar takes {size / 2**20:.0f} MiB, over the limit of "
                         f"{MAX_COMPILED_BYTES >> 20} MiB (MAX_COMPILED_BYTES)")
    return time.perf_counter() - start


def compile_with(compiler: Any, kind: str, source: str, options: dict[str, Any]) -> Any:
    """``compiler`` (an ``xgrammar.GrammarCompiler``)'s ``CompiledGrammar`` of one constraint."""
    if kind == "json":
        return compiler.compile_json_schema(source, **options)
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(source)
    return compiler.compile_grammar(source)


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(NICENESS)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    conn = Connection(int(argv[0]))
    import xgrammar  # noqa: F401 - seconds of imports, before "ready"

    conn.send("ready")
    compilers: dict[int, Any] = {}
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return 0
        try:
            reply = ("ok", compile_job(compilers, job))
        except Exception as exc:  # noqa: BLE001 - any compile failure is the request's, sent back as text
            reply = ("error", str(exc).strip() or type(exc).__name__)
        conn.send(reply)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
