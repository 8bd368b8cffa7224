// Input checks of the C++ ops: a line-by-line port of specdec/_validation.py (same order, error types
// and messages, each starting with the argument's name), for C++ callers that bypass the Python wrappers.
// ValueError = TORCH_CHECK_VALUE, TypeError = TORCH_CHECK_TYPE.
#include "specdec.h"


#include <cstdio>
#include <cmath>
#include <algorithm>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>

namespace specdec {
namespace {

using at::ScalarType;

const std::initializer_list<ScalarType> kFloat = {ScalarType::Half, ScalarType::BFloat16, ScalarType::Float,
                                                  ScalarType::Double};
// _validation.CACHE_DTYPES, in its order (the "expected one of" message lists them)
const std::initializer_list<ScalarType> kCache = {ScalarType::Half, ScalarType::BFloat16, ScalarType::Float,
                                                  ScalarType::Double, ScalarType::Float8_e4m3fn,
                                                  ScalarType::Float8_e5m2};
const std::initializer_list<ScalarType> kInt = {ScalarType::Int, ScalarType::Long};
const std::initializer_list<ScalarType> kInt32 = {ScalarType::Int};

// torch's Python name of a dtype ("float16"), as _validation.py prints them.
std::string dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Half: return "float16";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Float: return "float32";
    case ScalarType::Double: return "float64";
    case ScalarType::Float8_e4m3fn: return "float8_e4m3fn";
    case ScalarType::Float8_e5m2: return "float8_e5m2";
    case ScalarType::Int: return "int32";
    case ScalarType::Long: return "int64";
    case ScalarType::Short: return "int16";
    case ScalarType::Char: return "int8";
    case ScalarType::Byte: return "uint8";
    case ScalarType::Bool: return "bool";
    case ScalarType::ComplexFloat: return "complex64";
    case ScalarType::ComplexDouble: return "complex128";
    default: return c10::toString(t);
  }
}

// A Python tuple's repr: (), (3,), (2, 5).
std::string shape_str(c10::IntArrayRef shape) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << (shape.size() == 1 ? ",)" : ")");
  return s.str();
}

// printf's %g, which Python's format(x, "g") matches ("-1", "0.001", "1e-30", "nan", "-inf"); a NaN
// with its sign bit set is "nan" in Python but "-nan" in glibc's printf.
std::string format_g(double x) {
  if (std::isnan(x)) return "nan";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", x);
  return buf;
}

void check_tensor(const std::string& name, const Tensor& x, int64_t dim = -1,
                  std::initializer_list<ScalarType> dtypes = {}, const c10::Device* device = nullptr) {
  TORCH_CHECK_VALUE(dim < 0 || x.dim() == dim, name, ": expected ", dim, " dimensions, got shape ",
                    shape_str(x.sizes()));
  if (dtypes.size() > 0) {
    bool ok = false;
    std::string names;
    for (auto t : dtypes) {
      ok = ok || x.scalar_type() == t;
      names += (names.empty() ? "" : ", ") + dtype_name(t);
    }
    TORCH_CHECK_TYPE(ok, name, ": dtype ", dtype_name(x.scalar_type()), " not supported (expected one of ",
                     names, ")");
  }
  TORCH_CHECK_VALUE(device == nullptr || x.device() == *device, name, ": on ", x.device().str(), ", expected ",
                    device->str(), " like the other inputs");
}

void check_shape(const std::string& name, const Tensor& x, c10::IntArrayRef expected) {
  TORCH_CHECK_VALUE(x.sizes() == expected, name, ": expected shape ", shape_str(expected), ", got ",
                    shape_str(x.sizes()));
}

// An int index tensor as int32, contiguous; an int64 one must hold int32 values (narrowing would wrap them).
// With num_nodes (int32 (B,)), x is (B, T) per node and only the real nodes' values count (padding is never read).
Tensor int32_contiguous(const std::string& name, const Tensor& x, const Tensor& num_nodes = Tensor()) {
  if (x.scalar_type() == ScalarType::Long && x.numel() > 0) {
    const Tensor values = x.contiguous();
    const int64_t* v = values.data_ptr<int64_t>();
    const int64_t rows = num_nodes.defined() ? x.size(0) : 1, T = num_nodes.defined() ? x.size(1) : x.numel();
    for (int64_t b = 0; b < rows; ++b) {
      const int64_t n = num_nodes.defined() ? num_nodes.data_ptr<int32_t>()[b] : T;
      for (int64_t i = 0; i < std::min(n, T); ++i) {
        TORCH_CHECK_VALUE(v[b * T + i] >= std::numeric_limits<int32_t>::min() &&
                          v[b * T + i] <= std::numeric_limits<int32_t>::max(), name,
                          ": int64 values must fit in int32");
      }
    }
  }
  return x.to(at::kInt).contiguous();
}

Tensor normalize_num_nodes(const Tensor& num_nodes, int64_t B, const c10::Device& device) {
  check_tensor("num_nodes", num_nodes, 1, kInt, &device);
  check_shape("num_nodes", num_nodes, {B});
  return int32_contiguous("num_nodes", num_nodes);
}

void check_num_nodes_range(const Tensor& num_nodes, int64_t T) {
  const int32_t* nn = num_nodes.data_ptr<int32_t>();
  for (int64_t b = 0; b < num_nodes.size(0); ++b) {
    TORCH_CHECK_VALUE(nn[b] >= 1 && nn[b] <= T, "num_nodes: every entry must be in [1, ", T, "]");
  }
}

