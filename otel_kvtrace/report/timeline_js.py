"""The HTML report's timeline script (vanilla JS, SVG), kept as a Python string so it ships with the
package without package-data configuration.

Rows: one header per queue, then one row per task; a task is a bar split into its stage spans (the
forward thread's consumer_wait is drawn thin below). HOL intervals are shaded across their queue's rows
and outlined on the head's row. Wheel zooms around the pointer, drag pans, double-click resets; clicking
a bar fills ``#details`` with the task's stages, dependency times and HOL intervals.
"""

TIMELINE_JS = r"""
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("kvtrace-data").textContent);
  const T = DATA.timeline, COLORS = DATA.colors, HOLC = DATA.holColors;
  const svg = document.getElementById("timeline");
  const wrap = document.getElementById("timeline-wrap");
  const details = document.getElementById("details");
  const NS = "http://www.w3.org/2000/svg";
  const ROW = 12, HEADER = 18, AXIS = 22, LABEL = 150;
  const byCid = new Map();
  T.tasks.forEach(t => byCid.set(t.cid, t));

  // Layout: y of every task row, queue header rows in between.
  const layout = [];  // {kind: "queue"|"task", y, queue, task}
  let y = AXIS;
  T.queues.forEach((q, qi) => {
    layout.push({kind: "queue", y: y, queue: qi});
    y += HEADER;
    T.tasks.filter(t => t.queue === qi).forEach(t => { layout.push({kind: "task", y: y, queue: qi, task: t}); t._y = y; y += ROW; });
  });
  const NPU = T.npu || {lanes: [], events: []};
  const NPU_COLORS = {attention: "#e377c2", copy: "#17becf", communication: "#bcbd22"};
  const npuY = [];
  if (NPU.lanes.length) {
    layout.push({kind: "npu-header", y: y});
    y += HEADER;
    NPU.lanes.forEach(() => { npuY.push(y); y += ROW; });
  }
  const height = Math.max(y + 4, 60);
  let tMin = Infinity, tMax = -Infinity;
  T.tasks.forEach(t => {
    tMin = Math.min(tMin, t.enqueue);
    t.stages.forEach(s => { tMax = Math.max(tMax, s[2]); });
  });
  if (!isFinite(tMin)) { tMin = 0; tMax = 1; }
  if (tMax <= tMin) tMax = tMin + 1;
  let view = [tMin, tMax];
  if (T.hol.length) {  // start on the longest HOL interval, with some context around it
    const h = T.hol.reduce((a, b) => (b.end - b.start > a.end - a.start ? b : a));
    const pad = Math.max(3 * (h.end - h.start), 200);
    view = [Math.max(tMin, h.start - pad), Math.min(tMax, h.end + pad)];
  }
  const initialView = view.slice();
  let selected = null;
  let evidence = new Set();

  function width() { return Math.max(300, wrap.clientWidth - 2); }
  function xOf(t) { return LABEL + (t - view[0]) / (view[1] - view[0]) * (width() - LABEL - 4); }
  // Bars are clamped to the plot area, so a long bar's centre (where a click lands) is always visible.
  function xClamped(t) { return Math.min(Math.max(xOf(t), LABEL), width()); }
  function el(name, attrs, parent) {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmt(us) { return us === null || us === undefined ? "-" : (us >= 1000 ? (us / 1000).toFixed(3) + " ms" : us.toFixed(1) + " us"); }

  function render() {
    const W = width();
    svg.setAttribute("width", W);
    svg.setAttribute("height", height);
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const clip = el("clipPath", {id: "plot-clip"}, el("defs", {}, svg));
    el("rect", {x: LABEL, y: 0, width: W - LABEL, height: height}, clip);
    const plot = el("g", {"clip-path": "url(#plot-clip)"}, svg);
    // Axis ticks.
    const span = view[1] - view[0];
    const step = Math.pow(10, Math.floor(Math.log10(span / 6)));
    const tick = [1, 2, 5, 10].map(m => m * step).find(s => span / s <= 10) || step * 10;
    for (let t = Math.ceil(view[0] / tick) * tick; t <= view[1]; t += tick) {
      const x = xOf(t);
      el("line", {x1: x, x2: x, y1: AXIS - 4, y2: height, stroke: "#eee"}, plot);
      const label = el("text", {x: x + 2, y: AXIS - 8, "font-size": 10, fill: "#555"}, svg);
      label.textContent = fmt(t);
    }
    // HOL bands across each queue's rows.
    T.hol.forEach(h => {
      if (h.end < view[0] || h.start > view[1]) return;
      const rows = layout.filter(r => r.kind === "task" && r.queue === h.queue);
      if (!rows.length) return;
      const y0 = rows[0].y, y1 = rows[rows.length - 1].y + ROW;
      const x0 = xClamped(h.start), x1 = xClamped(h.end);
      el("rect", {x: x0, y: y0, width: Math.max(1, x1 - x0), height: y1 - y0, fill: HOLC[h.class],
                  "fill-opacity": 0.12, class: "hol", "data-head": h.head}, plot);
      const head = byCid.get(h.head);
      if (head) el("rect", {x: x0, y: head._y, width: Math.max(1, x1 - x0), height: ROW - 2, fill: "none",
                            stroke: HOLC[h.class], "stroke-width": 1.5, class: "hol-head"}, plot);
    });
    layout.forEach(r => {
      if (r.kind === "npu-header") return;
      if (r.kind === "queue") {
        const t = el("text", {x: 4, y: r.y + 13, "font-size": 11, "font-weight": "bold"}, svg);
        t.textContent = T.queues[r.queue];
        return;
      }
      const task = r.task;
      const label = el("text", {x: 4, y: r.y + 9, "font-size": 9, fill: "#333"}, svg);
      label.textContent = "s" + task.step + " l" + task.layer + (task.final ? " (final)" : "") + " #" + task.seq;
      task.stages.forEach(s => {
        if (s[2] < view[0] || s[1] > view[1]) return;
        const x0 = xClamped(s[1]), x1 = xClamped(s[2]);
        const consumer = s[0] === "consumer_wait";
        const rect = el("rect", {x: x0, y: consumer ? r.y + ROW - 4 : r.y + 1, width: Math.max(1, x1 - x0),
                                 height: consumer ? 2 : ROW - 4, fill: COLORS[s[0]] || "#000",
                                 class: "stage" + (selected === task.cid ? " selected" : "") +
                                        (evidence.has(task.cid) ? " evidence" : ""),
                                 "data-cid": task.cid, "data-stage": s[0]}, plot);
        const title = el("title", {}, rect);
        title.textContent = task.cid + "\n" + s[0] + ": " + fmt(s[2] - s[1]);
      });
    });
    if (NPU.lanes.length) {
      const header = layout.find(r => r.kind === "npu-header");
      el("text", {x: 4, y: header.y + 13, "font-size": 11, "font-weight": "bold"}, svg).textContent = "NPU (torch_npu profiler)";
      NPU.lanes.forEach((name, i) => {
        el("text", {x: 4, y: npuY[i] + 9, "font-size": 9, fill: "#333"}, svg).textContent = name;
      });
      NPU.events.forEach(e => {
        if (e.end < view[0] || e.start > view[1]) return;
        const x0 = xClamped(e.start), x1 = xClamped(e.end);
        const rect = el("rect", {x: x0, y: npuY[e.lane] + 1, width: Math.max(1, x1 - x0), height: ROW - 4,
                                 fill: NPU_COLORS[e.kind] || "#000", class: "npu npu-" + e.kind}, plot);
        el("title", {}, rect).textContent = e.kind + ": " + e.name + "\n" + fmt(e.end - e.start);
      });
    }
    document.getElementById("range").textContent = " showing " + fmt(view[0]) + " .. " + fmt(view[1]);
  }

  // Trace values reach the page only as text nodes (textContent), never as markup.
  function node(tag, attrs, children) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    (children || []).forEach(c => e.appendChild(c instanceof Node ? c : document.createTextNode(String(c))));
    return e;
  }
  function dataTable(id, head, rows) {
    return node("table", {class: "data", id: id}, [node("tr", {}, head.map(h => node("th", {}, [h])))].concat(
      rows.map(r => node("tr", {}, r.map((c, i) => node("td", i === 0 ? {class: "text"} : {}, [c]))))));
  }

  function showDetails(cid) {
    const t = byCid.get(cid);
    if (!t) return;
    selected = cid;
    evidence = new Set(T.hol.filter(h => h.head === cid).map(h => h.evidence));
    const stageRows = t.stages.map(s => [s[0], fmt(s[1]), fmt(s[2] - s[1])]);
    const depRows = Object.keys(t.deps).map(d => {
      const v = t.deps[d];
      return [d, Array.isArray(v) ? "[" + fmt(v[0]) + ", " + fmt(v[1]) + "] (bounded)" : fmt(v)];
    });
    const hol = T.hol.filter(h => h.head === cid || h.evidence === cid).map(h => node("li", {}, [
      (h.head === cid ? "blocked head, " : "evidence for " + h.head + ", ") + h.class + " " + fmt(h.start) +
      " .. " + fmt(h.end) + " (" + fmt(h.end - h.start) + ")" + (h.head === cid ? ", ready behind it: " + h.evidence : "")]));
    const parts = [
      node("b", {}, [t.cid]),
      " seq " + t.seq + ", step " + t.step + ", layer " + t.layer + (t.final ? " (final layer)" : "") +
        ", outcome " + t.outcome + ", ready precision " + t.precision,
      node("br"),
      "enqueue " + fmt(t.enqueue) + ", dequeue " + fmt(t.dequeue) + ", ready " + fmt(t.ready) +
        (t.ready_lo !== null ? " (lower bound " + fmt(t.ready_lo) + ")" : "") + ", complete " + fmt(t.complete),
      dataTable("detail-stages", ["stage", "start", "duration"], stageRows),
      depRows.length ? dataTable("detail-deps", ["dependency", "satisfied at"], depRows)
                     : node("p", {id: "detail-deps"}, ["no dependencies"]),
      hol.length ? node("ul", {id: "detail-hol"}, hol) : node("p", {}, ["No HOL interval involves this task."]),
    ];
    details.replaceChildren.apply(details, parts.map(c => c instanceof Node ? c : document.createTextNode(c)));
    render();
  }

  function zoom(factor, centerT) {
    const c = centerT === undefined ? (view[0] + view[1]) / 2 : centerT;
    let a = c - (c - view[0]) * factor, b = c + (view[1] - c) * factor;
    if (b - a < 0.01) return;
    if (b - a > (tMax - tMin)) { a = tMin; b = tMax; }
    view = [a, b];
    render();
  }
  function tAt(clientX) {
    const rect = svg.getBoundingClientRect();
    return view[0] + (clientX - rect.left - LABEL) / (width() - LABEL - 4) * (view[1] - view[0]);
  }
  svg.addEventListener("wheel", e => {
    if (!e.ctrlKey && Math.abs(e.deltaY) < Math.abs(e.deltaX)) return;
    e.preventDefault();
    zoom(e.deltaY > 0 ? 1.25 : 0.8, tAt(e.clientX));
  }, {passive: false});
  let drag = null;
  svg.addEventListener("mousedown", e => { drag = {x: e.clientX, view: view.slice(), moved: false}; });
  window.addEventListener("mousemove", e => {
    if (!drag) return;
    const dx = e.clientX - drag.x;
    if (Math.abs(dx) > 3) drag.moved = true;
    if (!drag.moved) return;
    const dt = dx / (width() - LABEL - 4) * (drag.view[1] - drag.view[0]);
    view = [drag.view[0] - dt, drag.view[1] - dt];
    render();
  });
  window.addEventListener("mouseup", e => {
    if (drag && !drag.moved) {
      const target = e.target;
      if (target && target.getAttribute && target.getAttribute("data-cid")) showDetails(target.getAttribute("data-cid"));
    }
    drag = null;
  });
  svg.addEventListener("dblclick", () => { view = [tMin, tMax]; render(); });
  document.getElementById("zoom-reset").addEventListener("click", () => { view = initialView.slice(); render(); });
  document.getElementById("zoom-in").addEventListener("click", () => zoom(0.5));
  document.getElementById("zoom-out").addEventListener("click", () => zoom(2));
  document.getElementById("zoom-all") && document.getElementById("zoom-all").addEventListener("click", () => { view = [tMin, tMax]; render(); });
  window.addEventListener("resize", render);
  function setView(a, b) { view = [a, b]; render(); }
  window.kvtraceTimeline = {showDetails: showDetails, zoom: zoom, setView: setView, view: () => view.slice()};
  render();
  if (T.hol.length) {  // scroll the longest HOL event's head into view
    const h = T.hol.reduce((a, b) => (b.end - b.start > a.end - a.start ? b : a));
    const head = byCid.get(h.head);
    if (head) wrap.scrollTop = Math.max(0, head._y - wrap.clientHeight / 2);
  }
})();
"""
