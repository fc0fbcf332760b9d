# The newcomer's commands. Each one installs what is missing, configures, builds and runs.
#   make demo    the main job: the demonstration and its report
#   make test    every test: release, ASan+UBSan, TSan, the installed-package consumer
#   make bench   the benchmark suite (Google Benchmark JSON under build/bench/)
.PHONY: all deps release demo soak test test-release test-python test-asan test-tsan test-consumer package test-package bench clean fuzz test-fuzz-smoke

JOBS    ?= $(shell nproc)
BUILD   ?= build
CMAKE   ?= cmake
CTEST   ?= ctest --output-on-failure -j $(JOBS) --timeout 600
# Sanitizer builds skip the CUDA backend: its device tests skip here anyway, and the release
# build compiles and links it. Line tables only: reports still name file and line. TSan at -O1
# (about 40% less compile time than -O2 -g: tests/test_gpu_stage.cpp 23 s against 40 s).
# ASan+UBSan with clang 16 (installed for the fuzzers) at -O0: its UBSan at -O1 made that build
# the longest part of make test (780 s on 2 cores; tests/test_zip.cpp alone 124 s with GCC 12 at
# -O1, 77 s at -O0, 39 s with clang at -O0), and the checks are the same at -O0.
SAN_FLAGS = -DCMAKE_BUILD_TYPE=RelWithDebInfo \
            -DSPLITFLOW_WITH_CUDA=OFF \
            -DSPLITFLOW_BUILD_BENCHMARKS=OFF -DSPLITFLOW_BUILD_EXAMPLES=OFF \
            -DSPLITFLOW_BUILD_PYTHON=OFF
ASAN_FLAGS = $(SAN_FLAGS) -DCMAKE_CXX_COMPILER=clang++-16 \
             -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O0 -g1 -DNDEBUG"
TSAN_FLAGS = $(SAN_FLAGS) -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG"

all: release

deps:
	@scripts/install-deps.sh

release: deps
	$(CMAKE) -S . -B $(BUILD)/release -DCMAKE_BUILD_TYPE=Release
	$(CMAKE) --build $(BUILD)/release -j $(JOBS)

# The consolidation demonstration on image pipelines; its JPEGs are made once (PIL, cached).
demo: release
	rm -rf $(BUILD)/demo
	PYTHONPATH=$(BUILD)/release/python /usr/bin/python3 benchmarks/bench_images.py --only-data \
	  --images 480 --data $(BUILD)/demo-data/images
	$(BUILD)/release/examples/consolidation $(BUILD)/demo-data/images-480 $(BUILD)/demo
	/usr/bin/python3 scripts/plot_run.py --out $(BUILD)/demo/consolidation.png $(BUILD)/demo/job0.json $(BUILD)/demo/job1.json

# The soak with injected faults (docs/reliability.md): MINUTES of four graphs on one runtime;
# its figures go to build/soak.json. (make test runs a 2-minute one: ctest soak.smoke.)
MINUTES ?= 60
soak: release
	$(BUILD)/release/tests/soak --minutes $(MINUTES) --json $(BUILD)/soak.json

test: test-release test-python test-asan test-tsan test-consumer test-package test-fuzz-smoke
	@echo "make test: all suites passed"

test-release: release
	cd $(BUILD)/release && $(CTEST) -E '^python\.'

# The pytest suite (Debian's /usr/bin/python3, torch and numpy) against the release build tree.
test-python: release
	cd $(BUILD)/release && $(CTEST) -R '^python\.'

test-asan: deps
	$(CMAKE) -S . -B $(BUILD)/asan $(ASAN_FLAGS) -DSPLITFLOW_SANITIZE=address,undefined
	$(CMAKE) --build $(BUILD)/asan -j $(JOBS)
	cd $(BUILD)/asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 $(CTEST)

# oneTBB itself is rebuilt with -fsanitize=thread from Debian's source package (see the script).
test-tsan: deps
	scripts/build-tsan-tbb.sh $(BUILD)/tsan-tbb
	$(CMAKE) -S . -B $(BUILD)/tsan $(TSAN_FLAGS) -DSPLITFLOW_SANITIZE=thread \
	  -DTBB_DIR=$(abspath $(BUILD)/tsan-tbb)/lib/cmake/TBB
	$(CMAKE) --build $(BUILD)/tsan -j $(JOBS)
	cd $(BUILD)/tsan && TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$(abspath tests/tsan.supp) $(CTEST)

