"""Untrusted adapter files do bounded work and cannot break out (issue 30, adapter half).

Each hostile case is refused by ``AdapterManager.load`` with its precise error type and message, and
the manager (names, slots, slot version, counters) is exactly as it was; realistic adapters still load.
The safetensors header cases are in ``test_weight_file.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.adapters.manager import AdapterManager
from loraplex.adapters.names import check_adapter_name
from loraplex.adapters.reading import safe_files
from loraplex.adapters.reading.overflow_bound import INPUT_NORM, WEIGHT_BOUND
from loraplex.adapters.reading.peft_format import read_peft_adapter
from loraplex.config import ModelConfig
from loraplex.errors import (
    AdapterError,
    AdapterOverflow,
    AdapterShapeMismatch,
    ForbiddenAdapterPath,
    InvalidAdapter,
    InvalidAdapterName,
)
from loraplex.ops.lora_batch import BatchMapping
from tests.fixtures import write_peft_adapter
from tests.test_peft_format import NullWriter

Q = "base_model.model.model.layers.0.self_attn.q_proj"
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


@pytest.fixture
def manager(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> Iterator[AdapterManager]:
    """A manager serving one good adapter, pinned in a slot."""
    manager = AdapterManager(ModelConfig.from_hf(tiny_llama), max_loras=2, max_cpu_loras=2, max_lora_rank=16,
                             writer=NullWriter())
    manager.acquire(manager.load("good", tiny_llama_adapters["r2_qv"]).version_id)
    yield manager
    manager.close()


def _state(manager: AdapterManager) -> tuple:
    return manager.list(), list(manager.slot_table.slots), manager.slot_table.version, manager.counters()


def refused(manager: AdapterManager, folder: Path, error: type[AdapterError], fragments: list[str],
            roots: list[Path] | None = None, name: str = "bad") -> str:
    """``manager.load(name, folder)`` raises exactly ``error`` with every fragment, and changes nothing."""
    before = _state(manager)
    with pytest.raises(error) as info:
        manager.load(name, folder, roots=roots)
    assert type(info.value) is error
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert _state(manager) == before
    manager.check_integrity()
    return message


def _copy(src: Path, dst: Path, config: dict | None = None,
          tensors: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> Path:
    shutil.copytree(src, dst)
    if config:
        raw = json.loads((dst / CONFIG).read_text())
        (dst / CONFIG).write_text(json.dumps({**raw, **config}))
    if tensors:
        save_file(tensors(load_file(dst / WEIGHTS)), dst / WEIGHTS)
    return dst


# ---- 1. the overflow bound ----

def _set(key: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], dict]:
    return lambda t: {**t, key: edit(t[key].clone())}


def _one_at(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def edit(t: torch.Tensor) -> torch.Tensor:
        t[0, 0] = value
        return t
    return edit


MODULE, BOUND = "module 'model.layers.0.self_attn.q_proj'", "over the bound 9.22e+18"
OVERFLOW = {  # id -> (tensor edit, message fragments)
    "lora_A_one_3e38": (_set(f"{Q}.lora_A.weight", _one_at(3e38)), [MODULE, "||lora_A||_F = 3e+38", BOUND]),
    "lora_A_all_3e38": (_set(f"{Q}.lora_A.weight", lambda t: torch.full_like(t, 3e38)),
                        [MODULE, "||lora_A||_F = 4.8e+39", BOUND]),  # 3e38 * sqrt(4 * 64)
    "product": (_set(f"{Q}.lora_B.weight", lambda t: t * 1e19),
                [MODULE, "||lora_A||_F * ||scale * lora_B||_F =", BOUND]),
}


@pytest.mark.parametrize("case", OVERFLOW)
def test_weights_that_overflow_a_step_are_refused(case: str, manager: AdapterManager,
                                                  tiny_llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    edit, fragments = OVERFLOW[case]
    folder = _copy(tiny_llama_adapters["r4_attn"], tmp_path / case, tensors=edit)
    refused(manager, folder, AdapterOverflow, [str(folder), *fragments])


def test_replaced_vocabulary_rows_are_bounded(manager: AdapterManager, tiny_llama_adapters: dict[str, Path],
                                              tiny_llama: Path, tmp_path: Path) -> None:
    lm_head = load_file(tiny_llama / "model.safetensors")["model.embed_tokens.weight"].clone()  # tied: as saved
    lm_head[7] = 1e20
    folder = _copy(tiny_llama_adapters["r4_attn"], tmp_path / "rows", {"modules_to_save": ["lm_head"]},
                   lambda t: {**t, "base_model.model.lm_head.weight": lm_head})
    norm = float(lm_head.double().norm())
    refused(manager, folder, AdapterOverflow, [f"lm_head rows: L2 norm {norm:.3g}", "over the bound 9.22e+18"])


def test_the_bound_is_where_a_float32_delta_stays_finite(manager: AdapterManager,
                                                          tiny_llama_adapters: dict[str, Path],
                                                          tiny_llama: Path, tmp_path: Path) -> None:
    """At 0.99 of the bound (2^63, written out here) the adapter loads, and its q_proj delta for an input of
    norm 2^64 aimed along its largest singular direction stays within 2^127 in float32 and equals a float64
    reference; at 1.01 it is refused."""
    src = tiny_llama_adapters["r2_qv"]
    tensors = load_file(src / WEIGHTS)
    a, b = tensors[f"{Q}.lora_A.weight"], tensors[f"{Q}.lora_B.weight"]
    scale = read_peft_adapter(src, ModelConfig.from_hf(tiny_llama), 16).config.scale_for("model.layers.0.self_attn"
                                                                                         ".q_proj")
    product = float(a.norm() * (b * scale).norm())
    assert (WEIGHT_BOUND, INPUT_NORM) == (2.0**63, 2.0**64)
    for factor, loads in ((0.99, True), (1.01, False)):
        grow = (factor * 2.0**63 / product) ** 0.5  # half into A, half into B
        folder = _copy(src, tmp_path / f"x{factor}", tensors=lambda t, g=grow: {
            **t, f"{Q}.lora_A.weight": a * g, f"{Q}.lora_B.weight": b * g})
        if not loads:
            refused(manager, folder, AdapterOverflow, ["||lora_A||_F * ||scale * lora_B||_F",
                                                       f"= {factor * 2.0**63:.3g}, over the bound"])
            continue
        info = manager.load(f"edge{factor}", folder)
        a_s, b_s = manager.host.get(info.version_id).modules[(0, "q_proj")]
        delta = (b_s.double() @ a_s.double())  # [out, in]
        direction = torch.linalg.svd(delta).Vh[0]  # the input that the delta grows most
        x = (direction * 2.0**64).float()[None]  # [1, in], ||x|| = 2^64
        out = (x @ a_s.t()) @ b_s.t()  # the step's order: shrink, then expand
        assert bool(torch.isfinite(out).all()) and float(out.abs().max()) <= 2.0**127
        torch.testing.assert_close(out.double(), x.double() @ delta.t(), rtol=1e-4, atol=0)


def test_realistic_adapters_load_far_below_the_bound(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                                     tmp_path: Path) -> None:
    """The test fixtures, a fresh PEFT init (B = 0), a strongly scaled one (alpha / r = 256) and the demo
    adapters (on SmolLM2) all load; their largest ||A||_F ||scale * B||_F is under 1e-12 of the bound."""
    from loraplex.demo_adapters import DEMO_ADAPTERS
    from loraplex.models.embedded import embedded_checkpoint

    tiny = ModelConfig.from_hf(tiny_llama)
    cases = [(tiny, folder) for folder in tiny_llama_adapters.values()]
    cases.append((tiny, write_peft_adapter(tiny_llama, tmp_path / "init", rank=4, b_std=0.0)))
    cases.append((tiny, write_peft_adapter(tiny_llama, tmp_path / "scaled", rank=2, alpha=512.0, b_std=0.2)))
    smollm2 = ModelConfig.from_hf(embedded_checkpoint())
    cases += [(smollm2, folder) for folder in DEMO_ADAPTERS.values()]
    for model_config, folder in cases:
        weights = read_peft_adapter(folder, model_config, 16)
        largest = max(float(a.norm() * b.norm()) for a, b in weights.modules.values())
        assert largest < 1e-12 * WEIGHT_BOUND, (folder, largest)


def test_dora_gain_is_bounded_after_folding(tiny_llama: Path, tmp_path: Path) -> None:
    """A DoRA magnitude within the bound on its own whose folded gain ``|m| + 2 g ||B_j|| ||A||_F`` is not
    (m at 1e18 per feature: ||m|| = 8e18, the gain a few times that) is refused once the real model folds g."""
    from loraplex.models.loader import load_model
    from loraplex.models.registry import model_config
    from tests.format_fixtures import format_config, write_format_adapter

    folder = write_format_adapter(tiny_llama, tmp_path / "dora", seed=3, **format_config(tiny_llama, "dora"))
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_magnitude_vector"
    tensors = load_file(folder / WEIGHTS)
    save_file({**tensors, key: torch.full_like(tensors[key], 1e18)}, folder / WEIGHTS)
    cfg = model_config(tiny_llama)
    model = load_model(tiny_llama, cfg, 2, 16, torch.float32, "cpu")
    manager = AdapterManager(cfg, 2, 2, 16, writer=model)
    read_peft_adapter(folder, cfg, 16)  # the file alone passes: ||m|| = 8e18 is within the bound
    message = refused(manager, folder, AdapterOverflow, ["module 'layers.1.q_proj': DoRA's folded gain",
                                                         "over the bound 9.22e+18"])
    assert WEIGHT_BOUND < float(re.search(r"\|\|_2 = ([0-9.e+]+), over", message)[1]) < 10 * WEIGHT_BOUND
    manager.close()


# ---- 2. files are checked, not only folders ----

_WATCHED: list[tuple[str, list[str]]] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _WATCHED and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        for watched, seen in _WATCHED:
            if os.path.realpath(path) == watched:
                seen.append(path)


sys.addaudithook(_audit)  # audit hooks cannot be removed: this one only looks while a test watches


class _watching:  # noqa: N801 (a context manager read as a phrase)
    """Records every Python-level open of ``paths`` (after symlinks) while active."""

    def __init__(self, *paths: Path) -> None:
        self.seen: list[str] = []
        self.entries = [(os.path.realpath(path), self.seen) for path in paths]

    def __enter__(self) -> list[str]:
        _WATCHED.extend(self.entries)
        return self.seen

    def __exit__(self, *exc: object) -> None:
        for entry in self.entries:
            _WATCHED.remove(entry)


@pytest.fixture
def root(tmp_path: Path, tiny_llama_adapters: dict[str, Path]) -> Path:
    """An adapter root holding a copy of ``r4_attn`` as ``root/adapter``; ``tmp_path/outside`` is not in it."""
    shutil.copytree(tiny_llama_adapters["r4_attn"], tmp_path / "outside")
    shutil.copytree(tiny_llama_adapters["r4_attn"], tmp_path / "root" / "adapter")
    return tmp_path / "root"


def _link(path: Path, target: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to(target)


def test_a_file_linked_out_of_the_root_is_forbidden(manager: AdapterManager, root: Path) -> None:
    folder, outside = root / "adapter", root.parent / "outside"
    _link(folder / WEIGHTS, outside / WEIGHTS)
    refused(manager, folder, ForbiddenAdapterPath, [f"{folder}: {WEIGHTS} resolves to {outside / WEIGHTS}",
                                                    "outside the allowed adapter roots", str(root)], roots=[root])
    assert manager.load("trusted", folder).name == "trusted"  # no roots (start-up adapters): links are followed


@pytest.mark.parametrize("name", [CONFIG, "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_config_and_tokenizer_files_out_of_the_root_are_forbidden(name: str, manager: AdapterManager,
                                                                  root: Path, tiny_llama: Path) -> None:
    """The folder ships the base's tokenizer (regular files) but one file is a link out of the root."""
    for regular in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / regular, root / "adapter" / regular)
    target = Path("/etc/passwd") if name == CONFIG else tiny_llama / name
    _link(root / "adapter" / name, target)
    refused(manager, root / "adapter", ForbiddenAdapterPath, [f"{name} resolves to {target}", "outside"],
            roots=[root])


