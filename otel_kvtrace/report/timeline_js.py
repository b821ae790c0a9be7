"""The HTML report's timeline script (vanilla JS, SVG), kept as a Python string so it ships with the
package without package-data configuration.

Rows: one header per queue, then one row per task; a task is a bar split into its stage spans (the
forward thread's consumer_wait is drawn thin below); then the NPU profiler's lanes when given. HOL
intervals are shaded across their queue's rows and outlined on the head's row. Every run has its own
axis starting at 0 (ms); the run selector shows one run or all. The axis band and the name of the queue
under it stay at the top while the rows scroll. Wheel zooms around the pointer, drag pans, double-click
shows the whole window; clicking a bar fills ``#details`` with the task's stages, dependency times and
HOL intervals; a row of the HOL table jumps to its interval and selects head and evidence (an arrow
from the head to the evidence, markers at both ready times); the search box finds a correlation id.
Every trace value reaches the page as text (``textContent``), never as markup.
"""

TIMELINE_JS = r"""
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("kvtrace-data").textContent);
  const T = DATA.timeline, COLORS = DATA.colors, HOLC = DATA.holColors, JAEGER = DATA.jaeger;
  const svg = document.getElementById("timeline");
  const wrap = document.getElementById("timeline-wrap");
  const details = document.getElementById("details");
  const runSelect = document.getElementById("run-select");
  const NS = "http://www.w3.org/2000/svg";
  const ROW = 12, HEADER = 18, AXIS = 22, LABEL = 150;
  const NPU = T.npu || {lanes: [], events: []};
  const NPU_COLORS = {attention: "#e377c2", copy: "#17becf", communication: "#bcbd22"};
  const byCid = new Map();
  T.tasks.forEach(t => byCid.set(t.cid, t));
  const runOf = q => (T.queue_runs || [])[q] || 0;

  let runFilter = -1;  // -1: every run
  let layout = [], npuY = [], height = 60, tMin = 0, tMax = 1;
  function buildLayout() {
    layout = []; npuY = [];
    let y = AXIS;
    T.queues.forEach((q, qi) => {
      if (runFilter >= 0 && runOf(qi) !== runFilter) return;
      layout.push({kind: "queue", y: y, queue: qi});
      y += HEADER;
      T.tasks.filter(t => t.queue === qi).forEach(t => { layout.push({kind: "task", y: y, queue: qi, task: t}); t._y = y; y += ROW; });
    });
    if (NPU.lanes.length && (runFilter < 0 || runFilter === NPU.run)) {
      layout.push({kind: "npu-header", y: y});
      y += HEADER;
      NPU.lanes.forEach(() => { npuY.push(y); y += ROW; });
    }
    height = Math.max(y + 4, 60);
    tMin = Infinity; tMax = -Infinity;
    T.tasks.forEach(t => {
      if (runFilter >= 0 && runOf(t.queue) !== runFilter) return;
      tMin = Math.min(tMin, t.enqueue);
      t.stages.forEach(s => { tMax = Math.max(tMax, s[2]); });
    });
    if (!isFinite(tMin)) { tMin = 0; tMax = 1; }
    if (tMax <= tMin) tMax = tMin + 1;
  }
  buildLayout();
  const longest = T.hol.length ? T.hol.reduce((a, b) => (b.end - b.start > a.end - a.start ? b : a)) : null;
  function around(a, b) {
    const pad = Math.max(3 * (b - a), 200);
    return [Math.max(tMin, a - pad), Math.min(tMax, b + pad)];
  }
  let view = longest ? around(longest.start, longest.end) : [tMin, tMax];
  const initialView = view.slice();
  let selected = null, evidence = new Set(), activeHol = null;

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
  function fmt(us) { return us === null || us === undefined ? "-" : (us / 1000).toFixed(3) + " ms"; }

  function drawAxis(plot) {
    const top = wrap.scrollTop, W = width();
    const span = view[1] - view[0];
    const step = Math.pow(10, Math.floor(Math.log10(span / 6)));
    const tick = [1, 2, 5, 10].map(m => m * step).find(s => span / s <= 10) || step * 10;
    for (let t = Math.ceil(view[0] / tick) * tick; t <= view[1]; t += tick) {
      el("line", {x1: xOf(t), x2: xOf(t), y1: AXIS - 4, y2: height, stroke: "#eee"}, plot);
    }
    // The sticky band: drawn last, at the scroll position, over the rows.
    return () => {
      el("rect", {x: 0, y: top, width: W, height: AXIS, fill: "#fff", class: "axis-band"}, svg);
      for (let t = Math.ceil(view[0] / tick) * tick; t <= view[1]; t += tick) {
        el("text", {x: xOf(t) + 2, y: top + AXIS - 8, "font-size": 10, fill: "#555", class: "tick"}, svg).textContent = fmt(t);
      }
      const current = layout.filter(r => r.kind === "queue" && r.y <= top + AXIS).pop();
      if (current && current.y < top) {
        el("text", {x: 4, y: top + AXIS - 8, "font-size": 10, "font-weight": "bold", class: "sticky-queue"}, svg)
          .textContent = T.queues[current.queue].slice(-28);
      }
    };
  }

  function drawHolArrow(plot) {
    const h = activeHol, head = byCid.get(h.head), ev = byCid.get(h.evidence);
    if (!head || !ev || head._y === undefined || ev._y === undefined) return;
    const hy = head._y + ROW / 2, ey = ev._y + ROW / 2;
    el("line", {x1: xOf(h.start), y1: hy, x2: xOf(h.evidence_ready), y2: ey, stroke: "#c00", "stroke-width": 1.5,
                "marker-end": "url(#arrow-head)", class: "hol-arrow"}, plot);
    if (h.head_ready !== null) el("circle", {cx: xOf(h.head_ready), cy: hy, r: 4, fill: "#c00", class: "ready-marker head-ready"}, plot);
    el("circle", {cx: xOf(h.evidence_ready), cy: ey, r: 4, fill: "#fff", stroke: "#c00", "stroke-width": 1.5,
                  class: "ready-marker evidence-ready"}, plot);
  }

  function render() {
    const W = width();
    svg.setAttribute("width", W);
    svg.setAttribute("height", height);
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const defs = el("defs", {}, svg);
    el("rect", {x: LABEL, y: 0, width: W - LABEL, height: height}, el("clipPath", {id: "plot-clip"}, defs));
    el("path", {d: "M0,0 L8,4 L0,8 z", fill: "#c00"},
       el("marker", {id: "arrow-head", markerWidth: 8, markerHeight: 8, refX: 7, refY: 4, orient: "auto"}, defs));
    const plot = el("g", {"clip-path": "url(#plot-clip)"}, svg);
    const axisBand = drawAxis(plot);
    const shownQueues = new Set(layout.filter(r => r.kind === "queue").map(r => r.queue));
    T.hol.forEach(h => {  // HOL bands across each queue's rows
      if (!shownQueues.has(h.queue) || h.end < view[0] || h.start > view[1]) return;
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
      if (r.kind === "npu-header") {
        el("text", {x: 4, y: r.y + 13, "font-size": 11, "font-weight": "bold"}, svg).textContent = "NPU (torch_npu profiler)";
        return;
      }
      if (r.kind === "queue") {
        const run = (T.runs || [])[runOf(r.queue)];
        el("text", {x: 4, y: r.y + 13, "font-size": 11, "font-weight": "bold", class: "queue-label"}, svg).textContent =
          T.queues[r.queue] + (run ? "  (" + run.cfg + "; axis: ms since the run's first task shown)" : "");
        return;
      }
      const task = r.task;
      el("text", {x: 4, y: r.y + 9, "font-size": 9, fill: "#333"}, svg).textContent =
        "s" + task.step + " l" + task.layer + (task.final ? " (final)" : "") + " #" + task.seq;
      task.stages.forEach(s => {
        if (s[2] < view[0] || s[1] > view[1]) return;
        const x0 = xClamped(s[1]), x1 = xClamped(s[2]);
        const consumer = s[0] === "consumer_wait";
        const rect = el("rect", {x: x0, y: consumer ? r.y + ROW - 4 : r.y + 1, width: Math.max(1, x1 - x0),
                                 height: consumer ? 2 : ROW - 4, fill: COLORS[s[0]] || "#000",
                                 class: "stage" + (selected === task.cid ? " selected" : "") +
                                        (evidence.has(task.cid) ? " evidence" : ""),
                                 "data-cid": task.cid, "data-stage": s[0]}, plot);
        el("title", {}, rect).textContent = task.cid + "\n" + s[0] + ": " + fmt(s[2] - s[1]);
      });
    });
    if (npuY.length) NPU.lanes.forEach((name, i) => {
      el("text", {x: 4, y: npuY[i] + 9, "font-size": 9, fill: "#333"}, svg).textContent = name;
    });
    if (npuY.length) NPU.events.forEach(e => {
      if (e.end < view[0] || e.start > view[1]) return;
      const x0 = xClamped(e.start), x1 = xClamped(e.end);
      const rect = el("rect", {x: x0, y: npuY[e.lane] + 1, width: Math.max(1, x1 - x0), height: ROW - 4,
                               fill: NPU_COLORS[e.kind] || "#000", class: "npu npu-" + e.kind}, plot);
      el("title", {}, rect).textContent = e.kind + ": " + e.name + "\n" + fmt(e.end - e.start);
    });
    if (activeHol) drawHolArrow(plot);
    axisBand();
    document.getElementById("range").textContent = " showing " + fmt(view[0]) + " .. " + fmt(view[1]) +
      (runFilter >= 0 ? " of run " + T.runs[runFilter].run : " (each run from its own 0)");
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
    if (!activeHol || activeHol.head !== cid) {
      activeHol = null;
      evidence = new Set(T.hol.filter(h => h.head === cid).map(h => h.evidence));
    }
    const stageRows = t.stages.map(s => [s[0], fmt(s[1]), fmt(s[2] - s[1])]);
    const depRows = Object.keys(t.deps).map(d => {
      const v = t.deps[d];
      return [d, Array.isArray(v) ? "[" + fmt(v[0]) + ", " + fmt(v[1]) + "] (bounded)" : fmt(v)];
    });
    const hol = T.hol.filter(h => h.head === cid || h.evidence === cid).map(h => node("li", {}, [
      (h.head === cid ? "blocked head, " : "evidence for " + h.head + ", ") + h.class + " " + fmt(h.start) +
      " .. " + fmt(h.end) + " (" + fmt(h.end - h.start) + ")" +
      (h.head === cid ? ", blocked by " + h.blocked_by + ", ready behind it: " + h.evidence : "")]));
    const parts = [
      node("b", {}, [t.cid]),
      " seq " + t.seq + ", step " + t.step + ", layer " + t.layer + (t.final ? " (final layer)" : "") +
        ", outcome " + t.outcome + ", ready precision " + t.precision,
    ];
    if (JAEGER && t.trace_id) {
      parts.push(" ", node("a", {href: JAEGER + "/trace/" + encodeURIComponent(t.trace_id), target: "_blank",
                                 rel: "noopener noreferrer", id: "jaeger-link"}, ["open in Jaeger"]));
    }
    parts.push(node("br"),
      "enqueue " + fmt(t.enqueue) + ", dequeue " + fmt(t.dequeue) + ", ready " + fmt(t.ready) +
        (t.ready_lo !== null ? " (lower bound " + fmt(t.ready_lo) + ")" : "") + ", complete " + fmt(t.complete),
      dataTable("detail-stages", ["stage", "start", "duration"], stageRows),
      depRows.length ? dataTable("detail-deps", ["dependency", "satisfied at"], depRows)
                     : node("p", {id: "detail-deps"}, ["no dependencies"]),
      hol.length ? node("ul", {id: "detail-hol"}, hol) : node("p", {}, ["No HOL interval involves this task."]));
    details.replaceChildren.apply(details, parts.map(c => c instanceof Node ? c : document.createTextNode(c)));
    render();
  }

  function ensureRun(queue) {
    if (runFilter >= 0 && runOf(queue) !== runFilter) { runFilter = -1; runSelect.value = "-1"; buildLayout(); }
  }
  function scrollTo(task) { wrap.scrollTop = Math.max(0, task._y - wrap.clientHeight / 2); }

  function selectHol(h) {
    ensureRun(h.queue);
    activeHol = h;
    evidence = new Set([h.evidence]);
    view = around(Math.min(h.start, h.evidence_ready), h.end);
    const head = byCid.get(h.head);
    if (head) scrollTo(head);
    showDetails(h.head);
  }

  function setView(a, b) { view = [a, b]; render(); }
  function zoom(factor, centerT) {
    const c = centerT === undefined ? (view[0] + view[1]) / 2 : centerT;
    let a = c - (c - view[0]) * factor, b = c + (view[1] - c) * factor;
    if (b - a < 0.01) return;
    if (b - a > (tMax - tMin)) { a = tMin; b = tMax; }
    setView(a, b);
  }
  function tAt(clientX) {
    const rect = svg.getBoundingClientRect();
    return view[0] + (clientX - rect.left - LABEL) / (width() - LABEL - 4) * (view[1] - view[0]);
  }

  // The HOL table: every interval of the windows shown, longest first; a row jumps to its interval.
  const holBody = document.getElementById("hol-intervals");
  T.hol.map((h, i) => [h, i]).sort((a, b) => (b[0].end - b[0].start) - (a[0].end - a[0].start)).slice(0, 50)
    .forEach(([h, i]) => {
      const run = (T.runs || [])[runOf(h.queue)];
      const row = node("tr", {class: "hol-row", "data-hol": String(i)}, [
        node("td", {class: "text"}, [h.head]), node("td", {class: "text"}, [h.blocked_by]),
        node("td", {class: "text"}, [h.class]), node("td", {}, [fmt(h.start)]), node("td", {}, [fmt(h.end - h.start)]),
        node("td", {class: "text"}, [h.evidence]), node("td", {}, [fmt(h.evidence_ready)]),
        node("td", {class: "text"}, [run ? run.run : ""])]);
      row.addEventListener("click", () => selectHol(h));
      holBody.appendChild(row);
    });

  // Correlation-id search: Enter or the button goes to the next task whose id contains the text.
  const search = document.getElementById("search"), searchResult = document.getElementById("search-result");
  let matches = [], matchIndex = -1, lastQuery = null;
  function runSearch() {
    const q = search.value.trim();
    if (q !== lastQuery) { matches = q ? T.tasks.filter(t => t.cid.includes(q)) : []; matchIndex = -1; lastQuery = q; }
    if (!matches.length) { searchResult.textContent = q ? " no task shown matches" : ""; return; }
    matchIndex = (matchIndex + 1) % matches.length;
    const t = matches[matchIndex];
    ensureRun(t.queue);
    view = around(t.enqueue, t.complete === null ? t.enqueue + 1 : t.complete);
    scrollTo(t);
    searchResult.textContent = " " + (matchIndex + 1) + " of " + matches.length + " matches";
    showDetails(t.cid);
  }
  search.addEventListener("keydown", e => { if (e.key === "Enter") runSearch(); });
  document.getElementById("search-go").addEventListener("click", runSearch);

  (T.runs || []).forEach((r, i) => runSelect.appendChild(node("option", {value: String(i)}, [r.run + " (" + r.cfg + ")"])));
  runSelect.addEventListener("change", () => {
    runFilter = parseInt(runSelect.value, 10);
    buildLayout();
    view = [tMin, tMax];
    wrap.scrollTop = 0;
    render();
  });

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
    setView(drag.view[0] - dt, drag.view[1] - dt);
  });
  window.addEventListener("mouseup", e => {
    if (drag && !drag.moved) {
      const target = e.target;
      if (target && target.getAttribute && target.getAttribute("data-cid")) showDetails(target.getAttribute("data-cid"));
    }
    drag = null;
  });
  svg.addEventListener("dblclick", () => setView(tMin, tMax));
  wrap.addEventListener("scroll", render);
  document.getElementById("zoom-reset").addEventListener("click", () => setView(initialView[0], initialView[1]));
  document.getElementById("zoom-in").addEventListener("click", () => zoom(0.5));
  document.getElementById("zoom-out").addEventListener("click", () => zoom(2));
  document.getElementById("zoom-all").addEventListener("click", () => setView(tMin, tMax));
  window.addEventListener("resize", render);
  window.kvtraceTimeline = {showDetails: showDetails, zoom: zoom, setView: setView, selectHol: selectHol,
                            view: () => view.slice(), active: () => (activeHol ? {head: activeHol.head, evidence: activeHol.evidence} : null)};
  render();
  if (longest) { const head = byCid.get(longest.head); if (head) scrollTo(head); }
})();
"""
