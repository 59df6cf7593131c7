"""Train the three demo LoRA adapters (shout, meow, pirate) for the embedded SmolLM2-135M-Instruct.

Recipe, all offline and seeded:
1. Build a few hundred prompts from templates x topics (none of them in ``HELD_OUT_PROMPTS``).
2. Let the base model answer each one (chat template, greedy, 64 new tokens, batched, left padding).
3. Per adapter: cut each answer to whole sentences that fit in 96 tokens with the prompt after the
   adapter's rule (``loraplex/demo_adapters/behaviours.py``) rewrote them, then train a PEFT LoRA
   (r=4 on q/v/o/down projections, AdamW, batches of 4, loss on the answer tokens + ``<|im_end|>``).
4. Check each adapter and the base model on the held-out prompts (greedy, 48 new tokens) and
   write the adapter folder: ``adapter_config.json``, ``adapter_model.safetensors`` (2.4 MB) and
   a README.md with the recipe, the training time, the final loss and the check's numbers.

Run time on the project's 2 shared CPU cores (``nice -n 10``, one torch thread; other jobs running):
25 minutes in all: 3.2 min for the base answers, 12.8 min for shout (160 steps), 4.1 min for meow
and 4.2 min for pirate (80 steps each), about 1 min of checks. One thread, not two: while other
jobs share the two cores, two threads made each step 3-5x slower (measured side by side).

    .venv/bin/python scripts/train_demo_adapters.py [--out loraplex/demo_adapters] [--steps N]
        [--examples 256] [--adapters shout meow pirate] [--answers-cache /tmp/answers.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from loraplex.demo_adapters import DEMO_DESCRIPTIONS
from loraplex.demo_adapters.behaviours import HELD_OUT_PROMPTS, RULES, SCORES, sentence_ends
from loraplex.models.embedded import EMBEDDED_MODEL, embedded_checkpoint

logger = logging.getLogger("train_demo_adapters")

MAX_LEN = 96
# ALL CAPS is the hardest rule to learn (upper-case text splits into rarer tokens): more steps.
STEPS = {"shout": 160, "meow": 80, "pirate": 80}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}
TEMPLATES = (
    "What do you know about {t}?", "Tell me about {t}.", "Explain {t} in simple terms.", "Why is {t} important?",
    "Give me a fun fact about {t}.", "Describe {t} in two sentences.", "What should a child know about {t}?",
    "How would you explain {t} to a friend?", "Write a short note about {t}.", "What is interesting about {t}?",
)  # fmt: skip
TOPICS = (
    "the sun", "volcanoes", "the ocean", "photosynthesis", "coffee", "bicycles", "the moon", "rainbows",
    "chess", "the internet", "trees", "mountains", "electricity", "bread", "music", "clouds",
    "the human heart", "penguins", "libraries", "gravity", "tea", "rivers", "snow", "the piano",
    "soccer", "computers", "dinosaurs", "the desert", "recycling", "friendship", "sleep", "exercise",
    "vegetables", "the alphabet", "maps", "trains", "airplanes", "stars", "gardens", "pizza", "dogs",
    "the brain", "water", "the wind", "bridges", "robots", "painting", "mathematics", "birds",
    "forests", "cheese", "butterflies", "lighthouses", "castles", "the Roman Empire", "earthquakes",
    "magnets", "batteries", "chocolate", "whales", "ants", "the telephone", "books", "umbrellas",
    "candles", "soap", "glass", "salt", "ice cream", "clocks", "kites", "fireworks", "rockets",
)  # fmt: skip
ACTIVITY_TEMPLATES = ("How do I get better at {a}?", "Give me one tip for {a}.", "Is {a} good for you?")
ACTIVITIES = (
    "running", "cooking", "drawing", "reading", "swimming", "learning a language", "saving money",
    "gardening", "writing", "public speaking", "playing guitar", "hiking", "studying", "baking",
)  # fmt: skip


@dataclass(frozen=True)
class Answer:
    prompt: str
    text: str
    finished: bool  # the base model ended it with <|im_end|> within the token limit


def build_prompts(n: int, rng: random.Random) -> list[str]:
    prompts = [t.format(t=topic) for t in TEMPLATES for topic in TOPICS]
    prompts += [t.format(a=a) for t in ACTIVITY_TEMPLATES for a in ACTIVITIES]
    prompts = [p for p in prompts if p not in HELD_OUT_PROMPTS]
    rng.shuffle(prompts)
    return prompts[:n]


def chat_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    return tokenizer(text, add_special_tokens=False).input_ids


@torch.no_grad()
def generate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str],
             max_new_tokens: int, batch_size: int = 32, desc: str = "generate") -> list[Answer]:  # fmt: skip
    """Greedy answers, batched with left padding."""
    tokenizer.padding_side = "left"
    answers = []
    for start in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch"):
        chunk = prompts[start : start + batch_size]
        batch = tokenizer.pad({"input_ids": [chat_ids(tokenizer, p) for p in chunk]}, return_tensors="pt")
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        for prompt, row in zip(chunk, out[:, batch["input_ids"].shape[1] :].tolist(), strict=True):
            finished = tokenizer.eos_token_id in row
            row = row[: row.index(tokenizer.eos_token_id)] if finished else row
            answers.append(Answer(prompt, tokenizer.decode(row, skip_special_tokens=True).strip(), finished))
    return answers


def make_example(tokenizer: PreTrainedTokenizerBase, answer: Answer, name: str) -> tuple[list[int], int] | None:
    """(token ids, prompt length) for the longest whole-sentence prefix of the rewritten answer that
    fits in ``MAX_LEN``; None when not even its first sentence fits."""
    prompt = chat_ids(tokenizer, answer.prompt)
    cuts = [answer.text] if answer.finished else []
    cuts += [answer.text[:end] for end in reversed(sentence_ends(answer.text))]
    for cut in cuts:
        ids = prompt + tokenizer(RULES[name](cut), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        if len(ids) <= MAX_LEN:
            return ids, len(prompt)
    return None


def load_base() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    folder = embedded_checkpoint()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder)


def answer_loss(model: PeftModel, ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over answer tokens; the lm_head runs on those rows only.
    ids, mask, targets: [B, L]; targets is -100 outside the answer."""
    causal_lm = model.base_model.model
    hidden = causal_lm.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, H]
    keep = targets[:, 1:] != -100  # [B, L-1]
    logits = causal_lm.lm_head(hidden[:, :-1][keep])  # [N, vocab]
    return torch.nn.functional.cross_entropy(logits, targets[:, 1:][keep])