def test_a_folder_linked_out_of_the_root_is_forbidden(manager: AdapterManager, root: Path) -> None:
    (root / "link").symlink_to(root.parent / "outside")
    refused(manager, root / "link", ForbiddenAdapterPath, ["the adapter folder resolves to", "outside"], roots=[root])


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_only_regular_files_are_opened(kind: str, manager: AdapterManager, root: Path) -> None:
    """A FIFO would block an open for reading, a device could be endless: neither is ever opened (no open
    reaches it; the load returns at once, under a watchdog), whatever the roots."""
    folder = root / "adapter"
    name, what = {"fifo": (WEIGHTS, "is a FIFO"), "device": (WEIGHTS, "is a character device"),
                  "directory": (CONFIG, "is a directory")}[kind]
    (folder / name).unlink()
    if kind == "fifo":
        os.mkfifo(folder / name)
    elif kind == "device":
        (folder / name).symlink_to("/dev/zero")
    else:
        (folder / name).mkdir()
    result: list[str] = []
    watchdog = threading.Thread(target=lambda: result.append(
        refused(manager, folder, ForbiddenAdapterPath, [f"{folder}: {name} {what}, not a regular file"])))
    with _watching(folder / name) as opened:
        watchdog.start()
        watchdog.join(timeout=60)
    assert result, "the load blocked or failed otherwise"
    assert opened == []


