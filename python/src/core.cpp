// splitflow._core: graphs of Python callables and C++ ops, run by the C++ runtime.
//
// GIL discipline: C++ stages and ops run without the GIL; a Python stage takes it only around
// its call. Every call that can wait (Run.wait, a pull sink's next, destroying a graph or a
// runtime) releases the GIL first, so Python stages on arena threads can always proceed.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <climits>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <splitflow/ops/image.hpp>
#include <splitflow/ops/ops.hpp>
#include <splitflow/splitflow.hpp>

#include "values.hpp"

namespace splitflow::python {

namespace {

using namespace std::chrono_literals;

// ---- errors --------------------------------------------------------------------------------

PyObject* g_stage_error = nullptr;  // splitflow.StageError (python/splitflow/_errors.py)
// splitflow.Error, GraphError, StageError, OverloadedError, DeadlineError, CancelledError: kept
// for the process.
PyObject* g_error_types[6] = {};
PyObject* g_remote_exception = nullptr;  // splitflow._errors.RemoteException (not an Error)

/// A Python exception raised in a Python stage, carried through the C++ run: a
/// PythonStageError, or a PythonStopRequest for a KeyboardInterrupt or SystemExit (a request to
/// stop, which no on_error policy absorbs). Caught as this base.
class PythonException {
 public:
  explicit PythonException(PyObj exc) : exc_(std::move(exc)) {}
  virtual ~PythonException() = default;
  const PyObj& exception() const noexcept { return exc_; }

 private:
  PyObj exc_;
};

class PythonStageError : public Error, public PythonException {
 public:
  PythonStageError(std::string what, PyObj exc) : Error(std::move(what)), PythonException(std::move(exc)) {}
};

class PythonStopRequest : public StopRequest, public PythonException {
 public:
  PythonStopRequest(std::string what, PyObj exc)
      : StopRequest(std::move(what)), PythonException(std::move(exc)) {}
};

/// The C++ exception carrying Python's `exc` (raised by a stage's body) through the run.
std::exception_ptr carry_python(std::string what, PyObj exc) {
  if (!PyObject_IsInstance(exc.get().ptr(), PyExc_Exception))  // KeyboardInterrupt, SystemExit...
    return std::make_exception_ptr(PythonStopRequest(std::move(what), std::move(exc)));
  return std::make_exception_ptr(PythonStageError(std::move(what), std::move(exc)));
}

/// Runs a Python call (with the GIL held) and turns a Python exception into PythonStageError.
template <class F>
auto call_python(F&& f) {
  try {
    return f();
  } catch (py::error_already_set& e) {
    std::string what = std::string(py::str(e.type().attr("__name__"))) + ": " + py::str(e.value()).cast<std::string>();
    // The exception keeps its traceback (the user's raising line), which fetching it dropped.
    if (e.trace() && !e.trace().is_none()) PyException_SetTraceback(e.value().ptr(), e.trace().ptr());
    PyObj exc(py::reinterpret_borrow<py::object>(e.value()));
    std::rethrow_exception(carry_python(std::move(what), std::move(exc)));
  }
}

py::object python_error(std::exception_ptr p);

/// A C++ op's exception nested in a StageError as the Python StageError's `__cause__`: the
/// matching splitflow error (sf.Error for an op's refusal), as a Python body's own exception is
/// (a verification trial: a C++ op's StageError had no __cause__, which docs/api.md promised).
void set_cpp_cause(const py::object& exc, std::exception_ptr nested) {
  try {
    PyException_SetCause(exc.ptr(), python_error(std::move(nested)).release().ptr());  // steals
  } catch (const py::error_already_set&) {  // the error type would not build: no cause
    PyErr_Clear();
  }
}

/// Raises splitflow.StageError for `e`, its cause (`__cause__`) the original Python exception
/// when a Python stage raised it, the matching splitflow error when a C++ op did.
[[noreturn]] void raise_stage_error(const StageError& e) {
  py::object exc = py::reinterpret_borrow<py::object>(g_stage_error)(e.what(), e.graph(), e.stage(),
                                                                      e.item(), e.message());
  try {
    std::rethrow_if_nested(e);
  } catch (const PythonException& inner) {
    py::object cause = inner.exception().get();
    // KeyboardInterrupt, SystemExit: not errors of the item but requests to stop; they reach
    // the caller as themselves (the run was cancelled), not wrapped in a StageError.
    if (!PyObject_IsInstance(cause.ptr(), PyExc_Exception)) {
      // A fresh one of its type and arguments is raised, not the object the run keeps: raising
      // that one would chain the caller's frames to its traceback, and those frames (holding
      // the graph, which holds the run's error) would never be collected: a cycle through C++
      // (a new user's trial leaked a graph, its workers and 16 descriptors per raise).
      // Its cause, context, notes and attributes go with it (a SystemExit's code, say).
      PyObject* fresh = PyObject_Call(reinterpret_cast<PyObject*>(Py_TYPE(cause.ptr())),
                                      py::getattr(cause, "args").ptr(), nullptr);
      if (fresh && PyExceptionInstance_Check(fresh)) {
        py::object f = py::reinterpret_steal<py::object>(fresh);
        try {
          for (const char* a : {"__traceback__", "__cause__", "__context__", "__suppress_context__"})
            py::setattr(f, a, py::getattr(cause, a));
          if (py::hasattr(cause, "__dict__")) f.attr("__dict__").attr("update")(cause.attr("__dict__"));
        } catch (const py::error_already_set&) {  // a type that refuses them: as they came
        }
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(f.ptr())), f.ptr());
      } else {  // its type takes other arguments: the kept one, as before
        Py_XDECREF(fresh);
        PyErr_Clear();
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(cause.ptr())), cause.ptr());
      }
      throw py::error_already_set();
    }
    PyException_SetCause(exc.ptr(), cause.release().ptr());  // steals
  } catch (const py::error_already_set&) {
    throw;
  } catch (...) {
    set_cpp_cause(exc, std::current_exception());
  }
  PyErr_SetObject(g_stage_error, exc.ptr());
  throw py::error_already_set();
}

/// The Python exception object for a request's error (with the GIL): the user's own exception
/// when a Python stage raised it, splitflow's matching error class otherwise.
py::object python_error(std::exception_ptr p) {
  auto make = [](int type, const char* what) {
    return py::reinterpret_borrow<py::object>(g_error_types[type])(what);
  };
  try {
    std::rethrow_exception(p);
  } catch (const PythonException& e) {
    return e.exception().get();
  } catch (const StageError& e) {
    py::object exc = py::reinterpret_borrow<py::object>(g_stage_error)(
        e.what(), e.graph(), e.stage(), e.item(), e.message());
    try {
      std::rethrow_if_nested(e);
    } catch (const PythonException& inner) {
      PyException_SetCause(exc.ptr(), inner.exception().get().release().ptr());  // steals
    } catch (...) {
      set_cpp_cause(exc, std::current_exception());
    }
    return exc;
  } catch (const GraphError& e) {
    return make(1, e.what());
  } catch (const OverloadedError& e) {
    return make(3, e.what());
  } catch (const DeadlineError& e) {
    return make(4, e.what());
  } catch (const CancelledError& e) {
    return make(5, e.what());
  } catch (const std::exception& e) {
    return make(0, e.what());
  } catch (...) {
    return make(0, "splitflow: an unknown error");
  }
}

// ---- runtime, graph, nodes ---------------------------------------------------------------------

struct PyGraph;
/// Whether `g`'s run is still going once the interpreter exits (RunRegistry::shut_down left it:
/// a body inside a call that runs no bytecode): the graph is then never destroyed, as its
/// destructor would wait for that run. Other objects wait for none.
bool left_running_at_exit(const PyGraph* g) noexcept;
template <class T>
bool left_running_at_exit(const T*) noexcept {
  return false;
}

/// Deletes with the GIL released when the deleting thread holds it: destructors that wait for
/// runs must let the runs' Python stages take the GIL.
template <class T>
std::shared_ptr<T> make_released(std::unique_ptr<T> p) {
  return std::shared_ptr<T>(p.release(), [](T* x) {
    if (left_running_at_exit(x)) return;  // (leaked at exit: see left_running_at_exit)
    if constexpr (requires { x->before_release(); })
      if (PyGILState_Check()) x->before_release();
    if constexpr (requires { x->deleted_behind(); })
      if (x->deleted_behind()) return;
    if (PyGILState_Check()) {
      NoGil nogil;
      delete x;
    } else {
      delete x;
    }
  });
}

/// oneTBB's worker threads do not survive fork(): a child of a process whose runs had started
/// them would hang in its first arena. Creating a Runtime starts none (its arena's threads come
/// with its first run), so a process that only made one may fork. Refuse, loudly, a Runtime or
/// a run in a child of a process that had run graphs, instead of hanging.
std::atomic<pid_t> g_threads_started_in{0};  // the process whose first run started them; 0: none

void check_not_forked_after_tbb() {
  const pid_t started = g_threads_started_in.load();
  if (started != 0 && started != getpid())
    throw Error(
        "splitflow.Runtime: this process was forked from one (pid " + std::to_string(started) +
        ") that had already run splitflow graphs, which started its thread pool (oneTBB's "
        "threads do not survive fork()); create the DataLoader with "
        "multiprocessing_context='spawn' (or 'forkserver'), or fork before running graphs "
        "(creating a Runtime before the fork is fine)");
}

/// Before a run starts: the thread pool is this process's from now on.
void starting_a_run() {
  check_not_forked_after_tbb();
  pid_t none = 0;
  g_threads_started_in.compare_exchange_strong(none, getpid());
}

struct PyRuntime {
  explicit PyRuntime(RuntimeConfig c) : rt((check_not_forked_after_tbb(), c)) {}
  Runtime rt;
};

/// Cancels `run`, through `sink`'s close() when given and the run is going (that run is then
/// the graph's current one: the readers of its other pull sinks are told who stopped it).
/// Without the GIL.
void cancel_through(const Run& run, const PullSink<Value>* sink) noexcept {
  if (sink && run.status() == RunStatus::running) sink->close();
  run.cancel();
}

/// Cancels `run` and waits for it to end; its error, if any, is not raised (the caller is
/// abandoning the run). Call without the GIL: its Python stages may need it to finish.
void drain(const Run& run) noexcept {
  run.cancel();
  try {
    run.wait();
  } catch (...) {
  }
}

struct BodyThreads;

/// Runs started from Python, so that interpreter exit can cancel and drain them.
struct RunRegistry {
  struct Entry {
    Run run;
    std::weak_ptr<BodyThreads> bodies;  // its graph's Python bodies running now
  };
  std::mutex mu;
  std::vector<Entry> runs;
  bool shut = false;  // after shut_down(): a run that started meanwhile is cancelled at once
  void add(const Run& r, std::weak_ptr<BodyThreads> bodies) {
    {
      std::lock_guard lk(mu);
      if (!shut) {
        std::erase_if(runs, [](const Entry& x) { return x.run.status() != RunStatus::running; });
        runs.push_back({r, std::move(bodies)});
        return;
      }
    }
    r.cancel();
  }
  /// A cancelled run's Python bodies get this long to return at interpreter exit before they
  /// are interrupted (KeyboardInterrupt at their next bytecode, as Ctrl-C does in a loop), and
  /// as long again after that before the run is left behind.
  static constexpr std::chrono::seconds kExitGrace{2};
  /// Interpreter exit, once the exit gate is closed (no new runs, no Python on splitflow's
  /// threads): cancels every run (all first, so that they stop together), lets them end, and
  /// waits for the threads still inside the gate (Python stages finishing their call; readers
  /// woken by the cancel go to sleep). Python bodies still running after kExitGrace are
  /// interrupted: a body that never returns (a service's model stuck in a loop) held the
  /// process at exit for ever, Ctrl-C included (a new user's trial). A body inside a call that
  /// runs no bytecode (time.sleep, a blocking read, C code) cannot be interrupted: its run is
  /// left behind kExitGrace later, named on stderr, and the process exits without it (before,
  /// it waited for that call: for ever for a hung one). Should that call return while the
  /// interpreter finalises, CPython's own code takes the GIL back and Python 3.11 ends the
  /// thread mid-C++ (values.hpp, NoGil), which can abort the process: leaving a run is the last
  /// resort, 4 s after the cancel. Without the GIL.
  void shut_down();
};
RunRegistry& registry() {
  static auto* r = new RunRegistry;  // never destroyed: used at interpreter exit
  return *r;
}

/// The threads running a graph's Python stage bodies now, so that Ctrl-C can interrupt them
/// (each gets a KeyboardInterrupt at its next bytecode, as the main thread would) instead of
/// the run waiting for them to return. Used only with the GIL held: the GIL is its lock.
struct BodyThreads {
  struct Running {
    int n = 0;                          // bodies running on the thread (nested: > 1)
    const std::string* who = nullptr;   // the outermost's "stage 'x' of graph 'g'" (null: unnamed)
  };
  std::unordered_map<unsigned long, Running> running;  // thread id -> its bodies
  std::unordered_set<unsigned long> interrupted;

  /// Raises KeyboardInterrupt in every thread running a body of the graph (with the GIL).
  void interrupt() {
    for (const auto& [tid, r] : running)
      if (r.n > 0 && PyThreadState_SetAsyncExc(tid, PyExc_KeyboardInterrupt) > 0) interrupted.insert(tid);
  }
  /// The bodies running now, named once each: "stage 'x' of graph 'g' (2 bodies)" (with the GIL).
  std::string names() const {
    std::vector<std::pair<std::string, int>> seen;
    for (const auto& [tid, r] : running) {
      if (r.n <= 0) continue;
      const std::string who = r.who && !r.who->empty() ? *r.who : "a Python body";
      auto it = std::find_if(seen.begin(), seen.end(), [&](const auto& p) { return p.first == who; });
      if (it == seen.end()) seen.emplace_back(who, 1); else ++it->second;
    }
    std::sort(seen.begin(), seen.end());
    std::string out;
    for (const auto& [who, n] : seen)
      out += (out.empty() ? "" : ", ") + who + (n > 1 ? " (" + std::to_string(n) + " bodies)" : "");
    return out;
  }
};

/// Cancels `runs` (all first, so that they stop together) and lets them end for up to
/// RunRegistry::kExitGrace; true if some still run then. Without the GIL.
bool still_running_after_grace(std::span<RunRegistry::Entry> runs) {
  for (auto& e : runs) e.run.cancel();
  const auto grace = std::chrono::steady_clock::now() + RunRegistry::kExitGrace;
  bool late = false;
  for (auto& e : runs) {
    const auto left = grace - std::chrono::steady_clock::now();
    late = !e.run.wait_for(std::max<std::chrono::nanoseconds>(left, std::chrono::nanoseconds(0))) || late;
  }
  return late;
}

/// Interrupts the Python bodies of those of `runs` still running (with the GIL).
void interrupt_bodies(std::span<RunRegistry::Entry> runs) {
  for (auto& e : runs)
    if (auto b = e.bodies.lock(); b && e.run.status() == RunStatus::running) b->interrupt();
}

void RunRegistry::shut_down() {
  std::vector<Entry> copy;
  {
    std::lock_guard lk(mu);
    copy.swap(runs);
    shut = true;
  }
  std::string left;  // the bodies of the runs left behind
  if (still_running_after_grace(copy)) {
    std::vector<std::string> names(copy.size());
    {
      py::gil_scoped_acquire gil;  // (the exit gate is closed: WithGil would not take it)
      interrupt_bodies(copy);
      for (std::size_t i = 0; i < copy.size(); ++i)
        if (auto b = copy[i].bodies.lock()) names[i] = b->names();
    }
    const auto grace = std::chrono::steady_clock::now() + kExitGrace;
    for (std::size_t i = 0; i < copy.size(); ++i) {
      const auto rest = std::max<std::chrono::nanoseconds>(grace - std::chrono::steady_clock::now(), 0ns);
      if (!copy[i].run.wait_for(rest))
        left += (left.empty() ? "" : ", ") + (names[i].empty() ? std::string("a body") : names[i]);
    }
  }
  for (auto& e : copy)
    if (e.run.status() != RunStatus::running) drain(e.run);
  if (!left.empty()) {
    std::fprintf(stderr,
                 "splitflow: exiting without waiting for %s: cancelled %lld s ago, still inside a "
                 "call that Python cannot interrupt (time.sleep, a blocking read, C code)\n",
                 left.c_str(), static_cast<long long>(2 * kExitGrace.count()));
    std::fflush(stderr);
  }
  exit_gate::wait_empty(left.empty() ? std::chrono::milliseconds(10s) : std::chrono::milliseconds(200ms));
}

