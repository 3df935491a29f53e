#!/usr/bin/env bash
# One call on a machine with an NVIDIA GPU: builds the CUDA backend, runs the parity checks
# against the CPU reference, and the benchmarks (prefill attention vs PyTorch SDPA, decode
# attention vs a device-to-device copy, Llama-7B-shaped decode vs the weight-bandwidth
# roofline), then prints one table. See docs/cuda.md.
#
#   scripts/gpu-check.sh [--quick] [--parity-only]
#   scripts/gpu-check.sh --bundle DIR    on a machine WITH libabsl-dev: pack abseil's headers
#                                        and static libraries into DIR for a GPU machine
#                                        without them (then KVLENS_ABSL_BUNDLE=DIR there)
#   scripts/gpu-check.sh --prebuild DIR  after --bundle DIR, where nvcc is (no GPU needed):
#                                        build the standalone programs into DIR/bin, so the
#                                        GPU machine spends its time running, not compiling
#                                        (it falls back to building when they do not load)
# Environment: BUILD_DIR (build-gpu), KVLENS_ABSL_BUNDLE (default build-gpu-bundle when it
# exists), CUDA_ARCH (90), JOBS (nproc), STANDALONE=1 (skip the full tree even where it
# would configure), TEST_TIMEOUT (180 s for the GPU test suites). The table is also
# written to $BUILD_DIR/gpu-check.txt; each row goes to stderr as it is measured.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD_DIR=${BUILD_DIR:-build-gpu}
CUDA_ARCH=${CUDA_ARCH:-90}
JOBS=${JOBS:-$(nproc)}
TEST_TIMEOUT=${TEST_TIMEOUT:-180}
CHECK_ARGS=()
GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)
# The standalone programs (kernels/cuda/standalone) into $BUILD_DIR/standalone, with the
# bundle $1 when given.
build_standalone() {
  cmake -S kernels/cuda/standalone -B "$BUILD_DIR/standalone" "${GENERATOR[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" \
    ${1:+-DKVLENS_ABSL_BUNDLE="$1"} || {
    echo "gpu-check: abseil not found. On a machine with libabsl-dev run" >&2
    echo "  scripts/gpu-check.sh --bundle build-gpu-bundle" >&2
    echo "and bring build-gpu-bundle/ (about 13 MB) along; see docs/cuda.md." >&2
    exit 2; }
  cmake --build "$BUILD_DIR/standalone" -j "$JOBS"
}
# What the standalone programs are built from (no git needed: the GPU machine may have only
# a copy of the tree), so prebuilt programs are used only for the sources at hand.
source_hash() {
  find kernels engine tests -type f \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \
    -o -name '*.cmake' -o -name CMakeLists.txt \) | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16
}

