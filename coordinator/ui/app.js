// The dashboard's entry point: sign-in with a pasted token, the hash routes
// (#/jobs, #/cluster, #/job/ID), and the refresh loop every view uses.
import { get, token, setToken, clearToken, setUnauthorizedHandler, sleep } from "./api.js";
import { h, replace } from "./dom.js";
import * as jobs from "./jobs.js";
import * as cluster from "./cluster.js";
import * as job from "./job.js";

const main = document.getElementById("main");
const login = document.getElementById("login");
const nav = document.getElementById("nav");
const who = document.getElementById("who");
const signout = document.getElementById("signout");
const problem = document.getElementById("problem");

/** Who the token names: {name, role}; null until signed in. */
let session = null;
/** Aborts the current view's requests and loops. */
let view = null;

function showLogin(message) {
  view?.abort();
  view = null;
  session = null;
  main.replaceChildren();
  nav.hidden = true;
  signout.hidden = true;
  who.textContent = "";
  problem.textContent = "";
  login.hidden = false;
  document.getElementById("login-error").textContent = message || "";
  document.getElementById("token").focus();
}

setUnauthorizedHandler(() => {
  clearToken();
  showLogin("The token was refused (wrong or revoked): paste a valid one.");
});

login.addEventListener("submit", async (e) => {
  e.preventDefault();
  const input = document.getElementById("token");
  const value = input.value.trim();
  if (!value) return;
  try {
    session = await get("/v1/whoami", { tokenValue: value });
  } catch (err) {
    document.getElementById("login-error").textContent = `Sign-in failed: ${err.message}`;
    return;
  }
  setToken(value);
  input.value = "";
  enter();
});

signout.addEventListener("click", () => {
  clearToken();
  showLogin("");
});

/** Shows the signed-in frame and the view the hash names. */
function enter() {
  login.hidden = true;
  nav.hidden = false;
  signout.hidden = false;
  who.textContent = `${session.name} (${session.role})`;
  route();
}

/**
 * Runs `fn` now and every `everyMs` after it settles, until the view changes; a failure
 * is shown in the problem line and retried. Returns a function that runs it at once.
 */
function pollerFor(signal) {
  return (fn, everyMs) => {
    let wake = null;
    (async () => {
      while (!signal.aborted) {
        try {
          await fn();
          problem.textContent = "";
        } catch (e) {
          if (signal.aborted) return;
          if (e.status !== 401) problem.textContent = `Could not refresh: ${e.message}`;
        }
        try {
          await Promise.race([sleep(everyMs, signal), new Promise((r) => { wake = r; })]);
        } catch {
          return;
        }
      }
    })();
    return () => wake?.();
  };
}

function route() {
  if (!session) return;
  view?.abort();
  view = new AbortController();
  const signal = view.signal;
  const [name, ...params] = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  const ctx = { signal, poll: pollerFor(signal), session, params };
  for (const a of nav.querySelectorAll("a")) {
    a.classList.toggle("here", a.getAttribute("href") === `#/${name || "jobs"}`);
  }
  if (name === "cluster") cluster.mount(main, ctx);
  else if (name === "job" && params[0]) job.mount(main, ctx);
  else jobs.mount(main, ctx);
}

window.addEventListener("hashchange", route);

async function start() {
  if (!token()) {
    showLogin("");
    return;
  }
  try {
    session = await get("/v1/whoami");
  } catch (e) {
    if (e.status !== 401) showLogin(`Could not reach the coordinator: ${e.message}`);
    return;
  }
  enter();
}

replace(main, h("p", { class: "muted" }, "loading"));
start();
