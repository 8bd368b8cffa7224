// kv_rollback: keep only the accepted path's K/V rows, for every layer given, then advance cache_lens.
//
//   k_caches, v_caches  lists of tensors, each one layer (4-D) or a stack of layers (5-D, leading layer
//                       dim); v_caches empty for single-cache layers (MLA's latent caches); every layer
//                       (B, L_max, Hkv, D) contiguous or (num_blocks, block_size, Hkv, D)
//                       paged, all with the same layer shape and dtype (any float dtype or float8: rows are
//                       moved as raw elements, so a float8 cache's scales play no part)
//   cache_lens          (B,) int32, += num_accepted + 1 after all moves (in place)
//   accepted_nodes      (B, P) int32/int64, strictly increasing from 0 on the path
//   num_accepted        (B,) int32/int64
//   block_table         (B, max_blocks) int32 or None
//
// For every layer and request: row L + path[i] moves to L + i for i = 1..num_accepted in ascending i
// (L = cache_lens[b]). Ascending order is what makes overlapping moves (path [0, 2, 3]: 2 -> 1, 3 -> 2)
// correct: a later source L + path[j] > L + path[i] >= L + i is never a row already written. The path's
// leading run with path[i] == i stays in place and is not touched. Layers x requests run in parallel.
#include "specdec.h"

#include <vector>

namespace specdec {
namespace {

template <typename T>
void rollback_rows(at::TensorList k_caches, at::TensorList v_caches, const Tensor& cache_lens, const int32_t* path,
                   int64_t P, const int32_t* num_accepted, const std::optional<Tensor>& block_table) {
  std::vector<CacheRows<T>> layers;
  for (at::TensorList caches : {k_caches, v_caches}) {
    for (const Tensor& cache : caches) {
      T* base = static_cast<T*>(cache.data_ptr());
      const int64_t count = cache.dim() == 5 ? cache.size(0) : 1, layer_stride = cache.dim() == 5 ? cache.stride(0) : 0;
      for (int64_t l = 0; l < count; ++l) layers.emplace_back(base + l * layer_stride, cache, block_table);
    }
  }
  const int64_t B = cache_lens.size(0), H = k_caches[0].size(-2), D = k_caches[0].size(-1);
  auto lens = cache_lens.accessor<int32_t, 1>();
  // first node of each path that actually moves (path[i] != i): everything before it stays
  std::vector<int64_t> first_move(B);
  int64_t moves = 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t i = 0;
    while (i <= num_accepted[b] && path[b * P + i] == i) ++i;
    first_move[b] = i;
    moves += num_accepted[b] + 1 - i;
  }
  if (moves > 0) {
    const int64_t items = static_cast<int64_t>(layers.size()) * B;
    const int64_t bytes_per_item = std::max<int64_t>(1, moves * H * D * static_cast<int64_t>(sizeof(T)) / B);
    at::parallel_for(0, items, std::max<int64_t>(1, 65536 / bytes_per_item), [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const CacheRows<T>& rows = layers[item / B];
        const int64_t b = item % B, L = lens[b];
        for (int64_t i = first_move[b]; i <= num_accepted[b]; ++i) {
          copy_row(rows(b, L + i), rows.head_stride, rows.elem_stride, rows(b, L + path[b * P + i]), rows.head_stride,
                   rows.elem_stride, H, D);
        }
      }
    });
  }
  for (int64_t b = 0; b < B; ++b) lens[b] += num_accepted[b] + 1;
}

void kv_rollback_cpu(at::TensorList k_caches, at::TensorList v_caches, const Tensor& cache_lens,
                     const Tensor& accepted_nodes, const Tensor& num_accepted,
                     const std::optional<Tensor>& block_table) {
  auto [path, na] = check_kv_rollback(k_caches, v_caches, cache_lens, accepted_nodes, num_accepted, block_table);
  dispatch_by_element_size(k_caches[0].element_size(), [&](auto type_tag) {
    rollback_rows<decltype(type_tag)>(k_caches, v_caches, cache_lens, path.data_ptr<int32_t>(), path.size(1),
                                      na.data_ptr<int32_t>(), block_table);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("kv_rollback", &kv_rollback_cpu); }

}  // namespace specdec