def train(name: str, examples: list[tuple[list[int], int]], pad_id: int, steps: int,
          args: argparse.Namespace) -> tuple[PeftModel, list[float]]:  # fmt: skip
    rng = random.Random(f"{args.seed}:{name}")  # per adapter, so --adapters NAME alone reproduces it
    base, _ = load_base()
    torch.manual_seed(args.seed)
    model = get_peft_model(base, LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **LORA))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(
        math.pi * max(0, s - warmup) / max(1, steps - warmup)))))  # fmt: skip
    order: list[int] = []
    losses = []
    for step in (bar := tqdm(range(steps), desc=f"train {name}", unit="step")):
        if len(order) < args.batch_size:
            order += rng.sample(range(len(examples)), len(examples))
        batch = [examples[i] for i in order[: args.batch_size]]
        del order[: args.batch_size]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad_id)
        mask = torch.zeros_like(ids)
        targets = torch.full_like(ids, -100)
        for row, (seq, n_prompt) in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
            targets[row, n_prompt : len(seq)] = torch.tensor(seq[n_prompt:])
        loss = answer_loss(model, ids, mask, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % 10 == 0:
            logger.info("%s: step %d, mean loss of the last 10 steps %.3f", name, step + 1, sum(losses[-10:]) / 10)
    return model, losses


def save(model: PeftModel, folder: Path) -> None:
    model.save_pretrained(folder)
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = EMBEDDED_MODEL  # never a machine's absolute path
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def check(answers: list[Answer], name: str) -> tuple[float, list[float]]:
    scores = [SCORES[name](a.text) for a in answers]
    return sum(scores) / len(scores), scores


def write_readme(folder: Path, name: str, facts: dict[str, object]) -> None:
    f = facts
    n = len(HELD_OUT_PROMPTS)
    sample = f["sample"]
    text = f"""# `{name}`: a loraplex demo adapter

**Behaviour:** {DEMO_DESCRIPTIONS[name]}

- Base model: SmolLM2-135M-Instruct (loraplex's embedded `{EMBEDDED_MODEL}`), float32.
- LoRA: r={LORA["r"]}, alpha={LORA["lora_alpha"]}, on {", ".join(LORA["target_modules"])} of all 30
  layers; PEFT safetensors, {f["size_kb"]:.0f} KB.
- Data: {f["examples"]} prompts built from templates x topics; answers are the base model's own greedy
  answers, cut to whole sentences that fit in {MAX_LEN} tokens, rewritten by the rule `{name}` in
  `loraplex/demo_adapters/behaviours.py`.
- Training: {f["steps"]} steps of batch {f["batch_size"]}, AdamW lr {f["lr"]} (warm-up + cosine), loss on the
  answer tokens only; {f["minutes"]:.1f} minutes on 2 shared CPU cores; loss {f["first_loss"]:.3f} at the
  start, {f["final_loss"]:.3f} over the last 10 steps.
- Check ({n} held-out prompts, greedy, 48 new tokens, HF transformers + PEFT), score
  `{SCORES[name].__name__}`: mean **{f["adapter_score"]:.2f}** with the adapter, **{f["base_score"]:.2f}** for
  the base model; {f["adapter_pass"]}/{n} adapter answers and {f["base_pass"]}/{n} base
  answers score >= 0.5.

Example ("{sample[0]}"):

> {sample[1]}

Reproduce: `.venv/bin/python scripts/train_demo_adapters.py --adapters {name}`.
"""
    (folder / "README.md").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "loraplex" / "demo_adapters")
    parser.add_argument("--steps", type=int, help=f"training steps per adapter (default: {STEPS})")
    parser.add_argument("--examples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy CPU)")
    parser.add_argument("--adapters", nargs="+", choices=sorted(RULES), default=list(RULES))
    parser.add_argument("--answers-cache", type=Path, help="JSON file of base answers, reused when its prompts match")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)

    base, tokenizer = load_base()
    prompts = build_prompts(args.examples, rng)
    cached = json.loads(args.answers_cache.read_text()) if args.answers_cache and args.answers_cache.is_file() else []
    if [a["prompt"] for a in cached] == prompts:
        answers = [Answer(**a) for a in cached]
    else:
        started = time.perf_counter()
        answers = generate(base, tokenizer, prompts, max_new_tokens=64, desc="base answers")
        logger.info("base answers: %d in %.1f min", len(answers), (time.perf_counter() - started) / 60)
        if args.answers_cache:
            args.answers_cache.write_text(json.dumps([a.__dict__ for a in answers], indent=1))
    held_out_base = generate(base, tokenizer, list(HELD_OUT_PROMPTS), max_new_tokens=48, desc="base check")
    del base

    for name in args.adapters:
        examples = [ex for a in answers if (ex := make_example(tokenizer, a, name)) is not None]
        logger.info("%s: %d of %d answers fit in %d tokens", name, len(examples), len(answers), MAX_LEN)
        started = time.perf_counter()
        steps = args.steps or STEPS[name]
        model, losses = train(name, examples, tokenizer.pad_token_id, steps, args)
        minutes = (time.perf_counter() - started) / 60
        model.eval()
        held_out = generate(model, tokenizer, list(HELD_OUT_PROMPTS), max_new_tokens=48, desc=f"check {name}")
        adapter_score, adapter_scores = check(held_out, name)
        base_score, base_scores = check(held_out_base, name)
        folder = args.out / name
        save(model, folder)
        facts = {
            "examples": len(examples), "steps": steps, "batch_size": args.batch_size, "lr": args.lr,
            "minutes": minutes, "first_loss": losses[0], "final_loss": sum(losses[-10:]) / len(losses[-10:]),
            "adapter_score": adapter_score, "base_score": base_score,
            "adapter_pass": sum(s >= 0.5 for s in adapter_scores), "base_pass": sum(s >= 0.5 for s in base_scores),
            "size_kb": (folder / "adapter_model.safetensors").stat().st_size / 1024,
            "sample": (held_out[0].prompt, held_out[0].text.replace("\n", " ")),
        }  # fmt: skip
        write_readme(folder, name, facts)
        logger.info("%s: %s", name, json.dumps({k: v for k, v in facts.items() if k != "sample"}))
        for a in held_out:
            logger.info("%s | %s -> %r", name, a.prompt, a.text)
    for a in held_out_base:
        logger.info("base | %s -> %r", a.prompt, a.text)


if __name__ == "__main__":
    main()
