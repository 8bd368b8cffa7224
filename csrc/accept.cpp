// accept: verify each request's draft tree against the target; the accepted path plus one next token.
//
//   target_logits (B, T, V) fp16/bf16/fp32/fp64: the target's logits at each node
//   tokens        (B, T) int32/int64: node i's draft token (the root's is unused)
//   parents       (B, T) int32/int64
//   draft_logits  (B, T, V) or None: the drafter's logits at each node (its children were drawn i.i.d. from
//                 softmax(draft / t)); None means the children are given proposals
//   temperature   (B,) float: 0 = greedy for that request
//   seeds         (B,) int64, offset int: request b's random stream is Philox4x32(seeds[b], offset) only,
//                 so a request's result does not depend on the rest of the batch
//   num_nodes     (B,) int32/int64
// -> accepted_nodes (B, T) int32 (path from node 0, padded with -1), num_accepted (B,) int32,
//    next_tokens (B,) int64
//
// Semantics of reference.accept: greedy descends into the first child (node order) whose token is the
// target argmax (first index on ties). Sampling with p = softmax(target / t) keeps a residual r (= p at
// each node) and tries children in node order: with draft logits, child x is accepted iff
// u * q(x) < r(x), else r <- norm(max(r - q, 0)); with given proposals iff u < r(x) / sum(r), else
// r(x) <- 0. The next token is drawn from r. This is exactly lossless (SpecInfer multi-step rejection).
//
// Two passes: (1) every row once: max, first argmax, NaN/+inf flags (the input checks need all rows
// anyway, and greedy requests are then done); (2) per request, walk the tree, computing exp and residual
// updates only for the rows on the path (fp32, fp64 for fp64 logits).
#include "specdec.h"

#include <ATen/core/PhiloxRNGEngine.h>

#include <cmath>
#include <limits>
#include <vector>

namespace specdec {
namespace {

// Calls vec_fn(Vectorized<acc_t> x, i) for the row's full vectors (converted to acc_t), starting at
// element i, then scalar_fn(acc_t x, i) for the tail.
template <typename scalar_t, typename VecFn, typename ScalarFn>
inline void for_each_vec(const scalar_t* row, int64_t n, VecFn&& vec_fn, ScalarFn&& scalar_fn) {
  using acc_t = acc_type_t<scalar_t>;
  constexpr int64_t AS = Vectorized<acc_t>::size();
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    for (; i + AS <= n; i += AS) vec_fn(Vectorized<acc_t>::loadu(row + i), i);
  } else {
    using SVec = Vectorized<scalar_t>;
    for (; i + SVec::size() <= n; i += SVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(SVec::loadu(row + i));
      vec_fn(lo, i);
      vec_fn(hi, i + AS);
    }
  }
  for (; i < n; ++i) scalar_fn(static_cast<acc_t>(row[i]), i);
}

// Pass 1: per-row statistics of a (B, T, V) logits tensor: max, first argmax, NaN and +inf flags.
template <typename scalar_t>
struct RowStats {
  using acc_t = acc_type_t<scalar_t>;
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t VS = Vec::size();

  const scalar_t* data;
  int64_t V;
  Tensor max, argmax, nan, posinf;  // (B, T) double, int64, bool, bool

  explicit RowStats(const Tensor& logits)
      : data(logits.const_data_ptr<scalar_t>()), V(logits.size(2)),
        max(at::empty(logits.sizes().slice(0, 2), logits.options().dtype(at::kDouble))),
        argmax(at::empty_like(max, max.options().dtype(at::kLong))),
        nan(at::empty_like(max, max.options().dtype(at::kBool))),
        posinf(at::empty_like(max, max.options().dtype(at::kBool))) {}