def _swap_before_open(monkeypatch: pytest.MonkeyPatch, target: Path, swap: Callable[[], None]) -> None:
    real_open = os.open

    def open_after_swap(path: str, flags: int, *args: int, **kwargs: int) -> int:
        if Path(path) == target:
            swap()
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_after_swap)


@pytest.mark.parametrize("swap", ["other_file", "symlink", "parent_directory"])
def test_a_file_swapped_between_its_check_and_its_open_is_forbidden(swap: str, manager: AdapterManager, root: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check after the open bites on its own: the inode (another file renamed over it), O_NOFOLLOW (a
    link put in its place) and the descriptor's real path (a parent swapped for a link to a hard link
    of the very same file outside the root)."""
    folder, outside = root / "adapter", root.parent / "outside"
    target = folder / WEIGHTS

    def other_file() -> None:
        os.replace(outside / WEIGHTS, target)

    def symlink() -> None:
        _link(target, outside / WEIGHTS)

    def parent_directory() -> None:
        shutil.rmtree(outside)
        outside.mkdir()
        os.link(target, outside / WEIGHTS)  # the same inode, now also outside the root
        os.rename(folder, root / "moved")
        folder.symlink_to(outside)

    _swap_before_open(monkeypatch, target, {"other_file": other_file, "symlink": symlink,
                                            "parent_directory": parent_directory}[swap])
    fragment = {"other_file": "changed between its check and its open",
                "symlink": "became a symbolic link after its check",
                "parent_directory": f"resolves to {outside / WEIGHTS}, outside"}[swap]
    refused(manager, folder, ForbiddenAdapterPath, [f"{folder}: {WEIGHTS}", fragment], roots=[root])


def test_paths_inside_files_are_never_opened(manager: AdapterManager, root: Path, tiny_llama: Path,
                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``base_model_name_or_path`` and the tokenizer config's path fields point at a secret outside the root
    (a valid tokenizer.json with one more token), and ``additional_chat_templates/`` (which transformers
    reads from a folder it is given) links to a secret template: the load succeeds, no Python-level open
    touches a secret, the tokenizer served is the folder's own (the secret's token and template absent),
    and the tokenizer config transformers reads has no path fields (older transformers in pyproject's
    range opened them as given)."""
    from transformers import AutoTokenizer

    secret = tmp_path / "secret" / "tokenizer.json"
    secret.parent.mkdir()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.add_tokens(["<|secret|>"])
    tokenizer.save_pretrained(secret.parent)
    folder = root / "adapter"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / name, folder / name)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    fields = ("vocab_file", "merges_file", "tokenizer_file", "special_tokens_map_file")
    (folder / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, **dict.fromkeys(fields, str(secret)),
                                                              "fast_tokenizer_files": [str(secret)]}))
    raw = json.loads((folder / CONFIG).read_text())
    (folder / CONFIG).write_text(json.dumps({**raw, "base_model_name_or_path": str(secret)}))
    template = secret.parent / "evil.jinja"
    template.write_text("{{ 'secret template' }}")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "evil.jinja").symlink_to(template)
    seen_configs: list[dict] = []
    real = AutoTokenizer.from_pretrained

    def recording(path: str, **kwargs: object) -> object:
        seen_configs.append(json.loads((Path(path) / "tokenizer_config.json").read_text()))
        return real(path, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recording)
    with _watching(secret, template) as opened:
        info = manager.load("pointed", folder, roots=[root])
    assert opened == []
    assert "<|secret|>" not in info.tokenizer.get_vocab() and len(info.tokenizer) == len(tokenizer) - 1
    assert "secret template" not in str(info.tokenizer.chat_template)
    assert len(seen_configs) == 1 and not [k for k in seen_configs[0] if k.endswith(("_file", "_files"))]


