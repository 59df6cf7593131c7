"""The playground at ``GET /`` in a real browser (Playwright driving Debian's headless Chromium) against a
real server on a tiny model with three adapters: four models compared at once, each panel equal to the
API's own greedy answer; the live slot table through pins and an eviction; load and unload from the
page with the API's errors as worded; the API-key prompt; one column in a narrow window."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from loraplex.server.app import create_app
from tests.browser_harness import chromium
from tests.server_harness import BASE, Server, running_server, tiny_server, wait_until_idle

CONFIG = dict(max_loras=3, max_cpu_loras=6, max_lora_rank=16, kv_cache_blocks=256, max_num_seqs=8)
STARTUP = ("r8_all", "r4_attn", "r2_qv")
PROMPT = "Name three colours."
STATS = re.compile(r"TTFT \d+\.\d\d s · (?:\d+\.\d|…) tokens/s · (\d+) tokens?")

expect.set_options(timeout=30_000)  # a busy 2-core host


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_server(tiny_llama, tiny_llama_adapters, STARTUP, ("r16_mlp",), tmp_path_factory.mktemp("root"),
                     **CONFIG) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as b:
        yield b


@pytest.fixture()
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    yield context.new_page()
    context.close()


def open_playground(page: Page, url: str) -> None:
    page.goto(f"{url}/")
    expect(page.locator("#slot-table tbody tr")).to_have_count(CONFIG["max_loras"])


def tick_only(page: Page, models: list[str]) -> None:
    for box in page.locator('#model-list input[name="model"]').all():
        box.set_checked(box.get_attribute("value") in models)


def api_error(url: str, path: str, body: dict, status: int, key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=30)
    assert response.status_code == status, response.text
    return response.json()["error"]["message"]


def check_panels(page: Page, server: Server, models: list[str], chat: bool, max_tokens: int,
                 key: str = "unused") -> None:
    """Every panel finished and shows the API's own greedy answer and token count for its model."""
    expect(page.locator('.panel[data-state="done"]')).to_have_count(len(models))
    client = server.client(key)
    for model in models:
        if chat:
            answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                                    max_tokens=max_tokens, temperature=0)
            text = answer.choices[0].message.content
        else:
            answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
            text = answer.choices[0].text
        panel = page.locator(f'.panel[data-model="{model}"]')
        assert panel.locator(".panel-output").text_content() == text, model
        expect(panel.locator(".panel-status")).to_have_text(
            f"Done (finish reason: {answer.choices[0].finish_reason})")
        stats = STATS.fullmatch(panel.locator(".panel-stats").text_content())
        assert stats and int(stats.group(1)) == answer.usage.completion_tokens, model


def test_compare_streams_each_models_own_answer(server: Server, page: Page) -> None:
    open_playground(page, server.url)
    boxes = page.locator('#model-list input[name="model"]')
    expect(boxes).to_have_count(4)
    assert [b.get_attribute("value") for b in boxes.all() if b.is_checked()] == [BASE, *STARTUP]  # the default
    page.fill("#prompt", PROMPT)
    page.fill("#max-tokens", "12")
    page.press("#prompt", "Control+Enter")  # runs from the keyboard
    check_panels(page, server, [BASE, *STARTUP], chat=True, max_tokens=12)
    assert len({page.locator(f'.panel[data-model="{m}"] .panel-output').text_content()
                for m in (BASE, *STARTUP)}) >= 3  # not one answer copied into every panel

    page.check('input[name="mode"][value="completion"]')
    tick_only(page, [BASE, "r2_qv"])
    page.fill("#max-tokens", "8")
    page.click("#run")
    check_panels(page, server, [BASE, "r2_qv"], chat=False, max_tokens=8)
    expect(page.locator("#compare-status")).to_have_text("Finished 2 answers.")

    for field, value in (("#temperature", "0.8"), ("#top-p", "0.9"), ("#top-k", "20"), ("#seed", "7")):
        page.fill(field, value)  # every sampling field reaches the API: a seeded sample equals the API's
    tick_only(page, ["r2_qv"])
    page.click("#run")
    expect(page.locator('.panel[data-state="done"]')).to_have_count(1)
    sampled = server.client().completions.create(model="r2_qv", prompt=PROMPT, max_tokens=8, temperature=0.8,
                                                 top_p=0.9, seed=7, extra_body={"top_k": 20})
    assert page.locator(".panel-output").text_content() == sampled.choices[0].text

    page.fill("#max-tokens", "1000")  # past the tiny model's context: each panel shows the API's words
    tick_only(page, [BASE, "r2_qv"])
    page.click("#run")
    message = api_error(server.url, "/v1/completions", {"model": BASE, "prompt": PROMPT, "max_tokens": 1000}, 400)
    expect(page.locator(".panel-status")).to_have_text([f"Error: {message}"] * 2)
    expect(page.locator("#compare-status")).to_have_text("Finished; 2 of 2 did not complete.")