// parents/num_nodes: int32 contiguous (B, T) / (B,).
void check_parents(const Tensor& parents, const Tensor& num_nodes) {
  const int64_t B = parents.size(0), T = parents.size(1);
  TORCH_CHECK_VALUE(T >= 1, "parents: needs at least one node (the root), got shape ", shape_str(parents.sizes()));
  check_num_nodes_range(num_nodes, T);
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* nn = num_nodes.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(par[b * T] == -1, "parents: parents[:, 0] must be -1 (node 0 is the root)");
  }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 1; i < nn[b]; ++i) {
      int32_t p = par[b * T + i];
      TORCH_CHECK_VALUE(p >= 0 && p < i, "parents: every real node i > 0 needs 0 <= parents[b, i] < i");
    }
  }
}

// _validation.v_reads_k: v_cache is k_cache[..., :Dv], the leading channels of K's rows (MLA's V)
bool v_reads_k(const Tensor& k_cache, const Tensor& v_cache) {
  return v_cache.is_alias_of(k_cache) && v_cache.dim() == k_cache.dim() &&
         v_cache.storage_offset() == k_cache.storage_offset() && v_cache.strides() == k_cache.strides() &&
         v_cache.sizes().slice(0, v_cache.dim() - 1) == k_cache.sizes().slice(0, k_cache.dim() - 1) &&
         v_cache.size(-1) <= k_cache.size(-1);
}

// v_cache undefined: a single cache (MLA's latent cache). v_head_dim: v_cache may have its own head dim
// (tree_attention's V), else it has k_cache's shape and is not a narrower view of k_cache's rows.
void check_cache_pair(const Tensor& k_cache, const Tensor& v_cache, const std::optional<Tensor>& block_table,
                      int64_t B, const std::string& k_name = "k_cache", const std::string& v_name = "v_cache",
                      bool v_head_dim = false) {
  check_tensor(k_name, k_cache, -1, kCache);
  const c10::Device device = k_cache.device();
  if (v_cache.defined()) check_tensor(v_name, v_cache, -1, kCache, &device);
  TORCH_CHECK_VALUE(k_cache.dim() == 4 || k_cache.dim() == 5, k_name,
                    ": expected (B, L_max, Hkv, D), (num_blocks, block_size, Hkv, D) or a stack of those with a "
                    "leading layer dimension, got shape ", shape_str(k_cache.sizes()));
  if (v_cache.defined()) {
    TORCH_CHECK_VALUE(v_head_dim || !v_reads_k(k_cache, v_cache) || v_cache.size(-1) == k_cache.size(-1), v_name,
                      ": is a view of ", k_name,
                      "'s rows (MLA's V); a single-cache layer passes ", v_name,
                      "=None, its rows are written and moved once");
    std::vector<int64_t> expected(k_cache.sizes().begin(), k_cache.sizes().end());
    if (v_head_dim && v_cache.dim() == k_cache.dim()) expected.back() = v_cache.size(-1);
    check_shape(v_name, v_cache, expected);
    TORCH_CHECK_TYPE(v_cache.scalar_type() == k_cache.scalar_type(), v_name, ": dtype torch.",
                     dtype_name(v_cache.scalar_type()), " differs from ", k_name, " dtype torch.",
                     dtype_name(k_cache.scalar_type()));
  }
  TORCH_CHECK_VALUE(block_table.has_value() || k_cache.size(-4) == B, k_name,
                    ": a contiguous cache needs one row per request (", B, "), got ", k_cache.size(-4));
}

void check_block_table(const std::optional<Tensor>& block_table, int64_t B, const c10::Device& device) {
  if (!block_table.has_value()) return;
  check_tensor("block_table", *block_table, 2, kInt32, &device);
  TORCH_CHECK_VALUE(block_table->size(0) == B, "block_table: expected ", B,
                    " rows (one per request), got shape ", shape_str(block_table->sizes()));
}

void check_cache_lens(const Tensor& cache_lens, int64_t B, const c10::Device& device) {
  check_tensor("cache_lens", cache_lens, 1, kInt32, &device);
  check_shape("cache_lens", cache_lens, {B});
}

// The dequantization scales of a cache of dtype `cache`: finite, > 0, and 1 unless the cache is float8.
void check_scales(ScalarType cache, double k_scale, double v_scale) {
  for (const auto& [name, scale] : {std::pair<const char*, double>{"k_scale", k_scale}, {"v_scale", v_scale}}) {
    TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0, name, ": must be a finite number > 0, got ",
                      format_g(scale));
    TORCH_CHECK_VALUE(scale == 1.0 || is_float8(cache), name, ": only float8 caches are scaled; this cache is ",
                      dtype_name(cache));
  }
}

// Positions [cache_lens[b], cache_lens[b] + extent(b)) exist, and the blocks the op touches, those holding
// positions [first(cache_lens[b]), cache_lens[b] + extent(b)), are valid (an engine may have freed the others,
// e.g. the blocks that slid out of a window).
template <typename Extent, typename First>
void check_positions(c10::IntArrayRef cache_shape, const Tensor& cache_lens, const std::optional<Tensor>& block_table,
                     Extent extent, First first, const char* what) {
  const int64_t B = cache_lens.size(0), rows = cache_shape[cache_shape.size() - 3];
  const int64_t cap = block_table.has_value() ? block_table->size(1) * rows : rows;
  auto lens = cache_lens.accessor<int32_t, 1>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK_VALUE(lens[b] >= 0, "cache_lens: must be >= 0");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(lens[b] + extent(b) <= cap, "cache_lens: no room for ", what,
                      ": cache_lens + count exceeds the capacity ", cap);
    // (cache_lens is int32: the op advances it to at most the end)
    TORCH_CHECK_VALUE(lens[b] + extent(b) <= std::numeric_limits<int32_t>::max(), "cache_lens: no room for ", what,
                      ": cache_lens + count exceeds 2**31 - 1 (int32)");
  }
  if (!block_table.has_value()) return;
  const int64_t num_blocks = cache_shape[cache_shape.size() - 4];
  auto table = block_table->accessor<int32_t, 2>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = (lens[b] + extent(b) + rows - 1) / rows;
    for (int64_t j = first(int64_t{lens[b]}) / rows; j < used; ++j) {
      TORCH_CHECK_VALUE(table[b][j] >= 0 && table[b][j] < num_blocks, "block_table: block ids in use must be in [0, ",
                        num_blocks, ")");
    }
  }
}

