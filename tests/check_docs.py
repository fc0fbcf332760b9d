#!/usr/bin/python3
"""Docs that cannot drift (issue 22): the code blocks of README.md and docs/*.md are compiled
and run, and the names the docs cite are checked against the code and real outputs.

    check_docs.py snippets  [--root R] --build-dir B [--like TARGET] [--docs F...] [-v]
    check_docs.py names     [--root R] --dump EXE | --outputs DIR [--docs F...] [-v]
    check_docs.py self-test [--root R] --build-dir B --dump EXE | --outputs DIR

Every failure is printed as FILE:LINE: ... (the file relative to the root) and makes the exit
status 1. Standard library only; run with /usr/bin/python3 (ctest: docs.snippets, docs.names,
docs.self_test).

SNIPPETS. Every fenced block names its language (```text for diagrams and listings). ```cpp /
```c++ and ```python blocks are code: each one either is a complete program (C++: it defines
main) or carries a marker in an HTML comment on the line (or the last non-blank line) before
its fence:

    <!-- snippet: fragment FILLER... -->             wrapped with the named fillers (below)
    <!-- snippet: fragment FILLER...; compile-only reason="..." -->   C++: compiled, not run
    <!-- snippet: skip reason="..." -->             neither compiled nor run (reason required)

Blocks of other languages (sh, cmake, text, ...) are not code to run; they are counted. All
C++ blocks of the doc set are compiled as ONE translation unit: each in its own namespace
snippet_<file>_<line>, its #include lines hoisted to the top, its main renamed, with #line
directives so that an error names the doc's file and line; it is linked as --like TARGET (a
program of the build tree that links splitflow::splitflow) is linked. A block that does not
compile is reported and the others are compiled again without it. Each C++ block then runs in
its own process, each Python block in a fresh /usr/bin/python3 (--python-path, default
BUILD_DIR/python, before the environment's PYTHONPATH), in an empty temporary directory, with a timeout; an exception, a non-zero exit or
a timeout fails the block. `check_docs.py fillers` lists the fillers.

NAMES. Spans in backticks (outside code blocks), markdown links, paths in text blocks and the
tables of docs/telemetry.md are checked:
  - test names (`Suite.Name`, `Suite.Prefix...`) against TEST/TEST_F in tests/*.cpp; ctest
    names (`layers.check`: a prefix that ctest names use) against add_test in the CMake files;
    Python test files and functions against python/tests/;
  - paths (tests/..., lib/..., include/..., docs/..., benchmarks/..., examples/...,
    python/..., scripts/..., cmake/...; and file names with a source extension, which must be
    the end of a repository path) and link targets (with their #anchors) against the tree;
  - C++ and Python names (`GraphOptions::max_in_flight`, `splitflow::report(...)`,
    `sf.ops.normalize`, `run.stats()`, `{.seed, .epoch}`, `on_error="skip"`): qualified names
    and sf. names against the identifiers of the API (include/, lib/, python/src/,
    python/splitflow/, the CMake files), the others against every source file of the repository
    (comments excluded; string literals count when they are a bare identifier, as pybind11's
    names are); a designated initializer of a struct of include/ (`GraphOptions{.max_in_flight,
    .observer}`) names its fields in their declaration order, as C++20 takes them;
  - JSON keys (the JSON summary listing, spans like `{"graph", "service"}`) against the keys of
    a real run's JSON (docs_dump: run.json, service.json), and enumerated values
    ("running|succeeded") against the string literals of the library;
  - metric names, their types and labels (the Prometheus table, spans like
    `splitflow_x{graph,service}`) against prometheus_text of real runs (metrics.prom,
    service.prom);
  - the Chrome trace section's event names (`copy H2D`, `lease: STAGE`: capitals are
    placeholders), phases, args and metadata keys against a real run's trace.json.
A name that is right but cannot be checked goes into ALLOW below, with its reason.

SELF-TEST. A temporary copy of docs/telemetry.md, with a broken C++ snippet, a Python snippet
that raises, a C++ snippet that throws, an unmarked fragment, a skip without a reason, a
designated initializer out of its struct's order, and stale
names (a test, a path, a JSON key, a metric, a C++ name, a trace event, a link anchor) must fail
naming each one's line, while its intact snippet still passes.
"""
import argparse
import glob
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ROOT = os.path.dirname(HERE)

# --------------------------------------------------------------------------------------------
# Fillers: what a fragment is wrapped with. C++: `prelude` goes at namespace scope (inside the
# snippet's namespace), `before` / `after` around the block inside int main(); `wrap` says the
# block is statements (in main), otherwise it stays at namespace scope. One wrapper at most.
# Python: `prelude` runs before the block and `after` after it, in the same namespace.
# --------------------------------------------------------------------------------------------
CPP_FILLERS = {
    "main": {"wrap": True, "doc": "the block's statements run inside int main()"},
    "runtime": {"wrap": True, "before": "splitflow::Runtime rt;",
                "doc": "inside main(), with a splitflow::Runtime rt"},
    "graph": {"wrap": True, "before": 'splitflow::Runtime rt;\nsplitflow::Graph g(rt, "snippet");',
              "doc": "inside main(), with a splitflow::Runtime rt and a splitflow::Graph g"},
    "run": {"wrap": True, "before": """splitflow::Runtime rt;
splitflow::Graph g(rt, "squares");
g.source("numbers", std::views::iota(0L, 1000L)) >> g.stage("square", [](long x) { return x * x; })
    >> g.sink("drop", [](long) {});
splitflow::Run run = g.run();
run.wait();""",
            "doc": "inside main(), with rt, g and a finished splitflow::Run run of a CPU graph"},
    "namespace": {"wrap": False, "doc": "declarations at namespace scope: compiled, nothing runs"},
    # Stand-ins for the user's own code that examples name.
    "images": {"prelude": """struct Image {
  std::vector<std::uint8_t> pixels;
  int height = 0, width = 0;
};
using Path = std::string;
inline const std::vector<Path> paths = {"a.jpg", "b.jpg", "c.jpg"};
inline Image decode_jpeg(Path p) { return Image{std::vector<std::uint8_t>(12, std::uint8_t(p[0])), 2, 2}; }
inline Image augment(Image img) { return img; }
inline void decode_into(const Path& p, splitflow::HostTensor& t) {
  std::memset(t.data<std::uint8_t>(), p[0], t.nbytes());
}
inline int steps = 0;
inline void train_step(const Image&) { ++steps; }
inline void train_step(const splitflow::DeviceTensor&) { ++steps; }""",
               "after": """if (steps != int(paths.size()))
  throw std::logic_error("train_step ran " + std::to_string(steps) + " times for 3 paths");""",
               "doc": "Image, Path, paths (3 names), decode_jpeg(Path), augment(Image), "
                      "decode_into(Path, HostTensor&), train_step(Image or DeviceTensor); after the "
                      "block: train_step ran once per path"},
    "features": {"prelude": """using Features = std::vector<float>;
inline const Features features{1.0f, 2.0f, 3.0f};
inline std::vector<float> forward(const std::vector<Features>& items, splitflow::DeviceContext&) {
  std::vector<float> scores;
  for (const Features& f : items) scores.push_back(f.empty() ? 0.0f : f[0]);
  return scores;
}""", "doc": "Features (a vector of floats), features, forward(items, ctx) -> a score per item"},
    "answer": {"after": """if (score.get() != 1.0f) throw std::logic_error("the service answered a wrong score");
svc.close();
run.wait();""", "doc": "after the block: checks the future `score`, closes `svc`, waits for `run`"},
}

PY_FILLERS = {
    "images": {"prelude": """import numpy as np
files = [f"img{i}.jpg" for i in range(6)]
mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
def load_image(i):
    return np.full((8, 8, 3), i % 256, dtype=np.uint8)
_steps = []
def train_step(x):
    _steps.append(x)""", "after": "assert _steps, 'no training step ran'",
               "doc": "files (6 names), load_image(i) -> an 8x8x3 uint8 array, mean, std, "
                      "train_step(x); after: at least one step ran"},
    "jpegs": {"prelude": """import os as _os
from PIL import Image as _Image
for _c in ("cat", "dog"):
    _os.makedirs(f"data/train/{_c}", exist_ok=True)
for _i in range(70):
    _Image.new("RGB", (64, 48), (_i * 3 % 256, 90, 160)).save(
        f"data/train/{('cat', 'dog')[_i % 2]}/{_i:03d}.jpg")""",
              "doc": "70 JPEGs (64x48) in data/train/cat/ and data/train/dog/ under the block's "
                     "working directory"},
    "iterate-ds": {"after": """import torch as _torch
_batches = list(_torch.utils.data.DataLoader(ds, batch_size=None))
assert _batches, "the dataset yielded nothing"
""", "doc": "after the block: one epoch of DataLoader(ds, batch_size=None) yields something"},
}

CPP_LANGS = {"cpp", "c++", "cxx"}
PY_LANGS = {"python", "py", "python3"}
CPP_STD_HEADERS = ["chrono", "cstdint", "cstdio", "cstring", "exception", "fstream", "future",
                   "optional", "ranges", "stdexcept", "string", "type_traits", "vector"]