  void compute(int64_t row_begin, int64_t row_end) {
    constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();
    constexpr int kAllZero = (1 << VS) - 1;
    alignas(64) acc_t lane_index[VS];
    for (int64_t j = 0; j < VS; ++j) lane_index[j] = static_cast<acc_t>(j);
    for (int64_t r = row_begin; r < row_end; ++r) {
      // per lane: max and the first index reaching it (strict >), as acc_t (exact for V < 2^24)
      Vec best(-kInf), best_at(acc_t(-1)), index = Vec::loadu(lane_index), any_nan(acc_t(0)), any_posinf(acc_t(0));
      acc_t tail_best = -kInf;
      int64_t tail_at = -1;
      bool tail_nan = false, tail_posinf = false;
      for_each_vec(data + r * V, V,
          [&](const Vec& x, int64_t i) {
            const Vec greater = x > best;
            best = Vec::blendv(best, x, greater);
            best_at = Vec::blendv(best_at, index + Vec(static_cast<acc_t>(i)), greater);
            any_nan = any_nan | (x != x);
            any_posinf = any_posinf | (x == Vec(kInf));
          },
          [&](acc_t x, int64_t i) {
            if (x > tail_best) tail_best = x, tail_at = i;
            tail_nan = tail_nan || std::isnan(x);
            tail_posinf = tail_posinf || x == kInf;
          });
      alignas(64) acc_t lanes[VS], lanes_at[VS];
      best.store(lanes);
      best_at.store(lanes_at);
      acc_t m = -kInf;
      int64_t at = -1;
      for (int64_t j = 0; j < VS; ++j) {
        const int64_t idx = static_cast<int64_t>(lanes_at[j]);
        if (idx >= 0 && (lanes[j] > m || (lanes[j] == m && idx < at))) m = lanes[j], at = idx;
      }
      if (tail_best > m) m = tail_best, at = tail_at;  // the tail's indices come after every lane's
      max.data_ptr<double>()[r] = static_cast<double>(m);
      argmax.data_ptr<int64_t>()[r] = at;
      nan.data_ptr<bool>()[r] = tail_nan || any_nan.zero_mask() != kAllZero;
      posinf.data_ptr<bool>()[r] = tail_posinf || any_posinf.zero_mask() != kAllZero;
    }
  }
};

// A request's random stream: Philox4x32 keyed by (seed, offset) alone.
struct RequestRng {
  at::Philox4_32 engine;
  RequestRng(int64_t seed, int64_t offset) : engine(static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), 0) {}
  double uniform() {  // 53 random bits in [0, 1)
    const uint64_t hi = engine() >> 5, lo = engine() >> 6;
    return (static_cast<double>(hi) * 67108864.0 + static_cast<double>(lo)) * (1.0 / 9007199254740992.0);
  }
};

template <typename scalar_t>
struct Accept {
  using acc_t = acc_type_t<scalar_t>;
  using Vec = Vectorized<acc_t>;

  const scalar_t* target;  // contiguous (B, T, V)
  const scalar_t* draft;   // contiguous (B, T, V) or null
  const double *target_max, *draft_max;
  const int64_t* target_argmax;
  const int32_t *tokens, *parents, *num_nodes;
  const float* temperature;
  const int64_t* seeds;
  int64_t T, V, offset;
  int32_t* accepted;  // (B, T), pre-filled with -1
  int32_t* num_accepted;
  int64_t* next_tokens;

  // dst = exp((row - max) * inv_t); returns the sum.
  double exp_row(const scalar_t* row, double max, double inv_t, acc_t* dst) const {
    const acc_t m = static_cast<acc_t>(max), it = static_cast<acc_t>(inv_t);
    Vec sum(acc_t(0));
    double tail = 0;
    for_each_vec(row, V,
        [&](const Vec& x, int64_t i) {
          const Vec e = ((x - Vec(m)) * Vec(it)).exp();
          e.store(dst + i);
          sum = sum + e;
        },
        [&](acc_t x, int64_t i) { tail += dst[i] = std::exp((x - m) * it); });
    return static_cast<double>(at::vec::vec_reduce_all<acc_t>(std::plus<Vec>(), sum)) + tail;
  }

