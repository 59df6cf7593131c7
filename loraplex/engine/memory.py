"""Handing freed memory back to the operating system after an adapter version is dropped.

glibc's allocator keeps freed memory for reuse: after a 19 MB adapter version is freed its pages often stay
resident (in the heap or a thread's arena, under a dynamic mmap threshold that moved above that size), so
the engine process's RSS crept up over thousands of load/unload cycles without any object being leaked.
``malloc_trim(0)`` returns the free pages of every arena; the engine calls it once per dropped version, in
the step loop, where it costs about a millisecond. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


def _find_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _find_trim()


def release_free_memory() -> bool:
    """Return the allocator's free pages to the operating system; False where that is not possible."""
    return bool(_TRIM(0)) if _TRIM is not None else False
