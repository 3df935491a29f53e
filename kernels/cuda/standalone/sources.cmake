# The sources of kvlens_gpu_check outside kernels/cuda, relative to the repository root.
# Shared by the standalone build (this folder) and the main tree, which links its
# kvlens_gpu_check from exactly these plus kvlens_cuda's objects (kernels/cuda/CMakeLists.txt):
# a source the standalone build lacks is then a link error in CI, not on a GPU machine.
set(KVLENS_GPU_CHECK_HOST_SOURCES
    kernels/attention_check.cc
    kernels/attention_tuning.cc
    kernels/dtype.cc
    kernels/kv_dtype.cc
    kernels/memory.cc
    kernels/weight.cc
    kernels/token_draw.cc
    kernels/cpu/reference_backend.cc
    kernels/cpu/reference_backward.cc
    kernels/cpu/row_reduce.cc)
# kvlens_cuda's sources (kernels/cuda).
set(KVLENS_CUDA_SOURCES attention_tuner.cc cuda_backend.cc cuda_backend_attention.cc cuda_backend_products.cc cuda_memory.cc step_graph.cc launch.cc stream_timing.cc ops.cu matvec.cu attention.cu
    flash_prefill.cu flash_prefill_bf16.cu kv_f16_copy.cu split_kv_mma.cu attention_backward.cu
    draw_tokens.cu)
# The GoogleTest GPU suites (CudaBackend*, CudaEngine*): built into cuda_emu_tests (CI,
# on the emulator) and, when the bundle brings GoogleTest, into the standalone
# kvlens_gpu_tests. Header-only helpers aside, they need kvlens_kernels and kvlens_engine.
set(KVLENS_GPU_TEST_SOURCES tests/kernels/cuda/attention_tuner_test.cc
    tests/kernels/cuda/attention_fuzz_test.cc
    tests/kernels/cuda/products_fuzz_test.cc
    tests/kernels/cuda/cuda_backend_test.cc
    tests/kernels/cuda/flash_prefill_test.cc
    tests/kernels/cuda/flash_block_order_test.cc
    tests/kernels/cuda/kv_f16_copy_test.cc
    tests/kernels/cuda/step_graph_test.cc
    tests/kernels/cuda/split_kv_balance_test.cc
    tests/kernels/cuda/matvec_rope_store_test.cc
    tests/kernels/cuda/launch_prefetch_test.cc
    tests/kernels/cuda/draw_tokens_test.cc
    tests/kernels/cuda/materialized_rows_test.cc
    tests/engine/cuda_engine_test.cc)