// _validation.self_overlapping: two elements of t may share memory (a stride-0 dimension, or strides that do
// not nest: sorted, each larger than the extent of the smaller ones).
bool self_overlapping(const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dimensions of size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t extent = 0;
  for (const auto& [stride, n] : dims) {
    if (stride <= extent) return true;
    extent += (n - 1) * stride;
  }
  return false;
}

// (first, last + 1) byte addresses of t's elements.
std::pair<uintptr_t, uintptr_t> byte_span(const Tensor& t) {
  int64_t extent = 0;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {first, first + (extent + 1) * t.element_size()};
}

// _validation.shares_memory: an element in common (exact for one layout at two offsets: the offset written in
// the layout's nested strides, digit by digit; other pairs whose address ranges intersect count as sharing).
bool shares_memory(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || a.storage().data() != b.storage().data()) return false;
  const auto [a_lo, a_hi] = byte_span(a);
  const auto [b_lo, b_hi] = byte_span(b);
  if (a_hi <= b_lo || b_hi <= a_lo) return false;
  const int64_t size = a.element_size();
  const int64_t offset = static_cast<int64_t>(b_lo) - static_cast<int64_t>(a_lo);
  if (a.sizes() != b.sizes() || a.strides() != b.strides() || b.element_size() != size || offset % size != 0) {
    return true;
  }
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1) dims.emplace_back(a.stride(d), a.size(d));
  }
  std::sort(dims.rbegin(), dims.rend());
  int64_t rest = offset / size;
  for (const auto& [stride, n] : dims) rest -= std::clamp(rest / stride, -(n - 1), n - 1) * stride;
  return rest == 0;
}

// _validation._choice: one of `choices`, else "name: expected one of ('a', 'b'), got 'x'".
void check_choice(const char* name, c10::string_view x, std::initializer_list<const char*> choices) {
  std::string names;
  bool ok = false;
  for (const char* c : choices) {
    ok = ok || x == c;
    names += (names.empty() ? "'" : ", '") + std::string(c) + "'";
  }
  TORCH_CHECK_VALUE(ok, name, ": expected one of (", names, "), got '", std::string(x), "'");
}

// A per-request penalty (B,) float -> float32 contiguous; finite, and > 0 for the repetition penalty (checked
// after the cast, as _validation.normalize_penalty: a float64 beyond float32's range is inf there).
Tensor penalty(const char* name, const std::optional<Tensor>& x, int64_t B, const c10::Device& device, bool positive) {
  if (!x.has_value()) return Tensor();
  check_tensor(name, *x, 1, kFloat, &device);
  check_shape(name, *x, {B});
  Tensor values = x->to(at::kFloat).contiguous();
  const float* v = values.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(std::isfinite(v[b]) && (!positive || v[b] > 0), name,
                      positive ? ": must be finite and > 0 (1: off)" : ": must be finite (0: off)");
  }
  return values;
}

// (B, K) int token ids, -1 = padding, else in [0, V) -> int32 contiguous (_validation._token_ids).
Tensor token_ids(const char* name, const Tensor& x, int64_t B, int64_t V, const c10::Device& device) {
  check_tensor(name, x, 2, kInt, &device);
  TORCH_CHECK_VALUE(x.size(0) == B, name, ": expected shape (B, K) with B = ", B, ", got ", shape_str(x.sizes()));
  const Tensor ids = x.to(at::kLong).contiguous();
  const int64_t* v = ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < ids.numel(); ++j) {
    TORCH_CHECK_VALUE(v[j] >= -1 && v[j] < V, name, ": ids must be in [0, ", V, ") or -1 (padding)");
  }
  return ids.to(at::kInt).contiguous();
}

