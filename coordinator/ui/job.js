// One job: its facts and the actions the user may take, ranks × attempts, restarts
// with their causes, the checkpoint timeline, a chart per reported metric, live logs.
import { get, post } from "./api.js";
import { h, table, replace, duration, num, progress, bar, badge, clock, bytes, markOnce } from "./dom.js";
import { metricChart, checkpointTimeline } from "./chart.js";
import { logPanel } from "./logs.js";

const REFRESH_MS = 2000;
const CHECKPOINTS_EVERY = 5;
const TERMINAL = ["succeeded", "failed", "cancelled", "timed_out"];
/** Most points kept per metric (the summary's history holds at most 240 samples). */
const MAX_POINTS = 2000;

export function mount(main, { signal, poll, session, params }) {
  const jobId = params[0];
  const head = h("div", { id: "job-head" }, "loading");
  const actions = h("div", { id: "actions", class: "actions" });
  const note = h("p", { id: "action-note", class: "muted" });
  const ranks = h("section", {}, h("h2", {}, "Ranks × attempts"), h("div", { id: "ranks" }));
  const restarts = h("section", {}, h("h2", {}, "Restarts"), h("div", { id: "restarts" }));
  const ckpts = h("section", {}, h("h2", {}, "Checkpoints"), h("div", { id: "checkpoints" }));
  const charts = h("section", {}, h("h2", {}, "Metrics"), h("div", { id: "charts", class: "charts" }));
  const logs = h("div", { id: "logs" });
  replace(main, h("h1", {}, "Job ", h("code", {}, jobId)), head, actions, note, charts, ranks, restarts, ckpts, logs);

  // Every point seen while the page is open, by metric then step: the chart keeps the
  // points it drew even while the coordinator answering has fewer (a leader change).
  const series = new Map();
  const keep = (name, step, value) => {
    let s = series.get(name);
    if (!s) series.set(name, (s = new Map()));
    s.set(Number(step), value);
    if (s.size > MAX_POINTS) s.delete(s.keys().next().value);
  };

  let job = null;
  let pass = 0;
  let logsShown = false;
  async function refresh() {
    const [j, summary] = await Promise.all([
      get(`/v1/jobs/${encodeURIComponent(jobId)}`, { signal }),
      get(`/v1/jobs/${encodeURIComponent(jobId)}/summary`, { signal }),
    ]);
    job = j.job;
    if (!logsShown) {
      logsShown = true;
      logs.append(logPanel(jobId, job.spec.world_size, signal));
    }
    for (const sample of summary.history || []) {
      for (const [k, v] of Object.entries(sample.metrics || {})) keep(k, sample.step, v);
    }
    if (summary.live) {
      for (const [k, v] of Object.entries(summary.metrics || {})) keep(k, summary.step, v);
    }
    drawHead(summary);
    drawActions();
    drawRanks();
    drawRestarts();
    drawCharts();
    if (pass++ % CHECKPOINTS_EVERY === 0) {
      const c = await get(`/v1/jobs/${encodeURIComponent(jobId)}/checkpoints`, { signal });
      drawCheckpoints(c.checkpoints || [], summary.total_steps);
    }
    markOnce("cumulus:job-drawn");
  }

  function drawHead(s) {
    replace(head, h("dl", { class: "facts" },
      h("dt", {}, "name"), h("dd", {}, job.spec.name || "–"),
      h("dt", {}, "state"), h("dd", { id: "job-state" }, badge(job.state),
        job.stop_action ? ` (stopping: ${job.stop_action})` : "",
        job.pending_reason ? ` ${job.pending_reason}` : ""),
      h("dt", {}, "owner"), h("dd", {}, job.owner),
      h("dt", {}, "progress"), h("dd", {}, bar(s.step, s.total_steps), " ", progress(s.step, s.total_steps)),
      h("dt", {}, "steps/s"), h("dd", {}, s.steps_per_s ? num(s.steps_per_s) : "–"),
      h("dt", {}, "ETA"), h("dd", {}, duration(s.eta_ms)),
      h("dt", {}, "running"), h("dd", {}, duration(job.running_ms)),
      h("dt", {}, "restarts"), h("dd", {}, `${job.restarts_used} of ${job.spec.restart?.max_restarts ?? "?"}`),
      h("dt", {}, "committed step"), h("dd", {}, job.committed_step == null ? "none" : String(job.committed_step)),
      h("dt", {}, "submitted"), h("dd", {}, clock(job.submitted_at_ms)),
      job.failure_cause ? [h("dt", {}, "cause"), h("dd", { class: "error" }, job.failure_cause)] : [],
    ));
  }

  function drawActions() {
    const mayAct = session.role === "admin" || (session.role === "submit" && session.name === job.owner);
    const live = !TERMINAL.includes(job.state);
    const buttons = [];
    if (mayAct && live) {
      buttons.push(action("cancel", "Cancel", true));
      if ((job.state === "running" || job.state === "pending") && !job.stop_action) {
        buttons.push(action("pause", "Pause", false));
      }
      if (job.state === "paused") buttons.push(action("resume", "Resume", false));
    }
    const key = buttons.map((b) => b.id).join();
    if (actions.dataset.key !== key) {
      actions.dataset.key = key;
      replace(actions, buttons);
    }
  }

  function action(verb, label, confirmFirst) {
    const button = h("button", { id: `do-${verb}`, type: "button" }, label);
    button.addEventListener("click", async () => {
      if (confirmFirst && button.dataset.armed !== "yes") {
        button.dataset.armed = "yes";
        button.textContent = `${label}: click again to confirm`;
        return;
      }
      button.disabled = true;
      note.textContent = `${verb}…`;
      try {
        const r = await post(`/v1/jobs/${encodeURIComponent(jobId)}/${verb}`, { signal });
        note.textContent = `${verb}: the job is ${r.job.state}`;
      } catch (e) {
        note.textContent = `${verb} refused: ${e.message}`;
      }
      button.disabled = false;
    });
    return button;
  }

  function drawRanks() {
    const maxAttempt = Math.max(0, ...job.ranks.map((r) => r.attempt));
    const causes = new Map();
    for (const rs of job.restarts || []) {
      for (const r of rs.ranks || []) {
        const list = causes.get(r) || [];
        list.push(rs.cause);
        causes.set(r, list);
      }
    }
    const cols = Array.from({ length: maxAttempt + 1 }, (_, a) => `attempt ${a}`);
    replace(document.getElementById("ranks"), table(["rank", "worker", ...cols],
      job.ranks.map((r) => h("tr", { dataset: { rank: r.rank } },
        h("td", {}, String(r.rank)),
        h("td", {}, r.worker_id || "–"),
        cols.map((_, a) => h("td", {}, cell(r, a, causes.get(r.rank) || []))),
      )),
      { class: "grid" }));
  }

  function cell(r, a, causes) {
    if (a > r.attempt) return "";
    if (a < r.attempt) return h("span", { class: "muted", title: causes[a] || "" }, `ended: ${causes[a] || "replaced"}`);
    const bits = [badge(r.state)];
    if (r.step) bits.push(` step ${r.step}`);
    if (r.steps_per_s) bits.push(` ${num(r.steps_per_s)}/s`);
    if (r.exit_code != null) bits.push(` exit ${r.exit_code}`);
    if (r.signal != null) bits.push(` signal ${r.signal}`);
    if (r.exit_cause) bits.push(h("div", { class: "error" }, r.exit_cause));
    return bits;
  }

  function drawRestarts() {
    const list = job.restarts || [];
    replace(document.getElementById("restarts"), list.length === 0 ? h("p", { class: "muted" }, "none") :
      table(["#", "failed at", "cause", "ranks", "delay", "resumes from"],
        list.map((r) => h("tr", {},
          h("td", {}, String(r.number)),
          h("td", {}, clock(r.failed_at_ms)),
          h("td", {}, r.cause),
          h("td", {}, (r.ranks || []).join(", ")),
          h("td", { class: "num" }, duration(r.delay_ms)),
          h("td", {}, r.resume_step == null ? "scratch" : `step ${r.resume_step}`),
        )), { class: "grid" }));
  }

  function drawCheckpoints(list, totalSteps) {
    const el = document.getElementById("checkpoints");
    if (list.length === 0) {
      replace(el, h("p", { class: "muted" }, job.spec.ckpt_dir || job.spec.ckpt_url ? "none committed yet" : "the job does not checkpoint"));
      return;
    }
    replace(el, checkpointTimeline(list, totalSteps), table(["step", "verified", "latest", "size", "tiers"],
      list.map((c) => h("tr", {},
        h("td", {}, String(c.step)),
        h("td", {}, c.verified ? "yes" : "no"),
        h("td", {}, c.latest ? "yes" : ""),
        h("td", { class: "num" }, bytes(c.bytes)),
        h("td", {}, (c.tiers || []).join(", ")),
      )), { class: "grid" }));
  }

  function drawCharts() {
    const el = document.getElementById("charts");
    if (series.size === 0) {
      replace(el, h("p", { class: "muted" }, "no metrics reported yet"));
      return;
    }
    const names = [...series.keys()].sort();
    replace(el, names.map((n) => metricChart(n, [...series.get(n)].sort((a, b) => a[0] - b[0]))));
  }

  poll(refresh, REFRESH_MS);
}
