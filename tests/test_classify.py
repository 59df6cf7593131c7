"""Classification with SEQ_CLS adapters (issue 38, engine half): a PEFT adapter's saved ``score`` head is read
with its version, and a classifying request (``PoolingParams(classify=True)``) is a prefill-only row whose
logits equal HF ``AutoModelForSequenceClassification`` + PEFT's within 1e-5 relative, in batches mixing
classifying rows of several adapters with embedding and generating rows (whose tokens do not change); a
request keeps the head of the version it was admitted on across a reload."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex import LLM, InvalidAdapter, PoolingParams, RequestError, SamplingParams
from loraplex.errors import AdapterShapeMismatch
from tests.classifier_fixtures import hf_classifier_logits, write_classifier_adapter
from tests.fixtures import write_embedding_adapter
from tests.reference import assert_embedding_close, hf_embeddings
from tests.test_pooling import prompts_of

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CLASSIFY = SamplingParams(max_tokens=0, pooling=PoolingParams("last", normalize=False, classify=True))
LABELS = ("negative", "neutral", "positive")


@pytest.fixture(scope="module")
def classifiers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("classifiers")
    return {"sentiment": write_classifier_adapter(tiny_llama, root / "sentiment", 3, rank=8, seed=31,
                                                  class_labels=LABELS),
            "relevance": write_classifier_adapter(tiny_llama, root / "relevance", 1, rank=4, seed=32)}


@pytest.fixture(scope="module")
def embedder(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_embedding_adapter(tiny_llama, tmp_path_factory.mktemp("cls-emb") / "emb", rank=8, seed=33)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path, classifiers: dict[str, Path], embedder: Path, tiny_llama_adapters: dict[str, Path]) -> LLM:
    llm = LLM(model=str(tiny_llama), max_loras=4, max_lora_rank=16, kv_cache_blocks=256, debug_checks=True)
    for name, folder in {**classifiers, "emb": embedder, "r8_all": tiny_llama_adapters["r8_all"]}.items():
        llm.load_adapter(name, folder)
    return llm


def assert_logits_close(ours: list[float], ref: torch.Tensor) -> None:
    """Within 1e-5 of the reference's largest magnitude (as the embeddings are compared)."""
    assert_embedding_close(ours, ref, rel=1e-5)


def test_mixed_batch_logits_equal_hf_peft_and_neighbours_are_unchanged(
        llm: LLM, tiny_llama: Path, classifiers: dict[str, Path], embedder: Path) -> None:
    """One ``generate`` call: classifying rows of two SEQ_CLS adapters, embedding rows of an embedder and
    generating rows of a LoRA adapter and the base, all in the same steps."""
    gen_names, gen_prompts = ["r8_all", None], prompts_of(2, seed=41)
    cls_names = ["sentiment", "relevance", "sentiment", "relevance"]
    cls_prompts = prompts_of(len(cls_names), seed=42)
    emb_prompts = prompts_of(2, seed=43)
    embed = SamplingParams(max_tokens=0, pooling=PoolingParams("mean"))
    outs = llm.generate(gen_prompts + cls_prompts + emb_prompts,
                        [GREEDY] * 2 + [CLASSIFY] * len(cls_names) + [embed] * 2,
                        adapters=gen_names + cls_names + ["emb", "emb"], use_tqdm=False)
    alone = llm.generate(gen_prompts, GREEDY, adapters=gen_names, use_tqdm=False)
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in alone]
    for out, name, prompt in zip(outs[2:2 + len(cls_names)], cls_names, cls_prompts, strict=True):
        assert out.token_ids == [] and out.error is None
        (ref,) = hf_classifier_logits(tiny_llama, classifiers[name], [prompt])
        assert len(out.embedding) == ref.shape[0]
        assert_logits_close(out.embedding, ref)
    for out, prompt in zip(outs[2 + len(cls_names):], emb_prompts, strict=True):
        assert_embedding_close(out.embedding, hf_embeddings(tiny_llama, embedder, [prompt], "mean")[0])
    assert llm.stats().num_running == 0


def test_classify_offline_api_labels_and_probabilities(llm: LLM, tiny_llama: Path,
                                                       classifiers: dict[str, Path]) -> None:
    """``LLM.classify``: softmax of HF's logits, the label named by the folder's ``id2label`` (``LABEL_0``
    without one), text prompts tokenized as the engine's other prompts are."""
    prompts = ["the film was wonderful", [7, 8, 9, 10], "a dull and tedious evening"]
    outs = llm.classify(prompts, adapters=["sentiment", "sentiment", "relevance"], use_tqdm=False)
    for out, prompt, name in zip(outs, prompts, ["sentiment", "sentiment", "relevance"], strict=True):
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
        assert out.prompt_token_ids == ids and out.adapter == name
        (ref,) = hf_classifier_logits(tiny_llama, classifiers[name], [ids])
        assert_logits_close(out.logits, ref)
        probs = torch.softmax(ref.double(), 0)
        assert out.probs == pytest.approx(probs.tolist(), abs=1e-6)
        names = LABELS if name == "sentiment" else ("LABEL_0",)
        assert out.label == names[int(probs.argmax())]