while [ $# -gt 0 ]; do
  case "$1" in
    --bundle)
      # abseil (headers, static libraries), nlohmann_json (headers), GoogleTest (sources,
      # built there with that machine's compiler) and the test data the GPU suites read.
      dir=${2:?--bundle needs a directory}
      for need in /usr/include/absl /usr/include/nlohmann/json.hpp /usr/src/googletest/CMakeLists.txt \
                  ../shared/testdata/stories260K/stories260K.bin; do
        [ -e "$need" ] || { echo "gpu-check --bundle: $need is missing (scripts/install-deps.sh," \
                                 "and ../shared beside the checkout)" >&2; exit 2; }
      done
      rm -rf "$dir"
      mkdir -p "$dir/include" "$dir/lib" "$dir/shared/testdata"
      cp -r /usr/include/absl /usr/include/nlohmann "$dir/include/"
      cp /usr/lib/*/libabsl_*.a "$dir/lib/"
      cp -r /usr/src/googletest "$dir/googletest"
      cp -r ../shared/testdata/stories260K "$dir/shared/testdata/"
      echo "bundle in $dir ($(du -sh "$dir" | cut -f1)); carry it to the GPU machine"
      exit 0 ;;
    --prebuild)
      dir=${2:?--prebuild needs the bundle directory}
      [ -f "$dir/googletest/CMakeLists.txt" ] || {
        echo "gpu-check --prebuild: $dir is no bundle (run --bundle $dir first)" >&2; exit 2; }
      dir=$(cd "$dir" && pwd)
      export PATH=/usr/local/cuda/bin:$PATH
      build_standalone "$dir"
      mkdir -p "$dir/bin"
      cp "$BUILD_DIR/standalone/kvlens_gpu_check" "$BUILD_DIR/standalone/kvlens_gpu_tests" "$dir/bin/"
      source_hash >"$dir/bin/SOURCES"
      echo "prebuilt for sm_$CUDA_ARCH (sources $(cat "$dir/bin/SOURCES")) in $dir/bin ($(du -sh "$dir/bin" | cut -f1))"
      exit 0 ;;
    --quick|--parity-only) CHECK_ARGS+=("$1"); shift ;;
    *) echo "usage: $0 [--quick] [--parity-only] | --bundle DIR | --prebuild DIR" >&2; exit 64 ;;
  esac
done

export PATH=/usr/local/cuda/bin:$PATH
command -v nvcc >/dev/null || { echo "gpu-check: nvcc not found (need the CUDA toolkit)" >&2; exit 2; }
command -v cmake >/dev/null || { echo "gpu-check: cmake not found" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || {
  echo "gpu-check: nvidia-smi failed: no usable GPU here" >&2; exit 2; }
mkdir -p "$BUILD_DIR"

# 1. The whole tree when its dependencies are here (then the GoogleTest GPU suite runs too);
#    else the standalone build (kernels/cuda/standalone), which needs CUDA, CMake and the
#    bundle of --bundle.
# The standalone kvlens_gpu_tests: the same CudaBackend* and CudaEngine* suites as
# `ctest -L gpu` in the full tree, finding the tree and the bundle's test data wherever
# the program was built. A hang (a kernel that never returns) must not cost the table
# below: time-boxed.
run_gpu_tests() {
  if [ ! -x "$1" ]; then
    echo "gpu-check: no kvlens_gpu_tests (the bundle lacks GoogleTest): end-to-end checks NOT run"
    return
  fi
  echo "== GPU tests (kvlens_gpu_tests: CudaBackend*, CudaEngine*)"
  KVLENS_SOURCE_DIR=$ROOT KVLENS_SHARED_DIR=$BUNDLE/shared \
    timeout "$TEST_TIMEOUT" "$1" --gtest_brief=1 ||
    echo "gpu-check: GPU unit tests FAILED (or ran past ${TEST_TIMEOUT}s)"
  # Out-of-bounds and misaligned accesses on the real device: the op-level suite, decode
  # over a NaN cache and graph replay (about 10 s on an H200), where compute-sanitizer
  # works (on Firecracker machines; gVisor refuses the device). Its log: memcheck.log.
  if command -v compute-sanitizer >/dev/null; then
    echo "== compute-sanitizer memcheck (CudaBackendTest, CudaEngineDecode, graph replay)"
    if KVLENS_SOURCE_DIR=$ROOT KVLENS_SHARED_DIR=$BUNDLE/shared timeout "$TEST_TIMEOUT" \
         compute-sanitizer --tool memcheck --error-exitcode 9 "$1" --gtest_brief=1 \
         --gtest_filter='CudaBackendTest.*:CudaEngineDecode.*:CudaEngineGraphs.DecodeSteps*' \
         >"$BUILD_DIR/memcheck.log" 2>&1; then
      grep -E "ERROR SUMMARY" "$BUILD_DIR/memcheck.log" | tail -1
    else
      echo "gpu-check: memcheck FAILED or did not finish (exit $?; $BUILD_DIR/memcheck.log):"
      grep -E "ERROR SUMMARY|Invalid|FAILED|refused|not supported" "$BUILD_DIR/memcheck.log" | head -5
    fi
  fi
}

CHECK_BIN=""
BUNDLE=${KVLENS_ABSL_BUNDLE:-}
[ -z "$BUNDLE" ] && [ -d build-gpu-bundle ] && BUNDLE=$ROOT/build-gpu-bundle
# 0. Programs prebuilt elsewhere (--prebuild), when they load here: CUDA's runtime and cuBLAS
#    come from this machine's toolkit.
PREBUILT=${BUNDLE:+$BUNDLE/bin}
if [ -n "$PREBUILT" ] && [ -x "$PREBUILT/kvlens_gpu_check" ]; then
  for lib in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$lib" ] && export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  done
  set +e
  "$PREBUILT/kvlens_gpu_check" --usage >/dev/null 2>"$BUILD_DIR/prebuilt-load.log"
  load_rc=$?
  set -e
  if [ "$load_rc" = 64 ] && [ "$(cat "$PREBUILT/SOURCES" 2>/dev/null)" = "$(source_hash)" ]; then
    echo "== prebuilt programs from $PREBUILT (sources $(cat "$PREBUILT/SOURCES"))"
    CHECK_BIN=$PREBUILT/kvlens_gpu_check
    run_gpu_tests "$PREBUILT/kvlens_gpu_tests"
  elif [ "$load_rc" != 64 ]; then
    echo "== the prebuilt programs in $PREBUILT do not load here (exit $load_rc:" \
         "$(head -c 300 "$BUILD_DIR/prebuilt-load.log")): building here"
  else
    echo "== the prebuilt programs in $PREBUILT are of other sources" \
         "($(cat "$PREBUILT/SOURCES" 2>/dev/null || echo '?'), here $(source_hash)): building here"
  fi
fi
if [ -n "$CHECK_BIN" ]; then
  :
elif [ "${STANDALONE:-0}" != "1" ] && cmake -S . -B "$BUILD_DIR/full" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
     -DKVLENS_CUDA=ON -DKVLENS_BUILD_TESTS=ON -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" \
     >"$BUILD_DIR/full-configure.log" 2>&1; then
  echo "== building the full tree (kernels_tests, engine_tests, kvlens_gpu_check)"
  cmake --build "$BUILD_DIR/full" -j "$JOBS" --target kernels_tests engine_tests kvlens_gpu_check
  # CudaBackend* (op parity) and CudaEngine* (the engine on the GPU: stories260K text, the
  # default model's logits, incremental decode over a NaN cache); both need ../shared.
  echo "== GPU tests (ctest -L gpu)"
  (cd "$BUILD_DIR/full" && ctest -L gpu --output-on-failure --timeout "$TEST_TIMEOUT") ||
    echo "gpu-check: GPU unit tests FAILED"
  CHECK_BIN=$BUILD_DIR/full/kernels/cuda/kvlens_gpu_check
else
  [ "${STANDALONE:-0}" = "1" ] && echo "== STANDALONE=1: the standalone build" ||
  echo "== the full tree does not configure here (missing: $(grep -o 'Could not find a package configuration file provided by "[^"]*"\|Could NOT find [A-Za-z_]*' "$BUILD_DIR/full-configure.log" | sed 's/.*"\(.*\)"/\1/; s/Could NOT find //' | sort -u | tr '\n' ' '))"
  echo "   building the standalone kvlens_gpu_check (CUDA + abseil only; no GoogleTest suite,"
  echo "   so the engine's CudaEngine* tests do not run: they need the full tree)"
  build_standalone "$BUNDLE"
  CHECK_BIN=$BUILD_DIR/standalone/kvlens_gpu_check
  run_gpu_tests "$BUILD_DIR/standalone/kvlens_gpu_tests"
fi

# 2. PyTorch's scaled_dot_product_attention on the prefill shapes, when PyTorch is here: each
#    backend forced in turn (the target is the flash backend: "SDPA's flash path"), then
#    PyTorch's own choice, with the name of the kernel that choice ran (lines "BACKEND T
#    TFLOPS" and "kernel T NAME", read by kvlens_gpu_check --sdpa).
SDPA=$BUILD_DIR/sdpa.txt
: >"$SDPA"
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "== PyTorch SDPA reference (bf16, H=32, Dh=128, causal; each backend, then the default)"
  python3 - "$SDPA" <<'PY' || echo "gpu-check: the SDPA reference failed; the table lacks it"
import contextlib, sys, torch
import torch.nn.functional as F
try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
except ImportError:  # PyTorch before 2.3: the flash backend alone, by the old switch
    backends = [("flash", None)]
    def sdpa_kernel(_):
        return torch.backends.cuda.sdp_kernel(enable_flash=True, enable_math=False)
out = open(sys.argv[1], "w")
print("torch", torch.__version__)
for t in (4096, 8192, 16384):
    q, k, v = (torch.randn(1, 32, t, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name, backend in backends + [("default", None)]:
        try:
            with contextlib.nullcontext() if name == "default" else sdpa_kernel(backend):
                for _ in range(3):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.cuda.synchronize()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                iters = 10
                start.record()
                for _ in range(iters):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
                stop.record()
                torch.cuda.synchronize()
        except Exception as e:  # a backend this build or shape lacks
            print(f"SDPA {name} T={t}: not available ({str(e).splitlines()[0][:120]})")
            continue
        sec = start.elapsed_time(stop) / 1e3 / iters
        tflops = 4 * 32 * 128 * t * t / 2 / sec / 1e12
        print(f"SDPA {name} T={t}: {tflops:.1f} TFLOP/s")
        out.write(f"{name} {t} {tflops:.2f}\n")
    try:  # which kernel the default ran: the longest on the GPU in one profiled call
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
        ev = max(kernels or events, key=lambda e: getattr(e, "device_time_total",
                                                          getattr(e, "cuda_time_total", 0)))
        name = ev.key.removeprefix("void ").split("(")[0].split("<")[0].replace(" ", "_")
        out.write(f"kernel {t} {name[:80]}\n")
    except Exception as e:  # the name is a remark, never a failure
        print(f"SDPA default T={t}: kernel name not found ({e})")
    out.flush()
PY
else
  echo "== PyTorch with CUDA not found: the table has no SDPA reference"
fi

# 3. Parity and benchmarks: one table.
echo "== kvlens_gpu_check"
set +e
"$CHECK_BIN" --sdpa "$SDPA" "${CHECK_ARGS[@]}" | tee "$BUILD_DIR/gpu-check.txt"
rc=${PIPESTATUS[0]}
set -e
echo "table written to $BUILD_DIR/gpu-check.txt"
exit "$rc"
