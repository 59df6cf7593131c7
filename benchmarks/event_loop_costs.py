"""What the API process still does per token and per request, piece by piece (issue 21, item 4).

Per token (per stream, per step), with SmolLM2's tokenizer and real chat text:
- ``detokenize``: the reader thread's ``OutputProcessor.process`` (incremental detokenization and the
  stop-string check), per token; it holds the API process's GIL, not the event loop;
- ``hand-off``: the event loop's share of delivering a step: one ``call_soon_threadsafe`` per step,
  a queue put and a consumer wake-up per stream (``RequestStream``), per token;
- ``sse chunk``: building the OpenAI chunk and its ``data:`` line (``ResponseBuilder.chunk`` + JSON),
  per token. (uvicorn's socket write comes on top; the served runs of ``serving_overhead.py`` give the
  whole API process's CPU per step.)
Per request:
- ``prepare``: a typical chat body parsed, validated, templated and tokenized by a worker, as the event
  loop awaits it: round trip through a worker thread and through a worker process, and the work alone;
- ``submit``: ``EngineProcess.submit`` until the engine process answers ``Accepted`` (tiny model).

    .venv/bin/python -m benchmarks.event_loop_costs [--out ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from transformers import AutoTokenizer

from benchmarks.common import QUESTIONS
from benchmarks.peers import shared
from loraplex.client.base import RequestStream, deliver
from loraplex.client.output import OutputProcessor
from loraplex.client.process import EngineProcess
from loraplex.client.tokenizers import TokenizerTable
from loraplex.config import EngineConfig
from loraplex.engine.request import RequestOutput, SamplingParams
from loraplex.models.embedded import embedded_checkpoint
from loraplex.server.generation import _sse
from loraplex.server.openai.responses import ResponseBuilder, TokenTexts
from loraplex.server.prepare.preparer import RequestPreparer
from loraplex.server.prepare.worker import PrepareConfig, PrepareWorker

STREAMS, STEPS = 16, 64


def answer_tokens(tokenizer) -> list[list[int]]:  # noqa: ANN001
    """Per stream, STEPS token ids of real English text (the questions, as if they were answers)."""
    text = " ".join(QUESTIONS * 4)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [ids[i * 7:i * 7 + STEPS] for i in range(STREAMS)]


def per_token_detokenize(tokenizer) -> float:  # noqa: ANN001
    processor = OutputProcessor()
    streams = answer_tokens(tokenizer)
    for i in range(STREAMS):
        processor.add(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=STEPS, stop=("\n\n", "User:")), tokenizer)
    start = time.perf_counter()
    for step in range(STEPS):
        processor.process([RequestOutput(f"r{i}", None, [], [streams[i][step]], "", "", step == STEPS - 1)
                           for i in range(STREAMS)])
    return (time.perf_counter() - start) / (STREAMS * STEPS)


def per_token_sse(tokenizer) -> float:  # noqa: ANN001
    builder = ResponseBuilder(chat=True, model="smollm2-135m-instruct", tokens=TokenTexts(tokenizer))
    out = RequestOutput("r0", None, [1, 2, 3], [42], " word", " word", False)
    start = time.perf_counter()
    for _ in range(STREAMS * STEPS):
        _sse(builder.chunk(builder.chat_delta(0, out, 0, 1, out.delta_text)))
    return (time.perf_counter() - start) / (STREAMS * STEPS)


def per_token_hand_off() -> float:
    """Event-loop thread CPU per token: STEPS deliveries of STREAMS outputs from another thread."""

    class Owner:
        def abort(self, request_id: str) -> None: ...

    async def run() -> float:
        loop = asyncio.get_running_loop()
        streams = [RequestStream(Owner(), f"r{i}", loop) for i in range(STREAMS)]  # type: ignore[arg-type]
        outs = [[RequestOutput(f"r{i}", None, [], [], "", " w", step == STEPS - 1) for i in range(STREAMS)]
                for step in range(STEPS)]

        async def consume(stream: RequestStream) -> None:
            async for _ in stream:
                pass

        def produce() -> None:
            for step in range(STEPS):
                deliver(list(zip(streams, outs[step], strict=True)))
                time.sleep(0.002)

        cpu = time.thread_time()
        producer = threading.Thread(target=produce)
        producer.start()
        await asyncio.gather(*(consume(s) for s in streams))
        producer.join()
        return (time.thread_time() - cpu) / (STREAMS * STEPS)

    return asyncio.run(run())


def chat_body(i: int) -> bytes:
    return json.dumps({"model": "smollm2-135m-instruct", "max_tokens": 64, "stream": True,
                       "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}).encode()


class BaseTokenizerOnly:
    """The two questions the preparer asks an engine client, when no adapter ships a tokenizer."""

    def __init__(self, tokenizer) -> None:  # noqa: ANN001
        self.tokenizer = tokenizer

    def tokenizer_for(self, adapter: str | None):  # noqa: ANN201
        return self.tokenizer

    def tokenizer_table(self) -> TokenizerTable:
        return TokenizerTable()


def per_request_prepare(folder: str, tokenizer, n: int = 60) -> dict[str, float]:  # noqa: ANN001
    config = PrepareConfig(folder, 8192)
    worker = PrepareWorker(config, lambda _table, _adapter: tokenizer)
    worker.chat(chat_body(0), TokenizerTable())  # compiles the chat template once, as a warm worker has
    alone = []
    for i in range(n):
        begin = time.perf_counter()
        worker.chat(chat_body(i), TokenizerTable())
        alone.append(time.perf_counter() - begin)
    out = {"prepare work alone": statistics.median(alone)}
    for label, processes in (("prepare via thread", 0), ("prepare via process", 1)):
        client = BaseTokenizerOnly(tokenizer)
        preparer = RequestPreparer(config, client=client, processes=processes)  # type: ignore[arg-type]

        async def run(prep: RequestPreparer = preparer) -> list[float]:
            await prep.warm_up()
            times = []
            for i in range(n):
                begin = time.perf_counter()
                await prep.chat(chat_body(i))
                times.append(time.perf_counter() - begin)
            return times

        out[label] = statistics.median(asyncio.run(run()))
        preparer.shutdown()
    return out


def per_request_submit(n: int = 60) -> float:
    from tests.fixtures import write_tiny_model

    folder = write_tiny_model(Path(tempfile.mkdtemp(prefix="loraplex-loop-costs-")))
    client = EngineProcess(EngineConfig(model=str(folder), kv_cache_blocks=64))
    client.start()

    async def run() -> list[float]:
        times = []
        for i in range(n):
            begin = time.perf_counter()
            stream = await client.submit(f"s{i}", [1, 2, 3, 4], SamplingParams(max_tokens=4))
            times.append(time.perf_counter() - begin)
            stream.abort()
        return times

    try:
        return statistics.median(asyncio.run(run()))
    finally:
        client.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=shared.RESULTS / "event_loop_costs.json")
    args = parser.parse_args()
    folder = str(embedded_checkpoint())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    results = {**shared.header(), "per_token_us": {}, "per_request_us": {}}
    results["per_token_us"]["detokenize (reader thread)"] = 1e6 * per_token_detokenize(tokenizer)
    results["per_token_us"]["hand-off (event loop)"] = 1e6 * per_token_hand_off()
    results["per_token_us"]["sse chunk (event loop)"] = 1e6 * per_token_sse(tokenizer)
    results["per_request_us"] = {k: 1e6 * v for k, v in per_request_prepare(folder, tokenizer).items()}
    results["per_request_us"]["submit until accepted (engine process)"] = 1e6 * per_request_submit()
    results["load_avg_end"] = list(os.getloadavg())
    shared.write_json(args.out, results)
    print(f"\n{results['machine']} ({results['date']}, load avg {results['load_avg'][0]:.1f})\n")
    rows = [[f"per token: {k}", f"{v:.1f}"] for k, v in results["per_token_us"].items()]
    rows += [[f"per request: {k}", f"{v:.0f}"] for k, v in results["per_request_us"].items()]
    shared.print_table(rows, ["what", "µs"])


if __name__ == "__main__":
    main()
