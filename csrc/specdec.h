// Shared by the C++ CPU ops (csrc/*.cpp): SIMD selection, cache row addressing, float conversion, and
// the declarations of the input checks (validation.cpp).
#pragma once

// at::vec::Vectorized picks its implementation from CPU_CAPABILITY_* macros that ATen's own build passes
// per kernel file; an extension gets the generic scalar-array fallback unless it sets them. setup.py
// compiles for the build machine (-march=native), so map what the compiler may use to the widest
// implementation. Our own namespace names keep these instantiations apart from libtorch's.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY specdec_avx512
#define SPECDEC_VEC_REGISTERS 32
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY specdec_avx2
#define SPECDEC_VEC_REGISTERS 16
#else
#define CPU_CAPABILITY specdec_default
#define SPECDEC_VEC_REGISTERS 16
#endif

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <type_traits>

namespace specdec {

using at::Tensor;
using at::vec::Vectorized;

// The float8 KV cache dtypes (_layout.FP8_DTYPES): such a cache holds x / scale (per-tensor scales).
inline bool is_float8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// fp16/bf16/fp32 (and float8) compute in fp32; fp64 in fp64.
template <typename scalar_t>
using acc_type_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Calls vec_fn(Vectorized<acc_t> x, i) for the row's full vectors (converted to acc_t = acc_type_t<scalar_t>),
// starting at element i, then scalar_fn(acc_t x, i) for the tail. float8 rows have no vector conversion: they
// go element by element through scalar_fn.
template <typename scalar_t, typename VecFn, typename ScalarFn>
inline void for_each_vec(const scalar_t* row, int64_t n, VecFn&& vec_fn, ScalarFn&& scalar_fn) {
  using acc_t = acc_type_t<scalar_t>;
  constexpr int64_t AS = Vectorized<acc_t>::size();
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    for (; i + AS <= n; i += AS) vec_fn(Vectorized<acc_t>::loadu(row + i), i);
  } else if constexpr (std::is_same_v<scalar_t, at::Half> || std::is_same_v<scalar_t, at::BFloat16>) {
    using SVec = Vectorized<scalar_t>;
    for (; i + SVec::size() <= n; i += SVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(SVec::loadu(row + i));
      vec_fn(lo, i);
      vec_fn(hi, i + AS);
    }
  }
  for (; i < n; ++i) scalar_fn(static_cast<acc_t>(row[i]), i);
}

// dst[0:n] = src[0:n] converted to acc_t: src's accumulation type by default; a float8 cache row is loaded
// into its queries' type, fp64 for fp64 queries (exact: float8 values are floats).
template <typename scalar_t, typename acc_t = acc_type_t<scalar_t>>
inline void load_row(const scalar_t* src, acc_t* dst, int64_t n) {
  for_each_vec(src, n, [&](const auto& x, int64_t i) { x.store(dst + i); },
               [&](auto x, int64_t i) { dst[i] = static_cast<acc_t>(x); });
}

// Addresses row `pos` of request b in a K/V cache (one layer): contiguous (B, L_max, H, D) when there is
// no block table, else paged (num_blocks, block_size, H, D) through table[b, pos / block_size].
// Strides are in elements: heads are `head_stride` apart, a head's D values `elem_stride` apart.
template <typename T>
struct CacheRows {
  T* data;
  int64_t stride0, stride1, head_stride, elem_stride;
  const int32_t* table = nullptr;
  int64_t table_stride0 = 0, table_stride1 = 0, block_size = 1;

  CacheRows(T* data_, const Tensor& cache, const std::optional<Tensor>& block_table)
      : data(data_), stride0(cache.stride(-4)), stride1(cache.stride(-3)), head_stride(cache.stride(-2)),
        elem_stride(cache.stride(-1)) {
    if (block_table.has_value()) {
      table = block_table->data_ptr<int32_t>();
      table_stride0 = block_table->stride(0);
      table_stride1 = block_table->stride(1);
      block_size = cache.size(-3);
    }
  }
  T* operator()(int64_t b, int64_t pos) const {
    if (table == nullptr) return data + b * stride0 + pos * stride1;
    int64_t block = table[b * table_stride0 + (pos / block_size) * table_stride1];
    return data + block * stride0 + (pos % block_size) * stride1;
  }
};

