#!/usr/bin/python3
"""One table of every goal ratio the issues name, from the JSON `make bench` wrote.

    /usr/bin/python3 benchmarks/summary.py build/bench

Reads the Google Benchmark JSON of each bench_* binary (medians when the run has repetitions)
and the JSON of the Python benchmarks (bench_loader.py, bench_images.py, bench_memory.py, ...).
Each row: the figure, its goal, and whether this run met it. Every figure is a ratio of two things measured in the same run.
"""
import json
import os
import statistics
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def runs_of(gbench, name):
    """The iterations of benchmark `name` (its run name, before suffixes like /real_time)."""
    if not gbench:
        return []
    return [b for b in gbench["benchmarks"]
            if b.get("run_type", "iteration") == "iteration"
            and (b.get("run_name", b["name"]) + "/").startswith(name + "/")]


def times(gbench, name):
    """real_time of benchmark `name`: the median of its repetitions (or its one run)."""
    runs = runs_of(gbench, name)
    return statistics.median(b["real_time"] for b in runs) if runs else None


def counter(gbench, name, key):
    vals = [b[key] for b in runs_of(gbench, name) if key in b]
    return statistics.median(vals) if vals else None


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "build/bench"
    hop = load(os.path.join(d, "bench_chain_hop.json"))
    ring = load(os.path.join(d, "bench_ring_handoff.json"))
    cons = load(os.path.join(d, "bench_consolidation.json"))
    loader = load(os.path.join(d, "bench_loader.json"))
    images = load(os.path.join(d, "bench_images.json"))
    inf = load(os.path.join(d, "bench_inference.json"))
    merge = load(os.path.join(d, "bench_merge.json"))
    procs = load(os.path.join(d, "bench_process_stage.json"))
    large = load(os.path.join(d, "bench_large_photos.json"))
    dask = load(os.path.join(d, "bench_dask.json"))
    memory = load(os.path.join(d, "bench_memory.json"))
    shared = load(os.path.join(d, "bench_shared_device.json"))
    tune = load(os.path.join(d, "bench_autotune.json"))
    grid = load(os.path.join(d, "image_pipeline_grid.json"))
    pygrid = load(os.path.join(d, "bench_images_grid.json"))
    pyauto = load(os.path.join(d, "bench_python_auto.json")) or {}

    sf = times(hop, "BM_ChainHop/splitflow")
    rows = [
        # (issue, what, value, goal text, met?)
        ("2", "ChainHop: splitflow / oneTBB parallel_pipeline (time)",
         ratio(sf, times(hop, "BM_ChainHop/tbb_parallel_pipeline")), "<= 1.0", lambda v: v <= 1.0),
        ("4", "ChainHop: telemetry on / off (time)",
         ratio(sf, times(hop, "BM_ChainHop/splitflow_notelemetry")), "<= 1.05", lambda v: v <= 1.05),
        ("4", "ChainHop: tracing on / off (time)",
         ratio(times(hop, "BM_ChainHop/splitflow_trace"), times(hop, "BM_ChainHop/splitflow_notelemetry")),
         "(stated)", None),
        ("14", "Merge: cost per item, 128 producers / 2",
         ratio(counter(merge, "BM_Merge/128", "ns_per_item"), counter(merge, "BM_Merge/2", "ns_per_item")),
         "<= 1.5", lambda v: v <= 1.5),
        ("3", "Ring hand-off 1 MiB: memcpy time / ring time",
         ratio(times(ring, "BM_RingHandoff/memcpy/1048576"), times(ring, "BM_RingHandoff/splitflow/1048576")),
         ">= 0.8", lambda v: v >= 0.8),
        ("17", "Automatic ring: rate / a 64 MiB ring's (interleaved)",
         counter(ring, "BM_RingDepth", "rate_ratio"), ">= 0.95", lambda v: v >= 0.95),
        ("17", "Automatic ring: its bytes / 64 MiB",
         counter(ring, "BM_RingDepth", "ring_bytes_ratio"), "<= 0.25", lambda v: v <= 0.25),
        ("3", "Consolidation split: devices used",
         counter(cons, "BM_Consolidation/split/2", "devices_used"), "1 (bundled: 2)", lambda v: v == 1),
        ("3", "Consolidation split: device busy / summed demand",
         counter(cons, "BM_Consolidation/split/2", "busy_vs_demand"), ">= 0.9", lambda v: v >= 0.9),
        ("3", "Consolidation split: slowest job / dedicated",
         counter(cons, "BM_Consolidation/split/2", "min_throughput_ratio"), ">= 0.9", lambda v: v >= 0.9),
        ("3", "Consolidation split: device held / busy",
         counter(cons, "BM_Consolidation/split/2", "held_over_busy"), "<= 1.1", lambda v: v <= 1.1),
        ("5", "Loader (synthetic): splitflow / best DataLoader",
         loader and loader.get("ratio_vs_best_dataloader"), ">= 2", lambda v: v >= 2),
        ("6", "Images, C++: splitflow / best DataLoader",
         images and images.get("ratio_cpp_vs_best_dataloader"), ">= 2", lambda v: v >= 2),
        ("6", "Images, Python: splitflow / best DataLoader",
         images and images.get("ratio_python_vs_best_dataloader"), ">= 2", lambda v: v >= 2),
        ("6", "Images, C++: of the decode-only ceiling",
         images and images.get("cpp_of_ceiling"), ">= 0.7", lambda v: v >= 0.7),
        ("6", "Images, Python: of the decode-only ceiling",
         images and images.get("python_of_ceiling"), ">= 0.7", lambda v: v >= 0.7),
        ("6", "Images, C++ with full decode: of the ceiling",
         images and images.get("cpp_full_decode_of_ceiling"), "(stated)", None),
        ("21", "Large photos: scaled decode / full decode",
         large and large.get("scaled_vs_full"), ">= 1.5", lambda v: v >= 1.5),
        ("21", "Large photos: scaled decode / best DataLoader",
         large and large.get("scaled_vs_best_dataloader"), ">= 2.5", lambda v: v >= 2.5),
        ("21", "Large photos: scaled decode PSNR vs full (min dB)",
         large and large.get("psnr_min"), "(stated)", None),
        ("15", "Labelled images, Python / C++ pipeline",
         images and images.get("labelled_python_vs_cpp"), ">= 0.9", lambda v: v >= 0.9),
        ("15", "Labelled images, Python / best DataLoader",
         images and images.get("labelled_python_vs_best_dataloader"), ">= 3", lambda v: v >= 3),
        ("15", "Python transform, processes=2 / DataLoader(2)",
         procs and procs.get("processes_vs_dataloader"), ">= 1.0", lambda v: v >= 1.0),
        ("15", "C++ decode + Python transform, processes=2 / DL(2)",
         procs and procs.get("mixed_vs_dataloader"), ">= 1.5", lambda v: v >= 1.5),
        ("15", "Pure-Python work: processes=2 / thread stage",
         procs and procs.get("gil_processes_vs_gil_thread"), "(stated)", None),
        ("18", "Dask remote CPU part (2 workers) / local (2 threads)",
         dask and dask.get("remote_vs_local"), ">= 0.8", lambda v: v >= 0.8),
        ("18", "Dask cost per split: worker gap + fetch (ms)",
         1e3 * dask["overhead_s_per_split"] if dask and dask.get("overhead_s_per_split")
         is not None else None, "(stated)", None),
        ("18", "Dask: CPU per image, remote / local (every process)",
         ratio((dask.get("cpu_ms_per_item") or {}).get("remote"),
               (dask.get("cpu_ms_per_item") or {}).get("local")) if dask else None,
         "(stated)", None),
        ("18", "Dask transport alone: bound on remote / local here",
         dask and dask.get("transport_bound"), "(stated)", None),
        ("16", "Peak RSS, 10x the images / 1x (same config)",
         memory and memory.get("peak_10x_vs_1x"), "0.90 to 1.10", lambda v: abs(v - 1) <= 0.10),
        ("7", "Inference at a p99 target: dynamic / no batching",
         ratio(counter(inf, "BM_InferenceAtTarget/dynamic", "rate_at_target"),
               counter(inf, "BM_InferenceAtTarget/unbatched", "rate_at_target")), ">= 3", lambda v: v >= 3),
        ("7", "Two models, one device: throughput / dedicated",
         ratio(counter(inf, "BM_TwoModels/shared", "throughput"),
               counter(inf, "BM_TwoModels/dedicated", "throughput")), ">= 0.9", lambda v: v >= 0.9),
        ("7", "Two models, one device: p99 targets met",
         counter(inf, "BM_TwoModels/shared", "targets_met"), "1 (both)", lambda v: v == 1),
        ("7", "Two models, one device: devices used",
         counter(inf, "BM_TwoModels/shared", "devices_used"), "1 (dedicated: 2)", lambda v: v == 1),
    ]
    for n in (2, 4):
        name = f"BM_SharedDevice/processes/{n}"
        rows += [
            ("19", f"{n} job processes, one device: busy / summed demand",
             counter(shared, name, "busy_vs_demand"), ">= 0.9", lambda v: v >= 0.9),
            ("19", f"{n} job processes: slowest job / dedicated",
             counter(shared, name, "min_throughput_ratio"), ">= 0.9", lambda v: v >= 0.9),
            ("19", f"{n} job processes: device held / busy",
             counter(shared, name, "held_over_busy"), "<= 1.1", lambda v: v <= 1.1),
        ]
    rows += [
        ("19", "Inference beside batch, priority: p99 / dedicated",
         counter(shared, "BM_Priority/with", "p99_ratio"), "<= 1.2", lambda v: v <= 1.2),
        ("19", "Inference beside batch, priority: batch / dedicated",
         counter(shared, "BM_Priority/with", "batch_throughput_ratio"), ">= 0.5", lambda v: v >= 0.5),
        ("19", "Inference beside batch, no priority: p99 / dedicated",
         counter(shared, "BM_Priority/without", "p99_ratio"), "(stated)", None),
    ]
    rows.append(("19", "Lease through the arbiter: cost over the pool (us)",
                 (lambda c: c / 1000 if c is not None else None)(
                     counter(shared, "BM_LeaseCost", "arbiter_cost_ns")), "<= 5", lambda v: v <= 5))
    rows += [
        ("17", "Autotune CPU chain: tuned rate / computed bound",
         counter(tune, "BM_AutotuneChain/auto", "rate_over_bound"), ">= 0.95", lambda v: v >= 0.95),
        ("17", "Autotune CPU chain: tuned / best of a grid (same run)",
         counter(tune, "BM_AutotuneChain/auto", "rate_over_best_grid"), "(stated)", None),
        ("17", "Autotune CPU chain: tuned queues' rate / queues as sized",
         counter(tune, "BM_AutotuneChain/auto", "rate_over_fixed_queues"), "(stated)", None),
        ("17", "Autotune CPU chain: seconds to 95% of the grid's best",
         (lambda v: v if v is None or v >= 0 else float("inf"))(
             counter(tune, "BM_AutotuneChain/auto", "seconds_to_95")), "<= 5", lambda v: v <= 5),
        ("17", "Autotune GPU-bound: device busy",
         counter(tune, "BM_AutotuneGpu/auto", "device_busy"), ">= 0.95", lambda v: v >= 0.95),
        ("17", "Autotune GPU-bound: device busy / best of a grid",
         counter(tune, "BM_AutotuneGpu/auto", "busy_over_best_grid"), "(stated)", None),
        ("17", "Autotune GPU-bound: prep's cores - (fewest + 1)",
         (lambda c, f: None if c is None or f is None else c - (f + 1))(
             counter(tune, "BM_AutotuneGpu/auto", "prep_cores"),
             counter(tune, "BM_AutotuneGpu/auto", "fewest_cores")), "<= 0", lambda v: v <= 0),
        ("17", "Autotune I/O read (async, 3 ms): tuned rate / bound",
         counter(tune, "BM_AutotuneIo/auto", "rate_over_bound"), ">= 0.95", lambda v: v >= 0.95),
        ("17", "Autotune I/O read: seconds to 95% of the bound",
         (lambda v: v if v is None or v >= 0 else float("inf"))(
             counter(tune, "BM_AutotuneIo/auto", "seconds_to_95")), "<= 5", lambda v: v <= 5),
        ("17", "Autotune I/O read (blocking stage, 3 ms sleep): rate / bound with its CPU",
         counter(tune, "BM_AutotuneIo/blocking", "rate_over_cpu_bound"), ">= 0.95", lambda v: v >= 0.95),
        ("17", "Autotune I/O read (blocking): rate / parse-only bound",
         counter(tune, "BM_AutotuneIo/blocking", "rate_over_bound"), "(stated)", None),
        ("17", "Autotune I/O read (plain stage, placed by the tuner), 2nd epoch: rate / bound with its CPU",
         counter(tune, "BM_AutotuneIo/placed", "rate_over_cpu_bound"), ">= 0.95", lambda v: v >= 0.95),
        ("17", "Autotune I/O read (placed): 2nd epoch's / 1st epoch's (on the arena) rate",
         (lambda a, b: None if a is None or not b else a / b)(
             counter(tune, "BM_AutotuneIo/placed", "tuned_rate"),
             counter(tune, "BM_AutotuneIo/placed", "threads_only_rate")), "(stated)", None),
        ("17", "Autotune two graphs on one runtime: summed / bound",
         counter(tune, "BM_AutotuneTwoGraphs/auto", "rate_over_bound"), ">= 0.95", lambda v: v >= 0.95),
        ("17", "Autotune two graphs: slower / faster graph",
         counter(tune, "BM_AutotuneTwoGraphs/auto", "slower_over_faster"), "(stated)", None),
        ("17", "JPEG pipeline (C++), concurrency auto / grid's best",
         grid and grid.get("auto_of_grid_best"), ">= 0.97", lambda v: v >= 0.97),
        ("17", "JPEG pipeline (Python), concurrency auto / grid's best",
         pygrid and pygrid.get("auto_of_grid_best"), ">= 0.97", lambda v: v >= 0.97),
        ("17", "Python body holding the GIL, auto / best of (1, 2)",
         pyauto.get("gil", {}).get("rate_over_best_grid"), "(stated)", None),
        ("17", "Python body holding the GIL: auto's threads - fewest",
         (lambda g: None if not g else g["auto_threads"] - g["fewest_threads"])(pyauto.get("gil")),
         "<= 0", lambda v: v <= 0),
        ("17", "Python numpy body (GIL released), auto / best of (1, 2)",
         pyauto.get("numpy", {}).get("rate_over_best_grid"), ">= 0.95", lambda v: v >= 0.95),
        ("17", "GIL shared with a user-set stage: rate / model bound",
         pyauto.get("shared", {}).get("rate_over_model_bound"), "(stated)", None),
        ("17", "  ... / one over the tuned stage's GIL holds",
         pyauto.get("shared", {}).get("rate_over_whole_gil_bound"), "(stated)", None),
    ]
    print(f"\n{'issue':5s} {'figure':52s} {'value':>8s} {'goal':>15s}  met")
    missed = 0
    for issue, what, value, goal, ok in rows:
        if value is None:
            print(f"{issue:5s} {what:52s} {'-':>8s} {goal:>15s}  (not run)")
            continue
        verdict = "" if ok is None else ("yes" if ok(value) else "NO")
        missed += verdict == "NO"
        print(f"{issue:5s} {what:52s} {value:8.2f} {goal:>15s}  {verdict}")
    print(f"\n{missed} goal(s) missed in this run. Noisy machines: see docs/benchmarks.md for "
          "repeated runs.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
