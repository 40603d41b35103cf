// rollbox operator dashboard: read-only views over the /v1 api and /dashboard/api, with the
// session cookie (same origin only). Everything a sandbox wrote is shown as text (textContent),
// never as HTML.
"use strict";

const $ = (sel) => document.querySelector(sel);

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}

async function getJSON(url) {
  const r = await fetch(url, { credentials: "same-origin" });
  const body = await r.json().catch(() => null);
  if (!r.ok) {
    const e = body && body.error ? body.error : { message: r.statusText };
    throw new Error(`${r.status} ${e.code || ""}: ${e.message}`);
  }
  return body;
}

async function loadWho() {
  const who = await getJSON("/dashboard/api/whoami");
  $("#who").textContent = who.admin ? "admin (every project)" : `project ${who.project}`;
}

async function loadNodes() {
  const tbody = $("#nodes tbody");
  const nodes = await getJSON("/dashboard/api/nodes");
  const rows = nodes.map((n) => [n.node, n.health,
    n.max_sandboxes === undefined ? "" : `${n.sandboxes} / ${n.max_sandboxes}`,
    n.memory_available_mib === undefined ? "" : `${n.memory_available_mib} MiB free, ${n.requested_cpus} CPUs asked`]);
  tbody.replaceChildren();
  for (const r of rows) {
    const tr = document.createElement("tr");
    r.forEach((v) => cell(tr, v));
    tbody.appendChild(tr);
  }
}

function filterQuery() {
  const q = new URLSearchParams();
  for (const el of $("#filters").elements) {
    if (el.name && el.value) q.append(el.name, el.value);
  }
  return q.toString();
}

async function loadSandboxes() {
  const tbody = $("#sandboxes tbody");
  try {
    const list = await getJSON("/dashboard/api/sandboxes?" + filterQuery());
    $("#filter-error").textContent = "";
    tbody.replaceChildren();
    for (const s of list) {
      const tr = document.createElement("tr");
      tr.className = "sandbox";
      tr.dataset.id = s.id;
      cell(tr, s.id); cell(tr, s.owner); cell(tr, s.image); cell(tr, s.backend); cell(tr, s.state);
      cell(tr, Object.entries(s.labels || {}).map(([k, v]) => `${k}=${v}`).join(" "));
      cell(tr, new Date(s.expires_at * 1000).toISOString().replace(".000Z", "Z"));
      tr.addEventListener("click", () => openSandbox(s.id));
      tbody.appendChild(tr);
    }
  } catch (e) {
    $("#filter-error").textContent = e.message;
  }
}

async function loadErrors() {
  const tbody = $("#errors tbody");
  const list = await getJSON("/dashboard/api/errors");
  tbody.replaceChildren();
  for (const e of list.slice(0, 50)) {
    const tr = document.createElement("tr");
    cell(tr, new Date(e.ts * 1000).toISOString()); cell(tr, `${e.status} ${e.code}`);
    cell(tr, `${e.method} ${e.route}`); cell(tr, e.message); cell(tr, e.request_id || "");
    tbody.appendChild(tr);
  }
}

let following = null;

function line(parent, text, cls) {
  const li = document.createElement("li");
  li.textContent = text;
  if (cls) li.className = cls;
  parent.appendChild(li);
}

function showEvent(ev) {
  const out = $("#output");
  if (ev.kind === "exec.stdout" || ev.kind === "exec.stderr") {
    const span = document.createElement("span");
    span.textContent = ev.data;
    if (ev.kind === "exec.stderr") span.className = "stderr";
    out.appendChild(span);
    out.scrollTop = out.scrollHeight;
    return;
  }
  if (ev.kind === "exec.started") {
    let cmd = ev.data;
    try { cmd = JSON.stringify(JSON.parse(ev.data).cmd); } catch (e) { /* as it is */ }
    const span = document.createElement("span");
    span.className = "meta";
    span.textContent = `\n$ ${cmd}   [${ev.exec_id}]\n`;
    out.appendChild(span);
  }
  if (ev.kind === "net.denied") line($("#denials"), `${new Date(ev.ts * 1000).toISOString()} ${ev.data}`);
  line($("#events"), `${ev.seq} ${new Date(ev.ts * 1000).toISOString()} ${ev.kind} ${ev.exec_id || ""}`);
}

async function openSandbox(id) {
  if (following) following.abort();
  following = new AbortController();
  $("#detail").hidden = false;
  $("#detail-id").textContent = id;
  $("#output").replaceChildren(); $("#events").replaceChildren(); $("#denials").replaceChildren();
  const r = await fetch(`/v1/sandboxes/${encodeURIComponent(id)}/events?follow=true`,
    { credentials: "same-origin", signal: following.signal });
  if (!r.ok) { line($("#events"), `error ${r.status}`); return; }
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let tail = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      const parts = (tail + dec.decode(value, { stream: true })).split("\n");
      tail = parts.pop();
      for (const p of parts) if (p.trim()) showEvent(JSON.parse(p));
    }
  } catch (e) { /* aborted: another sandbox was opened */ }
}

$("#filters").addEventListener("submit", (ev) => { ev.preventDefault(); loadSandboxes(); });

async function refresh() {
  await Promise.allSettled([loadNodes(), loadSandboxes(), loadErrors()]);
}

loadWho().then(refresh);
setInterval(refresh, 3000);
const want = new URLSearchParams(location.hash.slice(1)).get("sandbox");
if (want) openSandbox(want);