// _validation.check_sampling_params on the op's normalized arguments (each None: off for the whole batch), in its
// order; fills in's step-0, filter-order and logprob fields.
void check_sampling_params(AcceptInputs& in, int64_t B, int64_t V, const c10::Device& device,
                           const std::optional<Tensor>& repetition_penalty,
                           const std::optional<Tensor>& frequency_penalty,
                           const std::optional<Tensor>& presence_penalty,
                           const std::optional<Tensor>& output_token_counts,
                           const std::optional<Tensor>& prompt_token_mask, const std::optional<Tensor>& logit_bias_ids,
                           const std::optional<Tensor>& logit_bias_values, const std::optional<Tensor>& min_tokens,
                           const std::optional<Tensor>& stop_token_ids, c10::string_view filter_order,
                           int64_t return_logprobs, c10::string_view logprobs_mode) {
  check_choice("filter_order", filter_order, {"hf", "vllm", "sglang"});
  check_choice("logprobs_mode", logprobs_mode, {"raw", "processed"});
  TORCH_CHECK_VALUE(return_logprobs >= -1 && return_logprobs <= kMaxLogprobs, "return_logprobs: must be in [0, ",
                    kMaxLogprobs, "] (-1: off), got ", return_logprobs);
  in.filter_order = filter_order == "vllm" ? FilterOrder::kVllm
                    : filter_order == "sglang" ? FilterOrder::kSglang : FilterOrder::kHf;
  in.return_logprobs = return_logprobs;
  in.processed_logprobs = logprobs_mode == "processed";
  in.repetition_penalty = penalty("repetition_penalty", repetition_penalty, B, device, true);
  in.frequency_penalty = penalty("frequency_penalty", frequency_penalty, B, device, false);
  in.presence_penalty = penalty("presence_penalty", presence_penalty, B, device, false);
  TORCH_CHECK_TYPE(min_tokens.has_value() || !stop_token_ids.has_value(),
                   "stop_token_ids: goes with min_tokens (the stop tokens masked until min_tokens)");
  if (min_tokens.has_value()) {
    check_tensor("min_tokens", *min_tokens, 1, kInt, &device);
    check_shape("min_tokens", *min_tokens, {B});
    const Tensor given = min_tokens->to(at::kLong).contiguous();
    const int64_t* m = given.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK_VALUE(m[b] >= 0 && m[b] <= std::numeric_limits<int32_t>::max(),
                        "min_tokens: must be in [0, 2**31) (0: off)");
    }
    in.min_tokens = given.to(at::kInt).contiguous();
    TORCH_CHECK_TYPE(stop_token_ids.has_value(), "stop_token_ids: required with min_tokens");
    in.stop_token_ids = token_ids("stop_token_ids", *stop_token_ids, B, V, device);
  }
  const char* needs_counts = in.repetition_penalty.defined() ? "repetition_penalty"
                             : in.frequency_penalty.defined() ? "frequency_penalty"
                             : in.presence_penalty.defined()  ? "presence_penalty"
                             : in.min_tokens.defined()        ? "min_tokens" : nullptr;
  if (output_token_counts.has_value()) {
    check_tensor("output_token_counts", *output_token_counts, 2, kInt, &device);
    check_shape("output_token_counts", *output_token_counts, {B, V});
    const Tensor counts = output_token_counts->contiguous();
    auto check_counts = [&](auto* c) {
      for (int64_t j = 0; j < counts.numel(); ++j) {
        TORCH_CHECK_VALUE(c[j] >= 0 && c[j] <= std::numeric_limits<int32_t>::max(),
                          "output_token_counts: counts must be in [0, 2**31)");
      }
    };
    if (counts.scalar_type() == ScalarType::Long) {
      check_counts(counts.data_ptr<int64_t>());
    } else {
      check_counts(counts.data_ptr<int32_t>());
    }
    if (needs_counts != nullptr) in.output_token_counts = counts.to(at::kInt);
  } else {
    TORCH_CHECK_TYPE(needs_counts == nullptr, "output_token_counts: required with ", needs_counts,
                     " (the counts the penalties read)");
  }
  if (prompt_token_mask.has_value()) {
    check_tensor("prompt_token_mask", *prompt_token_mask, 2, {}, &device);
    TORCH_CHECK_VALUE(prompt_token_mask->scalar_type() == ScalarType::Int, "prompt_token_mask: dtype ",
                      dtype_name(prompt_token_mask->scalar_type()), " not supported (expected int32)");
    check_shape("prompt_token_mask", *prompt_token_mask, {B, (V + 31) / 32});
    if (in.repetition_penalty.defined()) in.prompt_token_mask = prompt_token_mask->contiguous();
  }
  // (named as the Python argument logit_bias = (ids, values) names them)
  TORCH_CHECK_TYPE(logit_bias_ids.has_value() == logit_bias_values.has_value(),
                   "logit_bias: expected (ids (B, K) int, values (B, K) float)");
  if (logit_bias_ids.has_value()) {
    in.logit_bias_ids = token_ids("logit_bias[0]", *logit_bias_ids, B, V, device);
    check_tensor("logit_bias[1]", *logit_bias_values, 2, kFloat, &device);
    check_shape("logit_bias[1]", *logit_bias_values, in.logit_bias_ids.sizes());
    in.logit_bias_values = logit_bias_values->to(at::kFloat).contiguous();
    const float* v = in.logit_bias_values.data_ptr<float>();
    for (int64_t j = 0; j < in.logit_bias_values.numel(); ++j) {
      TORCH_CHECK_VALUE(std::isfinite(v[j]), "logit_bias[1]: must be finite (as float32)");
    }
  }
}

}  // namespace

TreeInputs check_build_tree(const Tensor& parents, const Tensor& num_nodes) {
  check_tensor("parents", parents, 2, kInt);
  Tensor nn = normalize_num_nodes(num_nodes, parents.size(0), parents.device());
  TreeInputs in{int32_contiguous("parents", parents, nn), nn};
  check_parents(in.parents, in.num_nodes);
  return in;
}

