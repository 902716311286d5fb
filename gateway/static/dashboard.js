// Switchyard dashboard: polls /v1/switchyard/status (the scheduler's status.json snapshot) and
// draws slots, queue, prompt tokens by source, disk use, recent TTFT by cause and a timeline of
// recent requests per conversation. No framework,
// no build step; the DOM is built with textContent only (no HTML from data).
"use strict";

const STATUS_URL = "/v1/switchyard/status";
const POLL_MS = 1000;
const STALE_S = 10;
const SVG_NS = "http://www.w3.org/2000/svg";
const SOURCES = ["reused", "copied", "restored", "prefilled"];
const CAUSES = ["reused", "restored", "prefilled"];
const PARTS = [...SOURCES, "decoded"];  // a timeline bar's parts
const MAX_LANES = 16;  // conversations the timeline shows: the latest active

// -- small helpers ---------------------------------------------------------------------------

function $(id) { return document.getElementById(id); }

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }

function fmtInt(n) { return Math.round(n || 0).toLocaleString("en-US"); }

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  n = n || 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "-";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 60) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(Math.floor(s % 60)).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

function median(values) {
  if (!values.length) return null;
  const v = [...values].sort((a, b) => a - b);
  const mid = Math.floor(v.length / 2);
  return v.length % 2 ? v[mid] : (v[mid - 1] + v[mid]) / 2;
}

function sum(obj) { return Object.values(obj || {}).reduce((a, b) => a + b, 0); }

function row(cells, attrs) {
  const tr = el("tr", attrs);
  for (const c of cells) tr.appendChild(typeof c === "string" ? el("td", {}, c) : c);
  return tr;
}

function emptyRow(tbody, columns, text) {
  tbody.appendChild(row([el("td", { colspan: String(columns), class: "empty" }, text)]));
}

function legendItem(cls, text) {
  const li = el("li", { "data-kind": cls });
  li.appendChild(el("span", { class: `swatch ${cls}` }));
  li.appendChild(document.createTextNode(text));
  return li;
}

// -- sections --------------------------------------------------------------------------------

function renderHeader(data) {
  const age = data.age_s || 0;
  const state = age > STALE_S ? "stale" : "live";
  const pill = $("state");
  pill.dataset.state = state;
  pill.textContent = state === "live" ? "live" : `stale (${fmtSeconds(age)} old)`;
  const ready = `worker ${data.worker_ready ? "ready" : "not ready"}, ` +
    `kvstore ${data.kvstore_ready ? "ready" : "not ready"}`;
  $("updated").textContent = `${ready} · updated ${new Date(data.at * 1000).toLocaleTimeString()}`;
}

function renderSlots(data) {
  const tbody = clear($("slots").tBodies[0]);
  const slots = data.slots || [];
  const busy = slots.filter((s) => s.state !== "idle").length;
  $("slots-summary").textContent = `${busy} busy of ${slots.length}`;
  if (!slots.length) emptyRow(tbody, 6, "no slots reported");
  for (const s of slots) {
    const conv = el("td", {});
    conv.appendChild(el("code", {}, s.conversation || "-"));
    const last = s.last_used ? `${fmtSeconds(Math.max(0, data.at - s.last_used))} ago` : "-";
    tbody.appendChild(row([
      String(s.slot), el("td", { class: `state-${s.state}` }, s.state), conv,
      el("td", { class: "num" }, fmtInt(s.num_tokens)), last, s.priority || "-",
    ], { "data-slot": String(s.slot), "data-state": s.state }));
  }
}

function renderQueue(data) {
  const tbody = clear($("queue").tBodies[0]);
  const queue = data.queue || [];
  $("queue-summary").textContent = `${queue.length} waiting`;
  if (!queue.length) emptyRow(tbody, 4, "no request is waiting");
  for (const q of queue) {
    tbody.appendChild(row([
      q.rid, q.priority, el("td", { class: "num" }, fmtInt(q.prompt_tokens)),
      el("td", { class: "num" }, fmtSeconds(q.waiting_s)),
    ], { "data-rid": q.rid }));
  }
}

