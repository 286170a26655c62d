// The dashboard of one node: polls GET status / history / swarm and draws them.
// Peer ids, model names, rejection details and every other string in those answers can
// come from the network, so nothing is ever parsed as markup: the DOM is built with
// createElement and text nodes only (charts.js does the same for the SVG).
"use strict";

const { el, lineChart, barChart, fmtValue } = window.Charts;
const ROUND_STEPS = ["generating", "publishing", "gathering", "training", "checkpointing"];
const PALETTE = ["#e0752d", "#56a64b", "#a352cc", "#d44a3a", "#1f9aa3", "#c9a21c", "#f27aa6", "#6d8a2f", "#8a6fdf", "#7a5c3e"];
const OWN = { key: "own", color: "#3274d9" };
const BATCH = { key: "batch", color: "#4b5263" };
const UNNAMED = "unattributed";
// [chart, metric key, y-axis title, y floor, smallest y span]: a flat series stays flat on screen.
const OFFPOLICY = [
  ["chart-is", "is_weight_mean", "IS weight", null, 0.1], ["chart-capped", "frac_capped", "fraction", 0, 0.05],
  ["chart-ess", "ess", "ESS", null, 0.1], ["chart-filtered", "frac_filtered", "fraction", 0, 0.05],
];
const state = { status: null, history: [], swarm: null, skew: 0, hidden: new Set(), colors: new Map(), lastOk: 0, error: "", roundsSeen: -1, rewardFull: false };

const $ = id => document.getElementById(id);
const now = () => Date.now() / 1000 + state.skew;  // the node's clock, for countdowns
const num = v => typeof v === "number" && isFinite(v);
const fmt = (v, digits = 3) => v === null || v === undefined ? "–" : (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(digits)) : String(v));
const shortId = id => (typeof id === "string" && id.length > 14 ? "…" + id.slice(-6) : String(id));
const inRound = phase => ROUND_STEPS.includes(phase);

