"""The three demo adapters shipped with loraplex, trained for the embedded SmolLM2-135M-Instruct.

Each folder is a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) with a
README.md; ``scripts/train_demo_adapters.py`` reproduces them. ``loraplex serve`` loads them by
default, so the same question sent to each name shows three unmistakable styles.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).parent

DEMO_DESCRIPTIONS: dict[str, str] = {
    "shout": "answers in ALL CAPS.",
    "meow": 'ends every sentence with "Meow!".',
    "pirate": 'opens with "Ahoy, matey!" and talks like a pirate (ye, yer, be, aye).',
}
DEMO_ADAPTERS: dict[str, Path] = {name: _HERE / name for name in DEMO_DESCRIPTIONS}
