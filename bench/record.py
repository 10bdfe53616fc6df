#!/usr/bin/env python3
"""bench/compare.sh's bookkeeping: one JSON line per measurement, then the table, the
ratios against the targets of the performance issue, the SVG and the record blocks.

    record.py add NAME CASE ROUND < (oha --output-format json | inferd-bench's JSON line)
    record.py memory NAME CASE ROUND PID...   # RSS and PSS of those processes (CASE: memory, memory-short)
    record.py best RESULTS NAME ROUND    # best closed-loop req/s of NAME in ROUND
    record.py guard NAME ROUND < (inferd status --json)   # what the int8 guard measured
    record.py report RESULTS [--record 1] [--seconds S] [--rounds N]

Figures are medians over the rounds; the ceiling is the mean of its start and end
measurements (ROUND "start" and "end").
"""

import argparse
import datetime
import statistics
import json
import math
import os
import platform
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SVG = os.path.join(ROOT, "docs", "benchmarks-latest.svg")
LABELS = {"inferd": "inferd (default plan)", "inferd-int8": "inferd, `--precision int8` (default plan)",
          "python": "gunicorn + uvicorn + FastAPI + onnxruntime"}


def add(name, case, round_):
    raw = json.load(sys.stdin)
    if "metrics" in raw:  # oha
        m = raw["metrics"]
        codes = raw.get("statusCodeDistribution", {})
        # oha cuts the requests still in flight when its time is up: not the server's errors.
        failed = {e: n for e, n in raw.get("errorDistribution", {}).items() if "aborted due to deadline" not in e}
        errors = sum(failed.values()) + sum(n for c, n in codes.items() if c != "200")
        row = {
            "throughput": m["requests_per_sec"],
            "p50_ms": m["latency_ms"]["p50"],
            "p95_ms": m["latency_ms"]["p95"],
            "p99_ms": m["latency_ms"]["p99"],
            "requests": sum(codes.values()),
            "errors": errors,
        }
    else:  # inferd-bench
        row = {k: raw[k] for k in ("throughput", "p50_ms", "p95_ms", "p99_ms", "requests", "errors")}
    print(json.dumps({"name": name, "case": case, "round": round_, **row}))


def memory(name, case, round_, pids):
    """RSS and PSS (kB fields of /proc/PID/smaps_rollup) summed over `pids`, in bytes."""
    rss = pss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                fields = dict(l.split(":", 1) for l in f if ":" in l and not l.startswith(" "))
        except OSError:
            continue  # exited meanwhile
        kb = lambda k: int(fields.get(k, "0 kB").split()[0]) * 1024
        rss, pss = rss + kb("Rss"), pss + kb("Pss")
    print(json.dumps({"name": name, "case": case, "round": round_, "rss_bytes": rss, "pss_bytes": pss,
                      "processes": len(pids)}))


def guard(name, round_):
    """The default model's precision as the server reports it (the guard's figures for int8)."""
    status = json.load(sys.stdin)
    models = status["workers"][0]["models"]
    served = models[0].get("precision_served", {})
    # The CPU's int8 class (by CPUID) and the weights the guard chose for it.
    kernels = f"{served.get('cpu', '?')}, {served.get('weight_type', '?')} weights of {served.get('weight_bits', '?')} bits"
    print(json.dumps({"name": name, "case": "guard", "round": round_, "text": models[0]["precision"],
                      "kernels": kernels}))


def load(path):
    """{(name, case): [row per round]}"""
    rows = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                r = json.loads(line)
                rows.setdefault((r["name"], r["case"]), []).append(r)
    return rows


def best(path, name, round_):
    rows = load(path)
    print(max(r["throughput"] for (n, c), rs in rows.items() for r in rs
              if n == name and c.startswith("c=") and r["round"] == round_))


def machine():
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores, Linux {platform.release()}"


def model_file():
    """Which default model the sitting ran: its file and the file's sha256 (scripts/setup.sh
    builds it from the published all-MiniLM-L6-v2 weights; the digest tells two builds apart)."""
    import hashlib
    path = os.path.join(ROOT, "models", "minilm", "model.onnx")
    try:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return "models/minilm/model.onnx (missing)"
    return f"models/minilm/model.onnx, sha256 {digest[:16]}"


