// A job's live logs: a rank filter, the stream's status, and the lines (each rank's
// last TAIL_LINES at first, then every new line; at most MAX_LINES kept on the page).
import { followLogs } from "./api.js";
import { h, markOnce } from "./dom.js";

/** Lines each rank starts with. */
export const TAIL_LINES = 1000;
/** Lines kept on the page; the oldest go first. */
export const MAX_LINES = 10000;

/** The log panel of job `jobId` with `worldSize` ranks; stops when `signal` aborts. */
export function logPanel(jobId, worldSize, signal) {
  const rankSel = h("select", { id: "log-rank" },
    h("option", { value: "" }, "every rank"),
    Array.from({ length: worldSize }, (_, r) => h("option", { value: String(r) }, `rank ${r}`)));
  const status = h("span", { id: "log-status", class: "muted" }, "connecting");
  const lines = h("div", { id: "log-lines", class: "log", role: "log" });
  const panel = h("section", { class: "logs" },
    h("h2", {}, "Logs ", rankSel, " ", status), lines);

  let stream = null;
  function start() {
    stream?.abort();
    stream = new AbortController();
    signal.addEventListener("abort", () => stream.abort(), { once: true });
    lines.replaceChildren();
    const rank = rankSel.value === "" ? null : Number(rankSel.value);
    followLogs({
      jobId,
      rank,
      tail: TAIL_LINES,
      signal: stream.signal,
      onStatus: (s) => { status.textContent = s; },
      onLines: (batch) => show(batch),
    });
  }

  function show(batch) {
    const atBottom = lines.scrollTop + lines.clientHeight >= lines.scrollHeight - 4;
    const now = String(Date.now());
    const frag = document.createDocumentFragment();
    for (const l of batch) {
      frag.append(h("div", { class: "line", dataset: { rank: l.rank, attempt: l.attempt, receivedMs: now } },
        h("span", { class: "who" }, `[${l.rank}.${l.attempt}] `), l.line));
    }
    lines.append(frag);
    for (let extra = lines.childElementCount - MAX_LINES; extra > 0; extra--) {
      lines.firstElementChild.remove();
    }
    if (atBottom) lines.scrollTop = lines.scrollHeight;
    markOnce("cumulus:log-lines-drawn");
  }

  rankSel.addEventListener("change", start);
  start();
  return panel;
}
