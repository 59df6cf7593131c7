"""Opening an adapter's files: each one a regular file that resolves inside the allowed roots.

Every file an adapter load reads (``adapter_config.json``, the weight file, tokenizer files, chat
templates) goes through ``open_file``: its path is resolved once (symlinks and ``..``), checked against
``roots`` when they are given, checked to be a regular file *before* it is opened (a FIFO, a device or a
directory is never opened, so opening has no side effect and cannot block), then opened without
following a symlink (``O_NOFOLLOW``: a link swapped in meanwhile fails the open) and checked again on
the open descriptor (``fstat``: the same inode, still regular; on Linux also the path the descriptor
really names, against the roots), so what is read is what was checked. A file outside the roots or not
regular raises ``ForbiddenAdapterPath`` (HTTP 403). Nothing here follows a path read from a file.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from loraplex.errors import AdapterNotFound, ForbiddenAdapterPath, InvalidAdapter

Roots = tuple[Path, ...] | None  # resolved allowed roots; None: any path (trusted callers)

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def resolve_roots(roots: Iterable[str | Path] | None) -> Roots:
    """``roots`` resolved once (None stays None: no root check)."""
    return None if roots is None else tuple(Path(os.path.realpath(Path(r).expanduser())) for r in roots)


def adapter_folder(path: str | Path, roots: Roots) -> Path:
    """``path`` as a ``Path`` once checked: ``AdapterNotFound`` if no folder is there, ``ForbiddenAdapterPath``
    if it resolves outside ``roots`` (each file is resolved and checked again when it is opened)."""
    folder = Path(path)
    if "\x00" in str(folder):
        raise AdapterNotFound(f"{folder!r}: no adapter folder at a path with a NUL character")
    resolved = Path(os.path.realpath(folder))
    _check_inside(resolved, roots, f"{folder}: the adapter folder")
    if not resolved.is_dir():
        raise AdapterNotFound(f"{folder}: no adapter folder at this path")
    return folder


def present(folder: Path, name: str) -> bool:
    """Whether the folder has an entry ``name`` of any kind (a dangling link counts: opening it then fails)."""
    try:
        os.lstat(folder / name)
    except OSError:
        return False
    return True


class AdapterFile:
    """One opened adapter file (``open_file``): ``size`` bytes, read with ``read`` / ``readinto`` at offsets."""

    def __init__(self, fd: int, size: int, what: str) -> None:
        self.fd, self.size, self.what = fd, size, what

    def read(self, offset: int, count: int) -> bytes:
        """Exactly ``count`` bytes at ``offset`` (``InvalidAdapter`` if the file ends first)."""
        buffer = bytearray(count)
        self.readinto(buffer, offset)
        return bytes(buffer)

    def readinto(self, buffer: bytearray, offset: int) -> None:
        """Fill ``buffer`` from ``offset`` (short reads continue; a file that shrank is ``InvalidAdapter``)."""
        view, done = memoryview(buffer), 0
        while done < len(view):
            try:
                got = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as e:
                raise InvalidAdapter(f"{self.what}: cannot read ({e})") from e
            if got == 0:
                raise InvalidAdapter(f"{self.what}: the file ended at byte {offset + done} while reading "
                                     f"{len(view)} bytes at {offset} (it changed while being read)")
            done += got

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> AdapterFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


def open_file(folder: Path, name: str, roots: Roots) -> AdapterFile:
    """Open ``folder/name`` as described in the module docstring."""
    what = f"{folder}: {name}"
    resolved = os.path.realpath(folder / name)
    _check_inside(Path(resolved), roots, what)
    try:
        before = os.stat(resolved)
        _check_regular(before, what)
        fd = os.open(resolved, _FLAGS)
    except FileNotFoundError as e:
        raise InvalidAdapter(f"{what}: no such file (a dangling link?)") from e
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW: the checked file was replaced by a link
            raise ForbiddenAdapterPath(f"{what} became a symbolic link after its check; it is not followed") from e
        raise InvalidAdapter(f"{what}: cannot open ({e})") from e
    try:
        opened = os.fstat(fd)
        _check_regular(opened, what)
        if (opened.st_dev, opened.st_ino) != (before.st_dev, before.st_ino):
            raise ForbiddenAdapterPath(f"{what}: the file changed between its check and its open")
        _check_opened(fd, roots, what)
    except BaseException:
        os.close(fd)
        raise
    return AdapterFile(fd, opened.st_size, what)


def read_file(folder: Path, name: str, roots: Roots, limit: int) -> bytes:
    """The whole of ``folder/name`` (``open_file``), refused past ``limit`` bytes before it is read."""
    with open_file(folder, name, roots) as file:
        if file.size > limit:
            raise InvalidAdapter(f"{file.what} is {file.size} bytes, over the limit of {limit} bytes")
        return file.read(0, file.size)


def _check_inside(resolved: Path, roots: Roots, what: str) -> None:
    if roots is not None and not any(resolved.is_relative_to(root) for root in roots):
        raise ForbiddenAdapterPath(f"{what} resolves to {resolved}, outside the allowed adapter roots (after "
                                   f"resolving '..' and symlinks): {', '.join(str(r) for r in roots) or 'none'}")


def _check_regular(status: os.stat_result, what: str) -> None:
    if not stat.S_ISREG(status.st_mode):
        kind = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
                stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}.get(stat.S_IFMT(status.st_mode), "special")
        raise ForbiddenAdapterPath(f"{what} is {kind}, not a regular file; it is not opened")


def _check_opened(fd: int, roots: Roots, what: str) -> None:
    """On Linux, the path the descriptor names must still lie inside ``roots`` (a directory on the way may
    have been swapped for a link between the check and the open)."""
    if roots is None:
        return
    try:
        actual = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc: the checks before the open stand
        return
    _check_inside(Path(actual), roots, what)