# A separate project that finds the *installed* package with find_package(splitflow CONFIG),
# then the same project using add_subdirectory.
test-consumer: release
	rm -rf $(BUILD)/consumer $(BUILD)/consumer-core $(BUILD)/consumer-subdir $(BUILD)/install-test
	$(CMAKE) --install $(BUILD)/release --prefix $(abspath $(BUILD)/install-test)
	@# The installed package names targets, never the build machine's library paths.
	@! grep -rnE '[";:]/(usr|opt|home|root|work|tmp)/' \
	  $(BUILD)/install-test/lib/cmake/splitflow/splitflowTargets*.cmake || \
	  { echo "test-consumer: the installed targets name paths of this machine"; exit 1; }
	$(CMAKE) -S tests/consumer -B $(BUILD)/consumer -DCMAKE_PREFIX_PATH=$(abspath $(BUILD)/install-test)
	$(CMAKE) --build $(BUILD)/consumer -j $(JOBS)
	$(BUILD)/consumer/consumer
	@# splitflow::core alone: found and linked with no CUDA toolkit and no libjpeg-turbo.
	$(CMAKE) -S tests/consumer -B $(BUILD)/consumer-core -DSPLITFLOW_CONSUMER_CORE_ONLY=ON \
	  -DCMAKE_PREFIX_PATH=$(abspath $(BUILD)/install-test) \
	  -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON -DCMAKE_DISABLE_FIND_PACKAGE_SplitflowJPEG=ON
	$(CMAKE) --build $(BUILD)/consumer-core -j $(JOBS)
	$(BUILD)/consumer-core/consumer_core
	@! ldd $(BUILD)/consumer-core/consumer_core | grep -E 'jpeg|cuda' || \
	  { echo "test-consumer: splitflow::core alone links libjpeg or CUDA"; exit 1; }
	@! nm $(BUILD)/consumer-core/consumer_core | grep -qE ' [TtU] cuda[A-Z]' || \
	  { echo "test-consumer: splitflow::core alone contains the CUDA runtime"; exit 1; }
	$(CMAKE) -S tests/consumer -B $(BUILD)/consumer-subdir -DSPLITFLOW_SOURCE_DIR=$(abspath .)
	$(CMAKE) --build $(BUILD)/consumer-subdir -j $(JOBS) --target consumer
	$(BUILD)/consumer-subdir/consumer
	PYTHONPATH=$(abspath $(BUILD)/install-test)/lib/python3.11/site-packages /usr/bin/python3 \
	  tests/consumer/check_python_install.py $(abspath $(BUILD)/install-test)

# The Debian package (cpack -G DEB; CMakeLists.txt): libraries, headers, CMake config under
# /usr and the Python module in /usr/lib/python3/dist-packages. `dpkg -i` it, or unpack it.
package: release
	cd $(BUILD)/release && rm -f splitflow_*.deb && cpack -G DEB
	@ls $(BUILD)/release/splitflow_*.deb

# The package unpacked (no change to this machine): its Python module imports and runs from
# dist-packages, and the consumer project builds against its CMake package and runs.
test-package: package
	rm -rf $(BUILD)/package-root $(BUILD)/consumer-deb
	dpkg-deb -x $(BUILD)/release/splitflow_*.deb $(BUILD)/package-root
	dpkg-deb -f $(BUILD)/release/splitflow_*.deb Depends | grep -q 'libtbb-dev'
	test -f $(BUILD)/package-root/usr/lib/cmake/splitflow/splitflowConfig.cmake
	PYTHONPATH=$(abspath $(BUILD)/package-root)/usr/lib/python3/dist-packages /usr/bin/python3 \
	  tests/consumer/check_python_install.py $(abspath $(BUILD)/package-root)
	$(CMAKE) -S tests/consumer -B $(BUILD)/consumer-deb -DCMAKE_PREFIX_PATH=$(abspath $(BUILD)/package-root)/usr
	$(CMAKE) --build $(BUILD)/consumer-deb -j $(JOBS)
	$(BUILD)/consumer-deb/consumer
	$(BUILD)/consumer-deb/consumer_core

