// Standalone check of the emulated Metal kernels (csrc/metal_emulator/),
// built under a sanitizer by .ci/sanitize: random cases (random bit
// patterns, ties, NaN, infinities, rows spanning several threadgroup chunks,
// outputs updated in place) run through the emulator and the CPU kernels,
// and every output must agree bit for bit. Under ThreadSanitizer a barrier
// missing or too weak in a kernel is a reported race; under
// AddressSanitizer an access past a buffer is a reported overflow (each
// buffer is a heap block of its own that ends where the array ends). Also
// checks the emulator's half/bfloat conversions against MLX's.
//
// usage: knorm_sanitize_driver [cases] [seed]
// (cases = 0 runs the fixed cases alone: the conversions, the refusal of a
// plan that binds an empty array, one case of each kernel, and the in-place
// temporal compaction; enough for every broken kernel of
// tests/cpp/broken_kernels.py to fail)
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/types/bf16.h"
#include "mlx/types/half_types.h"

#include "evict_and_fill/evict_and_fill.h"
#include "evict_and_fill/order_tree.h"
#include "key_norms/key_norms.h"
#include "metal_emulator/run_plan.h"
#include "protected_topk_gather/protected_topk_gather.h"
#include "row_scores/row_scores.h"

// The emulator's half and bfloat, without the qualifier macros of
// metal_emulator.h.
#include "metal_emulator/language.h"

namespace mx = mlx::core;
using namespace mlx_knorm;

namespace {

int failures = 0;

void fail(const std::string& what) {
  std::fprintf(stderr, "MISMATCH: %s\n", what.c_str());
  ++failures;
}

// An array whose memory MLX's allocator provides: the kernels and the
// driver read and write the same bytes. (MLX copies memory handed to its
// pointer constructor, so wrapping memory of the driver's own would leave
// the kernels working on a copy.) MLX's CPU allocator gives each buffer a
// heap block of its own that ends where the array ends.
struct Buffer {
  mx::array array;
  size_t size;  // bytes

  uint8_t* bytes() {
    return array.data<uint8_t>();
  }
  const uint8_t* bytes() const {
    return array.data<uint8_t>();
  }
};

std::unique_ptr<Buffer> make(mx::Shape shape, mx::Dtype dtype) {
  size_t count = 1;
  for (int s : shape) {
    count *= static_cast<size_t>(s);
  }
  const size_t size = count * dtype.size();
  return std::make_unique<Buffer>(
      Buffer{mx::array(mx::allocator::malloc(size), std::move(shape), dtype), size});
}

const float kSpecials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-45f,
                           1e-40f, 3e38f, -3e38f, 1.0f, 2.0f};

// Keys and values: any bit pattern at all. Norms: ties, specials or gaussians.
void fill_bits(Buffer& b, std::mt19937_64& rng) {
  for (size_t i = 0; i < b.size; ++i) {
    b.bytes()[i] = static_cast<uint8_t>(rng());
  }
}

void fill_norms(Buffer& b, std::mt19937_64& rng, int mode) {
  auto* p = reinterpret_cast<float*>(b.bytes());
  const size_t n = b.size / sizeof(float);
  std::normal_distribution<float> gauss;
  for (size_t i = 0; i < n; ++i) {
    if (mode == 0) {
      p[i] = static_cast<float>(rng() % 4);
    } else if (mode == 1 && rng() % 4 == 0) {
      p[i] = kSpecials[rng() % (sizeof(kSpecials) / sizeof(float))];
    } else {
      p[i] = gauss(rng);
    }
  }
}

