"""Building the project's C++ CPU kernels with ``torch.utils.cpp_extension``, once per environment.

torch caches a build under its extension name and rebuilds whenever the build command changes, and the
command holds the source paths and the Python environment's paths: two virtualenvs (CI and a user's)
sharing ``~/.cache/torch_extensions`` would rebuild each other's modules on every switch, and two
checkouts of the same sources (git worktrees) would each compile for minutes. So the sources (with the
headers beside them) are copied to a folder named after a digest of their contents, the environment,
the torch version and the flags, and built from there under a name carrying that digest: equal sources
build once per environment wherever they are checked out, and an edited source gets a build of its own
(``TORCH_EXTENSIONS_DIR`` still chooses the folder).

Every module compiles with ``-fopenmp``: ATen's ``at::parallel_for`` is OpenMP only where ``_OPENMP`` is
defined, and runs its range serially on the calling thread otherwise (the kernels then used one of the
engine's threads). The OpenMP symbols resolve to the libgomp torch has already loaded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)


def build_cpu_extension(name: str, label: str, sources: list[Path], flags: list[str],
                        fallback: str) -> ModuleType | None:
    """The module built from ``sources`` for this environment (cached), or None on CPUs without AVX2 or
    where it cannot be built (no compiler, no headers), logged once with what runs instead."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    flags = [*flags, "-fopenmp"]
    try:
        from torch.utils.cpp_extension import load

        digest, copies = _content_addressed(sources, flags)
        return load(name=f"{name}_{digest[:10]}", sources=[str(s) for s in copies], extra_cflags=flags,
                    verbose=False)
    except Exception as e:  # the torch path stays correct
        logger.warning("%s unavailable (%s); %s", label, e, fallback)
        return None


def _content_addressed(sources: list[Path], flags: list[str]) -> tuple[str, list[Path]]:
    """The digest of ``sources``, the headers in their folders, the environment, torch and ``flags``, and
    the sources' copies in the folder named after it (written once, atomically)."""
    from torch.utils.cpp_extension import get_default_build_root

    files = [*sources, *sorted({h for s in sources for h in s.parent.glob("*.h")})]
    digest = hashlib.sha256()
    for part in (sys.prefix, torch.__version__, *flags):
        digest.update(part.encode() + b"\0")
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    hex_digest = digest.hexdigest()
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "loraplex-sources"
    folder = root / hex_digest[:16]
    if not folder.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=root))
        for file in files:
            (staging / file.name).write_bytes(file.read_bytes())
        try:
            staging.rename(folder)
        except OSError:  # another process wrote the same folder first
            for file in staging.iterdir():
                file.unlink()
            staging.rmdir()
    return hex_digest, [folder / s.name for s in sources]


def build_for_this_cpu(build: Callable[[str], ModuleType | None]) -> ModuleType | None:
    """``build("avx512")`` where ``get_cpu_capability()`` is AVX512 (falling back to ``build("avx2")`` if it
    does not build), ``build("avx2")`` on AVX2 CPUs; ``build`` returns None where nothing builds."""
    if torch.backends.cpu.get_cpu_capability() == "AVX512" and (module := build("avx512")) is not None:
        return module
    return build("avx2")
