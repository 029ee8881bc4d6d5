// The chat page of `aioengine serve` (GET /): streams /v1/chat/completions over fetch and
// a ReadableStream, shows each answer's time to first token and tokens/s, and stops an
// answer by aborting its fetch (the server sees the disconnect and frees the request).
// With --api-key the key is asked for once, kept in sessionStorage, sent as a Bearer token.
// With --reasoning-parser, an answer's reasoning (delta.reasoning_content) is shown in a
// collapsed <details> above it and is not sent back with the conversation.
"use strict";

const KEY_STORAGE = "aioengine-api-key";
const $ = (id) => document.getElementById(id);
const conversation = []; // {role, content} of the turns so far (the system prompt apart)
let controller = null; // the AbortController of the answer streaming now

class AuthError extends Error {}

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message || `${response.status} ${response.statusText}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

async function api(path, options = {}) {
  const headers = { ...authHeaders(), ...(options.headers || {}) };
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) throw new AuthError(await errorMessage(response));
  return response;
}

function askForKey(message) {
  const dialog = $("api-key-dialog");
  $("api-key-error").textContent = message;
  $("api-key").value = "";
  dialog.showModal();
  return new Promise((resolve) => {
    $("api-key-form").onsubmit = () => {
      sessionStorage.setItem(KEY_STORAGE, $("api-key").value);
      resolve();
    };
  });
}

function setStatus(text) {
  $("status").textContent = text;
}

async function loadModels() {
  for (;;) {
    try {
      const response = await api("/v1/models");
      if (!response.ok) throw new Error(await errorMessage(response));
      const { data } = await response.json();
      $("model").replaceChildren(...data.map((card) => new Option(card.id, card.id)));
      showModelDefaults(data[0]);
      setStatus(`ready: ${data.length} model${data.length === 1 ? "" : "s"}`);
      return;
    } catch (e) {
      if (!(e instanceof AuthError)) return setStatus(`cannot list the models: ${e.message}`);
      const refused = sessionStorage.getItem(KEY_STORAGE) ? "That key was refused." : "";
      await askForKey(refused);
    }
  }
}

// The served model's sampling defaults (its card's generation_config, e.g. the bundled
// SmolLM2's temperature 0.2, top_p 0.9) as the settings' starting values.
function showModelDefaults(card) {
  const defaults = (card && card.generation_config) || {};
  for (const name of ["temperature", "top_p"]) {
    if (typeof defaults[name] === "number") $(name).value = String(defaults[name]);
  }
}

function addMessage(role, text) {
  const root = document.createElement("div");
  root.className = `msg ${role}`;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  // The reasoning, collapsed, shown once some arrives.
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "Reasoning";
  const reasoningText = document.createElement("div");
  reasoningText.className = "reasoning-text";
  reasoning.append(summary, reasoningText);
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  const stats = document.createElement("div");
  stats.className = "stats";
  root.append(label, reasoning, body, stats);
  $("messages").append(root);
  root.scrollIntoView({ block: "end" });
  return { root, text: body, stats, reasoning, reasoningText };
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  return {
    model: $("model").value, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
  };
}

// The JSON payloads of a Server-Sent Events response, up to `data: [DONE]`.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        if (line === "data: [DONE]") return;
        yield JSON.parse(line.slice(6));
      }
    }
  }
}

function showStats(answer, timing) {
  const { start, first, end, tokens, finish } = timing;
  const parts = [];
  if (first !== null) {
    const ttft = first - start;
    answer.root.dataset.ttftMs = ttft.toFixed(0);
    parts.push(`TTFT ${ttft.toFixed(0)} ms`);
  }
  if (first !== null && tokens > 1 && end > first) {
    const rate = (tokens - 1) / ((end - first) / 1000); // decoding, after the first token
    answer.root.dataset.tokensPerSecond = rate.toFixed(1);
    parts.push(`${rate.toFixed(1)} tokens/s`);
  }
  parts.push(`${tokens} tokens`, finish || "");
  answer.root.dataset.finish = finish || "";
  answer.stats.textContent = parts.filter(Boolean).join(" · ");
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// Streams one answer into `answer`; returns the finish reason ("stopped" when aborted).
async function streamAnswer(answer, timing) {
  const response = await api("/v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(requestBody()), signal: controller.signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  let chunks = 0;
  let usage = null;
  for await (const chunk of sseEvents(response)) {
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const content = choice.delta?.content;
      const thought = choice.delta?.reasoning_content;
      if (content || thought) {
        if (timing.first === null) timing.first = performance.now();
        chunks += 1;
        timing.tokens = chunks;
      }
      if (thought) {
        answer.reasoning.hidden = false;
        answer.reasoningText.textContent += thought;
      }
      if (content) answer.text.textContent += content;
      if (content || thought) answer.root.scrollIntoView({ block: "end" });
      if (choice.finish_reason) timing.finish = choice.finish_reason;
    }
  }
  if (usage) timing.tokens = usage.completion_tokens;
}

async function send(text) {
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const answer = addMessage("assistant", "");
  const timing = { start: performance.now(), first: null, end: 0, tokens: 0, finish: null };
  controller = new AbortController();
  setBusy(true);
  try {
    await streamAnswer(answer, timing);
  } catch (e) {
    if (e.name === "AbortError") {
      timing.finish = "stopped";
    } else {
      conversation.pop(); // the turn failed: it is not part of the conversation
      answer.root.classList.add("failed");
      answer.text.textContent += `${answer.text.textContent ? "\n" : ""}error: ${e.message}`;
      if (e instanceof AuthError) await askForKey(e.message);
      return;
    }
  } finally {
    timing.end = performance.now();
    controller = null;
    setBusy(false);
  }
  conversation.push({ role: "assistant", content: answer.text.textContent });
  showStats(answer, timing);
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller?.abort());
$("clear").addEventListener("click", () => {
  controller?.abort();
  conversation.length = 0;
  $("messages").replaceChildren();
});
$("api-key-dialog").addEventListener("cancel", (event) => event.preventDefault());
loadModels();