// Copies one cache row of H heads x D elements between strided places (one memcpy when both are dense).
template <typename T>
inline void copy_row(T* dst, int64_t dst_head_stride, int64_t dst_elem_stride, const T* src,
                     int64_t src_head_stride, int64_t src_elem_stride, int64_t H, int64_t D) {
  if (dst_elem_stride == 1 && src_elem_stride == 1) {
    if (dst_head_stride == D && src_head_stride == D) {
      std::memcpy(dst, src, H * D * sizeof(T));
      return;
    }
    for (int64_t h = 0; h < H; ++h) std::memcpy(dst + h * dst_head_stride, src + h * src_head_stride, D * sizeof(T));
    return;
  }
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t d = 0; d < D; ++d) dst[h * dst_head_stride + d * dst_elem_stride] = src[h * src_head_stride + d * src_elem_stride];
  }
}

// Calls f(T{}) with an unsigned integer type T of the given byte size: copies need only the element size.
template <typename F>
inline void dispatch_by_element_size(int64_t size, F&& f) {
  switch (size) {
    case 1: return f(uint8_t{});
    case 2: return f(uint16_t{});
    case 4: return f(uint32_t{});
    case 8: return f(uint64_t{});
    default: TORCH_CHECK(false, "specdec: unsupported element size ", size);
  }
}

// ------------------------------------------------------------------------------------------------
// Input checks (validation.cpp): the same errors, types and messages as specdec/_validation.py, so a
// C++ caller that bypasses Python gets the same guarantees. Each runs before anything is written.
// The index-like inputs are returned as contiguous int32 tensors.
// ------------------------------------------------------------------------------------------------
struct TreeInputs {
  Tensor parents, num_nodes;
};
TreeInputs check_build_tree(const Tensor& parents, const Tensor& num_nodes);

Tensor check_tree_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                            const Tensor& cache_lens, const Tensor& tree_mask,
                            const std::optional<Tensor>& block_table, const Tensor& num_nodes, double scale,
                            double k_scale, double v_scale, int64_t window_left, double logits_soft_cap,
                            const std::optional<Tensor>& row_offsets, int64_t max_nodes,
                            const std::optional<Tensor>& sinks);

// accept's filter_order: which set top-p normalizes over (specdec.sampling; the kept set is top-k ∩ top-p ∩ min-p)
enum class FilterOrder {
  kHf,      // "hf": the top-k set (Hugging Face's warpers: top-k, top-p, min-p)
  kVllm,    // "vllm": the min-p ∩ top-k set (vLLM's sampler: min-p first)
  kSglang,  // "sglang": every allowed token (SGLang's joint top-k / top-p)
};

