"use strict";
// Every request of this page (it included) bears the admin token: the
// browser adds it (a header extension, or a local proxy in front of the
// admin listener); the page never holds it.
async function api(method, path, body) {
  const response = await fetch(path, {
    // Every change declares JSON, bodiless or not (the router refuses a
    // change that does not: see its docs).
    method, headers: method === "GET" ? {} : { "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
    credentials: "omit", cache: "no-store",
  });
  const text = await response.text();
  let value = text;
  try { value = JSON.parse(text); } catch (_) {}
  if (!response.ok) {
    throw new Error((value && value.detail) || (response.status + " " + response.statusText));
  }
  return value;
}

const el = (tag, attrs, ...children) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
};
const say = (text, kind) => { const m = document.getElementById("message"); m.textContent = text; m.className = kind || ""; };
const path = (limit, key, command) => "/api/limits/" + encodeURIComponent(limit) + "/keys/" +
  encodeURIComponent(key) + (command ? "/" + command : "");

// Prometheus text: {metric: [{labels, value}]}.
function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const pair of (m[3] || "").matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]] = pair[2];
    (out[m[1]] = out[m[1]] || []).push({ labels, value: Number(m[4]) });
  }
  return out;
}

const history_ = [];  // [{t, rates: {"rule admitted": n/s, ...}}]
let previous = null;
const colors = ["#3fb950", "#f85149", "#58a6ff", "#d29922", "#bc8cff", "#39c5cf", "#ff7b72", "#a5d6ff"];

function chart() {
  const canvas = document.getElementById("chart"), g = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 30;
  g.clearRect(0, 0, w, h);
  const series = [...new Set(history_.flatMap(p => Object.keys(p.rates)))].sort();
  const max = Math.max(1, ...history_.flatMap(p => Object.values(p.rates)));
  g.strokeStyle = "#2a3540"; g.fillStyle = "#8a96a3"; g.font = "11px system-ui";
  for (let i = 0; i <= 4; i++) {
    const y = h - pad - (h - 2 * pad) * i / 4;
    g.beginPath(); g.moveTo(pad, y); g.lineTo(w - 8, y); g.stroke();
    g.fillText((max * i / 4).toFixed(max < 8 ? 1 : 0), 2, y + 4);
  }
  canvas.dataset.points = history_.length;
  const legend = document.getElementById("legend"); legend.replaceChildren();
  series.forEach((name, i) => {
    const color = colors[i % colors.length];
    g.strokeStyle = color; g.lineWidth = 2; g.beginPath();
    history_.forEach((p, j) => {
      const x = pad + (w - pad - 8) * j / Math.max(1, 59);
      const y = h - pad - (h - 2 * pad) * (p.rates[name] || 0) / max;
      j ? g.lineTo(x, y) : g.moveTo(x, y);
    });
    g.stroke(); g.lineWidth = 1;
    legend.append(el("span", {}, el("i", { style: "background:" + color }), name));
  });
}

async function refreshMetrics() {
  let text;
  try { text = await api("GET", "/metrics"); } catch (_) { return; }
  const metrics = parseMetrics(text), now = performance.now() / 1000;
  const lastLatency = previous ? previous.latency || {} : {};
  const totals = {};
  for (const s of metrics.ratelimit_decisions_total || []) {
    const outcome = s.labels.outcome === "admitted" ? "admitted" : s.labels.outcome === "skipped" ? null : "denied";
    if (!outcome) continue;
    const name = s.labels.rule + " " + outcome;
    totals[name] = (totals[name] || 0) + s.value;
  }
  if (previous) {
    const dt = Math.max(0.001, now - previous.t), rates = {};
    for (const [name, total] of Object.entries(totals)) rates[name] = Math.max(0, total - (previous.totals[name] || 0)) / dt;
    history_.push({ t: now, rates });
    if (history_.length > 60) history_.shift();
    chart();
  }
  previous = { t: now, totals };

  // Store health: the breaker and the mean latency since the last refresh.
  const rows = [];
  const sums = {}, counts = {};
  for (const s of metrics.ratelimit_store_duration_seconds_sum || []) sums[s.labels.rule] = s.value;
  for (const s of metrics.ratelimit_store_duration_seconds_count || []) counts[s.labels.rule] = s.value;
  const rules = new Set([...(metrics.ratelimit_circuit_breaker_open || []).map(s => s.labels.rule), ...Object.keys(counts)]);
  for (const rule of [...rules].sort()) {
    const open = (metrics.ratelimit_circuit_breaker_open || []).find(s => s.labels.rule === rule);
    const before = lastLatency[rule];
    const dc = before ? counts[rule] - before.count : counts[rule];
    const ds = before ? sums[rule] - before.sum : sums[rule];
    const mean = dc > 0 ? (ds / dc * 1000).toFixed(2) + " ms" : "–";
    rows.push(el("tr", {}, el("td", {}, rule),
      el("td", { class: open && open.value === 1 ? "bad" : "ok" }, open && open.value === 1 ? "breaker open" : "healthy"),
      el("td", { class: "num" }, mean)));
  }
  previous.latency = Object.fromEntries([...rules].map(r => [r, { count: counts[r] || 0, sum: sums[r] || 0 }]));
  if (rows.length) document.querySelector("#store tbody").replaceChildren(
    el("tr", {}, el("th", {}, "rule"), el("th", {}, "state"), el("th", { class: "num" }, "mean latency")), ...rows);
}

