// The fleet console: renders each view the server sends on /events. No third-party code;
// every device-written string goes in as text (textContent), never as markup.
"use strict";
// SVG, el, svg, age and connect come from common.js, loaded first.

const COLORS = ["#0969da", "#bf3989", "#1a7f37", "#bc4c00", "#8250df", "#0a7480", "#cf222e", "#6e7781"];

function fmt(v, digits = 4) { return v == null ? "-" : Number(v).toPrecision(digits); }
function bytes(n) { return n == null ? "-" : n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(1)} MiB` : `${(n / 1024).toFixed(0)} KiB`; }
function pairs(obj) { return Object.entries(obj || {}).map(([k, v]) => `${k}: ${v}`).join("; ") || "-"; }
// A task whose device selection leaves this device out (round_messages.DeviceSelection.refusal): routine.
function notForHere(why) { return typeof why === "string" && why.startsWith("task runs on "); }

function renderDevices(devices, now) {
  const body = document.querySelector("#devices tbody");
  const rows = devices.map((d) => {
    const tr = el("tr", { "data-device": d.device, "data-online": String(!!d.online), "data-paused": String(d.paused != null),
      "data-revoked": String(!!d.revoked) });
    const word = d.revoked ? "revoked" : d.online ? "online" : "offline";
    const state = el("td", { class: d.revoked ? "nowrap bad" : "nowrap", title: d.revoked ? "revoked from the fleet (fleet revoke-device)" : d.paused ?? "" },
      el("span", { class: `dot ${d.online ? "online" : "offline"}` }), word + (d.paused != null ? ", paused" : ""));
    const rows = d.rows ? `${d.rows.train ?? "?"}/${d.rows.test ?? "?"}` : "-";
    const sensor = el("td", { class: d.sensor === "fault" ? "bad" : "" }, d.sensor ?? "-");
    // Tasks this device refuses: red, except the routine "not for this device" (grey).
    const refusedTasks = el("td", {}, ...Object.entries(d.refused_tasks || {}).map(([k, v], i) =>
      el("span", { class: notForHere(v) ? "muted not-for-here" : "bad", "data-task": k }, `${i ? "; " : ""}${k}: ${v}`)));
    if (!refusedTasks.childNodes.length) refusedTasks.textContent = "-";
    // Refusals in red; copies of uploads already counted (a restart's re-send) are routine, apart and grey.
    const uploads = el("td", {}, el("span", { class: Object.keys(d.uploads_refused || {}).length ? "bad" : "" }, pairs(d.uploads_refused)));
    if (d.uploads_resent) uploads.append(" ", el("span", { class: "muted resent", title: "copies of uploads already counted: routine" }, `(resent: ${d.uploads_resent})`));
    tr.append(
      el("td", {}, d.device), state, el("td", {}, age(d.last_seen, now)), el("td", {}, d.kind ?? "-"),
      el("td", { class: "num" }, rows), sensor, el("td", {}, d.models ?? "-"), el("td", {}, d.tasks ?? "-"),
      refusedTasks, uploads,
      el("td", { class: "num" }, d.cpu_s_round == null ? "-" : `${(1000 * d.cpu_s_round).toFixed(0)} ms`),
      el("td", { class: "num" }, bytes(d.max_rss_bytes)),
    );
    return tr;
  });
  body.replaceChildren(...rows);
}

// A learning curve: one thin line per device, the fleet mean thick and dark.
function plot(task, colorOf) {
  const W = 560, H = 230, L = 52, R = 12, T = 10, B = 28;
  // The fleet mean first, beneath: a lone device's curve (equal to the mean) stays visible on top.
  const series = [{ name: "fleet mean", pts: task.mean, color: "#1d2329", width: 2.6 },
    ...Object.entries(task.curves).map(([d, pts]) => ({ name: d, pts, color: colorOf(d), width: 1.3 }))];
  const all = series.flatMap((s) => s.pts);
  const box = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, "data-task": task.name,
    "data-mean-points": String(task.mean.length), "data-last-round": String(all.length ? Math.max(...all.map((p) => p[0])) : 0) });
  if (!all.length) {
    const t = svg("text", { x: L, y: H / 2 }); t.textContent = "no rounds yet"; box.append(t);
    return box;
  }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  // Losses fall by orders of magnitude: a log axis when every value is positive and they span > 20x.
  const log = y0 > 0 && y1 / y0 > 20;
  const f = log ? Math.log10 : (v) => v, inv = log ? (v) => 10 ** v : (v) => v;
  let [f0, f1] = [f(y0), f(y1)];
  const pad = (f1 - f0) * 0.05; f0 -= pad; f1 += pad;
  // An accuracy lies in [0, 1]: the padding never draws an axis past them.
  if (!log && /accuracy/.test(task.metric ?? "")) { f0 = Math.max(f0, 0); f1 = Math.min(f1, 1); }
  box.setAttribute("data-scale", log ? "log" : "linear");
  const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const Y = (y) => T + (1 - (f(y) - f0) / (f1 - f0)) * (H - T - B);
  box.append(svg("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "#fff", stroke: "#d0d7de" }));
  for (let i = 0; i <= 4; i++) {  // y grid and labels
    const v = inv(f0 + ((f1 - f0) * i) / 4);
    box.append(svg("line", { x1: L, x2: W - R, y1: Y(v), y2: Y(v), stroke: "#eaeef2" }));
    const t = svg("text", { x: L - 4, y: Y(v) + 4, "text-anchor": "end" }); t.textContent = fmt(v, 3); box.append(t);
  }
  if (log) { const t = svg("text", { x: W - R - 4, y: T + 12, "text-anchor": "end" }); t.textContent = "log scale"; box.append(t); }
  for (const x of [x0, Math.round((x0 + x1) / 2), x1]) {
    const t = svg("text", { x: X(x), y: H - 10, "text-anchor": "middle" }); t.textContent = `${x}`; box.append(t);
  }
  for (const s of series) {
    if (!s.pts.length) continue;
    const d = s.pts.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join("");
    const path = svg("path", { d, fill: "none", stroke: s.color, "stroke-width": s.width, "data-series": s.name,
      "data-points": String(s.pts.length) });
    box.append(path);
    if (s.pts.length === 1) box.append(svg("circle", { cx: X(s.pts[0][0]), cy: Y(s.pts[0][1]), r: 3, fill: s.color }));
  }
  return box;
}

function roundsTable(task) {
  const head = el("tr", {}, ...["round", "phase", "status", "participants", "duration", "closed by", "sat out",
    "refused", `mean ${task.metric ?? ""}`, "held out"].map((h) => el("th", {}, h)));
  const rows = task.rounds.slice().reverse().map((r) => el("tr", { "data-round": String(r.round) },
    el("td", { class: "num" }, String(r.round)), el("td", {}, r.phase),
    el("td", { class: r.status === "completed" ? "" : "bad" }, r.status),
    el("td", { class: "num", title: r.participants.join(", ") }, String(r.participants.length)),
    el("td", { class: "num" }, `${r.duration_s.toFixed(2)} s`),
    el("td", { class: r.closed === "deadline" ? "bad" : "" }, r.closed === "deadline" ? "deadline (waited)" : r.closed ?? "-"),
    // Who sat out, by name (the reason on hover and once under the table, not on every round).
    el("td", { title: pairs(r.sat_out) }, Object.keys(r.sat_out).join(", ") || "-"),
    el("td", { class: Object.keys(r.rejected).length ? "bad" : "" }, pairs(r.rejected)),
    el("td", { class: "num" }, fmt(r.mean)),
    el("td", { class: "holdout" }, Object.entries(r.holdout || {}).map(([d, v]) => `${d}: ${fmt(v)}`).join("; ") || "-")));
  const reasons = new Map();  // device -> the reason it last gave, each (device, reason) once
  for (const r of task.rounds) for (const [d, why] of Object.entries(r.sat_out || {})) reasons.set(d, why);
  const table = el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows));
  if (!reasons.size) return table;
  const note = el("ul", { class: "sat-out muted" }, ...[...reasons].map(([d, why]) => el("li", { "data-device": d }, `${d} sat out: ${why}`)));
  return el("div", {}, table, note);
}

function renderTasks(tasks, colorOf) {
  // The task trained most recently first; tasks with no round yet as one line each, last.
  const active = tasks.filter((t) => t.last_finished != null).sort((a, b) => b.last_finished - a.last_finished);
  const waiting = tasks.filter((t) => t.last_finished == null);
  const cards = active.map((t) => {
    const legend = el("div", { class: "legend" },
      ...Object.keys(t.curves).map((d) => { const s = el("span", {}, d); s.style.setProperty("--c", colorOf(d)); return s; }),
      (() => { const s = el("span", {}, "fleet mean"); s.style.setProperty("--c", "#1d2329"); return s; })());
    const title = `${t.name} — ${t.algorithm ?? "?"} on ${t.model ?? "?"}: ${t.completed}/${t.planned ?? "?"} rounds`
      + (t.abandoned ? `, ${t.abandoned} abandoned` : "");
    return el("div", { class: "task", "data-task": t.name },
      el("div", {}, el("h3", {}, title),
        el("div", { class: "muted" }, t.metric ? `${t.metric} per device, by round` : "no metric reported yet"),
        legend, plot(t, colorOf)),
      el("div", {}, el("h3", {}, `last ${t.rounds.length} rounds`), roundsTable(t)));
  });
  for (const t of waiting) {
    cards.push(el("div", { class: "task waiting", "data-task": t.name },
      el("h3", {}, `${t.name} — ${t.algorithm ?? "?"} on ${t.model ?? "?"}: no round yet (0/${t.planned ?? "?"})`)));
  }
  document.getElementById("tasks").replaceChildren(...(cards.length ? cards : [el("p", { class: "muted" }, "no task in the store yet")]));
}

function renderModels(view) {
  const versions = Object.entries(view.versions);
  const vbox = versions.length
    ? el("table", { id: "model-versions" }, el("tr", {}, el("th", {}, "model"), el("th", {}, "active version: devices")),
      ...versions.map(([m, per]) => el("tr", {}, el("td", {}, m), el("td", {}, pairs(per)))))
    : el("p", { class: "muted" }, "no device reports a pushed model");
  document.getElementById("versions").replaceChildren(vbox);
  const tables = Object.entries(view.rollouts).map(([name, t]) => el("div", {}, el("h3", {}, name),
    el("table", { "data-rollouts": name }, el("tr", {}, ...t.columns.map((c) => el("th", {}, c))),
      ...t.rows.map((r) => el("tr", {}, ...r.map((v) => el("td", {}, v == null ? "" : String(v))))))));
  document.getElementById("rollouts").replaceChildren(...(tables.length ? tables : [el("p", { class: "muted" }, "no staged rollouts recorded")]));
}

function render(view) {
  const names = [...new Set([...view.devices.map((d) => d.device), ...view.tasks.flatMap((t) => Object.keys(t.curves))])].sort();
  const colorOf = (d) => COLORS[Math.max(0, names.indexOf(d)) % COLORS.length];
  document.getElementById("fleet").textContent = view.fleet;
  document.getElementById("updated").textContent = `updated ${new Date(view.taken * 1000).toLocaleTimeString()}`;
  const b = view.broker;
  document.getElementById("broker").textContent = b.bytes_received == null ? ""
    : `broker: ${bytes(b.bytes_received)} in, ${bytes(b.bytes_sent)} out`;
  renderDevices(view.devices, view.taken);
  renderTasks(view.tasks, colorOf);
  renderModels(view);
}

connect(render);  // common.js