struct AcceptInputs {
  Tensor tokens, parents, num_nodes, temperature, seeds;
  Tensor offsets;  // (B,) int64: request b's random-stream offset, offset + offsets[b] (offsets: 0 if absent)
  // the filters, undefined when absent: top_k (B,) int32 clamped to [-1, V], top_p / min_p (B,) float32,
  // token_bitmask (B, T, ceil(V/32)) int32, all contiguous
  Tensor top_k, top_p, min_p, token_bitmask;
  bool block = false;  // method "block": block verification of chains
  bool traversal = false;  // method "traversal": traversal verification of trees (neither: "token")
  Tensor row_offsets;  // (B,) int64: node i of request b is row row_offsets[b] + i (padded: b * T)
  // step 0 (in vLLM's order: the logit bias, min-tokens' stop tokens, the penalties), each undefined when absent,
  // all contiguous and per request: repetition / frequency / presence penalty (B,) float32; output_token_counts
  // (B, V) int32 (defined with any penalty or min_tokens); prompt_token_mask (B, ceil(V/32)) int32 (defined with
  // the repetition penalty); logit_bias_ids (B, K) int32 (-1: padding) with logit_bias_values (B, K) float32;
  // min_tokens (B,) int32 with stop_token_ids (B, S) int32 (-1: padding)
  Tensor repetition_penalty, frequency_penalty, presence_penalty, output_token_counts, prompt_token_mask,
      logit_bias_ids, logit_bias_values, min_tokens, stop_token_ids;
  FilterOrder filter_order = FilterOrder::kHf;
  int64_t return_logprobs = -1;  // -1: off; else the number N (0..20) of top logprobs per emitted position
  bool processed_logprobs = false;  // logprobs_mode "processed" (else "raw")
  // whether any request has step 0 on (else every row is used as given)
  bool step0() const {
    return repetition_penalty.defined() || frequency_penalty.defined() || presence_penalty.defined() ||
           logit_bias_ids.defined() || min_tokens.defined();
  }
};
constexpr int64_t kMaxOffset = int64_t{1} << 60;  // _validation.MAX_OFFSET
constexpr int64_t kMaxLogprobs = 20;              // _validation.MAX_LOGPROBS: return_logprobs <= 20
AcceptInputs check_accept(const Tensor& target_logits, const Tensor& tokens, const Tensor& parents,
                          const std::optional<Tensor>& draft_logits, const Tensor& temperature,
                          const Tensor& seeds, const Tensor& num_nodes, int64_t offset,
                          const std::optional<Tensor>& offsets, const std::optional<Tensor>& top_k,
                          const std::optional<Tensor>& top_p, const std::optional<Tensor>& min_p,
                          const std::optional<Tensor>& token_bitmask, c10::string_view method, bool probs,
                          const std::optional<Tensor>& row_offsets, const std::optional<Tensor>& repetition_penalty,
                          const std::optional<Tensor>& frequency_penalty, const std::optional<Tensor>& presence_penalty,
                          const std::optional<Tensor>& output_token_counts,
                          const std::optional<Tensor>& prompt_token_mask, const std::optional<Tensor>& logit_bias_ids,
                          const std::optional<Tensor>& logit_bias_values, const std::optional<Tensor>& min_tokens,
                          const std::optional<Tensor>& stop_token_ids, c10::string_view filter_order,
                          int64_t return_logprobs, c10::string_view logprobs_mode);
// Per-row flags of a logits tensor, computed by the accept kernel's first pass; raises the errors of
// _validation.check_accept ("contains NaN", "contains +inf", "a real node's row is entirely -inf", and with a
// bitmask (masked_empty defined, (B, T) bool) "a real node's row is -inf on every token token_bitmask allows").
// probs: the rows are log-probabilities taken of probabilities (accept's probs=True), and the empty rows' errors
// say so ("all zeros", "0 on every token ..."). stopped_empty (defined with min_tokens, (B, T) bool, set for real
// rows only): the rows that min-tokens' stop tokens and the bitmask leave without a finite value ("min_tokens: ...").
void check_logit_rows(const char* name, const Tensor& row_nan, const Tensor& row_posinf,
                      const Tensor& row_max, const Tensor& num_nodes, const Tensor& masked_empty, bool probs = false,
                      const Tensor& stopped_empty = Tensor());

void check_kv_append(const Tensor& k_cache, const Tensor& v_cache, const Tensor& k_new, const Tensor& v_new,
                     const Tensor& cache_lens, const std::optional<Tensor>& block_table, double k_scale,
                     double v_scale);

struct PathInputs {
  Tensor accepted_nodes, num_accepted;
};
PathInputs check_kv_rollback(at::TensorList k_caches, at::TensorList v_caches, const Tensor& cache_lens,
                             const Tensor& accepted_nodes, const Tensor& num_accepted,
                             const std::optional<Tensor>& block_table);

}  // namespace specdec