/// A Python body running on this thread (construct and destroy with the GIL held). On leaving,
/// an interruption that arrived after the body's last bytecode is withdrawn, so that it cannot
/// reach other code on the thread.
class BodyScope {
 public:
  BodyScope(BodyThreads* t, const std::string* who) : t_(t), tid_(PyThread_get_thread_ident()) {
    if (!t_) return;
    auto& r = t_->running[tid_];
    if (r.n++ == 0) r.who = who;
  }
  ~BodyScope() {
    if (!t_) return;
    if (--t_->running[tid_].n == 0) t_->running.erase(tid_);
    if (t_->interrupted.erase(tid_)) PyThreadState_SetAsyncExc(tid_, nullptr);
  }
  BodyScope(const BodyScope&) = delete;
  BodyScope& operator=(const BodyScope&) = delete;

 private:
  BodyThreads* t_;
  unsigned long tid_;
};

/// A Python object that a graph's bodies call or iterate (a stage's function, a source's
/// iterable, a process pool), held once by the graph however often the C++ body holding it is
/// copied, so that the graph can report it to Python's cycle collector (Graph's tp_traverse).
struct Held {
  PyObj obj;
};
using HeldRef = std::shared_ptr<Held>;

struct PyNode;

struct PyGraph {
  PyGraph(std::shared_ptr<PyRuntime> r, std::string name, GraphOptions o)
      : runtime(std::move(r)), graph(runtime->rt, std::move(name), std::move(o)) {}
  std::shared_ptr<PyRuntime> runtime;  // outlives the graph
  std::shared_ptr<BodyThreads> bodies = std::make_shared<BodyThreads>();
  std::vector<std::weak_ptr<PyNode>> pulls;  // its pull sinks (run.wait() looks at their readers)
  /// What the bodies hold (before `graph`: destroying the graph waits for its run, whose
  /// bodies may still call these).
  std::vector<HeldRef> held;
  Graph graph;
  std::optional<Run> last_run;  // the latest run started from Python (run(), iterate())
  /// A run that Ctrl-C cancelled and left to end behind (end_on_ctrl_c): the graph's next run
  /// waits for it to end (wait_for_abandoned) rather than be refused as "already running".
  std::optional<Run> abandoned;

  /// Destroyed with its run going (its last reference dropped: a service's graph and run left
  /// in a function's locals): the run is cancelled, as Graph's destructor does, and Python
  /// bodies still running RunRegistry::kExitGrace later are interrupted, as at interpreter
  /// exit; a body stuck in a loop held the thread dropping the graph for ever (a verification
  /// trial). Without the GIL (make_released).
  ~PyGraph();

  /// Its last reference let go of with the GIL while its run goes on: the run is cancelled and
  /// waited for here, in slices that let Ctrl-C through (wait_in_slices); Python bodies still
  /// running RunRegistry::kExitGrace later are interrupted, and stderr says what it waits for.
  /// A Ctrl-C then leaves the run behind (end_on_ctrl_c; deleted_behind deletes the graph once
  /// it ends) and is raised at the next bytecode. Before, the destructor waited with no signal
  /// checks: for ever behind a body inside a call Python cannot interrupt (a verification
  /// trial: a function's graph, its run going, freed as the function returned).
  void before_release();

  /// Its last reference gone while a run that Ctrl-C left behind still runs (abandoned): the
  /// graph is deleted on a thread of its own once that run ends, rather than here (its
  /// destructor would wait for the run: for ever behind a hung body, the review of the Ctrl-C
  /// change found, e.g. a function's graph dropped as its KeyboardInterrupt is handled).
  /// True if so; from the last reference's thread, with or without the GIL.
  bool deleted_behind() {
    if (!abandoned || abandoned->status() != RunStatus::running) return false;
    std::thread([this, run = *abandoned] {
      try {
        run.wait();
      } catch (...) {
      }
      delete this;  // (its Python objects are dropped with the GIL, or left once exiting)
    }).detach();
    return true;
  }

  /// Holds `o` for a body (with the GIL).
  HeldRef hold(py::object o) {
    held.push_back(std::make_shared<Held>(Held{PyObj(std::move(o))}));
    return held.back();
  }
};

bool left_running_at_exit(const PyGraph* g) noexcept {
  return !exit_gate::open() && g->last_run && g->last_run->status() == RunStatus::running;
}

PyGraph::~PyGraph() {
  if (!last_run || last_run->status() != RunStatus::running) return;
  RunRegistry::Entry e{*last_run, bodies};
  if (!still_running_after_grace({&e, 1})) return;
  WithGil gil;
  if (gil) interrupt_bodies({&e, 1});
}

/// The graph a Python Graph object holds, if that object is its only owner and it is not
/// running: then what its bodies hold is reachable only through this object, and the cycle
/// collector may see (and break) a cycle through it, e.g. a bound method of the object that
/// holds the graph. Nodes, runs and iterators share the graph too; while any exists the graph
/// reports nothing (it is kept, as it may run).
PyGraph* solely_owned_graph(PyObject* self) {
  auto* inst = reinterpret_cast<py::detail::instance*>(self);
  auto vh = inst->get_value_and_holder();
  if (!vh.holder_constructed()) return nullptr;
  const auto& holder = vh.holder<std::shared_ptr<PyGraph>>();
  if (!holder || holder.use_count() != 1 || holder->graph.running()) return nullptr;
  return holder.get();
}

/// Graph takes part in Python's cycle collection (see solely_owned_graph).
void collectable_graph(PyHeapTypeObject* heap_type) {
  PyTypeObject* type = &heap_type->ht_type;
  type->tp_flags |= Py_TPFLAGS_HAVE_GC;
  type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) -> int {
    Py_VISIT(Py_TYPE(self));
    if (PyGraph* g = solely_owned_graph(self))
      for (const HeldRef& h : g->held) Py_VISIT(h->obj.ptr());
    return 0;
  };
  type->tp_clear = [](PyObject* self) -> int {
    if (PyGraph* g = solely_owned_graph(self))
      for (const HeldRef& h : g->held) h->obj.reset();
    return 0;
  };
  // Untracked before the C++ object goes: its destructor may release the GIL (to wait for a
  // run), and a collection meanwhile must not traverse it.
  type->tp_dealloc = [](PyObject* self) {
    PyObject_GC_UnTrack(self);
    py::detail::pybind11_object_dealloc(self);
  };
}

/// How long Ctrl-C waits for the run it cancels (end_on_ctrl_c).
constexpr std::chrono::seconds kCtrlCGrace{1};

/// What stopped the caller, for the messages: "Ctrl-C" for a KeyboardInterrupt, else the
/// exception's type (a SIGTERM handler's SystemExit, say).
std::string stop_cause(PyObject* type) {
  if (!type || PyErr_GivenExceptionMatches(type, PyExc_KeyboardInterrupt)) return "Ctrl-C";
  return PyType_Check(type) ? reinterpret_cast<PyTypeObject*>(type)->tp_name : "an exception";
}

/// A signal handler raised an exception (pending: `type` is PyErr_Occurred(); or given: a
/// `with` block's exit) while the caller waited for `run` (for x in sink, run.wait(), a close):
/// the run is cancelled (through `sink`'s close() when given, so that the readers of the
/// graph's other pull sinks are told who stopped it), its Python bodies interrupted (each gets
/// a KeyboardInterrupt at its next bytecode), and it gets kCtrlCGrace to end. A body inside a
/// call that runs no bytecode (time.sleep, a blocking read, an Event's wait, C code) does not
/// end by then: the run is left to end behind, when that call returns; stderr names the bodies,
/// and the graph's next run waits for it (wait_for_abandoned). Before, the exception waited for
/// those calls: a body hung in one held Ctrl-C for ever. With the GIL; a run that has ended (an
/// iterator's, outliving it) is left alone.
void end_on_ctrl_c(const Run& run, PyGraph* g, const PullSink<Value>* sink,
                   PyObject* type = nullptr) {
  if (!run.valid() || run.status() != RunStatus::running) return;
  // Left behind already (a `with` block's exit after its loop's Ctrl-C): the graph runs one
  // run at a time, so a running abandoned run is this one.
  if (g && g->abandoned && g->abandoned->status() == RunStatus::running) return;
  if (!type) type = PyErr_Occurred();
  if (g) g->bodies->interrupt();
  bool ended = false;
  {
    NoGil nogil;
    cancel_through(run, sink);
    ended = run.wait_for(kCtrlCGrace);
    if (ended) drain(run);  // (its error, if any, is not the caller's: it stopped the run)
  }
  if (ended || !g) return;
  g->abandoned = run;
  const std::string names = g->bodies->names();
  std::fprintf(stderr,
               "splitflow: graph '%s' was cancelled (%s) and has not ended within %lld s: %s "
               "still running, inside a call that Python cannot interrupt (time.sleep, a blocking "
               "read, C code). It ends when that call returns; the graph's next run waits for "
               "it.\n",
               g->graph.name().c_str(), stop_cause(type).c_str(), static_cast<long long>(kCtrlCGrace.count()),
               names.empty() ? "a body is" : (names + (names.find(", ") == std::string::npos ? " is" : " are")).c_str());
  std::fflush(stderr);
}

/// How long waiting for a cancelled run goes before it says what it waits for.
constexpr std::chrono::seconds kCloseNote{3};

/// Waits for `run` to end (with the GIL) in 50 ms slices with the GIL released (so that its
/// Python stages can finish), letting a signal handler's exception through: true once it ended,
/// false with that exception pending. `note()` is called once, after `note_after` of waiting.
template <class Note>
bool wait_in_slices(const Run& run, std::chrono::nanoseconds note_after, Note note) {
  const auto t0 = std::chrono::steady_clock::now();
  bool said = false;
  for (;;) {
    bool done = false;
    {
      NoGil nogil;
      done = run.wait_for(50ms);
      if (done) drain(run);
    }
    if (done) return true;
    if (PyErr_CheckSignals() != 0) return false;
    if (!said && std::chrono::steady_clock::now() - t0 >= note_after) {
      said = true;
      note();
    }
  }
}

/// Waits for `run`, cancelled, to end (with the GIL; wait_in_slices). After kCloseNote stderr
/// names the bodies it waits for; an exception from a signal handler (Ctrl-C) leaves the run to
/// end behind (end_on_ctrl_c) and returns false, the exception pending. Before, a body that
/// never returned held close(), a break, a `with` block's end and Ctrl-C for ever.
bool wait_cancelled(const Run& run, PyGraph* g) {
  const bool ended = wait_in_slices(run, kCloseNote, [&] {
    if (!g) return;
    const std::string names = g->bodies->names();
    std::fprintf(stderr,
                 "splitflow: ending a cancelled run of graph '%s' waits for %s, still running "
                 "%lld s after the cancel; Ctrl-C leaves the run to end behind\n",
                 g->graph.name().c_str(), names.empty() ? "its stages" : names.c_str(),
                 static_cast<long long>(kCloseNote.count()));
    std::fflush(stderr);
  });
  if (!ended) end_on_ctrl_c(run, g, nullptr);
  return ended;
}

/// The exception a destructor cannot raise (a signal handler's, during an iterator's close on
/// its release), raised in the main thread at its next bytecode (a pending call), as it was.
void raise_later();

void PyGraph::before_release() {
  if (!last_run || last_run->status() != RunStatus::running || !python_alive() || !exit_gate::open())
    return;
  if (abandoned && abandoned->status() == RunStatus::running) return;  // (deleted_behind)
  const Run run = *last_run;
  {
    NoGil nogil;
    run.cancel();
  }
  const bool ended = wait_in_slices(run, RunRegistry::kExitGrace, [&] {
    bodies->interrupt();
    const std::string names = bodies->names();
    std::fprintf(stderr,
                 "splitflow: dropping graph '%s' waits for its cancelled run: %s still running "
                 "%lld s after the cancel (interrupted now); Ctrl-C leaves the run to end behind\n",
                 graph.name().c_str(), names.empty() ? "its stages" : names.c_str(),
                 static_cast<long long>(RunRegistry::kExitGrace.count()));
    std::fflush(stderr);
  });
  if (ended) return;
  end_on_ctrl_c(run, this, nullptr);
  raise_later();
}

void raise_later() {
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  PyErr_Fetch(&type, &value, &tb);
  if (!type) return;
  auto* saved = new std::array<PyObject*, 3>{type, value, tb};
  const int added = Py_AddPendingCall([](void* p) -> int {
    std::unique_ptr<std::array<PyObject*, 3>> e(static_cast<std::array<PyObject*, 3>*>(p));
    PyErr_Restore((*e)[0], (*e)[1], (*e)[2]);  // steals
    return -1;
  }, saved);
  if (added != 0) {  // (the queue is full: the exception is lost, as an unraisable one)
    PyErr_Restore(saved->at(0), saved->at(1), saved->at(2));
    delete saved;
    PyErr_WriteUnraisable(nullptr);
  }
}

/// Before a run of `g` starts (with the GIL): a run that Ctrl-C left to end behind
/// (end_on_ctrl_c) is waited for, in 50 ms slices that let Ctrl-C through, saying once on
/// stderr what it waits for when that takes more than a second.
void wait_for_abandoned(PyGraph& g) {
  if (!g.abandoned) return;
  const Run run = *g.abandoned;  // (a copy: another thread's start may reset it meanwhile)
  const bool ended = wait_in_slices(run, 1s, [&] {
    const std::string names = g.bodies->names();
    std::fprintf(stderr,
                 "splitflow: graph '%s' waits for its run cancelled by Ctrl-C to end before the "
                 "next one starts: %s still running\n",
                 g.graph.name().c_str(), names.empty() ? "a body" : names.c_str());
    std::fflush(stderr);
  });
  if (!ended) throw py::error_already_set();
  g.abandoned.reset();
}

/// A node handle: its Value input and output ends (either may be null), and the graph.
struct PyNode {
  std::shared_ptr<PyGraph> graph;
  std::string name;
  detail::Receiver<Value>* in = nullptr;
  detail::Emitter<Value>* out = nullptr;
  std::optional<PullSink<Value>> pull;
  /// A pull sink's iterators alive (for x in sink, Graph.iterate): run.wait() warns of a full
  /// sink that has none.
  std::shared_ptr<std::atomic<int>> readers = std::make_shared<std::atomic<int>>(0);
  PyObj pool = {};  // a process stage's worker pool (splitflow._procs.ProcessPool)
  std::shared_ptr<PyNode> first = nullptr, second = nullptr;  // a zip's two inputs
};

/// Graph.service: a graph's request entry and exit.
struct PyService {
  std::shared_ptr<PyGraph> graph;
  Service<Value, Value> svc;
  std::shared_ptr<PyNode> source, sink;
};

void connect_nodes(const PyNode& a, const PyNode& b) {
  if (!a.out) throw GraphError("splitflow.connect: '" + a.name + "' has no output (it is a sink)");
  if (!b.in) throw GraphError("splitflow.connect: '" + b.name + "' has no input (it is a source)");
  detail::link(*a.out, *b.in);
}

/// A C++ op for a CPU stage (runs without the GIL).
/// A C++ op for a GPU stage: enqueues its work on the leased stream.
struct GpuOp {
  std::string name;
  std::function<Value(Value, DeviceContext&)> fn;
};
/// An op with a CPU form (for g.stage) and, for ops that have one, the GPU form of the same
/// computation (for g.gpu_stage): one name whatever the stage, as in C++, where the argument
/// (a HostTensor or a DeviceContext) picks the form.
struct CpuOp {
  std::string name;
  std::function<Value(Value)> fn;
  std::function<Value(Value, DeviceContext&)> gpu = {};  // empty: CPU only
  // An image op, whose item's index matters (random_resized_crop's randomness): with field=,
  // a plain array in the field reaches it as an image carrying the sample's "index" (on_field).
  bool indexed = false;
};

/// The stage's order: `order` ("in_order" / "out_of_order", C++'s names) when given, else the
/// older `ordered` flag.
Order order_of(bool ordered, const py::object& order) {
  if (order.is_none()) return ordered ? Order::in_order : Order::out_of_order;
  const std::string o = py::str(order);
  if (o == "in_order") return Order::in_order;
  if (o == "out_of_order") return Order::out_of_order;
  throw GraphError("splitflow: order must be 'in_order' or 'out_of_order', not '" + o + "'");
}

OnError on_error_of(const std::string& on_error) {
  if (on_error == "fail") return OnError::fail;
  if (on_error == "skip") return OnError::skip;
  throw GraphError("splitflow: on_error must be 'fail' or 'skip' (or give substitute=), not '" + on_error + "'");
}

/// A count argument (a size, a capacity, a concurrency): a Python int (or anything with
/// __index__: a NumPy integer) >= 0, else GraphError naming `who`'s argument `arg` and its value.
/// `expected`: what the argument may be, for the message.
std::size_t count_arg(const py::handle& o, const std::string& who, const char* arg,
                      const char* expected = "an int >= 0") {
  const std::string repr = py::repr(o).cast<std::string>();
  const std::optional<std::int64_t> v = index_of(o.ptr());
  if (!v && (PyBool_Check(o.ptr()) || !PyIndex_Check(o.ptr())))
    throw GraphError(who + ": " + arg + " must be " + expected + ", not " + repr);
  if (!v || *v < 0) {  // (no value: an integer past 64 bits, of either sign)
    const bool negative = PyObject_RichCompareBool(o.ptr(), py::int_(0).ptr(), Py_LT) == 1;
    throw GraphError(who + ": " + arg + "=" + repr + (negative ? " is negative" : " is too large"));
  }
  return static_cast<std::size_t>(*v);
}