def test_the_audit_hook_sees_python_opens(tmp_path: Path) -> None:
    """The watcher above is not blind: an open of the watched path is recorded."""
    secret = tmp_path / "secret.txt"
    secret.write_text("x")
    with _watching(secret) as opened:
        secret.read_text()
    assert opened == [str(secret)]


# ---- 3. adapter names ----

@pytest.mark.parametrize("name", ["../../etc/passwd", " ", "a\nb", "x" * 10_000, "", ".hidden", "-a", "a/b",
                                  "a b", "naïve", "x" * 129, None, 3])
def test_bad_names_are_refused(name: object, manager: AdapterManager, tiny_llama_adapters: dict[str, Path]) -> None:
    message = refused(manager, tiny_llama_adapters["r4_attn"], InvalidAdapterName,
                      ["does not match ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"], name=name)  # type: ignore[arg-type]
    assert len(message) < 400  # a 10,000-character name is shown shortened
    assert InvalidAdapterName.http_status == 400


@pytest.mark.parametrize("name", ["a", "A.b_c-1", "v2", "x" * 128, "0"])
def test_good_names_pass(name: str) -> None:
    assert check_adapter_name(name) == name


def test_name_error_keeps_its_param_across_pickling() -> None:
    import pickle

    with pytest.raises(InvalidAdapterName) as info:
        check_adapter_name("a b", param="lora_name")
    again = pickle.loads(pickle.dumps(info.value))
    assert (type(again), str(again), again.param) == (InvalidAdapterName, str(info.value), "lora_name")


