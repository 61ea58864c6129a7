// Ripples dashboard: renders the snapshots of /api/events (server-sent events).
// Vanilla JS, no build step, no external library.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const W = 800, H = 520;
let lastGroupId = 0;
let lastSnapshot = null;

function el(tag, attrs = {}, text = null) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  return node;
}

function fmt(x, digits = 3) {
  return x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(digits);
}

// Host boxes on a grid, workers on a circle inside their host's box.
function layout(snapshot) {
  const hosts = snapshot.hosts;
  const cols = Math.max(1, Math.ceil(Math.sqrt(hosts.length)));
  const rows = Math.max(1, Math.ceil(hosts.length / cols));
  const bw = W / cols, bh = H / rows, pos = {}, boxes = [];
  hosts.forEach((h, i) => {
    const x0 = (i % cols) * bw, y0 = Math.floor(i / cols) * bh;
    boxes.push({host: h.host, x: x0 + 8, y: y0 + 8, w: bw - 16, h: bh - 16});
    const cx = x0 + bw / 2, cy = y0 + bh / 2 + 8;
    const n = h.worker_ids.length;
    const r = n === 1 ? 0 : Math.min(bw, bh) / 2 - 48;
    h.worker_ids.forEach((wid, j) => {
      const a = -Math.PI / 2 + (2 * Math.PI * j) / n;
      pos[wid] = {x: cx + r * Math.cos(a), y: cy + r * Math.sin(a)};
    });
  });
  return {pos, boxes};
}

// Lines between placed nodes (workers, or hosts), as bright as their weight (recency).
function drawEdges(svg, edges, pos) {
  for (const e of edges) {
    const a = pos[e.a], b = pos[e.b];
    if (!a || !b) continue;
    svg.append(el("line", {class: "edge", x1: a.x, y1: a.y, x2: b.x, y2: b.y,
                           "stroke-width": 1 + 2 * e.weight, "stroke-opacity": 0.15 + 0.6 * e.weight,
                           "data-a": e.a, "data-b": e.b}));
  }
}

// Past MAX_WORKER_DETAIL workers the snapshot's topology is by host: one node per host
// (or per run of hosts), live/total workers and the slow ones in it, lines between nodes
// whose workers averaged together lately.
function drawHostTopology(svg, t, note) {
  const n = t.nodes.length;
  const cols = Math.max(1, Math.ceil(Math.sqrt(n * W / H)));
  const rows = Math.max(1, Math.ceil(n / cols));
  const bw = W / cols, bh = (H - 20) / rows;
  const r = Math.max(6, Math.min(bw, bh) / 2 - 6);
  const pos = t.nodes.map((_, i) => ({x: (i % cols) * bw + bw / 2,
                                      y: Math.floor(i / cols) * bh + bh / 2}));
  drawEdges(svg, t.edges, pos);
  t.nodes.forEach((node, i) => {
    const classes = ["host-node"];
    if (node.slow) classes.push("slow");
    if (node.live < node.workers) classes.push("degraded");
    const g = el("g", {class: classes.join(" "), "data-node": i,
                       transform: `translate(${pos[i].x},${pos[i].y})`});
    g.append(el("title", {}, `${node.label}: ${node.live}/${node.workers} workers live, ` +
                             `${node.slow} slow, iteration ${fmt(node.mean_iteration, 1)} ` +
                             `(lowest ${node.min_iteration ?? "–"}), loss ${fmt(node.mean_loss, 4)}`));
    g.append(el("circle", {r}));
    if (r >= 18) {
      g.append(el("text", {class: "wid", y: -2}, node.label.length > 12 ? node.label.slice(0, 11) + "…" : node.label));
      g.append(el("text", {y: 12}, `${node.live}/${node.workers}` + (node.slow ? ` · ${node.slow} slow` : "")));
    }
    svg.append(g);
  });
  svg.append(el("text", {class: "edges-note", x: W / 2, y: H - 4}, note));
}

