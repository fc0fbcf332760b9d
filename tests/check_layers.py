#!/usr/bin/python3
"""The layer rule (docs/architecture.md, "Layers"): each layer has one folder under
include/splitflow/ and under lib/, and a file includes only its own layer and those below it.

    core <- telemetry <- device <- executor <- serving      ops on device (and below)
    tools (installed commands) on top of them all

    /usr/bin/python3 tests/check_layers.py ROOT          check the tree at ROOT
    /usr/bin/python3 tests/check_layers.py --self-test ROOT
                                                         a broken copy must fail, naming the line

Reads every #include "..." (and <splitflow/...>) line of include/splitflow/** and lib/**. Prints each violation as
FILE:LINE: LAYER includes HIGHER_LAYER (PATH) and exits 1; exits 0 when there is none.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

ALLOWED = {
    "core": {"core"},
    "telemetry": {"core", "telemetry"},
    "device": {"core", "telemetry", "device"},
    "executor": {"core", "telemetry", "device", "executor"},
    "serving": {"core", "telemetry", "device", "executor", "serving"},
    "ops": {"core", "telemetry", "device", "ops"},
    # the commands installed with the library (splitflow-top): on top of every layer
    "tools": {"core", "telemetry", "device", "executor", "serving", "ops", "tools"},
}
TOP_LEVEL = {"splitflow.hpp": "umbrella"}  # the umbrella may include every layer
INCLUDE = re.compile(r'^\s*#\s*include\s+([<"])([^>"]+)[>"]')


def layer_of_file(rel):
    """The layer of a file under ROOT (include/splitflow/LAYER/... or lib/LAYER/...)."""
    parts = rel.split("/")
    if parts[:2] == ["include", "splitflow"]:
        if len(parts) == 3:
            return TOP_LEVEL.get(parts[2], "?" + parts[2])
        return parts[2]
    if parts[0] == "lib":
        return parts[1] if len(parts) > 2 else "?" + parts[1]
    return None


def layer_of_include(path, including_rel):
    """The layer an #include "path" in file `including_rel` reaches, or None (not splitflow's)."""
    if path.startswith("splitflow/"):
        rest = path[len("splitflow/"):].split("/")
        if rest == ["version.hpp"]:
            return "core"  # generated from cmake/version.hpp.in
        if len(rest) == 1:
            return TOP_LEVEL.get(rest[0], "?" + rest[0])
        return rest[0]
    if including_rel.startswith("lib/"):
        here = os.path.dirname(including_rel)
        target = os.path.normpath(os.path.join(here, path))
        if not os.path.isfile(os.path.join(ROOT, target)):
            target = os.path.normpath(os.path.join("lib", path))  # lib/ is an include directory
        return layer_of_file(target) if target.startswith("lib/") else None
    # a public header's relative include stays in its folder
    return layer_of_file(os.path.normpath(os.path.join(os.path.dirname(including_rel), path)))


def check(root):
    global ROOT
    ROOT = root
    problems = []
    for top in ("include/splitflow", "lib"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                if not name.endswith((".hpp", ".cpp", ".cu", ".inl", ".h")):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                mine = layer_of_file(rel)
                if mine not in ALLOWED and mine != "umbrella":
                    problems.append(f"{rel}:1: not in a layer's folder ({', '.join(ALLOWED)})")
                    continue
                with open(os.path.join(root, rel), encoding="utf-8") as f:
                    for n, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        if m.group(1) == "<" and not m.group(2).startswith("splitflow/"):
                            continue  # a system or third-party header
                        theirs = layer_of_include(m.group(2), rel)
                        if theirs is None or mine == "umbrella":
                            continue
                        if theirs not in ALLOWED.get(mine, ()):
                            problems.append(f"{rel}:{n}: {mine} includes {theirs} ({m.group(2)})")
    return problems


def self_test(root):
    """A copy with one include going up must fail, naming that file and line."""
    with tempfile.TemporaryDirectory() as tmp:
        for top in ("include", "lib"):
            shutil.copytree(os.path.join(root, top), os.path.join(tmp, top))
        victim = os.path.join(tmp, "include/splitflow/core/error.hpp")
        with open(victim) as f:
            lines = f.readlines()
        at = next(i for i, l in enumerate(lines) if l.startswith("#include")) + 1
        lines.insert(at, '#include "splitflow/executor/graph.hpp"\n')
        with open(victim, "w") as f:
            f.writelines(lines)
        out = subprocess.run([sys.executable, __file__, tmp], capture_output=True, text=True)
        want = f"include/splitflow/core/error.hpp:{at + 1}: core includes executor"
        if out.returncode != 1 or want not in out.stdout:
            print(f"self-test FAILED: expected exit 1 and '{want}', got {out.returncode}:\n"
                  f"{out.stdout}{out.stderr}")
            return 1
    print("self-test passed: a core header including the executor is refused, with its line")
    return 0


def main(argv):
    if len(argv) >= 2 and argv[0] == "--self-test":
        return self_test(argv[1])
    root = argv[0] if argv else os.path.join(os.path.dirname(__file__), "..")
    problems = check(os.path.abspath(root))
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} include(s) break the layer rule (docs/architecture.md, \"Layers\")")
        return 1
    print("layers: every include goes to the same layer or one below")
    return 0


ROOT = "."
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
