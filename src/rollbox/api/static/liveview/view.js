// The live view page (rollbox.api.liveview): noVNC on this sandbox's screen, view-only until a
// person takes over. The page's cookie authenticates every request here (same origin only);
// nothing in this script holds a token.
import RFB from "../novnc/core/rfb.js";

const sandbox = document.body.dataset.sandbox;
const base = `/view/${encodeURIComponent(sandbox)}/`;
const statusEl = document.getElementById("status");
const modeEl = document.getElementById("mode");
const takeoverBtn = document.getElementById("takeover");
const releaseBtn = document.getElementById("release");
const scheme = location.protocol === "https:" ? "wss:" : "ws:";

// What the page shows, for a person and for the browser test (window.rollboxView).
const view = { state: "connecting", takenOver: false, error: null };
window.rollboxView = view;

function setState(state) {
  view.state = state;
  statusEl.textContent = state;
  document.body.dataset.state = state;
}

const rfb = new RFB(document.getElementById("screen"), `${scheme}//${location.host}${base}ws`,
                    { shared: true });
view.rfb = rfb;
rfb.viewOnly = true;
rfb.scaleViewport = false;
rfb.focusOnClick = true;
rfb.addEventListener("connect", () => setState("connected"));
rfb.addEventListener("disconnect", (e) => setState(e.detail.clean ? "disconnected" : "lost"));

// taken_over: by anyone; yours: this page's session holds mouse and keyboard (only its input
// reaches the guest; another viewer's take-over is refused until it is released).
function apply(s) {
  view.takenOver = !!s.taken_over;
  view.yours = !!s.yours;
  view.takeovers = s.takeovers;
  rfb.viewOnly = !view.yours;
  takeoverBtn.hidden = view.takenOver;
  releaseBtn.hidden = !view.takenOver;
  modeEl.textContent = view.yours ? "you have mouse and keyboard (the agent is locked out)"
                     : view.takenOver ? "view only: another viewer has mouse and keyboard"
                     : "view only";
  document.body.classList.toggle("taken", view.yours);
}

async function post(what) {
  const r = await fetch(base + what, { method: "POST", credentials: "same-origin",
                                       headers: { "X-Rollbox-View": "1" } });
  const body = await r.json();
  if (!r.ok) throw new Error((body.error && body.error.message) || `HTTP ${r.status}`);
  return body;
}

async function act(what) {
  try {
    apply(await post(what));
    view.error = null;
    if (view.takenOver) rfb.focus();
  } catch (e) {
    view.error = String(e.message || e);
    modeEl.textContent = `${what} refused: ${view.error}`;
  }
}

takeoverBtn.addEventListener("click", () => act("takeover"));
releaseBtn.addEventListener("click", () => act("release"));
fetch(base + "state", { credentials: "same-origin" })
  .then((r) => r.json()).then(apply).catch(() => {});
