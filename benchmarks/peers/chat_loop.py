"""A closed-loop multi-turn chat workload, driven the same way on every engine (standard library only, so
the vLLM worker in its own virtualenv imports it too).

Every conversation starts at once; when a turn's answer is complete, the conversation's next prompt (the
whole history: the previous prompt, the answer, the next user message, as token ids) is submitted at
once. TTFT is the time from a turn's submission to the step that returns its first token; throughput is
generated tokens over the wall time of the whole workload.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Conversation:
    adapter: str | None
    system: list[int]  # the shared system prompt's token ids
    user_turns: list[list[int]]  # one user message per turn


@dataclass
class StepOutput:
    """What an engine's step reports for one request: its id, its tokens so far, whether it finished."""

    request_id: str
    token_ids: list[int]
    finished: bool


def run_chats(conversations: list[Conversation], new_tokens: int,
              submit: Callable[[str, list[int], str | None, int], None],
              step: Callable[[], list[StepOutput]]) -> dict:
    """Run every conversation to its last turn. ``submit(request_id, prompt_ids, adapter, max_tokens)`` queues
    a request; ``step()`` runs one engine step. Returns TTFT per turn, wall time, tokens and the answers."""
    history = [c.system + c.user_turns[0] for c in conversations]
    turn = [0] * len(conversations)
    submitted: dict[str, float] = {}
    ttft: dict[str, float] = {}
    answers: dict[str, list[int]] = {}
    prompt_tokens = 0

    def send(i: int) -> None:
        nonlocal prompt_tokens
        rid = f"c{i}t{turn[i]}"
        submitted[rid] = time.perf_counter()
        prompt_tokens += len(history[i])
        submit(rid, list(history[i]), conversations[i].adapter, new_tokens)

    start = time.perf_counter()
    for i in range(len(conversations)):
        send(i)
    while len(answers) < len(submitted):  # a finished turn submits the next one in the same iteration
        outputs = step()
        now = time.perf_counter()
        for out in outputs:
            if out.token_ids and out.request_id not in ttft:
                ttft[out.request_id] = now - submitted[out.request_id]
            if out.finished:
                answers[out.request_id] = list(out.token_ids)
                i, t = (int(x) for x in out.request_id[1:].split("t"))
                if t + 1 < len(conversations[i].user_turns):
                    history[i] += out.token_ids + conversations[i].user_turns[t + 1]
                    turn[i] = t + 1
                    send(i)
    wall = time.perf_counter() - start
    generated = sum(len(a) for a in answers.values())
    values = sorted(ttft.values())
    return {"wall_s": wall, "generated_tokens": generated, "prompt_tokens": prompt_tokens,
            "tok_s": generated / wall, "ttft_p50_s": statistics.median(values),
            "ttft_p90_s": values[int(0.9 * (len(values) - 1))], "requests": len(answers), "answers": answers}
