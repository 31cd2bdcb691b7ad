// Small DOM and formatting helpers. Text always goes in as text nodes (never as HTML),
// so nothing the API returns (a job name, a log line) can become markup.

/**
 * `h("td", {class: "num", dataset: {rank: 1}}, "text", child)`: an element with
 * attributes (`on*` functions become listeners) and children (strings become text).
 */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "dataset") Object.assign(el.dataset, v);
    else if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

/** An SVG element with attributes. */
export function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v !== undefined && v !== null) el.setAttribute(k, String(v));
  }
  append(el, children);
  return el;
}

/** A table with a header row and `rows` (arrays of cells: strings or nodes). */
export function table(headers, rows, attrs = {}) {
  return h(
    "table",
    attrs,
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))),
    h("tbody", {}, rows),
  );
}

/** Replaces `el`'s children. */
export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
}

/** `1h 02m`, `3m 05s`, `4.2s`; "–" for 0 or absent. */
export function duration(ms) {
  if (!ms) return "–";
  const s = ms / 1000;
  if (s < 10) return `${s.toFixed(1)}s`;
  const total = Math.round(s);
  const hours = Math.floor(total / 3600);
  const mins = Math.floor((total % 3600) / 60);
  const secs = total % 60;
  if (hours) return `${hours}h ${String(mins).padStart(2, "0")}m`;
  if (mins) return `${mins}m ${String(secs).padStart(2, "0")}s`;
  return `${secs}s`;
}

/** `12.3 MiB`. */
export function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Number(n);
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return `${i ? v.toFixed(1) : v} ${units[i]}`;
}

/** A metric or rate: finite numbers to 4 significant digits; "NaN"/"Infinity" as sent. */
export function num(v) {
  if (typeof v === "string") return v;
  if (v === undefined || v === null) return "–";
  if (Number.isInteger(v)) return String(v);
  return Number(v).toPrecision(4);
}

/** A time in ms since the epoch as local `HH:MM:SS` (with the date when not today). */
export function clock(ms) {
  if (!ms) return "–";
  const d = new Date(Number(ms));
  const today = new Date().toDateString() === d.toDateString();
  return today ? d.toLocaleTimeString() : d.toLocaleString();
}

/** `step / total (pct%)`. */
export function progress(step, total) {
  if (!total) return step ? `step ${step}` : "–";
  const pct = Math.min(100, (100 * step) / total);
  return `${step} / ${total} (${pct.toFixed(pct < 10 ? 1 : 0)}%)`;
}

/** A progress bar: a <meter> from 0 to total. */
export function bar(step, total) {
  return h("meter", { min: 0, max: total || 1, value: total ? step : 0 });
}

/** A state as a colored label. */
export function badge(state) {
  return h("span", { class: `badge s-${state || "unknown"}` }, state || "?");
}

/** Marks the first time `name` happened on this page (the benchmark reads the marks). */
export function markOnce(name) {
  if (performance.getEntriesByName(name, "mark").length === 0) performance.mark(name);
}