# ---- 4. bounded parsing of the config ----

CONFIGS = {  # id -> (config changes, message fragments); every one an InvalidAdapter naming its field
    "invalid_regex": ({"target_modules": "q_proj("}, ["target_modules regex is not a valid RE2 regex (missing )"]),
    "lookaround": ({"target_modules": r".*(?<!k)_proj"}, ["not a valid RE2 regex", "no lookaround or backreferences"]),
    "exclude_regex": ({"exclude_modules": "["}, ["exclude_modules regex is not a valid RE2 regex"]),
    "rank_pattern_key": ({"rank_pattern": {"q_proj(": 2}}, ["rank_pattern key 'q_proj(' is not a valid RE2 regex"]),
    "rank_pattern_value": ({"rank_pattern": {"q_proj": "2"}}, ["rank_pattern['q_proj'] must be a positive integer, "
                                                               "got '2'"]),
    "rank_pattern_list": ({"rank_pattern": ["q_proj"]}, ["rank_pattern must be an object of module pattern -> value, "
                                                         "got ['q_proj']"]),
    "alpha_pattern_text": ({"alpha_pattern": {"q_proj": "x"}}, ["alpha_pattern['q_proj'] must be a finite number, "
                                                                "got 'x'"]),
    "alpha_pattern_bool": ({"alpha_pattern": {"q_proj": True}}, ["alpha_pattern['q_proj'] must be a finite number"]),
    "lora_alpha_nan": ({"lora_alpha": float("nan")}, ["lora_alpha must be a finite number, got nan"]),
    "layers_text": ({"layers_to_transform": ["x"]}, ["layers_to_transform must be a layer index or a list of layer "
                                                     "indices (integers >= 0), got ['x']"]),
    "layers_negative": ({"layers_to_transform": [-1]}, ["layers_to_transform must be", "got [-1]"]),
    "layers_bool": ({"layers_to_transform": True}, ["layers_to_transform must be", "got True"]),
    "trainable_id_huge": ({"trainable_token_indices": [10**9]}, ["vocabulary of 1000000001 tokens (trainable token "
                                                                 "id 1000000000) adds more than 65536 tokens"]),
    "trainable_id_past_limit": ({"trainable_token_indices": [49152 + 65536]}, ["vocabulary of 114689 tokens "
                                                                               "(trainable token id 114688) adds more "
                                                                               "than 65536 tokens to the base model's "
                                                                               "49152"]),
    "trainable_id_at_limit": ({"trainable_token_indices": [49152 + 65535]}, ["trainable_token_indices lists "
                                                                             "embed_tokens but the adapter has no"]),
}


