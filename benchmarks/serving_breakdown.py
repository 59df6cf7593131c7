"""Where a step's wall time goes, offline and served (for ``serving_overhead.py``).

- ``OfflineTimer`` wraps an ``LLM``'s engine: per step its wall time, the model forward
  (``runner.execute``), sampling, and the rest (scheduling, detokenization, bookkeeping), over the
  steps in which every one of C sequences decodes (the steady state of a closed loop of C clients).
- ``ServedCounters`` reads a running server before and after a load: the engine's step count and
  time (``loraplex_step_latency_seconds`` in ``/metrics``), and the CPU seconds of the API process
  (with its request-preparation workers) and of the engine process (``loraplex.engine.core_process``;
  none when the step loop runs in the API process).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from loraplex import LLM
from loraplex.engine import engine as engine_module


class OfflineTimer:
    def __init__(self, llm: LLM) -> None:
        engine = llm.engine
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        self._width = 0
        engine.runner.execute = self._timed(engine.runner.execute, "forward")
        engine_module.sample_rows = self._timed(engine_module.sample_rows, "sample")
        step, schedule = engine.step, engine.scheduler.schedule

        def timed_schedule() -> Any:
            batch = schedule()
            self._current["decoding"] = float(len(batch) == sum(s.num_tokens for s in batch) == self._width)
            return batch

        def timed_step() -> Any:
            self._current = {"forward": 0.0, "sample": 0.0, "decoding": 0.0}
            start = time.perf_counter()
            out = step()
            self._current["step"] = time.perf_counter() - start
            if self._current["decoding"]:
                self.steps.append(self._current)
            return out

        engine.step, engine.scheduler.schedule = timed_step, timed_schedule

    def _timed(self, fn: Callable, key: str) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._current[key] = self._current.get(key, 0.0) + time.perf_counter() - start
        return wrapper

    def reset(self, width: int) -> None:
        """Count steps with exactly ``width`` sequences, all decoding, from now on."""
        self.steps, self._width = [], width

    def summary(self) -> dict[str, float | None]:
        if not self.steps:
            return {"step_ms": None}
        med = {key: 1e3 * statistics.median(s[key] for s in self.steps) for key in ("step", "forward", "sample")}
        return {"step_ms": med["step"], "forward_ms": med["forward"], "sample_ms": med["sample"],
                "rest_ms": med["step"] - med["forward"] - med["sample"], "decode_steps": len(self.steps)}


class ServedCounters:
    def __init__(self, url: str, server: psutil.Process) -> None:
        self.url, self.server = url, server
        self._before: tuple[float, float, float, float] | None = None

    def _read(self) -> tuple[float, float, float, float]:
        """(steps, step seconds, API-side CPU seconds, engine-process CPU seconds) so far."""
        steps = seconds = 0.0
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=60).text):
            for sample in family.samples:
                if sample.name == "loraplex_step_latency_seconds_count":
                    steps = sample.value
                elif sample.name == "loraplex_step_latency_seconds_sum":
                    seconds = sample.value
        api = engine = 0.0
        for proc in [self.server, *self.server.children(recursive=True)]:
            try:
                cpu = proc.cpu_times()
                busy = cpu.user + cpu.system
                if "loraplex.engine.core_process" in " ".join(proc.cmdline()):
                    engine += busy
                else:
                    api += busy
            except psutil.NoSuchProcess:
                continue
        return steps, seconds, api, engine

    def begin(self) -> None:
        self._before = self._read()

    def end(self, wall: float) -> dict[str, float | None]:
        assert self._before is not None
        steps, seconds, api, engine = (after - before for after, before in zip(self._read(), self._before,
                                                                                strict=True))
        if steps <= 0:
            return {"step_ms": None}
        return {"steps": steps, "step_ms": 1e3 * seconds / steps, "period_ms": 1e3 * wall / steps,
                "api_cpu_ms": 1e3 * api / steps, "engine_cpu_ms": 1e3 * engine / steps if engine else None}