Tensor check_tree_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& cache_lens,
                            const Tensor& tree_mask, const std::optional<Tensor>& block_table,
                            const Tensor& num_nodes, double scale, double k_scale, double v_scale,
                            int64_t window_left, double logits_soft_cap, const std::optional<Tensor>& row_offsets,
                            int64_t max_nodes, const std::optional<Tensor>& sinks) {
  // packed (row_offsets given): q (N, Hq, D) and tree_mask (N, W) rows, node i of request b at row_offsets[b] + i
  const bool packed = row_offsets.has_value();
  check_tensor("q", q, packed ? 3 : 4, kFloat);
  const int64_t B = packed ? row_offsets->size(0) : q.size(0), T = packed ? max_nodes : q.size(1);
  const int64_t Hq = q.size(-2), D = q.size(-1);
  TORCH_CHECK_TYPE(!packed || max_nodes >= 1, "max_nodes: with cu_num_nodes, an int >= 1 bounding every request's "
                   "number of nodes");
  const c10::Device device = q.device();
  check_tensor("k_cache", k_cache, 4, {}, &device);
  check_cache_pair(k_cache, v_cache, block_table, B, "k_cache", "v_cache", /*v_head_dim=*/true);
  const int64_t Hkv = k_cache.size(-2), Dk = k_cache.size(-1), Dv = v_cache.size(-1);
  TORCH_CHECK_TYPE(k_cache.scalar_type() == q.scalar_type() || is_float8(k_cache.scalar_type()),
                   "k_cache: dtype torch.", dtype_name(k_cache.scalar_type()), " differs from q dtype torch.",
                   dtype_name(q.scalar_type()), " (a cache holds q's dtype or float8)");
  check_scales(k_cache.scalar_type(), k_scale, v_scale);
  // one set of stored values, one scale (the Python op turns v_scale=None into k_scale)
  TORCH_CHECK_VALUE(!v_reads_k(k_cache, v_cache) || v_scale == k_scale, "v_scale: v_cache is a view of k_cache's "
                    "rows, which hold K / k_scale: V's scale is k_scale (", format_g(k_scale), "); give "
                    "v_scale=None or k_scale, got ", format_g(v_scale));
  TORCH_CHECK_VALUE(Dk == D, "k_cache: head dim ", Dk, " differs from q head dim ", D);
  TORCH_CHECK_VALUE(Hkv >= 1 && D >= 1, "k_cache: needs at least one KV head and a head dim >= 1, got shape ",
                    shape_str(k_cache.sizes()));
  TORCH_CHECK_VALUE(Dv >= 1 && Dv <= D, "v_cache: head dim ", Dv, " must be in [1, ", D, "] (at most K's, as "
                    "MLA's V, the first channels of its latent rows)");
  TORCH_CHECK_VALUE(Hkv > 0 && Hq % Hkv == 0, "q: ", Hq, " query heads is not a multiple of the ", Hkv, " KV heads");
  check_cache_lens(cache_lens, B, device);
  check_block_table(block_table, B, device);
  check_tensor("tree_mask", tree_mask, packed ? 2 : 3, kInt32, &device);
  const int64_t words = (T + 31) / 32;
  check_shape("tree_mask", tree_mask, packed ? std::vector<int64_t>{q.size(0), words} : std::vector<int64_t>{B, T, words});
  Tensor nn = normalize_num_nodes(num_nodes, B, device);
  // (scale: any finite float; the Python TypeErrors for non-numbers cannot happen here)
  TORCH_CHECK_VALUE(std::isfinite(scale), "scale: must be a finite number, got ", format_g(scale));
  TORCH_CHECK_VALUE(window_left == -1 || window_left >= T - 1, "window_left: must be -1 (no window) or >= T - 1 = ",
                    T - 1, " (a node always sees its ancestors), got ", window_left);
  TORCH_CHECK_VALUE(std::isfinite(logits_soft_cap) && logits_soft_cap >= 0,
                    "logits_soft_cap: must be a finite number >= 0 (0 = no cap), got ", format_g(logits_soft_cap));
  if (sinks.has_value()) {  // one logit per query head
    check_tensor("sinks", *sinks, 1, {ScalarType::Float}, &device);
    check_shape("sinks", *sinks, {Hq});
  }

  if (sinks.has_value()) {  // (the value checks from here on)
    const Tensor logits = sinks->contiguous();
    const float* s = logits.const_data_ptr<float>();
    for (int64_t h = 0; h < Hq; ++h) {
      TORCH_CHECK_VALUE(!std::isnan(s[h]) && s[h] != std::numeric_limits<float>::infinity(),
                        "sinks: every entry must be a finite logit or -inf (no sink), got NaN or +inf");
    }
  }
  check_num_nodes_range(nn, T);
  // the committed prefix is read from position 0, or from the window's first position
  check_positions(
      k_cache.sizes(), cache_lens, block_table, [T](int64_t) { return T; },
      [window_left](int64_t L) { return window_left >= 0 ? std::max<int64_t>(0, L - window_left) : 0; },
      "the T new tokens");
  const Tensor mask_rows = tree_mask.contiguous();
  const int32_t* mask = mask_rows.data_ptr<int32_t>();
  const int32_t* n = nn.data_ptr<int32_t>();
  std::vector<int64_t> first_row(B);
  const Tensor offsets = packed ? row_offsets->to(at::kLong).contiguous() : Tensor();  // (a view: read by index)
  for (int64_t b = 0; b < B; ++b) {
    first_row[b] = packed ? offsets.data_ptr<int64_t>()[b] : b * T;
    TORCH_CHECK_VALUE(!packed || (first_row[b] >= 0 && first_row[b] + n[b] <= q.size(0)), "row_offsets: request "
                      "b's rows row_offsets[b] .. + num_nodes[b] - 1 must be in [0, ", q.size(0), ")");
  }
  auto bit = [&](int64_t b, int64_t i, int64_t j) {
    return (static_cast<uint32_t>(mask[(first_row[b] + i) * words + j / 32]) >> (j % 32)) & 1u;
  };
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < n[b]; ++i) {
      TORCH_CHECK_VALUE(bit(b, i, i), "tree_mask: every real node must have its own bit set");
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < n[b]; ++i) {
      for (int64_t j = i + 1; j < T; ++j) {
        TORCH_CHECK_VALUE(!bit(b, i, j), "tree_mask: node i may only see nodes j <= i (ancestors and itself)");
      }
    }
  }
  return nn;
}

