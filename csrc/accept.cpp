// accept: verify each request's draft tree against the target; the accepted path plus one next token.
//
//   target_logits (B, T, V) fp16/bf16/fp32/fp64: the target's logits at each node
//   tokens        (B, T) int32/int64: node i's draft token (the root's is unused)
//   parents       (B, T) int32/int64
//   draft_logits  (B, T, V) or None: the drafter's logits at each node (its children were drawn i.i.d. from
//                 softmax(draft / t)); None means the children are given proposals
//   temperature   (B,) float: 0 = greedy for that request
//   seeds         (B,) int64, offset int, offsets (B,) int or None: request b's random stream is
//                 Philox4x32(seeds[b], offset + offsets[b]) only, so a request's result does not depend on
//                 the rest of the batch
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
// Two passes: (1) every row once, at memory speed: its max, which also gives the NaN/+inf flags (the input
// checks need all rows anyway); (2) per request, walk the tree, reading again only the rows on the path
// (fp32, fp64 for fp64 logits): greedy finds the first index of the max; sampling computes exp, residual
// updates and the final draw over per-block sums, so each path row costs one exp pass, a rejection one
// more pass over r and q, and the draw one block.
#include "specdec.h"

#include <ATen/core/PhiloxRNGEngine.h>

#include <cmath>
#include <limits>
#include <vector>

namespace specdec {
namespace {

// Pass 1: the max of every row of a (B, T, V) logits tensor, and from it the input checks' flags: the
// max propagates NaN (at::vec::maximum), so a row holds NaN iff its max is NaN, and +inf iff its max is
// +inf. Four independent accumulators keep the loop at memory speed (one max chain is latency-bound).
template <typename scalar_t>
struct RowStats {
  using acc_t = acc_type_t<scalar_t>;
  using Vec = Vectorized<acc_t>;

  const scalar_t* data;
  int64_t V;
  Tensor max, nan, posinf;  // (B, T) double, bool, bool

  explicit RowStats(const Tensor& logits)
      : data(logits.const_data_ptr<scalar_t>()), V(logits.size(2)),
        max(at::empty(logits.sizes().slice(0, 2), logits.options().dtype(at::kDouble))),
        nan(at::empty_like(max, max.options().dtype(at::kBool))),
        posinf(at::empty_like(max, max.options().dtype(at::kBool))) {}

  acc_t row_max(const scalar_t* row) const {
    constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();
    constexpr int64_t AS = Vec::size();
    Vec m0(-kInf), m1(-kInf), m2(-kInf), m3(-kInf);
    int64_t i = 0;
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      for (; i + 4 * AS <= V; i += 4 * AS) {
        m0 = at::vec::maximum(m0, Vec::loadu(row + i));
        m1 = at::vec::maximum(m1, Vec::loadu(row + i + AS));
        m2 = at::vec::maximum(m2, Vec::loadu(row + i + 2 * AS));
        m3 = at::vec::maximum(m3, Vec::loadu(row + i + 3 * AS));
      }
    } else {
      using SVec = Vectorized<scalar_t>;
      constexpr int64_t SS = SVec::size();
      for (; i + 2 * SS <= V; i += 2 * SS) {
        auto [a, b] = at::vec::convert_to_float<scalar_t>(SVec::loadu(row + i));
        auto [c, d] = at::vec::convert_to_float<scalar_t>(SVec::loadu(row + i + SS));
        m0 = at::vec::maximum(m0, a);
        m1 = at::vec::maximum(m1, b);
        m2 = at::vec::maximum(m2, c);
        m3 = at::vec::maximum(m3, d);
      }
    }
    acc_t tail = -kInf;
    for_each_vec(row + i, V - i, [&](const Vec& x, int64_t) { m0 = at::vec::maximum(m0, x); },
                 [&](acc_t x, int64_t) { tail = std::isnan(tail) || x <= tail ? tail : x; });  // NaN sticks
    const Vec m = at::vec::maximum(at::vec::maximum(m0, m1), at::vec::maximum(m2, m3));
    const acc_t lanes = at::vec::vec_reduce_all<acc_t>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, m);
    return std::isnan(lanes) || std::isnan(tail) ? std::numeric_limits<acc_t>::quiet_NaN() : std::max(lanes, tail);
  }