  // r <- max(r / r_sum - q / q_sum, 0); returns the new sum.
  double subtract_residual(acc_t* r, double r_sum, const acc_t* q, double q_sum) const {
    const acc_t a = static_cast<acc_t>(1.0 / r_sum), c = static_cast<acc_t>(1.0 / q_sum);
    const Vec va(a), vc(c), zero(acc_t(0));
    constexpr int64_t VS = Vec::size();
    Vec sum = zero;
    int64_t i = 0;
    for (; i + VS <= V; i += VS) {
      const Vec x = at::vec::maximum(Vec::loadu(r + i) * va - Vec::loadu(q + i) * vc, zero);
      x.store(r + i);
      sum = sum + x;
    }
    double tail = 0;
    for (; i < V; ++i) tail += r[i] = std::max(r[i] * a - q[i] * c, acc_t(0));
    return static_cast<double>(at::vec::vec_reduce_all<acc_t>(std::plus<Vec>(), sum)) + tail;
  }

  // A draw from r (unnormalized, some mass > 0) by inverse CDF over block sums, then inside the block.
  // The total is the sum of the same block sums, so the threshold always falls inside some block.
  int64_t sample(const acc_t* r, double u) const {
    constexpr int64_t kBlock = 512;
    auto block_sum = [&](int64_t b0) {
      return static_cast<double>(at::vec::reduce_all<acc_t>([](Vec x, Vec y) { return x + y; }, r + b0,
                                                            std::min(kBlock, V - b0)));
    };
    double total = 0;
    for (int64_t b0 = 0; b0 < V; b0 += kBlock) total += block_sum(b0);
    const double threshold = u * total;
    double cum = 0;
    int64_t b0 = 0;
    for (; b0 + kBlock < V; b0 += kBlock) {
      const double block = block_sum(b0);
      if (cum + block > threshold) break;
      cum += block;
    }
    int64_t last = -1;
    for (int64_t i = b0; i < std::min(V, b0 + kBlock); ++i) {
      if (r[i] <= 0) continue;
      last = i;
      cum += r[i];
      if (cum > threshold) return i;
    }
    if (last >= 0) return last;  // the scalar sum rounded below the block's vector sum
    for (int64_t i = b0 - 1; i > 0; --i) {  // u * total rounded up to total past an empty last block
      if (r[i] > 0) return i;
    }
    return 0;
  }

  void run(int64_t b, acc_t* r, acc_t* q) const {
    const int64_t n = num_nodes[b];
    // children in node order: first_child / next_sibling lists
    std::vector<int64_t> first_child(n, -1), next_sibling(n, -1);
    for (int64_t i = n - 1; i >= 1; --i) {
      const int64_t p = parents[b * T + i];
      next_sibling[i] = first_child[p];
      first_child[p] = i;
    }
    const double t = temperature[b];
    const double inv_t = std::min(1.0 / t, static_cast<double>(std::numeric_limits<acc_t>::max()));
    RequestRng rng(seeds[b], offset);
    int64_t node = 0, length = 0, token = -1;
    accepted[b * T] = 0;
    while (true) {
      const int64_t row = b * T + node;
      int64_t chosen = -1;
      if (t == 0.0) {
        token = target_argmax[row];
        for (int64_t c = first_child[node]; c >= 0 && chosen < 0; c = next_sibling[c]) {
          if (tokens[b * T + c] == token) chosen = c;
        }
      } else {
        double r_sum = exp_row(target + row * V, target_max[row], inv_t, r);
        double q_sum = draft != nullptr ? exp_row(draft + row * V, draft_max[row], inv_t, q) : 0.0;
        for (int64_t c = first_child[node]; c >= 0 && chosen < 0; c = next_sibling[c]) {
          const int64_t x = tokens[b * T + c];
          const double u = rng.uniform();
          if (draft != nullptr) {
            if (u * (q[x] / q_sum) < r[x] / r_sum) {
              chosen = c;
            } else {
              r_sum = subtract_residual(r, r_sum, q, q_sum);
              if (!(r_sum > 0)) break;  // r == q: a rejection of probability 0 happened by rounding
            }
          } else if (u * r_sum < r[x]) {
            chosen = c;
          } else {
            r_sum = std::max(r_sum - static_cast<double>(r[x]), 0.0);
            r[x] = 0;
          }
        }
        if (chosen < 0) token = r_sum > 0 ? sample(r, rng.uniform()) : target_argmax[row];
      }
      if (chosen < 0) break;
      accepted[b * T + ++length] = static_cast<int32_t>(chosen);
      node = chosen;
    }
    num_accepted[b] = static_cast<int32_t>(length);
    next_tokens[b] = token;
  }
};

