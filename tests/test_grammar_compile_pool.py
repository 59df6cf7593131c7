"""Grammar compiles are bounded, cancellable and shared among tenants (issue 30, item 4), on an in-process
``Engine`` over the tiny Llama (SmolLM2's tokenizer) driven step by step, with the pool's own counters as
hooks (no wall-clock bounds):

- a schema within every static limit whose compile takes long (512 properties, each with a
  ``pattern`` of twelve optional letters: 59 s here under load) fails its request alone with a 400-class
  ``RequestError`` naming the time budget, and its worker process is killed and replaced;
- while it compiles, another tenant's small schema is compiled and its request served to the end: it
  does not queue behind the hostile one; a second hostile schema of the same tenant waits for the first
  (a tenant holds at most all but one worker);
- aborting the only request waiting for a compile kills it; a compile two requests wait for survives
  the abort of one;
- a compiled grammar over ``MAX_COMPILED_BYTES`` is refused (``compile_job``, in this process).
Outputs of the served constrained requests are checked against the constraint (the choice strings)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from loraplex import StructuredOutputsParams
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.request import RequestTags, SamplingParams
from loraplex.engine.sampling.structured import compile_worker
from loraplex.engine.sampling.structured.compile_worker import CompileJob, compile_job
from loraplex.errors import RequestError
from tests.engine_harness import Progress, add, gather

TIMEOUT_S = 3.0
# within every static limit of params.py (512 properties, 72-character patterns without a repetition bound,
# 60 KB): 59 s to compile here under load
HOSTILE = {"type": "object", "required": [f"p{i}" for i in range(512)],
           "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]?" * 12} for i in range(512)}}
CHOICES = ["red", "green", "blue"]
TIMED_OUT, CANCELLED = "past its time budget", "cancelled"  # CompilePool.killed's reasons


def hostile(salt: int = 0) -> StructuredOutputsParams:
    return StructuredOutputsParams(json={**HOSTILE, "title": f"bomb {salt}"})  # a distinct cache key per salt


def params(constraint: StructuredOutputsParams, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=constraint)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[Engine]:
    engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_blocks=64, max_num_seqs=4,
                                 grammar_compile_workers=2, grammar_compile_timeout_s=TIMEOUT_S,
                                 grammar_compile_warm=True))  # as `loraplex serve`: workers start now
    warm = {}  # start both workers (seconds of imports) before the tests look at them
    add(engine, "warm-0", "Hi", params(StructuredOutputsParams(choice=["a", "b"])), tags=RequestTags("w0"))
    add(engine, "warm-1", "Hi", params(StructuredOutputsParams(choice=["c", "d"])), tags=RequestTags("w1"))
    step_until(engine, warm, lambda: all(warm.get(f"warm-{i}", Progress()).finished for i in range(2)))
    yield engine
    engine.grammars.shutdown()


def step_until(engine: Engine, results: dict[str, Progress], done: Callable[[], bool], timeout: float = 120) -> None:
    """Step ``engine`` until ``done()`` (a safety timeout, far above what any step here takes)."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError("the condition never held")
        if not gather(engine.step(), results):
            time.sleep(0.01)  # nothing happened: a compile or a worker's start is under way


def test_a_hostile_compile_fails_alone_past_its_budget(engine: Engine) -> None:
    pool, results = engine.grammars.pool, {}
    timeouts, pids = pool.killed[TIMED_OUT], set(pool.worker_pids())
    add(engine, "bomb", "Answer:", params(hostile(1)), tags=RequestTags("attacker"))
    step_until(engine, results, lambda: "bomb" in results)
    error = results["bomb"].error
    assert isinstance(error, RequestError) and error.param == "structured_outputs", error
    assert f"within {TIMEOUT_S:g} s" in str(error) and "--grammar-compile-timeout" in str(error)
    assert pool.killed[TIMED_OUT] == timeouts + 1
    step_until(engine, results, lambda: pool.running() == 0)  # replaced before its share is free
    assert len(pool.worker_pids()) == 2 and set(pool.worker_pids()) != pids


def test_a_hostile_compile_does_not_stall_another_tenant(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a budget longer than the test (the bombs are aborted at the end), so that the order holds on
    any host: the victim is served while the first bomb compiles and the second waits for the first."""
    pool, results = engine.grammars.pool, {}
    monkeypatch.setattr(pool, "timeout_s", 600.0)
    add(engine, "bomb", "Answer:", params(hostile(2)), tags=RequestTags("attacker"))
    add(engine, "bomb-2", "Answer:", params(hostile(3)), tags=RequestTags("attacker"))
    step_until(engine, results, lambda: pool.running() == 1)  # the first bomb is compiling
    add(engine, "small", "Colour:", params(StructuredOutputsParams(choice=CHOICES), 8), tags=RequestTags("victim"))
    step_until(engine, results, lambda: "small" in results and results["small"].finished)
    assert results["small"].error is None and results["small"].finish_reason == "stop"
    assert engine.tokenizer.decode(results["small"].token_ids[:-1]) in CHOICES
    assert "bomb" not in results and pool.running() == 1  # served while the first bomb still compiles...
    assert "bomb-2" not in results  # ...and the attacker's second one queues behind it, not in the free worker
    engine.abort_request("bomb")
    engine.abort_request("bomb-2")
    step_until(engine, results, lambda: "bomb" in results and "bomb-2" in results and pool.running() == 0)
    assert results["bomb"].finish_reason == results["bomb-2"].finish_reason == "abort"


def test_an_abandoned_compile_is_killed_and_a_shared_one_survives_one_abort(engine: Engine) -> None:
    pool, results = engine.grammars.pool, {}
    cancels, timeouts = pool.killed[CANCELLED], pool.killed[TIMED_OUT]
    add(engine, "bomb", "Answer:", params(hostile(4)), tags=RequestTags("attacker"))
    step_until(engine, results, lambda: pool.running() == 1)
    engine.abort_request("bomb")
    step_until(engine, results, lambda: pool.killed[CANCELLED] == cancels + 1 and pool.running() == 0)
    assert pool.killed[TIMED_OUT] == timeouts  # killed at the abort, not at the end of its budget
    assert results["bomb"].finish_reason == "abort"
    shared = StructuredOutputsParams(choice=["on", "off"])
    add(engine, "first", "Switch:", params(shared), tags=RequestTags("a"))
    add(engine, "second", "Switch:", params(shared), tags=RequestTags("b"))  # the same compile: a cache hit
    engine.abort_request("first")
    step_until(engine, results, lambda: "second" in results and results["second"].finished)
    assert results["second"].error is None and pool.killed[CANCELLED] == cancels + 1
    assert engine.tokenizer.decode(results["second"].token_ids[:-1]) in ("on", "off")


def test_a_compiled_grammar_over_the_memory_limit_is_refused(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import xgrammar as xgr

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[2])
    job = CompileJob(1, info.serialize_json(), "regex", "[a-z]{1,20}")
    assert compile_job({}, job) >= 0  # the seconds it took
    monkeypatch.setattr(compile_worker, "MAX_COMPILED_BYTES", 1024)
    with pytest.raises(ValueError, match=r"over the limit of 0 MiB \(MAX_COMPILED_BYTES\)"):
        compile_job({}, job)
