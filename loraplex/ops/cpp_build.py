"""Building the project's C++ CPU kernels with ``torch.utils.cpp_extension``, once per environment.

torch caches a build under its extension name and rebuilds whenever the build command changes, and the
command holds the Python environment's paths: two virtualenvs (two checkouts, CI and a user's) sharing
``~/.cache/torch_extensions`` would rebuild each other's modules on every switch. The name therefore
carries a short digest of the environment, the torch version, the source paths and the flags, so each keeps its
own build (``TORCH_EXTENSIONS_DIR`` still chooses the folder).

Every module compiles with ``-fopenmp``: ATen's ``at::parallel_for`` is OpenMP only where ``_OPENMP`` is
defined, and runs its range serially on the calling thread otherwise (the kernels then used one of the
engine's threads). The OpenMP symbols resolve to the libgomp torch has already loaded.
"""

from __future__ import annotations

import hashlib
import logging
import sys
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
    digest = hashlib.sha256("|".join([sys.prefix, torch.__version__, *map(str, sources), *flags]).encode()).hexdigest()
    try:
        from torch.utils.cpp_extension import load

        return load(name=f"{name}_{digest[:10]}", sources=[str(s) for s in sources], extra_cflags=flags,
                    verbose=False)
    except Exception as e:  # the torch path stays correct
        logger.warning("%s unavailable (%s); %s", label, e, fallback)
        return None


def build_for_this_cpu(build: Callable[[str], ModuleType | None]) -> ModuleType | None:
    """``build("avx512")`` where ``get_cpu_capability()`` is AVX512 (falling back to ``build("avx2")`` if it
    does not build), ``build("avx2")`` on AVX2 CPUs; ``build`` returns None where nothing builds."""
    if torch.backends.cpu.get_cpu_capability() == "AVX512" and (module := build("avx512")) is not None:
        return module
    return build("avx2")
