#!/usr/bin/python3
"""Turns splitflow runs into a PNG: the device held and busy over time for each graph (from
their Chrome traces), and every stage's busy / starved / blocked time (from their JSON
summaries). Run with Debian's python3 (python3-matplotlib).

usage: plot_run.py --out run.png GRAPH.json [GRAPH.json ...]
       each GRAPH.json is a summary written by splitflow::to_json(); a GRAPH.trace.json beside
       it (Run::trace_json()) adds the timeline.
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def intervals(trace, pid):
    return [(e["ts"] / 1000.0, (e["ts"] + e["dur"]) / 1000.0)
            for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("pid") == pid]


def coverage(spans, edges):
    """Fraction of each bin [edges[i], edges[i+1]) covered by the union of the spans."""
    spans = sorted(spans)
    merged = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out = []
    for lo, hi in zip(edges, edges[1:]):
        covered = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in merged)
        out.append(covered / (hi - lo))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--bins", type=int, default=60)
    ap.add_argument("summaries", nargs="+")
    args = ap.parse_args()

    runs = []
    for path in args.summaries:
        summary = json.load(open(path))
        trace_path = path[:-len(".json")] + ".trace.json"
        trace = json.load(open(trace_path)) if os.path.exists(trace_path) else None
        runs.append((summary, trace))

    fig, (timeline, bars) = plt.subplots(2, 1, figsize=(11, 8), gridspec_kw={"height_ratios": [1, 1.2]})

    # Device held (a stream leased) and busy (its kernels and copies) over time, per graph.
    traced = [(s, t) for s, t in runs if t]
    if traced:
        end = max(max((b for _, b in intervals(t, 2) + intervals(t, 3)), default=1.0) for _, t in traced)
        edges = [end * i / args.bins for i in range(args.bins + 1)]
        mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
        for summary, trace in traced:
            held = coverage(intervals(trace, 2), edges)
            busy = coverage(intervals(trace, 3), edges)
            line, = timeline.plot(mids, held, linestyle="--", label=f"{summary['graph']} held")
            timeline.plot(mids, busy, color=line.get_color(), label=f"{summary['graph']} busy")
        timeline.set_xlabel("time since the run started (ms)")
        timeline.set_ylabel("fraction of each bin")
        timeline.set_ylim(0, 1.05)
        timeline.legend(loc="upper right", fontsize="small", ncol=2)
        timeline.set_title("GPU held (a stream leased) vs busy (kernels and copies), per graph")
    else:
        timeline.text(0.5, 0.5, "no trace (GraphOptions::trace)", ha="center")

    # Stage states as shares of the run's wall time.
    labels, busy, starved, blocked = [], [], [], []
    for summary, _ in runs:
        wall = max(summary["wall_ns"], 1)
        for s in summary["stages"]:
            labels.append(f"{summary['graph']}/{s['name']}")
            busy.append(s["busy_ns"] / wall)
            starved.append(s["starved_ns"] / wall)
            blocked.append(s["blocked_ns"] / wall)
    y = range(len(labels))
    bars.barh(y, busy, label="busy", color="#2e7d32")
    bars.barh(y, starved, left=busy, label="starved", color="#bdbdbd")
    bars.barh(y, blocked, left=[a + b for a, b in zip(busy, starved)], label="blocked", color="#c62828")
    bars.set_yticks(list(y))
    bars.set_yticklabels(labels, fontsize="small")
    bars.invert_yaxis()
    bars.set_xlim(0, 1)
    bars.set_xlabel("share of the run's wall time")
    bars.legend(loc="lower right", fontsize="small")
    bars.set_title("stages: busy / starved (no input) / blocked (consumer full)")

    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"plot_run: wrote {args.out}")


if __name__ == "__main__":
    main()