/// An integer argument within [lo, hi] (a Python int or NumPy integer; not a bool or a float),
/// else GraphError naming `who`'s argument `arg` and the value given (a value past the C type's range
/// was pybind's "incompatible constructor arguments").
std::int64_t int_in(const py::handle& o, const std::string& who, const char* arg, std::int64_t lo,
                    std::int64_t hi, const char* meaning = "") {
  const std::string repr = py::repr(o).cast<std::string>();
  const std::optional<std::int64_t> v =
      PyBool_Check(o.ptr()) || !PyIndex_Check(o.ptr()) ? std::nullopt : index_of(o.ptr());
  if (PyBool_Check(o.ptr()) || !PyIndex_Check(o.ptr()))
    throw GraphError(who + ": " + arg + " must be an int, not " + repr);
  if (!v || *v < lo || *v > hi)
    throw GraphError(who + ": " + arg + " must be " + std::to_string(lo) + meaning + " to " +
                std::to_string(hi) + ", not " + repr);
  return *v;
}

/// A seed or an epoch: an int from 0 to 2**64 - 1 (not a bool or a float), else GraphError
/// naming `who`'s argument (a negative or wider value was pybind's "incompatible function
/// arguments").
std::uint64_t u64_arg(const py::handle& o, const std::string& who, const char* arg) {
  const std::string repr = py::repr(o).cast<std::string>();
  if (PyBool_Check(o.ptr()) || !PyIndex_Check(o.ptr()))
    throw GraphError(who + ": " + arg + " must be an int, not " + repr);
  const py::object i = py::reinterpret_steal<py::object>(PyNumber_Index(o.ptr()));
  if (!i) throw py::error_already_set();
  const unsigned long long v = PyLong_AsUnsignedLongLong(i.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw GraphError(who + ": " + arg + " must be an int from 0 to 2**64 - 1, not " + repr);
  }
  return static_cast<std::uint64_t>(v);
}

/// An output size as torchvision takes it: an int (a square), or a sequence of (height, width)
/// (or of one int). Returns (height, width); GraphError naming `who` and the value otherwise,
/// its bounds checked here (image::kMaxOutputSide), named as `who`'s: left to the op's checks,
/// they named C++'s op (a new user's trial: "splitflow::image::RandomResizedCrop: size 0").
std::pair<int, int> crop_size_arg(const py::handle& o, const std::string& who) {
  const auto side = [&](const py::handle& v) -> int {
    if (PyBool_Check(v.ptr()) || !PyIndex_Check(v.ptr()))
      throw GraphError(who + ": size must be an int or (height, width), not " +
                  py::repr(o).cast<std::string>());
    const std::optional<std::int64_t> n = index_of(v.ptr());
    if (!n || *n < INT_MIN || *n > INT_MAX)  // (a check after the cast would name a clamped value)
      throw GraphError(who + ": size " + py::repr(v).cast<std::string>() + " is out of range: give 1 "
                  "to " + std::to_string(image::kMaxOutputSide) + " (pixels per side)");
    return static_cast<int>(*n);
  };
  // (A height or width of 0 would mean a square to the op, its checks would say "size".)
  const auto within = [&](int n, const char* what, const char* unit) {
    if (n < 1 || n > image::kMaxOutputSide)
      throw GraphError(who + ": " + what + " " + std::to_string(n) + " is out of range: give 1 to " +
                       std::to_string(image::kMaxOutputSide) + " (" + unit + ")");
    return n;
  };
  const auto square = [&](const py::handle& v) -> std::pair<int, int> {
    const int n = within(side(v), "size", "pixels per side");
    return {n, n};
  };
  if (PyIndex_Check(o.ptr()) || PyBool_Check(o.ptr())) return square(o);
  if (PySequence_Check(o.ptr()) && !PyUnicode_Check(o.ptr()) && !PyBytes_Check(o.ptr())) {
    const py::sequence seq = py::reinterpret_borrow<py::sequence>(o);
    if (seq.size() == 1) return square(seq[0]);
    if (seq.size() == 2) {
      const int h = side(seq[0]), w = side(seq[1]);
      return {within(h, "height", "pixels"), within(w, "width", "pixels")};
    }
  }
  throw GraphError(who + ": size must be an int or (height, width), not " +
              py::repr(o).cast<std::string>());
}

/// A real number's value (a Python or NumPy int or float; not a bool, a string or a complex).
std::optional<double> real_of(const py::handle& o) {
  if (PyBool_Check(o.ptr()) || PyComplex_Check(o.ptr()) || !PyNumber_Check(o.ptr())) return std::nullopt;
  const double v = PyFloat_AsDouble(o.ptr());
  if (v == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    return std::nullopt;
  }
  return v;
}

/// A real number argument, else GraphError naming `who`'s argument `arg` and the value given (it
/// was pybind's "incompatible function arguments").
double real_arg(const py::handle& o, const std::string& who, const char* arg) {
  if (const std::optional<double> v = real_of(o)) return *v;
  throw GraphError(who + ": " + arg + " must be a number, not " + py::repr(o).cast<std::string>());
}

/// flip= of the crop ops: a probability, or a flag (True: always, False: never; pybind's float
/// took a bool as 1.0 and 0.0, and flip=False is a natural way to say no flip).
double flip_arg_of(const py::handle& o, const std::string& who) {
  if (PyBool_Check(o.ptr())) return o.ptr() == Py_True ? 1.0 : 0.0;
  return real_arg(o, who, "flip");
}

/// A (min, max) pair as torchvision's RandomResizedCrop takes scale= and ratio=: a sequence of
/// two numbers, else GraphError naming `who`'s argument (`scale=0.5` was pybind's "incompatible
/// function arguments"). Their bounds are the op's (image::validate).
std::pair<double, double> range_arg(const py::handle& o, const std::string& who, const char* arg) {
  if (PySequence_Check(o.ptr()) && !PyUnicode_Check(o.ptr()) && !PyBytes_Check(o.ptr())) {
    const py::sequence seq = py::reinterpret_borrow<py::sequence>(o);
    if (seq.size() == 2) {
      const std::optional<double> lo = real_of(seq[0]), hi = real_of(seq[1]);
      if (lo && hi) return {*lo, *hi};
    }
  }
  throw GraphError(who + ": " + arg + " must be (min, max), two numbers, not " +
                   py::repr(o).cast<std::string>());
}

/// `make()`'s result; a GraphError from the C++ op's checks (image::validate, "splitflow::image::
/// RandomResizedCrop: scale ...") named as Python's op, `who` ("splitflow.ops.random_resized_crop:
/// scale ..."): one name for the op in what it says.
template <class Make>
auto named_as(const std::string& who, const std::string& cxx, Make&& make) {
  try {
    return make();
  } catch (const GraphError& e) {
    const std::string said = e.what(), prefix = "splitflow::image::" + cxx;
    if (said.rfind(prefix, 0) != 0) throw;
    throw GraphError(who + said.substr(prefix.size()));
  }
}

/// A flag argument (ordered=, blocking=, drop_last=): True or False (a NumPy bool too), else
/// GraphError naming `who`'s argument `arg` and its value ('yes' is not a flag, nor is 1).
bool flag_arg(const py::handle& o, const std::string& who, const char* arg) {
  if (PyBool_Check(o.ptr())) return o.ptr() == Py_True;
  const py::handle type = reinterpret_cast<PyObject*>(Py_TYPE(o.ptr()));
  if (py::str(type.attr("__module__")).cast<std::string>() == "numpy" &&
      py::str(type.attr("__name__")).cast<std::string>().rfind("bool", 0) == 0)
    return PyObject_IsTrue(o.ptr()) == 1;
  throw GraphError(who + ": " + arg + " must be True or False, not " + py::repr(o).cast<std::string>());
}

/// antialias= of the image ops: a flag, or torchvision's defaults, None (0.14) and "warn"
/// (0.15-0.16), which on PIL images, what these ops match, antialias: True. None was taken as
/// False (a new user's trial: torchvision's arguments copied gave the aliasing bilinear, 103
/// off PIL).
bool antialias_arg(const py::handle& o, const std::string& who) {
  if (o.is_none() || (py::isinstance<py::str>(o) && o.cast<std::string>() == "warn")) return true;
  return flag_arg(o, who, "antialias");
}

/// A stage's concurrency= (g.stage, g.gpu_stage): an int (0: unlimited) or "auto"
/// (Concurrency::automatic), else GraphError naming `who`.
std::size_t concurrency_arg(const py::handle& o, const std::string& who) {
  if (py::isinstance<py::str>(o)) {
    if (o.cast<std::string>() != "auto")
      throw GraphError(who + ": concurrency must be a number (0: unlimited) or 'auto', not '" +
                       o.cast<std::string>() + "'");
    return Concurrency::automatic;
  }
  return count_arg(o, who, "concurrency", "an int (0: unlimited) or 'auto'");
}

StageOptions stage_options(std::size_t concurrency, Order order, std::size_t capacity,
                           const std::string& on_error = "fail") {
  return StageOptions{concurrency == 0 ? Concurrency::unlimited : concurrency, order, capacity,
                      on_error_of(on_error)};
}

// ---- the Python stage and source bodies ----------------------------------------------------------

/// A dynamic batch's results, from what a stage's function returned for its requests collated:
/// one per request (a list, a tuple, or anything with len() and indexing: a tensor's rows), in a
/// batch of the same requests. With the GIL held.
Value batch_results(const BatchPtr& b, const py::object& out, const std::string& who) {
  const std::size_t n = b->batch.size();
  const auto one_each = [&] {
    return "; return one per request (a list, or a tensor whose first dimension is the batch's)";
  };
  // (A torch tensor is no sequence to PySequence_Check: what has a len() is taken.)
  if (out.is_none() || PyDict_Check(out.ptr()) || !py::hasattr(out, "__len__"))
    throw Error(who + ": the function returned " +
                (out.is_none() ? std::string("None")
                               : "a " + py::str(out.get_type().attr("__name__")).cast<std::string>()) +
                " for a batch of " +
                std::to_string(n) + " requests" + one_each());
  const py::ssize_t got = py::len(out);
  if (got != static_cast<py::ssize_t>(n))
    throw Error(who + ": the function returned " + std::to_string(got) + " results for a batch of " +
                std::to_string(n) + " requests" + one_each());
  BatchPtr r = same_requests(b->batch);
  for (std::size_t i = 0; i < n; ++i) r->batch.items.push_back(from_python(out[py::int_(i)]));
  return r;
}

/// A dynamic batch's results from the function's calls on its request_groups (`part(k)`: the
/// results of `groups[k]` as a batch, one per request, batch_results), each put in its
/// request's place; a request an earlier stage failed keeps its error and gets no result.
/// Where the batch was split in groups, a group's call that fails (raises, or returns another
/// number of results) fails that group's requests (Batch::fail) and not the others (a review:
/// an odd shape's group failed them all); a batch of one group fails whole, through its stage's
/// on_error, as without groups; a stop request (Ctrl-C) ends the run whatever.
template <class Part>
Value grouped_results(const BatchPtr& b, const std::vector<std::vector<std::size_t>>& groups,
                      Part&& part) {
  BatchPtr r = same_requests(b->batch);
  r->batch.items.resize(b->batch.size());
  for (std::size_t k = 0; k < groups.size(); ++k) {
    try {
      Value got = part(k);
      auto& items = std::get<BatchPtr>(got)->batch.items;
      for (std::size_t j = 0; j < groups[k].size(); ++j) r->batch.items[groups[k][j]] = std::move(items[j]);
    } catch (...) {
      std::exception_ptr e = std::current_exception();
      if (groups.size() == 1 || is_stop_request(e)) throw;
      for (std::size_t i : groups[k]) r->batch.fail(i, e);
    }
  }
  return r;
}

/// Whether a batch's request_groups are the whole batch as it is: all live, one kind.
bool whole(const std::vector<std::vector<std::size_t>>& groups, const BatchPtr& b) {
  return groups.size() == 1 && groups[0].size() == b->batch.size();
}

/// The answer to one item of a process stage (splitflow/_procs.py calls it from its reader
/// thread): done(value) or fail(exception), once. For a dynamic batch (`batch`), the value is
/// the function's results for its requests collated, one per request, as in a thread stage.
struct PyCompletion {
  std::shared_ptr<Completion<Value>> c;
  BatchPtr batch = {};
  std::string who = {};
  // Whether the batch went as its request_groups (not the whole batch): the worker was sent
  // one collated batch per group (_procs._Groups) and answers with a list of their results,
  // each a _procs._Failed where that group's call raised.
  bool grouped = false;
  std::vector<std::vector<std::size_t>> groups = {};
  bool done(py::handle value) {
    if (!batch) return c->done(from_python(value));
    // (What cannot be split per request raises here, back into the pool's reader: a Python
    // error in len() or indexing as itself, a wrong count as a splitflow.Error; the pool then
    // fails the item with it, its cause as in a thread stage, and counts it failed.)
    if (!grouped) return c->done(batch_results(batch, py::reinterpret_borrow<py::object>(value), who));
    const py::object parts = py::reinterpret_borrow<py::object>(value);
    const py::object failed = py::module_::import("splitflow._procs").attr("_Failed");
    return c->done(grouped_results(batch, groups, [&](std::size_t k) {
      return call_python([&]() -> Value {
        py::object got = parts[py::int_(k)];
        if (py::isinstance(got, failed)) std::rethrow_exception(error_of(got.attr("exception")));
        return batch_results(requests_at(batch->batch, groups[k]), got, who);
      });
    }));
  }
  /// `keep` (not None): the item to emit in the failed one's place under substitute= (a
  /// field= stage's sample with that field substituted).
  bool fail(py::handle exc, py::handle keep) {
    std::exception_ptr e = error_of(exc);
    if (!keep.is_none())
      e = std::make_exception_ptr(detail::SubstituteWith<Value>{from_python(keep), std::move(e)});
    return c->fail(std::move(e));
  }
  static std::exception_ptr error_of(py::handle exc) {
    if (!PyExceptionInstance_Check(exc.ptr()))
      return std::make_exception_ptr(Error("failed with " + std::string(py::repr(exc))));
    // splitflow.Error (a worker died, the pool closed): its message, as the item's error.
    // Anything else, and a splitflow.Error the function raised itself (marked _splitflow_own
    // by _procs), is the function's own exception, the StageError's __cause__.
    if (PyObject_IsInstance(exc.ptr(), g_error_types[0]) == 1 && !py::hasattr(exc, "_splitflow_own")) {
      // A pool that cannot work (its workers die as they start) ends the run whatever the
      // stage's on_error (_procs._stops_run): no item would ever succeed.
      if (py::hasattr(exc, "stops_run") && py::bool_(exc.attr("stops_run")))
        return std::make_exception_ptr(StopRequest(py::str(exc).cast<std::string>()));
      // (Its cause, what the pool could not do with the item, is the StageError's: an item
      // that cannot be pickled.)
      const py::object cause = exc.attr("__cause__");
      if (!cause.is_none() && PyExceptionInstance_Check(cause.ptr()) &&
          PyObject_IsInstance(cause.ptr(), g_error_types[0]) != 1)
        return carry_python(py::str(exc).cast<std::string>(), PyObj(cause));
      return std::make_exception_ptr(Error(py::str(exc).cast<std::string>()));
    }
    // (A RemoteException's text is its type's and its own: "NoArgExc: 1-2".)
    std::string what = g_remote_exception && PyObject_IsInstance(exc.ptr(), g_remote_exception) == 1
                           ? py::str(exc).cast<std::string>()
                           : std::string(py::str(exc.get_type().attr("__name__"))) + ": " +
                                 py::str(exc).cast<std::string>();
    return carry_python(std::move(what), PyObj(py::reinterpret_borrow<py::object>(exc)));
  }
};

/// One stage's measure of how long its bodies hold the GIL: a body about every millisecond is
/// measured (reading a thread's CPU demand costs microseconds: every body's would cost a
/// trivial body a tenth of its rate), for the bodies since the last one measured.
struct GilSampler {
  static constexpr std::int64_t kPeriodNs = 1'000'000;
  std::atomic<std::int64_t> next_ns{0};
  std::atomic<std::int64_t> last_ns{0};  // when the last measured body started (0: none yet)
  std::atomic<std::uint64_t> bodies{0};
  /// The bodies the one starting at `now` is measured for (0: not measured), and the time
  /// since the last measured one started (-1: none): the stage cannot have held the GIL
  /// longer than that before this body (a measured body preempted a while with the GIL taken,
  /// charged for several, would charge that while several times).
  std::uint64_t due(std::int64_t now, std::int64_t& since) noexcept {
    bodies.fetch_add(1, std::memory_order_relaxed);
    std::int64_t next = next_ns.load(std::memory_order_relaxed);
    if (now < next || !next_ns.compare_exchange_strong(next, now + kPeriodNs, std::memory_order_relaxed))
      return 0;
    const std::int64_t last = last_ns.exchange(now, std::memory_order_relaxed);
    since = last > 0 && now >= last ? now - last : -1;
    return bodies.exchange(0, std::memory_order_relaxed);
  }
};

