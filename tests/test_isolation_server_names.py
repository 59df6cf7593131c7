"""Adapter names and adapter roots on every server path (issue 30, item 3), over real HTTP in both engine modes:
a name outside ``ADAPTER_NAME_PATTERN`` is a 400 naming its field on load, unload, rollback and split (and
nothing is loaded); ``--adapter NAME=PATH`` refuses it at the command line; and every file a runtime load opens
(the load route and ``--load-on-demand``) must resolve inside ``--adapter-root``: a folder inside the root
whose weights file is a symlink to a file outside it is a 403, through both paths, while the same folder's
copy loads."""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from loraplex.adapters.names import ADAPTER_NAME_PATTERN
from loraplex.cli import adapter_spec, build_parser
from tests.server_harness import MODES, Server, tiny_server

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=128, max_num_seqs=4)
WEIGHTS = "adapter_model.safetensors"
BAD_NAMES = ["../../etc/passwd", " ", "a\nb", "x" * 10_000, ".hidden", "-lead", "a b", "naïve"]
BAD_IN_PATHS = ["..x", " ", "a\nb", "y" * 10_000, "-lead", "a b"]  # names that fit one URL path segment


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("root")
    outside = tmp_path_factory.mktemp("outside")
    shutil.copytree(tiny_llama_adapters["r4_attn"], outside / "r4_attn")
    shutil.copytree(tiny_llama_adapters["r4_attn"], root / "linked")
    (root / "linked" / WEIGHTS).unlink()
    (root / "linked" / WEIGHTS).symlink_to(outside / "r4_attn" / WEIGHTS)  # the folder is inside, its file not
    shutil.copytree(tiny_llama_adapters["r4_attn"], root / "copied")
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all",), (), root, mode=request.param,
                     app_options={"load_on_demand": True}, **CONFIG) as srv:
        yield srv


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=15)


def names(server: Server) -> list[str]:
    return [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]]


def assert_bad_name(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, 400)
    assert ADAPTER_NAME_PATTERN in error["message"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_bad_name_is_refused_on_load_and_unload(server: Server, tiny_llama_adapters: dict[str, Path],
                                                  name: str) -> None:
    """Checked first: before the path policy (the path is outside the root, a 403 otherwise) and the scope."""
    before = names(server)
    load = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(tiny_llama_adapters["r2_qv"])})
    assert_bad_name(load, "lora_name")
    if len(name) > 64:
        assert f"({len(name)} characters)" in load.json()["error"]["message"]  # shown cut, not echoed whole
    assert names(server) == before
    assert_bad_name(post(server, "/v1/unload_lora_adapter", {"lora_name": name}), "lora_name")


@pytest.mark.parametrize("name", BAD_IN_PATHS)
def test_a_bad_name_is_refused_on_rollback_and_split(server: Server, name: str) -> None:
    segment = quote(name, safe="")
    assert_bad_name(post(server, f"/v1/adapters/{segment}/rollback", {}), "name")
    assert_bad_name(post(server, f"/v1/adapters/{segment}/split", {"v1": 1}), "name")
    assert post(server, "/v1/adapters/no-such/rollback", {}).status_code == 404  # a good unknown name: 404


def test_a_file_linked_out_of_the_root_is_forbidden_on_the_load_route(server: Server) -> None:
    refused = post(server, "/v1/load_lora_adapter", {"lora_name": "linked", "lora_path": str(server.root / "linked")})
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["type"] == "permission_error" and "outside the allowed adapter roots" in error["message"]
    assert WEIGHTS in error["message"] and "linked" not in names(server)
    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "copied", "lora_path": str(server.root / "copied")})
    assert loaded.status_code == 200, loaded.text
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "copied"}).status_code == 200


def test_a_file_linked_out_of_the_root_is_forbidden_on_demand(server: Server) -> None:
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
    refused = post(server, "/v1/completions", {"model": "linked", **body})
    assert refused.status_code == 403, refused.text
    assert "outside the allowed adapter roots" in refused.json()["error"]["message"]
    assert "linked" not in names(server)
    assert post(server, "/v1/completions", {"model": "copied", **body}).status_code == 200
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "copied"}).status_code == 200


def test_a_bad_name_on_demand_is_the_unknown_models_404(server: Server) -> None:
    """A ``model`` outside the pattern is never looked up in the roots (``..x`` would be a folder name)."""
    (server.root / "..x").mkdir(exist_ok=True)
    shutil.copytree(server.root / "copied", server.root / "..x", dirs_exist_ok=True)
    response = post(server, "/v1/completions", {"model": "..x", "prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    assert "..x" not in names(server)


@pytest.mark.parametrize("name", ["../x", ".x", "a b", "x" * 129])
def test_the_command_line_refuses_a_bad_name(name: str, tmp_path: Path) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="does not match"):
        adapter_spec(f"{name}={tmp_path}")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--adapter", f"{name}={tmp_path}"])
    assert adapter_spec(f"ok-1.2_x={tmp_path}") == ("ok-1.2_x", str(tmp_path))