AcceptInputs check_accept(const Tensor& target_logits, const Tensor& tokens, const Tensor& parents,
                          const std::optional<Tensor>& draft_logits, const Tensor& temperature, const Tensor& seeds,
                          const Tensor& num_nodes, int64_t offset, const std::optional<Tensor>& offsets,
                          const std::optional<Tensor>& top_k, const std::optional<Tensor>& top_p,
                          const std::optional<Tensor>& min_p, const std::optional<Tensor>& token_bitmask,
                          c10::string_view method, bool probs, const std::optional<Tensor>& row_offsets,
                          const std::optional<Tensor>& repetition_penalty,
                          const std::optional<Tensor>& frequency_penalty, const std::optional<Tensor>& presence_penalty,
                          const std::optional<Tensor>& output_token_counts,
                          const std::optional<Tensor>& prompt_token_mask, const std::optional<Tensor>& logit_bias_ids,
                          const std::optional<Tensor>& logit_bias_values, const std::optional<Tensor>& min_tokens,
                          const std::optional<Tensor>& stop_token_ids, c10::string_view filter_order,
                          int64_t return_logprobs, c10::string_view logprobs_mode) {
  const char* target_name = probs ? "target_probs" : "target_logits";
  const char* draft_name = probs ? "draft_probs" : "draft_logits";
  // _validation.check_method
  TORCH_CHECK_VALUE(method == "token" || method == "block" || method == "traversal",
                    "method: expected one of ('token', 'block', 'traversal'), got '", std::string(method), "'");
  TORCH_CHECK_VALUE(method == "token" || draft_logits.has_value(), "method: '", std::string(method), "' needs ",
                    draft_name, " (the drafter's laws); given proposals verify with method='token'");
  // packed rows (N, V) when row_offsets is given: node i of request b is row row_offsets[b] + i
  const bool packed = row_offsets.has_value();
  check_tensor(target_name, target_logits, packed ? 2 : 3, kFloat);
  const c10::Device device = target_logits.device();
  check_tensor("tokens", tokens, 2, kInt, &device);
  // (padded: the shapes follow target_logits; packed: the nodes' (B, T) follow tokens)
  const int64_t B = packed ? tokens.size(0) : target_logits.size(0);
  const int64_t T = packed ? tokens.size(1) : target_logits.size(1), V = target_logits.size(-1);
  TORCH_CHECK_VALUE(V >= 1, target_name, ": needs a vocabulary of at least one token, got shape ",
                    shape_str(target_logits.sizes()));
  std::vector<int64_t> rows_shape = packed ? std::vector<int64_t>{target_logits.size(0)} : std::vector<int64_t>{B, T};
  auto with_last = [&](int64_t last) {
    std::vector<int64_t> shape = rows_shape;
    shape.push_back(last);
    return shape;
  };
  check_shape("tokens", tokens, {B, T});
  check_tensor("parents", parents, 2, kInt, &device);
  check_shape("parents", parents, {B, T});
  if (draft_logits.has_value()) {
    check_tensor(draft_name, *draft_logits, packed ? 2 : 3, kFloat, &device);
    check_shape(draft_name, *draft_logits, with_last(V));
  }
  if (packed) {
    check_tensor("row_offsets", *row_offsets, 1, kInt, &device);
    check_shape("row_offsets", *row_offsets, {B});
  }
  AcceptInputs in;
  in.num_nodes = normalize_num_nodes(num_nodes, B, device);
  if (T >= 1) check_num_nodes_range(in.num_nodes, T);  // first: the per-node checks below read the slots it names
  check_tensor("temperature", temperature, 1, kFloat, &device);
  check_shape("temperature", temperature, {B});
  in.temperature = temperature.to(at::kFloat).contiguous();
  check_tensor("seeds", seeds, 1, kInt, &device);
  check_shape("seeds", seeds, {B});
  in.seeds = seeds.to(at::kLong).contiguous();
  TORCH_CHECK_TYPE(offset >= 0, "offset: expected a non-negative int or a (B,) int tensor");
  TORCH_CHECK_VALUE(offset < kMaxOffset, "offset: must be < 2**60, got ", offset);
  if (offsets.has_value()) {
    check_tensor("offset", *offsets, 1, kInt, &device);
    check_shape("offset", *offsets, {B});
    in.offsets = offsets->to(at::kLong).contiguous();
  } else {
    in.offsets = at::zeros({B}, target_logits.options().dtype(at::kLong));
  }
  Tensor top_k_values;  // int64, as given (the clamped int32 copy is what the kernel reads)
  if (top_k.has_value()) {
    check_tensor("top_k", *top_k, 1, kInt, &device);
    check_shape("top_k", *top_k, {B});
    top_k_values = top_k->to(at::kLong).contiguous();
    in.top_k = top_k_values.clamp(-1, V).to(at::kInt).contiguous();
  }
  for (const auto& [name, x, out] : {std::tuple<const char*, const std::optional<Tensor>&, Tensor&>{"top_p", top_p, in.top_p},
                                     {"min_p", min_p, in.min_p}}) {
    if (!x.has_value()) continue;
    check_tensor(name, *x, 1, kFloat, &device);
    check_shape(name, *x, {B});
    // checked as given, then narrowed so that valid values stay valid (_validation.to_float32_fraction)
    const bool is_top_p = std::string(name) == "top_p";
    const Tensor given = x->to(at::kDouble).contiguous();
    const double* p = given.data_ptr<double>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK_VALUE(is_top_p ? (p[b] > 0 && p[b] <= 1) : (p[b] >= 0 && p[b] < 1), name,
                        is_top_p ? ": must be in (0, 1] (1: off)" : ": must be in [0, 1) (0: off)");
    }
    const double tiny = std::numeric_limits<float>::denorm_min(), below_one = 1.0 - std::ldexp(1.0, -24);
    out = (is_top_p ? given.clamp_min(tiny) : given.clamp_max(below_one)).to(at::kFloat).contiguous();
  }
  if (token_bitmask.has_value()) {
    check_tensor("token_bitmask", *token_bitmask, packed ? 2 : 3, {}, &device);
    TORCH_CHECK_VALUE(token_bitmask->scalar_type() == ScalarType::Int, "token_bitmask: dtype ",
                      dtype_name(token_bitmask->scalar_type()), " not supported (expected int32)");
    check_shape("token_bitmask", *token_bitmask, with_last((V + 31) / 32));
    in.token_bitmask = token_bitmask->contiguous();
  }
  const int64_t* off = in.offsets.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(off[b] >= 0 && off[b] < kMaxOffset - offset, "offset: must be in [0, 2**60)");
  }
  in.parents = int32_contiguous("parents", parents, in.num_nodes);
  check_parents(in.parents, in.num_nodes);
  if (packed) {
    in.row_offsets = row_offsets->to(at::kLong).contiguous();
    const int64_t* ro = in.row_offsets.data_ptr<int64_t>();
    const int32_t* n = in.num_nodes.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK_VALUE(ro[b] >= 0 && ro[b] + n[b] <= rows_shape[0], "row_offsets: request b's rows row_offsets[b] .. "
                        "+ num_nodes[b] - 1 must be in [0, ", rows_shape[0], ")");
    }
  } else {
    in.row_offsets = at::empty({B}, target_logits.options().dtype(at::kLong));
    int64_t* ro = in.row_offsets.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) ro[b] = b * T;
  }
  in.block = method == "block";
  in.traversal = method == "traversal";
  if (in.block) {
    const int32_t* par = in.parents.data_ptr<int32_t>();
    const int32_t* n = in.num_nodes.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 1; i < n[b]; ++i) {
        TORCH_CHECK_VALUE(par[b * T + i] == i - 1, "method: 'block' verifies chains only (parents[b, i] = i - 1)");
      }
    }
  }

  in.tokens = int32_contiguous("tokens", tokens, in.num_nodes);
  const int32_t* tok = in.tokens.data_ptr<int32_t>();
  const int32_t* nn = in.num_nodes.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 1; i < nn[b]; ++i) {
      TORCH_CHECK_VALUE(tok[b * T + i] >= 0 && tok[b * T + i] < V, "tokens: draft tokens must be in [0, ", V, ")");
    }
  }
  const float* temp = in.temperature.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(std::isfinite(temp[b]) && temp[b] >= 0, "temperature: must be finite and >= 0");
  }
  if (top_k_values.defined()) {
    const int64_t* k = top_k_values.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK_VALUE(k[b] >= 0, "top_k: must be >= 0 (0 or >= V: off)");
  }
  if (in.token_bitmask.defined()) {  // every real node's row allows some token of [0, V)
    const int64_t W = (V + 31) / 32;
    const uint32_t last = V % 32 == 0 ? ~0u : (1u << (V % 32)) - 1;
    const int32_t* words = in.token_bitmask.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < nn[b]; ++i) {
        const int32_t* row = words + (in.row_offsets.data_ptr<int64_t>()[b] + i) * W;
        bool any = false;
        for (int64_t w = 0; w < W && !any; ++w) any = (static_cast<uint32_t>(row[w]) & (w == W - 1 ? last : ~0u)) != 0;
        TORCH_CHECK_VALUE(any, "token_bitmask: a real node's row allows no token");
      }
    }
  }
  check_sampling_params(in, B, V, device, repetition_penalty, frequency_penalty, presence_penalty, output_token_counts,
                        prompt_token_mask, logit_bias_ids, logit_bias_values, min_tokens, stop_token_ids, filter_order,
                        return_logprobs, logprobs_mode);
  return in;
}