function drawTopology(s) {
  const svg = document.getElementById("topology-svg");
  svg.replaceChildren();
  if (s.topology && s.topology.mode === "hosts") { drawHostTopology(svg, s.topology, s.edges_note); return; }
  const {pos, boxes} = layout(s);
  for (const b of boxes) {
    svg.append(el("rect", {class: "host-box", x: b.x, y: b.y, width: b.w, height: b.h, rx: 10}));
    svg.append(el("text", {class: "host-label", x: b.x + 10, y: b.y + 20}, b.host));
  }
  drawEdges(svg, s.edges, pos);
  if (s.edges_note) {  // a complete graph too large to draw: say so instead
    svg.append(el("text", {class: "edges-note", x: W / 2, y: H - 4}, s.edges_note));
  }
  const inGroup = {};
  for (const g of s.active_groups) {
    for (const m of g.members) inGroup[m] = g.state;
    for (let i = 0; i < g.members.length; i++) {
      for (let j = i + 1; j < g.members.length; j++) {
        const a = pos[g.members[i]], b = pos[g.members[j]];
        if (!a || !b) continue;
        // Pending groups are drawn a few pixels aside, so that a pair in both an executing
        // and a pending group shows two lines instead of one striped line.
        const off = g.state === "pending" ? 6 : 0;
        const len = Math.hypot(b.x - a.x, b.y - a.y) || 1;
        const dx = (-(b.y - a.y) / len) * off, dy = ((b.x - a.x) / len) * off;
        svg.append(el("line", {class: `group-edge ${g.state}`, x1: a.x + dx, y1: a.y + dy,
                               x2: b.x + dx, y2: b.y + dy, "data-group-id": g.group_id}));
      }
    }
  }
  // Workers in a group formed since the previous snapshot flash once.
  const flashing = new Set();
  let newest = lastGroupId;
  for (const g of [...s.recent_groups, ...s.active_groups]) {
    if (g.group_id > lastGroupId) g.members.forEach((m) => flashing.add(m));
    newest = Math.max(newest, g.group_id);
  }
  lastGroupId = newest;
  for (const w of s.workers) {
    const p = pos[w.worker_id];
    if (!p) continue;
    const classes = ["worker"];
    if (inGroup[w.worker_id]) classes.push(`in-${inGroup[w.worker_id]}`);
    if (w.slow) classes.push("slow");
    if (["left", "expired", "failed"].includes(w.state)) classes.push("gone");
    if (flashing.has(w.worker_id)) classes.push("flash");
    const g = el("g", {class: classes.join(" "), "data-worker-id": w.worker_id,
                       transform: `translate(${p.x},${p.y})`});
    g.append(el("title", {}, `worker ${w.worker_id} (${w.host}/${w.local_rank}), ${w.state}`));
    g.append(el("circle", {r: 34}));
    g.append(el("text", {class: "wid", y: -4}, `w${w.worker_id}`));
    g.append(el("text", {y: 12}, `r${w.rank} · it ${w.iteration}`));
    if (w.slow) g.append(el("text", {class: "slow-tag", y: 46}, "slow"));
    svg.append(g);
  }
}

function drawCounters(s) {
  const r = s.run || {};
  const items = [
    ["groups formed", r.groups_formed], ["executing", r.groups_executing],
    ["pending (queue)", r.groups_pending], ["conflicts", r.conflicts],
    ["pending waits", r.pending_waits], ["cancelled", r.groups_cancelled],
    ["failed", r.groups_failed], ["lease expirations", r.lease_expirations],
    ["restart rounds", r.restarts],
  ];
  const dl = document.getElementById("counters");
  dl.replaceChildren();
  for (const [k, v] of items) {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = v ?? "–";
    dd.dataset.counter = k;
    dl.append(dt, dd);
  }
  const ol = document.getElementById("groups");
  ol.replaceChildren();
  const groups = [...s.active_groups, ...s.recent_groups.filter(
    (g) => !s.active_groups.some((a) => a.group_id === g.group_id)).reverse()];
  for (const g of groups.slice(0, 12)) {
    const li = document.createElement("li");
    li.className = g.state;
    li.dataset.groupId = g.group_id;
    li.textContent = `#${g.group_id} {${g.members.join(", ")}} ${g.state}, ` +
                     `by w${g.initiator}, ${fmt(g.age_seconds, 1)} s ago`;
    ol.append(li);
  }
  if (!groups.length) {
    const li = document.createElement("li");
    li.className = "none";
    li.textContent = s.groups_note || "none yet";
    ol.append(li);
  }
}

function drawWorkers(s) {
  const tbody = document.querySelector("#workers tbody");
  tbody.replaceChildren();
  document.getElementById("workers-note").textContent = s.workers_note || "";
  for (const w of s.workers) {
    const tr = document.createElement("tr");
    tr.dataset.workerId = w.worker_id;
    if (w.slow) tr.className = "slow";
    const cells = [
      w.worker_id, `${w.host}/${w.local_rank}`, w.rank, w.state,
      `${w.iteration}${w.planned_iterations ? " / " + w.planned_iterations : ""}`,
      fmt(w.iterations_per_second, 1), fmt(w.loss, 4), w.request_count,
      `${fmt(w.compute_seconds, 1)} / ${fmt(w.wait_seconds, 1)} / ${fmt(w.preduce_seconds, 1)}`,
    ];
    cells.forEach((c, i) => {
      const td = document.createElement("td");
      td.textContent = c;
      if (i === 3) td.className = `state-${w.state}`;
      tr.append(td);
    });
    const flag = document.createElement("td");
    if (w.slow) { const t = document.createElement("span"); t.className = "tag-slow"; t.textContent = "slow"; flag.append(t); }
    if (w.error) flag.append(document.createTextNode(" " + w.error));
    tr.append(flag);
    tbody.append(tr);
  }
}

