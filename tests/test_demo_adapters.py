"""The shipped demo adapters, served by the real engine in one mixed batch, each show their behaviour.

One ``LLM.generate`` call runs every held-out prompt through the base model and all three adapters,
interleaved, so neighbouring rows of the batch use different adapters. Each behaviour must show on
its own adapter's answers and on no other row: a wrong-slot bug would put a style on the wrong rows.
The rules and scores are also checked on hand-written texts.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from loraplex import LLM, SamplingParams
from loraplex.demo_adapters import DEMO_ADAPTERS, DEMO_DESCRIPTIONS
from loraplex.demo_adapters.behaviours import (
    HELD_OUT_PROMPTS,
    RULES,
    SCORES,
    greets_like_a_pirate,
    meow,
    pirate,
    shout,
    signoff_fraction,
    upper_fraction,
)

PROMPTS = HELD_OUT_PROMPTS[:6]
# Per adapter: (lowest mean score on its own answers, highest mean score on any other row's answers).
THRESHOLDS = {"shout": (0.8, 0.2), "meow": (0.6, 0.1), "pirate": (0.8, 0.1)}


def test_rules_and_scores_on_known_texts() -> None:
    text = "The sky is blue. It scatters light! Is 3.5 big? You are my friend"
    assert shout(text) == "THE SKY IS BLUE. IT SCATTERS LIGHT! IS 3.5 BIG? YOU ARE MY FRIEND"
    assert meow(text) == "The sky is blue. Meow! It scatters light! Meow! Is 3.5 big? Meow! You are my friend"
    assert pirate(text) == "Ahoy, matey! The sky be blue. It scatters light! Be 3.5 big? Ye be me matey"
    assert upper_fraction(text) == pytest.approx(4 / 46)
    assert upper_fraction(shout(text)) == 1.0
    assert signoff_fraction(text) == 0.0
    assert signoff_fraction(meow(text)) == 1.0
    assert signoff_fraction("One. Meow! Two. Three. Meow!") == pytest.approx(2 / 3)
    assert greets_like_a_pirate(pirate(text)) == 1.0 and greets_like_a_pirate(text) == 0.0


def test_adapter_folders_are_small_portable_peft_adapters() -> None:
    assert set(DEMO_ADAPTERS) == set(DEMO_DESCRIPTIONS) == set(RULES) == set(SCORES)
    for name, folder in DEMO_ADAPTERS.items():
        config = json.loads((folder / "adapter_config.json").read_text())
        weights = folder / "adapter_model.safetensors"
        assert config["peft_type"] == "LORA" and config["r"] <= 16, name
        assert config["base_model_name_or_path"] == "smollm2-135m-instruct", name
        assert weights.stat().st_size < 3 * 1024 * 1024, name
        with safe_open(weights, "pt") as f:
            assert len(list(f.keys())) == 2 * 30 * len(config["target_modules"]), name
        assert (folder / "README.md").is_file(), name


@pytest.fixture(scope="module")
def mixed_answers() -> dict[str | None, list[str]]:
    """Adapter name (None = base) -> its greedy answers to ``PROMPTS``, all from one mixed batch.

    Runs on one torch thread: on the shared 2-core CI machine, 2 threads made this batch up to
    16x slower (18 s vs 304 s measured side by side while other jobs ran)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _mixed_answers()
    finally:
        torch.set_num_threads(threads)


def _mixed_answers() -> dict[str | None, list[str]]:
    llm = LLM(model="smollm2-135m-instruct", max_loras=4)
    for name, path in DEMO_ADAPTERS.items():
        llm.load_adapter(name, path)
    names: list[str | None] = [None, *DEMO_ADAPTERS]
    jobs = [(prompt, names[(i + j) % len(names)]) for i, prompt in enumerate(PROMPTS) for j in range(len(names))]
    chats = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p, _ in jobs
    ]
    outputs = llm.generate(chats, SamplingParams(max_tokens=48, temperature=0.0), adapters=[a for _, a in jobs])
    answers: dict[str | None, list[str]] = {name: [] for name in names}
    for (_, name), out in zip(jobs, outputs, strict=True):
        assert out.adapter == name and out.error is None
        answers[name].append(out.text)
    return answers


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DEMO_ADAPTERS))
def test_behaviour_shows_on_its_adapter_only(name: str, mixed_answers: dict[str | None, list[str]]) -> None:
    score = SCORES[name]
    lowest_own, highest_other = THRESHOLDS[name]
    own = [score(text) for text in mixed_answers[name]]
    assert sum(own) / len(own) >= lowest_own, (name, own, mixed_answers[name])
    for other, texts in mixed_answers.items():
        if other != name:
            scores = [score(text) for text in texts]
            assert sum(scores) / len(scores) <= highest_other, (name, other or "base", scores, texts)
