#!/usr/bin/python3
"""Checks that `cmake --install` put a working splitflow Python package under the prefix
(run with PYTHONPATH=<prefix>/lib/python3.11/site-packages)."""
import sys

import numpy as np

import splitflow as sf

prefix = sys.argv[1]
assert sf.__file__.startswith(prefix), f"imported {sf.__file__}, not the installed package"
rt = sf.Runtime(threads=2, backend="host")
g = sf.Graph(rt, "installed")
out = g.pull_sink("out")
g.indices("idx", list(range(10))) >> g.stage("fill", sf.ops.fill([3]), concurrency=0) >> out
got = [np.asarray(t) for t in g.iterate(out)]
assert [int(a[0]) for a in got] == list(range(10)), got
import splitflow.torch  # noqa: E402,F401  (the torch integration imports too)
print("installed Python package OK:", sf.__file__)