void check_logit_rows(const char* name, const Tensor& row_nan, const Tensor& row_posinf, const Tensor& row_max,
                      const Tensor& num_nodes, const Tensor& masked_empty, bool probs, const Tensor& stopped_empty) {
  const bool packed = row_max.dim() == 1;  // packed rows: every one is a node's
  const int64_t B = packed ? 1 : row_max.size(0), T = packed ? row_max.size(0) : row_max.size(1);
  const bool* nan = row_nan.data_ptr<bool>();
  const bool* posinf = row_posinf.data_ptr<bool>();
  const int32_t* nn = num_nodes.data_ptr<int32_t>();
  for (int64_t r = 0; r < B * T; ++r) TORCH_CHECK_VALUE(!nan[r], name, ": contains NaN");
  for (int64_t r = 0; r < B * T; ++r) TORCH_CHECK_VALUE(!posinf[r], name, ": contains +inf");
  const double* mx = row_max.data_ptr<double>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < (packed ? T : nn[b]); ++i) {
      TORCH_CHECK_VALUE(mx[b * T + i] != -INFINITY, name, probs ? ": a real node's row is all zeros"
                                                            : ": a real node's row is entirely -inf");
    }
  }
  if (masked_empty.defined()) {
    const bool* empty = masked_empty.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < (packed ? T : nn[b]); ++i) {
        TORCH_CHECK_VALUE(!empty[b * T + i], name, ": a real node's row is ", probs ? "0" : "-inf",
                          " on every token token_bitmask allows");
      }
    }
  }
  if (stopped_empty.defined()) {  // (_validation.check_rows_after_min_tokens; only real rows are ever flagged)
    const bool* empty = stopped_empty.data_ptr<bool>();
    for (int64_t r = 0; r < B * T; ++r) {
      TORCH_CHECK_VALUE(!empty[r], "min_tokens: masks every possible token of a real node's row (its stop tokens "
                        "and the grammar mask leave none)");
    }
  }
}