function renderCache(data) {
  const tokens = (data.stats || {}).tokens || {};
  const total = SOURCES.reduce((a, k) => a + (tokens[k] || 0), 0);
  const hits = total - (tokens.prefilled || 0);
  $("cache-summary").textContent = total
    ? `${(100 * hits / total).toFixed(1)}% not re-read` : "no requests yet";
  const bar = clear($("cache-bar"));
  let x = 0;
  for (const k of SOURCES) {
    const w = total ? (400 * (tokens[k] || 0)) / total : 0;
    if (w > 0) {
      const rect = svg("rect", { x, y: 0, width: w, height: 28, class: `seg ${k}`,
                                 "data-kind": k });
      rect.appendChild(svg("title", {}, `${k}: ${fmtInt(tokens[k])} tokens`));
      bar.appendChild(rect);
    }
    x += w;
  }
  const legend = clear($("cache-legend"));
  for (const k of SOURCES) legend.appendChild(legendItem(k, `${k} ${fmtInt(tokens[k])}`));
  legend.appendChild(el("li", { class: "muted" }, `generated ${fmtInt(tokens.generated)}`));
  const proposed = tokens.draft_proposed || 0;  // speculative decoding
  if (proposed) {
    const accepted = tokens.draft_accepted || 0;
    legend.appendChild(el("li", { class: "muted" }, `drafts: ${fmtInt(accepted)} of ` +
      `${fmtInt(proposed)} accepted (${(100 * accepted / proposed).toFixed(0)}%)`));
  }
}

function renderDisk(data) {
  const disk = data.disk || {};
  const used = disk.bytes || 0;
  const budget = disk.budget_bytes || 0;
  const share = budget ? used / budget : 0;
  $("disk-summary").textContent =
    `${fmtBytes(used)} of ${fmtBytes(budget)} (${(100 * share).toFixed(share < 0.01 ? 3 : 1)}%)`;
  const bar = clear($("disk-bar"));
  const rect = svg("rect", { x: 0, y: 0, width: Math.max(share > 0 ? 2 : 0, 400 * Math.min(1, share)),
                             height: 28, class: "seg used", "data-kind": "used" });
  rect.appendChild(svg("title", {}, `${fmtBytes(used)} used`));
  bar.appendChild(rect);
  const facts = clear($("disk-facts"));
  facts.appendChild(el("li", {}, `${fmtInt(disk.num_pages)} pages`));
  facts.appendChild(el("li", {}, `${fmtInt(disk.num_writing)} being written`));
  facts.appendChild(el("li", {}, `${fmtInt(disk.num_evicted)} evicted`));
  facts.appendChild(el("li", { class: disk.num_thrash ? "state-prefilling" : "" },
                       `${fmtInt(disk.num_thrash)} thrash events`));
  if (disk.writable === false) facts.appendChild(el("li", { class: "state-prefilling" },
                                                    "writes paused"));
  // --peer servers: the pages fetched from each (docs/design/kv-pages.md "Pages from a peer").
  for (const peer of data.peer_servers || []) {
    facts.appendChild(el("li", { class: peer.num_failures ? "state-prefilling" : "" },
      `from ${peer.url}: ${fmtInt(peer.num_pages)} pages, ${fmtBytes(peer.num_bytes)} in ` +
      `${peer.fetch_s.toFixed(2)} s, ${fmtInt(peer.num_failures)} failed`));
  }
}

function logTicks(lo, hi) {
  const ticks = [];
  for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e += 1) {
    for (const m of hi / lo <= 100 ? [1, 2, 5] : [1]) {
      const t = m * 10 ** e;
      if (t >= lo * 0.999 && t <= hi * 1.001) ticks.push(t);
    }
  }
  return ticks;
}

function renderTtft(data) {
  const plot = clear($("ttft-plot"));
  const W = 760, H = 260, L = 56, R = 12, T = 10, B = 34;
  const recent = ((data.stats || {}).recent_requests || []).filter((r) => r.ttft_s > 0);
  const legend = clear($("ttft-legend"));
  for (const c of CAUSES) {
    const values = recent.filter((r) => r.cause === c).map((r) => r.ttft_s);
    const med = median(values);
    legend.appendChild(legendItem(c, `${c}: ${values.length}` +
                                  (med === null ? "" : `, median ${fmtSeconds(med)}`)));
  }
  $("ttft-summary").textContent = `${recent.length} requests`;
  if (!recent.length) {
    plot.appendChild(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "nodata" },
                         "no finished requests yet"));
    return;
  }
  const ys = recent.map((r) => r.ttft_s);
  let lo = 10 ** Math.floor(Math.log10(Math.min(...ys)));
  let hi = 10 ** Math.ceil(Math.log10(Math.max(...ys)));
  if (hi / lo < 10) hi = lo * 10;
  const now = data.at;
  const first = Math.min(...recent.map((r) => r.at));
  const span = Math.max(1, (now - first) * 1.04);
  const t0 = now - span;
  const xOf = (at) => L + ((at - t0) / span) * (W - L - R);
  const yOf = (v) => T + (1 - Math.log10(v / lo) / Math.log10(hi / lo)) * (H - T - B);
  for (const t of logTicks(lo, hi)) {
    const y = yOf(t);
    plot.appendChild(svg("line", { x1: L, x2: W - R, y1: y, y2: y, class: "grid" }));
    plot.appendChild(svg("text", { x: L - 6, y: y + 4, "text-anchor": "end" }, fmtSeconds(t)));
  }
  plot.appendChild(svg("line", { x1: L, x2: L, y1: T, y2: H - B, class: "axis" }));
  plot.appendChild(svg("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
  for (const frac of [0, 0.25, 0.5, 0.75, 1]) {
    const x = L + frac * (W - L - R);
    const ago = (1 - frac) * span;
    plot.appendChild(svg("text", { x, y: H - B + 16, "text-anchor": "middle" },
                         ago < 0.5 ? "now" : `${fmtSeconds(ago)} ago`));
  }
  plot.appendChild(svg("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" },
                       "when the request finished; TTFT on a log scale"));
  for (const r of recent) {
    const cause = CAUSES.includes(r.cause) ? r.cause : "prefilled";
    const dot = svg("circle", { cx: xOf(r.at).toFixed(1), cy: yOf(r.ttft_s).toFixed(1), r: 4.5,
                                class: `point ${cause}`, "data-cause": cause,
                                "data-ttft": r.ttft_s });
    dot.appendChild(svg("title", {}, `${cause}: ${fmtSeconds(r.ttft_s)}, ` +
                        `${fmtInt(r.prompt_tokens)} prompt tokens, ${fmtInt(r.cached_tokens)} cached`));
    plot.appendChild(dot);
  }
}