/// Takes the GIL for a stage's body, its wait for it told to the tuner as contention
/// (detail::add_contended_ns): a Python body that computes waits for the GIL while others
/// compute, and is not to be moved past the cores for that wait. Its CPU demand while it holds
/// the GIL (a sampled body's, for the bodies since the last one: GilSampler) is told as the
/// time it held the lock all Python bodies share (detail::add_serial_ns): the tuner's bound on
/// Python stages, whatever their threads (a body that releases the GIL to compute, as numpy
/// and torch do, counts that time too: the tuner's trials of more threads correct it).
struct BodyGil {
  static std::int64_t now_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  const std::int64_t t0 = PyGILState_Check() != 0 ? 0 : now_ns();
  WithGil gil;
  std::int64_t demand0 = 0;  // at taking the GIL (0: not measured)
  std::uint64_t weight = 0;  // the bodies it is measured for
  std::int64_t since = -1;   // since the stage's last measured body started (-1: unknown)
  explicit BodyGil(GilSampler* sampler, const char* what = "a Python stage") {
    if (!gil) throw_exiting(what);
    if (t0 != 0) {
      detail::add_contended_ns(now_ns() - t0);
      if (sampler && (weight = sampler->due(t0, since)) > 0)
        demand0 = std::max<std::int64_t>(detail::thread_demand_ns(), 1);
    }
  }
  ~BodyGil() {
    if (demand0 == 0) return;
    const std::int64_t held = detail::thread_demand_ns() - demand0;
    std::int64_t charge = held * static_cast<std::int64_t>(weight);
    // (The bodies before it: at most the time since the last measured one started.)
    if (since >= 0 && weight > 1) charge = std::min(charge, held + since);
    detail::add_serial_ns(charge);
  }
  BodyGil(const BodyGil&) = delete;
  BodyGil& operator=(const BodyGil&) = delete;
};

struct PythonBody {
  HeldRef fn;  // the graph's (PyGraph::hold)
  std::shared_ptr<BodyThreads> threads = {};  // the graph's (Ctrl-C interrupts its bodies)
  std::string who = {};  // "stage 'model' of graph 'svc'", for errors
  std::shared_ptr<GilSampler> gil_sampler = std::make_shared<GilSampler>();  // the stage's
  Value operator()(Value v) const {
    BodyGil gil(gil_sampler.get());
    BodyScope scope(threads.get(), &who);
    if (auto* b = std::get_if<BatchPtr>(&v)) return on_batch(std::move(*b));
    return call_python([&] { return from_python(fn->obj.get()(to_python(std::move(v)))); });
  }

 private:
  // A dynamic batch: the function takes its items collated and returns one result per item
  // (a list, a tuple, or anything with len() and indexing: a tensor's rows).
  // Called once per request_groups group: the requests an earlier stage failed are left out,
  // and requests that collate differently (another shape) are batches of their own.
  Value on_batch(BatchPtr b) const {
    const auto groups = call_python([&] { return request_groups(b->batch); });
    if (whole(groups, b))
      return call_python([&]() -> Value { return batch_results(b, fn->obj.get()(to_python(Value(b))), who); });
    return grouped_results(b, groups, [&](std::size_t k) {
      return call_python([&]() -> Value {
        BatchPtr part = requests_at(b->batch, groups[k]);
        return batch_results(part, fn->obj.get()(to_python(Value(part))), who);
      });
    });
  }
};

/// A C++ op on a dynamic batch applies to each of its items; an item whose op throws fails its
/// own request (Batch::fail), not the batch's others. `op` takes the item, and a GPU op its
/// burst's DeviceContext too (all of a batch's items in one burst).
template <class Op>
auto per_item(Op op) {
  return [op = std::move(op)](Value v, auto&... ctx) -> Value {
    auto* b = std::get_if<BatchPtr>(&v);
    if (!b) return op(std::move(v), ctx...);
    Batch<Value>& batch = writable(*b);
    detail::CurrentItem current;  // each request's own number (random crops draw from it)
    for (std::size_t i = 0; i < batch.items.size(); ++i) {
      if (i < batch.errors.size() && batch.errors[i]) continue;
      if (batch.ids.size() == batch.items.size()) current.set(batch.ids[i]);
      try {
        batch.items[i] = op(std::move(batch.items[i]), ctx...);
      } catch (...) {
        batch.fail(i, std::current_exception());
      }
    }
    return v;
  };
}

/// Iterates a Python iterable; each run calls iter() afresh (the generator is copied per run).
/// Its GIL holds are measured as a stage's are (BodyGil), for the tuner: the time they leave
/// the graph's Python stages (autotune's Sample::serial_others_ns).
struct PythonSource {
  HeldRef iterable;  // the graph's (PyGraph::hold)
  PyObj iterator;
  std::shared_ptr<BodyThreads> threads = {};  // the graph's (Ctrl-C interrupts its bodies)
  std::string who = {};  // "source 'n' of graph 'g'"
  std::shared_ptr<GilSampler> gil_sampler = std::make_shared<GilSampler>();
  std::optional<Value> operator()() {
    BodyGil gil(gil_sampler.get(), "a Python source");
    BodyScope scope(threads.get(), &who);
    return call_python([&]() -> std::optional<Value> {
      if (!iterator) iterator = PyObj(py::iter(iterable->obj.get()));
      PyObject* next = PyIter_Next(iterator.get().ptr());
      if (!next) {
        if (PyErr_Occurred()) throw py::error_already_set();
        iterator.reset();
        return std::nullopt;
      }
      return from_python(py::reinterpret_steal<py::object>(next));
    });
  }
};

// ---- runs and pull sinks --------------------------------------------------------------------------

struct PyRun {
  Run run;
  std::shared_ptr<PyGraph> graph;  // keeps the graph (and its runtime) alive while referenced
};

/// For run.wait(): the graph's pull sinks that are full with no iterator to read them, which
/// the run cannot end past ("" if none). Their items are taken only by an iterator made later,
/// on another thread: a warning, not an error.
std::string unread_full_pull_sinks(const Run& run, const PyGraph& graph) {
  std::vector<std::string> names;
  for (const auto& w : graph.pulls)
    if (auto n = w.lock(); n && n->readers->load() == 0) names.push_back(n->name);
  if (names.empty()) return {};
  RunStats st;
  {
    NoGil nogil;
    st = run.stats();
  }
  std::string full;
  for (const StageStats& s : st.stages) {
    if (s.kind != StageKind::pull_sink || s.capacity == 0 ||
        std::find(names.begin(), names.end(), s.name) == names.end() ||
        s.items_in - std::min(s.items_in, s.items_out) < s.capacity)
      continue;
    full += (full.empty() ? "'" : ", '") + s.name + "' (" + std::to_string(s.capacity) + " items)";
  }
  return full;
}

RunStatus wait_run(const Run& run, std::optional<double> timeout_s, bool& done,
                   const std::shared_ptr<PyGraph>& graph) {
  bool warned = false;
  int slices = 0;
  // Wait in slices so that Ctrl-C reaches Python promptly; a KeyboardInterrupt cancels the run.
  const auto deadline = timeout_s ? std::chrono::steady_clock::now() +
                                        std::chrono::duration_cast<std::chrono::nanoseconds>(
                                            std::chrono::duration<double>(*timeout_s))
                                  : std::chrono::steady_clock::time_point::max();
  for (;;) {
    auto slice = std::chrono::nanoseconds(50ms);
    if (timeout_s) slice = std::min(slice, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                               deadline - std::chrono::steady_clock::now()));
    {
      NoGil nogil;
      done = run.wait_for(std::max(slice, std::chrono::nanoseconds(0)));
    }
    if (done) {
      try {
        NoGil nogil;
        return run.wait();
      } catch (const StageError& e) {
        raise_stage_error(e);
      }
    }
    if (PyErr_CheckSignals() != 0) {
      end_on_ctrl_c(run, graph.get(), nullptr);
      throw py::error_already_set();
    }
    // A run whose pull sink is full and read by nobody waits for ever: say so, once. Checked
    // once a second of waiting (the first slice, then every 20th: run.stats() copies every
    // stage's figures), not on each 50 ms slice.
    if (!warned && graph && slices++ % 20 == 0 && run.status() == RunStatus::running) {
      if (const std::string full = unread_full_pull_sinks(run, *graph); !full.empty()) {
        warned = true;
        const std::string text =
            "splitflow: run.wait() waits for graph '" + graph->graph.name() + "', whose pull sink " +
            full + " is full and read by nobody: the run cannot end until its items are taken "
            "(for x in sink, on another thread) or it is cancelled; g.iterate(sink) runs the "
            "graph and reads it at once";
        if (PyErr_WarnEx(PyExc_RuntimeWarning, text.c_str(), 1) != 0) throw py::error_already_set();
      }
    }
    if (timeout_s && std::chrono::steady_clock::now() >= deadline) return RunStatus::running;
  }
}

/// Iterates a pull sink for one run. Dropping it before the end cancels the run (a `break`
/// out of a for loop).
struct PullIterator {
  /// Counts the iterator among its sink's readers while it lives (PyNode::readers).
  struct Reader {
    std::shared_ptr<std::atomic<int>> count;
    Reader() = default;
    Reader(const Reader&) = delete;
    Reader& operator=(const Reader&) = delete;
    ~Reader() {
      if (count) count->fetch_sub(1);
    }
  };
  explicit PullIterator(std::shared_ptr<PyNode> n) : node(std::move(n)) {
    reader.count = node->readers;
    reader.count->fetch_add(1);
  }
  Reader reader;
  std::shared_ptr<PyNode> node;
  Run run;
  /// Whether the run is the iterator's own (Graph.iterate) or the graph's run that `for x in
  /// sink` reads (Graph.run, then the sink): that one is cancelled by leaving the loop only once
  /// an item was taken, as C++'s range-for over a PullSink does.
  bool own = true;
  bool finished = false;
  std::optional<std::uint64_t> item;  // the number in its run of the item last returned

  py::object next() {
    if (finished) throw py::stop_iteration();
    for (int slices = 1;; ++slices) {
      bool timed_out = false;
      std::optional<Value> v;
      try {
        NoGil nogil;
        std::uint64_t seq = 0;
        v = node->pull->next_for(50ms, timed_out, &seq);
        if (v) item = seq;
      } catch (const StageError& e) {
        finished = true;
        raise_stage_error(e);
      } catch (const CancelledError&) {
        finished = true;  // (the translator raises splitflow.CancelledError)
        throw;
      }
      if (v) return to_python(std::move(*v));
      if (!timed_out) {
        finished = true;
        throw py::stop_iteration();
      }
      if (PyErr_CheckSignals() != 0) {
        finished = true;
        end_on_ctrl_c(run, node->graph.get(), &*node->pull);
        throw py::error_already_set();
      }
      // A loop that has waited kStuckSlices for one item says once, on stderr, what the run's
      // stages are doing (a stuck run is a bug: this is what finds the stage it stopped at).
      if (slices == kStuckSlices && run.valid() && run.status() == RunStatus::running) {
        const std::string state = report(run.stats());
        std::fprintf(stderr, "splitflow: a pull sink has waited %d s for its next item; the run:\n%s",
                     kStuckSlices / 20, state.c_str());
        std::fflush(stderr);
      }
    }
  }
  static constexpr int kStuckSlices = 20 * 120;  // 50 ms slices: 120 s
  /// close(), or the iterator let go of with the GIL (a break): ends the run (its sink's
  /// close(), as close_and_drain) and waits for its end (wait_cancelled: a Ctrl-C meanwhile
  /// leaves it behind and returns false, the exception pending).
  bool close_and_wait() {
    if (!run.valid()) return true;
    {
      NoGil nogil;
      cancel_through(run, &*node->pull);
    }
    return wait_cancelled(run, node->graph.get());
  }
  /// Before the iterator is deleted by its last reference, with the GIL (make_released): a loop
  /// left early ends the run here, as close() does; an exception a signal handler raises during
  /// that wait (Ctrl-C) leaves the run behind and is raised at the next bytecode (a destructor
  /// cannot raise it).
  void before_release() {
    if (finished || !run.valid() || !python_alive() || !exit_gate::open() || (!own && !item) ||
        run.status() != RunStatus::running)
      return;
    finished = true;
    if (!close_and_wait()) raise_later();
  }
  /// The reader stops (a break, close(), Ctrl-C): the run ends as its sink's close() ends it,
  /// so that the readers of the graph's other pull sinks are told who stopped it. Without the GIL.
  void close_and_drain() noexcept {
    cancel_through(run, &*node->pull);
    drain(run);
  }
  // Leaving a loop early ends the run before the loop statement returns, so that the graph can
  // run again at once: before_release does, with the GIL; here the rest (a last reference let go
  // of without the GIL). (make_released deletes iterators with the GIL released: waiting here
  // lets the run's Python stages take it.)
  ~PullIterator() {
    if (finished || !run.valid() || !python_alive() || (!own && !item)) return;
    if (run.status() == RunStatus::running) close_and_drain();
  }
};

/// PullIterator's dealloc. An iterator dropped while a KeyboardInterrupt leaves its loop (Ctrl-C
/// landed in the loop's own code: `for x in g.iterate(o): step(x)`, the error still set as the
/// loop's frame unwinds) ends its run as Ctrl-C in next() does (end_on_ctrl_c: interrupted
/// bodies, a bounded wait, a hung body left behind); before, the iterator's destructor waited for
/// the run's end, for ever behind a hung body. Other drops (a break, another exception) wait for
/// the end as before: the loop statement returns with the run over.
void ctrl_c_aware_iterator(PyHeapTypeObject* heap_type) {
  heap_type->ht_type.tp_dealloc = [](PyObject* self) {
    if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) && python_alive()) {
      auto* inst = reinterpret_cast<py::detail::instance*>(self);
      auto vh = inst->get_value_and_holder();
      if (vh.holder_constructed()) {
        if (const auto& it = vh.holder<std::shared_ptr<PullIterator>>();
            it && !it->finished && it->run.valid() && (it->own || it->item)) {
          it->finished = true;
          end_on_ctrl_c(it->run, it->node->graph.get(), &*it->node->pull);
        }
      }
    }
    py::detail::pybind11_object_dealloc(self);
  };
}

// ---- stats as Python dicts --------------------------------------------------------------------------

py::dict stats_dict(const RunStats& st) {
  // The same keys as the JSON summary (docs/telemetry.md).
  py::module_ json = py::module_::import("json");
  return json.attr("loads")(to_json(st)).cast<py::dict>();
}

// ---- C++ ops exposed to Python --------------------------------------------------------------------

/// A single HWC image as a batch of one (NHWC), and back: the same memory, reshaped.
template <class Tn>
Tn reshaped(const Tn& t, std::vector<std::int64_t> shape) {
  if constexpr (std::is_same_v<Tn, HostTensor>) {
    return HostTensor::wrap(t.raw(), t.dtype(), std::move(shape), t.owner(), t.memory());
  } else {
    return t.reshaped(std::move(shape));
  }
}
template <class Tn>
Tn batched(const Tn& t) {
  std::vector<std::int64_t> shape{1};
  shape.insert(shape.end(), t.shape().begin(), t.shape().end());
  return reshaped(t, std::move(shape));
}
template <class Tn>
Tn unbatched(const Tn& t) {
  return reshaped(t, std::vector<std::int64_t>(t.shape().begin() + 1, t.shape().end()));
}

DeviceValue device_input(Value&& v, DeviceContext& ctx, const char* what) {
  if (auto* d = std::get_if<DeviceValue>(&v)) return std::move(*d);
  HostTensor h = as_host(v, what);
  return DeviceValue{ctx.to_device(h), ctx.backend() == BackendKind::cuda};
}

// An image op's input: an Image (from read_file, decode_jpeg or a sample's field with its
// "index": on_field) keeps its index; a plain array carries none, so the item's number in the
// run stands in for it (random_resized_crop's randomness: it was 0 for every item, the same box
// and flip for all).
image::Image image_input(Value&& v, const char* what) {
  if (auto* im = std::get_if<image::Image>(&v)) return std::move(*im);
  return image::Image{current_item().value_or(0), "", as_host(v, what)};
}

// A pixel op's input: image_input, with a 2-D uint8 array (a gray image, as NumPy gives PIL's
// 'L' mode) taken as height x width x 1 (it was refused: "takes a u8 HWC image").
image::Image pixels_input(Value&& v, const char* what) {
  image::Image im = image_input(std::move(v), what);
  if (im.pixels.ndim() == 2 && im.pixels.dtype() == DType::u8)
    im.pixels = reshaped(im.pixels, {im.pixels.dim(0), im.pixels.dim(1), 1});
  return im;
}

