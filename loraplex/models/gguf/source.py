"""Which model paths are GGUF checkpoints: a ``*.gguf`` file, or a folder holding exactly one (and no
``*.safetensors``: a folder with both is an HF checkpoint, as before)."""

from __future__ import annotations

from pathlib import Path

from loraplex.models.gguf.reader import GGUFError

SUFFIX = ".gguf"


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names (the file itself, or the one ``*.gguf`` in a folder without
    ``*.safetensors``), or None when ``path`` is not a GGUF model. ``GGUFError`` for a folder holding several
    GGUF files (which one is meant is not guessed)."""
    path = Path(path).expanduser()
    if path.is_file():
        return path if path.suffix.lower() == SUFFIX else None
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(files) > 1:
        raise GGUFError(f"{path}: holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
                        "pass the one to serve as --model")
    return files[0] if files else None
