"use strict";

const $ = (id) => document.getElementById(id);
let lastCommand = null; // {key, user_id, delta}: what "Send again" repeats

// newEventID returns a random (version 4) UUID. crypto.randomUUID exists
// only in secure contexts; getRandomValues works everywhere.
function newEventID() {
  if (crypto.randomUUID) return crypto.randomUUID();
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const h = Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
}

async function getJSON(path) {
  const resp = await fetch(path, { cache: "no-store" });
  const body = await resp.json().catch(() => ({ error: `HTTP ${resp.status}` }));
  return { status: resp.status, body };
}

function errorText(body) {
  return body.field ? `${body.field}: ${body.error}` : body.error;
}

function ms(v) {
  if (v < 0) return "unknown";
  if (v === 0) return "0 ms";
  if (v < 1) return `${v.toFixed(2)} ms`;
  if (v < 1000) return `${Math.round(v)} ms`;
  return `${(v / 1000).toFixed(1)} s`;
}

function freshnessText(f) {
  if (f.unverified) {
    // Redis lost the board's keys, or no full pass has checked it yet:
    // scores and users may be missing, however recent the outbox.
    return `source ${f.source} · not verified: scores may be missing (lag unknown until a full reconcile pass)`;
  }
  const through = f.projected_through ? new Date(f.projected_through).toLocaleTimeString() : "unknown";
  return `source ${f.source} · lag ${ms(f.lag_ms)} · projected through ${through}`;
}

// freshnessClass warns of a projection that lags, or whose lag is unknown.
function freshnessClass(f) {
  return f.unverified || f.lag_ms < 0 || f.lag_ms > 5000 ? "warn" : "muted";
}

function setText(el, text, cls) {
  el.textContent = text;
  el.className = cls || "muted";
}

// placeholderRow is a table row of one cell spanning the three columns.
function placeholderRow(text) {
  const tr = document.createElement("tr");
  const td = document.createElement("td");
  td.colSpan = 3;
  td.className = "muted";
  td.textContent = text;
  tr.appendChild(td);
  return tr;
}

function renderTop(body) {
  const rows = body.entries.map((e) => {
    const tr = document.createElement("tr");
    tr.dataset.user = e.user_id;
    for (const [cls, v] of [["rank", e.rank], ["user", e.user_id], ["score", e.score]]) {
      const td = document.createElement("td");
      td.className = cls;
      td.textContent = String(v); // user ids are data, never markup
      tr.appendChild(td);
    }
    return tr;
  });
  if (rows.length === 0) {
    rows.push(placeholderRow(body.freshness.unverified ? "none in Redis, which is not verified" : "no scores yet"));
  }
  document.querySelector("#top tbody").replaceChildren(...rows);
  setText($("freshness"), "freshness: " + freshnessText(body.freshness), freshnessClass(body.freshness));
  $("board").textContent = body.board;
}

function renderOutbox(body) {
  setText($("outbox"),
    `outbox pending ${body.pending} (in flight ${body.in_flight}, retrying ${body.retrying}) · ` +
    (body.pending > 0 ? `oldest waiting ${ms(body.oldest_pending_age_ms)}` : "nothing waiting") + ` · dead letters ${body.dead_letters} (all streams)`,
    body.dead_letters > 0 ? "warn" : "muted");
}

function renderReconcile(body) {
  const r = body.last;
  if (!r) {
    setText($("reconcile"), body.every_seconds > 0 ? `first run pending (every ${body.every_seconds} s)` : "scheduled reconcile disabled");
    return;
  }
  const counts = Object.entries(r.counts).map(([k, v]) => `${k} ${v}`).join(", ") || "nothing checked";
  let text = `${new Date(r.started).toLocaleTimeString()}: ${r.sampled ? "sample" : "full pass"}, ` +
    `${r.checked} checked in ${ms(r.duration_ms)} — ${counts}; drift ${r.drift}, repaired ${r.repaired}`;
  if (r.error) text += ` — error: ${r.error}`;
  setText($("reconcile"), text, r.error ? "err" : r.drift > 0 ? "warn" : "ok");
}

async function refresh() {
  try {
    const [top, rec, stats] = await Promise.all([
      getJSON("/leaderboard?limit=10"), getJSON("/reconcile/last"), getJSON("/stats"),
    ]);
    if (top.status === 200) {
      renderTop(top.body);
    } else {
      // A refused read (fail-closed, unverified) must not leave the last
      // answer on screen as if it were current.
      document.querySelector("#top tbody").replaceChildren(placeholderRow("not shown: the service refused the read"));
      setText($("freshness"), errorText(top.body), "err");
    }
    if (rec.status === 200) renderReconcile(rec.body);
    if (stats.status === 200) renderOutbox(stats.body); else setText($("outbox"), errorText(stats.body), "err");
    setText($("status"), `live · updated ${new Date().toLocaleTimeString()}`, "muted");
  } catch (e) {
    // No answer: the last one is not current either.
    document.querySelector("#top tbody").replaceChildren(placeholderRow("not shown: no answer from the service"));
    setText($("freshness"), "freshness: unknown (service unreachable)", "err");
    setText($("status"), `service unreachable (${e.message}); retrying`, "err");
  } finally {
    setTimeout(refresh, 1000);
  }
}

