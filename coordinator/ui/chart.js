// Inline SVG charts, drawn by hand: a metric over steps, and a checkpoint timeline.
import { h, svg, num } from "./dom.js";

const W = 460;
const H = 150;
const PAD = { left: 56, right: 12, top: 12, bottom: 24 };

function scale(lo, hi, from, to) {
  const span = hi - lo || 1;
  return (v) => from + ((v - lo) / span) * (to - from);
}

/**
 * A chart of metric `name` over steps: `points` is `[[step, value], ...]` sorted by step
 * (non-finite values are left out). The SVG carries `data-points` (the points drawn),
 * `data-first-step` and `data-last-step`.
 */
export function metricChart(name, points) {
  const finite = points.filter(([, v]) => typeof v === "number" && Number.isFinite(v));
  const figure = h("figure", { class: "chart", dataset: { metric: name } });
  figure.append(h("figcaption", {}, name));
  const root = svg("svg", {
    viewBox: `0 0 ${W} ${H}`,
    width: W,
    height: H,
    role: "img",
    "aria-label": `${name} over steps`,
    "data-points": finite.length,
    "data-first-step": finite.length ? finite[0][0] : null,
    "data-last-step": finite.length ? finite[finite.length - 1][0] : null,
  });
  figure.append(root);
  if (finite.length === 0) {
    root.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "muted" }, "no points yet"));
    return figure;
  }
  const steps = finite.map(([s]) => s);
  const values = finite.map(([, v]) => v);
  const [s0, s1] = [Math.min(...steps), Math.max(...steps)];
  let [v0, v1] = [Math.min(...values), Math.max(...values)];
  if (v0 === v1) [v0, v1] = [v0 - 1, v1 + 1];
  const x = scale(s0, s1 === s0 ? s0 + 1 : s1, PAD.left, W - PAD.right);
  const y = scale(v0, v1, H - PAD.bottom, PAD.top);
  root.append(
    svg("line", { x1: PAD.left, y1: H - PAD.bottom, x2: W - PAD.right, y2: H - PAD.bottom, class: "axis" }),
    svg("line", { x1: PAD.left, y1: PAD.top, x2: PAD.left, y2: H - PAD.bottom, class: "axis" }),
    svg("text", { x: PAD.left - 4, y: PAD.top + 4, "text-anchor": "end", class: "tick" }, num(v1)),
    svg("text", { x: PAD.left - 4, y: H - PAD.bottom, "text-anchor": "end", class: "tick" }, num(v0)),
    svg("text", { x: PAD.left, y: H - 6, class: "tick" }, `step ${s0}`),
    svg("text", { x: W - PAD.right, y: H - 6, "text-anchor": "end", class: "tick" }, `step ${s1}`),
    svg("polyline", {
      class: "line",
      points: finite.map(([s, v]) => `${x(s).toFixed(1)},${y(v).toFixed(1)}`).join(" "),
    }),
  );
  for (const [s, v] of finite) {
    root.append(svg("circle", { cx: x(s).toFixed(1), cy: y(v).toFixed(1), r: 2.5, class: "point" }, svg("title", {}, `step ${s}: ${num(v)}`)));
  }
  return figure;
}

/**
 * The checkpoints of a job along its steps (0 to `totalSteps`, or the newest step): a
 * mark per step, filled when verified, the latest ringed.
 */
export function checkpointTimeline(checkpoints, totalSteps) {
  const w = 700;
  const hgt = 56;
  const root = svg("svg", {
    viewBox: `0 0 ${w} ${hgt}`,
    width: w,
    height: hgt,
    class: "timeline",
    role: "img",
    "aria-label": "checkpoints over steps",
    "data-points": checkpoints.length,
  });
  const last = Math.max(totalSteps || 0, ...checkpoints.map((c) => c.step), 1);
  const x = scale(0, last, 16, w - 16);
  root.append(
    svg("line", { x1: 16, y1: 24, x2: w - 16, y2: 24, class: "axis" }),
    svg("text", { x: 16, y: 50, class: "tick" }, "0"),
    svg("text", { x: w - 16, y: 50, "text-anchor": "end", class: "tick" }, String(last)),
  );
  for (const c of checkpoints) {
    const cls = `ckpt${c.verified ? " verified" : ""}${c.latest ? " latest" : ""}`;
    root.append(
      svg("circle", { cx: x(c.step).toFixed(1), cy: 24, r: c.latest ? 7 : 5, class: cls },
        svg("title", {}, `step ${c.step}${c.latest ? " (latest)" : ""}${c.verified ? "" : " (not verified)"}`)),
    );
  }
  return root;
}
