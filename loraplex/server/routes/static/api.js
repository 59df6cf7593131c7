// Calls to the server's /v1 API: JSON requests and server-sent-event streams, with the API key.
//
// The key lives only in this module's memory (never localStorage or sessionStorage): reloading the
// tab asks for it again. A 401 from any call reports to the handler set with onUnauthorized.

let apiKey = null;
let unauthorizedHandler = () => {};

export function setApiKey(key) {
  apiKey = key || null;
}

export function onUnauthorized(handler) {
  unauthorizedHandler = handler;
}

// An error the API answered with: `message` is the API's own wording (OpenAI's error body).
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (apiKey) h["Authorization"] = `Bearer ${apiKey}`;
  return h;
}

async function errorOf(response) {
  let message = `HTTP ${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) {
    // not JSON: keep the status line
  }
  if (response.status === 401) unauthorizedHandler(message);
  return new ApiError(response.status, message);
}

// GET (body undefined) or POST a JSON body; resolves to the parsed JSON, throws ApiError.
export async function api(path, body, signal) {
  const init = { method: body === undefined ? "GET" : "POST", headers: headers(body !== undefined), signal };
  if (body !== undefined) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// POST a streaming request; yields each `data:` event's parsed JSON until `data: [DONE]`.
// An error event (`data: {"error": ...}`) is thrown as an ApiError with the API's message.
export async function* stream(path, body, signal) {
  const response = await fetch(path, {
    method: "POST", headers: headers(true), body: JSON.stringify({ ...body, stream: true }), signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new ApiError(parsed.error.code || 500, parsed.error.message);
        yield parsed;
      }
    }
  }
}