let limits = [];

async function refreshRules() {
  const shown = await api("GET", "/api/rules");
  const box = document.getElementById("rules"); box.replaceChildren(); box.className = "";
  limits = [];
  const table = el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "rule"), el("th", {}, "policy"), el("th", {}, "algorithm"), el("th", {}, "tiers"))));
  const body = el("tbody");
  for (const rule of (shown.rules && shown.rules.rules) || []) {
    limits.push(rule.name);
    body.append(el("tr", {}, el("td", {}, el("code", {}, rule.name)), el("td", {}, rule.policy), el("td", {}, rule.algorithm),
      el("td", {}, Object.entries(rule.tiers).map(([t, p]) => t + ": " + p).join(", ") || "–")));
  }
  for (const limiter of shown.limiters || []) {
    limits.push(limiter.name);
    body.append(el("tr", {}, el("td", {}, el("code", {}, limiter.name)), el("td", {}, limiter.policy), el("td", {}, "–"), el("td", {}, "–")));
  }
  table.append(body); box.append(table);
  const watch = shown.watch;
  if (watch) {
    const loaded = watch.loaded_at_ms ? new Date(watch.loaded_at_ms).toLocaleString() : "–";
    box.append(el("p", {}, "source ", el("code", {}, watch.source), " · version ", el("b", {}, watch.version), " · loaded ", loaded));
    if (watch.error) box.append(el("p", { class: "bad" }, "last error: " + watch.error));
    if (watch.rejected) box.append(el("details", {}, el("summary", { class: "warn" }, "last rejected set: " + watch.rejected.error), el("pre", {}, watch.rejected.text)));
  } else if (shown.source) {
    box.append(el("p", { class: "dim" }, "source: " + shown.source));
  }
}

async function act(limit, key, command, body) {
  const who = limit + " " + key;
  try {
    const answer = command === "peek" ? await api("GET", path(limit, key))
      : await api("POST", path(limit, key, command), body);
    const s = answer.state;
    say(command + " " + who + ": " + (s.allowed ? "admitted" : s.blocked ? "blocked" : "denied") +
      ", remaining " + s.remaining + (s.retry_after_ms ? ", retry after " + (s.retry_after_ms / 1000).toFixed(1) + " s" : ""), "ok");
    return s;
  } catch (error) { say(command + " " + who + " failed: " + error.message, "bad"); }
}

async function refreshTop() {
  const rows = [];
  for (const limit of limits) {
    let top;
    try { top = await api("GET", "/api/limits/" + encodeURIComponent(limit) + "/top"); } catch (error) { say(error.message, "bad"); continue; }
    for (const { key, denials } of top.keys.slice(0, 10)) {
      const state = el("td", { class: "dim" }, "");
      rows.push(el("tr", { "data-key": key, "data-limit": limit }, el("td", {}, el("code", {}, limit)), el("td", {}, el("code", {}, key)), el("td", { class: "num" }, denials), state,
        el("td", {},
          el("button", { class: "peek", onclick: async () => { const s = await act(limit, key, "peek"); if (s) state.textContent = s.allowed ? "admitted" : s.blocked ? "blocked" : "denied"; } }, "peek"), " ",
          el("button", { class: "reset", onclick: async () => { if (await act(limit, key, "reset", {})) state.textContent = "reset"; } }, "reset"), " ",
          el("button", { class: "block danger", onclick: async () => {
            const minutes = Number(prompt("Block " + key + " for how many minutes (at most a day)?", "10"));
            if (minutes > 0 && await act(limit, key, "block", { seconds: Math.round(minutes * 60) })) state.textContent = "blocked";
          } }, "block"))));
    }
  }
  const body = document.querySelector("#top tbody");
  if (rows.length) body.replaceChildren(...rows);
  else body.replaceChildren(el("tr", {}, el("td", { colspan: "5", class: "dim" }, "no key denied")));
}

async function tick() {
  try {
    await refreshRules();
    await Promise.all([refreshMetrics(), refreshTop()]);
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (error) {
    document.getElementById("updated").textContent = "cannot reach the admin API: " + error.message;
  }
}
tick();
setInterval(tick, 1000);
