// The machines view: each machine's condition now, its recent answers, alerts, field accuracy and
// serving model, redrawn from every view the server sends on /events. No third-party code; every
// device-written string goes in as text (textContent), never as markup.
"use strict";
// SVG, el, svg, age and connect come from common.js, loaded first.

const COLORS = ["#0969da", "#1a7f37", "#bc4c00", "#cf222e", "#8250df", "#0a7480", "#bf3989", "#6e7781"];

function when(t, now) {
  if (t == null) return "?";
  const d = new Date(t * 1000);
  const clock = Math.abs(now - t) < 86400 ? d.toLocaleTimeString() : d.toLocaleString();
  return t <= now ? `${clock} (${age(t, now)})` : clock;  // a simulated machine's clock may run ahead
}

function fmt(v, digits = 3) { return v == null ? "-" : Number(v).toPrecision(digits); }
function signed(v) { return v == null ? "-" : `${v >= 0 ? "+" : ""}${v.toFixed(1)}`; }

// Recent answers, oldest left: a layer's expected speed (solid) against its commanded one (dashed);
// a weld's probability of each class.
function timeline(task) {
  const W = 600, H = 150, L = 44, R = 10, T = 8, B = 22;
  const pts = task.timeline.points, classes = task.timeline.classes;
  const series = classes
    ? classes.map((c, i) => ({ name: `P(${c})`, ys: pts.map((p) => p[2 + i]), color: COLORS[i % COLORS.length], dash: "" }))
    : [{ name: "expected speed", ys: pts.map((p) => p[2]), color: COLORS[0], dash: "" },
      { name: "commanded speed", ys: pts.map((p) => p[3]), color: "#57606a", dash: "4 3" }];
  const box = svg("svg", { class: "timeline", width: W, height: H, viewBox: `0 0 ${W} ${H}`,
    "data-task": task.task, "data-points": String(pts.length) });
  box.append(svg("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "#fff", stroke: "#d0d7de" }));
  if (!pts.length) { box.append(svg("text", { x: L + 8, y: H / 2 }, "no answers yet")); return [box, null]; }
  const all = series.flatMap((s) => s.ys).filter((v) => v != null);
  let [y0, y1] = classes ? [0, 1] : [Math.min(...all), Math.max(...all)];
  if (!classes) { const pad = (y1 - y0) * 0.08 || 1; y0 -= pad; y1 += pad; }
  const n = pts.length;
  const X = (i) => L + (n === 1 ? 0.5 : i / (n - 1)) * (W - L - R);
  const Y = (v) => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
  for (let i = 0; i <= 2; i++) {
    const v = y0 + ((y1 - y0) * i) / 2;
    box.append(svg("line", { x1: L, x2: W - R, y1: Y(v), y2: Y(v), stroke: "#eaeef2" }));
    box.append(svg("text", { x: L - 4, y: Y(v) + 4, "text-anchor": "end" }, fmt(v, 3)));
  }
  box.append(svg("text", { x: L, y: H - 6 }, `${pts[0][1]}`));
  box.append(svg("text", { x: W - R, y: H - 6, "text-anchor": "end" }, `${pts[n - 1][1]} (last ${n})`));
  for (const s of series) {
    const d = s.ys.map((v, i) => (v == null ? "" : `${i && s.ys[i - 1] != null ? "L" : "M"}${X(i).toFixed(1)},${Y(v).toFixed(1)}`)).join("");
    box.append(svg("path", { d, fill: "none", stroke: s.color, "stroke-width": 1.6, "stroke-dasharray": s.dash,
      "data-series": s.name }));
    if (n <= 60) s.ys.forEach((v, i) => { if (v != null) box.append(svg("circle", { cx: X(i), cy: Y(v), r: 2, fill: s.color })); });
  }
  const legend = el("div", { class: "legend" }, ...series.map((s) => {
    const span = el("span", {}, s.name); span.style.setProperty("--c", s.color); return span;
  }));
  return [box, legend];
}

function conditionNow(task, meanings) {
  const a = task.latest;
  if (!a) return el("div", { class: "now muted" }, "no answer yet");
  if (a.classes) {
    const i = a.classes.indexOf(a.predicted);
    const p = i >= 0 ? a.probabilities[i] : null;
    return el("div", { class: "now", "data-key": a.key },
      `weld ${a.key}: `, el("b", {}, `${a.predicted ?? "?"}`), Object.hasOwn(meanings, a.predicted ?? "") ? el("span", { class: "meaning" }, ` — ${meanings[a.predicted]}`) : "",
      ` (p ${fmt(p, 2)}) `,
      el("span", { class: "probs muted" }, ...a.classes.map((c, j) => el("span", {}, `${c} ${fmt(a.probabilities[j], 2)}`))));
  }
  const off = a.residual != null && a.commanded ? Math.abs(a.residual) / a.commanded : 0;
  return el("div", { class: "now", "data-key": a.key },
    `layer ${a.key}: vibrates like `, el("b", {}, `${fmt(a.expected_speed, 3)} mm/s`),
    ` while printing at ${fmt(a.commanded, 3)} mm/s, residual `,
    el("b", { class: off > 0.5 ? "bad" : "" }, `${signed(a.residual)} mm/s`));
}

function facts(task) {
  const out = [];
  if (task.advice != null) out.push(el("span", { class: "advice" }, `speed advice: ≤ ${fmt(task.advice, 3)} mm/s (vibration budget ${fmt(task.vibration_budget, 3)})`));
  // A budget and no advice: the model expects no usable speed (under 5 mm/s) within it yet.
  else if (task.vibration_budget != null) out.push(el("span", { class: "advice none" }, `no speed advice yet: the model expects no usable speed within vibration budget ${fmt(task.vibration_budget, 3)}`));
  const f = task.field;
  if (f) {
    const what = f.metric === "accuracy" ? "field accuracy" : "field error";
    const value = f.value == null ? "not scored yet" : f.metric === "accuracy" ? `${(100 * f.value).toFixed(0)}%` : `${fmt(f.value, 3)} mm/s`;
    const ref = f.reference == null ? "" : ` (its test split: ${f.metric === "accuracy" ? `${(100 * f.reference).toFixed(0)}%` : `${fmt(f.reference, 3)} mm/s`})`;
    const span = el("span", { class: "field", "data-drift": String(!!f.drift) }, `${what} ${value} over ${f.n ?? 0} scored${ref}`);
    if (f.awaiting_labels) span.append(`, ${f.awaiting_labels} awaiting labels`);
    if (f.coverage_value != null) span.append(`; interval coverage ${(100 * f.coverage_value).toFixed(0)}% over ${f.coverage_n ?? 0} (nominal ${(100 * (f.coverage_level ?? 0)).toFixed(0)}%)`);
    if (f.drift) span.append(" ", el("span", { class: "drift" }, "DRIFT"));
    out.push(span);
  }
  const m = task.model;
  if (m.round != null) {
    const enc = m.encoder_version != null ? `, encoder ${m.encoder ?? ""} v${m.encoder_version}` : "";
    const which = m.candidate ? ` (${m.candidate})` : "";
    out.push(el("span", { class: "model", "data-candidate": m.candidate ?? "" }, `serving: ${task.task} round ${m.round}, ${m.digest ?? "?"}${enc}${which}`));
    // No test-split figure: field scores are kept, but no drift can ever be told against it.
    if (m.reference == null) out.push(el("span", { class: "warn no-reference" }, "no reference to drift from (its model has no test-split figure)"));
    const ev = task.evidence;
    if (ev) {
      const scores = Object.entries(ev.scores).map(([k, v]) => `${k} ${v == null ? "n/a" : fmt(v, 3)}`).join(", ");
      out.push(el("span", { class: "evidence", title: [ev.why, ev.serves].filter(Boolean).join("; ") }, `${ev.metric ?? "score"} on its ${ev.rows ?? 0} newest rows: ${scores}`));
    }
  } else out.push(el("span", { class: "model muted" }, `serving: ${task.task}, no model yet`));
  if (task.answered != null) out.push(el("span", {}, `${task.answered} answered`));
  const refused = Object.entries(task.refused);
  if (refused.length) out.push(el("span", { class: "bad refused" }, `refused: ${refused.map(([k, v]) => `${k} ${v}`).join(", ")}`));
  if (task.gate) out.push(el("span", { class: "gate", title: task.gate }, `gate: ${task.gate.slice(0, 90)}`));
  return el("div", { class: "facts" }, ...out);
}

function alertLine(a, now) {
  const open = a.state === "raised";
  const detail = `${a.votes ?? "?"} of the last ${a.n ?? "?"} ${open ? "over" : "at or below"} ${fmt(a.threshold, 3)}; row ${a.key ?? "?"} read ${fmt(a.value, 3)}`;
  const meaning = a.meaning ? ` — ${a.meaning}` : "";
  const text = open ? `⚠ ${a.rule} (${a.task ?? "?"}${meaning}) since ${when(a.since ?? a.at, now)}: ${detail}`
    : `${a.rule} (${a.task ?? "?"}${meaning}) cleared ${when(a.at, now)}`;
  const line = el("div", { class: open ? "alert" : "alert cleared", "data-alert": a.rule, "data-state": a.state }, text);
  if (open && a.action) line.append(el("div", { class: "action" }, `what to do: ${a.action}`));
  return line;
}

// A rule that cannot fire (yet): its task serves no model here yet, or it reads what its task never answers.
function silentRule(r) {
  return el("div", { class: "warn rule-silent", "data-rule": r.rule }, `rule ${r.rule} cannot fire: ${r.silent}`);
}

function moonrakerLine(k) {
  const failing = (k.failed ?? 0) > 0 || k.last_error;
  const text = `Moonraker${k.dry_run ? " (dry run)" : ""}: ${k.sent ?? 0} sent, ${k.failed ?? 0} failed, ${k.restored ?? 0} restored`
    + (k.last_error ? `; last error: ${k.last_error}` : "") + (k.refused ? `; refused: ${k.refused}` : "");
  return el("div", { class: failing || k.refused ? "facts bad moonraker" : "facts moonraker", "data-failed": String(k.failed ?? 0) }, text);
}

function card(m, now) {
  const head = el("h2", {}, el("span", { class: `dot ${m.online ? "online" : "offline"}` }), m.device,
    el("span", { class: "muted small" }, `${m.kind ?? "?"} · ${m.online ? "online" : "offline"} · seen ${age(m.last_seen, now)}`));
  const box = el("div", { class: m.open_alerts ? "machine alerting" : "machine", "data-device": m.device,
    "data-open-alerts": String(m.open_alerts), "data-online": String(!!m.online) }, head);
  for (const a of m.alerts) box.append(alertLine(a, now));
  for (const r of m.rules || []) if (r.silent) box.append(silentRule(r));
  if (m.moonraker) box.append(moonrakerLine(m.moonraker));
  for (const t of m.tasks) {
    const [plot, legend] = timeline(t);
    box.append(el("div", { class: "task-now", "data-task": t.task }, conditionNow(t, m.classes || {}), facts(t), plot, legend ?? ""));
  }
  if (!m.tasks.length) {
    // A status without a serving block: the trainer answers nothing (simulated data, the swarm, or off).
    const why = m.serving ? "no answer yet: its new rows are answered once a round gives it a model"
      : "answers nothing: its trainer serves no model (simulated data, or serving off)";
    box.append(el("p", { class: "muted" }, why));
  }
  const rows = Object.entries(m.refused_rows || {});
  if (rows.length) box.append(el("div", { class: "facts bad" }, `rows refused before any model: ${rows.map(([k, v]) => `${k} ${v}`).join(", ")}`));
  return box;
}

function render(view) {
  const now = view.taken, machines = view.machines || [];
  document.getElementById("fleet").textContent = view.fleet;
  document.getElementById("updated").textContent = `updated ${new Date(now * 1000).toLocaleTimeString()}`;
  const open = machines.reduce((s, m) => s + m.open_alerts, 0);
  const summary = document.getElementById("summary");
  summary.textContent = `${machines.length} machines, ${machines.filter((m) => m.online).length} online; `;
  summary.append(el("span", { class: open ? "bad" : "", id: "open-alerts" }, `${open} open alert${open === 1 ? "" : "s"}`));
  // Machines with an open alert first, then by name.
  const order = machines.slice().sort((a, b) => (b.open_alerts > 0) - (a.open_alerts > 0) || a.device.localeCompare(b.device));
  document.getElementById("machines").replaceChildren(...(order.length ? order.map((m) => card(m, now))
    : [el("p", { class: "muted" }, "no machine has reported yet")]));
}

connect(render);  // common.js