// A request's bar from its arrival to its end: until its first token, split by where its
// prompt's tokens came from (their share of the prompt, not of the time); then decoding.
function barParts(r, xOf) {
  const start = xOf(r.started_at), first = xOf(r.started_at + r.ttft_s), end = xOf(r.at);
  const widen = Math.max(0, 2 - (end - start));  // a request too short to see stays visible
  const prompt = SOURCES.reduce((a, k) => a + (r[`${k}_tokens`] || 0), 0);
  const parts = [];
  let x = start;
  const promptWidth = first - start + (r.generated_tokens ? 0 : widen);
  for (const k of SOURCES) {
    const w = prompt ? promptWidth * (r[`${k}_tokens`] || 0) / prompt : 0;
    if (w > 0) parts.push({ part: k, x, width: w });
    x += w;
  }
  if (r.generated_tokens) parts.push({ part: "decoded", x, width: end + widen - x });
  return parts;
}

function renderTimeline(data) {
  const plot = clear($("timeline"));
  const W = 760, L = 130, R = 12, T = 8, B = 34, LANE = 22;
  const recent = ((data.stats || {}).recent_requests || []).filter((r) => r.started_at > 0);
  const lanes = new Map();  // conversation -> its requests, in the order they finished
  for (const r of recent) {
    const key = r.conversation || "-";
    if (!lanes.has(key)) lanes.set(key, []);
    lanes.get(key).push(r);
  }
  const latest = (rs) => Math.max(...rs.map((r) => r.at));
  const shown = [...lanes.entries()].sort((a, b) => latest(b[1]) - latest(a[1]))
    .slice(0, MAX_LANES)
    .sort((a, b) => Math.min(...a[1].map((r) => r.started_at)) -
                    Math.min(...b[1].map((r) => r.started_at)));
  const rows = shown.flatMap(([, rs]) => rs);
  const legend = clear($("timeline-legend"));
  for (const k of PARTS) {
    const total = rows.reduce((a, r) => a + (r[k === "decoded" ? "generated_tokens"
                                                            : `${k}_tokens`] || 0), 0);
    legend.appendChild(legendItem(k, `${k} ${fmtInt(total)}`));
  }
  $("timeline-summary").textContent =
    `${shown.length} conversations, ${rows.length} requests` +
    (lanes.size > shown.length ? ` (the latest ${MAX_LANES} of ${lanes.size})` : "");
  const H = T + Math.max(1, shown.length) * LANE + B;
  plot.setAttribute("viewBox", `0 0 ${W} ${H}`);
  if (!rows.length) {
    plot.appendChild(svg("text", { x: W / 2, y: T + LANE / 2 + 4, "text-anchor": "middle",
                                   class: "nodata" }, "no finished requests yet"));
    return;
  }
  const t0 = Math.min(...rows.map((r) => r.started_at));
  const span = Math.max(0.001, Math.max(...rows.map((r) => r.at)) - t0) * 1.02;
  const xOf = (t) => L + ((t - t0) / span) * (W - L - R);
  for (const frac of [0, 0.25, 0.5, 0.75, 1]) {
    const x = L + frac * (W - L - R);
    plot.appendChild(svg("line", { x1: x, x2: x, y1: T, y2: H - B, class: "grid" }));
    plot.appendChild(svg("text", { x, y: H - B + 16, "text-anchor": "middle" },
                         `+${fmtSeconds(frac * span)}`));
  }
  plot.appendChild(svg("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
  plot.appendChild(svg("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" },
                       "after the first request shown; until its first token a bar is split " +
                       "by where its prompt came from"));
  shown.forEach(([conv, rs], i) => {
    const y = T + i * LANE;
    const lane = svg("g", { class: "lane", "data-conversation": conv });
    lane.appendChild(svg("text", { x: L - 8, y: y + LANE / 2 + 4, "text-anchor": "end",
                                   class: "lane" }, conv));
    for (const r of rs) {
      const bar = svg("g", { class: "request", "data-rid": r.rid || "" });
      bar.appendChild(svg("title", {}, `${r.rid || "request"}: TTFT ${fmtSeconds(r.ttft_s)}, ` +
        `${fmtSeconds(r.at - r.started_at)} in all; ${fmtInt(r.prompt_tokens)} prompt tokens ` +
        `(${SOURCES.map((k) => `${fmtInt(r[`${k}_tokens`])} ${k}`).join(", ")}), ` +
        `${fmtInt(r.generated_tokens)} decoded`));
      for (const p of barParts(r, xOf)) {
        bar.appendChild(svg("rect", { x: p.x.toFixed(1), y: y + 4, width: p.width.toFixed(2),
                                      height: LANE - 8, class: `seg ${p.part}`,
                                      "data-part": p.part }));
      }
      lane.appendChild(bar);
    }
    plot.appendChild(lane);
  });
}

function renderCounters(data) {
  const stats = data.stats || {};
  const counters = clear($("counters"));
  const finished = stats.requests_finished || {};
  const failed = stats.requests_failed || {};
  const ttft = stats.ttft || {};
  const step = stats.step_time || {};
  const http = (data.gateway || {}).http_requests || [];
  const items = [
    `requests finished ${fmtInt(sum(finished))}`,
    `failed ${fmtInt(sum(failed))}` + (Object.keys(failed).length
      ? ` (${Object.entries(failed).map(([k, v]) => `${k} ${v}`).join(", ")})` : ""),
    `TTFT mean ${ttft.count ? fmtSeconds(ttft.sum / ttft.count) : "-"}`,
    `steps ${fmtInt(stats.num_steps)}, mean ${step.count ? fmtSeconds(step.sum / step.count) : "-"}`,
    `HTTP requests ${fmtInt(http.reduce((a, r) => a + r.count, 0))}`,
  ];
  for (const text of items) counters.appendChild(el("li", {}, text));
  const comps = clear($("components"));
  comps.appendChild(el("li", { "data-role": "scheduler" },
                       `scheduler pid ${data.pid}, up ${fmtSeconds(data.at - data.started_at)}`));
  const restarts = stats.restarts || {};
  for (const [role, peer] of Object.entries(data.peers || {})) {
    comps.appendChild(el("li", { "data-role": role },
                         `${role} pid ${peer.pid ?? "-"}, restarts ${restarts[role] || 0}`));
  }
}

// -- polling ---------------------------------------------------------------------------------

function apiKey() {
  const match = location.hash.match(/key=([^&]+)/);
  if (match) {
    sessionStorage.setItem("switchyard-key", decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname);
  }
  return sessionStorage.getItem("switchyard-key") || "";
}

function showError(text) {
  const pill = $("state");
  pill.dataset.state = "error";
  pill.textContent = text;
}

let timer = null;

async function poll() {
  clearTimeout(timer);
  const key = apiKey();
  try {
    const response = await fetch(STATUS_URL, {
      headers: key ? { Authorization: `Bearer ${key}` } : {}, cache: "no-store" });
    if (response.status === 401) {
      $("key-form").hidden = false;
      showError("API key needed");
    } else if (!response.ok) {
      showError(response.status === 503 ? "waiting for the scheduler" : `HTTP ${response.status}`);
    } else {
      const data = await response.json();
      $("key-form").hidden = true;
      renderHeader(data);
      renderSlots(data);
      renderQueue(data);
      renderCache(data);
      renderDisk(data);
      renderTtft(data);
      renderTimeline(data);
      renderCounters(data);
      document.body.dataset.rendered = String((Number(document.body.dataset.rendered) || 0) + 1);
    }
  } catch (err) {
    showError("server unreachable");
  }
  timer = setTimeout(poll, POLL_MS);
}

function start() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem("switchyard-key", $("key-input").value);
    $("key-input").value = "";
    poll();
  });
  poll();
}

document.addEventListener("DOMContentLoaded", start);
