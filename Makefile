# wprep: the two commands are `make run` and `make test`; both set up a fresh machine first.
SHELL := /bin/bash
BUILD ?= build
SAN_BUILD ?= build-fuzz
TSA_BUILD ?= build-tsan
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# nvcc lives outside PATH on some machines; CMake finds it through CUDACXX.
ifeq ($(shell command -v nvcc),)
  ifneq ($(wildcard /usr/local/cuda/bin/nvcc),)
    export CUDACXX ?= /usr/local/cuda/bin/nvcc
  endif
endif

.PHONY: all deps build test test-unit test-python lint test-sanitize test-thread-safety test-tsan test-fuzz \
  test-deploy run bench soak-memory gpu-bundle clean

all: build

deps:
	@bash scripts/bootstrap.sh

$(BUILD)/build.ninja: | deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: deps $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

# Everything CI runs: the unit and integration tests, the Python client's tests, static
# analysis, the host tests under AddressSanitizer + UndefinedBehaviorSanitizer, clang's
# lock-annotation check, the daemon's tests under ThreadSanitizer, a short run of each
# fuzz target, and the deployment checks.
test: test-unit test-python lint test-sanitize test-thread-safety test-tsan test-fuzz test-deploy

test-unit: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600

# The Python client (client/python) against the built wprepd on the CPU engine, with Debian's
# Python and its grpcio/protobuf (the oldest runtimes the package supports). Its GPU tests
# report skipped here (no torch).
PYTHON ?= /usr/bin/python3
test-python: build
	WPREPD=$(abspath $(BUILD))/server/wprepd $(PYTHON) -m pytest -p no:cacheprovider -q -rs client/python/tests

# Host code under ASan + UBSan (no CUDA in this build: its tests report skipped). It is
# the fuzzing build (clang, instrumented for libFuzzer too), so test-fuzz builds nothing
# more; scripts/fuzz.sh configures it the same way.
SAN_CMAKE = -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DWPREP_FUZZ=ON -DWPREP_ENABLE_CUDA=OFF
test-sanitize: deps
	cmake -S . -B $(SAN_BUILD) -G Ninja $(SAN_CMAKE) $(CMAKE_FLAGS)
	cmake --build $(SAN_BUILD) -j $(JOBS)
	cd $(SAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --output-on-failure -j $(JOBS) --timeout 900

# clang-tidy (.clang-tidy) and cppcheck over the C++ sources, from build/'s compile commands.
lint: build
	BUILD=$(BUILD) JOBS=$(JOBS) bash scripts/lint.sh

# clang -Wthread-safety -Werror over the host code: every ABSL_GUARDED_BY is honoured.
# A compile-time check. The same clang build is instrumented for ThreadSanitizer, so it
# also builds what test-tsan runs.
test-thread-safety: deps
	cmake -S . -B $(TSA_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
	  -DCMAKE_CXX_COMPILER=clang++ -DWPREP_ENABLE_CUDA=OFF -DWPREP_TSAN=ON $(CMAKE_FLAGS)
	cmake --build $(TSA_BUILD) -j $(JOBS) --target wprepd wprep server_test server_fault_test kernels_cpu_test \
	  wprep_memory_soak health_test reflection_test

# The daemon's tests (server_test, server_fault_test, health_test, reflection_test, the CPU
# engine's, a 2,000-request load from 64 clients) under ThreadSanitizer, host paths only.
# Every process's reports go to $(TSA_BUILD)/tsan-reports, and any report fails the target.
# Left out: the two tests that bound the daemon's RSS (TSan's shadow memory counts in RSS;
# they run in the other builds), the 2,000 concurrent streams (some 6,000 daemon threads,
# near TSan's limit of 8,128 live threads per process; the 64-waiter admission test covers
# the queue's races) and the tests of programs not built here. Suppressions (third-party
# code only, each justified) are in tests/tsan/suppressions.txt.
TSAN_EXCLUDE = NOT_BUILT|Hardening.UnreadAnswersStayWithinTheBufferBudget|Fault.SlowStreamReaderKeepsDaemonMemoryBounded|Admission.TwoThousandConcurrentSmallStreamsAreAllServedExactly
test-tsan: test-thread-safety
	rm -rf $(TSA_BUILD)/tsan-reports && mkdir -p $(TSA_BUILD)/tsan-reports && chmod 1777 $(TSA_BUILD)/tsan-reports
	cd $(TSA_BUILD) && TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 \
	  suppressions=$(CURDIR)/tests/tsan/suppressions.txt log_path=$(CURDIR)/$(TSA_BUILD)/tsan-reports/report log_exe_name=1" \
	  ctest --output-on-failure -j $(JOBS) --timeout 900 -E '$(TSAN_EXCLUDE)'
	@bash scripts/tsan_reports.sh $(TSA_BUILD)/tsan-reports

# Each libFuzzer target for 20 s after replaying its committed inputs (clang, ASan +
# UBSan, in build-fuzz/); `scripts/fuzz.sh 3600` fuzzes for an hour each.
test-fuzz: deps
	FUZZ_BUILD=$(SAN_BUILD) JOBS=$(JOBS) bash scripts/fuzz.sh 20

# The Dockerfile, deploy/k8s, deploy/prometheus and deploy/grafana against the real daemon:
# lint, kustomize renders and schemas, the image's files staged as its build stage stages
# them, the rendered daemons and their probes, promtool, and a real Prometheus (as root,
# in private namespaces: tests/deploy/run.sh).
test-deploy: build
	bash scripts/deploy_tools.sh
	bash scripts/stage_runtime.sh .stage
	bash tests/deploy/run.sh

# Starts the daemon in the foreground (GPU when present, else the CPU engine).
run: build
	@if [ -x $(BUILD)/server/wprepd ]; then exec $(BUILD)/server/wprepd $(ARGS); \
	 else echo "wprepd is not built in this tree; try: $(BUILD)/client/cli/wprep convert --help"; exit 1; fi

# Conversion timings next to a copy of the same bytes (GPU when present, and the CPU).
bench: build
	$(BUILD)/bench/wprep_bench $(ARGS)

# wprepd's host RSS and device memory before, during and after 10,000 mixed requests
# (CPU engine; ARGS go to wprep_memory_soak, e.g. ARGS="--requests=2000").
soak-memory: build
	$(BUILD)/bench/wprep_memory_soak $(ARGS) -- --devices=cpu

# Binaries + non-glibc shared libraries for the GPU machine (see scripts/gpu_bundle.sh).
gpu-bundle: deps
	bash scripts/gpu_bundle.sh

clean:
	rm -rf $(BUILD) $(SAN_BUILD) $(TSA_BUILD) build-sanitize build-thread-safety build-fuzz .bundle .stage .tools
