// Compare: one prompt to several models at once, each answer streamed into its own panel with its
// time to first token (TTFT) and decode speed (tokens after the first / time since the first).

import { stream } from "./api.js";

const DEMO_ADAPTERS = ["shout", "meow", "pirate"];
const $ = (id) => document.getElementById(id);

let baseModel = null;
let selected = null; // Set of model ids ticked; null until the first model list arrives
let controller = null;

function checkbox(id, label) {
  const input = Object.assign(document.createElement("input"), { type: "checkbox", name: "model", value: id });
  input.checked = selected.has(id);
  input.addEventListener("change", () => (input.checked ? selected.add(id) : selected.delete(id)));
  const wrap = document.createElement("label");
  wrap.append(input, ` ${label}`);
  return wrap;
}

// `cards`: /v1/models' data. The base model first; by default the base and the demo adapters
// (or, without them, the first three adapters) are ticked.
export function setModels(cards) {
  const base = cards.find((c) => c.parent === null) || cards[0];
  const adapters = cards.filter((c) => c !== base).map((c) => c.id);
  baseModel = base.id;
  if (selected === null) {
    const demo = DEMO_ADAPTERS.filter((name) => adapters.includes(name));
    selected = new Set([base.id, ...(demo.length ? demo : adapters.slice(0, 3))]);
  }
  const ids = new Set(cards.map((c) => c.id));
  for (const id of [...selected]) if (!ids.has(id)) selected.delete(id);
  const legend = $("model-list").querySelector("legend");
  $("model-list").replaceChildren(legend, checkbox(base.id, `${base.id} (base)`),
    ...adapters.map((id) => checkbox(id, id)));
}

function numberField(id, parse) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : parse(raw);
}

function requestBody(model) {
  const body = {
    model,
    max_tokens: numberField("max-tokens", parseInt),
    temperature: numberField("temperature", parseFloat),
    top_p: numberField("top-p", parseFloat),
    top_k: numberField("top-k", parseInt),
    seed: numberField("seed", parseInt),
    stream_options: { include_usage: true },
  };
  const prompt = $("prompt").value;
  if (document.querySelector('input[name="mode"]:checked').value === "chat") {
    body.messages = [{ role: "user", content: prompt }];
  } else {
    body.prompt = prompt;
  }
  return body;
}

function makePanel(model) {
  const panel = document.createElement("article");
  panel.className = "panel";
  panel.dataset.model = model;
  const title = document.createElement("h3");
  title.textContent = model === baseModel ? `${model} (base)` : model;
  const status = Object.assign(document.createElement("p"), { className: "panel-status" });
  status.setAttribute("role", "status");
  const output = Object.assign(document.createElement("div"), { className: "panel-output", tabIndex: 0 });
  output.setAttribute("role", "region");
  output.setAttribute("aria-label", `Answer of ${model}`);
  output.append(document.createTextNode(""));
  const stats = Object.assign(document.createElement("p"), { className: "panel-stats" });
  const head = Object.assign(document.createElement("div"), { className: "panel-head" });
  head.append(title, status);
  panel.append(head, output, stats);
  return { panel, status, output, stats };
}

function formatStats(t0, first, last, tokens) {
  const ttft = first === null ? "TTFT …" : `TTFT ${((first - t0) / 1000).toFixed(2)} s`;
  const speed = tokens > 1 && last > first ? `${((tokens - 1) / ((last - first) / 1000)).toFixed(1)} tokens/s`
    : "… tokens/s";
  return `${ttft} · ${speed} · ${tokens} token${tokens === 1 ? "" : "s"}`;
}

async function runOne(view, model, signal) {
  const body = requestBody(model);
  const chat = body.messages !== undefined;
  const t0 = performance.now();
  let first = null;
  let last = null;
  let chunks = 0;
  let usage = null;
  let finish = null;
  view.status.textContent = "Waiting for the first token";
  try {
    for await (const chunk of stream(chat ? "/v1/chat/completions" : "/v1/completions", body, signal)) {
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const text = (chat ? choice.delta && choice.delta.content : choice.text) || "";
      if (text) {
        last = performance.now();
        if (first === null) {
          first = last;
          view.status.textContent = "Streaming";
        }
        chunks += 1;
        view.output.firstChild.appendData(text);
        view.stats.textContent = formatStats(t0, first, last, chunks);
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    view.stats.textContent = formatStats(t0, first, last, usage ? usage.completion_tokens : chunks);
    view.status.textContent = `Done (finish reason: ${finish})`;
    view.panel.dataset.state = "done";
  } catch (error) {
    view.panel.dataset.state = error.name === "AbortError" ? "stopped" : "error";
    view.status.textContent = error.name === "AbortError" ? "Stopped" : `Error: ${error.message}`;
  }
}

async function run(event) {
  event.preventDefault();
  if ($("run").disabled) return; // a run is in progress (Ctrl+Enter while running)
  const models = [...document.querySelectorAll('#model-list input[name="model"]:checked')].map((i) => i.value);
  if (models.length === 0) {
    $("compare-status").textContent = "Tick at least one model.";
    return;
  }
  controller = new AbortController();
  $("run").disabled = true;
  $("stop").disabled = false;
  $("compare-status").textContent = `Running ${models.length} model${models.length === 1 ? "" : "s"}…`;
  const views = models.map(makePanel);
  $("panels").replaceChildren(...views.map((v) => v.panel));
  await Promise.all(views.map((view, i) => runOne(view, models[i], controller.signal)));
  const failed = views.filter((v) => v.panel.dataset.state !== "done").length;
  $("compare-status").textContent = failed ? `Finished; ${failed} of ${models.length} did not complete.`
    : `Finished ${models.length} answer${models.length === 1 ? "" : "s"}.`;
  $("run").disabled = false;
  $("stop").disabled = true;
}

export function initCompare() {
  $("compare-form").addEventListener("submit", run);
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("compare-form").requestSubmit();
  });
}