function drawLoss(s) {
  const canvas = document.getElementById("loss-chart");
  const ratio = window.devicePixelRatio || 1;
  const cw = canvas.clientWidth || canvas.width, ch = canvas.clientHeight || canvas.height;
  canvas.width = cw * ratio; canvas.height = ch * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, cw, ch);
  const curves = Object.entries(s.worker_loss_curves).map(([wid, pts]) => ({wid, pts}));
  const all = [...s.loss_curve, ...curves.flatMap((c) => c.pts)].filter((p) => Number.isFinite(p.loss));
  if (!all.length) { ctx.fillStyle = "#6b7687"; ctx.fillText("no loss reported yet", 20, 30); return; }
  const pad = {l: 50, r: 10, t: 10, b: 30};
  const xmax = Math.max(1e-9, ...all.map((p) => p.seconds));
  const ymin = Math.min(...all.map((p) => p.loss)), ymax = Math.max(...all.map((p) => p.loss));
  const yspan = ymax - ymin || 1;
  const X = (t) => pad.l + (t / xmax) * (cw - pad.l - pad.r);
  const Y = (v) => pad.t + (1 - (v - ymin) / yspan) * (ch - pad.t - pad.b);
  ctx.strokeStyle = "#d9dee6"; ctx.fillStyle = "#6b7687"; ctx.lineWidth = 1; ctx.font = "12px system-ui";
  for (let i = 0; i <= 4; i++) {
    const v = ymin + (yspan * i) / 4;
    ctx.beginPath(); ctx.moveTo(pad.l, Y(v)); ctx.lineTo(cw - pad.r, Y(v)); ctx.stroke();
    ctx.fillText(v.toFixed(3), 4, Y(v) + 4);
  }
  ctx.fillText(`${xmax.toFixed(xmax < 10 ? 1 : 0)} s of training`, cw - pad.r - 110, ch - 8);
  ctx.fillText("0 s", pad.l, ch - 8);
  const line = (pts, color, width) => {  // a point without a loss (null) is skipped
    ctx.strokeStyle = color; ctx.lineWidth = width; ctx.beginPath();
    pts.filter((p) => Number.isFinite(p.loss)).forEach((p, i) =>
      (i ? ctx.lineTo(X(p.seconds), Y(p.loss)) : ctx.moveTo(X(p.seconds), Y(p.loss))));
    ctx.stroke();
  };
  const palette = ["#4c6ef5", "#12b886", "#fab005", "#e64980", "#7950f2", "#15aabf", "#82c91e", "#fd7e14"];
  curves.forEach((c, i) => line(c.pts, palette[i % palette.length] + "99", 1));
  if (s.run && s.run.target_loss) {
    ctx.setLineDash([5, 4]); line([{seconds: 0, loss: s.run.target_loss}, {seconds: xmax, loss: s.run.target_loss}], "#868e96", 1);
    ctx.setLineDash([]);
  }
  line(s.loss_curve, "#1d2430", 2.5);
}

function drawHeader(s) {
  const badge = document.getElementById("status-badge");
  const banner = document.getElementById("banner");
  if (s.connected) {
    badge.className = "badge live"; badge.textContent = "live";
    banner.hidden = true;
  } else {
    badge.className = "badge down"; badge.textContent = "disconnected";
    banner.hidden = false; banner.textContent = `${s.error} — retrying; showing the last known state`;
  }
  const r = s.run;
  if (r && RUN_PAGE && ENDED.has(r.state)) {  // a finished run, read from the history
    badge.className = "badge pending"; badge.textContent = r.state;
  }
  document.getElementById("run-info").textContent = r
    ? (r.name ? `${r.name} (${r.run_id}) · ${r.state} · ` : "") +
      `${r.protocol} · ${r.task} · ${s.workers_total ?? s.workers.length}/${r.num_workers} workers · ` +
      (r.started ? `${fmt(r.elapsed_seconds, 1)} s` : "waiting for workers") +
      ` · mean loss ${fmt(r.mean_loss, 4)}` + (r.target_loss ? ` (target ${r.target_loss})` : "") +
      (r.stopped ? ` · stopped: ${r.stop_reason}` : "") + ` · coordinator ${s.coordinator}`
    : `coordinator ${s.coordinator}`;
}

