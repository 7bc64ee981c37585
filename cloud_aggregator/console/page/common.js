// What both console pages share: building DOM and SVG nodes (device-written strings go in as
// text, never as markup), the age of a timestamp, and the live connection to /events.
"use strict";

const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text != null) node.textContent = text;
  return node;
}

function age(t, now) {
  if (t == null) return "?";
  const s = Math.max(0, now - t);
  return s < 90 ? `${s.toFixed(0)} s ago` : s < 5400 ? `${(s / 60).toFixed(0)} min ago` : `${(s / 3600).toFixed(1)} h ago`;
}

// Calls render(view) with every view the server sends; EventSource reconnects by itself.
function connect(render) {
  const conn = document.getElementById("conn");
  const source = new EventSource("events");
  source.addEventListener("view", (e) => { render(JSON.parse(e.data)); });
  source.onopen = () => { conn.textContent = "live"; conn.className = "live"; };
  source.onerror = () => { conn.textContent = "reconnecting…"; conn.className = "down"; };
}