void bind_image_ops(py::module_& mops) {
  mops.def("read_file", [](std::vector<std::string> paths, py::object labels_in) {
    std::optional<std::vector<std::int64_t>> labels;
    if (!labels_in.is_none()) labels = int64_list(labels_in, "ops.read_file: labels");
    if (labels && labels->size() != paths.size())
      throw GraphError("ops.read_file: " + std::to_string(labels->size()) + " labels for " +
                       std::to_string(paths.size()) + " paths; give one label per path");
    auto kept = std::make_shared<const std::vector<std::string>>(std::move(paths));
    std::shared_ptr<const std::vector<std::int64_t>> lab;
    if (labels) lab = std::make_shared<const std::vector<std::int64_t>>(std::move(*labels));
    return CpuOp{"read_file", [kept, lab](Value v) -> Value {
      const std::optional<std::int64_t> i = as_index(v);
      if (!i)
        throw Error("ops.read_file: expected an integer index into its " +
                    std::to_string(kept->size()) + " paths (from g.indices(...) or g.source(...) "
                    "of ints), got " + describe(v));
      if (*i < 0 || static_cast<std::size_t>(*i) >= kept->size())
        throw Error("ops.read_file: index " + std::to_string(*i) + " is out of range for its " +
                    std::to_string(kept->size()) + " paths");
      const auto at = static_cast<std::size_t>(*i);
      image::Encoded e = image::read_file({static_cast<std::uint64_t>(*i), (*kept)[at]});
      image::Image bytes{e.index, std::move(e.path), std::move(e.bytes)};
      if (!lab) return bytes;
      // A labelled sample: {"image": the file's bytes, "label": its label, "index": i}.
      auto sample = std::make_shared<Sample>();
      sample->kind = Sample::Kind::dict;
      sample->keys = {"image", "label", "index"};
      sample->fields.emplace_back(std::move(bytes));
      sample->fields.emplace_back((*lab)[at]);
      sample->fields.emplace_back(*i);
      return sample;
    }};
  }, py::arg("paths"), py::arg("labels") = py::none(),
  "CPU op: index i -> the bytes of paths[i] (an error names the file). Keeps the index and path "
  "for decode_jpeg's errors and random_resized_crop's per-item randomness. With labels (one "
  "int per path, e.g. from splitflow.image_folder): the sample {'image': bytes, 'label': "
  "labels[i], 'index': i}; give the image ops field='image'.");

  mops.def("decode_jpeg", [](bool gray) {
    return CpuOp{"decode_jpeg", [gray](Value v) -> Value {
      image::Image in = image_input(std::move(v), "ops.decode_jpeg");
      return image::decode({in.index, std::move(in.path), std::move(in.pixels)},
                           gray ? image::Color::gray : image::Color::rgb);
    }, {}, true};
  }, py::arg("gray") = false,
  "CPU op: JPEG bytes -> uint8 HWC pixels (libjpeg-turbo). Corrupt or truncated data raises, "
  "naming the file; use the stage's on_error='skip' to drop such files.");

  mops.def("random_resized_crop", [](py::object size, py::object seed_arg, py::object epoch_arg,
                                     py::object scale_arg, py::object ratio_arg, py::object flip_arg,
                                     py::object antialias_in) {
    const bool antialias = antialias_arg(antialias_in, "splitflow.ops.random_resized_crop");
    const auto [h, w] = crop_size_arg(size, "splitflow.ops.random_resized_crop");
    const auto scale = range_arg(scale_arg, "splitflow.ops.random_resized_crop", "scale");
    const auto ratio = range_arg(ratio_arg, "splitflow.ops.random_resized_crop", "ratio");
    const double flip = flip_arg_of(flip_arg, "splitflow.ops.random_resized_crop");
    const std::uint64_t seed = u64_arg(seed_arg, "splitflow.ops.random_resized_crop", "seed");
    const std::uint64_t epoch = u64_arg(epoch_arg, "splitflow.ops.random_resized_crop", "epoch");
    const auto op = named_as("splitflow.ops.random_resized_crop", "RandomResizedCrop", [&] {
      return image::RandomResizedCrop(
          {h, w, scale.first, scale.second, ratio.first, ratio.second, flip, seed, epoch, antialias});
    });
    return CpuOp{"random_resized_crop", [op](Value v) -> Value {
      return op(pixels_input(std::move(v), "ops.random_resized_crop"));
    }, {}, true};
  }, py::arg("size") = 224, py::arg("seed") = 0, py::arg("epoch") = 0,
  py::arg("scale") = std::pair<double, double>{0.08, 1.0},
  py::arg("ratio") = std::pair<double, double>{3.0 / 4.0, 4.0 / 3.0}, py::arg("flip") = 0.5,
  py::arg("antialias") = true,
  "CPU op: torchvision's RandomResizedCrop + RandomHorizontalFlip on uint8 HWC pixels (HW: gray, "
  "one channel) (size: an "
  "int for a square, or (height, width), as torchvision takes it), with "
  "randomness drawn from (seed, epoch, the item's index): reproducible in any thread order. "
  "antialias=True (the default; None, torchvision's default, is the same, as torchvision does it "
  "on PIL images): the crop is shrunk as PIL's resize(BILINEAR) does it (within 1 "
  "at every pixel); antialias=False: the plain bilinear, which aliases when shrinking.");

  mops.def("decode_random_resized_crop", [](py::object size, py::object seed_arg, py::object epoch_arg,
                                            py::object scale_arg, py::object ratio_arg,
                                            py::object flip_arg, bool gray, py::object antialias_in,
                                            std::string scaled_decode) {
    const bool antialias = antialias_arg(antialias_in, "splitflow.ops.decode_random_resized_crop");
    using SD = image::AugmentSpec::ScaledDecode;
    SD sd;
    if (scaled_decode == "large") {
      sd = SD::large_photos;
    } else if (scaled_decode == "always") {
      sd = SD::always;
    } else if (scaled_decode == "never") {
      sd = SD::never;
    } else {
      throw GraphError("splitflow.ops.decode_random_resized_crop: scaled_decode='" + scaled_decode +
                       "'; use 'large' (the default: photos of 8 megapixels or more), 'always' or 'never'");
    }
    const auto [h, w] = crop_size_arg(size, "splitflow.ops.decode_random_resized_crop");
    const auto scale = range_arg(scale_arg, "splitflow.ops.decode_random_resized_crop", "scale");
    const auto ratio = range_arg(ratio_arg, "splitflow.ops.decode_random_resized_crop", "ratio");
    const double flip = flip_arg_of(flip_arg, "splitflow.ops.decode_random_resized_crop");
    const std::uint64_t seed = u64_arg(seed_arg, "splitflow.ops.decode_random_resized_crop", "seed");
    const std::uint64_t epoch = u64_arg(epoch_arg, "splitflow.ops.decode_random_resized_crop", "epoch");
    const auto op = named_as("splitflow.ops.decode_random_resized_crop", "DecodeRandomResizedCrop", [&] {
      return image::DecodeRandomResizedCrop(
          {h, w, scale.first, scale.second, ratio.first, ratio.second, flip, seed, epoch, antialias, sd},
          gray ? image::Color::gray : image::Color::rgb);
    });
    return CpuOp{"decode_random_resized_crop", [op](Value v) -> Value {
      image::Image in = image_input(std::move(v), "ops.decode_random_resized_crop");
      return op({in.index, std::move(in.path), std::move(in.pixels)});
    }, {}, true};
  }, py::arg("size") = 224, py::arg("seed") = 0, py::arg("epoch") = 0,
  py::arg("scale") = std::pair<double, double>{0.08, 1.0},
  py::arg("ratio") = std::pair<double, double>{3.0 / 4.0, 4.0 / 3.0}, py::arg("flip") = 0.5,
  py::arg("gray") = false, py::arg("antialias") = true, py::arg("scaled_decode") = "large",
  "CPU op: decode_jpeg + random_resized_crop fused (size: an int or (height, width)): the crop "
  "is drawn from the header's size "
  "and only its region is decoded. The same pixels as the two ops (with the same antialias), "
  "for less decoding, unless the crop is decoded at a reduced scale: scaled_decode='large' (the "
  "default) decodes a crop that shrinks by 2x or more at libjpeg's 1/2, 1/4 or 1/8 DCT scale "
  "(PIL's Image.draft; 1/4 at most for 4:2:2, 4:4:0 and 4:1:1 files, whose chroma libjpeg-turbo "
  "repeats at 1/8) for photos of 8 megapixels or more, 'always' for any image, 'never' "
  "keeps full decode. antialias as for random_resized_crop.");

  mops.def("resize", [](py::object height_arg, py::object width_arg, py::object antialias_in) {
    const bool antialias = antialias_arg(antialias_in, "splitflow.ops.resize");
    // (Out of range: GraphError, as the crop ops' sizes; past C's int it was pybind's TypeError.)
    if (width_arg.is_none()) {  // torchvision's Resize(size): the shorter side
      const int size = static_cast<int>(int_in(height_arg, "splitflow.ops.resize", "size", 1, image::kMaxOutputSide));
      return CpuOp{"resize", [size, antialias](Value v) -> Value {
        image::Image in = pixels_input(std::move(v), "ops.resize");
        in.pixels = image::resize_shorter(in.pixels, size, antialias);
        return in;
      }, {}, true};
    }
    const int height = static_cast<int>(int_in(height_arg, "splitflow.ops.resize", "height", 1, image::kMaxOutputSide));
    const int width = static_cast<int>(int_in(width_arg, "splitflow.ops.resize", "width", 1, image::kMaxOutputSide));
    return CpuOp{"resize", [height, width, antialias](Value v) -> Value {
      image::Image in = pixels_input(std::move(v), "ops.resize");
      in.pixels = image::resize(in.pixels, height, width, {}, antialias);
      return in;
    }, {}, true};
  }, py::arg("height"), py::arg("width") = py::none(), py::arg("antialias") = true,
  "CPU op: bilinear resize of uint8 HWC pixels (HW: gray, one channel) to height x width, or, "
  "given one size (width=None), its shorter side to that size and the longer in proportion "
  "(torchvision's Resize(256)). antialias=True (the default; None, torchvision's default, is the "
  "same, as torchvision does it on PIL images): when shrinking, "
  "PIL's resize(BILINEAR) (a triangle filter as wide as the scale factor; within 1 of PIL at "
  "every pixel); when enlarging, the plain bilinear. antialias=False: the plain bilinear always "
  "(two neighbours per side; aliases when shrinking).");

  mops.def("center_crop", [](py::object size) {
    const auto [h, w] = crop_size_arg(size, "splitflow.ops.center_crop");
    image::validate_size(h, w, "center_crop");
    return CpuOp{"center_crop", [h = h, w = w](Value v) -> Value {
      image::Image in = pixels_input(std::move(v), "ops.center_crop");
      in.pixels = image::center_crop(in.pixels, h, w);
      return in;
    }, {}, true};
  }, py::arg("size"),
  "CPU op: torchvision's CenterCrop on uint8 HWC pixels (size: an int for a square, or "
  "(height, width)): the centre of the image, zero-padded where the image is smaller. With "
  "resize(256) before it, torchvision's evaluation transform Resize(256) + CenterCrop(224).");
}

// A dict sample's "index" field, when it holds an integer: the data set index of its image.
std::optional<std::int64_t> sample_index(const Sample& s) {
  if (s.kind != Sample::Kind::dict) return std::nullopt;
  for (std::size_t i = 0; i < s.keys.size(); ++i)
    if (s.keys[i] == "index") return as_index(s.fields[i]);
  return std::nullopt;
}

// `body` (Value(Value) or Value(Value, DeviceContext&)) on one field of each sample (`field`: a
// dict's key or a tuple's index); the other fields pass through untouched. `method`, `name`:
// the stage's, for errors. `substitute` (the stage's substitute=): when the body raises, the
// sample goes on with that field replaced by it (the node emits it: detail::SubstituteWith),
// not the whole sample. `indexed` (a C++ op's body): a plain array in the field goes to it as
// an image with the sample's "index", when it has one (random_resized_crop draws from it).
template <class Body>
auto on_field(Body body, const py::object& field, const char* method, const std::string& name,
              std::shared_ptr<const Value> substitute = nullptr, bool indexed = false) {
  // (Read from Python once, here: the lookups need no GIL, within a GPU stage's lease too.)
  Sample::Name f = Sample::Name::of(field, "splitflow.Graph." + std::string(method) + "('" + name + "')");
  return [body = std::move(body), f = std::move(f), who = "stage '" + name + "'",
          substitute = std::move(substitute), indexed](Value v, auto&... ctx) -> Value {
    if (auto* b = std::get_if<BatchPtr>(&v)) {
      // A dynamic batch (a service's requests): the body on the field of each request, as one
      // batch of the same ids (a Python function gets those fields collated and returns one
      // result per request; a C++ op runs on each), each result put back in its request's
      // sample. (The body fails the batch as a whole as it would without field=.)
      Batch<Value>& batch = writable(*b);
      BatchPtr fields = same_requests(batch);
      std::vector<Sample*> samples;
      for (std::size_t i = 0; i < batch.items.size(); ++i) {
        if (i < batch.errors.size() && batch.errors[i]) {  // failed before: no sample left
          samples.push_back(nullptr);
          fields->batch.items.emplace_back();
          continue;
        }
        auto* p = std::get_if<SamplePtr>(&batch.items[i]);
        if (!p)
          throw Error(who + ": field=" + f.repr + " but request " + std::to_string(i) + " of its dynamic batch is " +
                      describe(batch.items[i]) + ", not a tuple or dict");
        samples.push_back(&writable(*p));
        fields->batch.items.push_back(samples.back()->at(f, who));
      }
      Value out = body(Value{std::move(fields)}, ctx...);
      auto* r = std::get_if<BatchPtr>(&out);
      if (!r || (*r)->batch.items.size() != samples.size())
        throw Error(who + ": field=" + f.repr + ": the body did not return one result per request of its dynamic batch");
      for (std::size_t i = 0; i < samples.size(); ++i)
        if (samples[i]) samples[i]->at(f, who) = std::move((*r)->batch.items[i]);
      batch.errors = std::move((*r)->batch.errors);
      return v;
    }
    auto* p = std::get_if<SamplePtr>(&v);
    if (!p) throw Error(who + ": field=" + f.repr + " but the item is " + describe(v) + ", not a tuple or dict");
    Sample& sample = writable(*p);
    Value& slot = sample.at(f, who);
    // The body on the field (a plain array given the sample's index first: within the
    // substitute's reach, as the op's own conversion of it was).
    const auto call = [&] {
      if (indexed && (std::holds_alternative<HostTensor>(slot) || std::holds_alternative<PyObj>(slot)))
        if (const std::optional<std::int64_t> index = sample_index(sample); index && *index >= 0)
          return body(Value{image::Image{static_cast<std::uint64_t>(*index), "",
                                         as_host(slot, who.c_str())}}, ctx...);
      return body(std::move(slot), ctx...);
    };
    if (!substitute) {
      slot = call();
      return v;
    }
    try {
      slot = call();
    } catch (...) {
      slot = *substitute;
      throw detail::SubstituteWith<Value>{std::move(v), std::current_exception()};
    }
    return v;
  };
}