@pytest.mark.parametrize("case", CONFIGS)
def test_bad_config_fields_are_precise_400s(case: str, manager: AdapterManager, tiny_llama_adapters: dict[str, Path],
                                            tmp_path: Path) -> None:
    changes, fragments = CONFIGS[case]
    folder = _copy(tiny_llama_adapters["r4_attn"], tmp_path / case, changes)
    refused(manager, folder, InvalidAdapter, [f"{folder}: ", *fragments])
    assert InvalidAdapter.http_status == 400


def test_a_catastrophic_regex_runs_in_linear_time(manager: AdapterManager, tiny_llama_adapters: dict[str, Path],
                                                  tmp_path: Path) -> None:
    """``m([\\w.]+)+!`` backtracks exponentially in Python's ``re`` on the 31-character module names (minutes);
    RE2 answers at once. The watchdog only tells a hang from an answer."""
    folder = _copy(tiny_llama_adapters["r4_attn"], tmp_path / "redos", {"target_modules": r"m([\w.]+)+!"})
    result: list[str] = []
    watchdog = threading.Thread(target=lambda: result.append(refused(manager, folder, InvalidAdapter, [
        "tensors for module 'model.layers.0.self_attn.k_proj', which target_modules='m([\\\\w.]+)+!'"])), daemon=True)
    watchdog.start()
    watchdog.join(timeout=60)
    assert result, "the regex did not finish"


