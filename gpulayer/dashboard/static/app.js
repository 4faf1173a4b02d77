// GPUlayer dashboard: polls /api/peers and /api/tasks about once a second and redraws.
// Every value from a peer is written with textContent, never parsed as HTML.
// The requests carry the dashboard's token in the cookie that the page's URL (?token=) set.
"use strict";

if (new URLSearchParams(location.search).has("token")) history.replaceState(null, "", location.pathname);

const REFRESH_MS = 1000;
const TIMELINE_S = 300;  // the timeline shows the last five minutes
let refreshes = 0;

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function gb(x) { return x === null || x === undefined ? "?" : x.toFixed(x < 10 ? 1 : 0) + " GB"; }
function pct(x) { return x === null || x === undefined ? "-" : Math.round(x) + "%"; }
function bytes(n) { return !n ? "-" : n >= 2 ** 30 ? (n / 2 ** 30).toFixed(1) + " GiB" : (n / 2 ** 20).toFixed(1) + " MiB"; }
function seconds(s) { return s < 60 ? s.toFixed(1) + " s" : Math.floor(s / 60) + " min " + Math.round(s % 60) + " s"; }

function bar(percent) {
  const outer = el("span", null, "bar"), inner = el("span");
  inner.style.width = Math.max(0, Math.min(100, percent || 0)) + "%";
  outer.appendChild(inner);
  return outer;
}

function memoryText(peer) {
  if (!peer.devices.length) return gb(peer.ram_gb) + " host, " + gb(peer.ram_available_gb) + " free";
  return peer.devices.map(d => gb(d.free_gb) + " free of " + gb(d.total_gb) +
    (d.unreserved_gb !== null && d.unreserved_gb < d.total_gb ? " (" + gb(d.total_gb - d.unreserved_gb) + " reserved)" : "")
  ).join("; ") + " " + peer.memory_kind;
}

function isolation(peer) {  // how its jobs' processes are held; why there is no cgroup, on hover
  const td = el("td", peer.job_isolation || "?", "isolation");
  if (peer.job_isolation_reason) td.title = peer.job_isolation_reason;
  return td;
}

function renderPeers(peers) {
  const body = document.querySelector("#peers tbody");
  body.replaceChildren(...peers.map(p => {
    const row = el("tr");
    row.dataset.peer = p.name;
    row.dataset.state = p.state;
    const state = el("td", p.state === "up" ? (p.draining ? "up (draining)" : "up") : p.state, "state state-" + p.state);
    if (p.error) state.title = p.error;
    const util = el("td", null, "util");
    const gpus = p.devices.filter(d => d.util_percent !== null);
    if (gpus.length) gpus.forEach(d => { util.appendChild(bar(d.util_percent)); util.appendChild(el("span", pct(d.util_percent))); });
    else util.textContent = "-";
    const slots = p.busy === null ? "?/" + p.slots : p.busy + "/" + p.slots + (p.queued ? " +" + p.queued + " queued" : "");
    const frameworks = Object.entries(p.frameworks).map(([k, v]) => k + " " + v).join(", ") || "-";
    [el("td", p.name, "name"), el("td", p.address), state, el("td", p.accelerator + (p.device ? " (" + p.device + ")" : "")),
     el("td", memoryText(p), "memory"), util, el("td", pct(p.cpu_percent)), el("td", slots, "slots"),
     el("td", bytes(p.held_bytes) + (p.held ? " (" + p.held + ")" : ""), "held"), isolation(p), el("td", p.python),
     el("td", frameworks)].forEach(td => row.appendChild(td));
    return row;
  }));
}

function renderRunning(running) {
  const body = document.querySelector("#running tbody");
  if (!running.length) { body.replaceChildren(el("tr", null)); body.firstChild.appendChild(el("td", "nothing running", "muted")); return; }
  body.replaceChildren(...running.map(t => {
    const row = el("tr", null, "task");
    row.dataset.task = t.name;
    const what = t.kind === "actor" ? "actor " + t.name + " (" + (t.served || 0) + " calls)" : t.name;
    [el("td", t.peer), el("td", t.device || (t.slot !== undefined ? "slot " + t.slot : "")), el("td", what, "task-name"),
     el("td", t.submitter || ""), el("td", t.kind === "actor" ? "" : seconds(t.elapsed_s))].forEach(td => row.appendChild(td));
    return row;
  }));
}

