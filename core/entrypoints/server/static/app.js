// The chat and the engine view. Talks to the server's own API only:
// /v1/models, /v1/chat/completions (stream=true, server-sent events) and
// /v1/engine/state (polled once a second). The API key, when the server has
// one, comes from ?key=... (then dropped from the address bar) or the key
// dialog, and is kept in local storage.
"use strict";

const KEY_STORE = "paged.apiKey";
const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);
const conversation = [];  // {role, content} turns sent with each request
let controller = null;    // the streaming request's AbortController
let pollTimer = null;

// -- the API key --------------------------------------------------------------------

function takeKeyFromAddress() {
  const url = new URL(window.location.href);
  const key = url.searchParams.get("key");
  if (key === null) return;
  localStorage.setItem(KEY_STORE, key);
  url.searchParams.delete("key");
  window.history.replaceState(null, "", url.pathname + url.search + url.hash);
}

function authHeaders(extra = {}) {
  const key = localStorage.getItem(KEY_STORE);
  return key ? {...extra, Authorization: `Bearer ${key}`} : extra;
}

class NeedsKey extends Error {}

function askForKey() {
  const dialog = $("key-dialog");
  if (!dialog.open) {
    $("key-input").value = localStorage.getItem(KEY_STORE) || "";
    dialog.showModal();
  }
}

async function api(path, options = {}) {
  const response = await fetch(path, {...options, headers: authHeaders(options.headers)});
  if (response.status === 401) {
    askForKey();
    throw new NeedsKey("this server needs its API key");
  }
  return response;
}

async function errorText(response) {
  try {
    return (await response.json()).error.message;
  } catch (e) {
    return `HTTP ${response.status}`;
  }
}

// -- models and settings ----------------------------------------------------------

async function loadModels() {
  const response = await api("/v1/models");
  if (!response.ok) throw new Error(await errorText(response));
  const select = $("model");
  select.replaceChildren();
  for (const model of (await response.json()).data) {
    const option = document.createElement("option");
    option.value = option.textContent = model.id;
    select.append(option);
  }
  $("model-name").textContent = select.value;
}

function numberSetting(id) {
  const text = $(id).value.trim();
  return text === "" ? null : Number(text);
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({role: "system", content: system});
  messages.push(...conversation);
  const body = {model: $("model").value, messages, stream: true, stream_options: {include_usage: true}};
  for (const [field, id] of [["temperature", "temperature"], ["top_p", "top-p"], ["max_tokens", "max-tokens"],
                             ["seed", "seed"]]) {
    const value = numberSetting(id);
    if (value !== null) body[field] = value;
  }
  return body;
}

// -- the chat -----------------------------------------------------------------------

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.append(body);
  $("messages").append(div);
  div.scrollIntoView({block: "end"});
  return div;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// Server-sent events from a fetch body: yields each `data:` payload.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("chat-error").textContent = "";
  $("prompt").value = "";
  conversation.push({role: "user", content: text});
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  reply.classList.add("streaming");
  controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let content = "", firstAt = null, finish = null, usage = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(requestBody()),
      signal: controller.signal});
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = (choice.delta && choice.delta.content) || "";
        if (piece && firstAt === null) firstAt = performance.now();
        content += piece;
        finish = choice.finish_reason || finish;
      }
      reply.querySelector(".text").textContent = content;
      reply.scrollIntoView({block: "end"});
    }
  } catch (error) {
    if (error.name !== "AbortError") $("chat-error").textContent = error.message;
    finish = finish || (error.name === "AbortError" ? "stopped" : "error");
  } finally {
    controller = null;
    setBusy(false);
    reply.classList.remove("streaming");
  }
  conversation.push({role: "assistant", content});
  reply.dataset.finish = finish || "";
  const meta = document.createElement("span");
  meta.className = "meta";
  const parts = [];
  if (usage) parts.push(`${usage.completion_tokens} tokens`);
  if (firstAt !== null) {
    parts.push(`first token ${Math.round(firstAt - started)} ms`);
    const seconds = (performance.now() - firstAt) / 1000;
    if (usage && usage.completion_tokens > 1 && seconds > 0) {
      parts.push(`${((usage.completion_tokens - 1) / seconds).toFixed(1)} tok/s`);
    }
  }
  if (finish) parts.push(finish);
  meta.textContent = parts.join(" · ");
  reply.append(meta);
}

