"""The JSON bodies of one completion or chat completion (whole, or as streamed chunks), with logprobs.

Choices are indexed ``prompt_index * n + j``. Logprobs come from the engine's ``TokenLogprob``s (raw
model log-probabilities) and are shaped here: OpenAI's legacy format for completions (``tokens``,
``token_logprobs``, ``top_logprobs`` holding the top k plus the chosen token, ``text_offset`` into
the choice's text), the chat format (``content: [{token, logprob, bytes, top_logprobs}]``), and
vLLM's ``prompt_logprobs`` when that extension is asked for. The bodies follow ``schemas.py``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte <-> character table

from loraplex.client.output import RequestOutput
from loraplex.engine.request import TokenLogprob
from loraplex.server.openai.chat_message import ChoiceStream, message_fields
from loraplex.server.openai.reasoning import ReasoningParser
from loraplex.server.openai.tool_parsers import ToolParser


class TokenTexts:
    """Each token id's text (decoded alone, special tokens shown) and its bytes, cached per tokenizer. For
    byte-level BPE vocabularies the bytes are the token's own (a piece of a UTF-8 character included);
    otherwise the UTF-8 of its text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

    def text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self.tokenizer.decode([token_id]) if self.tokenizer else f"token_id:{token_id}"
        return self._texts[token_id]

    def bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id) if self.tokenizer else None
        if isinstance(piece, str) and piece and all(c in self._byte_of for c in piece):
            return [self._byte_of[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ResponseBuilder:
    """Builds the bodies of one request's choices. ``prompt_texts[i]`` is prompt i's text (echoed when
    ``echo``); ``n`` choices per prompt. ``tool_parser`` (chat with tools) reads each choice's tool calls and
    ``reasoning_parser`` its reasoning, streamed as they are generated (``chat_message.py``)."""

    def __init__(self, chat: bool, model: str, tokens: TokenTexts, n: int = 1, echo: bool = False,
                 prompt_texts: Sequence[str] = (), show_prompt_logprobs: bool = False,
                 tool_parser: ToolParser | None = None, reasoning_parser: ReasoningParser | None = None) -> None:
        self.chat, self.model, self.tokens, self.n, self.echo = chat, model, tokens, n, echo
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self._streams: dict[int, ChoiceStream] = {}
        self.prompt_texts = list(prompt_texts)
        self.show_prompt_logprobs = show_prompt_logprobs
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.system_fingerprint: str | None = None  # the answering version's content hash, once routed

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": choices}

    def usage(self, outs: Sequence[RequestOutput]) -> dict[str, Any]:
        """Each prompt counted once, each generated token once; ``prompt_tokens_details.cached_tokens``: the
        prompt tokens whose K/V came from the prefix cache (the engine's count at admission)."""
        prompt = sum(len(o.prompt_token_ids) for o in outs[:: self.n])
        completion = sum(len(o.token_ids) for o in outs)
        cached = sum(o.times.prefix_cached_tokens for o in outs[:: self.n] if o.times is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def full(self, outs: Sequence[RequestOutput]) -> dict:
        """The non-streamed response; ``outs`` are the finished choices in index order."""
        choices = []
        for index, out in enumerate(outs):
            prompt = outs[index - index % self.n]  # choice 0 of this prompt holds its prompt logprobs
            if self.chat:
                message, finish_reason = self._message(out)
                choices.append({"index": index, "message": {"role": "assistant", **message},
                                "logprobs": self._chat_logprobs(out.token_ids, out.logprobs),
                                "finish_reason": finish_reason})
                continue
            choice = self.completion_choice(index, out, prompt.prompt_logprobs, 0, len(out.token_ids), True)
            choice["finish_reason"] = out.finish_reason
            choices.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = self.usage(outs)
        if self.chat and self.show_prompt_logprobs:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(outs[0].prompt_logprobs)
        return body

    def completion_choice(self, index: int, out: RequestOutput, prompt_logprobs: list | None, start: int, end: int,
                          first: bool, text: str | None = None, offset: int = 0) -> dict:
        """Choice ``index`` carrying generated tokens ``[start, end)`` and ``text`` (default: all of the
        output's); the first chunk of an echoed choice leads with the prompt."""
        text = out.text if text is None else text
        echoed = self.echo and first
        lead = self.prompt_texts[index // self.n] if echoed else ""
        logprobs = None
        if out.logprobs is not None:
            ids, entries = out.token_ids[start:end], out.logprobs[start:end]
            if echoed:
                scored = prompt_logprobs or [None] * len(out.prompt_token_ids)
                ids, entries = out.prompt_token_ids + ids, list(scored) + entries
            logprobs = self._legacy_logprobs(ids, entries, offset)
        choice = {"index": index, "text": lead + text, "logprobs": logprobs, "finish_reason": None}
        if self.show_prompt_logprobs and first:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt_logprobs)
        return choice

    def _message(self, out: RequestOutput) -> tuple[dict[str, Any], str | None]:
        """A finished chat choice's message fields and finish reason: its text, or its tool calls."""
        return message_fields(out.text, out.finish_reason, self.tool_parser, self.reasoning_parser)

    def chat_delta(self, index: int, out: RequestOutput, start: int, end: int, text: str) -> dict | None:
        """The chunk choice for tokens ``[start, end)`` and their ``text``; with tools or reasoning, the deltas
        known now (None while there is nothing to send)."""
        delta: dict[str, Any] = {"content": text} if text else {}
        finish_reason = None
        if self.tool_parser is not None or self.reasoning_parser is not None:
            stream = self._streams.setdefault(index, ChoiceStream(self.tool_parser, self.reasoning_parser))
            delta, finish_reason = stream.delta(out.text, out.finished, out.finish_reason)
            if not delta and not out.finished:
                return None
        return {"index": index, "delta": delta,
                "logprobs": self._chat_logprobs(out.token_ids[start:end], out.logprobs and out.logprobs[start:end]),
                "finish_reason": finish_reason}

    def role_chunk(self, index: int) -> dict:
        return self._envelope("chat.completion.chunk", [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}])

    def chunk(self, choice: dict) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, outs: Sequence[RequestOutput]) -> dict:
        """The extra last chunk sent when ``stream_options.include_usage`` is set."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = self.usage(outs)
        return body

    def _legacy_logprobs(self, ids: Sequence[int], entries: Sequence[TokenLogprob | None], offset: int) -> dict:
        tokens = [self.tokens.text(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else {**{self.tokens.text(t): lp for t, lp in e.top},
                                                          self.tokens.text(e.token_id): e.logprob} for e in entries],
                "text_offset": offsets}

    def _chat_logprobs(self, ids: Sequence[int], entries: Sequence[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        text, raw = self.tokens.text, self.tokens.bytes
        return {"content": [{"token": text(t), "logprob": e.logprob, "bytes": raw(t),
                             "top_logprobs": [{"token": text(i), "logprob": lp, "bytes": raw(i)} for i, lp in e.top]}
                            for t, e in zip(ids, entries, strict=True)]}

    def _vllm_prompt_logprobs(self, entries: Sequence[TokenLogprob | None] | None) -> list | None:
        if entries is None:
            return None
        out: list[dict | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            ranked = {t: (lp, rank) for rank, (t, lp) in enumerate(e.top, start=1)}
            ranked[e.token_id] = (e.logprob, e.rank)
            out.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": self.tokens.text(t)}
                        for t, (lp, rank) in ranked.items()})
        return out