def slot_cells(page: Page, field: str) -> list[str]:
    return page.locator(f'#slot-table td[data-field="{field}"]').all_text_contents()


def test_slot_table_follows_pins_and_an_eviction(server: Server, page: Page) -> None:
    client = server.client()
    for name in STARTUP:  # in this order: r8_all becomes the least recently used slot
        client.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0)
    open_playground(page, server.url)
    # which slot each holds depends on the order concurrent requests reached the engine: any order
    one_of_them = re.compile(rf"^(?:{'|'.join(STARTUP)})$")
    expect(page.locator('#slot-table td[data-field="adapter"]')).to_have_text([one_of_them] * len(STARTUP))
    assert sorted(slot_cells(page, "adapter")) == sorted(STARTUP)
    slots = dict(zip(slot_cells(page, "adapter"), slot_cells(page, "slot"), strict=True))
    evictions = int(page.locator('dd[data-counter="device_evictions"]').text_content())

    pinned = server.engine.adapters.resolve("r4_attn")
    row = page.locator(f'#slot-table tr[data-slot="{slots["r4_attn"]}"]')
    server.engine.adapters.acquire(pinned)  # as two running requests would
    server.engine.adapters.acquire(pinned)
    try:
        expect(row.locator('td[data-field="pins"]')).to_have_text("2")
        expect(row.locator('td[data-field="last-use"]')).to_have_text("in use now")
    finally:
        server.engine.adapters.release(pinned)
        server.engine.adapters.release(pinned)
    expect(row.locator('td[data-field="pins"]')).to_have_text("0")
    expect(row.locator('td[data-field="last-use"]')).to_have_text(re.compile(r"\d+\.\d s ago"))

    httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=30,
               json={"lora_name": "fourth", "lora_path": str(server.root / "r16_mlp")}).raise_for_status()
    fourth = page.locator('#adapter-table tr[data-adapter="fourth"]')
    expect(fourth.locator('td[data-field="where"]')).to_have_text("host memory")
    client.completions.create(model="fourth", prompt=PROMPT, max_tokens=2, temperature=0)
    evicted_row = page.locator(f'#slot-table tr[data-slot="{slots["r8_all"]}"]')
    expect(evicted_row.locator('td[data-field="adapter"]')).to_have_text("fourth")
    expect(evicted_row.locator('td[data-field="version"]')).to_have_text(
        f"v{server.engine.adapters.resolve('fourth')}")
    expect(evicted_row.locator('td[data-field="rank"]')).to_have_text("16")
    expect(page.locator('dd[data-counter="device_evictions"]')).to_have_text(str(evictions + 1))
    assert "r8_all" not in slot_cells(page, "adapter")
    expect(fourth.locator('td[data-field="where"]')).to_have_text(f"device slot {slots['r8_all']}")
    expect(page.locator('#adapter-table tr[data-adapter="r8_all"] td[data-field="where"]')).to_have_text(
        "host memory")
    httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "fourth"}, timeout=30).raise_for_status()
    wait_until_idle(server.engine)


def load_from_page(page: Page, name: str, path: str) -> None:
    page.fill("#lora-name", name)
    page.fill("#lora-path", path)
    page.press("#lora-path", "Enter")