# --------------------------------------------------------------------------------------------
# Names that are right but that the checks cannot confirm, each with its reason.
# --------------------------------------------------------------------------------------------
ALLOW = {
    # tools, packages and variables of the environment
    "PATH": "an environment variable", "PYTHONPATH": "an environment variable",
    "OUT": "an environment variable of scripts/gpu-check.sh",
    "nvcc": "a tool", "nvidia-smi": "a tool", "numpy": "a package", "python3-numpy": "a package",
    "python3-torch": "a package", "sm_90": "a CUDA architecture",
    "INTER_LINEAR": "OpenCV's bilinear interpolation flag, named for comparison",
    "ImageFolder": "torchvision's dataset class, named for comparison",
    "DeadlineExceeded": "the old name of DeadlineError, kept as an alias (docs/api.md)",
    "global_control": "oneTBB's tbb::global_control",
    "valgrind --tool=callgrind --fair-sched=yes": "a tool's command line (Debian's valgrind)",
    "pthread_getspecific": "glibc's thread-specific data lookup, which oneTBB calls",
    "MALLOC_MMAP_THRESHOLD_": "a glibc malloc tunable (environment variable)",
    "MALLOC_TRIM_THRESHOLD_": "a glibc malloc tunable (environment variable), which Dask's nanny sets",
    "perf record": "a tool's command line (Debian's linux-perf)",
    "ObjectRef": "Ray's object reference, named for comparison (docs/scale-out.md)",
    "max_restarts": "a Ray actor option, named for comparison (docs/scale-out.md)",
    "max_task_retries": "a Ray actor option, named for comparison (docs/scale-out.md)",
    "DaskCluster": "the Dask Kubernetes operator's resource, named for comparison",
    "DaskWorkerGroup": "the Dask Kubernetes operator's resource, named for comparison",
    "enqueue": "oneTBB's task_arena::enqueue",
    "parallel_pipeline": "oneTBB's tbb::parallel_pipeline, the benchmark's baseline",
    "version.hpp": "generated into the build tree from cmake/version.hpp.in",
    "splitflow/version.hpp": "generated into the build tree from cmake/version.hpp.in",
    "Normalize": "torchvision's transform, named for comparison",
    "ToTensor": "torchvision's transform, named for comparison",
    "RandomHorizontalFlip": "torchvision's transform, named for comparison",
    "memoryview": "a Python builtin", "BufferError": "a Python builtin exception",
    "KeyboardInterrupt": "a Python builtin exception",
    "SystemExit": "a Python builtin exception", "RuntimeError": "a Python builtin",
    "ValueError": "a Python builtin", "convert": "PIL's Image.convert",
    "resize(BILINEAR)": "PIL's Image.resize with its BILINEAR filter",
    "BILINEAR": "PIL's Image.BILINEAR",
    "train.trace.json": "a file the telemetry example writes",
    "items << 32 | units": "the packing of a counter, an expression rather than names",
}
# Roots of qualified or dotted names that are other libraries', and common variable names.
EXTERNAL_ROOTS = {"std", "tbb", "torch", "np", "numpy", "PIL", "cuda", "thrust", "pybind11",
                  "py", "os", "sys", "nlohmann", "fmt"}
VARIABLES = {"a", "b", "c", "g", "o", "t", "x", "it", "ds", "rt", "run", "svc", "ctx", "sink",
             "stage", "files", "img", "batch", "st", "dataset", "self", "e", "p"}
KNOWN_DIRS = ("tests", "lib", "include", "docs", "benchmarks", "examples", "python", "scripts",
              "cmake")
SOURCE_EXTS = ("cpp", "hpp", "cu", "h", "inl", "py", "sh", "md", "cmake", "in")


def rel(path, root):
    return os.path.relpath(path, root)


def doc_files(root):
    return [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)\s*(.*)$")
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(.*?)\s*-->\s*$")


class Block:
    def __init__(self, doc, fence_line, lang, lines, marker, marker_line):
        self.doc, self.fence_line, self.lang = doc, fence_line, lang
        self.lines, self.marker, self.marker_line = lines, marker, marker_line

    @property
    def first_line(self):
        return self.fence_line + 1

    @property
    def where(self):
        return f"{self.doc}:{self.fence_line}"

    @property
    def code(self):
        return "\n".join(self.lines) + "\n"


def parse_marker(text):
    """'fragment a b; compile-only reason="x"' -> {'fragment': [...], 'skip': bool, ...}."""
    out = {"fragment": None, "skip": False, "compile_only": False, "reason": None, "errors": []}
    m = re.search(r'reason\s*=\s*"([^"]*)"', text)
    if m:
        out["reason"] = m.group(1).strip()
        text = text[:m.start()] + text[m.end():]
    words = text.replace(";", " ").split()
    i = 0
    while i < len(words):
        w = words[i]
        if w == "fragment":
            out["fragment"] = []
            i += 1
            while i < len(words) and words[i] not in ("skip", "compile-only"):
                out["fragment"].append(words[i])
                i += 1
            continue
        if w == "skip":
            out["skip"] = True
        elif w == "compile-only":
            out["compile_only"] = True
        else:
            out["errors"].append(f"unknown word '{w}' in the snippet marker")
        i += 1
    if (out["skip"] or out["compile_only"]) and not out["reason"]:
        out["errors"].append('skip and compile-only need a reason="..."')
    if out["skip"] and out["fragment"] is not None:
        out["errors"].append("a skipped block is not a fragment")
    if not out["skip"] and out["fragment"] is None and not out["compile_only"]:
        out["errors"].append("the marker says neither fragment, compile-only nor skip")
    return out


def parse_doc(path, display):
    """Blocks, problems, and the text with code blocks blanked (same line numbers)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks, problems, prose = [], [], list(lines)
    i = 0
    pending_marker = None  # (line number, text)
    while i < len(lines):
        line = lines[i]
        mk = MARKER.match(line)
        if mk:
            if pending_marker:
                problems.append(f"{display}:{pending_marker[0]}: a snippet marker with no code block after it")
            pending_marker = (i + 1, mk.group(1))
            i += 1
            continue
        fm = FENCE.match(line)
        if not fm:
            if line.strip() and pending_marker:
                problems.append(f"{display}:{pending_marker[0]}: a snippet marker with no code block after it")
                pending_marker = None
            i += 1
            continue
        indent, fence, lang = fm.group(1), fm.group(2), fm.group(3).lower()
        start = i + 1
        body = []
        i += 1
        closed = False
        while i < len(lines):
            cm = re.match(r"^\s*(`{3,}|~{3,})\s*$", lines[i])
            if cm and cm.group(1)[0] == fence[0] and len(cm.group(1)) >= len(fence):
                closed = True
                break
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if not closed:
            problems.append(f"{display}:{start}: a code fence that is never closed")
        for k in range(start - 1, min(i + 1, len(lines))):
            prose[k] = ""
        if not lang:
            problems.append(f"{display}:{start}: a code block without a language: name it "
                            "(```text for a diagram or a listing)")
        marker = marker_line = None
        if pending_marker:
            marker_line, marker = pending_marker[0], parse_marker(pending_marker[1])
            pending_marker = None
        blocks.append(Block(display, start, lang, body, marker, marker_line))
        i += 1
    if pending_marker:
        problems.append(f"{display}:{pending_marker[0]}: a snippet marker with no code block after it")
    return blocks, problems, "\n".join(prose), lines


# --------------------------------------------------------------------------------------------
# Snippets
# --------------------------------------------------------------------------------------------
def classify(block):
    """('cpp'|'python'|'other', action, fillers, problem). action: run, compile, skip."""
    lang = "cpp" if block.lang in CPP_LANGS else "python" if block.lang in PY_LANGS else "other"
    m = block.marker
    if lang == "other":
        if m and not m["skip"]:
            return lang, "skip", [], f"{block.where}: a snippet marker on a {block.lang or 'plain'} block"
        return lang, "skip", [], None
    if m and m["errors"]:
        return lang, "skip", [], f"{block.doc}:{block.marker_line}: " + "; ".join(m["errors"])
    if m and m["skip"]:
        return lang, "skip", [], None
    fillers = (m["fragment"] or []) if m else []
    table = CPP_FILLERS if lang == "cpp" else PY_FILLERS
    unknown = [f for f in fillers if f not in table]
    if unknown:
        return lang, "skip", [], (f"{block.doc}:{block.marker_line}: unknown filler(s) {', '.join(unknown)} "
                                  f"(fillers: {', '.join(table)})")
    if lang == "cpp":
        wrappers = [f for f in fillers if "wrap" in CPP_FILLERS[f]]
        if len(wrappers) > 1:
            return lang, "skip", [], f"{block.doc}:{block.marker_line}: more than one wrapper ({', '.join(wrappers)})"
        if not (m and m["fragment"] is not None) and not re.search(r"\bint\s+main\s*\(", block.code):
            return lang, "skip", [], (f"{block.where}: a C++ block without int main(): mark it "
                                      "<!-- snippet: fragment FILLER... --> (check_docs.py fillers) or "
                                      '<!-- snippet: skip reason="..." -->')
        runnable = bool(wrappers and CPP_FILLERS[wrappers[0]]["wrap"]) or (
            not wrappers and re.search(r"\bint\s+main\s*\(", block.code))
        action = "compile" if (m and m["compile_only"]) or not runnable else "run"
        return lang, action, fillers, None
    if m and m["compile_only"]:
        return lang, "skip", [], f"{block.doc}:{block.marker_line}: compile-only is for C++ blocks"
    return lang, "run", fillers, None


def cpp_namespace(block):
    return "snippet_" + re.sub(r"\W", "_", block.doc) + f"_{block.fence_line}"


INCLUDE_RE = re.compile(r"^\s*#\s*include\b.*$")


def generate_cpp(entries):
    """One translation unit for the C++ blocks: [(block, fillers, action)]."""
    out = ["// Generated by tests/check_docs.py from the docs' C++ blocks: do not edit."]
    for h in CPP_STD_HEADERS:
        out.append(f"#include <{h}>")
    out.append("#include <splitflow/splitflow.hpp>")
    for block, _, _ in entries:
        for n, line in enumerate(block.lines):
            if INCLUDE_RE.match(line):
                out.append(f'#line {block.first_line + n} "{block.doc}"')
                out.append(line.strip())
    out.append('#line 1 "<check_docs generated>"')
    out.append("""namespace check_docs {
template <class F>
int call_main(F f, int argc, char** argv) {
  if constexpr (std::is_invocable_v<F, int, char**>) return f(argc, argv);
  else if constexpr (std::is_void_v<std::invoke_result_t<F>>) return f(), 0;
  else return f();
}
}  // namespace check_docs""")
    for block, fillers, _ in entries:
        ns = cpp_namespace(block)
        wrap = any(CPP_FILLERS[f].get("wrap") for f in fillers)
        out.append(f"namespace {ns} {{")
        for f in fillers:
            if CPP_FILLERS[f].get("prelude"):
                out.append(f'#line 1 "{block.where} [filler {f}]"')
                out.append(CPP_FILLERS[f]["prelude"])
        body = [("" if INCLUDE_RE.match(l) else l) for l in block.lines]
        if wrap:
            out.append(f'#line 1 "{block.where} [filler]"')
            out.append("int snippet_main() {")
            for f in fillers:
                if CPP_FILLERS[f].get("before"):
                    out.append(f'#line 1 "{block.where} [filler {f}]"')
                    out.append(CPP_FILLERS[f]["before"])
        else:
            body = [re.sub(r"\bint(\s+)main(\s*)\(", r"int\1snippet_main\2(", l) for l in body]
        out.append(f'#line {block.first_line} "{block.doc}"')
        out.extend(body)
        if wrap:
            for f in fillers:
                if CPP_FILLERS[f].get("after"):
                    out.append(f'#line 1 "{block.where} [filler {f}]"')
                    out.append(CPP_FILLERS[f]["after"])
            out.append(f'#line 1 "{block.where} [filler]"')
            out.append("return 0;\n}")
        out.append(f"}}  // namespace {ns}")
    out.append('#line 1 "<check_docs generated>"')
    out.append("int main(int argc, char** argv) {")
    out.append("  if (argc < 2) { std::fprintf(stderr, \"usage: snippets FILE:LINE\\n\"); return 2; }")
    out.append("  const std::string which = argv[1];")
    out.append("  try {")
    for block, fillers, action in entries:
        if action != "run":
            continue
        out.append(f'    if (which == "{block.where}") return check_docs::call_main('
                   f"&{cpp_namespace(block)}::snippet_main, argc - 1, argv + 1);")
    out.append("""  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: the snippet threw: %s\\n", which.c_str(), e.what());
    return 3;
  } catch (...) {
    std::fprintf(stderr, "%s: the snippet threw a non-std exception\\n", which.c_str());
    return 3;
  }
  std::fprintf(stderr, "no runnable snippet %s\\n", which.c_str());
  return 2;
}""")
    return "\n".join(out) + "\n"


