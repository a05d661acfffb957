// Time plots drawn on a canvas by hand (no library: the page works offline).
//
//   drawPlot(canvas, {windowS: 300, now: t, series: [{points: [[t, y], ...], color, dots}]})
//
// x is time over the last windowS seconds (labelled as minutes ago), y
// starts at 0 and its top is rounded up to a readable number.
"use strict";

function niceCeiling(value) {
  if (!(value > 0)) return 1;
  const power = Math.pow(10, Math.floor(Math.log10(value)));
  for (const step of [1, 2, 2.5, 5, 10]) {
    if (value <= step * power) return step * power;
  }
  return 10 * power;
}

function formatTick(value) {
  if (value === 0) return "0";
  if (value >= 100) return value.toFixed(0);
  if (value >= 1) return value.toFixed(value % 1 ? 1 : 0);
  return value.toPrecision(2);
}

function sizeCanvas(canvas) {
  // draw at the device's pixel density, sized by the stylesheet
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.width;
  const height = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return {ctx, width, height};
}

function drawPlot(canvas, {windowS, now, series}) {
  const {ctx, width, height} = sizeCanvas(canvas);
  const pad = {left: 36, right: 6, top: 6, bottom: 18};
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  let top = 0;
  for (const s of series) for (const [, y] of s.points) top = Math.max(top, y);
  top = niceCeiling(top);
  const x = (t) => pad.left + plotW * (1 - (now - t) / windowS);
  const y = (v) => pad.top + plotH * (1 - v / top);

  ctx.clearRect(0, 0, width, height);
  ctx.font = "10px system-ui, sans-serif";
  ctx.strokeStyle = "#dde1e8";
  ctx.fillStyle = "#6b7385";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {  // horizontal grid with y labels
    const v = (top * i) / 4;
    ctx.beginPath();
    ctx.moveTo(pad.left, Math.round(y(v)) + 0.5);
    ctx.lineTo(width - pad.right, Math.round(y(v)) + 0.5);
    ctx.stroke();
    ctx.fillText(formatTick(v), pad.left - 4, y(v));
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  const minutes = windowS / 60;
  for (let m = 0; m <= minutes; m++) {  // x labels: minutes ago
    const t = now - m * 60;
    ctx.fillText(m === 0 ? "now" : `-${m}m`, Math.min(Math.max(x(t), pad.left + 8), width - pad.right - 10),
                 height - pad.bottom + 4);
  }
  for (const s of series) {
    const points = s.points.filter(([t]) => t >= now - windowS);
    ctx.strokeStyle = ctx.fillStyle = s.color;
    if (s.dots) {
      for (const [t, v] of points) {
        ctx.beginPath();
        ctx.arc(x(t), y(v), 2.5, 0, 2 * Math.PI);
        ctx.fill();
      }
    } else if (points.length) {
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      points.forEach(([t, v], i) => (i ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
      ctx.stroke();
    }
  }
}

window.drawPlot = drawPlot;
