// The dashboard's access to the coordinator's REST API and SSE log stream.
//
// The token lives in this tab's sessionStorage and travels only in the Authorization
// header: no cookie, so another site cannot make the browser act for the user (no
// CSRF). Every JSON request asks the coordinator that served the page to forward it to
// the leader (x-cumulus-forward: leader), so a follower's page reads the leader's live
// figures and its writes reach the leader; a follower that cannot reach the leader
// answers reads itself.

const TOKEN_KEY = "cumulus.token";

/** The token of this tab, or null. */
export function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

/** Keeps `value` as this tab's token. */
export function setToken(value) {
  sessionStorage.setItem(TOKEN_KEY, value);
}

/** Forgets this tab's token. */
export function clearToken() {
  sessionStorage.removeItem(TOKEN_KEY);
}

/** An HTTP refusal: `status` and the coordinator's message. */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

let onUnauthorized = () => {};

/** Calls `handler` whenever the coordinator answers 401 (the token is wrong or revoked). */
export function setUnauthorizedHandler(handler) {
  onUnauthorized = handler;
}

function headers(tokenValue) {
  return {
    Authorization: `Bearer ${tokenValue}`,
    "x-cumulus-forward": "leader",
  };
}

async function refusal(resp) {
  let message = `${resp.status} ${resp.statusText}`;
  try {
    const body = await resp.json();
    if (body && body.error) message = body.error;
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(resp.status, message);
}

/**
 * `method path` with this tab's token (or `tokenValue`); the JSON answer.
 * A write that meets an election in progress (503) is retried a few times.
 */
export async function request(method, path, { tokenValue = token(), signal } = {}) {
  for (let tries = 0; ; tries++) {
    const resp = await fetch(path, {
      method,
      headers: headers(tokenValue),
      cache: "no-store",
      signal,
    });
    if (resp.ok) return resp.json();
    const err = await refusal(resp);
    if (resp.status === 401) {
      onUnauthorized(err);
      throw err;
    }
    if (resp.status === 503 && tries < 4) {
      await sleep(500 * (tries + 1), signal);
      continue;
    }
    throw err;
  }
}

export const get = (path, opts) => request("GET", path, opts);
export const post = (path, opts) => request("POST", path, opts);

/** Resolves after `ms`, or rejects once `signal` aborts. */
export function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    const t = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => {
      clearTimeout(t);
      reject(signal.reason);
    });
  });
}

/** One SSE event block ("event: log\nid: ...\ndata: ...") as {event, id, data}. */
export function parseEvent(block) {
  const ev = { event: "message", id: null, data: "" };
  const data = [];
  for (const line of block.split("\n")) {
    if (line === "" || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") ev.event = value;
    else if (field === "id") ev.id = value;
    else if (field === "data") data.push(value);
  }
  ev.data = data.join("\n");
  return ev;
}

/**
 * Follows job `jobId`'s logs (of `rank`, or every rank when null): `onLines(lines)` with
 * each batch of `{rank, attempt, offset, line}` read, `onStatus(text)` as the stream
 * connects, drops and ends. The stream starts at each rank's last `tail` lines; a dropped
 * stream reconnects with the last event's id as Last-Event-ID, so no line is missed or
 * shown twice. EventSource cannot send a header, so this reads the stream with fetch.
 * Stops when `signal` aborts.
 */
export async function followLogs({ jobId, rank, tail, onLines, onStatus, signal }) {
  let lastId = null;
  let backoff = 250;
  while (!signal.aborted) {
    const q = new URLSearchParams({ follow: "true" });
    if (rank !== null) q.set("rank", String(rank));
    if (lastId === null) q.set("tail", String(tail));
    const h = { Authorization: `Bearer ${token()}` };
    if (lastId !== null) h["Last-Event-ID"] = lastId;
    try {
      const resp = await fetch(`/v1/jobs/${encodeURIComponent(jobId)}/logs?${q}`, {
        headers: h,
        cache: "no-store",
        signal,
      });
      if (!resp.ok) {
        const err = await refusal(resp);
        if (resp.status === 401) {
          onUnauthorized(err);
          return;
        }
        if (![408, 429].includes(resp.status) && resp.status < 500) {
          onStatus(`stopped: ${err.message}`);
          return;
        }
        onStatus(`retrying: ${err.message}`);
      } else {
        onStatus("live");
        backoff = 250;
        const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += value.replaceAll("\r\n", "\n");
          const lines = [];
          let cut;
          while ((cut = buf.indexOf("\n\n")) >= 0) {
            const ev = parseEvent(buf.slice(0, cut));
            buf = buf.slice(cut + 2);
            if (ev.event === "log") {
              lines.push(JSON.parse(ev.data));
              if (ev.id) lastId = ev.id;
            } else if (ev.event === "end") {
              if (lines.length) onLines(lines);
              onStatus("ended");
              return;
            }
          }
          if (lines.length) onLines(lines);
        }
        onStatus("reconnecting");
      }
    } catch (e) {
      if (signal.aborted) return;
      onStatus(`reconnecting: ${e.message}`);
    }
    try {
      await sleep(backoff, signal);
    } catch {
      return;
    }
    backoff = Math.min(backoff * 2, 5000);
  }
}