def build_settings(build_dir, like):
    """The compile command and link line of target `like` in build_dir (Makefile generators)."""
    cc_path = os.path.join(build_dir, "compile_commands.json")
    link_txt = None
    for cand in glob.glob(os.path.join(build_dir, "**", "CMakeFiles", f"{like}.dir", "link.txt"),
                          recursive=True):
        link_txt = cand
        break
    if not os.path.isfile(cc_path) or not link_txt:
        raise SystemExit(f"check_docs: need {cc_path} and CMakeFiles/{like}.dir/link.txt under "
                         f"{build_dir} (a Makefile generator with CMAKE_EXPORT_COMPILE_COMMANDS; "
                         "build the target first)")
    with open(cc_path, encoding="utf-8") as f:
        commands = json.load(f)
    entry = next((e for e in commands if f"/{like}.dir/" in e.get("output", "") + e.get("command", "")),
                 None)
    if entry is None:
        raise SystemExit(f"check_docs: no compile command of {like} in {cc_path}")
    args = entry.get("arguments") or shlex.split(entry["command"])
    compiler, flags, skip = args[0], [], False
    for i, a in enumerate(args[1:], 1):
        if skip:
            skip = False
            continue
        if a in ("-o", "-c"):
            skip = True
            continue
        if a.startswith("-O") or a.startswith("-W"):
            continue
        flags.append(a)
    with open(link_txt, encoding="utf-8") as f:
        link = shlex.split(f.read().strip())
    link_dir = os.path.dirname(os.path.dirname(os.path.dirname(link_txt)))  # .../CMakeFiles/x.dir
    libs, skip = [], False
    for a in link[1:]:
        if skip:
            skip = False
            continue
        if a == "-o":
            skip = True
            continue
        if a.endswith(".o") or a.startswith("-O") or a == "-DNDEBUG":
            continue
        libs.append(a)
    return compiler, flags, link[0], libs, link_dir


def compile_cpp(entries, work, settings, verbose):
    """Compile and link; returns (binary or None, {where: error text}, seconds)."""
    compiler, flags, linker, libs, link_dir = settings
    failed = {}
    t0 = time.time()
    remaining = list(entries)
    for attempt in range(4):
        if not remaining:
            return None, failed, time.time() - t0
        src = os.path.join(work, "docs_snippets.cpp")
        with open(src, "w", encoding="utf-8") as f:
            f.write(generate_cpp(remaining))
        obj = os.path.join(work, "docs_snippets.o")
        cmd = [compiler] + flags + ["-O0", "-g0", "-fdiagnostics-color=never", "-c", src, "-o", obj]
        if verbose:
            print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode == 0:
            break
        blamed = set()
        per = {}
        for line in p.stderr.splitlines():
            if "warning:" in line:
                continue
            for block, _, _ in remaining:
                if line.startswith(block.where + " [") or re.search(
                        re.escape(block.doc) + r":(\d+)", line) and any(
                        block.first_line <= int(n) < block.first_line + len(block.lines) + 1
                        for n in re.findall(re.escape(block.doc) + r":(\d+)", line)):
                    blamed.add(block.where)
                    per.setdefault(block.where, []).append(line)
        if not blamed:
            failed["<all C++ snippets>"] = "the generated translation unit does not compile:\n" + p.stderr[-6000:]
            return None, failed, time.time() - t0
        for where in blamed:
            errs = [l for l in per[where] if "error" in l] or per[where]
            failed[where] = "does not compile:\n    " + "\n    ".join(errs[:12])
        remaining = [e for e in remaining if e[0].where not in blamed]
    else:
        for e in remaining:
            failed[e[0].where] = "not compiled: four compilations failed on other blocks"
        return None, failed, time.time() - t0
    binary = os.path.join(work, "docs_snippets")
    cmd = [linker, obj, "-o", binary] + libs
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=link_dir)
    if p.returncode != 0:
        failed["<all C++ snippets>"] = "the snippets do not link:\n" + p.stderr[-4000:]
        return None, failed, time.time() - t0
    return (binary, {e[0].where for e in remaining}), failed, time.time() - t0


# (Guarded: a block that starts worker processes under the spawn start method, as
# processes=N does, makes them import this file again as __mp_main__.)
PY_DRIVER = r'''
import json, sys
if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    for name, code in spec["prelude"]:
        exec(compile(code, "<filler %s>" % name, "exec"), ns)
    exec(compile("\n" * (spec["line"] - 1) + spec["code"], spec["file"], "exec"), ns)
    for name, code in spec["after"]:
        exec(compile(code, "<filler %s>" % name, "exec"), ns)
'''