  void compute(int64_t row_begin, int64_t row_end) const {
    for (int64_t r = row_begin; r < row_end; ++r) {
      const acc_t m = row_max(data + r * V);
      max.data_ptr<double>()[r] = static_cast<double>(m);
      nan.data_ptr<bool>()[r] = std::isnan(m);
      posinf.data_ptr<bool>()[r] = m == std::numeric_limits<acc_t>::infinity();
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

// The residual r over the vocabulary, with the sums of its blocks of kBlock entries: every change of r
// refreshes the sums of the blocks it touched, so the total and the inverse-CDF draw need no extra pass
// over r, and they agree with each other (the draw's threshold always falls inside some block).
template <typename acc_t>
struct Residual {
  static constexpr int64_t kBlock = 512;  // a multiple of every vector size
  std::vector<acc_t> r, q;
  std::vector<double> block_sums;

  Residual(int64_t V, bool with_draft) : r(V), q(with_draft ? V : 0), block_sums((V + kBlock - 1) / kBlock) {}

  double total() const {
    double sum = 0;
    for (const double s : block_sums) sum += s;
    return sum;
  }
};

template <typename scalar_t>
struct Accept {
  using acc_t = acc_type_t<scalar_t>;
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t kBlock = Residual<acc_t>::kBlock;

  const scalar_t* target;  // contiguous (B, T, V)
  const scalar_t* draft;   // contiguous (B, T, V) or null
  const double *target_max, *draft_max;
  // when set, the walk computes its request's row maxima: a path row's right before its use (which then
  // reads the row again from cache, not memory), the other rows after the walk
  const RowStats<scalar_t> *lazy_target, *lazy_draft;
  const int32_t *tokens, *parents, *num_nodes;
  const float* temperature;
  const int64_t* seeds;
  const int64_t* offsets;  // (B,): request b's stream offset is offset + offsets[b]
  int64_t T, V, offset;
  int32_t* accepted;  // (B, T), pre-filled with -1
  int32_t* num_accepted;
  int64_t* next_tokens;

  static double reduce_sum(const Vec& v) {
    return static_cast<double>(at::vec::vec_reduce_all<acc_t>(std::plus<Vec>(), v));
  }

  // The first index of the row's max (greedy's argmax, ties to the first), read again for the few rows
  // that need it. A NaN row (reported after the walk) has none: 0 keeps the walk in bounds.
  int64_t first_argmax(const scalar_t* row, double max) const {
    const acc_t m = static_cast<acc_t>(max);
    for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
      int64_t found = -1;
      for_each_vec(row + b0, std::min(kBlock, V - b0),
          [&](const Vec& x, int64_t i) {
            if (found < 0 && (x == Vec(m)).zero_mask() != (1 << Vec::size()) - 1) {
              for (int64_t j = 0; j < Vec::size(); ++j) {
                if (static_cast<acc_t>(row[b0 + i + j]) == m) { found = b0 + i + j; break; }
              }
            }
          },
          [&](acc_t x, int64_t i) { if (found < 0 && x == m) found = b0 + i; });
      if (found >= 0) return found;
    }
    return 0;
  }

  // dst = exp((row - max) * inv_t) by blocks; block_sums (if given) gets each block's sum. Returns the
  // total. exp_u20 (the exp of ATen's own softmax) is far cheaper than the 1-ulp exp; its 20-ulp error is
  // far below what any sampling test can see, and the residual stays a valid law.
  double exp_row(const scalar_t* row, double max, double inv_t, acc_t* dst, double* block_sums) const {
    const Vec m(static_cast<acc_t>(max)), it(static_cast<acc_t>(inv_t));
    double total = 0;
    for (int64_t b0 = 0, k = 0; b0 < V; b0 += kBlock, ++k) {
      Vec sum(acc_t(0));
      double tail = 0;
      for_each_vec(row + b0, std::min(kBlock, V - b0),
          [&](const Vec& x, int64_t i) {
            const Vec e = ((x - m) * it).exp_u20();
            e.store(dst + b0 + i);
            sum = sum + e;
          },
          [&](acc_t x, int64_t i) {
            tail += dst[b0 + i] = std::exp((x - static_cast<acc_t>(max)) * static_cast<acc_t>(inv_t));
          });
      const double block = reduce_sum(sum) + tail;
      if (block_sums != nullptr) block_sums[k] = block;
      total += block;
    }
    return total;
  }

  // r <- max(r / r_sum - q / q_sum, 0), block sums refreshed; returns the new total.
  double subtract_residual(Residual<acc_t>& res, double r_sum, double q_sum) const {
    acc_t* r = res.r.data();
    const acc_t* q = res.q.data();
    const acc_t a = static_cast<acc_t>(1.0 / r_sum), c = static_cast<acc_t>(1.0 / q_sum);
    const Vec va(a), vc(c), zero(acc_t(0));
    constexpr int64_t VS = Vec::size();
    double total = 0;
    for (int64_t b0 = 0, k = 0; b0 < V; b0 += kBlock, ++k) {
      const int64_t end = std::min(V, b0 + kBlock);
      Vec sum = zero;
      int64_t i = b0;
      for (; i + VS <= end; i += VS) {
        const Vec x = at::vec::maximum(at::vec::fmsub(Vec::loadu(r + i), va, Vec::loadu(q + i) * vc), zero);
        x.store(r + i);
        sum = sum + x;
      }
      double tail = 0;
      for (; i < end; ++i) tail += r[i] = std::max(r[i] * a - q[i] * c, acc_t(0));
      res.block_sums[k] = reduce_sum(sum) + tail;
      total += res.block_sums[k];
    }
    return total;
  }

  // r(x) <- 0 (a rejected given proposal); its block's sum is recomputed, not decremented, so an emptied
  // block sums to exactly 0. Returns the new total.
  double remove_token(Residual<acc_t>& res, int64_t x) const {
    res.r[x] = 0;
    const int64_t b0 = x / kBlock * kBlock;
    res.block_sums[x / kBlock] = static_cast<double>(
        at::vec::reduce_all<acc_t>([](Vec a, Vec b) { return a + b; }, res.r.data() + b0, std::min(kBlock, V - b0)));
    return res.total();
  }

  // A draw from r (unnormalized, total > 0) by inverse CDF over the block sums, then inside the block.
  int64_t sample(const Residual<acc_t>& res, double total, double u) const {
    const acc_t* r = res.r.data();
    const double threshold = u * total;
    double cum = 0;
    int64_t k = 0;
    for (; k + 1 < static_cast<int64_t>(res.block_sums.size()); ++k) {
      if (cum + res.block_sums[k] > threshold) break;
      cum += res.block_sums[k];
    }
    const int64_t b0 = k * kBlock;
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

  void run(int64_t b, Residual<acc_t>& res) const {
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
    RequestRng rng(seeds[b], offset + offsets[b]);
    acc_t *r = res.r.data(), *q = res.q.data();
    std::vector<bool> scanned(lazy_target != nullptr ? T : 0, false);
    auto scan = [&](int64_t i) {
      if (lazy_target == nullptr || scanned[i]) return;
      scanned[i] = true;
      lazy_target->compute(b * T + i, b * T + i + 1);
      if (lazy_draft != nullptr) lazy_draft->compute(b * T + i, b * T + i + 1);
    };
    int64_t node = 0, length = 0, token = -1;
    accepted[b * T] = 0;
    while (true) {
      const int64_t row = b * T + node;
      scan(node);
      int64_t chosen = -1;
      if (t == 0.0) {
        token = first_argmax(target + row * V, target_max[row]);
        for (int64_t c = first_child[node]; c >= 0 && chosen < 0; c = next_sibling[c]) {
          if (tokens[b * T + c] == token) chosen = c;
        }
      } else {
        double r_sum = exp_row(target + row * V, target_max[row], inv_t, r, res.block_sums.data());
        // a leaf's draft row is never needed: only the target law is sampled there
        const bool use_draft = draft != nullptr && first_child[node] >= 0;
        const double q_sum = use_draft ? exp_row(draft + row * V, draft_max[row], inv_t, q, nullptr) : 0.0;
        for (int64_t c = first_child[node]; c >= 0 && chosen < 0; c = next_sibling[c]) {
          const int64_t x = tokens[b * T + c];
          const double u = rng.uniform();
          if (use_draft) {
            if (u * (q[x] / q_sum) < r[x] / r_sum) {
              chosen = c;
            } else {
              r_sum = subtract_residual(res, r_sum, q_sum);
              if (!(r_sum > 0)) break;  // r == q: a rejection of probability 0 happened by rounding
            }
          } else if (u * r_sum < r[x]) {
            chosen = c;
          } else {
            r_sum = remove_token(res, x);
          }
        }
        if (chosen < 0) {
          token = r_sum > 0 ? sample(res, r_sum, rng.uniform()) : first_argmax(target + row * V, target_max[row]);
        }
      }
      if (chosen < 0) break;
      accepted[b * T + ++length] = static_cast<int32_t>(chosen);
      node = chosen;
    }
    for (int64_t i = 0; i < T; ++i) scan(i);
    num_accepted[b] = static_cast<int32_t>(length);
    next_tokens[b] = token;
  }
};

std::tuple<Tensor, Tensor, Tensor> accept_cpu(const Tensor& target_in, const Tensor& tokens, const Tensor& parents,
                                              const std::optional<Tensor>& draft_in, const Tensor& temperature,
                                              const Tensor& seeds, const Tensor& num_nodes, int64_t offset,
                                              const std::optional<Tensor>& offsets) {
  AcceptInputs in = check_accept(target_in, tokens, parents, draft_in, temperature, seeds, num_nodes, offset, offsets);
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
    const bool stats_in_walk = B >= at::get_num_threads();
    const Accept<scalar_t> op{target.const_data_ptr<scalar_t>(),
                              draft.has_value() ? draft->const_data_ptr<scalar_t>() : nullptr,
                              ts.max.template const_data_ptr<double>(),
                              ds.has_value() ? ds->max.template const_data_ptr<double>() : nullptr,
                              stats_in_walk ? &ts : nullptr,
                              stats_in_walk && ds.has_value() ? &*ds : nullptr,
                              in.tokens.const_data_ptr<int32_t>(),
                              in.parents.const_data_ptr<int32_t>(),
                              in.num_nodes.const_data_ptr<int32_t>(),
                              in.temperature.const_data_ptr<float>(),
                              in.seeds.const_data_ptr<int64_t>(),
                              in.offsets.const_data_ptr<int64_t>(),
                              T, V, offset,
                              accepted.data_ptr<int32_t>(),
                              num_accepted.data_ptr<int32_t>(),
                              next_tokens.data_ptr<int64_t>()};
    auto stats = [&](int64_t row_begin, int64_t row_end) {
      ts.compute(row_begin, row_end);
      if (ds.has_value()) ds->compute(row_begin, row_end);
    };
    // Walking needs only the request's own rows: with a request for every thread, one parallel region
    // (each region wakes the thread team, costly on a busy machine) in which the walk scans its request's
    // rows (Accept::lazy_target); else rows first, then requests. Bad logits are reported after both
    // passes (outputs are the op's own, nothing of the caller's is written), and the walk stays in
    // bounds on them.
    if (!stats_in_walk) at::parallel_for(0, B * T, 1, stats);
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      Residual<acc_t> res(V, draft.has_value());
      for (int64_t b = begin; b < end; ++b) op.run(b, res);
    });
    check_logit_rows("target_logits", ts.nan, ts.posinf, ts.max, in.num_nodes);
    if (ds.has_value()) check_logit_rows("draft_logits", ds->nan, ds->posinf, ds->max, in.num_nodes);
  });
  return {accepted, num_accepted, next_tokens};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("accept", &accept_cpu); }

}  // namespace specdec