void bind_ops(py::module_& m) {
  py::module_ mops = m.def_submodule("ops", "C++ ops: they run without the GIL.");
  py::class_<CpuOp>(mops, "CpuOp").def_readonly("name", &CpuOp::name).def("__repr__", [](const CpuOp& o) {
    return "<splitflow.ops.CpuOp " + o.name + ">";
  });
  py::class_<GpuOp>(mops, "GpuOp").def_readonly("name", &GpuOp::name).def("__repr__", [](const GpuOp& o) {
    return "<splitflow.ops.GpuOp " + o.name + ">";
  });

  // What normalize's arguments must be, checked when the op is made (not per item at run time).
  auto check_normalize = [](const char* op, const std::vector<float>& mean, const std::vector<float>& stddev) {
    // One value per channel, or one for all (broadcast, as torchvision's Normalize does).
    if (mean.empty() || stddev.empty() ||
        (mean.size() != stddev.size() && mean.size() != 1 && stddev.size() != 1))
      throw GraphError(std::string(op) + ": mean and std give one value per channel, or one "
                       "for all: " + std::to_string(mean.size()) + " means, " +
                       std::to_string(stddev.size()) + " stds");
    for (std::size_t i = 0; i < stddev.size(); ++i)
      if (stddev[i] == 0.0f)
        throw GraphError(std::string(op) + ": std[" + std::to_string(i) + "] is 0 (it divides)");
    // NaN or an infinity made every pixel NaN (or 0), silently: a new user's trial.
    auto finite = [&](const std::vector<float>& v, const char* name) {
      for (std::size_t i = 0; i < v.size(); ++i)
        if (!std::isfinite(v[i]))
          throw GraphError(std::string(op) + ": " + name + "[" + std::to_string(i) + "] is " +
                           py::repr(py::float_(v[i])).cast<std::string>() + "; give finite numbers");
    };
    finite(mean, "mean");
    finite(stddev, "std");
  };
  auto gpu_normalize = [](std::vector<float> mean, std::vector<float> stddev, float scale) {
    return [=](Value v, DeviceContext& ctx) -> Value {
      DeviceValue d = device_input(std::move(v), ctx, "ops.normalize");
      const bool single = d.tensor.ndim() == 3;
      DeviceTensor out = splitflow::ops::normalize(ctx, single ? batched(d.tensor) : d.tensor, mean, stddev, scale);
      return DeviceValue{single ? unbatched(out) : out, d.cuda};
    };
  };
  mops.def("normalize", [gpu_normalize, check_normalize](std::vector<float> mean, std::vector<float> stddev, float scale) {
    check_normalize("splitflow.ops.normalize", mean, stddev);
    return CpuOp{"normalize", [=](Value v) -> Value {
      HostTensor in = as_host(v, "ops.normalize");
      // Said in Python's words, of the array given (C++'s names a batch of one: f32[1, ...]).
      if (in.dtype() != DType::u8 || in.ndim() < 2 || in.ndim() > 4)
        throw Error("splitflow.ops.normalize takes uint8 pixels (an HWC image, an HW gray one or "
                    "an NHWC batch) and scales them (scale=1/255 by default), got " +
                    in.describe() + (in.dtype() != DType::u8 ? ": give the uint8 image, before "
                    "any conversion to float" : ""));
      if (in.ndim() == 2) in = reshaped(in, {in.dim(0), in.dim(1), 1});
      const bool single = in.ndim() == 3;
      HostTensor out = splitflow::ops::normalize(single ? batched(in) : in, mean, stddev, scale);
      return single ? unbatched(out) : out;
    }, gpu_normalize(mean, stddev, scale)};
  }, py::arg("mean"), py::arg("std"), py::arg("scale") = 1.0f / 255.0f,
  R"doc(uint8 HWC image (an HW gray one, or an NHWC batch) -> float32 CHW (NCHW), (x*scale - mean) / std, as C++'s
ops::normalize: in g.stage it runs on the CPU thread, in g.gpu_stage on the leased stream (host
input copied H2D first).)doc");

  mops.def("gpu_normalize", [gpu_normalize, check_normalize](std::vector<float> mean, std::vector<float> stddev, float scale) {
    check_normalize("splitflow.ops.gpu_normalize", mean, stddev);
    return GpuOp{"normalize", gpu_normalize(mean, stddev, scale)};
  }, py::arg("mean"), py::arg("std"), py::arg("scale") = 1.0f / 255.0f,
  R"doc(The GPU form of ops.normalize alone (ops.normalize in g.gpu_stage is the same).)doc");

  mops.def("busy_kernel", [](double microseconds) {
    const auto d = std::chrono::nanoseconds(static_cast<std::int64_t>(microseconds * 1000));
    return GpuOp{"busy_kernel", [d](Value v, DeviceContext& ctx) -> Value {
      splitflow::ops::busy_kernel(ctx, d);
      return v;
    }};
  }, py::arg("microseconds"), "GPU op: occupies the device for a set time; passes its input on.");

  mops.def("to_device", [] {
    return GpuOp{"to_device", [](Value v, DeviceContext& ctx) -> Value {
      return device_input(std::move(v), ctx, "ops.to_device");
    }};
  }, "GPU op: copies a host tensor or array to the device.");

  mops.def("to_host", [] {
    return GpuOp{"to_host", [](Value v, DeviceContext& ctx) -> Value {
      DeviceValue d = device_input(std::move(v), ctx, "ops.to_host");
      return ctx.to_host(d.tensor);
    }};
  }, "GPU op: copies a device tensor to pinned host memory.");

  mops.def("as_tensor", [] {
    return CpuOp{"as_tensor", [](Value v) -> Value { return as_host(v, "ops.as_tensor"); }};
  }, "CPU op: an array (buffer protocol, C-contiguous) -> a splitflow tensor viewing it (no copy).");

  mops.def("fill", [](std::vector<std::int64_t> shape, std::string dtype) {
    const DType dt = dtype_from_name(dtype);
    return CpuOp{"fill", [shape, dt](Value v) -> Value {
      // A tensor of `shape` whose bytes all equal the item (an integer) mod 256: test data.
      const std::optional<std::int64_t> i = as_index(v);
      if (!i) throw Error("ops.fill: expected an integer item, got " + describe(v));
      HostTensor t = HostTensor::empty(dt, shape);
      std::memset(t.raw(), static_cast<int>(*i & 0xff), t.nbytes());
      return t;
    }};
  }, py::arg("shape"), py::arg("dtype") = "uint8",
  "CPU op: integer item -> a new tensor of `shape` with every byte equal to item % 256.");
  bind_image_ops(mops);
}

}  // namespace

