// The specdec op schemas (the same strings as specdec/ops.py SCHEMAS; tests compare them) and the Python
// module specdec._C, whose import loads this library and so runs the registrations. The CPU kernels are
// registered next to each op (build_tree.cpp, tree_attention.cpp, accept.cpp, kv_append.cpp,
// kv_rollback.cpp); the CUDA (Triton) kernels and the fake implementations are registered from Python.
#include <Python.h>


#include "specdec.h"

namespace specdec {
namespace {

// How many threads at::parallel_for really uses inside this library: 1 when it was compiled without
// OpenMP although ATen reports more (a build problem that otherwise only shows as slowness).
int64_t parallel_threads() {
  const int64_t n = at::get_num_threads();
  std::vector<int> seen(n, 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  int64_t used = 0;
  for (int s : seen) used += s;
  return used;
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY(specdec, m) {
  m.def("build_tree(Tensor parents, Tensor num_nodes) -> (Tensor, Tensor)");
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_lens, Tensor tree_mask, "
        "Tensor? block_table, Tensor num_nodes, float scale, float k_scale=1.0, float v_scale=1.0, "
        "int window_left=-1, float logits_soft_cap=0.0, Tensor? row_offsets=None, int max_nodes=0, "
        "Tensor? sinks=None) -> (Tensor, Tensor)");
  m.def("accept(Tensor target_logits, Tensor tokens, Tensor parents, Tensor? draft_logits, Tensor temperature, "
        "Tensor seeds, Tensor num_nodes, int offset, Tensor? offsets=None, Tensor? top_k=None, Tensor? top_p=None, "
        "Tensor? min_p=None, Tensor? token_bitmask=None, str method=\"token\", bool probs=False, "
        "Tensor? row_offsets=None, Tensor? repetition_penalty=None, Tensor? frequency_penalty=None, "
        "Tensor? presence_penalty=None, Tensor? output_token_counts=None, Tensor? prompt_token_mask=None, "
        "Tensor? logit_bias_ids=None, Tensor? logit_bias_values=None, Tensor? min_tokens=None, "
        "Tensor? stop_token_ids=None, str filter_order=\"hf\", int return_logprobs=-1, "
        "str logprobs_mode=\"raw\") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("kv_append(Tensor(a!) k_cache, Tensor(b!)? v_cache, Tensor k_new, Tensor? v_new, Tensor cache_lens, "
        "Tensor? block_table, float k_scale=1.0, float v_scale=1.0) -> ()");
  m.def("kv_rollback(Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor(c!) cache_lens, Tensor accepted_nodes, "
        "Tensor num_accepted, Tensor? block_table) -> ()");
  m.def("_parallel_threads() -> int", &specdec::parallel_threads);
}

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "specdec._C",
                               "specdec C++ CPU ops; importing registers torch.ops.specdec.*", -1, nullptr};
  return PyModule_Create(&module);
}
