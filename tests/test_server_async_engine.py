"""``AsyncEngine`` without HTTP: outputs equal the offline ones; a consumer that stops early or is
cancelled aborts its request (KV blocks and adapter pin freed); errors reach the right caller."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path

import pytest

from loraplex import LLM, SamplingParams, UnknownAdapter
from loraplex.client.inproc import AsyncEngine
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.errors import RequestError
from tests.server_harness import wait_until_idle

CONFIG = dict(max_loras=2, max_cpu_loras=2, kv_cache_blocks=128)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> Iterator[AsyncEngine]:
    core = Engine(EngineConfig(model=str(tiny_llama), **CONFIG))
    core.load_adapter("a", tiny_llama_adapters["r8_all"])
    async_engine = AsyncEngine(core)
    async_engine.start()
    yield async_engine
    async_engine.shutdown()
    assert not async_engine.running


def test_generate_equals_offline(engine: AsyncEngine, tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = ["One two three", "Tea or coffee"]

    async def run() -> list[list[str]]:
        async def deltas(prompt: str, adapter: str | None) -> list[str]:
            return [out.delta_text async for out in engine.generate(prompt, params, adapter)]
        return list(await asyncio.gather(deltas(prompts[0], "a"), deltas(prompts[1], None)))

    got = asyncio.run(run())
    llm = LLM(model=str(tiny_llama), **CONFIG)
    llm.load_adapter("a", tiny_llama_adapters["r8_all"])
    want = llm.generate(prompts, params, adapters=["a", None], use_tqdm=False)
    assert ["".join(d) for d in got] == [w.text for w in want]
    wait_until_idle(engine.engine)


def test_consumer_stopping_early_aborts(engine: AsyncEngine) -> None:
    async def run() -> None:
        async with aclosing(engine.generate("Stop me", LONG, "a", request_id="early")) as outs:
            async for out in outs:
                assert not out.finished
                break
        # Closed (not finished, not garbage-collected): the request must already be on its way out.
        await asyncio.to_thread(wait_until_idle, engine.engine)

    asyncio.run(run())


def test_cancelled_task_aborts(engine: AsyncEngine) -> None:
    async def run() -> None:
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("Cancel me", LONG, "a", request_id="cancelled"):
                first.set()

        task = asyncio.ensure_future(consume())
        await first.wait()
        assert engine.engine.stats().num_running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    wait_until_idle(engine.engine)


def test_submission_errors_reach_the_caller(engine: AsyncEngine) -> None:
    async def first(adapter: str | None, params: SamplingParams, request_id: str | None = None) -> None:
        async for _ in engine.generate("x", params, adapter, request_id):
            return

    with pytest.raises(UnknownAdapter):
        asyncio.run(first("nope", LONG))
    with pytest.raises(RequestError) as info:
        asyncio.run(first(None, SamplingParams(top_p=0.0)))
    assert info.value.param == "top_p"

    async def duplicate() -> None:
        stream = await engine.submit("dup", [5], LONG, engine.route(None))
        try:
            with pytest.raises(RequestError):
                await engine.submit("dup", [5], LONG, engine.route(None))
        finally:
            stream.abort()

    asyncio.run(duplicate())
    wait_until_idle(engine.engine)


def test_a_failing_step_fails_requests_in_flight_and_the_loop_goes_on(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    real_step = engine.engine.step
    calls = {"n": 0}

    def flaky_step() -> list:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", flaky_step)

    async def run() -> None:
        with pytest.raises(RuntimeError, match="boom"):
            async for _ in engine.generate("Doomed", LONG, "a"):
                pass
        outs = [o async for o in engine.generate("Fine", SamplingParams(max_tokens=3, temperature=0.0,
                                                                         ignore_eos=True), None)]
        assert outs[-1].finished and len(outs[-1].token_ids) == 3

    asyncio.run(run())
    wait_until_idle(engine.engine)
