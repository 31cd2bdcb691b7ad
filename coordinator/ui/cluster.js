// The cluster view: the Raft members, leader, term and indexes, and the workers with
// their slots, GPUs and last heartbeat.
import { get } from "./api.js";
import { h, table, replace, duration, bytes, badge } from "./dom.js";

const REFRESH_MS = 3000;

export function mount(main, { signal, poll }) {
  const body = h("div", { id: "cluster" });
  replace(main, h("h1", {}, "Cluster"), body);

  async function refresh() {
    const c = await get("/v1/cluster", { signal });
    const facts = h("dl", { class: "facts" },
      h("dt", {}, "leader"), h("dd", { id: "leader" }, c.leader_id == null ? "none known" : `node ${c.leader_id}`),
      h("dt", {}, "term"), h("dd", {}, String(c.term)),
      h("dt", {}, "commit index"), h("dd", {}, String(c.commit_index ?? "–")),
      h("dt", {}, "applied index"), h("dd", {}, String(c.last_applied_index ?? "–")),
      h("dt", {}, "snapshot index"), h("dd", {}, String(c.snapshot_index ?? "–")),
      h("dt", {}, "answered by"), h("dd", {}, `node ${c.node_id}${c.insecure ? " (insecure: plaintext)" : ""}`),
    );
    const members = table(
      ["node", "role", "voter", "gRPC", "HTTP", "last ack"],
      (c.members || []).map((m) => h("tr", { dataset: { node: m.node_id } },
        h("td", {}, String(m.node_id)),
        h("td", {}, badge(m.role), m.last_role ? ` (was ${m.last_role})` : ""),
        h("td", {}, m.voter ? "yes" : "no"),
        h("td", {}, m.grpc_addr),
        h("td", {}, m.http_addr),
        h("td", { class: "num" }, m.last_ack_age_ms == null ? "–" : `${duration(m.last_ack_age_ms)} ago`),
      )),
      { class: "grid", id: "members" },
    );
    const workers = table(
      ["worker", "host", "state", "slots", "GPUs", "CPU", "memory", "last heartbeat"],
      (c.workers || []).map((w) => h("tr", { dataset: { worker: w.worker_id } },
        h("td", {}, w.worker_id),
        h("td", {}, w.host),
        h("td", {}, badge(w.state)),
        h("td", { class: "num" }, `${w.slots_used} / ${w.slots}`),
        h("td", {}, gpus(w.gpus || [])),
        h("td", { class: "num" }, w.cpu_percent ? `${w.cpu_percent.toFixed(0)}%` : "–"),
        h("td", { class: "num" }, w.memory_total_bytes ? `${bytes(w.memory_used_bytes)} / ${bytes(w.memory_total_bytes)}` : "–"),
        h("td", { class: "num" }, w.last_heartbeat_age_ms ? `${duration(w.last_heartbeat_age_ms)} ago` : "–"),
      )),
      { class: "grid", id: "workers" },
    );
    replace(body, facts, h("h2", {}, "Coordinators"), members, h("h2", {}, "Workers"), workers);
  }
  poll(refresh, REFRESH_MS);
}

function gpus(list) {
  if (list.length === 0) return "–";
  return list.map((g) => {
    const d = g.device || {};
    const s = g.status;
    const use = s ? ` ${s.utilization_percent ?? "?"}%` : "";
    return `${d.name || "GPU"} #${d.index ?? "?"} (${Math.round((g.allocated || 0) * 100)}% given${use})`;
  }).join(", ");
}
