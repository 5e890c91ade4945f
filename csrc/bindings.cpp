// Python bindings of the primitives (the package's mlx_knorm._ext).
// Built with NB_DOMAIN mlx so that mlx.core's array, Stream and Device types
// are shared with MLX's module.
#include <tuple>

#include <nanobind/nanobind.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "common/kernel_source.h"
#include "common/launch_plan.h"
#include "common/validation.h"
#include "evict_and_fill/evict_and_fill.h"
#include "key_norms/key_norms.h"
#include "metal/knorm_defines.h"
#include "protected_topk_gather/protected_topk_gather.h"
#include "row_scores/row_scores.h"
#ifdef MLX_KNORM_METAL
#include "common/metal_dispatch.h"
#endif
#ifdef MLX_KNORM_EMULATOR
#include "metal_emulator/run_plan.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

namespace {

mlx_knorm::Executor executor_for(bool emulate) {
  return emulate ? mlx_knorm::Executor::MetalEmulator
                 : mlx_knorm::Executor::Native;
}

// evict_and_fill's keys, values, new_keys and new_values: one array or a
// list of them (Python's tuple form).
using Payloads = std::variant<mx::array, std::vector<mx::array>>;

// How one of them was given: its array count, and whether as a list.
struct PayloadGroup {
  size_t count;
  bool listed;
};

// Appends the arrays of `p` to `out`.
PayloadGroup append_payloads(const Payloads& p, const char* name, mlx_knorm::PayloadArrays& out) {
  if (const auto* a = std::get_if<mx::array>(&p)) {
    out.push_back(*a);
    return {1, false};
  }
  const auto& list = std::get<std::vector<mx::array>>(p);
  if (list.empty()) {
    throw mlx_knorm::dtype_error(
        std::string("mlx_knorm: ") + name +
        " must be an mlx.core.array or a non-empty tuple of them, got an empty sequence");
  }
  for (const mx::array& a : list) {
    out.push_back(a);
  }
  return {list.size(), true};
}

// The new rows take the structure of the buffers they join.
void check_structure(
    const PayloadGroup& fresh,
    const char* fresh_name,
    const PayloadGroup& stored,
    const char* stored_name) {
  if (fresh.listed != stored.listed || fresh.count != stored.count) {
    auto describe = [](const PayloadGroup& g) {
      return g.listed ? "a tuple of " + std::to_string(g.count) + " arrays"
                      : std::string("an array");
    };
    throw std::invalid_argument(
        std::string("mlx_knorm: ") + fresh_name + " must have the structure of " +
        stored_name + ": " + stored_name + " is " + describe(stored) + ", " + fresh_name +
        " " + describe(fresh));
  }
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
  m.def(
      "_emulator_debug",
      [](bool record, bool first_group_only, uint32_t threadgroup_shortfall, bool reverse_groups,
         bool fresh_threads, uint64_t max_buffer_bytes) {
        mlx_knorm::EmulatorDebug& debug = mlx_knorm::emulator_debug();
        std::vector<nb::dict> log;
        for (const mlx_knorm::EmulatedDispatch& d : debug.log) {
          nb::dict entry;
          entry["kernel"] = d.kernel;
          entry["groups"] = d.groups;
          entry["group_size"] = d.group_size;
          entry["threadgroup_bytes"] = d.threadgroup_bytes;
          entry["threadgroup_memory"] = d.threadgroup_memory;
          entry["scratch"] = d.scratch;
          log.push_back(entry);
        }
        debug.log.clear();
        debug.record = record;
        debug.first_group_only = first_group_only;
        debug.threadgroup_shortfall = threadgroup_shortfall;
        debug.reverse_groups = reverse_groups;
        debug.fresh_threads = fresh_threads;
        debug.max_buffer_bytes = max_buffer_bytes;
        return log;
      },
      "record"_a = false,
      "first_group_only"_a = false,
      "threadgroup_shortfall"_a = 0,
      "reverse_groups"_a = false,
      "fresh_threads"_a = false,
      "max_buffer_bytes"_a = mlx_knorm::kEmulatedMaxBufferBytes,
      "Testing and bench/launch_plans.py only: sets the emulator's debugging "
      "knobs (metal_emulator/run_plan.h) and returns, then clears, the dispatches "
      "recorded since the last call.");
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
      "row_scores",
      [](const mx::array& keys,
         const std::optional<mx::array>& values,
         const std::optional<mx::array>& state,
         const std::string& scorer,
         int64_t offset,
         const std::optional<mx::array>& valid,
         bool emulate,
         mx::StreamOrDevice s) {
        const mlx_knorm::RowScoresConfig config{mlx_knorm::parse_scorer(scorer), offset, valid.has_value()};
        for (const auto& [given, needed, name] :
             {std::tuple{values.has_value(), config.uses_values(), "values"},
              std::tuple{state.has_value(), config.uses_state(), "state"}}) {
          if (given != needed) {
            throw std::invalid_argument(std::string("mlx_knorm: the ") + scorer + " scorer " +
                                        (needed ? "needs " : "takes no ") + name);
          }
        }
        return mlx_knorm::row_scores({keys, values, state, valid}, config, executor_for(emulate), s);
      },
      "keys"_a,
      "values"_a = nb::none(),
      "state"_a = nb::none(),
      nb::kw_only(),
      "scorer"_a,
      "offset"_a = 0,
      "valid"_a = nb::none(),
      "emulate_metal"_a = false,
      "stream"_a = nb::none(),
      "Scores of docs/spec.md §2a: [scores] or, for keydiff, [scores, state].");

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
      [](const Payloads& keys,
         const Payloads& values,
         const mx::array& norms,
         const mx::array& positions,
         const Payloads& new_keys,
         const Payloads& new_values,
         int64_t filled,
         int64_t offset,
         int64_t capacity,
         int budget,
         int n_sink,
         int recent,
         const std::string& keep,
         const std::string& layout,
         const std::optional<mx::array>& new_norms,
         const std::optional<mx::array>& valid,
         bool order_tree,
         const std::optional<mx::array>& tree,
         bool emulate,
         mx::StreamOrDevice s) {
        mlx_knorm::PayloadArrays rows;
        mlx_knorm::PayloadArrays new_rows;
        const PayloadGroup k = append_payloads(keys, "keys", rows);
        const PayloadGroup v = append_payloads(values, "values", rows);
        const PayloadGroup nk = append_payloads(new_keys, "new_keys", new_rows);
        const PayloadGroup nv = append_payloads(new_values, "new_values", new_rows);
        check_structure(nk, "new_keys", k, "keys");
        check_structure(nv, "new_values", v, "values");
        mlx_knorm::EvictAndFillConfig config{
            {budget, n_sink, recent, mlx_knorm::parse_keep(keep)},
            filled,
            offset,
            capacity,
            mlx_knorm::parse_layout(layout),
            {static_cast<int>(k.count), static_cast<int>(v.count), k.listed, v.listed},
            new_norms.has_value(),
            valid.has_value(),
            order_tree || tree.has_value(),
            tree.has_value()};
        const mlx_knorm::EvictAndFillInputs inputs{
            std::move(rows), norms, positions, std::move(new_rows), new_norms, valid, tree};
        return mlx_knorm::evict_and_fill(inputs, config, executor_for(emulate), s);
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
      "new_norms"_a = nb::none(),
      "valid"_a = nb::none(),
      "order_tree"_a = false,
      "tree"_a = nb::none(),
      "emulate_metal"_a = false,
      "stream"_a = nb::none(),
      "One cache step of docs/spec.md §4 on payloads moved as raw bits: keys "
      "and values (and new_keys, new_values) are each an array or a list of "
      "arrays; new_norms (float32 [..., S]) replaces the norms computed from "
      "new_keys; valid (int32 [..., 2]) gives each head's real positions "
      "[lo, hi); order_tree, or a given tree (int32 [..., 2, C + 1], the "
      "previous step's), adds the order tree of step 4. Returns [*keys, "
      "*values, norms, positions] and the tree where asked for, flat.");

  m.def(
      "metal_kernel_source",
      &mlx_knorm::metal_kernel_source,
      "metal_dir"_a,
      "name"_a,
      "The source the JIT path compiles for metal_dir/<name>.metal, with "
      "knorm_defines.h inlined (for tests).");

  m.def(
      "check_metal_pipeline",
      [](const std::string& kernel, uint32_t group_size, uint64_t max_threads,
         uint64_t execution_width) {
        mlx_knorm::LaunchPlan plan;
        plan.kernel = kernel;
        plan.group_size = group_size;
        mlx_knorm::check_pipeline(plan, {max_threads, execution_width});
      },
      "kernel"_a,
      "group_size"_a,
      "max_threads"_a,
      "execution_width"_a,
      "The check eval_gpu runs on each pipeline before it encodes a dispatch: "
      "raises RuntimeError for a pipeline that the kernel cannot run on (for "
      "tests).");
}