// rankLookups numbers the rank lookups; only the latest may show its
// answer. Two can be in flight (a submit's read-your-writes lookup and a
// manual one), and an older answer arriving last would replace the newer.
let rankLookups = 0;

async function lookupRank(user, atLeast) {
  const lookup = ++rankLookups;
  if (user === "." || user === "..") {
    // A dot segment: the browser resolves it away (escaped too) before
    // sending, so the service refuses these ids at submit.
    setText($("rank-result"), `${user}: not a user id ("." and ".." cannot be submitted)`, "warn");
    return;
  }
  const q = atLeast ? `?at_least=${atLeast}` : "";
  try {
    const { status, body } = await getJSON(`/users/${encodeURIComponent(user)}/rank${q}`);
    if (lookup !== rankLookups) return; // a newer lookup owns the line
    if (status === 200 && body.freshness.at_least_met === false) {
      // Served as is (serve-stale): the score from before the change.
      setText($("rank-result"), `${body.user_id}: your change is not projected yet; before it: rank ${body.rank}, score ${body.score} · ${freshnessText(body.freshness)}`, "warn");
    } else if (status === 200) {
      setText($("rank-result"), `${body.user_id}: rank ${body.rank}, score ${body.score} · ${freshnessText(body.freshness)}`,
        freshnessClass(body.freshness) === "warn" ? "warn" : "ok");
    } else if (status === 404 && body.freshness) {
      // From a lagging or unverified projection, the score may exist but
      // not be projected: say how fresh the "no score" is.
      setText($("rank-result"), `${user}: ${errorText(body)} · ${freshnessText(body.freshness)}`, "warn");
    } else {
      // 503: a score just saved is not in Redis yet (or Redis is too far behind).
      setText($("rank-result"), `${user}: ${errorText(body)}`, status === 404 || status === 503 ? "warn" : "err");
    }
  } catch (e) {
    if (lookup !== rankLookups) return;
    setText($("rank-result"), `lookup failed: ${e.message}`, "err");
  }
}

async function send(cmd) {
  try {
    const resp = await fetch("/scores", {
      method: "POST",
      headers: { "Content-Type": "application/json", "Idempotency-Key": cmd.key },
      body: JSON.stringify({ user_id: cmd.user_id, delta: cmd.delta }),
    });
    const body = await resp.json().catch(() => ({ error: `HTTP ${resp.status}` }));
    if (resp.status === 200 || resp.status === 201) {
      lastCommand = cmd;
      $("resend").disabled = false;
      setText($("submit-result"),
        `${body.user_id}: score ${body.score}, version ${body.version}` +
        (body.duplicate ? " — duplicate, nothing changed" : " — applied") + ` (key ${cmd.key})`, "ok");
      $("rank-user").value = body.user_id;
      lookupRank(body.user_id, body.version); // read-your-writes
    } else if (resp.status >= 500) {
      // A timeout or a database error: the command may have been applied
      // all the same. "Send again" retries with the same key, which is safe.
      lastCommand = cmd;
      $("resend").disabled = false;
      setText($("submit-result"), `${resp.status}: ${errorText(body)}; send again with the same key`, "err");
    } else {
      setText($("submit-result"), `${resp.status}: ${errorText(body)}`, "err");
    }
  } catch (e) {
    // The command may or may not have been applied: "Send again" retries
    // with the same key, which is safe.
    lastCommand = cmd;
    $("resend").disabled = false;
    setText($("submit-result"), `network error (${e.message}); send again with the same key`, "err");
  }
}

$("submit-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  // One command at a time: a second click (a double-click) while the first
  // is in flight would send it again under a new key, applied twice.
  if ($("submit").disabled) return;
  $("submit").disabled = true;
  const delta = Number($("delta").value);
  try {
    await send({ key: newEventID(), user_id: $("user-id").value, delta: Number.isInteger(delta) ? delta : $("delta").value });
  } finally {
    $("submit").disabled = false;
  }
});
$("resend").addEventListener("click", () => { if (lastCommand) send(lastCommand); });
$("rank-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  lookupRank($("rank-user").value);
});

refresh();
