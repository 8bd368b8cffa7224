// build_tree: depths and packed ancestor-or-self masks of a batch of trees.
//
//   parents   (B, T) int32/int64, parents[b, 0] == -1, 0 <= parents[b, i] < i for real nodes
//   num_nodes (B,)   int32/int64, nodes i >= num_nodes[b] are padding
// -> depth (B, T) int32 (root 0, padding 0), mask (B, T, ceil(T/32)) int32: bit j % 32 of word j / 32 of
//    mask[b, i] is set iff node j is i or an ancestor of i (padding nodes: only their own bit).
//
// Parents precede their children, so one pass in node order suffices: mask[i] = mask[parent] | bit(i).
#include "specdec.h"

namespace specdec {
namespace {

std::tuple<Tensor, Tensor> build_tree_cpu(const Tensor& parents_in, const Tensor& num_nodes_in) {
  auto [parents, num_nodes] = check_build_tree(parents_in, num_nodes_in);
  const int64_t B = parents.size(0), T = parents.size(1), W = (T + 31) / 32;
  Tensor depth = at::zeros({B, T}, parents.options().dtype(at::kInt));
  Tensor mask = at::zeros({B, T, W}, parents.options().dtype(at::kInt));
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* nn = num_nodes.data_ptr<int32_t>();
  int32_t* dep = depth.data_ptr<int32_t>();
  uint32_t* bits = reinterpret_cast<uint32_t*>(mask.data_ptr<int32_t>());
  at::parallel_for(0, B, std::max<int64_t>(1, 4096 / (T * W)), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t i = 0; i < T; ++i) {
        uint32_t* row = bits + (b * T + i) * W;
        if (i > 0 && i < nn[b]) {
          const int64_t p = par[b * T + i];
          dep[b * T + i] = dep[b * T + p] + 1;
          std::memcpy(row, bits + (b * T + p) * W, W * sizeof(uint32_t));
        }
        row[i / 32] |= 1u << (i % 32);
      }
    }
  });
  return {depth, mask};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("build_tree", &build_tree_cpu); }

}  // namespace specdec