@pytest.mark.parametrize("case", ["deep", "large", "not_an_object"])
def test_the_config_file_is_bounded_before_it_is_parsed(case: str, manager: AdapterManager,
                                                        tiny_llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(tiny_llama_adapters["r4_attn"], tmp_path / case)
    text, fragment = {
        "deep": ('{"r": 4, "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
                 f"{CONFIG} nests 100001 levels deep, over the limit of 32"),
        "large": (json.dumps({"r": 4, "pad": "x" * (2 << 20)}), f"{CONFIG} is {(2 << 20) + 19} bytes, over the "
                                                               "limit of 1048576 bytes"),
        "not_an_object": ("[1, 2]", f"{CONFIG} must hold a JSON object"),
    }[case]
    (folder / CONFIG).write_text(text)
    refused(manager, folder, InvalidAdapter, [f"{folder}: {fragment}"])


def test_a_sparse_2_gib_file_is_refused_before_its_data_is_read(manager: AdapterManager,
                                                                tiny_llama_adapters: dict[str, Path], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A header declaring a 2 GiB q_proj.lora_A (the config needs [4, 64]) over a sparse file: refused on
    its declared shape; no read reaches past the header and resident memory does not grow."""
    folder = _copy(tiny_llama_adapters["r4_attn"], tmp_path / "sparse")
    tensors = load_file(folder / WEIGHTS)
    huge = 1 << 31
    header = {name: {"dtype": "F32", "shape": list(t.shape), "data_offsets": [0, 0]} for name, t in tensors.items()}
    header[f"{Q}.lora_A.weight"]["shape"] = [4, huge // 16]
    offset = 0
    for entry in header.values():
        size = 4 * entry["shape"][0] * entry["shape"][1]
        entry["data_offsets"], offset = [offset, offset + size], offset + size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = folder / WEIGHTS
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)  # sparse: no disk, reads as zeros
    reads: list[tuple[int, int]] = []
    real_readinto = safe_files.AdapterFile.readinto
    monkeypatch.setattr(safe_files.AdapterFile, "readinto",
                        lambda self, buffer, at: (reads.append((at, len(buffer))), real_readinto(self, buffer, at))[1])
    rss = _resident_bytes()
    refused(manager, folder, AdapterShapeMismatch, [f"{Q.removeprefix('base_model.model.')}.lora_A has shape "
                                                    f"[4, {huge // 16}], expected [4, 64]"])
    assert max(at + n for at, n in reads) <= 8 + len(raw)
    assert _resident_bytes() - rss < 256 << 20


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- 5. loads run off the manager's critical section ----

def test_a_hostile_load_never_stalls_the_step_loops_calls(manager: AdapterManager,
                                                          tiny_llama_adapters: dict[str, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A load parked inside its validation (a gate in the overflow check of a 3e38 adapter) while another
    thread calls ``lora_batch`` and ``try_acquire``: both answer, then the load fails alone."""
    from loraplex.adapters.reading import peft_format

    good = manager.resolve("good")
    folder = _copy(tiny_llama_adapters["r4_attn"], tmp_path / "huge", tensors=OVERFLOW["lora_A_one_3e38"][0])
    parked, release = threading.Event(), threading.Event()
    real_check = peft_format.check_pairs

    def gated_check(*args: object) -> None:
        parked.set()
        release.wait(timeout=60)
        real_check(*args)

    monkeypatch.setattr(peft_format, "check_pairs", gated_check)
    before = _state(manager)
    failures: list[BaseException] = []

    def load() -> None:
        try:
            manager.load("huge", folder)
        except AdapterOverflow as e:
            failures.append(e)

    loader = threading.Thread(target=load)
    loader.start()
    assert parked.wait(timeout=60)
    answers: list[object] = []
    step = threading.Thread(target=lambda: answers.extend([manager.lora_batch(BatchMapping((good, None))),
                                                           manager.try_acquire(good)]))
    step.start()
    step.join(timeout=30)
    answered = not step.is_alive()
    release.set()
    loader.join(timeout=60)
    step.join(timeout=60)
    assert answered, "lora_batch / try_acquire waited for the hostile load"
    assert answers[0] is not None and answers[1] == manager.slot_table.slot_of[good]
    manager.release(good)  # the extra pin try_acquire took
    assert len(failures) == 1 and _state(manager)[:3] == before[:3]
    manager.check_integrity()
