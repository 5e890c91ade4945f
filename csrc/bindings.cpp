// Python bindings of the primitives (the package's mlx_knorm._ext).
// Built with NB_DOMAIN mlx so that mlx.core's array, Stream and Device types
// are shared with MLX's module.
#include <nanobind/nanobind.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "common/kernel_source.h"
#include "common/validation.h"
#include "evict_and_fill/evict_and_fill.h"
#include "key_norms/key_norms.h"
#include "metal/knorm_defines.h"
#include "protected_topk_gather/protected_topk_gather.h"
#ifdef MLX_KNORM_METAL
#include "common/metal_dispatch.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

namespace {

mlx_knorm::Executor executor_for(bool emulate) {
  return emulate ? mlx_knorm::Executor::MetalEmulator
                 : mlx_knorm::Executor::Native;
}

} // namespace

NB_MODULE(_ext, m) {
  m.doc() = "mlx-knorm native primitives (use the mlx_knorm package API)";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const mlx_knorm::dtype_error& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    }
  });

  m.attr("built_mlx_version") = MLX_KNORM_BUILT_MLX_VERSION;
  m.attr("metal_key_norms_max_dim") = mlx_knorm::kKeyNormsMaxDim;
#ifdef MLX_KNORM_METAL
  m.attr("has_metal_kernels") = true;
  m.def(
      "metal_kernel_library",
      [] {
        const auto& library = mlx_knorm::metal_kernel_library();
        return std::make_pair(
            std::string(library.prebuilt ? "metallib" : "jit"), library.path);
      },
      "Where the Metal kernels come from: (\"metallib\", its path) or "
      "(\"jit\", the folder of .metal sources compiled at first use).");
#else
  m.attr("has_metal_kernels") = false;
#endif
#ifdef MLX_KNORM_EMULATOR
  m.attr("has_metal_emulator") = true;
#else
  m.attr("has_metal_emulator") = false;
#endif

  m.def(
      "key_norms",
      [](const mx::array& keys, bool emulate, mx::StreamOrDevice s) {
        return mlx_knorm::key_norms(keys, executor_for(emulate), s);
      },
      "keys"_a,
      nb::kw_only(),
      "emulate_metal"_a = false,
      "stream"_a = nb::none(),
      "float32 L2 norm of each key row, in the pinned order of docs/spec.md §2.");

  m.def(
      "protected_topk_gather",
      [](const mx::array& prior_keys,
         const mx::array& prior_values,
         const mx::array& prior_norms,
         const mx::array& new_keys,
         const mx::array& new_values,
         const mx::array& new_norms,
         int budget,
         int n_sink,
         int recent,
         const std::string& keep,
         bool emulate,
         mx::StreamOrDevice s) {
        return mlx_knorm::protected_topk_gather(
            {prior_keys, prior_values, prior_norms, new_keys, new_values, new_norms},
            {budget, n_sink, recent, mlx_knorm::parse_keep(keep)},
            executor_for(emulate),
            s);
      },
      "prior_keys"_a,
      "prior_values"_a,
      "prior_norms"_a,
      "new_keys"_a,
      "new_values"_a,
      "new_norms"_a,
      "budget"_a,
      "n_sink"_a,
      "recent"_a,
      "keep"_a,
      nb::kw_only(),
      "emulate_metal"_a = false,
      "stream"_a = nb::none(),
      "Protected top-k of docs/spec.md §3: (keys, values, norms, indices).");

  m.def(
      "evict_and_fill",
      [](const mx::array& keys,
         const mx::array& values,
         const mx::array& norms,
         const mx::array& positions,
         const mx::array& new_keys,
         const mx::array& new_values,
         int64_t filled,
         int64_t offset,
         int64_t capacity,
         int budget,
         int n_sink,
         int recent,
         const std::string& keep,
         const std::string& layout,
         bool emulate,
         mx::StreamOrDevice s) {
        mlx_knorm::EvictAndFillConfig config{
            {budget, n_sink, recent, mlx_knorm::parse_keep(keep)},
            filled,
            offset,
            capacity,
            mlx_knorm::parse_layout(layout)};
        return mlx_knorm::evict_and_fill(
            {keys, values, norms, positions, new_keys, new_values},
            config,
            executor_for(emulate),
            s);
      },
      "keys"_a,
      "values"_a,
      "norms"_a,
      "positions"_a,
      "new_keys"_a,
      "new_values"_a,
      "filled"_a,
      "offset"_a,
      "capacity"_a,
      "budget"_a,
      "n_sink"_a,
      "recent"_a,
      "keep"_a,
      "layout"_a,
      nb::kw_only(),
      "emulate_metal"_a = false,
      "stream"_a = nb::none(),
      "One cache step of docs/spec.md §4: (keys, values, norms, positions).");

  m.def(
      "metal_kernel_source",
      &mlx_knorm::metal_kernel_source,
      "metal_dir"_a,
      "name"_a,
      "The source the JIT path compiles for metal_dir/<name>.metal, with "
      "knorm_defines.h inlined (for tests).");
}