// -- the engine view ------------------------------------------------------------------

function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? `${Math.round(value * 1000)} ms` : `${value.toFixed(2)} s`;
}

function showState(state) {
  const requests = state.requests, kv = state.kv_cache, history = state.history;
  $("model-name").textContent = `${state.model} · context ${state.max_model_len}`;
  $("stat-running").textContent = requests.running;
  $("stat-waiting").textContent = requests.waiting;
  $("stat-finished").textContent = requests.finished;
  $("stat-preemptions").textContent = requests.preemptions;
  $("stat-hit-rate").textContent = kv.prefix_queries ? `${(100 * kv.prefix_hit_rate).toFixed(1)}%` : "–";
  $("kv-used").textContent = kv.blocks_used;
  $("kv-free").textContent = kv.blocks_free;
  $("kv-total").textContent = kv.blocks_total;
  $("kv-bar").style.width = `${(100 * kv.usage).toFixed(1)}%`;
  // tok/s now: the last full seconds (the current one is still filling)
  const bins = history.output_tokens_per_s;
  const last = bins.slice(-6, -1);
  $("stat-toks").textContent = (last.reduce((a, b) => a + b, 0) / Math.max(last.length, 1)).toFixed(1);
  for (const el of document.querySelectorAll(".window")) el.textContent = Math.round(history.window_s / 60);
  const now = history.start + bins.length;
  drawPlot($("plot-throughput"), {windowS: history.window_s, now, series: [
    {color: "#2f6fde", points: bins.map((n, i) => [history.start + i + 1, n])}]});
  drawPlot($("plot-latency"), {windowS: history.window_s, now, series: [
    {color: "#d9822b", dots: true, points: history.ttft_s},
    {color: "#2f9e6f", dots: true, points: history.itl_s}]});
  showRecent(state.recent);
}

function showRecent(recent) {
  const rows = recent.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.id = r.id;
    for (const text of [r.id, r.prompt_tokens, r.output_tokens, seconds(r.ttft_s), seconds(r.itl_s),
                        seconds(r.e2e_s), r.finish_reason || "–"]) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.append(td);
    }
    tr.firstChild.title = `${r.id}, finished ${new Date(r.finished_at * 1000).toLocaleTimeString()}`;
    return tr;
  });
  $("recent").tBodies[0].replaceChildren(...rows);
}

async function poll() {
  try {
    const response = await api("/v1/engine/state");
    if (!response.ok) throw new Error(await errorText(response));
    showState(await response.json());
    $("status").className = "status ok";
    $("status").title = "engine state: live";
  } catch (error) {
    $("status").className = "status down";
    $("status").title = `engine state: ${error.message}`;
    if (error instanceof NeedsKey) return;  // resumes once a key is given
  }
  pollTimer = setTimeout(poll, POLL_MS);
}

function restartPolling() {
  clearTimeout(pollTimer);
  poll();
}

// -- wiring ---------------------------------------------------------------------------

function start() {
  takeKeyFromAddress();
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("clear").addEventListener("click", () => {
    conversation.length = 0;
    $("messages").replaceChildren();
  });
  $("model").addEventListener("change", () => { $("model-name").textContent = $("model").value; });
  $("key-button").addEventListener("click", askForKey);
  $("key-dialog").addEventListener("close", () => {
    if ($("key-dialog").returnValue !== "save") return;
    localStorage.setItem(KEY_STORE, $("key-input").value.trim());
    loadModels().catch(() => {});
    restartPolling();
  });
  loadModels().catch((error) => { $("chat-error").textContent = error.message; });
  poll();
}

document.addEventListener("DOMContentLoaded", start);
