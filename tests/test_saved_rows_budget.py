"""The memory budget for saved vocabulary rows: reported at start, counted per adapter version (only
rows that differ from the base), a load past it fails precisely and changes nothing, an unloaded
version still pinned keeps its rows until the last release, and those versions stay in host memory
(never silently re-read) while plain adapters cycle through the LRU tier."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from loraplex import LLM, AdapterMemoryBudgetExceeded
from loraplex.adapters.manager import AdapterManager
from loraplex.models.loader import load_model
from loraplex.models.registry import model_config
from tests.fixtures import write_peft_adapter, write_tiny_model
from tests.format_fixtures import FORMATS, write_format_adapter

VOCAB, HIDDEN = 512, 64
ROW = HIDDEN * 4  # bytes of one float32 row
SAVED = 2 * 40 * ROW  # "saved" changes 40 rows of embed_tokens and 40 of lm_head


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("budget")
    base = write_tiny_model(root / "base", "llama", vocab_size=VOCAB)
    out = {"base": base, "plain1": write_peft_adapter(base, root / "plain1", rank=2, seed=1),
           "plain2": write_peft_adapter(base, root / "plain2", rank=2, seed=2)}
    for i, name in enumerate(("saved", "saved2")):
        out[name] = write_format_adapter(base, root / name, seed=3 + i, **dict(FORMATS["saved"]))
    out["tokens"] = write_format_adapter(base, root / "tokens", seed=5, **dict(FORMATS["tokens"]))
    return out


def test_budget_refuses_past_it_and_frees_on_unload(folders: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="loraplex.engine.engine"):
        llm = LLM(model=str(folders["base"]), max_loras=2, kv_cache_blocks=32, saved_rows_budget_bytes=SAVED + 4 * ROW)
    matrix = f"a whole embed_tokens or lm_head is {VOCAB * ROW / 2**20:.1f} MiB"
    assert "budget 0 MiB" in caplog.text and matrix in caplog.text
    info = llm.load_adapter("saved", folders["saved"])
    assert info.saved_bytes == SAVED and llm.engine.stats().saved_rows_bytes == SAVED
    llm.load_adapter("tokens", folders["tokens"])  # 3 trainable rows (tied: shared by lm_head) fit too
    assert llm.engine.stats().saved_rows_bytes == SAVED + 3 * ROW
    before = (llm.list_adapters(), llm.engine.adapters.counters())
    with pytest.raises(AdapterMemoryBudgetExceeded) as err:
        llm.load_adapter("saved2", folders["saved2"])
    assert err.value.http_status == 507
    message = str(err.value)
    for fragment in (str(folders["saved2"]), "'saved2'", f"{SAVED / 2**20:.1f} MiB", "0.0 MiB", "unload"):
        assert fragment in message
    assert (llm.list_adapters(), llm.engine.adapters.counters()) == before
    llm.unload_adapter("saved")
    assert llm.engine.stats().saved_rows_bytes == 3 * ROW
    llm.load_adapter("saved2", folders["saved2"])


def test_pinned_unloaded_version_holds_its_rows_until_release(folders: dict[str, Path]) -> None:
    cfg = model_config(folders["base"])
    model = load_model(folders["base"], cfg, 2, 8, torch.float32, "cpu")
    manager = AdapterManager(cfg, 2, 2, 8, writer=model, saved_rows_budget=SAVED)
    first = manager.load("saved", folders["saved"]).version_id
    manager.acquire(first)
    manager.unload("saved")
    with pytest.raises(AdapterMemoryBudgetExceeded):
        manager.load("saved2", folders["saved2"])
    manager.release(first)  # the last pin: the slot is cleared and the rows are freed
    manager.load("saved2", folders["saved2"])
    manager.check_integrity()
    manager.close()


def test_saved_rows_stay_in_host_memory(folders: dict[str, Path]) -> None:
    """One host entry: plain adapters evict each other and are re-read; the saved one never is."""
    llm = LLM(model=str(folders["base"]), max_loras=1, max_cpu_loras=1, kv_cache_blocks=32)
    manager = llm.engine.adapters
    saved = llm.load_adapter("saved", folders["saved"]).version_id
    for name in ("plain1", "plain2"):
        llm.load_adapter(name, folders[name])
    assert manager.host.contains(saved) and manager.counters()["host_evictions"] == 1
    outs = llm.generate([[5, 6, 7]] * 3, adapters=["plain1", "saved", "plain2"], use_tqdm=False)
    assert all(o.finish_reason == "length" for o in outs)
    assert manager.host.contains(saved) and manager.counters()["disk_reads"] >= 1
    manager.check_integrity()