function ago(ts) {
  if (!num(ts)) return "–";
  const s = Math.max(0, now() - ts);
  if (s < 90) return `${Math.round(s)} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}

function bytes(n) {
  if (!num(n)) return "–";
  if (n < 1024) return `${n} B`;
  if (n < 1 << 20) return `${(n / 1024).toFixed(1)} kB`;
  return `${(n / (1 << 20)).toFixed(2)} MB`;
}

function duration(s) {
  if (!num(s)) return "–";
  if (s < 120) return `${s.toFixed(0)} s`;
  if (s < 7200) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  return `${(s / 3600).toFixed(1)} h`;
}

// ------------------------------------------------------------------ peers: names and colours

function peerInfo(pid) {
  const p = (state.status && state.status.peers[pid]) || {};
  const seen = ((state.swarm && state.swarm.peers) || []).find(q => q.peer_id === pid) || {};
  return { name: p.name || seen.name, model: p.model || seen.model, adapter: p.adapter_version || seen.adapter_version };
}

// A peer's --name is its own claim (many nodes keep the default "node"): the id suffix stays beside it.
function peerLabel(pid) {
  if (pid === UNNAMED) return "no peer named";
  const { name, model } = peerInfo(pid);
  const who = name || model;
  return who ? `${who} ${shortId(pid)}` : shortId(pid);
}

function peerCell(pid, ...extra) {
  const { name } = peerInfo(pid);
  return el("td", { class: "mono", title: name ? `${name} (its --name) · ${pid}` : pid },
    ...extra, name ? el("span", { class: "peer-name" }, name) : null, name ? " " : null, shortId(pid));
}

function peerColor(pid) {
  if (pid === UNNAMED) return "#9aa1b1";
  if (!state.colors.has(pid)) state.colors.set(pid, PALETTE[state.colors.size % PALETTE.length]);
  return state.colors.get(pid);
}

// Peers in the order they first appeared in the history (so colours do not shuffle).
function historyPeers() {
  const order = [];
  for (const rec of state.history) for (const pid of Object.keys(rec.peers || {})) if (!order.includes(pid)) order.push(pid);
  order.forEach(peerColor);
  return order;
}

// ------------------------------------------------------------------ rounds

const xOf = (rec, i) => (num(rec.round_in_run) ? rec.round_in_run : i + 1);

function xTip(x) {
  const i = state.history.findIndex((r, j) => xOf(r, j) === x);
  const rec = state.history[i];
  if (!rec) return `round ${x} of this run`;
  return state.status && state.status.peer_id ? `round ${x} of this run (DHT bucket ${rec.round})` : `round ${x} of this run (round ${rec.round})`;
}

function currentRoundInRun(s) {
  if (num(s.round_in_run)) return s.round_in_run;
  return s.rounds_done + (inRound(s.phase) ? 1 : 0);
}

function toggle(key) {
  if (state.hidden.has(key)) state.hidden.delete(key); else state.hidden.add(key);
  drawCharts();
}

// ------------------------------------------------------------------ charts

function drawCharts() {
  const h = state.history, s = state.status || {};
  const peers = historyPeers();
  const chartOpts = { xLabel: "round of this run", xTip };
  const ownLabel = s.model ? `own (${s.model})` : "own";
  const point = (rec, i, y) => (num(y) ? { x: xOf(rec, i), y } : null);
  const pts = f => h.map((rec, i) => point(rec, i, f(rec))).filter(Boolean);

  lineChart($("chart-reward"), [
    { ...OWN, label: ownLabel, width: 3, points: pts(r => r.reward_mean) },
    ...peers.map(pid => ({ key: pid, label: peerLabel(pid), title: pid, color: peerColor(pid), width: 1.5,
      points: pts(r => (r.peers && r.peers[pid] ? r.peers[pid].reward_mean : null)) })),
  ], state.hidden, toggle, { ...chartOpts, height: 300, yLabel: "mean reward", empty: "no finished round yet",
    // rewards of 0.02-0.12 would sit squashed at the bottom of a 0-1 axis: fit the data, 0-1 on a click
    ...(state.rewardFull ? { yMin: 0, yMax: 1 } : { yMin: 0, minSpan: 0.05 }) });
  const scale = $("reward-scale");
  if (scale) scale.textContent = state.rewardFull ? "fit to data" : "0–1 view";

  const stackOf = pid => ({ key: pid, label: peerLabel(pid), title: pid, color: peerColor(pid) });
  const rows = f => h.map((rec, i) => ({ x: xOf(rec, i), values: f(rec) }));
  const perPeer = field => rec => Object.fromEntries(Object.entries(rec.peers || {}).map(([pid, p]) => [pid, p[field] || 0]));
  const small = { ...chartOpts, height: 130, yLabel: "samples" };
  barChart($("chart-admitted"), peers.map(stackOf), rows(perPeer("admitted")), state.hidden, toggle, { ...small, empty: "no peer samples admitted yet" });
  barChart($("chart-used"), [{ ...OWN, label: ownLabel }, ...peers.map(stackOf)],
    rows(rec => ({ ...perPeer("used")(rec), own: rec.own_samples || 0 })), state.hidden, toggle, small);
  barChart($("chart-rejected"), [...peers.map(stackOf), { key: UNNAMED, label: peerLabel(UNNAMED), color: peerColor(UNNAMED) }],
    rows(rec => {
      const v = perPeer("rejected")(rec);
      const named = Object.values(v).reduce((a, b) => a + b, 0);
      const all = Object.values(rec.rejected || {}).reduce((a, b) => a + b, 0);
      if (all > named) v[UNNAMED] = all - named;
      return v;
    }), state.hidden, toggle, { ...small, yLabel: "rejected", empty: "nothing rejected" });

  for (const [id, key, yLabel, yMin, minSpan] of OFFPOLICY) {
    lineChart($(id), [
      ...peers.map(pid => ({ key: pid, label: peerLabel(pid), title: pid, color: peerColor(pid),
        points: pts(r => (r.peers && r.peers[pid] && r.peers[pid].offpolicy ? r.peers[pid].offpolicy[key] : null)) })),
      { ...BATCH, label: "whole batch", dash: true, width: 1.5, points: pts(r => (r.metrics || {})[key]) },
    ], state.hidden, toggle, { ...chartOpts, height: 150, yLabel, yMin, minSpan, empty: "no training step yet" });
  }
}

// ------------------------------------------------------------------ header, progress, tiles

function drawHeader(s) {
  document.title = `ftis-node · ${s.name} · ${s.phase}`;
  $("title").textContent = `ftis-node · ${s.name}`;
  $("model").textContent = `${s.model} · ${s.loss}`;
  $("phase").textContent = s.phase;
  $("phase").setAttribute("data-phase", s.phase);
  const n = currentRoundInRun(s);
  $("round").textContent = n > 0 ? `round ${n} of this run` : "no round yet";
  $("round").setAttribute("title", s.round === null || s.round === undefined ? "" :
    (s.peer_id ? `DHT time bucket ${s.round} (round = floor(DHT time / round length))` : `round ${s.round}, counted over resumes`));
}

function drawProgress() {
  const s = state.status;
  if (!s) return;
  const at = ROUND_STEPS.indexOf(s.phase);
  $("steps").replaceChildren(...ROUND_STEPS.map((step, i) =>
    el("li", { class: i === at ? "now" : (at > i ? "done" : "") }, step)));
  const d = s.phase_detail || {};
  let frac = null, text = s.phase;
  const rs = s.round_seconds, t = now();
  if (num(d.total) && d.total > 0 && num(d.done)) {
    frac = d.done / d.total;
    text = `${s.phase}: ${d.done} of ${d.total}`;
  } else if (s.phase === "gathering" && num(d.deadline)) {
    const left = Math.max(0, d.deadline - t), span = num(s.gather_seconds) && s.gather_seconds > 0 ? s.gather_seconds : null;
    frac = span ? 1 - left / span : null;
    text = `gathering: ${num(d.peers) ? `${d.peers} peer${d.peers === 1 ? "" : "s"} answered, ` : ""}${left.toFixed(1)} s left`;
  } else if (s.phase === "waiting for round" && num(rs) && num(s.round)) {
    const left = Math.max(0, s.round * rs - t);
    frac = 1 - left / rs;
    text = `waiting: the next round starts in ${left.toFixed(1)} s`;
  } else if (inRound(s.phase) && num(rs) && num(s.round) && s.peer_id) {
    const into = t - s.round * rs;
    frac = into / rs;
    text = into <= rs ? `${s.phase} · ${(rs - into).toFixed(1)} s left in this round's time bucket`
                      : `${s.phase} · ${(into - rs).toFixed(1)} s past this round's time bucket`;
  }
  const fill = $("progress-fill");
  fill.style.width = frac === null ? "0" : `${Math.round(Math.min(1, Math.max(0, frac)) * 100)}%`;
  $("progress-text").textContent = text;
}

