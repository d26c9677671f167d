// The live console: polls state.json every second and fills the page. No framework, no build step.
"use strict";

const STATE = "state.json";
const EVERY_MS = 1000;
const KEY = "mcp-broker-console-key";
let timer = null;

const $ = (id) => document.getElementById(id);

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "–" : String(text);
  if (cls) td.className = cls;
  return td;
}

function fill(id, rows, empty) {
  const body = $(id);
  const trs = rows.map((cells) => {
    const tr = document.createElement("tr");
    cells.forEach((c) => tr.appendChild(Array.isArray(c) ? cell(c[0], c[1]) : cell(c)));
    return tr;
  });
  if (!trs.length) {
    const tr = document.createElement("tr");
    const td = cell(empty, "empty");
    td.colSpan = body.parentElement.querySelectorAll("th").length;
    tr.appendChild(td);
    trs.push(tr);
  }
  body.replaceChildren(...trs);
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.max(0, Math.round(Date.now() / 1000 - seconds));
  if (s < 120) return s + " s";
  if (s < 7200) return Math.round(s / 60) + " min";
  return Math.round(s / 3600) + " h";
}

function usage(pair) {
  const [used, limit] = pair;
  if (limit === null) return [String(used)];
  const ratio = limit ? used / limit : 1;
  return [used + " / " + limit, ratio >= 1 ? "over" : ratio >= 0.8 ? "near" : ""];
}

function render(state) {
  for (const [name, value] of Object.entries(state.figures)) {
    const el = document.querySelector('[data-metric="' + name + '"]');
    if (el) el.textContent = value === null ? "–" : String(value);
  }
  const backendOk = state.backend === "ok";
  $("status").textContent = backendOk ? "live" : "backend unavailable";
  $("status").className = "status " + (backendOk ? "ok" : "bad");
  $("answered").textContent = "answered by " + state.answered_by.pid + "@" + state.answered_by.host;
  fill("workers", state.workers.map((w) => [w.pid + "@" + w.host, ago(w.started_at), w.streams, w.listens,
    w.changes_per_second, w.partitions, w.sources.join(", ") || "–"]), "no worker");
  fill("partitions", state.partitions.map((p) => [p.partition, p.holder === null ? ["nobody now", "near"] : p.holder,
    p.lag_entries, p.lag_seconds.toFixed(1) + " s"]), "the backend did not answer");
  fill("sources", state.sources.map((s) => [s.name, s.holders.length ? s.holders.join(", ")
    : [s.exclusive ? "nobody holds its lease now" : "not running", "near"]]), "no change source configured");
  fill("failing", state.webhooks.failing.map((f) => [f.id, f.tenant, f.error, ago(f.failing_since)]),
    "none failing");
  fill("letters", state.webhooks.dead_letters.map((d) => [d.subscription, d.tenant, d.attempts, d.error,
    ago(d.at)]), "none");
  fill("tenants", state.tenants.map((t) => [t.tenant, usage(t.streams), usage(t.listens), usage(t.webhooks),
    t.sessions_limit, t.publish_per_second]), "no tenant holds anything under a quota");
}

function showLogin(message) {
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("status").textContent = "credentials needed";
  $("status").className = "status bad";
}

async function poll() {
  const headers = { "Accept": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) headers["Authorization"] = "Bearer " + key;
  try {
    const answer = await fetch(STATE, { headers, cache: "no-store", credentials: "omit" });
    if (answer.status === 401 || answer.status === 403) {
      const body = await answer.json().catch(() => ({}));
      showLogin(key ? (body.detail || "refused") : "");
      return; // no more polling until a key is given
    }
    if (!answer.ok) throw new Error("HTTP " + answer.status);
    $("login").hidden = true;
    render(await answer.json());
  } catch (error) {
    $("status").textContent = "unreachable (" + error.message + "), retrying";
    $("status").className = "status bad";
  }
  timer = setTimeout(poll, EVERY_MS);
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key").value.trim());
  clearTimeout(timer);
  poll();
});

poll();
