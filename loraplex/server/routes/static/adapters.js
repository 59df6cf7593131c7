// Adapters: the live slot table from GET /v1/slots (polled while the tab is visible), the host
// tier, the counters, and load / unload through the API's own endpoints (its errors shown as worded).

import { api } from "./api.js";

const POLL_MS = 500;
const $ = (id) => document.getElementById(id);
const COUNTERS = [
  ["loads", "Loads"], ["device_evictions", "Device evictions"], ["host_evictions", "Host evictions"],
  ["device_hits", "Device hits"], ["host_hits", "Host hits"], ["disk_reads", "Disk re-reads"],
];

let timer = null;
let polling = false;
let chainAlive = false;
let registryChanged = () => {};
let shownAdapters = ""; // the adapter table's data, to re-render (and move focus) only on change

function cell(text, field) {
  const td = document.createElement("td");
  td.textContent = text;
  if (field) td.dataset.field = field;
  return td;
}

function ago(seconds) {
  if (seconds < 60) return `${seconds.toFixed(1)} s ago`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ago`;
  return `${Math.floor(seconds / 3600)} h ago`;
}

function slotRow(slot, now) {
  const tr = document.createElement("tr");
  tr.dataset.slot = slot.slot;
  const empty = slot.adapter === null;
  const name = empty ? "(empty)" : slot.unloaded ? `${slot.adapter} (unloaded; clears when its requests end)`
    : slot.pinned ? `${slot.adapter} (pinned: keeps this slot)` : slot.adapter;
  const lastUse = empty || slot.last_used === null ? "—" : slot.pins > (slot.pinned ? 1 : 0) ? "in use now"
    : ago(Math.max(0, now - slot.last_used));
  tr.append(cell(String(slot.slot), "slot"), cell(name, "adapter"), cell(empty ? "—" : `v${slot.version}`, "version"),
    cell(empty ? "—" : String(slot.rank), "rank"), cell(String(slot.pins), "pins"), cell(lastUse, "last-use"));
  return tr;
}

function where(adapter) {
  if (adapter.slot !== null) return `device slot ${adapter.slot}${adapter.pinned ? " (pinned)" : ""}`;
  return adapter.in_host ? "host memory" : "disk only (re-read on next use)";
}

function adapterRow(adapter, runtime) {
  const tr = document.createElement("tr");
  tr.dataset.adapter = adapter.adapter;
  const action = document.createElement("td");
  if (runtime) {
    const button = Object.assign(document.createElement("button"), { type: "button", textContent: "Unload" });
    button.setAttribute("aria-label", `Unload ${adapter.adapter}`);
    button.addEventListener("click", () => unload(adapter.adapter));
    action.append(button);
  } else {
    action.textContent = "—";
  }
  tr.append(cell(adapter.adapter, "adapter"), cell(`v${adapter.version}`, "version"), cell(String(adapter.rank), "rank"),
    cell(where(adapter), "where"), cell(adapter.path, "path"), action);
  return tr;
}

function renderAdapters(snap) {
  const key = JSON.stringify([snap.adapters, snap.runtime_adapters]);
  if (key === shownAdapters) return;
  shownAdapters = key;
  const focused = document.activeElement && document.activeElement.getAttribute("aria-label");
  const body = $("adapter-table").querySelector("tbody");
  body.replaceChildren(...snap.adapters.map((a) => adapterRow(a, snap.runtime_adapters)));
  if (focused) body.querySelector(`button[aria-label="${CSS.escape(focused)}"]`)?.focus();
  $("load-fields").disabled = !snap.runtime_adapters;
  $("runtime-note").textContent = snap.runtime_adapters ? "The folder must be inside one of the server's "
    + "--adapter-root folders, if it has any." : "Runtime loading is off: start the server with "
    + "--allow-runtime-adapters to load and unload adapters here.";
}

function render(snap) {
  const used = snap.slots.filter((s) => s.adapter !== null).length;
  $("slots-caption").textContent = `(${used} of ${snap.max_loras} in use; slot version ${snap.slot_version})`;
  $("slot-table").querySelector("tbody").replaceChildren(...snap.slots.map((s) => slotRow(s, snap.time)));
  $("host-caption").textContent = `${snap.host.length} of ${snap.max_cpu_loras} adapters, least recently used first.`;
  $("host-list").replaceChildren(...snap.host.map((h) => {
    const li = document.createElement("li");
    li.textContent = `${h.adapter} (v${h.version}, rank ${h.rank})`;
    return li;
  }));
  $("counters").replaceChildren(...COUNTERS.flatMap(([field, label]) => {
    const dt = Object.assign(document.createElement("dt"), { textContent: label });
    const dd = Object.assign(document.createElement("dd"), { textContent: String(snap.counters[field]) });
    dd.dataset.counter = field;
    return [dt, dd];
  }));
  renderAdapters(snap);
  $("slots-status").textContent = `Updated ${new Date(snap.time * 1000).toLocaleTimeString()}; `
    + `refreshed every ${POLL_MS / 1000} s while this tab is visible.`;
}

export async function refreshSlots() {
  try {
    render(await api("/v1/slots"));
  } catch (error) {
    $("slots-status").textContent = `Could not read the slot table: ${error.message}`;
    if (error.status === 401) stopPolling();
  }
}

async function tick() {
  timer = null;
  if (!document.hidden) await refreshSlots();
  if (polling) timer = setTimeout(tick, POLL_MS);
  else chainAlive = false;
}

// Poll /v1/slots every POLL_MS (skipped while the tab is hidden); one chain of timeouts at a time.
export function startPolling() {
  polling = true;
  if (!chainAlive) {
    chainAlive = true;
    tick();
  }
}

export function stopPolling() {
  polling = false;
  if (timer !== null) {
    clearTimeout(timer);
    timer = null;
    chainAlive = false;
  }
}

function showResult(text, error) {
  const line = $("adapter-result");
  const message = Object.assign(document.createElement("span"), { className: "message", textContent: text });
  line.dataset.state = error ? "error" : "ok";
  line.replaceChildren(error ? `Error (HTTP ${error.status}): ` : "Done: ", message);
}

async function call(path, body) {
  try {
    showResult((await api(path, body)).message, null);
    registryChanged();
  } catch (error) {
    showResult(error.message, error);
  }
  await refreshSlots();
}

function unload(name) {
  return call("/v1/unload_lora_adapter", { lora_name: name });
}

export function initAdapters(onRegistryChange) {
  registryChanged = onRegistryChange;
  $("load-form").addEventListener("submit", (event) => {
    event.preventDefault();
    call("/v1/load_lora_adapter", { lora_name: $("lora-name").value.trim(), lora_path: $("lora-path").value.trim() });
  });
}
