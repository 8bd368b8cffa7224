// kv_append: write the T new tokens' K/V of one layer at logical positions cache_lens[b] + i (in place).
//
//   k_cache, v_cache (B, L_max, Hkv, D) contiguous or (num_blocks, block_size, Hkv, D) paged, any float dtype
//                    or float8_e4m3fn / float8_e5m2; v_cache None for a single-cache layer (MLA's latent cache)
//   k_new, v_new     (B, T, Hkv, D), the caches' dtype; any float dtype (each its own) for a float8 cache;
//                    v_new None with v_cache
//   cache_lens       (B,) int32 (not changed)
//   block_table      (B, max_blocks) int32 or None
//   k_scale, v_scale float > 0, per-tensor scales (1 unless the cache is float8)
//
// In parallel over (b, i). A float8 cache stores reference.quantize(x, scale), bit for bit; any other
// cache gets its rows copied as raw elements of the dtype's size (pure data movement).
#include "specdec.h"

#include <limits>

namespace specdec {
namespace {

// For every new row (b, i): write(cache row at cache_lens[b] + i, its head and element strides, src row,
// its head and element strides, H, D), the signature of copy_row.
template <typename T, typename S, typename Write>
void append_rows(const Tensor& cache, const Tensor& src, const Tensor& cache_lens,
                 const std::optional<Tensor>& block_table, const Write& write) {
  const int64_t B = src.size(0), T_new = src.size(1), H = src.size(2), D = src.size(3);
  const CacheRows<T> rows(static_cast<T*>(cache.data_ptr()), cache, block_table);
  const S* in = static_cast<const S*>(src.data_ptr());
  auto lens = cache_lens.accessor<int32_t, 1>();
  const int64_t grain = std::max<int64_t>(1, 65536 / (H * D * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, B * T_new, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / T_new, i = r % T_new;
      write(rows(b, lens[b] + i), rows.head_stride, rows.elem_stride, in + b * src.stride(0) + i * src.stride(1),
            src.stride(2), src.stride(3), H, D);
    }
  });
}

// One row quantized as reference.quantize does: fp32(x) * inv (inv = fp32(1 / scale)), clamped to the
// format's finite range (NaN stays NaN), then the float8 constructor's round to nearest even.
template <typename cache_t, typename src_t>
void quantize_row(cache_t* dst, int64_t dst_head_stride, int64_t dst_elem_stride, const src_t* src,
                  int64_t src_head_stride, int64_t src_elem_stride, int64_t H, int64_t D, float inv) {
  const float max = static_cast<float>(std::numeric_limits<cache_t>::max());
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t d = 0; d < D; ++d) {
      const float y = static_cast<float>(src[h * src_head_stride + d * src_elem_stride]) * inv;
      dst[h * dst_head_stride + d * dst_elem_stride] = static_cast<cache_t>(y > max ? max : (y < -max ? -max : y));
    }
  }
}

void quantize_append(const Tensor& cache, const Tensor& src, const Tensor& cache_lens,
                     const std::optional<Tensor>& block_table, double scale) {
  const float inv = static_cast<float>(1.0 / scale);  // rounded once, from double, like the reference
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "specdec::kv_append", [&] {
    auto run = [&](auto cache_tag) {
      using cache_t = decltype(cache_tag);
      append_rows<cache_t, scalar_t>(cache, src, cache_lens, block_table,
                                     [inv](auto... args) { quantize_row(args..., inv); });
    };
    if (cache.scalar_type() == at::kFloat8_e4m3fn) {
      run(c10::Float8_e4m3fn{});
    } else {
      run(c10::Float8_e5m2{});
    }
  });
}

void kv_append_cpu(const Tensor& k_cache, const std::optional<Tensor>& v_cache_in, const Tensor& k_new,
                   const std::optional<Tensor>& v_new_in, const Tensor& cache_lens,
                   const std::optional<Tensor>& block_table, double k_scale, double v_scale) {
  // (undefined tensors: a single-cache layer)
  const Tensor v_cache = v_cache_in.value_or(Tensor()), v_new = v_new_in.value_or(Tensor());
  check_kv_append(k_cache, v_cache, k_new, v_new, cache_lens, block_table, k_scale, v_scale);
  if (is_float8(k_cache.scalar_type())) {
    quantize_append(k_cache, k_new, cache_lens, block_table, k_scale);
    if (v_cache.defined()) quantize_append(v_cache, v_new, cache_lens, block_table, v_scale);
    return;
  }
  // the new rows are in the cache's dtype and the scales are 1
  dispatch_by_element_size(k_cache.element_size(), [&](auto type_tag) {
    using T = decltype(type_tag);
    auto copy = [](auto... args) { copy_row(args...); };
    append_rows<T, T>(k_cache, k_new, cache_lens, block_table, copy);
    if (v_cache.defined()) append_rows<T, T>(v_cache, v_new, cache_lens, block_table, copy);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("kv_append", &kv_append_cpu); }

}  // namespace specdec
