#!/usr/bin/python3
"""Parses telemetry_dump's outputs and checks them: the JSON summary's figures are consistent,
the Chrome trace has its tracks and its events agree with the stats, the Prometheus text parses.
usage: check_telemetry.py DIR"""
import json
import re
import sys
from collections import Counter

d = sys.argv[1]
run = json.load(open(f"{d}/run.json"))
trace = json.load(open(f"{d}/trace.json"))
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


# Summary: stable keys, partition of wall time, held >= busy, device busy <= 1.
for key in ["graph", "status", "wall_ns", "items_delivered", "throughput", "stages", "gpu",
            "device", "diagnosis"]:
    check(key in run, f"run.json lacks '{key}'")
wall = run["wall_ns"]
stages = {s["name"]: s for s in run["stages"]}
for s in run["stages"]:
    total = s["busy_ns"] + s["starved_ns"] + s["blocked_ns"]
    check(abs(total - wall) <= 1e-3 * wall + 1000, f"{s['name']}: states sum to {total}, wall {wall}")
    check(s["latency_ns"]["p50"] <= s["latency_ns"]["p99"] <= max(s["latency_ns"]["max"], 1),
          f"{s['name']}: latency percentiles out of order")
check(run["gpu"]["held_ns"] >= run["gpu"]["busy_ns"], "held < busy")
check(0 <= run["device"]["busy_fraction"] <= 1, "device busy fraction outside [0, 1]")
check(run["items_delivered"] == 40, f"items_delivered {run['items_delivered']}")
check(stages["load"]["consumers"] == ["model"], "edges missing from the summary")
check("ring" in stages["model"], "the GPU stage's ring figures are missing")

# Trace: metadata, tracks, and counts equal to the stats (no sampling at this size).
events = trace["traceEvents"]
check(trace["metadata"]["sample_every"] == 1, "the trace sampled a small run")
names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
check(names == set(stages), f"stage tracks {names}")
processes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
check({"stream leases", "device work"} <= processes, f"processes {processes}")
order = [s["name"] for s in run["stages"]]
per_stage = Counter(order[e["tid"]] for e in events if e["ph"] == "X" and e["pid"] == 1)
for name, s in stages.items():
    check(per_stage[name] == s["invocations"],
          f"{name}: {per_stage[name]} trace events, {s['invocations']} invocations")
items = Counter()
for e in events:
    if e["ph"] == "X" and e["pid"] == 1:
        items[order[e["tid"]]] += e["args"]["items"]
check(items["step"] == stages["step"]["items_in"], "sink items in the trace != stats")
leases = [e for e in events if e["ph"] == "X" and e["pid"] == 2]
check(len(leases) == run["gpu"]["bursts"], f"{len(leases)} lease events, {run['gpu']['bursts']} bursts")
work = Counter(e["name"] for e in events if e["ph"] == "X" and e["pid"] == 3)
check(work["kernel"] == run["gpu"]["bursts"], f"kernels {work}")
check(work["copy H2D"] == run["gpu"]["bursts"] and work["copy D2H"] == run["gpu"]["bursts"], f"copies {work}")
counters = {e["name"] for e in events if e["ph"] == "C"}
check("queue model" in counters and "ring model" in counters, f"counters {counters}")
held = sum(e["dur"] for e in leases) * 1000
check(held >= run["gpu"]["busy_ns"] * 0.99, "lease intervals cover less than the busy time")
for e in events:
    if e["ph"] == "X":
        check(e["dur"] >= 0 and e["ts"] >= -1, f"bad interval {e}")

# Prometheus: every sample is `name{labels} value` under a TYPE line of its family.
types = {}
sample = re.compile(r'^([a-z_]+)\{((?:[a-z_]+="(?:[^"\\]|\\.)*",?)*)\} (-?[0-9.e+-]+)$')
for line in open(f"{d}/metrics.prom"):
    line = line.rstrip("\n")
    if line.startswith("# TYPE"):
        _, _, name, kind = line.split(" ")
        types[name] = kind
    elif line and not line.startswith("#"):
        m = sample.match(line)
        check(m is not None, f"unparsable sample: {line}")
        if m:
            family = re.sub(r"_(count|sum)$", "", m.group(1))
            check(family in types or m.group(1) in types, f"sample before its TYPE: {line}")

if failures:
    print("check_telemetry: FAILED")
    for f in failures:
        print("  -", f)
    sys.exit(1)
print(f"check_telemetry: {len(events)} trace events, {len(stages)} stages: all consistent")
