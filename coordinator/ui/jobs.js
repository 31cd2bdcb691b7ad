// The jobs view: the newest jobs' summaries, filtered by state (asked of the API),
// owner and name or id (here), refreshed every few seconds.
import { get } from "./api.js";
import { h, table, replace, duration, num, progress, bar, badge, clock, markOnce } from "./dom.js";

const STATES = ["", "pending", "running", "paused", "succeeded", "failed", "cancelled", "timed_out"];
/** Jobs asked for per refresh (the API's default; its maximum is 10,000). */
const LIMIT = 1000;
const REFRESH_MS = 3000;

const filters = { state: "", owner: "", text: "" };

export function mount(main, { signal, poll }) {
  const stateSel = h("select", { id: "f-state", onchange: () => { filters.state = stateSel.value; kick(); } },
    STATES.map((s) => h("option", { value: s, selected: s === filters.state }, s || "any state")));
  const owner = h("input", { id: "f-owner", placeholder: "owner", value: filters.owner,
    oninput: () => { filters.owner = owner.value.trim(); draw(); } });
  const text = h("input", { id: "f-text", placeholder: "name or id", value: filters.text,
    oninput: () => { filters.text = text.value.trim(); draw(); } });
  const count = h("span", { class: "muted" });
  const body = h("div", { id: "jobs" });
  replace(main, h("h1", {}, "Jobs"), h("div", { class: "filters" }, stateSel, owner, text, count), body);

  let summaries = [];
  function draw() {
    const shown = summaries.filter(
      (s) => (!filters.owner || s.owner === filters.owner) &&
        (!filters.text || s.job_id.includes(filters.text) || (s.name || "").includes(filters.text)),
    );
    count.textContent = `${shown.length} of ${summaries.length} shown`;
    replace(body, table(
      ["job", "name", "owner", "state", "progress", "steps/s", "ETA", "restarts", "submitted"],
      shown.map((s) => h("tr", { dataset: { job: s.job_id } },
        h("td", {}, h("a", { href: `#/job/${encodeURIComponent(s.job_id)}` }, s.job_id)),
        h("td", {}, s.name || ""),
        h("td", {}, s.owner || ""),
        h("td", {}, badge(s.state)),
        h("td", {}, bar(s.step, s.total_steps), " ", progress(s.step, s.total_steps)),
        h("td", { class: "num" }, s.steps_per_s ? num(s.steps_per_s) : "–"),
        h("td", { class: "num" }, duration(s.eta_ms)),
        h("td", { class: "num" }, String(s.restarts_used || 0)),
        h("td", {}, clock(s.submitted_at_ms)),
      )),
      { class: "grid" },
    ));
    markOnce("cumulus:jobs-drawn");
  }
  async function refresh() {
    const q = new URLSearchParams({ limit: String(LIMIT) });
    if (filters.state) q.set("state", filters.state);
    const r = await get(`/v1/jobs/summaries?${q}`, { signal });
    summaries = r.summaries || [];
    draw();
  }
  const kick = poll(refresh, REFRESH_MS);
}