// What the node warns about its last round (nothing to learn from, an overrun bucket).
function drawNotices(s) {
  const notices = Array.isArray(s.notices) ? s.notices.slice() : [];
  const faults = s.reward_faults && typeof s.reward_faults === "object" ? s.reward_faults : null;
  if (faults) {  // kept for the whole run, unlike a round's notices
    const counts = Object.entries(faults).filter(([k]) => k !== "last").map(([k, v]) => `${k} ${v}`).join(", ");
    notices.push(`reward faults: ${counts} (last: ${faults.last})`);
  }
  $("notices").replaceChildren(...notices.map(n => el("div", { class: "notice" }, String(n))));
  $("notices").hidden = notices.length === 0;
}

function tile(label, value, sub, cls) {
  return el("div", { class: "tile" }, el("div", { class: "label" }, label), el("div", { class: "value " + (cls || "") }, value), el("div", { class: "sub" }, sub || "\u00a0"));
}

function drawTiles(s) {
  const h = state.history, last = h[h.length - 1], prev = h[h.length - 2];
  const rewards = h.map(r => r.reward_mean).filter(num);
  let delta = "", cls = "";
  if (last && prev) {
    const dv = last.reward_mean - prev.reward_mean;
    delta = `${dv >= 0 ? "+" : ""}${dv.toFixed(3)} vs previous · `;
    cls = dv > 0 ? "up" : (dv < 0 ? "down" : "");
  }
  // Content a peer sent and we refused, apart from the network's failures (fetches, DHT calls).
  const failures = s.failures || { content: s.rejected || {}, network: s.swarm_errors || {} };
  const rejectedTotal = Object.values(failures.content || {}).reduce((a, b) => a + b, 0);
  const networkTotal = Object.values(failures.network || {}).reduce((a, b) => a + b, 0);
  const perRound = (n) => `${fmt(n / Math.max(s.rounds_done || 0, 1), 2)}/round`;
  const topNetwork = Object.entries(failures.network || {}).sort((a, b) => b[1] - a[1])[0];
  const topReason = Object.entries(failures.content || {}).sort((a, b) => b[1] - a[1])[0];
  const heard = Object.keys(s.peers || {}).length;
  const m = (last && last.metrics) || {};
  // Trust on the first screen: how many peers are in each state (the peers table has who).
  const trustCounts = {};
  for (const p of Object.values(s.peers || {})) if (p.trust) trustCounts[p.trust] = (trustCounts[p.trust] || 0) + 1;
  const quarantined = trustCounts.quarantined || 0;
  $("tiles").replaceChildren(
    tile("reward, last round", last ? fmt(last.reward_mean) : "–", last ? `${delta}best ${fmt(Math.max(...rewards))}` : "", cls),
    tile("rounds done", String(s.rounds_done), `up ${duration(s.uptime_s)}`),
    tile("peers answered", last ? String(last.peers_answered) : "–", `${heard} heard from · ${s.swarm_size || ((state.swarm && state.swarm.peers) || []).length} in swarm view`),
    tile("samples, last round", last ? String(last.own_samples + last.peer_samples) : "–", last ? `${last.own_samples} own + ${last.peer_samples} from peers` : ""),
    tile("peers trusted", String(trustCounts.trusted || 0),
      Object.keys(trustCounts).length ? Object.entries(trustCounts).filter(([k]) => k !== "trusted").map(([k, n]) => `${n} ${k}`).join(" · ") || "none on probation or quarantined" : "no peer yet",
      quarantined ? "down" : ""),
    tile("rejected content", String(rejectedTotal), topReason ? `most: ${topReason[0]} (${topReason[1]}) · ${perRound(rejectedTotal)}` : "nothing so far", rejectedTotal ? "down" : ""),
    tile("network failures", String(networkTotal), topNetwork ? `most: ${topNetwork[0]} (${topNetwork[1]}) · ${perRound(networkTotal)}` : "none so far", networkTotal ? "down" : ""),
    tile("packets, last round", last ? `↑ ${bytes(last.bytes_published)}` : "–", last ? `↓ ${bytes(last.bytes_read)} · gather ${fmt(last.gather_seconds, 1)} s` : ""),
    tile("round time", last ? `${fmt(last.seconds, 1)} s` : "–", last ? `step ${fmt(m.seconds, 2)} s · DHT errors ${last.dht_errors || 0}` : ""),
    tile("adapter", s.adapter_version ? String(s.adapter_version).slice(0, 10) : "–", s.adapter_version ? "hash of the trained weights" : "", "hash"),
  );
}

