// The playground's start-up: read /v1/models, fill the compare form, start the slot table; when a
// /v1 call answers 401, hide the rest and ask for the API key (kept in memory only, see api.js).

import { setApiKey, onUnauthorized, api } from "./api.js";
import { initCompare, setModels } from "./compare.js";
import { initAdapters, startPolling, stopPolling } from "./adapters.js";

const $ = (id) => document.getElementById(id);

function showKeyPrompt(message) {
  stopPolling();
  $("compare").hidden = true;
  $("adapters").hidden = true;
  $("key-section").hidden = false;
  $("key-error").textContent = message;
  $("server-line").textContent = "Waiting for the API key.";
  $("api-key").focus();
}

async function loadModels() {
  const cards = (await api("/v1/models")).data;
  setModels(cards);
  const adapters = cards.length - 1;
  $("server-line").textContent = `Base model ${cards.find((c) => c.parent === null)?.id ?? cards[0].id}; `
    + `${adapters} adapter${adapters === 1 ? "" : "s"} loaded.`;
}

async function connect() {
  try {
    await loadModels();
  } catch (error) {
    if (error.status !== 401) $("server-line").textContent = `Could not list the models: ${error.message}`;
    return;
  }
  $("key-section").hidden = true;
  $("compare").hidden = false;
  $("adapters").hidden = false;
  startPolling();
}

function init() {
  onUnauthorized(showKeyPrompt);
  initCompare();
  initAdapters(() => loadModels().catch(() => {}));
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setApiKey($("api-key").value.trim());
    $("api-key").value = "";
    $("key-error").textContent = "Checking the key…";
    connect();
  });
  connect();
}

init();