void check_kv_append(const Tensor& k_cache, const Tensor& v_cache, const Tensor& k_new, const Tensor& v_new,
                     const Tensor& cache_lens, const std::optional<Tensor>& block_table, double k_scale,
                     double v_scale) {
  check_tensor("k_new", k_new, 4, kFloat);
  const int64_t B = k_new.size(0), T = k_new.size(1), Hkv = k_new.size(2), D = k_new.size(3);
  const c10::Device device = k_new.device();
  // v_cache and v_new undefined: a single-cache layer (MLA's latent cache)
  TORCH_CHECK_TYPE(v_new.defined() || !v_cache.defined(),
                   "v_new: required with v_cache (a single-cache layer passes v_cache=None, v_new=None)");
  TORCH_CHECK_TYPE(v_cache.defined() || !v_new.defined(),
                   "v_new: given without v_cache (a single-cache layer has neither)");
  if (v_new.defined()) {
    check_tensor("v_new", v_new, -1, {}, &device);
    check_shape("v_new", v_new, k_new.sizes());
  }
  check_tensor("k_cache", k_cache, 4, {}, &device);
  check_cache_pair(k_cache, v_cache, block_table, B);
  const int64_t Hc = k_cache.size(-2), Dc = k_cache.size(-1);
  TORCH_CHECK_VALUE(Hc == Hkv && Dc == D, "k_new: (Hkv, D) = (", Hkv, ", ", D, ") differs from the cache's (", Hc,
                    ", ", Dc, ")");
  if (v_new.defined()) check_tensor("v_new", v_new, -1, kFloat);
  for (const auto& [name, x] : {std::pair<const char*, const Tensor&>{"k_new", k_new}, {"v_new", v_new}}) {
    if (!x.defined()) continue;
    TORCH_CHECK_TYPE(x.scalar_type() == k_cache.scalar_type() || is_float8(k_cache.scalar_type()), name,
                     ": dtype torch.", dtype_name(x.scalar_type()), " differs from cache dtype torch.",
                     dtype_name(k_cache.scalar_type()));
  }
  check_scales(k_cache.scalar_type(), k_scale, v_scale);
  check_cache_lens(cache_lens, B, device);
  check_block_table(block_table, B, device);
  check_positions(k_cache.sizes(), cache_lens, block_table, [T](int64_t) { return T; },
                  [](int64_t L) { return L; }, "the T new tokens");  // the new rows are written from L on
}

PathInputs check_kv_rollback(at::TensorList k_caches, at::TensorList v_caches, const Tensor& cache_lens,
                             const Tensor& accepted_nodes, const Tensor& num_accepted,
                             const std::optional<Tensor>& block_table) {
  TORCH_CHECK_TYPE(!k_caches.empty(), "k_cache: expected a tensor or a non-empty list of tensors");
  // no v_caches: single-cache layers (MLA's latent caches)
  TORCH_CHECK_VALUE(v_caches.empty() || k_caches.size() == v_caches.size(), "v_cache: ", v_caches.size(),
                    " layer tensors but k_cache has ", k_caches.size());
  check_tensor("cache_lens", cache_lens, 1, kInt32);
  const int64_t B = cache_lens.size(0);
  const c10::Device device = cache_lens.device();
  for (size_t i = 0; i < k_caches.size(); ++i) {
    const std::string suffix = k_caches.size() == 1 ? "" : "[" + std::to_string(i) + "]";
    const Tensor &k = k_caches[i], &v = v_caches.empty() ? Tensor() : v_caches[i];
    check_tensor("k_cache" + suffix, k, -1, {}, &device);
    check_cache_pair(k, v, block_table, B, "k_cache" + suffix, "v_cache" + suffix);
    const auto first = k_caches[0].sizes(), sizes = k.sizes();
    const bool same_layer = sizes.slice(sizes.size() - 4) == first.slice(first.size() - 4);
    TORCH_CHECK_VALUE(same_layer && k.scalar_type() == k_caches[0].scalar_type(), "k_cache", suffix,
                      ": every layer must share the first layer's shape and dtype");
  }
  // memory shared by two caches or two elements of one would have its rows moved twice (_validation)
  std::vector<std::pair<std::string, Tensor>> caches;
  for (const auto& [name, list] :
       {std::pair<const char*, at::TensorList>{"k_cache", k_caches}, {"v_cache", v_caches}}) {
    for (size_t i = 0; i < list.size(); ++i) {
      caches.emplace_back(name + (list.size() == 1 ? std::string() : "[" + std::to_string(i) + "]"), list[i]);
    }
  }
  for (const auto& [name, c] : caches) {
    TORCH_CHECK_VALUE(!self_overlapping(c), name, ": its elements overlap (a stride-0 or overlapping view); every "
                      "row must be memory of its own");
  }
  for (size_t j = 1; j < caches.size(); ++j) {
    for (size_t i = 0; i < j; ++i) {
      TORCH_CHECK_VALUE(!shares_memory(caches[i].second, caches[j].second), caches[j].first, ": shares memory with ",
                        caches[i].first, "; every K and V layer must be memory of its own");
    }
  }
  check_tensor("accepted_nodes", accepted_nodes, 2, kInt, &device);
  TORCH_CHECK_VALUE(accepted_nodes.size(0) == B, "accepted_nodes: expected ", B, " rows, got shape ",
                    shape_str(accepted_nodes.sizes()));
  check_tensor("num_accepted", num_accepted, 1, kInt, &device);
  check_shape("num_accepted", num_accepted, {B});
  check_block_table(block_table, B, device);

  PathInputs in{int32_contiguous("accepted_nodes", accepted_nodes), int32_contiguous("num_accepted", num_accepted)};
  const int64_t P = accepted_nodes.size(1);
  const int32_t* path = in.accepted_nodes.data_ptr<int32_t>();
  const int32_t* na = in.num_accepted.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(na[b] >= 0 && na[b] < P, "num_accepted: every entry must be in [0, ", P - 1, "]");
  }
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(path[b * P] == 0, "accepted_nodes: every path must start at node 0 (the root)");
  }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 1; i <= na[b]; ++i) {
      TORCH_CHECK_VALUE(path[b * P + i] > path[b * P + i - 1], "accepted_nodes: the accepted path must be strictly increasing");
    }
  }
  // rows from cache_lens to cache_lens + path[num_accepted] (the furthest row read) are touched
  check_positions(k_caches[0].sizes(), cache_lens, block_table,
                  [&](int64_t b) { return static_cast<int64_t>(path[b * P + na[b]]) + 1; },
                  [](int64_t L) { return L; }, "the tree rows");
  return in;
}

}  // namespace specdec