std::tuple<Tensor, Tensor, Tensor> accept_cpu(const Tensor& target_in, const Tensor& tokens, const Tensor& parents,
                                              const std::optional<Tensor>& draft_in, const Tensor& temperature,
                                              const Tensor& seeds, const Tensor& num_nodes, int64_t offset) {
  AcceptInputs in = check_accept(target_in, tokens, parents, draft_in, temperature, seeds, num_nodes, offset);
  const int64_t B = target_in.size(0), T = target_in.size(1), V = target_in.size(2);
  // mixed target/draft dtypes: both promoted (exactly) to a common one, so q is the drafter's own law
  const auto dtype = draft_in.has_value() ? c10::promoteTypes(target_in.scalar_type(), draft_in->scalar_type())
                                          : target_in.scalar_type();
  const Tensor target = target_in.to(dtype).contiguous();
  const std::optional<Tensor> draft =
      draft_in.has_value() ? std::optional<Tensor>(draft_in->to(dtype).contiguous()) : std::nullopt;
  auto opts = target.options();
  Tensor accepted = at::full({B, T}, -1, opts.dtype(at::kInt));
  Tensor num_accepted = at::empty({B}, opts.dtype(at::kInt));
  Tensor next_tokens = at::empty({B}, opts.dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, target.scalar_type(), "specdec::accept", [&] {
    using acc_t = acc_type_t<scalar_t>;
    RowStats<scalar_t> ts(target);
    std::optional<RowStats<scalar_t>> ds;
    if (draft.has_value()) ds.emplace(*draft);
    const Accept<scalar_t> op{target.const_data_ptr<scalar_t>(),
                              draft.has_value() ? draft->const_data_ptr<scalar_t>() : nullptr,
                              ts.max.template const_data_ptr<double>(),
                              ds.has_value() ? ds->max.template const_data_ptr<double>() : nullptr,
                              ts.argmax.template const_data_ptr<int64_t>(),
                              in.tokens.const_data_ptr<int32_t>(),
                              in.parents.const_data_ptr<int32_t>(),
                              in.num_nodes.const_data_ptr<int32_t>(),
                              in.temperature.const_data_ptr<float>(),
                              in.seeds.const_data_ptr<int64_t>(),
                              T, V, offset,
                              accepted.data_ptr<int32_t>(),
                              num_accepted.data_ptr<int32_t>(),
                              next_tokens.data_ptr<int64_t>()};
    auto stats = [&](int64_t row_begin, int64_t row_end) {
      ts.compute(row_begin, row_end);
      if (ds.has_value()) ds->compute(row_begin, row_end);
    };
    auto walk = [&](int64_t begin, int64_t end) {
      std::vector<acc_t> r(V), q(draft.has_value() ? V : 0);
      for (int64_t b = begin; b < end; ++b) op.run(b, r.data(), q.data());
    };
    // Walking needs only the request's own rows: with a request for every thread, one parallel region
    // (each region wakes the thread team, costly on a busy machine); else rows first, then requests.
    // Bad logits are reported after both passes (outputs are the op's own, nothing of the caller's is
    // written), and the walk stays in bounds on them.
    if (B >= at::get_num_threads()) {
      at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
        stats(begin * T, end * T);
        walk(begin, end);
      });
    } else {
      at::parallel_for(0, B * T, 1, stats);
      at::parallel_for(0, B, 1, walk);
    }
    check_logit_rows("target_logits", ts.nan, ts.posinf, ts.max, in.num_nodes);
    if (ds.has_value()) check_logit_rows("draft_logits", ds->nan, ds->posinf, ds->max, in.num_nodes);
  });
  return {accepted, num_accepted, next_tokens};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("accept", &accept_cpu); }

}  // namespace specdec