def test_requests_keep_their_versions_head_across_a_reload(tiny_llama: Path, classifiers: dict[str, Path],
                                                           tmp_path: Path) -> None:
    """Requests admitted before ``sentiment`` is reloaded with another head finish with the old version's
    logits; requests admitted after it get the new one's (the head travels with the version, never by name)."""
    other = write_classifier_adapter(tiny_llama, tmp_path / "sentiment-v2", 3, rank=8, seed=77, class_labels=LABELS)
    llm = LLM(model=str(tiny_llama), max_loras=2, max_lora_rank=16, kv_cache_blocks=128, debug_checks=True)
    llm.load_adapter("sentiment", classifiers["sentiment"])
    engine = llm.engine
    prompts = prompts_of(3, seed=44)
    old_version = engine.adapters.resolve("sentiment")
    before = [engine.add_request(None, p, CLASSIFY, old_version) for p in prompts]
    llm.load_adapter("sentiment", other, new_version=True)
    assert engine.adapters.resolve("sentiment") != old_version
    after = [engine.add_request(None, p, CLASSIFY, engine.adapters.resolve("sentiment")) for p in prompts]
    results: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.embedding
    old_refs = hf_classifier_logits(tiny_llama, classifiers["sentiment"], prompts)
    new_refs = hf_classifier_logits(tiny_llama, other, prompts)
    for request_id, ref in zip(before, old_refs, strict=True):
        assert_logits_close(results[request_id], ref)
    for request_id, ref in zip(after, new_refs, strict=True):
        assert_logits_close(results[request_id], ref)
    assert not torch.allclose(old_refs[0], new_refs[0])


def test_classification_refusals(llm: LLM) -> None:
    """A classifying request on the base model, on an adapter without a head, with mean pooling or normalized:
    a ``RequestError`` naming the field; nothing is left running."""
    prompt = [5, 6, 7]
    with pytest.raises(RequestError, match="has no classification head") as err:
        llm.generate([prompt], CLASSIFY, adapters="emb", use_tqdm=False)
    assert err.value.param == "model"
    with pytest.raises(RequestError, match="classification reads one adapter"):
        llm.generate([prompt], CLASSIFY, use_tqdm=False)
    with pytest.raises(RequestError, match="pooling 'last', no normalize"):
        llm.generate([prompt], SamplingParams(max_tokens=0, pooling=PoolingParams("mean", False, classify=True)),
                     adapters="sentiment", use_tqdm=False)
    with pytest.raises(RequestError, match="no classification head"):
        llm.classify([prompt], adapters="emb", use_tqdm=False)
    assert llm.stats().num_running == 0 and llm.stats().num_waiting == 0


def _broken(folder: Path, tmp_path: Path, tensors: dict | None = None, config_json: object = None) -> Path:
    """A copy of ``folder`` with its tensors replaced by ``tensors(old)`` and its config.json by ``config_json``."""
    out = tmp_path / "broken"
    out.mkdir()
    old = load_file(str(folder / "adapter_model.safetensors"))
    save_file(tensors(old) if tensors else old, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    if config_json is not None:
        (out / "config.json").write_text(json.dumps(config_json))
    return out


HEAD = "base_model.model.score.weight"
BROKEN_HEADS = {
    "wrong_hidden": (lambda t: {**t, HEAD: torch.zeros(3, 32)}, None, AdapterShapeMismatch, "expected [3, 64]"),
    "no_labels": (lambda t: {**t, HEAD: torch.zeros(0, 64)}, None, InvalidAdapter, "with 1 to 65536 labels"),
    "nan": (lambda t: {**t, HEAD: torch.full((3, 64), float("nan"))}, None, InvalidAdapter, "NaN or inf"),
    "two_heads": (lambda t: {**t, "base_model.model.classifier.weight": torch.zeros(3, 64)}, None, InvalidAdapter,
                  "two classification heads"),
    "bias_alone": (lambda t: {**{k: v for k, v in t.items() if k != HEAD}, "base_model.model.score.bias":
                              torch.zeros(3)}, None, InvalidAdapter, "bias without the score head's weight"),
    "bad_id2label": (None, {"id2label": {"zero": "a"}}, InvalidAdapter, "id2label maps class ids"),
    "gappy_id2label": (None, {"id2label": {"0": "a", "2": "c"}}, InvalidAdapter, "name classes 0 to 1"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_HEADS))
def test_broken_heads_are_refused(case: str, llm: LLM, classifiers: dict[str, Path], tmp_path: Path) -> None:
    """A malformed head or label file: a precise error naming the folder and the problem; nothing loads."""
    tensors, config_json, error, message = BROKEN_HEADS[case]
    folder = _broken(classifiers["sentiment"], tmp_path, tensors, config_json)
    with pytest.raises(error, match=re.escape(message)) as err:
        llm.load_adapter(f"broken-{case}", folder)
    assert str(folder) in str(err.value)
    assert f"broken-{case}" not in {a.name for a in llm.list_adapters()}


def test_head_bias_is_applied(tiny_llama: Path, classifiers: dict[str, Path], tmp_path: Path) -> None:
    """A ``classifier`` head with a bias (other families' heads have one): logits = h W^T + b, b checked against
    the bias-free head's logits on the same prompt."""
    bias = torch.tensor([1.5, -2.0, 0.25])
    folder = _broken(classifiers["sentiment"], tmp_path, lambda t: {
        **{k: v for k, v in t.items() if k != HEAD}, "base_model.model.classifier.weight": t[HEAD],
        "base_model.model.classifier.bias": bias})
    llm = LLM(model=str(tiny_llama), max_loras=2, max_lora_rank=16, kv_cache_blocks=64)
    llm.load_adapter("with-bias", folder)
    prompt = prompts_of(1, seed=45)[0]
    (out,) = llm.classify([prompt], adapters="with-bias", use_tqdm=False)
    (ref,) = hf_classifier_logits(tiny_llama, classifiers["sentiment"], [prompt])
    assert_logits_close(out.logits, ref + bias)
