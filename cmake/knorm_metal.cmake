# What CMakeLists.txt needs to build the Metal kernel library, as functions
# that tests/test_build_config.py runs on their own (cmake -P).

# The oldest MLX whose mlx_build_metallib (MLX's extension.cmake) takes
# every argument CMakeLists.txt passes: DEPLOYMENT_TARGET arrived in MLX
# 0.32.4. An older one does not fail on it but ignores it, and builds a
# metallib for the host's macOS, which older systems refuse to load.
set(KNORM_METALLIB_MLX_MIN_VERSION 0.32.4)

function(knorm_require_metallib_mlx mlx_version)
  if(NOT mlx_version OR mlx_version VERSION_LESS KNORM_METALLIB_MLX_MIN_VERSION)
    message(FATAL_ERROR
      "mlx-knorm: MLX ${mlx_version} is older than ${KNORM_METALLIB_MLX_MIN_VERSION}, "
      "whose mlx_build_metallib takes the DEPLOYMENT_TARGET this build passes; "
      "install mlx>=${KNORM_METALLIB_MLX_MIN_VERSION} (pyproject.toml pins the version "
      "to build against)")
  endif()
endfunction()

# The kernel that tells whether a Metal compiler works with the options the
# metallib build uses: it includes <metal_stdlib> (every kernel source does,
# through knorm_defines.h, and a toolchain without its headers fails there)
# and uses bfloat (MSL 3.1).
set(KNORM_METAL_PROBE_SOURCE
  "#include <metal_stdlib>\nusing namespace metal;\n"
  "kernel void knorm_probe(device bfloat* x [[buffer(0)]],\n"
  "                        uint i [[thread_position_in_grid]]) {\n"
  "  x[i] = bfloat(simd_sum(float(i)));\n"
  "}\n")
string(CONCAT KNORM_METAL_PROBE_SOURCE ${KNORM_METAL_PROBE_SOURCE})

# No metallib: a warning, since the kernels then compile at first use (in
# every process that uses them, seconds each) and a compiler error surfaces
# only then. `result` is the probe's exit status, `error` its stderr.
function(knorm_warn_metal_jit result error)
  # The result and the compiler's first line of complaint, if any.
  string(REGEX REPLACE "\n.*" "" first_line "${error}")
  if(first_line)
    string(APPEND result ": ${first_line}")
  endif()
  message(WARNING
    "mlx-knorm: no working Metal compiler (xcrun -sdk macosx metal on a "
    "test kernel: ${result}); building without mlx_knorm.metallib: the "
    "kernels compile at first use. Install Xcode's Metal toolchain "
    "(xcodebuild -downloadComponent MetalToolchain) for a prebuilt library.")
endfunction()