// ------------------------------------------------------------------ tables

function trustCell(p) {
  if (!p.trust) return el("td", { class: "muted" }, "–");
  const cell = el("td", {}, el("span", { class: `badge ${p.trust}` }, p.trust));
  const until = p.quarantined_until;
  const untilText = until === null || until === undefined ? "" : (num(until) && until > 1e9 ? ` until ${new Date(until * 1000).toLocaleTimeString()}` : ` until round ${until}`);
  if (p.trust_reason || untilText) cell.append(el("div", { class: "muted" }, `${p.trust_reason || ""}${untilText}`));
  return cell;
}

function reasonsCell(p) {
  const cell = el("td", {});
  const rej = Object.entries(p.rejected || {}), scr = Object.entries(p.screened || {});
  for (const [reason, n] of rej) cell.append(el("div", { class: "bad" }, `${reason} × ${n}`));
  for (const [reason, n] of scr) cell.append(el("div", { class: "muted" }, `screened: ${reason} × ${n}`));
  if (!rej.length && !scr.length) cell.append(el("span", { class: "muted" }, "–"));
  return cell;
}

function relRound(r, s) {
  if (!num(r)) return el("td", {}, "–");
  const behind = num(s.round) ? s.round - r : null;
  const text = behind === null ? String(r) : (behind <= 0 ? "this round" : `${behind} behind`);
  return el("td", { title: s.peer_id ? `DHT bucket ${r}` : `round ${r}` }, text);
}

function drawPeers(s) {
  const peers = Object.values(s.peers || {}).sort((a, b) => (b.samples_admitted - a.samples_admitted) || a.peer_id.localeCompare(b.peer_id));
  $("peers-table").tBodies[0].replaceChildren(...peers.map(p => {
    const o = p.offpolicy || {}, info = peerInfo(p.peer_id);
    const swatch = el("span", { class: "swatch" });
    swatch.style.background = peerColor(p.peer_id);
    return el("tr", { "data-peer": p.peer_id },
      peerCell(p.peer_id, swatch, " "),
      el("td", { class: "clip", title: info.model || "" }, info.model || "–"),
      el("td", { class: "mono", title: info.adapter || "" }, info.adapter ? String(info.adapter).slice(0, 10) : "–"),
      trustCell(p), relRound(p.last_round, s),
      el("td", {}, ago(p.last_seen)),
      el("td", { class: "num" }, p.samples_admitted), el("td", { class: "num" }, p.samples_used),
      el("td", { class: "num" }, fmt(p.reward_mean)),
      el("td", { class: "num" }, fmt(o.is_weight_mean)), el("td", { class: "num" }, fmt(o.frac_capped)),
      el("td", { class: "num" }, fmt(o.ess)), el("td", { class: "num" }, fmt(o.frac_filtered)),
      reasonsCell(p));
  }));
  $("peers-empty").hidden = peers.length > 0;
}