function render(s) {
  lastSnapshot = s;
  document.querySelector("main").classList.remove("stale");
  drawHeader(s);
  drawTopology(s);
  drawCounters(s);
  drawWorkers(s);
  drawLoss(s);
  document.body.dataset.version = (Number(document.body.dataset.version || 0) + 1).toString();
}

// One event the page cannot read or draw is reported (console and banner) and skipped:
// the stream goes on, and the next good event clears the banner.
function onStatus(ev) {
  try {
    render(JSON.parse(ev.data));
  } catch (err) {
    console.error("ripples dashboard: status event", ev.lastEventId, "skipped:", err);
    const banner = document.getElementById("banner");
    banner.hidden = false;
    banner.textContent = `a status update could not be shown (${err.message}); waiting for the next`;
  }
}

function connect() {
  const source = new EventSource("/api/events");
  source.addEventListener("status", onStatus);
  source.onerror = () => {
    // The dashboard itself is gone: EventSource retries on its own (retry: 2000).
    const badge = document.getElementById("status-badge");
    badge.className = "badge down"; badge.textContent = "dashboard unreachable";
    const banner = document.getElementById("banner");
    banner.hidden = false;
    const when = lastSnapshot ? new Date(lastSnapshot.updated_at * 1000).toLocaleTimeString() : "never";
    banner.textContent = `the dashboard server is unreachable — retrying; showing the state of ${when}`;
    document.querySelector("main").classList.add("stale");
  };
}

// The runs of the coordinator service: a table of links to each run's page.
function drawRuns(list) {
  const body = document.querySelector("#runs tbody");
  body.replaceChildren();
  for (const r of list.runs) {
    const tr = document.createElement("tr");
    tr.className = `run-${r.state}`;
    tr.dataset.runId = r.run_id;
    const link = document.createElement("a");
    link.href = `/runs/${encodeURIComponent(r.run_id)}`;
    link.textContent = r.run_id;
    const when = new Date(r.submitted_at * 1000).toLocaleString();
    const state = r.state + (r.queue_position ? ` #${r.queue_position}` : "");
    const cells = [link, r.name, state, r.protocol, r.workers, when,
                   r.elapsed_seconds ? `${fmt(r.elapsed_seconds, 1)} s` : "–",
                   r.mean_loss ? fmt(r.mean_loss, 4) : "–", r.stop_reason || "–"];
    for (const c of cells) {
      const td = document.createElement("td");
      if (c instanceof Node) td.append(c); else td.textContent = String(c);
      tr.append(td);
    }
    if (RUN_PAGE === r.run_id) tr.classList.add("current");
    body.append(tr);
  }
  document.getElementById("agents").textContent = list.agents.length
    ? "Host agents: " + list.agents.map((a) => `${a.host} (${a.slots} slots` +
      (a.run_id ? `, run ${a.run_id}` : ", idle") + (a.draining ? ", draining" : "") + ")").join(", ")
    : (list.runs.length ? "No host agent is connected." : "No runs yet: `ripples submit` adds one.");
}

async function pollRuns() {
  try {
    const response = await fetch("/api/runs");
    if (response.ok) drawRuns(await response.json());
  } catch (err) { /* the dashboard is unreachable: the status badge says so */ }
  setTimeout(pollRuns, 2000);
}

// A run's own page (/runs/ID): read it every 2 s until it ended, then keep what the
// history holds (no live stream: the active run's live page is /).
async function pollRun() {
  let ended = false;
  try {
    const response = await fetch(`/api/runs/${encodeURIComponent(RUN_PAGE)}`);
    if (response.status === 404) {
      document.getElementById("run-info").textContent = `no run ${RUN_PAGE}`;
      return;
    }
    const s = await response.json();
    render(s);
    ended = s.run !== null && ENDED.has(s.run.state);
  } catch (err) { /* retried below */ }
  if (!ended) setTimeout(pollRun, 2000);
}

const ENDED = new Set(["finished", "failed", "stopped", "cancelled"]);
const RUN_PAGE = (location.pathname.match(/^\/runs\/([^/]+)$/) || [null, null])[1];
window.addEventListener("resize", () => lastSnapshot && drawLoss(lastSnapshot));
pollRuns();
if (RUN_PAGE) pollRun(); else connect();