function renderJobs(jobs) {
  const body = document.querySelector("#jobs tbody");
  if (!jobs.length) { body.replaceChildren(el("tr", null)); body.firstChild.appendChild(el("td", "no jobs", "muted")); return; }
  body.replaceChildren(...jobs.slice().reverse().map(j => {
    const row = el("tr", null, "job state-" + j.state);
    row.dataset.job = j.id;
    const state = el("td", j.state, "job-state");
    if (j.reason) state.title = j.reason;
    [el("td", j.id, "job-id"), el("td", j.name), state, el("td", j.peer),
     el("td", j.elapsed_s === null ? "-" : seconds(j.elapsed_s)), el("td", j.exit_code === null ? "" : j.exit_code),
     el("td", j.peak_memory_bytes === null ? "-" : bytes(j.peak_memory_bytes), "job-peak"),
     el("td", j.tail, "job-tail")].forEach(td => row.appendChild(td));
    return row;
  }));
}

function renderTimeline(tasks) {
  const box = document.getElementById("timeline");
  const now = tasks.now, since = now - TIMELINE_S;
  const spans = tasks.finished.concat(tasks.running.filter(t => t.kind === "task").map(t => Object.assign({}, t, {end: now, outcome: "running"})));
  const lanes = new Map();
  spans.filter(t => t.end >= since).forEach(t => {
    const key = t.peer + " " + t.device;
    if (!lanes.has(key)) lanes.set(key, []);
    lanes.get(key).push(t);
  });
  if (!lanes.size) { box.replaceChildren(el("p", "no tasks in the last five minutes", "muted")); return; }
  box.replaceChildren(...[...lanes.keys()].sort().map(key => {
    const lane = el("div", null, "lane"), track = el("div", null, "lane-track");
    lane.appendChild(el("div", key, "lane-name"));
    lanes.get(key).forEach(t => {
      const start = Math.max(t.start, since);
      const span = el("div", null, "span" + (t.outcome === "running" ? " running" : t.outcome === "ok" ? "" : " fail"));
      span.style.left = (100 * (start - since) / TIMELINE_S) + "%";
      span.style.width = (100 * (t.end - start) / TIMELINE_S) + "%";
      span.title = t.name + " from " + t.submitter + ": " + seconds(t.end - t.start) + " (" + t.outcome + ")";
      track.appendChild(span);
    });
    lane.appendChild(track);
    return lane;
  }));
}

function renderRefusals(tasks) {
  const items = tasks.refusals.slice(-50).reverse().map(r =>
    el("li", new Date(r.t * 1000).toLocaleTimeString() + " " + r.peer + " refused a task from " + r.submitter + " (" + r.code + "): " + r.message));
  items.push(...tasks.submitter_refusals.map(r => el("li", "this submitter was told by " + r.peer_id + ": " + r.reason)));
  if (!items.length) items.push(el("li", "none", "muted"));
  document.getElementById("refusals").replaceChildren(...items);
}

async function getJSON(path) {
  const reply = await fetch(path);
  if (!reply.ok) throw new Error("HTTP " + reply.status + ": " + (await reply.text()).slice(0, 200));
  return reply.json();
}

async function refresh() {
  try {
    const [peers, tasks] = await Promise.all([getJSON("/api/peers"), getJSON("/api/tasks")]);
    renderPeers(peers);
    renderRunning(tasks.running);
    renderJobs(tasks.jobs);
    renderTimeline(tasks);
    renderRefusals(tasks);
    const up = peers.filter(p => p.state === "up").length;
    document.getElementById("summary").textContent = peers.length + " peer(s), " + up + " up, " + tasks.running.length + " running";
    refreshes += 1;
    const updated = document.getElementById("updated");
    updated.dataset.refreshes = String(refreshes);
    updated.textContent = "updated " + new Date().toLocaleTimeString();
  } catch (err) {
    document.getElementById("updated").textContent = "dashboard unreachable: " + err;
  }
}

refresh();
setInterval(refresh, REFRESH_MS);