# Every benchmark binary (Google Benchmark JSON under build/bench/; ChainHop interleaved and
# repeated, as these machines are noisy), the loader and end-to-end image benchmarks, then one
# table of every goal ratio (benchmarks/summary.py).
bench: release
	mkdir -p $(BUILD)/bench
	@for b in $(BUILD)/release/benchmarks/bench_*; do \
	  extra=""; \
	  case $$b in *chain_hop|*merge) extra="--benchmark_repetitions=7 --benchmark_enable_random_interleaving=true";; esac; \
	  echo "== $$b"; \
	  $$b --benchmark_format=console --benchmark_out_format=json $$extra \
	      --benchmark_out=$(BUILD)/bench/$$(basename $$b).json || exit 1; \
	done
	PYTHONPATH=$(BUILD)/release/python /usr/bin/python3 benchmarks/bench_loader.py \
	  --json $(BUILD)/bench/bench_loader.json
	PYTHONPATH=$(BUILD)/release/python /usr/bin/python3 benchmarks/bench_large_photos.py \
	  --data $(BUILD)/bench-data/large --json $(BUILD)/bench/bench_large_photos.json
	PYTHONPATH=$(BUILD)/release/python /usr/bin/python3 benchmarks/bench_process_stage.py \
	  --data $(BUILD)/bench-data/images --json $(BUILD)/bench/bench_process_stage.json
	PYTHONPATH=$(BUILD)/release/python /usr/bin/python3 benchmarks/bench_dask.py \
	  --data $(BUILD)/bench-data/images --json $(BUILD)/bench/bench_dask.json
	PYTHONPATH=$(BUILD)/release/python /usr/bin/python3 benchmarks/bench_images.py \
	  --bin $(BUILD)/release/benchmarks/image_pipeline_bench --data $(BUILD)/bench-data/images \
	  --json $(BUILD)/bench/bench_images.json
	PYTHONPATH=$(BUILD)/release/python /usr/bin/python3 benchmarks/bench_memory.py \
	  --data $(BUILD)/bench-data/images --json $(BUILD)/bench/bench_memory.json
	$(BUILD)/release/benchmarks/image_pipeline_bench grid $(BUILD)/bench-data/images-2000 \
	  > $(BUILD)/bench/image_pipeline_grid.json
	PYTHONPATH=$(BUILD)/release/python /usr/bin/python3 benchmarks/bench_images_grid.py \
	  --data $(BUILD)/bench-data/images --images 2000 --json $(BUILD)/bench/bench_images_grid.json
	PYTHONPATH=$(BUILD)/release/python /usr/bin/python3 benchmarks/bench_python_auto.py \
	  --json $(BUILD)/bench/bench_python_auto.json
	/usr/bin/python3 benchmarks/summary.py $(BUILD)/bench

clean:
	rm -rf $(BUILD)

# Fuzzing (docs/reliability.md, "Fuzzing"): libFuzzer targets under ASan+UBSan, built with
# clang-16 from only the sources they need (tests/fuzz/Makefile; not the project's build).
#   make fuzz [FUZZ_SECONDS=600] [FUZZ_RUNS=N] [FUZZ_TARGETS="decode_jpeg resize"]
# runs each target in turn for FUZZ_SECONDS (or FUZZ_RUNS executions), keeping its corpus in
# build/fuzz/corpus/; prints executions per target and in total, written to build/fuzz/summary.txt.
# make test runs test-fuzz-smoke: each target a few seconds, then every input checked in under
# tests/fuzz/regressions/.
FUZZ_MAKE = $(MAKE) --no-print-directory -f tests/fuzz/Makefile OUT=$(abspath $(BUILD))/fuzz

fuzz: deps
	$(FUZZ_MAKE) -j $(JOBS) bins
	$(FUZZ_MAKE) fuzz

test-fuzz-smoke: deps
	$(FUZZ_MAKE) -j $(JOBS) bins
	$(FUZZ_MAKE) smoke
