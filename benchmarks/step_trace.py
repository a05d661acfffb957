"""Where an engine's time went, from a step trace (PAGED_STEP_TRACE=PATH,
core/engine/step_trace.py): steps by kind (decode-only, mixed, prompt-only), their
total and median time, rows per step, the time between steps, and a
per-row cost fit (t = a + c_d * decode_rows + c_p * prompt_rows, least
squares over the steps).

    PAGED_STEP_TRACE=/tmp/steps.jsonl paged serve ...     # run the load, stop the server
    python benchmarks/step_trace.py /tmp/steps.jsonl [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from timing import emit_json


def load(path: str) -> list[dict]:
    steps = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    steps.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not a step trace line ({exc.msg})") from None
    if not steps:
        raise ValueError(f"{path}: no steps (was PAGED_STEP_TRACE set while the engine ran?)")
    return steps


def kind_summary(steps: list[dict]) -> dict:
    times = [s["step_s"] for s in steps]
    return {"steps": len(steps), "total_s": sum(times), "median_ms": 1e3 * statistics.median(times),
            "p99_ms": 1e3 * sorted(times)[min(len(times) - 1, int(0.99 * len(times)))],
            "decode_rows_mean": statistics.mean(s["decode_rows"] for s in steps),
            "prompt_rows": sum(s["prompt_rows"] for s in steps)}


def fit(steps: list[dict]) -> dict:
    """Least squares t = a + c_d * n_d + c_p * n_p (seconds), by the normal equations."""
    rows = [(1.0, float(s["decode_rows"]), float(s["prompt_rows"]), s["forward_s"]) for s in steps]
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    atb = [sum(r[i] * r[3] for r in rows) for i in range(3)]
    try:
        a, c_d, c_p = _solve3(ata, atb)
    except ZeroDivisionError:  # e.g. no prompt rows at all: the fit is undetermined
        return {}
    return {"a_ms": 1e3 * a, "c_decode_ms": 1e3 * c_d, "c_prompt_ms": 1e3 * c_p}


def _solve3(m: list[list[float]], b: list[float]) -> list[float]:
    m = [row[:] + [v] for row, v in zip(m, b)]
    for i in range(3):
        p = max(range(i, 3), key=lambda r: abs(m[r][i]))
        if abs(m[p][i]) < 1e-12:
            raise ZeroDivisionError
        m[i], m[p] = m[p], m[i]
        for r in range(3):
            if r != i:
                f = m[r][i] / m[i][i]
                m[r] = [x - f * y for x, y in zip(m[r], m[i])]
    return [m[i][3] / m[i][i] for i in range(3)]


def summarize(steps: list[dict]) -> dict:
    span = steps[-1]["start"] + steps[-1]["step_s"] - steps[0]["start"]
    gaps = [b["start"] - (a["start"] + a["step_s"]) for a, b in zip(steps, steps[1:])]
    kinds = {"decode-only": [s for s in steps if s["prompt_rows"] == 0],
             "mixed": [s for s in steps if s["prompt_rows"] and s["decode_rows"]],
             "prompt-only": [s for s in steps if not s["decode_rows"]]}
    return {"steps": len(steps), "span_s": span, "in_steps_s": sum(s["step_s"] for s in steps),
            "forward_s": sum(s["forward_s"] for s in steps), "gaps_s": sum(gaps),
            "kinds": {k: kind_summary(v) for k, v in kinds.items() if v}, "fit": fit(steps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a PAGED_STEP_TRACE file")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    try:
        report = summarize(load(args.trace))
    except (OSError, ValueError) as exc:
        print(f"step_trace.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"{report['steps']} steps over {report['span_s']:.2f} s: {report['in_steps_s']:.2f} s in steps "
          f"({report['forward_s']:.2f} s forward + sampling), {report['gaps_s']:.2f} s between them")
    print(f"{'kind':12s} {'steps':>6s} {'total s':>8s} {'median ms':>10s} {'p99 ms':>8s} {'decode rows':>12s} {'prompt rows':>12s}")
    for kind, k in report["kinds"].items():
        print(f"{kind:12s} {k['steps']:6d} {k['total_s']:8.2f} {k['median_ms']:10.1f} {k['p99_ms']:8.1f} "
              f"{k['decode_rows_mean']:12.1f} {k['prompt_rows']:12d}")
    f = report["fit"]
    if f:
        print(f"fit: forward = {f['a_ms']:.1f} ms + {f['c_decode_ms']:.2f} ms x decode rows "
              f"+ {f['c_prompt_ms']:.3f} ms x prompt rows")
    emit_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
