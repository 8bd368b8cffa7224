// kv_append: write the T new tokens' K/V of one layer at logical positions cache_lens[b] + i (in place).
//
//   k_cache, v_cache (B, L_max, Hkv, D) contiguous or (num_blocks, block_size, Hkv, D) paged, any float dtype
//   k_new, v_new     (B, T, Hkv, D), the caches' dtype
//   cache_lens       (B,) int32 (not changed)
//   block_table      (B, max_blocks) int32 or None
//
// Pure data movement: rows are copied as raw elements of the dtype's size, in parallel over (b, i).
#include "specdec.h"

namespace specdec {
namespace {

template <typename T>
void append_rows(const Tensor& cache, const Tensor& src, const Tensor& cache_lens,
                 const std::optional<Tensor>& block_table) {
  const int64_t B = src.size(0), T_new = src.size(1), H = src.size(2), D = src.size(3);
  const CacheRows<T> rows(static_cast<T*>(cache.data_ptr()), cache, block_table);
  const T* in = static_cast<const T*>(src.data_ptr());
  auto lens = cache_lens.accessor<int32_t, 1>();
  const int64_t grain = std::max<int64_t>(1, 65536 / (H * D * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, B * T_new, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / T_new, i = r % T_new;
      copy_row(rows(b, lens[b] + i), rows.head_stride, rows.elem_stride, in + b * src.stride(0) + i * src.stride(1),
               src.stride(2), src.stride(3), H, D);
    }
  });
}

void kv_append_cpu(const Tensor& k_cache, const Tensor& v_cache, const Tensor& k_new, const Tensor& v_new,
                   const Tensor& cache_lens, const std::optional<Tensor>& block_table) {
  check_kv_append(k_cache, v_cache, k_new, v_new, cache_lens, block_table);
  dispatch_by_element_size(k_cache.element_size(), [&](auto type_tag) {
    using T = decltype(type_tag);
    append_rows<T>(k_cache, k_new, cache_lens, block_table);
    append_rows<T>(v_cache, v_new, cache_lens, block_table);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("kv_append", &kv_append_cpu); }

}  // namespace specdec