void bind_graph(py::module_& m) {
  // One hierarchy with C++'s (python/splitflow/_errors.py): every error is a splitflow.Error.
  py::module_ errors = py::module_::import("splitflow._errors");
  PyObject** error_types = g_error_types;
  const char* names[6] = {"Error",           "GraphError",    "StageError",
                          "OverloadedError", "DeadlineError", "CancelledError"};
  for (int i = 0; i < 6; ++i) {
    error_types[i] = py::object(errors.attr(names[i])).release().ptr();  // kept for the process
    m.attr(names[i]) = py::handle(error_types[i]);
  }
  g_stage_error = error_types[2];
  g_remote_exception = py::object(errors.attr("RemoteException")).release().ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const GraphError& e) {
      PyErr_SetString(g_error_types[1], e.what());
    } catch (const OverloadedError& e) {
      PyErr_SetString(g_error_types[3], e.what());
    } catch (const DeadlineError& e) {
      PyErr_SetString(g_error_types[4], e.what());
    } catch (const CancelledError& e) {
      PyErr_SetString(g_error_types[5], e.what());
    } catch (const Error& e) {
      PyErr_SetString(g_error_types[0], e.what());
    }
  });

  py::class_<PyRuntime, std::shared_ptr<PyRuntime>>(m, "Runtime", R"doc(
The shared executor: a oneTBB arena of `threads` threads (0: one per core) and, created lazily
when a GPU stage first runs, one device with a pool of `streams` streams shared by every graph.
`arbiter` shares the device with other processes (C++ ArbiterConfig, docs/sharing.md): a dict
with "name" and optionally "capacity", "share", "group", "liveness" (seconds) and "label".
`host_memory_budget`: bytes the items of its tuned graphs may hold at once (C++
RuntimeConfig::host_memory_budget; 0: none): the tuner sizes their queues within it.
`blocking_threads`: the most bodies of blocking stages (`Graph.stage(..., blocking=True)`)
waiting at once.)doc")
      .def(py::init([](py::object threads, bool telemetry, std::string backend, py::object streams,
                       py::object host_compute_slots, std::optional<py::dict> arbiter,
                       py::object host_memory_budget, py::object blocking_threads) {
             RuntimeConfig c;
             const std::string who = "splitflow.Runtime";
             c.blocking_threads = static_cast<std::size_t>(
                 int_in(blocking_threads, who, "blocking_threads", 1, 4096));
             c.threads = static_cast<int>(
                 int_in(threads, who, "threads", 0, RuntimeConfig::kMaxThreads, " (one per core)"));
             c.telemetry = telemetry;
             c.host_memory_budget = count_arg(host_memory_budget, who, "host_memory_budget",
                                              "an int >= 0 (bytes; 0: none)");
             if (backend == "auto") c.device.backend = BackendKind::automatic;
             else if (backend == "host") c.device.backend = BackendKind::host;
             else if (backend == "cuda") c.device.backend = BackendKind::cuda;
             else throw Error("splitflow.Runtime: backend must be 'auto', 'host' or 'cuda', not '" + backend + "'");
             c.device.streams = static_cast<std::size_t>(int_in(streams, who, "streams", 1, 1024));
             c.device.host_compute_slots =
                 static_cast<int>(int_in(host_compute_slots, who, "host_compute_slots", 1, 1024));
             if (arbiter) {
               ArbiterConfig& a = c.device.arbiter;
               for (auto [k, v] : *arbiter) {
                 const std::string key = py::str(k);
                 if (key == "name") a.name = py::cast<std::string>(v);
                 else if (key == "capacity") a.capacity = py::cast<std::size_t>(v);
                 else if (key == "share") a.share = py::cast<double>(v);
                 else if (key == "group") a.group = py::cast<std::string>(v);
                 else if (key == "label") a.label = py::cast<std::string>(v);
                 else if (key == "liveness") {
                   // Seconds, whole milliseconds from 0.001 to an hour (below half a
                   // millisecond it rounded to 0 and was refused in C++'s words; 1e300 was an
                   // overflowing cast).
                   const double sec = py::cast<double>(v);
                   if (!(sec >= 0.001 && sec <= 3600))
                     throw Error("splitflow.Runtime: arbiter liveness is " +
                                 py::repr(py::float_(sec)).cast<std::string>() +
                                 " seconds; it must be from 0.001 to 3600");
                   a.liveness = std::chrono::milliseconds(std::llround(sec * 1000.0));
                 }
                 else
                   throw Error("splitflow.Runtime: arbiter has no option '" + key +
                               "' (name, capacity, share, group, liveness, label)");
               }
               if (a.name.empty()) throw Error("splitflow.Runtime: arbiter needs a \"name\"");
             }
             return make_released(std::make_unique<PyRuntime>(c));
           }),
           py::arg("threads") = 0, py::arg("telemetry") = true, py::arg("backend") = "auto",
           py::arg("streams") = 8, py::arg("host_compute_slots") = 1,
           py::arg("arbiter") = py::none(), py::arg("host_memory_budget") = 0,
           py::arg("blocking_threads") = 64)
      .def_property_readonly("threads", [](const PyRuntime& r) { return r.rt.threads(); })
      .def("device_stats", [](const PyRuntime& r) -> py::object {
        auto d = r.rt.device_stats();
        if (!d) return py::none();
        RunStats empty;
        py::dict all = py::module_::import("json").attr("loads")(to_json(empty, d));
        return all["device"];
      }, "The device's figures as a dict (None until a GPU stage has run).");

  py::class_<PyNode, std::shared_ptr<PyNode>>(m, "Node", "A stage of a graph; `a >> b` connects a to b.")
      .def_readonly("name", &PyNode::name)
      .def("__rshift__", [](std::shared_ptr<PyNode> a, std::shared_ptr<PyNode> b) {
        connect_nodes(*a, *b);
        return b;
      })
      .def("__iter__", [](std::shared_ptr<PyNode> n) {
        if (!n->pull) throw GraphError("splitflow: only a pull sink can be iterated ('" + n->name + "')");
        auto it = std::make_unique<PullIterator>(n);
        // The graph's run going now is the one it reads: Ctrl-C, close() and leaving the loop
        // early cancel that one (before, nothing cancelled it: the run went on, its sink full,
        // and the graph's next run was refused as "already running").
        it->own = false;
        if (const auto& last = n->graph->last_run; last && last->status() == RunStatus::running) it->run = *last;
        return make_released(std::move(it));
      }, "Iterates the items of the graph's current run (pull sinks only).")
      .def("__repr__", [](const PyNode& n) { return "<splitflow.Node " + n.name + ">"; })
      .def("first", [](const PyNode& n) {
        if (!n.first) throw GraphError("splitflow: '" + n.name + "' is not a zip; only Graph.zip has first() and second()");
        return n.first;
      }, "A zip's first input (Graph.zip): `a >> z.first()`.")
      .def("second", [](const PyNode& n) {
        if (!n.second) throw GraphError("splitflow: '" + n.name + "' is not a zip; only Graph.zip has first() and second()");
        return n.second;
      }, "A zip's second input (Graph.zip): `b >> z.second()`.")
      .def_property_readonly("pool", [](const PyNode& n) { return n.pool.get(); },
                             "A process stage's worker pool (pids, stats()); None for others.");
  py::class_<PyCompletion>(m, "_Completion")
      .def("done", &PyCompletion::done)
      .def("fail", &PyCompletion::fail, py::arg("exc"), py::arg("keep") = py::none())
      .def("withdrawn", [](const PyCompletion& c) { return c.c->withdrawn(); },
           "Whether its item's run was cancelled or failed (an answer now does nothing).");

  py::class_<PullIterator, std::shared_ptr<PullIterator>>(m, "PullIterator", py::custom_type_setup(ctrl_c_aware_iterator))
      .def("__iter__", [](py::object self) { return self; })
      .def("__next__", &PullIterator::next)
      .def_property_readonly("item", [](const PullIterator& it) { return it.item; },
                             "The number in its run of the item last returned: its source item's "
                             "position, as errors name it (items a stage skipped leave gaps); None "
                             "before the first.")
      .def_property_readonly("run", [](const PullIterator& it) {
        auto r = std::make_shared<PyRun>();
        r->run = it.run;
        r->graph = it.node->graph;
        return r;
      }, "The run this iterator reads.")
      .def("close", [](PullIterator& it) {
        if (!it.finished) {
          it.finished = true;
          if (!it.close_and_wait()) throw py::error_already_set();
        }
      }, "Cancels the run if it is still going, and waits for its end (Ctrl-C: see "
         "docs/architecture.md, \"The Python layer\").");

  py::class_<PyRun, std::shared_ptr<PyRun>>(m, "Run", "A run of a graph: wait(), cancel(), stats().")
      .def("wait", [](PyRun& r, std::optional<double> timeout) -> py::object {
        bool done = false;
        const RunStatus s = wait_run(r.run, timeout, done, r.graph);
        if (!done) return py::none();
        return py::str(to_string(s));
      }, py::arg("timeout") = py::none(),
      "Waits for the end (or `timeout` seconds: None if still running); returns the status. "
      "Raises StageError if a stage failed.")
      .def("cancel", [](PyRun& r) {
        NoGil nogil;
        r.run.cancel();
      })
      .def_property_readonly("status", [](const PyRun& r) { return to_string(r.run.status()); })
      .def("stats", [](const PyRun& r) {
        RunStats st;
        {
          NoGil nogil;
          st = r.run.stats();
        }
        return stats_dict(st);
      }, "The run's figures as a dict (live while running): the keys of docs/telemetry.md.")
      .def("report", [](const PyRun& r) {
        std::string text;
        {
          NoGil nogil;
          text = report(r.run.stats(), r.graph->runtime->rt.device_stats());
        }
        return text;
      }, "The text report with its diagnosis.")
      .def("json", [](const PyRun& r) {
        NoGil nogil;
        return to_json(r.run.stats(), r.graph->runtime->rt.device_stats());
      })
      .def("prometheus", [](const PyRun& r) {
        NoGil nogil;
        return prometheus_text(r.run.stats(), r.graph->runtime->rt.device_stats());
      })
      .def("trace_json", [](const PyRun& r) { return r.run.trace_json(); })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyRun& r, py::object type, py::object, py::object) {
        // Leaving a `with` block cancels a run still going (an exception, a break) and waits for
        // its end: as Ctrl-C in a wait when a KeyboardInterrupt (or another exception that is
        // not an Exception: SystemExit) leaves it (end_on_ctrl_c: a body that cannot be
        // interrupted is left behind), else in slices that let Ctrl-C through (wait_cancelled).
        // It drained the run whatever: for ever behind a hung body, Ctrl-C ignored.
        if (!r.run.valid() || r.run.status() != RunStatus::running) return false;
        if (!type.is_none() && !PyErr_GivenExceptionMatches(type.ptr(), PyExc_Exception)) {
          end_on_ctrl_c(r.run, r.graph.get(), nullptr, type.ptr());
          return false;
        }
        {
          NoGil nogil;
          r.run.cancel();
        }
        if (!wait_cancelled(r.run, r.graph.get())) throw py::error_already_set();
        return false;
      });

  py::class_<PyService, std::shared_ptr<PyService>>(m, "Service", R"doc(
A graph's request entry and exit (Graph.service). submit() returns a concurrent.futures.Future
(await it from asyncio with asyncio.wrap_future); every future completes exactly once: with the
result, with a StageError naming the graph, the stage and the request when a stage failed on it
(the body's exception its __cause__), with DeadlineError, or with an Error when the run ends
first.)doc")
      .def_readonly("source", &PyService::source, "Connect it to the graph's first stage.")
      .def_readonly("sink", &PyService::sink, "Connect the graph's last stage to it.")
      .def("submit", [](PyService& s, py::object value, std::optional<double> deadline) {
        py::object fut = py::module_::import("concurrent.futures").attr("Future")();
        fut.attr("set_running_or_notify_cancel")();  // it cannot be cancelled: the graph owns it
        Value v = from_python(value);
        std::optional<std::chrono::steady_clock::time_point> when;
        if (deadline) {
          // Seconds from now, within what the clock holds: past about 30 years (inf included),
          // no deadline; before as long ago, one that has passed. (A conversion of 1e10 s or
          // inf overflowed, and the request expired at once.)
          constexpr double kFar = 1e9;
          const double d = *deadline;
          if (std::isnan(d))
            throw GraphError("splitflow.Service.submit: deadline is NaN: give seconds from now "
                             "(None or math.inf: no deadline)");
          if (d < kFar)
            when = std::chrono::steady_clock::now() +
                   std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                       std::chrono::duration<double>(std::max(d, -kFar)));
        }
        auto keep = std::make_shared<PyObj>(fut);
        {
          NoGil nogil;  // admission may wait for room
          s.svc.submit(std::move(v), when, [keep](Value* result, std::exception_ptr error) {
            if (!python_alive()) return;
            WithGil gil;
            if (!gil) return;  // exiting: the future is left unanswered
            try {
              py::object f = keep->get();
              if (result) f.attr("set_result")(to_python(std::move(*result)));
              else f.attr("set_exception")(python_error(error));
            } catch (py::error_already_set& e) {
              e.discard_as_unraisable("splitflow.Service: completing a request's future");
            }
          });
        }
        return fut;
      }, py::arg("item"), py::arg("deadline") = py::none(),
      "Submits a request; returns a concurrent.futures.Future of its result. deadline: seconds "
      "from now (None or math.inf: none) after which, if no GPU stage or dynamic batch has taken it yet, it is dropped "
      "with DeadlineError. Waits for room (admission='wait': until the deadline at most, then "
      "raises DeadlineError) or raises OverloadedError "
      "(admission='fail_fast', or a submit from a thread of the graph's runtime, a stage "
      "body, that would wait for room only the runtime's threads make) when max_pending "
      "requests are pending; GraphError when the graph "
      "is not running or the service was closed.")
      .def("close", [](PyService& s) { s.svc.close(); },
           "No more requests: the run ends once every admitted one is answered. Called before the "
           "graph's first run (or as a run starts), it closes that run, which ends as it "
           "starts; after a run ended it does nothing.")
      .def("stats", [](const PyService& s) {
        return py::module_::import("json").attr("loads")(to_json(s.svc.stats()));
      }, "The service's figures as a dict (to_json(ServiceStats)'s keys): submitted, answered, "
         "failed, expired, rejected, pending and the latency split.");

  py::class_<PyGraph, std::shared_ptr<PyGraph>>(m, "Graph", R"doc(
A job: stages joined by bounded queues. Python callables run with the GIL (they serialise on
it); C++ ops (splitflow.ops) run without it, in parallel.)doc", py::custom_type_setup(collectable_graph))
      .def(py::init([](std::shared_ptr<PyRuntime> rt, std::string name, py::object max_in_flight,
                       py::object capacity, bool trace, double autotune_window,
                       bool autotune_queues, py::object priority, py::object autotune_cores) {
             GraphOptions o;
             const std::string who = "splitflow.Graph '" + name + "'";
             // (C++'s GraphOptions::autotune_cores, which Python lacked: a trial.)
             if (py::isinstance<py::bool_>(autotune_cores) ||
                 !(py::hasattr(autotune_cores, "__float__") || py::hasattr(autotune_cores, "__index__")))
               throw GraphError(who + ": autotune_cores must be a number of cores, not " +
                                py::repr(autotune_cores).cast<std::string>());
             o.autotune_cores = py::float_(autotune_cores).cast<double>();
             if (!(o.autotune_cores >= 0) || !std::isfinite(o.autotune_cores))
               throw GraphError(who + ": autotune_cores=" + py::repr(autotune_cores).cast<std::string>() +
                                ": it must be a finite number of cores, 0 or more (0: the runtime's "
                                "threads)");
             // (Past C's int it was pybind's "incompatible constructor arguments": a trial.)
             o.priority = static_cast<int>(int_in(priority, who, "priority", INT_MIN, INT_MAX));
             o.autotune_queues = autotune_queues;
             o.max_in_flight = count_arg(max_in_flight, who, "max_in_flight", "an int >= 1");
             o.default_capacity = count_arg(capacity, who, "capacity", "an int >= 1");
             // (Said with Python's names: C++'s message names GraphOptions::default_capacity.)
             if (o.max_in_flight == 0) throw GraphError(who + ": max_in_flight=0: it must be an int >= 1");
             if (o.default_capacity == 0)
               throw GraphError(who + ": capacity=0: a graph's capacity (its stages' default queue "
                                "size, which a stage's capacity=0 takes) must be an int >= 1");
             o.trace = trace;
             // Seconds, from a millisecond to an hour (the C++ kMaxAutotuneWindow): 1e300 was
             // cast to an integer (undefined behaviour: a 1 ms window here).
             constexpr double kMaxWindowSeconds =
                 std::chrono::duration<double>(kMaxAutotuneWindow).count();
             if (!(autotune_window >= 0.001 && autotune_window <= kMaxWindowSeconds))
               throw GraphError("splitflow.Graph '" + name + "': autotune_window must be positive "
                                "seconds, from 0.001 to " + std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kMaxAutotuneWindow).count()) +
                                " (got " + py::repr(py::float_(autotune_window)).cast<std::string>() + ")");
             o.autotune_window = std::chrono::milliseconds(std::llround(autotune_window * 1000));
             return make_released(std::make_unique<PyGraph>(std::move(rt), std::move(name), o));
           }),
           py::arg("runtime"), py::arg("name") = "graph", py::arg("max_in_flight") = 256,
           py::arg("capacity") = 32, py::arg("trace") = false, py::arg("autotune_window") = 0.25,
           py::arg("autotune_queues") = true, py::arg("priority") = 0, py::arg("autotune_cores") = 0)
      .def_property_readonly("name", [](const PyGraph& g) { return g.graph.name(); })
      .def("source", [](std::shared_ptr<PyGraph> g, std::string name, py::object iterable) {
        // (An iterable another system fills says so: splitflow.dask's remote pass.)
        std::string fed_by;
        if (py::object f = py::getattr(iterable, "splitflow_fed_by", py::none()); py::isinstance<py::str>(f))
          fed_by = f.cast<std::string>();
        auto s = g->graph.source(name, PythonSource{g->hold(std::move(iterable)), {}, g->bodies,
                                                 "source '" + name + "' of graph '" + g->graph.name() + "'"});
        if (!fed_by.empty()) s.fed_by(std::move(fed_by));
        return std::make_shared<PyNode>(PyNode{g, name, nullptr, &s.out_port(), std::nullopt});
      }, py::arg("name"), py::arg("iterable"),
      "A source from a Python iterable (iter() is called afresh for each run). An iterable "
      "with a str attribute ``splitflow_fed_by`` names the system that produces its items "
      "(the diagnosis points there when the source is the bottleneck: Node::fed_by).")
      .def("indices", [](std::shared_ptr<PyGraph> g, std::string name, py::object values) {
        // A C++ source: the graph keeps the list; no GIL per item.
        auto kept = std::make_shared<std::vector<std::int64_t>>(
            int64_list(values, "splitflow.Graph.indices('" + name + "')"));
        auto s = g->graph.source(name, [kept, i = std::size_t{0}]() mutable -> std::optional<Value> {
          if (i == kept->size()) return std::nullopt;
          return Value{(*kept)[i++]};
        });
        return std::make_shared<PyNode>(PyNode{g, name, nullptr, &s.out_port(), std::nullopt});
      }, py::arg("name"), py::arg("values"),
      "A C++ source of integers (indices into a dataset): no GIL per item.")
      .def("stage", [](std::shared_ptr<PyGraph> g, std::string name, py::object body,
                       py::object concurrency, py::object ordered_arg, py::object capacity_arg,
                       py::object on_error_arg, py::object substitute, py::object order,
                       py::object field, py::object processes_arg, py::object blocking_arg) {
        const std::string who = "splitflow.Graph.stage('" + name + "')";
        // None: 'fail', or 'substitute' where substitute= is given. A policy said with a
        // substitute that contradicts it is refused (the substitute won, silently, over 'skip'
        // and over 'fail': new users' trials); 'substitute' is C++'s OnError::substitute.
        if (!on_error_arg.is_none() && !py::isinstance<py::str>(on_error_arg))
          throw GraphError(who + ": on_error must be 'fail', 'skip' or 'substitute', not " +
                           std::string(py::repr(on_error_arg)));
        std::string on_error = on_error_arg.is_none() ? "fail" : on_error_arg.cast<std::string>();
        if (on_error != "fail" && on_error != "skip" && on_error != "substitute")
          throw GraphError(who + ": on_error must be 'fail', 'skip' or 'substitute', not '" + on_error + "'");
        if ((on_error == "skip" || on_error == "fail") && !on_error_arg.is_none() && !substitute.is_none())
          throw GraphError(who + ": on_error='" + on_error + "' " +
                           (on_error == "skip" ? "drops a failed item" : "fails the run on a failed item") +
                           ", substitute= replaces it: give one of them");
        if (on_error == "substitute") {
          if (substitute.is_none())
            throw GraphError(who + ": on_error='substitute' replaces a failed item with substitute=, "
                             "which is not given");
          on_error = "fail";  // (substitute= sets the policy: substitute_on_error)
        }
        const bool ordered = flag_arg(ordered_arg, who, "ordered");
        const bool blocking = flag_arg(blocking_arg, who, "blocking");
        const std::size_t processes =
            count_arg(processes_arg, who, "processes", "an int >= 0 (0: run in a thread of the runtime)");
        // concurrency="auto": C++'s Concurrency::automatic (the graph's tuner sets it). Not
        // given: "auto" for a C++ op (the library's, safe on any number of threads at once),
        // 1 for a Python function (whose state is its author's: serial unless they say).
        std::size_t n;
        if (concurrency.is_none()) {
          n = py::isinstance<CpuOp>(body) && processes == 0 ? Concurrency::automatic : Concurrency::serial;
        } else if ((n = concurrency_arg(concurrency, "splitflow.Graph.stage('" + name + "')")) ==
                   Concurrency::automatic) {
          if (processes > 0)
            throw GraphError("splitflow.Graph.stage('" + name + "'): concurrency='auto' is for "
                             "thread stages; a process stage's concurrency is its processes");
        } else {
          // (It was taken and ignored: the workers are the stage's concurrency, a new user's
          // trial gave processes=2, concurrency=4.)
          if (processes > 0)
            throw GraphError("splitflow.Graph.stage('" + name + "'): concurrency=" +
                             std::to_string(n) + " is for thread stages; a process stage's "
                             "concurrency is its processes (processes=" +
                             std::to_string(processes) + ", two items out per worker)");
        }
        const std::size_t capacity = count_arg(capacity_arg, "splitflow.Graph.stage('" + name + "')", "capacity");
        StageOptions o = stage_options(n, order_of(ordered, order), capacity, on_error);
        if (blocking && processes > 0)
          throw GraphError("splitflow.Graph.stage('" + name + "'): blocking=True runs the body on "
                           "the runtime's blocking threads; processes= runs it in worker "
                           "processes: give one of them");
        o.blocking = blocking;
        std::optional<Stage<Value, Value>> s;
        std::function<Value(Value)> fn;
        if (processes > 0) {
          // Past the GIL: the function runs in `processes` spawned worker processes
          // (splitflow/_procs.py); this stage hands each item on and is answered by the pool's
          // reader thread, so no arena thread waits. Two items per worker are out at once.
          if (py::isinstance<CpuOp>(body))
            throw GraphError("splitflow.Graph.stage('" + name + "', processes=" +
                             std::to_string(processes) + "): " + body.cast<CpuOp>().name +
                             " is a C++ op, which runs without the GIL already; processes= is "
                             "for Python functions");
          if (!PyCallable_Check(body.ptr()))
            throw GraphError("splitflow.Graph.stage('" + name + "'): the body must be callable");
          constexpr std::size_t kDepth = 2;
          py::object pool = py::module_::import("splitflow._procs").attr("ProcessPool")(
              body, processes, name, field, py::arg("depth") = kDepth,
              py::arg("substitute") = substitute);
          o.concurrency = static_cast<std::size_t>(processes) * kDepth;
          auto submit = [pool = g->hold(pool), by_field = !field.is_none(),
                         who = "stage '" + name + "' of graph '" + g->graph.name() + "'"](Value v, Completion<Value> c) {
            WithGil gil;
            if (!gil) throw_exiting("a process stage");
            PyCompletion pc{std::make_shared<Completion<Value>>(std::move(c))};
            // (A dynamic batch: its requests collated go to the worker, its results come back
            // one per request, the batch's ids kept here.)
            if (auto* b = std::get_if<BatchPtr>(&v)) {
              if (by_field)
                throw Error(who + ": field= on a process stage is not for a dynamic batch's requests; "
                            "give its function the requests whole (no field=), or make it a thread "
                            "stage, where field= takes that field of each request");
              pc.batch = *b, pc.who = who;
              auto groups = call_python([&] { return request_groups((*b)->batch); });
              if (groups.empty()) {  // every request failed before: nothing to send (a review)
                pc.c->done(grouped_results(*b, groups, [](std::size_t) -> Value { return {}; }));
                return;
              }
              if (!whole(groups, *b)) {  // (as a thread stage's: one batch per group)
                call_python([&] {
                  py::list parts;
                  for (const auto& at : groups) parts.append(to_python(Value(requests_at((*b)->batch, at))));
                  py::object item = py::module_::import("splitflow._procs").attr("_Groups")(parts);
                  pc.grouped = true;
                  pc.groups = std::move(groups);
                  pool->obj.get().attr("submit")(item, pc);
                });
                return;
              }
            }
            call_python([&] { pool->obj.get().attr("submit")(to_python(std::move(v)), pc); });
          };
          auto a = g->graph.async_stage<Value, Value>(name, std::move(submit), o);
          if (!substitute.is_none()) a.substitute_on_error(from_python(substitute));
          auto node = std::make_shared<PyNode>(PyNode{g, name, &a.in_port(), &a.out_port(), std::nullopt});
          node->pool = PyObj(pool);
          return node;
        }
        const bool indexed = py::isinstance<CpuOp>(body) && body.cast<CpuOp>().indexed;
        if (py::isinstance<CpuOp>(body)) {
          fn = per_item(body.cast<CpuOp>().fn);
        } else {
          if (py::isinstance<GpuOp>(body))
            throw GraphError("splitflow.Graph.stage('" + name + "'): ops." + body.cast<GpuOp>().name +
                             " is a GPU op; give it to g.gpu_stage('" + name + "', ...)");
          if (!PyCallable_Check(body.ptr())) throw GraphError("splitflow.Graph.stage('" + name + "'): the body must be callable or a splitflow.ops.CpuOp");
          fn = PythonBody{g->hold(std::move(body)), g->bodies,
                          "stage '" + name + "' of graph '" + g->graph.name() + "'"};
        }
        auto sub = substitute.is_none() ? nullptr : std::make_shared<const Value>(from_python(substitute));
        if (!field.is_none()) fn = on_field(std::move(fn), field, "stage", name, sub, indexed);
        s = g->graph.stage<Value>(name, std::move(fn), o);
        if (sub) s->substitute_on_error(*sub);
        return std::make_shared<PyNode>(PyNode{g, name, &s->in_port(), &s->out_port(), std::nullopt});
      }, py::arg("name"), py::arg("body"), py::arg("concurrency") = py::none(), py::arg("ordered") = true,
      py::arg("capacity") = 0, py::arg("on_error") = py::none(), py::arg("substitute") = py::none(),
      py::arg("order") = py::none(), py::arg("field") = py::none(), py::arg("processes") = 0,
      py::arg("blocking") = false,
      "A CPU stage: a Python callable (holds the GIL while it runs) or a C++ op from "
      "splitflow.ops (no GIL). concurrency 0 means unlimited; 'auto': set by the graph's tuner "
      "while it runs (its decisions in the stats' 'autotune'); not given: 'auto' for a C++ op, "
      "1 for a Python function (serial: its state is yours). order='in_order' (default) or "
      "'out_of_order', as in C++ (ordered=True/False says the same). on_error='skip' drops items "
      "whose body raises (counted, with their messages, in the stats: 'skipped', 'errors'); "
      "substitute=value emits value in their place instead. field='image' (a dict's key) or "
      "field=0 (a tuple's index): the body takes that field of each sample and the others "
      "(label, index, ...) pass through untouched; a skip drops the whole sample. "
      "processes=N runs a Python function in N spawned worker processes (past the GIL, as "
      "DataLoader workers; the function must be importable by name), arrays moving through "
      "shared memory; same order, error and skip semantics; a worker that dies fails (or skips) "
      "only the item it held and is replaced. blocking=True: the body waits rather than "
      "computes (a slow read, a blocking call): it runs on the runtime's blocking threads, not "
      "the arena's, so concurrency may go past the cores ('auto' takes it there when its "
      "measured CPU is a small part of its time); a Python body holds the GIL only while it "
      "runs Python.")
      .def("batch", [](std::shared_ptr<PyGraph> g, std::string name, py::object size_arg, py::object drop_last_arg) {
        const std::size_t size =
            count_arg(size_arg, "splitflow.Graph.batch('" + name + "')", "size", "an int >= 1");
        const bool drop_last = flag_arg(drop_last_arg, "splitflow.Graph.batch('" + name + "')", "drop_last");
        // Gathers `size` items and stacks their tensors into one (N, ...) tensor, in C++.
        auto b = g->graph.batch<Value>(name, size, {.drop_last = drop_last});
        const std::string who = "Graph.batch('" + name + "')";
        auto c = g->graph.stage(name + ".collate", [who](std::vector<Value> items) -> Value {
          return collate(std::move(items), who);
        });
        b >> c;
        return std::make_shared<PyNode>(PyNode{g, name, &b.in_port(), &c.out_port(), std::nullopt});
      }, py::arg("name"), py::arg("size"), py::arg("drop_last") = false,
      "Gathers `size` items and collates them in C++, as torch's default_collate does: tensors "
      "or arrays of one shape into one tensor (size, ...), ints into an int64 tensor, floats "
      "into a float64 tensor, tuples and dicts field by field (labels, indices and images of "
      "a sample each into their own), anything else into a list. The last batch may be "
      "shorter unless drop_last.")
      .def("dynamic_batch", [](std::shared_ptr<PyGraph> g, std::string name, py::object max_batch_arg,
                               double max_delay, py::object capacity_arg) {
        const std::string where = "splitflow.Graph.dynamic_batch('" + name + "')";
        const std::size_t max_batch = count_arg(max_batch_arg, where, "max_batch", "an int >= 1");
        const std::size_t capacity = count_arg(capacity_arg, where, "capacity");
        if (max_batch == 0) throw GraphError("splitflow.Graph.dynamic_batch('" + name + "'): max_batch must be at least 1");
        if (!(max_delay >= 0)) throw GraphError("splitflow.Graph.dynamic_batch('" + name + "'): max_delay must be >= 0 seconds");
        DynamicBatchOptions o;
        o.max_batch = max_batch;
        // float('inf') (or past what nanoseconds hold): full batches only, the last at the
        // input's end, as C++'s nanoseconds::max() (the cast of inf was undefined).
        o.max_delay = max_delay * 1e9 >= 9.2e18
                          ? std::chrono::nanoseconds::max()
                          : std::chrono::nanoseconds(static_cast<std::int64_t>(max_delay * 1e9));
        o.capacity = capacity;
        auto d = g->graph.dynamic_batch<Value>(name, o);
        // Its batches travel on Value edges to the Python stages and ops after it.
        auto box = g->graph.stage(name + ".box", [](Batch<Value> b) -> Value {
          return std::make_shared<BatchBox>(BatchBox{std::move(b)});
        });
        d >> box;
        return std::make_shared<PyNode>(PyNode{g, name, &d.in_port(), &box.out_port(), std::nullopt});
      }, py::arg("name"), py::arg("max_batch") = 32, py::arg("max_delay") = 0.002,
      py::arg("capacity") = 0,
      "A service's dynamic batch: gathers up to max_batch requests, or fewer once the oldest "
      "waited max_delay seconds. A Python stage after it gets the requests' items collated "
      "(as Graph.batch does) and returns one result per request; a C++ op applies to each "
      "item (an item's error fails its request alone). Graph.unbatch splits it again.")
      .def("unbatch", [](std::shared_ptr<PyGraph> g, std::string name, py::object max_batch_arg) {
        const std::size_t max_batch = count_arg(max_batch_arg, "splitflow.Graph.unbatch('" + name + "')", "max_batch", "an int >= 1");
        const std::string who = "unbatch '" + name + "'";
        auto unbox = g->graph.stage(name + ".unbox", [who](Value v) -> Batch<Value> {
          auto* b = std::get_if<BatchPtr>(&v);
          if (!b) throw Error(who + ": expected a dynamic batch, got " + describe(v));
          if (b->use_count() == 1) return std::move((*b)->batch);
          return (*b)->batch;
        });
        auto u = g->graph.unbatch<Value>(name, max_batch);
        unbox >> u;
        return std::make_shared<PyNode>(PyNode{g, name, &unbox.in_port(), &u.out_port(), std::nullopt});
      }, py::arg("name"), py::arg("max_batch") = 32,
      "Splits a dynamic batch back into its requests' results (max_batch: the dynamic batch's).")
      .def("service", [](std::shared_ptr<PyGraph> g, std::string name, py::object max_pending_arg,
                         std::string admission) {
        const std::size_t max_pending = count_arg(max_pending_arg, "splitflow.Graph.service('" + name + "')", "max_pending");
        ServiceOptions o;
        o.max_pending = max_pending;
        if (admission == "wait") o.admission = Admission::wait;
        else if (admission == "fail_fast") o.admission = Admission::fail_fast;
        else throw GraphError("splitflow.Graph.service('" + name + "'): admission must be 'wait' or 'fail_fast', not '" + admission + "'");
        auto svc = g->graph.service<Value, Value>(name, o);
        auto src = std::make_shared<PyNode>(PyNode{g, name, nullptr, &svc.source().out_port(), std::nullopt});
        auto sink = std::make_shared<PyNode>(PyNode{g, name + ".answer", &svc.sink().in_port(), nullptr, std::nullopt});
        return std::make_shared<PyService>(PyService{g, svc, src, sink});
      }, py::arg("name"), py::arg("max_pending") = 64, py::arg("admission") = "wait",
      "The graph's request entry and exit (one per graph): connect svc.source >> first stage "
      "and last stage >> svc.sink, run the graph, then svc.submit(item) from any thread.")
      .def("gpu_stage", [](std::shared_ptr<PyGraph> g, std::string name, py::object op_object,
                           py::object concurrency_in, py::object ordered_arg, py::object capacity_arg,
                           py::object order, std::string on_error, py::object field) {
        const std::string where = "splitflow.Graph.gpu_stage('" + name + "')";
        const bool ordered = flag_arg(ordered_arg, where, "ordered");
        // concurrency="auto": C++'s GpuStageOptions with Concurrency::automatic (the graph's
        // tuner sets its bursts in flight). It was refused ("must be an int >= 0, not 'auto'")
        // though C++ takes it (a new user's trial).
        const std::size_t concurrency = concurrency_arg(concurrency_in, where);
        const std::size_t capacity = count_arg(capacity_arg, where, "capacity");
        GpuOp op;
        if (py::isinstance<GpuOp>(op_object)) {
          op = op_object.cast<GpuOp>();
        } else if (py::isinstance<CpuOp>(op_object) && op_object.cast<const CpuOp&>().gpu) {
          const CpuOp& c = op_object.cast<const CpuOp&>();
          op = GpuOp{c.name, c.gpu};
        } else {
          throw GraphError("splitflow.Graph.gpu_stage('" + name + "'): the op must be a splitflow.ops "
                           "op with a GPU form (ops.normalize, ops.to_device, ...), not " +
                           std::string(py::repr(op_object)) + "; CPU-only ops go in g.stage");
        }
        GpuStageOptions o;
        o.concurrency = concurrency == 0 ? Concurrency::unlimited : concurrency;
        o.order = order_of(ordered, order);
        o.capacity = capacity;
        o.on_error = on_error_of(on_error);
        // Per request on a dynamic batch (a service's model step), as g.stage's C++ ops: the
        // op took the batch itself and refused it (a new user's trial).
        auto body = [each = per_item(op.fn)](Value v, DeviceContext& ctx) { return each(std::move(v), ctx); };
        auto node = [&](auto&& b) {
          auto s = g->graph.gpu_stage<Value>(name, std::move(b), o);
          return std::make_shared<PyNode>(PyNode{g, name, &s.in_port(), &s.out_port(), std::nullopt});
        };
        return field.is_none() ? node(std::move(body)) : node(on_field(std::move(body), field, "gpu_stage", name));
      }, py::arg("name"), py::arg("op"), py::arg("concurrency") = 2, py::arg("ordered") = true,
      py::arg("capacity") = 0, py::arg("order") = py::none(), py::arg("on_error") = "fail",
      py::arg("field") = py::none(),
      "A GPU stage running a splitflow.ops GPU op: it leases a pooled stream per burst. "
      "concurrency: its bursts in flight at once (0: unlimited; 'auto': the graph's tuner sets it, "
      "as C++'s Concurrency::automatic). order, on_error and field (the op takes that field of each sample, the others pass through) as "
      "for stage().")
      .def("sink", [](std::shared_ptr<PyGraph> g, std::string name, py::object body) {
        PythonBody b{g->hold(std::move(body)), g->bodies, "sink '" + name + "' of graph '" + g->graph.name() + "'"};
        auto s = g->graph.sink<Value>(name, [b](Value v) { (void)b(std::move(v)); });
        return std::make_shared<PyNode>(PyNode{g, name, &s.in_port(), nullptr, std::nullopt});
      }, py::arg("name"), py::arg("body"), "A sink calling a Python callable on each item.")
      .def("zip", [](std::shared_ptr<PyGraph> g, std::string name, py::object capacity_arg) {
        const std::size_t capacity = count_arg(capacity_arg, "splitflow.Graph.zip('" + name + "')", "capacity");
        // The C++ zip, then its pairs as (first, second) tuples (a Sample: C++ ops take a field
        // without the GIL, Python sees a tuple).
        auto z = g->graph.zip<Value, Value>(name, capacity);
        auto t = g->graph.stage(name + ".tuple", [](std::pair<Value, Value> p) -> Value {
          auto s = std::make_shared<Sample>();
          s->kind = Sample::Kind::tuple;
          s->fields.reserve(2);
          s->fields.push_back(std::move(p.first));
          s->fields.push_back(std::move(p.second));
          return s;
        });
        z >> t;
        auto node = std::make_shared<PyNode>(PyNode{g, name, nullptr, &t.out_port(), std::nullopt});
        node->first = std::make_shared<PyNode>(PyNode{g, name + ".first", &z.first().in_port(), nullptr, std::nullopt});
        node->second = std::make_shared<PyNode>(PyNode{g, name + ".second", &z.second().in_port(), nullptr, std::nullopt});
        return node;
      }, py::arg("name"), py::arg("capacity") = 0,
      "Pairs the items of its two inputs that came from the same item upstream (a fan-out's "
      "two branches: the same source item; two sources: the i-th item of each, the longer "
      "one's extras dropped and counted as skipped), whatever order they arrive in, into "
      "(first, second) tuples: `a >> z.first(); b >> z.second(); z >> next`. An item a "
      "branch skips drops its partner. Two sources are paced: neither runs far ahead of the "
      "other. capacity applies to each input (0: the graph's default).")
      .def("pull_sink", [](std::shared_ptr<PyGraph> g, std::string name, py::object capacity_arg) {
        const std::size_t capacity = count_arg(capacity_arg, "splitflow.Graph.pull_sink('" + name + "')", "capacity");
        auto s = g->graph.pull_sink<Value>(name, capacity);
        auto node = std::make_shared<PyNode>(PyNode{g, name, &s.in_port(), nullptr, s});
        g->pulls.push_back(node);
        return node;
      }, py::arg("name"), py::arg("capacity") = 0,
      "A sink that Python iterates: `for x in sink` reads the current run.")
      .def("connect", [](PyGraph&, const PyNode& a, const PyNode& b) { connect_nodes(a, b); })
      .def("run", [](std::shared_ptr<PyGraph> g) {
        if (!exit_gate::open()) throw_exiting(("splitflow.Graph.run('" + g->graph.name() + "')").c_str());
        wait_for_abandoned(*g);
        starting_a_run();
        auto r = std::make_shared<PyRun>();
        r->graph = g;
        {
          NoGil nogil;
          r->run = g->graph.run();
          registry().add(r->run, g->bodies);  // before ~NoGil, which parks a daemon thread once exiting
        }
        g->last_run = r->run;  // (with the GIL: PyGraph's fields are)
        return r;
      }, "Starts a run and returns it.")
      .def("running", [](const PyGraph& g) {
        // Without the GIL: running() takes the graph's lock, which a run's end holds while a
        // service's leftover requests are failed to their Python callbacks (which take the GIL).
        NoGil nogil;
        return g.graph.running();
      }, "Whether a run of this graph is in progress (C++: Graph::running()).")
      .def("iterate", [](std::shared_ptr<PyGraph> g, std::shared_ptr<PyNode> sink) {
        // run() + an iterator over `sink` that owns the run: leaving the loop early cancels it.
        if (!sink->pull) throw GraphError("splitflow.Graph.iterate: '" + sink->name + "' is not a pull sink");
        if (!exit_gate::open()) throw_exiting(("splitflow.Graph.iterate('" + g->graph.name() + "')").c_str());
        wait_for_abandoned(*g);
        starting_a_run();
        auto it = std::make_unique<PullIterator>(sink);
        {
          NoGil nogil;
          it->run = g->graph.run();
          registry().add(it->run, g->bodies);  // before ~NoGil, which parks a daemon thread once exiting
        }
        g->last_run = it->run;  // (with the GIL: PyGraph's fields are)
        return make_released(std::move(it));
      }, py::arg("sink"));

  m.def("_shutdown", [] {
    exit_gate::close();
    py::gil_scoped_release nogil;  // (not NoGil: the gate is closed)
    registry().shut_down();
  }, "Cancels and drains every run started from Python, then closes the exit gate: no thread "
     "of splitflow's takes the GIL after it (registered with atexit).");
  m.def("cuda_runtime_calls", [] { return cuda_runtime_calls(); },
        "CUDA runtime calls made by this process so far (0 in a CPU-only process).");
  m.def("built_with_cuda", [] { return built_with_cuda(); });
  m.def("_as_tensor", [](py::object o) { return to_python(Value(as_host(from_python(o), "_as_tensor"))); },
        "A splitflow.Tensor over an array's memory (no copy): what a C++ op's output is. For "
        "splitflow.dask: a remote result's tensors are tensors again locally, as in a local run.");
  m.def("list_arbiters", [] { return list_arbiters(); },
        "Names of the arbiter segments on this machine (docs/sharing.md).");
  m.def("read_arbiter", [](const std::string& name) -> py::object {
        ArbiterView v;
        {
          NoGil nogil;
          v = read_arbiter(name);
        }
        py::dict all = py::module_::import("json").attr("loads")(arbiters_json({v}));
        return all["arbiters"][py::int_(0)];
      }, py::arg("name"),
        "One arbiter's figures as a dict (as splitflow-top --json prints them).");
  m.def("remove_arbiter", [](const std::string& name, bool force) { return remove_arbiter(name, force); },
        py::arg("name"), py::arg("force") = false,
        "Removes a segment no process uses any more; False if there was none. Raises "
        "splitflow.Error naming the processes that still use it (force=True removes it anyway).");
  m.def("host_cache_stats", [] {
    const HostCacheStats s = host_cache_stats();
    py::dict d;
    d["cached_bytes"] = s.cached_bytes;
    d["limit"] = s.limit;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    return d;
  }, "The cache of freed large host blocks (HostTensor::empty): bytes kept now, the limit, and "
     "the allocations of 128 KiB and more it served (hits) or did not (misses).");
  m.def("image_files", [](const py::object& where_arg, std::optional<std::vector<std::string>> extensions) {
    namespace fs = std::filesystem;
    // A str or a path-like (pathlib.Path), as os.scandir takes it.
    const std::string where = py::module_::import("os").attr("fspath")(where_arg).cast<std::string>();
    if (extensions)
      for (const std::string& e : *extensions)
        if (e.size() < 2 || e[0] != '.')
          throw GraphError("splitflow.image_files('" + where + "'): extensions= takes endings "
                           "with their dot ('.png'), not '" + e + "'");
    if (extensions && extensions->empty())
      throw GraphError("splitflow.image_files('" + where + "'): extensions= is empty");
    // (Not a pattern: a path that is not there. A new user's trial read "FileList::glob: no file
    // matches" for a directory misspelled.)
    if (!fs::exists(where) && where.find_first_of("*?[") == std::string::npos)
      throw Error("splitflow.image_files('" + where + "'): no such directory or file (it takes a "
                  "directory, a list file or a glob pattern)");
    if (fs::is_directory(where))
      return extensions ? image::FileList::directory(where, *extensions).paths()
                        : image::FileList::directory(where).paths();
    if (extensions)
      throw GraphError("splitflow.image_files('" + where + "'): extensions= is for a directory");
    if (fs::is_regular_file(where)) return image::FileList::list_file(where).paths();
    return image::FileList::glob(where).paths();
  }, py::arg("where"), py::arg("extensions") = py::none(),
  "JPEG files: every .jpg/.jpeg under a directory (in torchvision ImageFolder's order with the "
  "directory as its root: its own files, then each of its folders whole, in name order, and "
  "within one folder by folder, each folder's files sorted before its subfolders'; "
  "extensions=[...]: those, "
  "case-insensitive), the paths of a list file (one per line, relative to it), or a glob "
  "pattern's matches (sorted).");

  bind_ops(m);
}

}  // namespace splitflow::python

PYBIND11_MODULE(_core, m) {
  m.doc() = "splitflow: CPU and GPU stages, with the GPU held only while kernels run.";
  splitflow::python::bind_tensor(m);
  splitflow::python::bind_graph(m);
}