bool same_bits(const mx::array& a, const mx::array& b, bool nan_equal) {
  if (a.nbytes() != b.nbytes()) {
    return false;
  }
  if (!nan_equal) {
    return a.nbytes() == 0 || std::memcmp(a.data<uint8_t>(), b.data<uint8_t>(), a.nbytes()) == 0;
  }
  const auto* x = a.data<float>();
  const auto* y = b.data<float>();
  for (size_t i = 0; i < a.nbytes() / sizeof(float); ++i) {
    const bool both_nan = std::isnan(x[i]) && std::isnan(y[i]);
    if (!both_nan && std::memcmp(&x[i], &y[i], sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

const mx::Dtype kTypes[] = {mx::float16, mx::bfloat16, mx::float32};

void check_key_norms(int rows, int dim, mx::Dtype t, std::mt19937_64& rng, const std::string& label) {
  auto keys = make({rows, dim}, t);
  fill_bits(*keys, rng);
  auto native = make({rows}, mx::float32);
  auto emulated = make({rows}, mx::float32);
  key_norms_cpu(keys->array, native->array);
  key_norms_emulated(keys->array, emulated->array);
  if (!same_bits(native->array, emulated->array, true)) {
    fail("key norms case " + label + " D=" + std::to_string(dim));
  }
}

// Every scorer on the same random rows (any bit pattern: NaN, infinities,
// subnormals), with valid ranges on every other call.
void check_row_scores(int heads, int rows, int dim, mx::Dtype t, std::mt19937_64& rng,
                      const std::string& label) {
  auto keys = make({heads, rows, dim}, t);
  auto values = make({heads, rows, dim}, t);
  auto state = make({heads, dim}, mx::float32);
  auto valid = make({heads, 2}, mx::int32);
  fill_bits(*keys, rng);
  fill_bits(*values, rng);
  fill_norms(*state, rng, 2);
  auto* ranges = reinterpret_cast<int32_t*>(valid->bytes());
  for (int h = 0; h < heads; ++h) {
    ranges[2 * h] = static_cast<int32_t>(rng() % 4);
    ranges[2 * h + 1] = static_cast<int32_t>(rng() % 8);
  }
  const bool has_valid = rng() % 2 == 0;
  for (Scorer scorer : {Scorer::KeyNorm, Scorer::ValueNorm, Scorer::QueryFilter, Scorer::KeyDiff}) {
    const RowScoresConfig config{scorer, 1, has_valid};
    RowScoresInputs in{keys->array, std::nullopt, std::nullopt, std::nullopt};
    if (config.uses_values()) {
      in.values = values->array;
    }
    if (config.uses_state()) {
      in.state = state->array;
    }
    if (has_valid) {
      in.valid = valid->array;
    }
    std::vector<std::unique_ptr<Buffer>> out;
    std::vector<mx::array> native;
    std::vector<mx::array> emulated;
    for (auto* outputs : {&native, &emulated}) {
      out.push_back(make({heads, rows}, mx::float32));
      outputs->push_back(out.back()->array);
      if (config.returns_state()) {
        out.push_back(make({heads, dim}, mx::float32));
        outputs->push_back(out.back()->array);
      }
    }
    row_scores_cpu(in, native, config);
    row_scores_emulated(in, emulated, config);
    for (size_t i = 0; i < native.size(); ++i) {
      if (!same_bits(native[i], emulated[i], false)) {
        fail(std::string("row scores (") + scorer_name(scorer) + ") case " + label + " output " +
             std::to_string(i) + " D=" + std::to_string(dim));
      }
    }
  }
}

void row_scores_case(std::mt19937_64& rng, int c) {
  const int dims[] = {0, 1, 3, 31, 33, 64, 80, 128, 512};
  const int dim = dims[rng() % 9];
  check_row_scores(static_cast<int>(1 + rng() % 5), static_cast<int>(rng() % 9), dim, kTypes[rng() % 3], rng,
                   std::to_string(c));
}

void key_norms_case(std::mt19937_64& rng, int c) {
  const int dims[] = {0, 1, 3, 31, 33, 80, 96, 112, 128, 256, 512};
  const int dim = dims[rng() % 11];
  const int rows = static_cast<int>(rng() % (dim >= 256 ? 3 : 10));
  check_key_norms(rows, dim, kTypes[rng() % 3], rng, std::to_string(c));
}

// Keys with D = 0 have no elements, so no Metal buffer: their slot must be
// marked empty, and the emulator must refuse the plan once the mark is
// taken away (the check that holds every plan to it has teeth).
void check_empty_array_slots() {
  auto keys = make({3, 0}, mx::float16);
  auto norms = make({3}, mx::float32);
  LaunchPlan plan = key_norms_plan(keys->array, norms->array);
  if (!plan.buffers.at(0).empty || plan.buffers.at(1).empty) {
    fail("key_norms_plan marks the wrong slots of D = 0 keys empty");
  }
  plan.buffers.at(0).empty = false;
  std::vector<mx::array> outputs{norms->array};
  try {
    run_emulated_plan(plan, {keys->array}, outputs);
    fail("the emulator bound an empty array that its plan did not mark");
  } catch (const std::logic_error&) {
  }
}

std::unique_ptr<Buffer> copy_of(const Buffer& b) {
  auto out = make(b.array.shape(), b.array.dtype());
  if (b.size > 0) {
    std::memcpy(out->bytes(), b.bytes(), b.size);
  }
  return out;
}

// One kernel's run on copies of `in`: output i is the copy of input i where
// bit i of `shared` is set (updated in place), else a fresh array of
// shapes[i] and types[i]. The buffers live as long as the run.
struct KernelRun {
  std::vector<std::unique_ptr<Buffer>> buffers;
  std::vector<mx::array> inputs;
  std::vector<mx::array> outputs;
};

KernelRun kernel_run(
    const std::vector<std::unique_ptr<Buffer>>& in,
    unsigned shared,
    const std::vector<mx::Shape>& shapes,
    const std::vector<mx::Dtype>& types) {
  KernelRun run;
  for (const auto& b : in) {
    run.buffers.push_back(copy_of(*b));
    run.inputs.push_back(run.buffers.back()->array);
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    if ((shared & (1u << i)) != 0) {
      run.outputs.push_back(run.inputs[i]);
    } else {
      run.buffers.push_back(make(shapes[i], types[i]));
      run.outputs.push_back(run.buffers.back()->array);
    }
  }
  return run;
}

// The shape of one protected_topk_gather case; its data is drawn at random.
struct GatherCase {
  SelectionConfig config;
  int n_rows;
  int n_prior;
  int n_new;
  int dim;
  int value_dim;
  mx::Dtype key_type;
  mx::Dtype value_type;
  int norms_mode;  // fill_norms: ties, specials or gaussians
  unsigned shared;  // bit i: output i (keys, values, norms) is prior i's buffer (budget = n_prior)
};

GatherCase random_gather_case(std::mt19937_64& rng) {
  const int n_rows = 1 + static_cast<int>(rng() % 2);
  const int n_prior = rng() % 2 ? static_cast<int>(rng() % 12)
                                : 250 + static_cast<int>(rng() % 400);
  const int n_new = static_cast<int>(rng() % 34);
  const int dims[] = {0, 1, 3, 8, 33, 80};
  const int dim = dims[rng() % 6];
  // Keys and values may differ in width.
  const int value_dim = rng() % 2 ? dim : dims[rng() % 6];
  const int n_total = n_prior + n_new;
  // A step from a full state, as donation updates it in place.
  const bool in_place = n_prior > 0 && rng() % 3 == 0;
  const unsigned shared = in_place ? 1u + static_cast<unsigned>(rng() % 7) : 0u;
  SelectionConfig config;
  config.budget = in_place ? n_prior : 1 + static_cast<int>(rng() % (n_total + 3));
  config.n_sink = static_cast<int>(rng() % config.budget);
  config.recent = static_cast<int>(rng() % (config.budget - config.n_sink));
  config.keep = rng() % 2 ? Keep::Low : Keep::High;
  const mx::Dtype kt = kTypes[rng() % 3];
  const mx::Dtype vt = kTypes[rng() % 3];
  return {config, n_rows, n_prior, n_new, dim, value_dim, kt, vt, static_cast<int>(rng() % 3),
          shared};
}

void check_gather(const GatherCase& gc, std::mt19937_64& rng, const std::string& label) {
  const SelectionConfig& config = gc.config;
  const int n_rows = gc.n_rows;
  std::vector<std::unique_ptr<Buffer>> in;
  in.push_back(make({n_rows, gc.n_prior, gc.dim}, gc.key_type));
  in.push_back(make({n_rows, gc.n_prior, gc.value_dim}, gc.value_type));
  in.push_back(make({n_rows, gc.n_prior}, mx::float32));
  in.push_back(make({n_rows, gc.n_new, gc.dim}, gc.key_type));
  in.push_back(make({n_rows, gc.n_new, gc.value_dim}, gc.value_type));
  in.push_back(make({n_rows, gc.n_new}, mx::float32));
  for (int i : {0, 1, 3, 4}) {
    fill_bits(*in[i], rng);
  }
  fill_norms(*in[2], rng, gc.norms_mode);
  fill_norms(*in[5], rng, gc.norms_mode);
  const int kept = std::min(gc.n_prior + gc.n_new, config.budget);
  const std::vector<mx::Shape> shapes = {
      {n_rows, kept, gc.dim}, {n_rows, kept, gc.value_dim}, {n_rows, kept}, {n_rows, kept}};
  const std::vector<mx::Dtype> types = {gc.key_type, gc.value_type, mx::float32, mx::uint32};
  KernelRun native = kernel_run(in, gc.shared, shapes, types);
  KernelRun emulated = kernel_run(in, gc.shared, shapes, types);
  protected_topk_gather_cpu(GatherInputs::from(native.inputs), native.outputs, config);
  protected_topk_gather_emulated(GatherInputs::from(emulated.inputs), emulated.outputs, config);
  const char* names[] = {"keys", "values", "norms", "indices"};
  for (int i = 0; i < 4; ++i) {
    if (!same_bits(native.outputs[i], emulated.outputs[i], false)) {
      fail("gather case " + label + " output " + names[i] +
           " n_prior=" + std::to_string(gc.n_prior) + " S=" +
           std::to_string(gc.n_new) + " budget=" + std::to_string(config.budget) +
           (gc.shared != 0 ? " in place=" + std::to_string(gc.shared) : ""));
    }
  }
}

// One payload of an evict_and_fill case: its width and dtype.
struct Payload {
  int width;
  mx::Dtype dtype;
};

// The shape of one evict_and_fill case; its data is drawn at random.
struct EvictAndFillCase {
  EvictAndFillConfig config;  // its payload groups, norms_given and has_valid too
  int n_heads;
  int slots;
  int n_new;
  std::vector<Payload> payloads;  // the keys', then the values'
  unsigned shared;  // bit i: output i (payloads, norms, positions) is input i's buffer
  bool distinct;    // distinct positions (the cache's) or a few repeated
  // (lo, hi) per head when config.has_valid; drawn at random when empty.
  std::vector<std::array<int32_t, 2>> valid = {};
  // With config.tree_given: the tree is the one of the inputs (built as the
  // previous step would have), or, when hostile, random int32 entries with
  // this step's stamps (the CPU kernel then evicts through garbage: only
  // the bounds are checked).
  bool hostile_tree = false;
};

// Payload dtypes of every element size: the first payload's, when the
// norms are computed, is one of kTypes.
const mx::Dtype kPayloadTypes[] = {mx::bool_, mx::uint8, mx::int16, mx::float16, mx::bfloat16,
                                   mx::uint32, mx::float32, mx::int64, mx::complex64};

// Keys and values as the float cache stores them (M = 2, norms computed).
std::vector<Payload> key_value(int key_dim, mx::Dtype key_type, int value_dim, mx::Dtype value_type) {
  return {{key_dim, key_type}, {value_dim, value_type}};
}

// A step's eviction configuration: a small budget or one of a few hundred
// rows, any sinks and window that fit, either keep.
SelectionConfig random_selection(std::mt19937_64& rng) {
  SelectionConfig selection;
  selection.budget = rng() % 2 ? 1 + static_cast<int>(rng() % 12)
                               : 250 + static_cast<int>(rng() % 450);
  selection.n_sink = static_cast<int>(rng() % selection.budget);
  selection.recent = static_cast<int>(rng() % (selection.budget - selection.n_sink));
  selection.keep = rng() % 2 ? Keep::Low : Keep::High;
  return selection;
}

EvictAndFillCase random_evict_and_fill_case(std::mt19937_64& rng) {
  EvictAndFillConfig config;
  config.selection = random_selection(rng);
  config.layout = rng() % 2 ? Layout::Slots : Layout::Temporal;
  const int budget = config.selection.budget;
  const int excess[] = {0, 1, 1, 2, 40, 300};
  config.filled = std::max(0, budget + excess[rng() % 6] - static_cast<int>(rng() % 3));
  // Now and then a block of new rows that a second dispatch writes.
  const int n_new = static_cast<int>(rng() % 4 == 0 ? 129 + rng() % 300 : rng() % 34);
  const int kept = static_cast<int>(config.kept());
  const int slots = std::max<int>(config.filled, kept + n_new) + static_cast<int>(rng() % 3);
  const bool in_place = rng() % 2 == 0;
  config.out_capacity = in_place ? slots : kept + n_new + static_cast<int>(rng() % 3);
  config.offset = config.filled + static_cast<int>(rng() % 5);
  const int dims[] = {0, 1, 3, 8, 33, 80};
  std::vector<Payload> payloads;
  if (rng() % 2 == 0) {
    // The float cache's keys and values.
    const int key_dim = dims[rng() % 6];
    payloads = key_value(key_dim, kTypes[rng() % 3], rng() % 2 ? key_dim : dims[rng() % 6],
                         kTypes[rng() % 3]);
    config.payloads = {1, 1, false, false};
  } else {
    // Any payloads, 1 to kEvictMaxPayloads of them, any dtypes and widths.
    const int m = 1 + static_cast<int>(rng() % kEvictMaxPayloads);
    for (int i = 0; i < m; ++i) {
      payloads.push_back({dims[rng() % 6], kPayloadTypes[rng() % 9]});
    }
    const int keys = 1 + static_cast<int>(rng() % m);
    config.payloads = {keys, m - keys, keys > 1, m - keys > 1};
  }
  const bool float_keys = payloads[0].dtype == mx::float16 ||
      payloads[0].dtype == mx::bfloat16 || payloads[0].dtype == mx::float32;
  config.norms_given = !float_keys || rng() % 3 == 0;
  config.has_valid = rng() % 2 == 0;
  const int m = static_cast<int>(payloads.size());
  const unsigned shared = in_place ? static_cast<unsigned>(rng() % (1u << (m + 2))) : 0u;
  config.order_tree = rng() % 3 == 0;
  return {config, 1 + static_cast<int>(rng() % 2), slots, n_new, payloads, shared, rng() % 2 == 0};
}

// A decode step through the previous step's order tree (docs/spec.md §4
// step 4): S = 1, slot layout, C_out = C, filled <= budget + 1, every
// output (the tree included) in place or none; the tree the inputs' own, or
// now and then hostile.
EvictAndFillCase random_tree_decode_case(std::mt19937_64& rng) {
  EvictAndFillConfig config;
  config.selection = random_selection(rng);
  config.layout = Layout::Slots;
  const int budget = config.selection.budget;
  config.filled = rng() % 4 == 0 ? static_cast<int>(rng() % (budget + 1)) : budget + 1;
  const int slots = std::max<int>(config.filled, config.kept() + 1) + static_cast<int>(rng() % 3);
  config.out_capacity = slots;
  config.offset = config.filled + static_cast<int>(rng() % 5);
  const int key_dim = 1 + static_cast<int>(rng() % 40);
  config.payloads = {1, 1, false, false};
  config.has_valid = rng() % 2 == 0;
  config.order_tree = true;
  config.tree_given = true;
  const bool in_place = rng() % 2 == 0;
  EvictAndFillCase ec{config, 1 + static_cast<int>(rng() % 3), slots, 1,
                      key_value(key_dim, kTypes[rng() % 3], key_dim, kTypes[rng() % 3]),
                      in_place ? 0xFu : 0u, rng() % 8 != 0};
  ec.hostile_tree = rng() % 5 == 0;
  return ec;
}

// A decode step through its tree over 601 slots (nodes on four levels wider
// than the threadgroup, so the build's level barrier orders real work), in
// place and not, with valid ranges and without.
std::vector<EvictAndFillCase> fixed_tree_cases() {
  std::vector<EvictAndFillCase> cases;
  for (const bool in_place : {true, false}) {
    for (const bool ranges : {false, true}) {
      EvictAndFillConfig config;
      config.selection = {600, 4, 50, Keep::Low};
      config.layout = Layout::Slots;
      config.filled = 601;
      config.out_capacity = 601;
      config.offset = 601;
      config.payloads = {1, 1, false, false};
      config.has_valid = ranges;
      config.order_tree = true;
      config.tree_given = true;
      cases.push_back({config, 2, 601, 1, key_value(64, mx::float16, 64, mx::float16),
                       in_place ? 0xFu : 0u, true});
    }
  }
  return cases;
}

// Rows a head copies in the fixed cases that split in two dispatches
// (metal/knorm_defines.h): two blocks, the last one row short, so that a
// block missing its guard at the head's end reads one row past the last
// head's, inside AddressSanitizer's redzone.
constexpr int kSplitCaseRows = 2 * static_cast<int>(kSplitRows) - 1;

// Every output in place, temporal layout, rows spanning three 256-slot
// chunks: a decode step (rows after the evicted one shift down by one), a
// step evicting 300 rows, and one evicting 300 rows with a block of
// kSplitCaseRows new ones (written by a second dispatch). The in-place
// compaction moves rows onto rows other threads still read: the norms and
// positions in the waves of one threadgroup a head, whose barriers keep
// that apart; the K/V rows over 128-slot blocks (the wide shift, the wide
// compaction), which the boundary rows or the staged copies in the scratch
// buffer keep apart.
std::vector<EvictAndFillCase> in_place_evict_and_fill_cases() {
  std::vector<EvictAndFillCase> cases;
  for (const auto [excess, n_new] : {std::pair{1, 1}, std::pair{300, 1}, std::pair{300, kSplitCaseRows}}) {
    EvictAndFillConfig config;
    config.selection = {600, 4, 16, Keep::Low};
    config.layout = Layout::Temporal;
    config.filled = 600 + excess;
    config.offset = config.filled;
    config.out_capacity = std::max<int64_t>(config.filled, 600 + n_new) + 1;
    cases.push_back({config, 2, static_cast<int>(config.out_capacity), n_new,
                     key_value(80, mx::float16, 33, mx::float32), 0xFu, true});
  }
  return cases;
}

// evict_and_fill calls whose new rows a second dispatch writes, on three
// heads, each in both layouts, on fresh outputs and in place: a prompt into
// an empty cache and a chunk that evicts nothing (the first dispatch is
// dropped in place).
std::vector<EvictAndFillCase> fixed_evict_and_fill_cases() {
  std::vector<EvictAndFillCase> cases;
  for (const int filled : {0, 131}) {
    for (const Layout layout : {Layout::Slots, Layout::Temporal}) {
      for (const unsigned shared : {0u, 0xFu}) {
        EvictAndFillConfig config;
        config.selection = {400, 3, 5, Keep::Low};
        config.layout = layout;
        config.filled = filled;
        config.offset = filled;
        config.out_capacity = 500;
        cases.push_back({config, 3, 500, kSplitCaseRows,
                         key_value(8, mx::bfloat16, 33, mx::float16), shared, true});
      }
    }
  }
  return cases;
}

// A quantized cache's six payloads (packed words, scales and biases of
// keys and values: widths of 4, 2 and 1 bytes a row and more), their new
// rows' norms given: a decode step in the slot layout (the spare row moves
// into the hole, every payload with it), and steps evicting 300 rows in
// both layouts, in place, one of them with a block the second dispatch
// writes.
std::vector<EvictAndFillCase> payload_evict_and_fill_cases() {
  const std::vector<Payload> quantized = {{16, mx::uint32}, {2, mx::float16}, {2, mx::float16},
                                          {12, mx::uint32}, {1, mx::bfloat16}, {3, mx::uint8}};
  std::vector<EvictAndFillCase> cases;
  for (const auto [excess, layout, n_new] :
       {std::tuple{1, Layout::Slots, 1}, std::tuple{300, Layout::Slots, 1},
        std::tuple{300, Layout::Temporal, kSplitCaseRows}}) {
    EvictAndFillConfig config;
    config.selection = {600, 4, 16, Keep::Low};
    config.layout = layout;
    config.filled = 600 + excess;
    config.offset = config.filled;
    config.out_capacity = std::max<int64_t>(config.filled, 600 + n_new) + 1;
    config.payloads = {3, 3, true, true};
    config.norms_given = true;
    cases.push_back({config, 2, static_cast<int>(config.out_capacity), n_new, quantized,
                     0xFFu, true});
  }
  return cases;
}

// Heads of a batch with valid ranges: positions 0, 1, ... (shuffled) in
// every head, the first 40 left padding in one head (the first 30 and the
// last 20 in another, as a right-padded prompt chunk), none in the third;
// a decode step and a step evicting 300 rows: the padding must rank after
// every real row whatever its norm.
std::vector<EvictAndFillCase> padding_evict_and_fill_cases() {
  std::vector<EvictAndFillCase> cases;
  for (const auto [excess, layout] :
       {std::pair{1, Layout::Slots}, std::pair{300, Layout::Temporal}}) {
    const int32_t filled = 600 + excess;
    EvictAndFillConfig config;
    config.selection = {600, 4, 16, Keep::Low};
    config.layout = layout;
    config.filled = 600 + excess;
    config.offset = config.filled;
    config.out_capacity = config.filled + 1;
    config.has_valid = true;
    cases.push_back({config, 3, static_cast<int>(config.out_capacity), 1,
                     key_value(8, mx::float16, 8, mx::float16), 0xFu, true,
                     {{40, std::numeric_limits<int32_t>::max()}, {30, filled - 20},
                      {0, std::numeric_limits<int32_t>::max()}}});
  }
  return cases;
}

// Two heads of 600 prior and 7 new rows among ties, kept over a compaction
// of three 256-row chunks: kSplitCaseRows (copied by a second dispatch) and
// 100 (copied by the selecting threadgroup, metal/knorm_defines.h's
// kSplitRows); then three heads of 300 new rows and no prior, kSplitCaseRows
// kept by the second dispatch.
std::vector<GatherCase> fixed_gather_cases() {
  std::vector<GatherCase> cases;
  for (int budget : {kSplitCaseRows, 100}) {
    SelectionConfig config;
    config.budget = budget;
    config.n_sink = 4;
    config.recent = 16;
    config.keep = Keep::Low;
    cases.push_back({config, 2, 600, 7, 8, 33, mx::bfloat16, mx::float16, 0, 0u});
  }
  SelectionConfig config;
  config.budget = kSplitCaseRows;
  config.n_sink = 1;
  config.recent = 1;
  config.keep = Keep::High;
  cases.push_back({config, 3, 0, 300, 8, 33, mx::float16, mx::float32, 2, 0u});
  return cases;
}

// Steps from a full state of 600 rows in place, over three 256-row chunks:
// a decode step (the rows after the evicted one shift down by one), one
// evicting 7 rows among ties, and one evicting kSplitCaseRows, that one
// also with only the keys or only the values in place. The moves write rows
// other threads still read: the norms in the selection's waves, whose
// barriers keep that apart; the keys and values over 128-row blocks, from
// copies staged in the scratch buffer by a dispatch before.
std::vector<GatherCase> in_place_gather_cases() {
  std::vector<GatherCase> cases;
  for (const auto [n_new, shared] :
       {std::pair{1, 7u}, std::pair{7, 7u}, std::pair{kSplitCaseRows, 7u},
        std::pair{kSplitCaseRows, 1u}, std::pair{kSplitCaseRows, 6u}}) {
    SelectionConfig config;
    config.budget = 600;
    config.n_sink = 4;
    config.recent = 0;
    config.keep = Keep::Low;
    // Gaussian norms (rows leave anywhere) or ties.
    cases.push_back({config, 2, 600, n_new, 80, 33, mx::float16, mx::float32,
                     n_new == 7 ? 0 : 2, shared});
  }
  return cases;
}

// Valid ranges for the heads of a case: the ones of its positions (left
// padding below lo, right padding from hi), others at random, empty ones
// and the whole int32 range among them.
void fill_valid(Buffer& b, const EvictAndFillCase& ec, std::mt19937_64& rng) {
  auto* valid = reinterpret_cast<int32_t*>(b.bytes());
  const int32_t offset = static_cast<int32_t>(ec.config.offset);
  for (int n = 0; n < ec.n_heads; ++n) {
    if (!ec.valid.empty()) {
      valid[2 * n] = ec.valid.at(n)[0];
      valid[2 * n + 1] = ec.valid.at(n)[1];
      continue;
    }
    int32_t lo = static_cast<int32_t>(rng() % (offset + 2)) - 1;
    int32_t hi = rng() % 2 ? std::numeric_limits<int32_t>::max()
                           : lo + static_cast<int32_t>(rng() % (offset + 3)) - 1;
    switch (rng() % 8) {
      case 0:
        lo = std::numeric_limits<int32_t>::min();
        break;
      case 1:
        std::swap(lo, hi);  // empty: every row padding
        break;
      default:
        break;
    }
    valid[2 * n] = lo;
    valid[2 * n + 1] = hi;
  }
}

// One evict_and_fill call on the same inputs through the CPU kernel and the
// emulated Metal kernel. Only the defined slots [0, kept + S) of each
// head are compared.
void check_evict_and_fill(
    const EvictAndFillCase& ec,
    std::mt19937_64& rng,
    const std::string& label) {
  const EvictAndFillConfig& config = ec.config;
  const int n_heads = ec.n_heads;
  const int m = static_cast<int>(ec.payloads.size());
  const int kept = static_cast<int>(config.kept());
  const int capacity = static_cast<int>(config.out_capacity);
  // Inputs in the primitive's order (EvictAndFillInputs).
  std::vector<std::unique_ptr<Buffer>> in;
  for (const Payload& p : ec.payloads) {
    in.push_back(make({n_heads, ec.slots, p.width}, p.dtype));
    fill_bits(*in.back(), rng);
  }
  in.push_back(make({n_heads, ec.slots}, mx::float32));
  fill_norms(*in.back(), rng, static_cast<int>(rng() % 3));
  in.push_back(make({n_heads, ec.slots}, mx::int32));
  auto* positions = reinterpret_cast<int32_t*>(in.back()->bytes());
  for (int n = 0; n < n_heads; ++n) {
    int32_t* head = positions + static_cast<size_t>(n) * ec.slots;
    for (int s = 0; s < ec.slots; ++s) {
      head[s] = ec.distinct ? s : static_cast<int32_t>(rng() % 8);
    }
    if (ec.distinct) {
      std::shuffle(head, head + config.filled, rng);
    }
  }
  for (const Payload& p : ec.payloads) {
    in.push_back(make({n_heads, ec.n_new, p.width}, p.dtype));
    fill_bits(*in.back(), rng);
  }
  if (config.norms_given) {
    in.push_back(make({n_heads, ec.n_new}, mx::float32));
    fill_norms(*in.back(), rng, 1);
  }
  const int32_t* valid = nullptr;
  if (config.has_valid) {
    in.push_back(make({n_heads, 2}, mx::int32));
    fill_valid(*in.back(), ec, rng);
    valid = reinterpret_cast<const int32_t*>(in.back()->bytes());
  }
  if (config.tree_given) {
    in.push_back(make({n_heads, 2, ec.slots + 1}, mx::int32));
    auto* tree = reinterpret_cast<int32_t*>(in.back()->bytes());
    const auto* norms = reinterpret_cast<const float*>(in[m]->bytes());
    for (int n = 0; n < n_heads; ++n) {
      int32_t* eviction = tree + static_cast<size_t>(n) * 2 * (ec.slots + 1);
      int32_t* window = eviction + ec.slots + 1;
      if (ec.hostile_tree) {
        for (int i = 0; i < 2 * (ec.slots + 1); ++i) {
          eviction[i] = static_cast<int32_t>(rng());
        }
        eviction[0] = static_cast<int32_t>(config.filled);
        window[0] = static_cast<int32_t>(config.offset);
        continue;
      }
      const size_t row = static_cast<size_t>(n) * ec.slots;
      const OrderTreeKeys keys{norms + row, positions + row, config.filled,
                               EvictionRank::of(config.selection, config.offset,
                                                valid ? valid + 2 * n : nullptr)};
      order_tree_build(eviction, window, ec.slots, keys, config.offset);
    }
  }
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> types;
  for (const Payload& p : ec.payloads) {
    shapes.push_back({n_heads, capacity, p.width});
    types.push_back(p.dtype);
  }
  shapes.push_back({n_heads, capacity});
  types.push_back(mx::float32);
  shapes.push_back({n_heads, capacity});
  types.push_back(mx::int32);
  if (config.order_tree) {
    shapes.push_back({n_heads, 2, capacity + 1});
    types.push_back(mx::int32);
  }
  auto run = [&](auto kernel) {
    KernelRun r = kernel_run(in, ec.shared & ((1u << (m + 2)) - 1u), shapes, types);
    if (config.tree_given && config.order_tree && ec.shared != 0 && capacity == ec.slots) {
      // The output tree in the given one's buffer.
      r.outputs[m + 2] = r.inputs.back();
    }
    kernel(EvictAndFillInputs::from(r.inputs, config), r.outputs, config);
    std::vector<std::vector<uint8_t>> defined;
    for (size_t i = 0; i < static_cast<size_t>(m + 2); ++i) {
      const auto& out = r.outputs[i];
      const size_t row = static_cast<size_t>(out.itemsize()) *
          (out.ndim() == 3 ? out.shape(2) : 1);
      std::vector<uint8_t> bytes;
      for (int n = 0; n < n_heads; ++n) {
        const uint8_t* head = out.data<uint8_t>() + static_cast<size_t>(n) * capacity * row;
        bytes.insert(bytes.end(), head, head + (kept + ec.n_new) * row);
      }
      defined.push_back(std::move(bytes));
    }
    if (config.order_tree) {
      const auto& tree = r.outputs[m + 2];
      defined.emplace_back(tree.data<uint8_t>(), tree.data<uint8_t>() + tree.nbytes());
    }
    return defined;
  };
  const auto native = run(&evict_and_fill_cpu);
  const auto emulated = run(&evict_and_fill_emulated);
  if (ec.hostile_tree) {
    // Unspecified results; the sanitizers check the bounds.
    return;
  }
  for (size_t i = 0; i < native.size(); ++i) {
    if (native[i] != emulated[i]) {
      const std::string name = static_cast<int>(i) < m ? config.payloads.name(static_cast<int>(i))
          : static_cast<int>(i) == m ? "norms" : static_cast<int>(i) == m + 1 ? "positions" : "order tree";
      fail("evict_and_fill case " + label + " output " + name + " (of " + std::to_string(m) +
           " payloads) filled=" + std::to_string(config.filled) + " budget=" +
           std::to_string(config.selection.budget) + " S=" + std::to_string(ec.n_new) +
           " in place=" + std::to_string(ec.shared) +
           (config.norms_given ? " norms given" : "") + (config.has_valid ? " valid ranges" : ""));
    }
  }
}

void check_conversions(std::mt19937_64& rng) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    metal::emulated_half h;
    h.bits = bits;
    mx::float16_t ref;
    std::memcpy(&ref, &bits, sizeof(bits));
    const float x = static_cast<float>(h);
    const float y = static_cast<float>(ref);
    if (!(std::isnan(x) && std::isnan(y)) && std::memcmp(&x, &y, 4) != 0) {
      fail("half -> float of 0x" + std::to_string(b));
    }
  }
  for (int i = 0; i < 1 << 20; ++i) {
    const uint32_t bits = static_cast<uint32_t>(rng());
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    if (std::isnan(f)) {
      continue;
    }
    const metal::emulated_half h(f);
    const mx::float16_t ref(f);
    const metal::emulated_bfloat bh(f);
    const mx::bfloat16_t bref(f);
    if (std::memcmp(&h.bits, &ref, 2) != 0 || std::memcmp(&bh.bits, &bref, 2) != 0) {
      fail("float -> half/bfloat of " + std::to_string(f));
    }
  }
}

// The fixed cases: every kernel once, the gather and the evict-and-fill
// kernel over their in-place compactions.
void fixed_cases(std::mt19937_64& rng) {
  check_key_norms(9, 80, mx::float16, rng, "fixed");
  check_row_scores(5, 9, 80, mx::float16, rng, "fixed");
  check_row_scores(3, 7, 128, mx::bfloat16, rng, "fixed");
  for (const GatherCase& gc : fixed_gather_cases()) {
    check_gather(gc, rng, "fixed");
  }
  for (const GatherCase& gc : in_place_gather_cases()) {
    check_gather(gc, rng, "in place");
  }
  for (const EvictAndFillCase& ec : in_place_evict_and_fill_cases()) {
    check_evict_and_fill(ec, rng, "in place, temporal");
  }
  for (const EvictAndFillCase& ec : fixed_evict_and_fill_cases()) {
    check_evict_and_fill(ec, rng, "fixed");
  }
  for (const EvictAndFillCase& ec : payload_evict_and_fill_cases()) {
    check_evict_and_fill(ec, rng, "payloads");
  }
  for (const EvictAndFillCase& ec : padding_evict_and_fill_cases()) {
    check_evict_and_fill(ec, rng, "padding");
  }
  for (const EvictAndFillCase& ec : fixed_tree_cases()) {
    check_evict_and_fill(ec, rng, "order tree");
  }
}

} // namespace

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 40;
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
  std::mt19937_64 rng(seed);
  try {
    check_conversions(rng);
    check_empty_array_slots();
    fixed_cases(rng);
    for (int c = 0; c < cases; ++c) {
      key_norms_case(rng, c);
      row_scores_case(rng, c);
      check_gather(random_gather_case(rng), rng, std::to_string(c));
      check_evict_and_fill(random_evict_and_fill_case(rng), rng, std::to_string(c));
      if (c % 2 == 0) {
        // Every other case: under the sanitizers a 700-slot decode is slow.
        check_evict_and_fill(random_tree_decode_case(rng), rng, "tree decode " + std::to_string(c));
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: %s\n", e.what());
    return 1;
  }
  std::printf("%d cases, %d mismatches\n", cases, failures);
  return failures == 0 ? 0 : 1;
}