def test_load_and_unload_from_the_page(server: Server, page: Page) -> None:
    open_playground(page, server.url)
    result = page.locator("#adapter-result")
    body = {"lora_name": "extra", "lora_path": str(server.root / "r16_mlp")}
    load_from_page(page, body["lora_name"], body["lora_path"])
    expect(result).to_have_text("Done: adapter 'extra' loaded")
    models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    assert "extra" in [m["id"] for m in models]
    expect(page.locator('#model-list input[value="extra"]')).to_have_count(1)
    expect(page.locator('#adapter-table tr[data-adapter="extra"] td[data-field="where"]')).to_have_text(
        "host memory")

    load_from_page(page, body["lora_name"], body["lora_path"])  # the name is taken
    expect(result).to_have_text("Error (HTTP 409): " + api_error(server.url, "/v1/load_lora_adapter", body, 409))
    outside = {"lora_name": "outside", "lora_path": str(server.outside["r8_all"])}
    load_from_page(page, outside["lora_name"], outside["lora_path"])
    expect(result).to_have_text("Error (HTTP 403): " + api_error(server.url, "/v1/load_lora_adapter", outside, 403))

    page.get_by_role("button", name="Unload extra").focus()
    page.keyboard.press("Enter")
    expect(result).to_have_text("Done: adapter 'extra' unloaded")
    models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    assert "extra" not in [m["id"] for m in models]
    expect(page.locator('#model-list input[value="extra"]')).to_have_count(0)
    expect(page.locator('#adapter-table tr[data-adapter="extra"]')).to_have_count(0)


def test_api_key_prompt(server: Server, page: Page) -> None:
    key = "playground-key"
    app = create_app(server.engine_client, served_model_name=BASE, api_key=key)  # runtime loading off
    with running_server(app) as url:
        assert httpx.get(f"{url}/", timeout=30).status_code == 200  # the page itself needs no key
        assert httpx.get(f"{url}/playground/main.js", timeout=30).status_code == 200
        unauthorized = httpx.get(f"{url}/v1/slots", timeout=30)
        assert unauthorized.status_code == 401
        snapshot = httpx.get(f"{url}/v1/slots", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
        assert snapshot["runtime_adapters"] is False and len(snapshot["slots"]) == CONFIG["max_loras"]

        page.goto(f"{url}/")
        expect(page.locator("#key-section")).to_be_visible()
        expect(page.locator("#compare")).to_be_hidden()
        expect(page.locator("#key-error")).to_have_text(unauthorized.json()["error"]["message"])
        page.fill("#api-key", "wrong")
        page.press("#api-key", "Enter")
        expect(page.locator("#key-error")).to_have_text(unauthorized.json()["error"]["message"])
        expect(page.locator("#compare")).to_be_hidden()
        page.fill("#api-key", key)
        page.press("#api-key", "Enter")
        expect(page.locator("#key-section")).to_be_hidden()
        expect(page.locator('#model-list input[name="model"]')).to_have_count(4)
        expect(page.locator("#slot-table tbody tr")).to_have_count(CONFIG["max_loras"])
        expect(page.locator("#runtime-note")).to_contain_text("--allow-runtime-adapters")
        expect(page.locator("#load-form button")).to_be_disabled()
        expect(page.get_by_role("button", name=re.compile("^Unload"))).to_have_count(0)

        tick_only(page, [BASE, "r4_attn"])
        page.fill("#prompt", PROMPT)
        page.fill("#max-tokens", "6")
        page.click("#run")
        check_panels(page, server, [BASE, "r4_attn"], chat=True, max_tokens=6)
        assert page.evaluate("() => [sessionStorage.length, localStorage.length]") == [0, 0]
        page.reload()  # the key lived in the tab's memory only
        expect(page.locator("#key-section")).to_be_visible()


def test_narrow_window_is_one_column(server: Server, browser: Browser) -> None:
    context = browser.new_context(viewport={"width": 360, "height": 740})
    page = context.new_page()
    try:
        open_playground(page, server.url)
        page.fill("#max-tokens", "2")
        page.click("#run")
        expect(page.locator('.panel[data-state="done"]')).to_have_count(4)
        lefts = {round(p.bounding_box()["x"]) for p in page.locator(".panel").all()}
        assert len(lefts) == 1  # stacked, not side by side
        assert page.evaluate("() => document.documentElement.scrollWidth") <= 360  # no sideways scrolling
    finally:
        context.close()