def run_python(block, fillers, root, timeout, verbose, python_path=None):
    with tempfile.TemporaryDirectory(prefix="check_docs_py_") as tmp:
        spec = {"prelude": [(f, PY_FILLERS[f]["prelude"]) for f in fillers if PY_FILLERS[f].get("prelude")],
                "after": [(f, PY_FILLERS[f]["after"]) for f in fillers if PY_FILLERS[f].get("after")],
                "line": block.first_line, "code": block.code,
                "file": os.path.join(root, block.doc)}
        with open(os.path.join(tmp, "spec.json"), "w", encoding="utf-8") as f:
            json.dump(spec, f)
        with open(os.path.join(tmp, "driver.py"), "w", encoding="utf-8") as f:
            f.write(PY_DRIVER)
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        if python_path:
            env["PYTHONPATH"] = os.pathsep.join([python_path] + [x for x in [env.get("PYTHONPATH")] if x])
        try:
            p = subprocess.run([sys.executable, os.path.join(tmp, "driver.py"), os.path.join(tmp, "spec.json")],
                               cwd=tmp, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return f"did not finish within {timeout} s"
        if verbose and p.stdout:
            print(p.stdout, end="")
        if p.returncode != 0:
            tb = p.stderr.strip().splitlines()
            return (f"raised (exit {p.returncode}): {tb[-1] if tb else ''}\n    " + "\n    ".join(tb[-14:]))
    return None


def run_cpp(binary, block, timeout, verbose):
    with tempfile.TemporaryDirectory(prefix="check_docs_cpp_") as tmp:
        try:
            p = subprocess.run([binary, block.where], cwd=tmp, capture_output=True, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"did not finish within {timeout} s"
        if verbose and p.stdout:
            print(p.stdout, end="")
        if p.returncode != 0:
            err = (p.stderr.strip() or p.stdout.strip()).splitlines()
            return f"exited with {p.returncode}:\n    " + "\n    ".join(err[-12:])
    return None


def cmd_snippets(args, docs=None, quiet=False):
    root = os.path.abspath(args.root)
    docs = docs or ([os.path.abspath(d) for d in args.docs] if args.docs else doc_files(root))
    problems, entries_cpp, entries_py, counts = [], [], [], {}
    skipped, others = [], {}
    t_start = time.time()
    for path in docs:
        blocks, probs, _, _ = parse_doc(path, rel(path, root))
        problems += probs
        for b in blocks:
            lang, action, fillers, problem = classify(b)
            if problem:
                problems.append(problem)
                continue
            if lang == "other":
                others[b.lang or "(none)"] = others.get(b.lang or "(none)", 0) + 1
                continue
            if action == "skip":
                skipped.append((b, b.marker["reason"]))
                continue
            (entries_cpp if lang == "cpp" else entries_py).append((b, fillers, action))
    results = {}
    compile_s = 0.0
    python_path = os.path.abspath(args.python_path) if args.python_path else None
    if python_path is None and args.build_dir and os.path.isdir(os.path.join(args.build_dir, "python", "splitflow")):
        python_path = os.path.abspath(os.path.join(args.build_dir, "python"))
    if entries_cpp:
        settings = build_settings(os.path.abspath(args.build_dir), args.like)
        with tempfile.TemporaryDirectory(prefix="check_docs_") as work:
            built, failed, compile_s = compile_cpp(entries_cpp, work, settings, args.verbose)
            if args.keep:
                os.makedirs(args.keep, exist_ok=True)
                shutil.copy(os.path.join(work, "docs_snippets.cpp"), args.keep)
            for where, msg in failed.items():
                problems.append(f"{where}: C++ block {msg}")
            if built:
                binary, ok = built
                for b, fillers, action in entries_cpp:
                    if b.where not in ok:
                        continue
                    if action != "run":
                        results[b.where] = "compiled (not run: " + (
                            b.marker["reason"] if b.marker and b.marker["compile_only"] else
                            "declarations only") + ")"
                        continue
                    t0 = time.time()
                    err = run_cpp(binary, b, args.timeout, args.verbose)
                    if err:
                        problems.append(f"{b.where}: C++ block {err}")
                    else:
                        results[b.where] = f"compiled, ran ({time.time() - t0:.1f} s)"
    for b, fillers, _ in entries_py:
        t0 = time.time()
        err = run_python(b, fillers, root, args.timeout, args.verbose, python_path)
        if err:
            problems.append(f"{b.where}: Python block {err}")
        else:
            results[b.where] = f"ran ({time.time() - t0:.1f} s)"
    if not quiet:
        for b, fillers, _ in entries_cpp + entries_py:
            if b.where in results:
                print(f"ok   {b.where} [{b.lang}{' fragment ' + ' '.join(fillers) if fillers else ''}]: "
                      f"{results[b.where]}")
        for b, reason in skipped:
            print(f"skip {b.where} [{b.lang}]: {reason}")
        n_cpp_run = sum(1 for v in results.values() if v.startswith("compiled, ran"))
        n_cpp_only = sum(1 for v in results.values() if v.startswith("compiled (not run"))
        n_py = sum(1 for v in results.values() if v.startswith("ran"))
        print(f"check_docs snippets: {len(entries_cpp)} C++ blocks ({n_cpp_run} compiled and run, "
              f"{n_cpp_only} compiled only; one translation unit, compiled and linked in "
              f"{compile_s:.1f} s), {len(entries_py)} Python blocks ({n_py} run), {len(skipped)} "
              f"skipped with a reason; not code: "
              + (", ".join(f"{n} {k}" for k, n in sorted(others.items())) or "none")
              + f"; {time.time() - t_start:.1f} s in all")
    for p in problems:
        print("FAIL " + p)
    if problems:
        print(f"check_docs snippets: {len(problems)} problem(s)")
    return problems


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _declaration_head(decl):
    """A declaration's part before its initializer, with template arguments, alignas(...) and
    [[attributes]] taken out: "std::function<void(int)> cb = f" -> "std::function cb "."""
    d = re.sub(r"\[\[.*?\]\]|\balignas\s*\([^()]*\)", " ", decl)
    out, level = [], 0
    for ch in d:
        if ch == "<":
            level += 1
        elif ch == ">" and level:
            level -= 1
        elif level == 0:
            out.append(ch)
    return re.split(r"[={]", "".join(out), maxsplit=1)[0]


def _is_function(head):
    return bool(re.search(r"\boperator\b|[\w>]\s*\(", head))


def struct_fields(code):
    """(name, [data members in declaration order]) of each struct defined in `code` (comments
    stripped): the last identifier of each declarator at the struct's top level, before its
    initializer; functions, types, static and using declarations left out."""
    out = []
    for m in re.finditer(r"\bstruct\s+(\w+)\s*(?:final\s*)?(?::[^{;]*)?\{", code):
        i, depth, stmt, members = m.end(), 1, [], []
        while i < len(code) and depth > 0:
            c = code[i]
            i += 1
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 1 and _is_function(_declaration_head("".join(stmt))):
                    stmt = []  # a member function's body ended
                    continue
            if depth == 1 and c == ";":
                decl = re.sub(r"\b(?:public|private|protected)\s*:", " ", "".join(stmt)).strip()
                stmt = []
                head = _declaration_head(decl)
                if not head.strip() or _is_function(head) or re.match(
                        r"(?:static|using|typedef|friend|enum|struct|class|template|constexpr)\b", head):
                    continue
                # One declarator or several (`double scale_min = 0.08, scale_max = 1.0;`): split
                # at the commas outside brackets, each declarator's name before its initializer.
                parts, level, cur = [], 0, ""
                for ch in decl:
                    level += ch in "<({[" and 1 or ch in ">)}]" and -1 or 0
                    if ch == "," and level == 0:
                        parts.append(cur)
                        cur = ""
                    else:
                        cur += ch
                parts.append(cur)
                for k, part in enumerate(parts):
                    names = re.findall(r"[A-Za-z_]\w*", _declaration_head(part))
                    if len(names) >= (2 if k == 0 else 1):
                        members.append(names[-1])
            elif depth >= 1:
                stmt.append(c)
        out.append((m.group(1), members))
    return out


def strip_cpp_comments(text):
    """Code without comments; string literals kept (returned separately too)."""
    out, strings, i, n = [], [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
        elif c == '"' or c == "'":
            if c == '"' and i > 0 and text[i - 1] == "R":  # raw string R"d(...)d"
                m = re.match(r'"([^(\s]*)\(', text[i:])
                if m:
                    end = text.find(")" + m.group(1) + '"', i)
                    end = n if end < 0 else end + len(m.group(1)) + 2
                    strings.append(text[i:end])
                    i = end
                    continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            strings.append(text[i + 1:j])
            out.append(" ")
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out), strings


def python_identifiers(text):
    names, strings = set(), []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.NAME:
                names.add(tok.string)
            elif tok.type == tokenize.STRING:
                m = re.match(r"^[rbuRBUfF]*('''|\"\"\"|'|\")(.*)\1$", tok.string, re.S)
                if m:
                    strings.append(m.group(2))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        names.update(IDENT.findall(text))
    return names, strings


class Corpus:
    """Identifiers of the code: `api` (include/, lib/, python/src, python/splitflow, CMake) and
    `all` (every source file), plus string literals of the library and the test names."""

    def __init__(self, root):
        self.root = root
        self.api, self.all, self.lib_strings = set(), set(), set()
        self.files = set()
        for dirpath, dirnames, files in os.walk(root, followlinks=True):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("build", "__pycache__")]
            for name in files:
                p = os.path.join(dirpath, name)
                self.files.add(rel(p, root))
        for r in sorted(self.files):
            top = r.split("/")[0]
            ext = r.rsplit(".", 1)[-1] if "." in os.path.basename(r) else ""
            is_cmake = os.path.basename(r) == "CMakeLists.txt" or ext == "cmake" or r.endswith(".cmake.in")
            if top not in KNOWN_DIRS and r != "CMakeLists.txt" or r == "tests/check_docs.py":
                continue  # (this script names stale names on purpose)
            if not (ext in ("cpp", "hpp", "cu", "h", "inl", "py", "sh") or is_cmake or r.endswith(".hpp.in")):
                continue
            try:
                with open(os.path.join(root, r), encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            if ext == "py":
                names, strings = python_identifiers(text)
            elif is_cmake or ext == "sh":
                code = re.sub(r"(?m)#.*$", "", text)
                names, strings = set(IDENT.findall(code)), []
            else:
                code, strings = strip_cpp_comments(text)
                names = set(IDENT.findall(code))
            for s in strings:  # pybind11's names, benchmark names ("BM_ChainHop/splitflow")
                if re.fullmatch(r"[A-Za-z_][\w./]*", s):
                    names.add(s)
                    names.update(x for x in re.split(r"[./]", s) if x)
            if r.startswith("python/splitflow/") and ext == "py":
                names.add(os.path.basename(r)[:-3])  # a module of the package: splitflow.dask
            self.all |= names
            api = (top in ("include", "lib", "cmake") or r == "CMakeLists.txt" or
                   r.startswith(("python/src/", "python/splitflow/", "python/CMakeLists")))
            if api:
                self.api |= names
                if top in ("lib", "include"):
                    self.lib_strings |= set(strings)
        self.tests = set()
        for p in glob.glob(os.path.join(root, "tests", "*.cpp")):
            with open(p, encoding="utf-8") as f:
                for m in re.finditer(r"\bTEST(?:_F|_P)?\(\s*(\w+)\s*,\s*(\w+)\s*\)", f.read()):
                    self.tests.add(f"{m.group(1)}.{m.group(2)}")
        self.py_tests = set()
        for p in glob.glob(os.path.join(root, "python", "tests", "*.py")):
            with open(p, encoding="utf-8") as f:
                self.py_tests |= set(re.findall(r"(?m)^\s*def (test_\w+)", f.read()))
        self.ctest, self.cpp_test_binaries = set(), set()
        for p in glob.glob(os.path.join(root, "**", "CMakeLists.txt"), recursive=True):
            if "/build/" in p:
                continue
            with open(p, encoding="utf-8") as f:
                text = f.read()
            self.ctest |= set(re.findall(r"add_test\(\s*NAME\s+([\w.]+)", text))
            self.cpp_test_binaries |= set(re.findall(r"splitflow_test\((\w+)", text))
            if "compile_fail_cases" in text:
                for m in re.finditer(r'"(\w+)\|', text):
                    self.ctest.add(f"compile_fail.{m.group(1)}")
        self.ctest_prefixes = {n.split(".")[0] for n in self.ctest if "." in n}
        self.make_targets = set()
        if os.path.isfile(os.path.join(root, "Makefile")):
            with open(os.path.join(root, "Makefile"), encoding="utf-8") as f:
                self.make_targets = set(re.findall(r"(?m)^([\w-]+)\s*:(?!=)", f.read()))
        # The data members of include/'s structs, in declaration order: the order C++20's
        # designated initializers take them in (`GraphOptions{.max_in_flight, .observer}`).
        self.fields = {}
        for r in sorted(self.files):
            if r.startswith("include/") and r.endswith(".hpp"):
                with open(os.path.join(root, r), encoding="utf-8") as f:
                    for name, members in struct_fields(strip_cpp_comments(f.read())[0]):
                        self.fields.setdefault(name, members)


class Outputs:
    """Real outputs of docs_dump: JSON keys, metric samples, trace events."""

    def __init__(self, outdir):
        self.dir = outdir
        self.json_keys = {}  # key -> file
        self.json_values = set()
        for name in ("run.json", "service.json"):
            with open(os.path.join(outdir, name), encoding="utf-8") as f:
                self._walk(json.load(f), name)
        self.samples = {}  # sample name -> [labels dict]
        self.types = {}  # family -> type
        for name in ("metrics.prom", "service.prom"):
            with open(os.path.join(outdir, name), encoding="utf-8") as f:
                for line in f:
                    m = re.match(r"# TYPE (\S+) (\S+)", line)
                    if m:
                        self.types[m.group(1)] = m.group(2)
                        continue
                    m = re.match(r"([a-zA-Z_:][\w:]*)(\{(.*)\})? ", line)
                    if m and not line.startswith("#"):
                        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
                        self.samples.setdefault(m.group(1), []).append(labels)
        with open(os.path.join(outdir, "trace.json"), encoding="utf-8") as f:
            trace = json.load(f)
        self.trace_top = set(trace)
        self.trace_meta = set(trace.get("metadata", {}))
        self.trace_phases, self.trace_names, self.trace_args, self.trace_event_keys = set(), set(), set(), set()
        self.trace_processes = set()
        for e in trace["traceEvents"]:
            self.trace_event_keys |= set(e)
            self.trace_phases.add(e.get("ph"))
            if e.get("ph") == "M":
                if e.get("name") == "process_name":
                    self.trace_processes.add(e["args"]["name"])
                continue
            self.trace_names.add(e.get("name"))
            self.trace_args |= set(e.get("args", {}))

    def _walk(self, v, name):
        if isinstance(v, dict):
            for k, x in v.items():
                self.json_keys.setdefault(k, name)
                self._walk(x, name)
        elif isinstance(v, list):
            for x in v:
                self._walk(x, name)
        elif isinstance(v, str):
            self.json_values.add(v)

    def family_samples(self, family):
        out = []
        for s, labels in self.samples.items():
            if s == family or s in (family + "_count", family + "_sum", family + "_bucket"):
                out += labels
        return out


def placeholder_regex(text):
    """'lease: STAGE' -> a regex where capitalised words of 3+ letters are placeholders."""
    parts = re.split(r"\b([A-Z]{3,})\b", text)
    return "^" + "".join(".+" if i % 2 else re.escape(p) for i, p in enumerate(parts)) + "$"


def heading_slug(h):
    s = h.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


class NameChecker:
    def __init__(self, root, corpus, outputs, verbose):
        self.root, self.c, self.o, self.verbose = root, corpus, outputs, verbose
        self.problems, self.checked = [], {}  # checked: kind -> set of names
        self.not_names = []  # spans taken for prose, output files or build folders

    def ok(self, kind, name):
        self.checked.setdefault(kind, set()).add(name)
        if self.verbose:
            print(f"  checked {kind}: {name}")

    def fail(self, where, msg):
        self.problems.append(f"{where}: {msg}")

    # ---- paths
    def path_exists(self, p):
        p = p.rstrip("/")
        alts = [p]
        m = re.search(r"\{([^{}]*)\}", p)
        if m:
            alts = [p[:m.start()] + a + p[m.end():] for a in m.group(1).split(",")]
        for a in alts:
            if "*" in a:
                if not glob.glob(os.path.join(self.root, a)):
                    return False
            elif not os.path.exists(os.path.join(self.root, a)):
                return False
        return True

    def suffix_exists(self, name):
        alts = [name]
        m = re.search(r"\{([^{}]*)\}", name)
        if m:
            alts = [name[:m.start()] + a + name[m.end():] for a in m.group(1).split(",")]
        for a in alts:
            if not any(f == a or f.endswith("/" + a) for f in self.c.files):
                return False
        return True

    def check_path_token(self, tok, where):
        tok = tok.strip().rstrip(".,;:)")
        if not tok or tok in ALLOW:
            return
        top = tok.split("/")[0]
        if top in KNOWN_DIRS and "/" in tok:
            if self.path_exists(tok):
                self.ok("paths (the file tree)", tok)
            elif any(self.path_exists(tok + ext) for ext in (".cpp", ".py")):
                self.ok("programs (built from a source of the tree)", tok)
            else:
                self.fail(where, f"`{tok}`: no such file or directory")
            return
        m = re.fullmatch(r"[\w./{},-]+\.(" + "|".join(SOURCE_EXTS) + r")", tok)
        if m and "*" not in tok:
            if self.suffix_exists(tok):
                self.ok("file names (the end of a path in the tree)", tok)
            else:
                self.fail(where, f"`{tok}`: no file of the repository has this name")

    def scan_paths(self, text, where):
        for m in re.finditer(r"(?:(?<=^)|(?<=[\s(`\[\"']))((?:%s)/[\w.*{},/+-]*)" % "|".join(KNOWN_DIRS), text):
            self.check_path_token(m.group(1), where)

    # ---- identifiers
    def check_ident(self, name, where, api=False, context=None):
        if name in ALLOW or len(name) < 2 or name in VARIABLES:
            return
        if re.fullmatch(r"[A-Z]{1,2}|In|Out|[A-Z][a-z]?", name):
            return  # a placeholder (T, A, B, In, Out)
        pool = self.c.api if api else self.c.all
        if name in pool:
            self.ok("C++/Python names (identifiers of " + ("the API: include/, lib/, python/, CMake)" if api
                    else "the repository's sources)"), name)
        elif name.startswith("test_") and (name in self.c.py_tests or name in self.c.cpp_test_binaries):
            self.ok("test functions and binaries", name)
        else:
            self.fail(where, f"`{context or name}`: `{name}` is not a name in "
                             + ("the API (include/, lib/, python/src, python/splitflow)" if api
                                else "the repository's code"))

    def check_code(self, span, where):
        """Identifiers of a code-like span, by shape."""
        self.check_designated_order(span, where)
        s = re.sub(r'"[^"]*"', '""', span)
        # Top level vs inside parentheses / braces.
        depth, top, inner = 0, [], []
        for ch in s:
            if ch in "([":
                depth += 1
                (top if depth == 1 else inner).append(ch)
                continue
            if ch in ")]":
                depth = max(0, depth - 1)
            (top if depth == 0 else inner).append(ch)
        top_s, inner_s = "".join(top), "".join(inner)
        self._chains(top_s, where, span, all_components=True)
        self._chains(inner_s, where, span, all_components=False)

    def check_designated_order(self, span, where):
        """`Type{.a, .b}` of a struct of include/: its fields, in their declaration order
        (C++20 refuses a designated initializer out of it)."""
        for m in re.finditer(r"\b(\w+)\s*\{\s*(\.\w+[^{}]*)\}", span):
            members = self.c.fields.get(m.group(1))
            if members is None:
                continue
            given = re.findall(r"(?:^|,)\s*\.(\w+)", m.group(2))
            unknown = [g for g in given if g not in members]
            if unknown:
                self.fail(where, f"`{span}`: {m.group(1)} has no field "
                                 + ", ".join(f"`{u}`" for u in unknown))
            elif [members.index(g) for g in given] != sorted(members.index(g) for g in given):
                self.fail(where, f"`{span}`: {m.group(1)}'s fields out of their declaration order "
                                 f"(C++20's designated initializers refuse it): "
                                 + ", ".join("." + g for g in sorted(given, key=members.index)))
            else:
                self.ok("designated initializers (fields of include/'s structs, in order)", m.group(1))

    def _chains(self, s, where, span, all_components):
        for m in re.finditer(r"(?<![\w.])(\.?)([A-Za-z_]\w*(?:(?:::|\.)~?[A-Za-z_*]\w*\*?)*)(\s*=(?!=))?(\s*[({<])?", s):
            lead, chain, kwarg, call = m.group(1), m.group(2), m.group(3), m.group(4)
            before = s[:m.start()].rstrip()
            if lead == "." or kwarg:  # designated initialiser .name or keyword argument name=
                self.check_ident(chain.split(".")[-1].split("::")[-1], where, context=span)
                continue
            if "::" in chain:
                parts = chain.split("::")
                if parts[0] in EXTERNAL_ROOTS:
                    continue
                for p in parts:
                    if p.endswith("*"):
                        if not any(x.startswith(p.rstrip("*")) for x in self.c.api):
                            self.fail(where, f"`{span}`: no name starts with `{p.rstrip('*')}`")
                        continue
                    if p in ("splitflow",):
                        continue
                    self.check_ident(p.lstrip("~"), where, api=True, context=span)
                continue
            if "." in chain:
                parts = chain.split(".")
                if parts[0] in EXTERNAL_ROOTS:
                    continue
                api = parts[0] in ("sf", "splitflow")
                if api or parts[0] in VARIABLES or (parts[0].islower() and len(parts[0]) <= 3 and parts[0] != "ops"):
                    parts = parts[1:]
                for p in parts:
                    if p == "*":
                        continue
                    self.check_ident(p, where, api=api, context=span)
                continue
            # a single identifier
            if not all_components and not call and not re.search(r"[A-Z_]", chain[1:] if chain else ""):
                continue  # a lowercase argument: a placeholder (i, error, ctx)
            if re.fullmatch(r"[a-z]+", chain) and not call and before.endswith(("in", "for")):
                continue
            if chain in ("for", "in", "auto", "const", "true", "false", "True", "False", "None",
                         "return", "import", "as", "null", "or", "and", "not"):
                continue
            self.check_ident(chain, where, context=span)

    # ---- JSON
    def check_json_keys(self, text, where_of, strict_keys=True):
        """Quoted strings: keys (not after ':') must be output keys; values with '|' are enums."""
        for m in re.finditer(r'"([^"\n]*)"', text):
            s = m.group(1)
            before = text[:m.start()].rstrip()
            where = where_of(m.start())
            if before.endswith(":"):
                if "|" in s:
                    for alt in s.split("|"):
                        if alt in self.c.lib_strings or alt in self.o.json_values:
                            self.ok("JSON enumerated values (string literals of lib/, include/)", alt)
                        else:
                            self.fail(where, f'JSON value "{alt}" (of "{s}") is not a string the library writes')
                continue
            if s in self.o.json_keys:
                self.ok("JSON keys (docs_dump: run.json, service.json)", s)
            else:
                self.fail(where, f'JSON key "{s}" is in no real output (run.json, service.json of docs_dump)')

    # ---- metrics
    def check_metric(self, name, labels, where, in_section):
        fam = name
        if fam in self.o.types or fam in self.o.samples:
            self.ok("metric names (prometheus_text of docs_dump's runs)", name)
        elif in_section or labels is not None:
            self.fail(where, f"metric `{name}` is not in prometheus_text's output (metrics.prom, service.prom)")
            return False
        else:
            return None
        for lab in labels or []:
            if not any(lab in s for s in self.o.family_samples(fam)):
                self.fail(where, f"metric `{name}` has no label `{lab}`")
            else:
                self.ok("metric labels", f"{name}{{{lab}}}")
        return True

    def check_prometheus_table(self, lines, start_line, end_line, display):
        for n in range(start_line, end_line):
            line = lines[n - 1]
            m = re.match(r"\|\s*`(splitflow_\w+)`\s*\|([^|]*)\|([^|]*)\|", line)
            if not m:
                continue
            name, typ, labels = m.group(1), m.group(2).strip(), m.group(3).strip()
            where = f"{display}:{n}"
            if name not in self.o.types:
                continue  # reported by the span check
            want = typ.split()[0] if typ else ""
            if want != self.o.types[name]:
                self.fail(where, f"metric `{name}` is documented as {want}, prometheus_text says {self.o.types[name]}")
            else:
                self.ok("metric types", f"{name} {want}")
            samples = self.o.family_samples(name)
            for part in labels.split(","):
                part = part.strip()
                if not part:
                    continue
                lab, _, vals = part.partition("=")
                lab = lab.strip()
                if not any(lab in s for s in samples):
                    self.fail(where, f"metric `{name}` has no label `{lab}`")
                    continue
                self.ok("metric labels", f"{name}{{{lab}}}")
                for v in (x.strip() for x in vals.split("/") if x.strip()):
                    if any(s.get(lab) == v for s in samples):
                        self.ok("metric label values", f"{name}{{{lab}={v}}}")
                    else:
                        self.fail(where, f"metric `{name}`: no sample has {lab}=\"{v}\"")

    # ---- trace
    def check_trace_span(self, span, where):
        o = self.o
        m = re.fullmatch(r"args:\s*\{([^}]*)\}", span)
        if m:
            for k in (x.strip() for x in m.group(1).split(",")):
                if k in o.trace_args:
                    self.ok("trace args keys (docs_dump: trace.json)", k)
                else:
                    self.fail(where, f"trace events have no arg `{k}`")
            return True
        m = re.fullmatch(r"\{([^}\"]*)\}", span)
        if m:
            for k in (x.strip() for x in m.group(1).split(",")):
                if k in o.trace_meta or k in o.trace_top:
                    self.ok("trace metadata keys (docs_dump: trace.json)", k)
                else:
                    self.fail(where, f"the trace has no metadata key `{k}`")
            return True
        if re.fullmatch(r"[A-Z]", span):
            if span in o.trace_phases:
                self.ok("trace phases", span)
            else:
                self.fail(where, f"no trace event has phase `{span}`")
            return True
        if re.fullmatch(r"[\w:]+(?: [\w:]+)*", span) and ("::" not in span):
            rx = placeholder_regex(span)
            pools = [o.trace_names, o.trace_processes, o.trace_args, o.trace_meta, o.trace_top,
                     o.trace_event_keys]
            if any(re.match(rx, x or "") for pool in pools for x in pool):
                self.ok("trace event names and keys (docs_dump: trace.json)", span)
                return True
            if " " in span or ":" in span:
                self.fail(where, f"no trace event, track or key is named `{span}`")
                return True
        return False


def check_names(root, docs, outputs, verbose):
    corpus = Corpus(root)
    nc = NameChecker(root, corpus, outputs, verbose)
    link_problems = []
    for path in docs:
        display = rel(path, root)
        blocks, probs, prose, lines = parse_doc(path, display)
        starts = [0]
        for i, ch in enumerate(prose):
            if ch == "\n":
                starts.append(i + 1)

        def line_of(off, starts=starts):
            lo, hi = 0, len(starts) - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if starts[mid] <= off:
                    lo = mid
                else:
                    hi = mid - 1
            return lo + 1

        headings = []  # (line, level, text)
        for n, l in enumerate(prose.split("\n"), 1):
            m = re.match(r"^(#{1,6})\s+(.*)$", l)
            if m:
                headings.append((n, len(m.group(1)), m.group(2)))

        def section(n):
            """The headings in force at line n, outermost first."""
            stack = []
            for hl, lvl, txt in headings:
                if hl > n:
                    break
                stack = [s for s in stack if s[0] < lvl] + [(lvl, txt)]
            return [t for _, t in stack]

        # Text blocks: paths; a JSON listing: its keys.
        for b in blocks:
            if b.lang in CPP_LANGS or b.lang in PY_LANGS:
                continue
            for k, l in enumerate(b.lines):
                nc.scan_paths(l, f"{display}:{b.first_line + k}")
                if b.lang in ("text", "") and re.search(r"\s\S+\.(hpp|cpp|cu|py)\b", l):
                    for tok in re.findall(r"(?<=\s)([\w/{},]+\.(?:hpp|cpp|cu|py))\b", l):
                        nc.check_path_token(tok, f"{display}:{b.first_line + k}")
            body = "\n".join(b.lines)
            if b.lang in ("text", "json") and body.lstrip().startswith("{") and '"' in body:
                offs = [0]
                for i, ch in enumerate(body):
                    if ch == "\n":
                        offs.append(i + 1)
                first = b.first_line
                nc.check_json_keys(body, lambda off, offs=offs, first=first: f"{display}:{first + sum(1 for o in offs if o <= off) - 1}")
        # Prose: links, paths, spans.
        for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", prose):
            target = m.group(1)
            where = f"{display}:{line_of(m.start())}"
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            tpath = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            if not os.path.exists(tpath):
                nc.fail(where, f"link target `{target}` does not exist")
                continue
            nc.ok("link targets", target)
            if anchor and tpath.endswith(".md"):
                with open(tpath, encoding="utf-8") as f:
                    slugs = {heading_slug(h) for h in re.findall(r"(?m)^#{1,6}\s+(.*)$", f.read())}
                if anchor in slugs:
                    nc.ok("link anchors (headings)", target)
                else:
                    nc.fail(where, f"link `{target}`: no heading `#{anchor}` in {rel(tpath, root)}")
        for n, l in enumerate(prose.split("\n"), 1):
            nc.scan_paths(re.sub(r"`[^`]*`", " ", l), f"{display}:{n}")
        for m in re.finditer(r"`([^`]+)`", prose):
            span = re.sub(r"\s+", " ", m.group(1)).strip()
            n = line_of(m.start())
            where = f"{display}:{n}"
            sec = section(n)
            if span in ALLOW:
                nc.ok("allowed (ALLOW, with a reason)", span)
                continue
            # paths inside the span (commands too)
            for tok in span.split():
                if "/" in tok or re.search(r"\.(%s)$" % "|".join(SOURCE_EXTS), tok):
                    nc.check_path_token(tok.split("=", 1)[-1] if tok.startswith(("PYTHONPATH=", "OUT=")) else tok, where)
            if span.startswith("<!--"):
                nc.not_names.append((where, span))  # markup
                continue
            mk = re.fullmatch(r"make ([\w-]+)", span)
            if mk:
                if mk.group(1) in corpus.make_targets:
                    nc.ok("make targets (the Makefile)", span)
                else:
                    nc.fail(where, f"`{span}`: the Makefile has no target {mk.group(1)}")
                continue
            for bm in re.finditer(r"(?:^|\s)build/[\w-]+/(benchmarks|examples|tests)/(\w+)(?=\s|$)", span):
                if any(os.path.exists(os.path.join(root, bm.group(1), bm.group(2) + ext)) for ext in (".cpp", ".py")):
                    nc.ok("programs of the build tree (their sources)", f"{bm.group(1)}/{bm.group(2)}")
                else:
                    nc.fail(where, f"`{span}`: no source {bm.group(1)}/{bm.group(2)}.cpp builds this program")
            if re.match(r"^(make|cmake|ctest|PYTHONPATH=|OUT=|/usr/bin/|build/|scripts/|"
                        r"benchmarks/|examples/|tests/|lib/|include/|docs/|python/|<prefix>|\.\./|--)", span):
                if not span.startswith(KNOWN_DIRS):
                    nc.not_names.append((where, span))  # a command or a build path (its paths checked)
                continue
            if re.search(r"(^|/)[\w.{},-]+\.(json|png|tgz|so|a|%s)$" % "|".join(SOURCE_EXTS), span) or span.endswith("/"):
                if not re.search(r"\.(%s)$" % "|".join(SOURCE_EXTS), span) and not span.startswith(KNOWN_DIRS):
                    nc.not_names.append((where, span))  # an output file or a build folder
                continue  # a file name: checked as a path above
            if " --" in span or re.match(r"[A-Z_]+=\S+ ", span):  # a command: its program
                prog = next((t for t in span.split() if "=" not in t), "")
                if re.fullmatch(r"\w+", prog):
                    nc.check_ident(prog, where, context=span)
                continue
            if re.fullmatch(r"_[A-Z][A-Z0-9_]*", span):  # the end of a name listed before it
                if any(x.endswith(span) for x in corpus.all):
                    nc.ok("name endings (`SPLITFLOW_VERSION_MAJOR`, `_MINOR`)", span)
                else:
                    nc.fail(where, f"`{span}`: no name of the code ends so")
                continue
            if "*" in span and re.fullmatch(r"[\w*]+", span):  # a family of names: ranker_*_ms
                rx = "^" + re.escape(span).replace("\\*", r"\w*") + "$"
                if any(re.match(rx, x) for x in corpus.all):
                    nc.ok("name families (`ranker_*_ms`)", span)
                else:
                    nc.fail(where, f"`{span}`: no name of the code matches")
                continue
            # test names
            tm = re.fullmatch(r"([A-Z]\w*)\.([A-Z]\w*[a-z]\w*)(\.\.\.)?", span)
            if tm:
                name = f"{tm.group(1)}.{tm.group(2)}"
                if tm.group(3):
                    found = any(t.startswith(name) for t in corpus.tests)
                else:
                    found = name in corpus.tests
                if found:
                    nc.ok("test names (TEST/TEST_F in tests/*.cpp)", span)
                else:
                    nc.fail(where, f"`{span}`: no test of tests/*.cpp is named so")
                continue
            cm = re.fullmatch(r"([a-z_]+)\.([a-z_]+)", span)
            if cm and cm.group(1) in corpus.ctest_prefixes:
                if span in corpus.ctest:
                    nc.ok("ctest names (add_test in the CMake files)", span)
                else:
                    nc.fail(where, f"`{span}`: no ctest test is named so")
                continue
            if re.fullmatch(r"test_\w+", span):
                if span in corpus.py_tests or span in corpus.cpp_test_binaries:
                    nc.ok("test functions and binaries", span)
                else:
                    nc.fail(where, f"`{span}`: no Python test function or C++ test binary is named so")
                continue
            # metrics
            mm = re.fullmatch(r"(splitflow_\w+)(?:\{([^}]*)\})?", span)
            if mm:
                labels = [x.strip() for x in mm.group(2).split(",")] if mm.group(2) is not None else None
                in_prom = any("Prometheus" in h for h in sec)
                r = nc.check_metric(mm.group(1), labels, where, in_prom)
                if r is not None:
                    continue
            if re.fullmatch(r"_(count|sum|bucket)", span):
                if any(s.endswith(span) for s in outputs.samples):
                    nc.ok("metric names (prometheus_text of docs_dump's runs)", span)
                else:
                    nc.fail(where, f"no metric sample ends with `{span}`")
                continue
            # trace
            if any(h.startswith("Chrome trace") for h in sec) and nc.check_trace_span(span, where):
                continue
            # JSON
            if span.startswith("{\"") or re.fullmatch(r'"\w+"', span) and any("JSON" in h for h in sec):
                nc.check_json_keys(span, lambda off, where=where: where)
                continue
            if re.fullmatch(r'"[^"]*"', span):
                s = span.strip('"')
                if s in corpus.all or s in outputs.json_keys or s in corpus.lib_strings:
                    nc.ok("string values (literals of the code)", s)
                else:
                    nc.fail(where, f"`{span}` is not a string of the code")
                continue
            # prose-like spans: not names
            if re.search(r"[A-Za-z]{2,} [A-Za-z]{2,} [A-Za-z]{2,}", span) and not re.search(r"[(){}:=<]", span):
                nc.not_names.append((where, span))
                continue
            if re.fullmatch(r"[^A-Za-z_]*", span) or re.search(r"[A-Za-z]-[A-Za-z]", span) and "(" not in span:
                nc.not_names.append((where, span))
                continue
            if re.fullmatch(r"[A-Z]+_[A-Z_]+=.*", span):
                nc.check_ident(span.split("=")[0], where, context=span)
                continue
            if re.fullmatch(r"BM_\w+(/\w+)?", span):
                nc.check_ident(span.split("/")[0], where, context=span)
                continue
            nc.check_code(span, where)
        # The Prometheus table: types and labels.
        prom = [h for h in headings if "Prometheus" in h[2]]
        for h in prom:
            following = [x for x in headings if x[0] > h[0] and x[1] <= h[1]]
            end = following[0][0] if following else len(lines) + 1
            nc.check_prometheus_table(lines, h[0], end, display)
        # Quoted process names in the trace table.
        for h in [h for h in headings if h[2].startswith("Chrome trace")]:
            following = [x for x in headings if x[0] > h[0] and x[1] <= h[1]]
            end = following[0][0] if following else len(lines) + 1
            for n in range(h[0], end):
                mm = re.match(r'\|\s*\d+\s+"([^"]+)"\s*\|', lines[n - 1])
                if mm:
                    rx = placeholder_regex(mm.group(1))
                    if any(re.match(rx, p) for p in outputs.trace_processes):
                        nc.ok("trace process names (docs_dump: trace.json)", mm.group(1))
                    else:
                        nc.fail(f"{display}:{n}", f'no trace process is named "{mm.group(1)}"')
    return nc


def make_outputs(args, tmp):
    if args.outputs:
        return Outputs(os.path.abspath(args.outputs))
    if not args.dump:
        raise SystemExit("check_docs names: give --dump DOCS_DUMP_EXE or --outputs DIR")
    out = os.path.join(tmp, "outputs")
    subprocess.run([os.path.abspath(args.dump), out], check=True, capture_output=True, timeout=120)
    return Outputs(out)


def cmd_names(args, docs=None, quiet=False):
    root = os.path.abspath(args.root)
    docs = docs or ([os.path.abspath(d) for d in args.docs] if args.docs else doc_files(root))
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="check_docs_names_") as tmp:
        outputs = make_outputs(args, tmp)
        nc = check_names(root, docs, outputs, args.verbose)
    if not quiet:
        total = sum(len(v) for v in nc.checked.values())
        print(f"check_docs names: {total} distinct names checked in {len(docs)} docs ({time.time() - t0:.1f} s):")
        for kind in sorted(nc.checked):
            names = sorted(nc.checked[kind])
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            print(f"  {len(names):4d} {kind}: {shown}")
        print(f"  not names: {len(nc.not_names)} spans taken for prose, commands, output files or build folders"
              + ("" if args.verbose else " (-v lists them)"))
        if args.verbose:
            for where, span in nc.not_names:
                print(f"    {where}: `{span}`")
    for p in nc.problems:
        print("FAIL " + p)
    if nc.problems:
        print(f"check_docs names: {len(nc.problems)} problem(s)")
    return nc.problems


# --------------------------------------------------------------------------------------------
# Self-test
# --------------------------------------------------------------------------------------------
BROKEN = '''
## Broken on purpose (check_docs self-test)

<!-- snippet: fragment graph -->
```cpp
auto src = g.source("n", std::views::iota(0, 3));
int wrong = g;  // BROKEN-CPP: a Graph is not an int
```

```python
import splitflow as sf
raise RuntimeError("BROKEN-PY")
```

<!-- snippet: fragment main -->
```cpp
throw std::runtime_error("BROKEN-THROW");
```

```cpp
#include <cstdio>
int main(int argc, char**) { std::printf("INTACT-PROGRAM %d\\n", argc); return 0; }
```

```cpp
splitflow::Runtime rt;  // BROKEN-UNMARKED: a fragment without its marker
```

<!-- snippet: skip -->
```python
print("BROKEN-SKIP: a skip without its reason")
```

```
BROKEN-NOLANG: a block without a language
```

Stale: `Trace.EventsAgreeWithTheStats` (BROKEN-TEST), `lib/nope.cpp` (BROKEN-PATH),
`GraphOptions::no_such_option` (BROKEN-CPPNAME), `sf.ops.no_such_op` (BROKEN-PYNAME),
`splitflow_no_such_metric_total{graph}` (BROKEN-METRIC), `layers.nope` (BROKEN-CTEST),
[a link](#no-such-heading) (BROKEN-ANCHOR), `{"graph", "no_such_service_key"}` (BROKEN-KEY2).

Out of order: `GraphOptions{.trace, .max_in_flight}` (BROKEN-ORDER).
'''


def cmd_self_test(args):
    root = os.path.abspath(args.root)
    src = os.path.join(root, "docs", "telemetry.md")
    with open(src, encoding="utf-8") as f:
        text = f.read()
    # A stale JSON key in the listing, a stale trace event and a stale metric type in the tables.
    assert '"schema_version"' in text and "`copy D2H`" in text and "| `splitflow_device_leases` | gauge |" in text
    text = text.replace('  "schema_version"', '  "no_such_key": int (BROKEN-KEY),\n  "schema_version"', 1)
    text = text.replace("`copy D2H`", "`copy D2H` or `copy P2P` (BROKEN-TRACE)", 1)
    text = text.replace("| `splitflow_device_leases` | gauge |",
                        "| `splitflow_device_leases` | counter (BROKEN-TYPE) |", 1)
    text += BROKEN
    with tempfile.TemporaryDirectory(prefix="check_docs_self_test_") as tmp:
        os.makedirs(os.path.join(tmp, "docs"))
        copy = os.path.join(tmp, "docs", "selftest.md")
        with open(copy, "w", encoding="utf-8") as f:
            f.write(text)
        lines = text.split("\n")

        def line_of(tag, after_fence=False):
            for n, l in enumerate(lines, 1):
                if tag in l:
                    if after_fence:  # the block's fence line: the last fence above it
                        k = n
                        while not lines[k - 1].lstrip().startswith("```"):
                            k -= 1
                        return k
                    return n
            raise AssertionError(tag)

        # The copy lives beside the real docs for the checks' sake (paths, links): a symlinked
        # tree whose docs/ has the one file.
        shadow = os.path.join(tmp, "root")
        os.makedirs(shadow)
        for name in os.listdir(root):
            if name not in ("docs", "build") and not name.startswith("."):
                os.symlink(os.path.join(root, name), os.path.join(shadow, name))
        os.makedirs(os.path.join(shadow, "docs"))
        for name in os.listdir(os.path.join(root, "docs")):
            os.symlink(os.path.join(root, "docs", name), os.path.join(shadow, "docs", name))
        os.symlink(copy, os.path.join(shadow, "docs", "selftest.md"))
        cmd = [sys.executable, os.path.abspath(__file__)]
        common = ["--root", shadow, "--docs", os.path.join(shadow, "docs", "selftest.md")]
        t0 = time.time()
        snip = subprocess.run(cmd + ["snippets"] + common + ["--build-dir", args.build_dir, "--like", args.like,
                                                             "--timeout", str(args.timeout)]
                              + (["--python-path", args.python_path] if args.python_path else []),
                              capture_output=True, text=True)
        t_snip = time.time() - t0
        names_args = ["--outputs", args.outputs] if args.outputs else ["--dump", args.dump]
        names = subprocess.run(cmd + ["names"] + common + names_args, capture_output=True, text=True)
        doc = "docs/selftest.md"
        expect_snip = {
            "broken C++ (does not compile)": (f"FAIL {doc}:{line_of('BROKEN-CPP', True)}",
                                              f"{doc}:{line_of('BROKEN-CPP')}:"),
            "Python block that raises": (f"FAIL {doc}:{line_of('BROKEN-PY', True)}", "BROKEN-PY"),
            "C++ block that throws": (f"FAIL {doc}:{line_of('BROKEN-THROW', True)}", "BROKEN-THROW"),
            "C++ fragment without a marker": (f"FAIL {doc}:{line_of('BROKEN-UNMARKED', True)}", "without int main"),
            "skip without a reason": (f"FAIL {doc}:{line_of('BROKEN-SKIP', True) - 1}", "reason"),
            "block without a language": (f"FAIL {doc}:{line_of('BROKEN-NOLANG', True)}", "without a language"),
            "a complete program runs": (f"ok   {doc}:{line_of('INTACT-PROGRAM', True)}", "compiled, ran"),
            "the intact snippet still runs": (f"ok   {doc}:{line_of('splitflow::Runtime rt;                                   // telemetry on', True)}", "compiled, ran"),
        }
        expect_names = {
            "stale test name": (f"FAIL {doc}:{line_of('BROKEN-TEST')}", "Trace.EventsAgreeWithTheStats"),
            "stale path": (f"FAIL {doc}:{line_of('BROKEN-PATH')}", "lib/nope.cpp"),
            "stale C++ name": (f"FAIL {doc}:{line_of('BROKEN-CPPNAME')}", "no_such_option"),
            "stale Python name": (f"FAIL {doc}:{line_of('BROKEN-PYNAME')}", "no_such_op"),
            "stale metric": (f"FAIL {doc}:{line_of('BROKEN-METRIC')}", "splitflow_no_such_metric_total"),
            "stale ctest name": (f"FAIL {doc}:{line_of('BROKEN-CTEST')}", "layers.nope"),
            "stale anchor": (f"FAIL {doc}:{line_of('BROKEN-ANCHOR')}", "no-such-heading"),
            "stale JSON key (listing)": (f"FAIL {doc}:{line_of('BROKEN-KEY')}", "no_such_key"),
            "stale JSON key (prose)": (f"FAIL {doc}:{line_of('BROKEN-KEY2')}", "no_such_service_key"),
            "stale trace event": (f"FAIL {doc}:{line_of('BROKEN-TRACE')}", "copy P2P"),
            "stale metric type": (f"FAIL {doc}:{line_of('BROKEN-TYPE')}", "splitflow_device_leases"),
            "designated initializer out of order": (f"FAIL {doc}:{line_of('BROKEN-ORDER')}",
                                                    "out of their declaration order"),
        }
        failures = []
        for label, proc, expect in (("snippets", snip, expect_snip), ("names", names, expect_names)):
            if proc.returncode == 0:
                failures.append(f"check_docs {label} passed on the broken copy")
            out = proc.stdout + proc.stderr
            for what, (prefix, needle) in expect.items():
                hit = any(l.startswith(prefix) and needle in l for l in out.splitlines()) or any(
                    l.startswith(prefix) for l in out.splitlines()) and needle in out
                if hit:
                    print(f"ok   {label}: {what}: reported as {prefix[5:].strip()}")
                else:
                    failures.append(f"{label}: {what}: expected a line starting '{prefix}' mentioning '{needle}'")
            # nothing else of the copy may fail: the intact parts of telemetry.md pass
            tags = [v[0] for v in expect.values()]
            for l in out.splitlines():
                if l.startswith("FAIL ") and not any(l.startswith(t) for t in tags):
                    failures.append(f"{label}: an unexpected failure: {l}")
        if failures or args.verbose:
            print("---- snippets output ----\n" + snip.stdout + snip.stderr)
            print("---- names output ----\n" + names.stdout + names.stderr)
        print(f"check_docs self-test: snippets on the copy took {t_snip:.1f} s")
        for f_ in failures:
            print("FAIL self-test: " + f_)
        if failures:
            return failures
        print("check_docs self-test: every planted breakage was reported with its file and line")
        return []


def cmd_fillers(_args):
    print("C++ fillers (<!-- snippet: fragment NAME... -->; one wrapper at most):")
    for k, v in CPP_FILLERS.items():
        print(f"  {k:10s} {'wrapper: ' if 'wrap' in v else ''}{v['doc']}")
    print("Python fillers:")
    for k, v in PY_FILLERS.items():
        print(f"  {k:10s} {v['doc']}")
    return []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["snippets", "names", "self-test", "fillers"])
    ap.add_argument("--root", default=DEFAULT_ROOT, help="the repository (default: this script's)")
    ap.add_argument("--build-dir", help="a configured and built build tree (snippets)")
    ap.add_argument("--like", default="telemetry_dump",
                    help="a program target of the build tree linked as snippets must be (default: telemetry_dump)")
    ap.add_argument("--python-path", help="prepended to PYTHONPATH for Python blocks "
                    "(default: BUILD_DIR/python when it holds the module)")
    ap.add_argument("--dump", help="the docs_dump program (names)")
    ap.add_argument("--outputs", help="a directory docs_dump wrote (names), instead of --dump")
    ap.add_argument("--docs", nargs="*", help="the docs to check (default: README.md docs/*.md)")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per snippet run")
    ap.add_argument("--keep", help="snippets: copy the generated translation unit into this directory")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    if args.mode in ("snippets", "self-test") and not args.build_dir:
        ap.error(f"{args.mode} needs --build-dir")
    if args.mode in ("names", "self-test") and not (args.dump or args.outputs):
        ap.error(f"{args.mode} needs --dump or --outputs")
    problems = {"snippets": cmd_snippets, "names": cmd_names, "self-test": cmd_self_test,
                "fillers": cmd_fillers}[args.mode](args)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