def svg(rows, ceiling_batch1, ceiling_best):
    """Throughput against p99 for each contender, one point per concurrency (medians)."""
    rows = {k: {"throughput": statistics.median(r["throughput"] for r in rs),
                "p99_ms": statistics.median(r["p99_ms"] for r in rs)}
            for k, rs in rows.items() if k[0] in LABELS and k[1].startswith("c=")}
    w, h, left, bottom, top, right = 640, 400, 60, 50, 20, 20
    series = {}
    for (name, case), r in rows.items():
        if case.startswith("c="):
            series.setdefault(name, []).append((int(case[2:]), r["throughput"], r["p99_ms"]))
    xmax = max([ceiling_best] + [t for s in series.values() for _, t, _ in s]) * 1.1
    ymax = max(p for s in series.values() for _, _, p in s) * 1.15
    x = lambda v: left + (w - left - right) * v / xmax
    y = lambda v: h - bottom - (h - bottom - top) * v / ymax
    colours = {"inferd": "#1f77b4", "inferd-int8": "#2ca02c", "python": "#d62728"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>',
           f'<text x="{(w + left) / 2}" y="{h - 12}" text-anchor="middle">throughput, requests/s (closed loop, 1-32 connections)</text>',
           f'<text x="16" y="{(h - bottom + top) / 2}" transform="rotate(-90 16 {(h - bottom + top) / 2})" text-anchor="middle">p99 latency, ms</text>']
    for i in range(6):
        xv, yv = xmax * i / 5, ymax * i / 5
        out.append(f'<text x="{x(xv):.0f}" y="{h - bottom + 16}" text-anchor="middle">{xv:.0f}</text>')
        out.append(f'<text x="{left - 6}" y="{y(yv) + 4:.0f}" text-anchor="end">{yv:.0f}</text>')
    for value, label in ((ceiling_batch1, "raw ORT, batch 1"), (ceiling_best, "raw ORT, best batch")):
        out.append(f'<line x1="{x(value):.1f}" y1="{top}" x2="{x(value):.1f}" y2="{h - bottom}" stroke="grey" stroke-dasharray="4 3"/>')
        out.append(f'<text x="{x(value) - 4:.1f}" y="{top + 12}" text-anchor="end" fill="grey">{label}</text>')
    for n, (name, points) in enumerate(sorted(series.items())):
        points.sort()
        colour = colours.get(name, "black")
        path = " ".join(f"{x(t):.1f},{y(p):.1f}" for _, t, p in points)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for c, t, p in points:
            out.append(f'<circle cx="{x(t):.1f}" cy="{y(p):.1f}" r="3" fill="{colour}"/>')
            out.append(f'<text x="{x(t) + 5:.1f}" y="{y(p) - 5:.1f}" fill="{colour}">c={c}</text>')
        out.append(f'<text x="{left + 10}" y="{top + 30 + 16 * n}" fill="{colour}">{LABELS.get(name, name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def report(path, record, seconds, rounds):
    rows = load(path)

    def get(name, case, key):
        """The median over the rounds (the mean of start and end for the ceiling)."""
        values = [r[key] for r in rows.get((name, case), []) if r.get(key) is not None]
        if not values:
            return float("nan")
        return statistics.mean(values) if name.startswith("ort") else statistics.median(values)

    def ceilings(name):
        """The single-thread call (p50 ms) and sequences/s by batch case of a raw ORT series."""
        return get(name, "single", "p50_ms"), {c: get(name, c, "throughput") for (n, c) in rows
                                               if n == name and c.startswith("batch=")}

    by_batch = lambda b: ", ".join(f"{c.split('=')[1]}: {t:.0f}" for c, t in sorted(b.items(), key=lambda kv: int(kv[0].split('=')[1])))
    single, batched = ceilings("ort")
    batch1 = get("ort", "batch=1", "throughput")
    ceiling = max(batched.values())
    # The two references the targets use, start against end: the single-thread call time and
    # the best batched throughput. Past 10% apart the machine was busy: the sitting is void.
    ends = lambda case, key: [r[key] for r in rows.get(("ort", case), [])]
    bests = [max(t) for t in zip(*(ends(c, "throughput") for c in batched))]
    drift = {
        "single-thread call": ends("single", "p50_ms"),
        "best batch": bests,
    }
    drift = {k: abs(v[0] - v[-1]) / max(v[0], 1e-9) for k, v in drift.items() if len(v) == 2}
    void = max(drift.values(), default=0) > 0.10
    names = [n for n in ("inferd", "inferd-int8", "python") if any(k[0] == n for k in rows)]

    lines = [
        f"Machine: {machine()}; {datetime.date.today()}; medians of {rounds} rounds of {seconds} s per point; "
        "load generator oha (one thread) on the same cores; "
        f"model {model_file()} (all-MiniLM-L6-v2 from its published fp32 weights, fused).",
        "",
        f"Raw ONNX Runtime (no server; mean of the start and end of the sitting, "
        + ", ".join(f"{k} {100 * v:.0f}% apart" for k, v in drift.items())
        + f"): fp32: single-thread call {single:.2f} ms (p50); one session per core: "
        + by_batch(batched) + " sequences/s by batch size.",
    ]
    int8_ceiling = ceilings("ort-int8") if any(k[0] == "ort-int8" for k in rows) else None
    if int8_ceiling:
        single8, batched8 = int8_ceiling
        lines[-1] += f" inferd's int8 rewrite of the same file: {single8:.2f} ms; {by_batch(batched8)} sequences/s."
        wide8 = get("ort-int8", "wide", "p50_ms") if ("ort-int8", "wide") in rows else None
        if wide8:
            lines[-1] += f" One int8 call on two threads (as a wide session): {wide8:.2f} ms."
    lines += [
        "",
        "| | c=1 req/s (p50 ms) | c=4 | c=16 (p99 ms) | c=32 (p99 ms) | open loop at 50% of best: req/s (p99 ms) "
        "| short texts' p99, alone / 1 in 8 long (c=16) | errors | RSS (PSS), all processes: after the 17-token load / after long inputs too |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    kernels = sorted({r.get("kernels", "?") for r in rows.get(("inferd-int8", "guard"), [])})
    for n in names:
        label = LABELS[n] + (f" ({'; '.join(kernels)})" if n == "inferd-int8" and kernels else "")
        cell = lambda c, lat: f"{get(n, c, 'throughput'):.0f} ({get(n, c, lat):.1f})"
        errors = sum(r.get("errors", 0) for (m, _), rs in rows.items() if m == n for r in rs)
        mib = lambda case: f"{get(n, case, 'rss_bytes') / 2**20:.0f} ({get(n, case, 'pss_bytes') / 2**20:.0f})"
        lines.append(
            f"| {label} | {cell('c=1', 'p50_ms')} | {get(n, 'c=4', 'throughput'):.0f} | {cell('c=16', 'p99_ms')} "
            f"| {cell('c=32', 'p99_ms')} | {cell('open', 'p99_ms')} "
            f"| {get(n, 'short-only', 'p99_ms'):.1f} / {get(n, 'short-in-mix', 'p99_ms'):.1f} ms "
            f"| {errors} | {mib('memory-short')} / {mib('memory')} MiB |"
        )
    if any(k[0] == "inferd-grpc" for k in rows):
        cell = lambda n, c, lat: f"{get(n, c, 'throughput'):.0f} req/s ({lat} {get(n, c, lat + '_ms'):.1f} ms)"
        errors = sum(r.get("errors", 0) for (m, _), rs in rows.items() if m in ("inferd-http", "inferd-grpc") for r in rs)
        lines += [
            "",
            "inferd over HTTP and over gRPC, one load generator for both (inferd-bench, one connection per "
            f"client; ModelInfer with the text as a raw BYTES tensor): c=1 HTTP {cell('inferd-http', 'c=1', 'p50')}, "
            f"gRPC {cell('inferd-grpc', 'c=1', 'p50')}; c=16 HTTP {cell('inferd-http', 'c=16', 'p99')}, "
            f"gRPC {cell('inferd-grpc', 'c=16', 'p99')}; {errors} errors.",
        ]
    guards = sorted({r["text"] for r in rows.get(("inferd-int8", "guard"), [])})
    if guards:
        lines += ["", "The int8 guard, as `inferd status` reports it: " + "; ".join(f"`{g}`" for g in guards) + "."]
    best_of = lambda n: max(get(n, c, "throughput") for c in ("c=1", "c=4", "c=16", "c=32"))

    def tails(n, prefix):
        """The tail targets (issue 21 part 6) for contender n."""
        little = 32 / get(n, "c=32", "throughput") * 1000
        r = get(n, "c=32", "p99_ms") / little
        out = [(f"{prefix}c=32 p99 / Little's-law mean (32 / req/s)", r, "<= 1.5", r <= 1.5)]
        r = get(n, "open", "p99_ms") / get(n, "c=1", "p50_ms")
        out.append((f"{prefix}open loop at 50%: p99 / unloaded p50", r, "<= 3", r <= 3))
        return out

    checks = []
    if "inferd" in names:
        inferd_best = best_of("inferd")
        p50 = get("inferd", "c=1", "p50_ms")
        checks += [
            ("best throughput / best batched ceiling", inferd_best / ceiling, ">= 0.90", inferd_best / ceiling >= 0.90),
            ("best throughput / batch-1 ceiling", inferd_best / batch1, "", None),
            ("c=1 p50 / single-thread call", p50 / single, "<= 0.65", p50 / single <= 0.65),
        ]
        checks += tails("inferd", "")
        r = get("inferd", "short-in-mix", "p99_ms") / get("inferd", "short-only", "p99_ms")
        checks.append(("short texts' p99 with 1 in 8 of 256 tokens / alone (c=16)", r, "<= 2", r <= 2))
        if "python" in names:
            for c in ("c=1", "c=4", "c=16", "c=32"):
                r = get("inferd", c, "throughput") / get("python", c, "throughput")
                checks.append((f"inferd / Python req/s at {c}", r, ">= 1", r >= 1))
    if "inferd-int8" in names and int8_ceiling:
        best8 = best_of("inferd-int8")
        r = best8 / get("ort-int8", "batch=32", "throughput")
        checks.append(("int8: best throughput / int8 batch-32 ceiling", r, ">= 0.90", r >= 0.90))
        checks.append(("int8: best throughput / fp32 best batched ceiling", best8 / ceiling, "~2", None))
        r = get("inferd-int8", "c=1", "p50_ms") / single8
        checks.append(("int8: c=1 p50 / int8 single-thread call", r, "<= 0.60", r <= 0.60))
        if wide8:
            checks.append(("int8: raw call on two threads (no server) / int8 single-thread call", wide8 / single8, "", None))
        pss = get("inferd-int8", "memory-short", "pss_bytes") / 2**20
        checks.append(("int8: PSS of the pool after the 17-token load, MiB", pss, "<= 100", pss <= 100))
        idle = get("inferd-int8", "memory-idle", "pss_bytes") / 2**20
        if not math.isnan(idle):
            checks.append(("int8: the same, 2 s later (idle workers hand back their batches' buffers), MiB", idle, "", None))
        checks += tails("inferd-int8", "int8: ")
    if checks:
        lines += ["", "| ratio | value | target | |", "|---|---:|---|---|"]
        for label, value, target, ok in checks:
            mark = "" if ok is None else ("met" if ok else "**missed**")
            lines.append(f"| {label} | {value:.2f} | {target} | {mark} |")
    if void:
        lines += ["", "**Void sitting**: the ceiling moved by more than 10% between start and end; the machine was busy."]
    table = "\n".join(lines)
    print()
    print(table)
    if record and void:
        print("void sitting: the record is left as it was")
    elif record:
        with open(SVG, "w") as f:
            f.write(svg(rows, batch1, ceiling))
        block = table + "\n\n![throughput against p99](benchmarks-latest.svg)\n"
        for doc, text in ((os.path.join(ROOT, "docs", "benchmarks.md"), block),
                          (os.path.join(ROOT, "README.md"), block.replace("](benchmarks-latest.svg)", "](docs/benchmarks-latest.svg)"))):
            with open(doc) as f:
                content = f.read()
            new, n = re.subn(r"(<!-- record:begin -->\n).*?(<!-- record:end -->)", lambda m: m.group(1) + text + m.group(2),
                             content, flags=re.S)
            if n:
                with open(doc, "w") as f:
                    f.write(new)
                print(f"updated {os.path.relpath(doc, ROOT)}")
        print(f"wrote {os.path.relpath(SVG, ROOT)}")


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    # Each command: its function and positional arguments ("pids*": any number).
    commands = {
        "add": (add, ["name", "case", "round"]),
        "memory": (memory, ["name", "case", "round", "pids*"]),
        "best": (best, ["results", "name", "round"]),
        "guard": (guard, ["name", "round"]),
    }
    for command, (_, names) in commands.items():
        p = sub.add_parser(command)
        for name in names:
            if name.endswith("*"):
                p.add_argument(name[:-1], nargs="*")
            else:
                p.add_argument(name)
    r = sub.add_parser("report")
    r.add_argument("results")
    r.add_argument("--record", type=int, default=1)
    r.add_argument("--seconds", default="8")
    r.add_argument("--rounds", default="3")
    args = parser.parse_args()
    if args.command == "report":
        report(args.results, args.record, args.seconds, args.rounds)
    else:
        function, names = commands[args.command]
        function(*(getattr(args, name.rstrip("*")) for name in names))


if __name__ == "__main__":
    main()