function drawSwarm(s) {
  const view = state.swarm || { peers: [], source: "gathered" };
  $("swarm-source").textContent = view.source === "dht"
    ? `every peer in the swarm's DHT records${num(view.updated_at) ? `, read ${ago(view.updated_at)}` : ""}`
    : "peers this node has heard from (its swarm layer lists no others)";
  const rows = [...view.peers].sort((a, b) => (b.round || 0) - (a.round || 0) || String(a.peer_id).localeCompare(String(b.peer_id)));
  $("swarm-table").tBodies[0].replaceChildren(...rows.map(p => el("tr", { "data-peer": p.peer_id },
    p.peer_id === s.peer_id
      ? el("td", { class: "mono", title: p.peer_id }, shortId(p.peer_id), el("span", { class: "badge self" }, "this node"))
      : peerCell(p.peer_id),
    el("td", { class: "clip", title: p.model || "" }, p.model || "–"),
    el("td", { class: "mono", title: p.adapter_version || "" }, p.adapter_version ? String(p.adapter_version).slice(0, 10) : "–"),
    relRound(p.round, s), el("td", { class: "num" }, bytes(p.size)), el("td", {}, ago(p.last_seen)))));
  $("swarm-empty").hidden = rows.length > 0;
}

function drawRejections(s) {
  const rows = Object.entries(s.rejected || {}).sort((a, b) => b[1] - a[1]);
  $("rejections").tBodies[0].replaceChildren(...rows.map(([reason, n]) => el("tr", { "data-reason": reason },
    el("td", { class: "bad" }, reason), el("td", { class: "num" }, n),
    el("td", { class: "mono detail" }, (s.rejected_examples || {})[reason] || ""))));
  $("rejections-empty").hidden = rows.length > 0;
}

function kvRows(table, pairs) {
  table.replaceChildren(...pairs.map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", { class: "mono" }, fmt(v)))));
}

function drawNode(s) {
  kvRows($("node"), [["name", s.name], ["model", s.model], ["task", s.task], ["loss", s.loss], ["peer id", s.peer_id],
    ["join with", (s.join_addrs || [])[0]], ["adapter", s.adapter_version], ["tokenizer", s.fingerprint],
    ["round length", num(s.round_seconds) ? `${s.round_seconds} s` : null], ["gather deadline", num(s.gather_seconds) ? `${s.gather_seconds} s` : null],
    ["rounds done", s.rounds_done], ["uptime", duration(s.uptime_s)], ["network failures", Object.entries((s.failures || {}).network || s.swarm_errors || {}).map(([k, v]) => `${k}: ${v}`).join(", ") || "none"]]);
  const last = s.last_round;
  kvRows($("last"), last ? [["round of this run", last.round_in_run], ["DHT bucket", last.round], ["reward (own)", last.reward_mean],
    ["own samples", last.own_samples], ["peer samples", last.peer_samples], ["peers answered", last.peers_answered],
    ["seconds", last.seconds], ["gather seconds", last.gather_seconds], ["bytes published", last.bytes_published],
    ["bytes read", last.bytes_read], ...Object.entries(last.metrics || {})] : []);
}

// ------------------------------------------------------------------ polling

function drawConn() {
  const c = $("conn");
  if (state.error) {
    c.textContent = `node not reachable (${state.error})${state.lastOk ? `; data from ${Math.round(Date.now() / 1000 - state.lastOk)} s ago` : ""}`;
    c.className = "conn bad";
  } else {
    c.textContent = state.lastOk ? `updated ${Math.round(Date.now() / 1000 - state.lastOk)} s ago` : "connecting…";
    c.className = "conn";
  }
}

async function getJSON(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

async function refresh() {
  try {
    const [s, swarm] = await Promise.all([getJSON("status"), getJSON("swarm")]);
    if (num(s.server_time)) state.skew = s.server_time - Date.now() / 1000;
    state.status = s;
    state.swarm = swarm;
    if (s.rounds_done !== state.roundsSeen) {
      state.history = await getJSON("history");
      state.roundsSeen = s.rounds_done;
      drawCharts();
    }
    state.error = "";
    state.lastOk = Date.now() / 1000;
    drawHeader(s); drawProgress(); drawNotices(s); drawTiles(s); drawPeers(s); drawSwarm(s); drawRejections(s); drawNode(s);
  } catch (e) {
    state.error = String(e.message || e);
  }
  drawConn();
}

let resizeTimer = null;
window.addEventListener("resize", () => { clearTimeout(resizeTimer); resizeTimer = setTimeout(drawCharts, 150); });
drawCharts();
refresh();
setInterval(refresh, 2000);
setInterval(() => { drawProgress(); drawConn(); }, 250);
$("reward-scale").addEventListener("click", () => { state.rewardFull = !state.rewardFull; drawCharts(); });
