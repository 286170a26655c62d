// Small SVG charts for the dashboard: line and stacked-bar panels with axes, ticks,
// gridlines, a legend and a shared hover read-out (the way TensorBoard and Grafana show
// training curves). No library, nothing fetched. Every label is set with textContent or
// setAttribute, never parsed as markup: series names come from the network.
(() => {
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) node.setAttribute(k, String(v));
  for (const c of children) if (c !== undefined && c !== null) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function svgEl(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

// "Nice" tick values covering [lo, hi] (1, 2, 5 times a power of ten; whole numbers if `integer`).
function niceTicks(lo, hi, count = 5, integer = false) {
  if (!isFinite(lo) || !isFinite(hi)) return [0, 1];
  if (lo === hi) { const pad = Math.abs(lo) * 0.1 || 1; lo = lo === 0 ? 0 : lo - pad; hi += pad; }
  const raw = (hi - lo) / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  let step = [1, 2, 2.5, 5, 10].map(m => m * mag).find(s => s >= raw) || 10 * mag;
  if (integer) step = Math.max(1, Math.round(step));
  const ticks = [];
  for (let v = Math.floor(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(+v.toFixed(10));
  if (ticks[ticks.length - 1] < hi) ticks.push(+(ticks[ticks.length - 1] + step).toFixed(10));
  return ticks;
}

// Integer ticks for round numbers, at most `count` of them.
function intTicks(lo, hi, count = 8) {
  const step = Math.max(1, Math.ceil((hi - lo + 1) / count));
  const ticks = [];
  for (let v = lo; v <= hi; v += step) ticks.push(v);
  return ticks;
}

// A tick label with as many decimals as the tick step needs, so neighbours never read alike.
function fmtTick(v, step) {
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(1).replace(/\.0$/, "") + "M";
  if (a >= 1e4 && step >= 1000) return (v / 1e3).toFixed(0) + "k";
  const decimals = Math.min(6, Math.max(0, Math.ceil(-Math.log10(step || 1) - 1e-9)));
  return v.toFixed(decimals);
}

// [lo, hi] widened to at least `minSpan` (kept above `floor`), so noise in a flat series stays flat.
function span(lo, hi, minSpan, floor) {
  if (!(hi - lo < minSpan)) return [lo, hi];
  const mid = (lo + hi) / 2;
  lo = mid - minSpan / 2; hi = mid + minSpan / 2;
  if (floor !== null && floor !== undefined && lo < floor) { hi += floor - lo; lo = floor; }
  return [lo, hi];
}

function fmtValue(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (Number.isInteger(v)) return String(v);
  return Math.abs(v) >= 100 ? v.toFixed(1) : (+v.toPrecision(4)).toString();
}

// The frame shared by both chart kinds: axes, ticks, gridlines, axis titles; returns scales.
function frame(svg, { width, height, xs, yTicks, xLabel, yLabel, band }) {
  const m = { left: 46, right: 10, top: 8, bottom: 34 };
  const w = width - m.left - m.right, h = height - m.top - m.bottom;
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  const y0 = yTicks[0], y1 = yTicks[yTicks.length - 1], yStep = yTicks.length > 1 ? yTicks[1] - yTicks[0] : 1;
  const slot = band ? w / Math.max(1, x1 - x0 + 1) : 0;
  const px = band ? x => m.left + (x - x0 + 0.5) * slot
                  : x => m.left + (x1 === x0 ? w / 2 : (x - x0) / (x1 - x0) * w);
  const py = y => m.top + h - (y - y0) / (y1 - y0 || 1) * h;
  const axes = svgEl("g", { class: "axes" });
  for (const t of yTicks) {
    axes.append(svgEl("line", { x1: m.left, x2: m.left + w, y1: py(t), y2: py(t), class: t === y0 ? "axis" : "grid" }));
    axes.append(svgEl("text", { x: m.left - 6, y: py(t) + 4, "text-anchor": "end", class: "tick" }, fmtTick(t, yStep)));
  }
  axes.append(svgEl("line", { x1: m.left, x2: m.left, y1: m.top, y2: m.top + h, class: "axis" }));
  for (const t of intTicks(x0, x1, Math.max(2, Math.floor(w / 48)))) {
    axes.append(svgEl("line", { x1: px(t), x2: px(t), y1: m.top + h, y2: m.top + h + 4, class: "axis" }));
    axes.append(svgEl("text", { x: px(t), y: m.top + h + 16, "text-anchor": "middle", class: "tick" }, t));
  }
  if (xLabel) axes.append(svgEl("text", { x: m.left + w / 2, y: height - 3, "text-anchor": "middle", class: "axis-title" }, xLabel));
  if (yLabel) axes.append(svgEl("text", { x: -(m.top + h / 2), y: 11, transform: "rotate(-90)", "text-anchor": "middle", class: "axis-title" }, yLabel));
  svg.append(axes);
  return { m, w, h, px, py, slot, x0, x1 };
}

function legend(series, hidden, onToggle) {
  const box = el("div", { class: "legend" });
  for (const s of series) {
    const item = el("button", { type: "button", class: "legend-item" + (hidden.has(s.key) ? " off" : ""), title: s.title || s.label, "data-key": s.key },
      el("span", { class: "swatch" + (s.dash ? " dashed" : "") }), s.label);
    item.firstChild.style.background = s.dash ? "transparent" : s.color;
    item.firstChild.style.borderColor = s.color;
    item.addEventListener("click", () => onToggle(s.key));
    box.append(item);
  }
  return box;
}

// A shared read-out: hovering anywhere over the plot shows every series at the nearest round.
function hover(svg, box, f, xs, rows, xTip) {
  const cursor = svgEl("line", { y1: f.m.top, y2: f.m.top + f.h, class: "cursor", visibility: "hidden" });
  svg.append(cursor);
  const tip = el("div", { class: "tip", hidden: "" });
  box.append(tip);
  const overlay = svgEl("rect", { x: f.m.left, y: f.m.top, width: Math.max(1, f.w), height: Math.max(1, f.h), class: "overlay" });
  svg.append(overlay);
  const show = ev => {
    const r = svg.getBoundingClientRect();
    const mx = (ev.clientX - r.left) * (svg.viewBox.baseVal.width / r.width);
    let best = xs[0];
    for (const x of xs) if (Math.abs(f.px(x) - mx) < Math.abs(f.px(best) - mx)) best = x;
    cursor.setAttribute("x1", f.px(best)); cursor.setAttribute("x2", f.px(best));
    cursor.setAttribute("visibility", "visible");
    tip.replaceChildren(el("div", { class: "tip-title" }, xTip(best)));
    for (const [label, color, value] of rows(best)) {
      const line = el("div", {}, el("span", { class: "swatch" }), `${label}: ${value}`);
      line.firstChild.style.background = color;
      tip.append(line);
    }
    tip.hidden = false;
    const left = (f.px(best) / svg.viewBox.baseVal.width) * r.width;
    tip.style.left = Math.min(Math.max(0, left + 12), Math.max(0, r.width - tip.offsetWidth)) + "px";
  };
  overlay.addEventListener("mousemove", show);
  overlay.addEventListener("mouseleave", () => { tip.hidden = true; cursor.setAttribute("visibility", "hidden"); });
}

// series: [{key, label, color, dash, points: [{x, y}]}]; opts: {height, xLabel, yLabel, yMin, yMax, xTip, empty}
function lineChart(box, series, hidden, onToggle, opts) {
  box.replaceChildren();
  const shown = series.filter(s => !hidden.has(s.key) && s.points.length);
  const all = shown.flatMap(s => s.points);
  const width = Math.max(240, box.clientWidth || 400), height = opts.height || 200;
  const svg = svgEl("svg", { viewBox: `0 0 ${width} ${height}`, width, height, role: "img", "aria-label": opts.yLabel || "" });
  box.append(svg);
  if (!all.length) {
    svg.append(svgEl("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" }, opts.empty || "no data yet"));
  } else {
    const ys = all.map(p => p.y);
    const [lo, hi] = span(Math.min(...ys, opts.yMin ?? Infinity), Math.max(...ys, opts.yMax ?? -Infinity), opts.minSpan || 0, opts.yMin);
    const xs = [...new Set(all.map(p => p.x))].sort((a, b) => a - b);
    const f = frame(svg, { width, height, xs, yTicks: niceTicks(lo, hi, height > 160 ? 5 : 3), xLabel: opts.xLabel, yLabel: opts.yLabel });
    for (const s of shown) {
      const g = svgEl("g", { "data-series": s.key, class: "series" });
      g.append(svgEl("polyline", { points: s.points.map(p => `${f.px(p.x).toFixed(1)},${f.py(p.y).toFixed(1)}`).join(" "),
        fill: "none", stroke: s.color, "stroke-width": s.width || 2, "stroke-dasharray": s.dash ? "5 4" : null }));
      for (const p of s.points) {
        const c = svgEl("circle", { cx: f.px(p.x).toFixed(1), cy: f.py(p.y).toFixed(1), r: s.width > 2 ? 3 : 2.5, fill: s.color, "data-round": p.x });
        c.append(svgEl("title", {}, `${s.label} · ${opts.xTip(p.x)}: ${fmtValue(p.y)}`));
        g.append(c);
      }
      svg.append(g);
    }
    hover(svg, box, f, xs, x => shown.map(s => [s.label, s.color, fmtValue((s.points.find(p => p.x === x) || {}).y)]), opts.xTip);
  }
  box.append(legend(series.filter(s => s.points.length), hidden, onToggle));
}

// stacks: [{key, label, color}]; rows: [{x, values: {key: number}}]
function barChart(box, stacks, rows, hidden, onToggle, opts) {
  box.replaceChildren();
  const shown = stacks.filter(s => !hidden.has(s.key));
  const width = Math.max(240, box.clientWidth || 400), height = opts.height || 160;
  const svg = svgEl("svg", { viewBox: `0 0 ${width} ${height}`, width, height, role: "img", "aria-label": opts.yLabel || "" });
  box.append(svg);
  const totals = rows.map(r => shown.reduce((a, s) => a + (r.values[s.key] || 0), 0));
  if (!rows.length) {
    svg.append(svgEl("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" }, opts.empty || "no data yet"));
  } else {
    const xs = rows.map(r => r.x);
    const f = frame(svg, { width, height, xs, yTicks: niceTicks(0, Math.max(1, ...totals), 3, true), xLabel: opts.xLabel, yLabel: opts.yLabel, band: true });
    const bw = Math.max(2, Math.min(28, f.slot * 0.7));
    const groups = new Map(shown.map(s => [s.key, svgEl("g", { "data-series": s.key, class: "series" })]));
    svg.append(...groups.values());
    rows.forEach(r => {
      let acc = 0;
      for (const s of shown) {
        const v = r.values[s.key] || 0;
        if (!v) continue;
        const rect = svgEl("rect", { x: (f.px(r.x) - bw / 2).toFixed(1), y: f.py(acc + v).toFixed(1), width: bw.toFixed(1),
          height: Math.max(0.5, f.py(acc) - f.py(acc + v)).toFixed(1), fill: s.color, "data-round": r.x });
        rect.append(svgEl("title", {}, `${s.label} · ${opts.xTip(r.x)}: ${v}`));
        groups.get(s.key).append(rect);
        acc += v;
      }
    });
    hover(svg, box, f, xs, x => {
      const r = rows.find(q => q.x === x) || { values: {} };
      return shown.filter(s => r.values[s.key]).map(s => [s.label, s.color, fmtValue(r.values[s.key])]);
    }, opts.xTip);
  }
  box.append(legend(stacks.filter(s => rows.some(r => r.values[s.key])), hidden, onToggle));
}

window.Charts = { el, lineChart, barChart, niceTicks, fmtValue };
})();
