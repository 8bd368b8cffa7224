// accept: verify each request's draft tree against the target; the accepted path plus one next token.
//
//   target_logits (B, T, V) fp16/bf16/fp32/fp64: the target's logits at each node
//   tokens        (B, T) int32/int64: node i's draft token (the root's is unused)
//   parents       (B, T) int32/int64
//   draft_logits  (B, T, V) or None: the drafter's logits at each node (its children were drawn i.i.d. from
//                 softmax(draft / t)); None means the children are given proposals
//   temperature   (B,) float: below kGreedyBelow (0 included) = greedy for that request
//   seeds         (B,) int64, offset int, offsets (B,) int or None: request b's random stream is
//                 Philox4x32(seeds[b], offset + offsets[b]) only, so a request's result does not depend on
//                 the rest of the batch
//   num_nodes     (B,) int32/int64
//   step 0 (each None: off): repetition / frequency / presence penalty (B,) float32, output_token_counts (B, V)
//                 int32, prompt_token_mask (B, ceil(V/32)) int32, logit_bias_ids / logit_bias_values (B, K),
//                 min_tokens (B,) with stop_token_ids (B, S); filter_order "hf" | "vllm" | "sglang";
//                 return_logprobs -1 (off) or N in [0, 20], logprobs_mode "raw" | "processed"
// -> accepted_nodes (B, T) int32 (path from node 0, padded with -1), num_accepted (B,) int32,
//    next_tokens (B,) int64, logprobs (B, T) float32, top_logprobs (B, T, N) float32, top_token_ids (B, T, N) int64,
//    token_ranks (B, T) int64 (the logprobs of the emitted tokens and their ranks, NaN / -1 after them; off: (B, 0),
//    (B, 0, 0), (B, 0, 0), (B, 0))
//
// Semantics of reference.accept: greedy descends into the first child (node order) whose token is the
// target argmax (first index on ties). Sampling with p = softmax(target / t) keeps a residual r (= p at
// each node) and tries children in node order: with draft logits, child x is accepted iff
// u * q(x) < r(x), else r <- norm(max(r - q, 0)); with given proposals iff u < r(x) / sum(r), else
// r(x) <- 0. The next token is drawn from r. This is exactly lossless (SpecInfer multi-step rejection).
//
// Filters (top_k, top_p, min_p (B,) or None; token_bitmask (B, T, ceil(V/32)) int32 or None): p and q at
// node i are the processed laws of specdec/reference.py (mask, temperature, top-k, top-p, min-p,
// renormalize); greedy takes the argmax of the masked row. Every kept set is an upper set of the logits,
// so a row's law is exp((x - M) / t) on the allowed x >= a threshold, 0 elsewhere (M: the masked max). The
// thresholds are exact and found without sorting the row (Accept::process_row): top-k by a filtered
// selection (the k-th largest of the maxima of 64-entry groups bounds the k-th value from below; only
// the entries above that bound are candidates, std::nth_element on them), min-p by solving
// exp((v - M) / t) >= min_p for the smallest float v (double math), top-p by a weighted selection over
// the kept tokens (after pruning, in one vectorized pass of mass pivots, the ones that cannot reach the
// boundary; top_p_threshold) with double-precision masses. filter_order only changes the set top-p normalizes
// over (process_row). A request with every filter off takes the plain path below, unchanged.
//
// Step 0 (reference.penalized_row, vLLM's order and arithmetic: the logit bias, min-tokens' stop tokens at -inf,
// then the repetition, frequency and presence penalties, each a rounded acc_t operation) is applied as a node's
// row is read (Accept::penalize, into per-thread scratch, so the rows are then read as acc_t: row_t): the counts
// are the output counts plus the node's path tokens as point corrections. The drafter's row at the node gets the
// same step 0. Logprobs (write_position: one pass over the row for the exp sum and the top entries) are computed at
// each emitted position's parent row: by the token-wise walk as it leaves the node (the row still in cache), after
// the walk for block and traversal verification.
//
// Two passes: (1) every row once, at memory speed: its max, which also gives the NaN/+inf flags (the input
// checks need all rows anyway); (2) per request, walk the tree, reading again only the rows on the path
// (fp32, fp64 for fp64 logits): greedy finds the first index of the max; sampling computes exp, residual
// updates and the final draw over per-block sums, so each path row costs one exp pass, a rejection one
// more pass over r and q, and the draw one block.
#include "specdec.h"

#include <ATen/core/PhiloxRNGEngine.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

namespace specdec {
namespace {

// A temperature below this is greedy (specdec.reference.GREEDY_BELOW, vLLM's _SAMPLING_EPS), compared in float as
// temperatures arrive: 1 / t <= 1e5 for every sampled request, and greedy keeps the argmax of the masked row.
constexpr float kGreedyBelow = 1e-5f;

// Pass 1: the max of every row of a (B, T, V) logits tensor, and from it the input checks' flags: the
// max propagates NaN (at::vec::maximum), so a row holds NaN iff its max is NaN, and +inf iff its max is
// +inf. Four independent accumulators keep the loop at memory speed (one max chain is latency-bound).
template <typename scalar_t>
struct RowStats {
  using acc_t = acc_type_t<scalar_t>;
  using Vec = Vectorized<acc_t>;

  const scalar_t* data;
  int64_t V;
  Tensor max, nan, posinf;  // per row ((B, T), or (N,) packed): double, bool, bool

  explicit RowStats(const Tensor& logits)
      : data(logits.const_data_ptr<scalar_t>()), V(logits.size(-1)),
        max(at::empty(logits.sizes().slice(0, logits.dim() - 1), logits.options().dtype(at::kDouble))),
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
    for (int64_t r = row_begin; r < row_end; ++r) record(r, row_max(data + r * V));
  }

  // row r's max m (NaN if the row holds one), found elsewhere
  void record(int64_t r, acc_t m) const {
    max.data_ptr<double>()[r] = static_cast<double>(m);
    nan.data_ptr<bool>()[r] = std::isnan(m);
    posinf.data_ptr<bool>()[r] = m == std::numeric_limits<acc_t>::infinity();
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

// Values appended one by one, storage kept from row to row: no zero fill, no capacity check per element
// (room for a row is made up front by reset).
struct Values {
  std::unique_ptr<double[]> data;
  int64_t size = 0, capacity = 0;
  void reset(int64_t room) {
    if (room > capacity) {
      data.reset(new double[room]);
      capacity = room;
    }
    size = 0;
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
  // scratch of the filters: top-k candidates, top-p (value, weight) candidates
  std::vector<acc_t> top_k_buffer, group_max;
  Values top_p_values, top_p_weights;
  // step 0: the node's target and draft rows after it (sized when step 0 is on); logprobs: the raw values of the
  // tokens step 0 changed (Accept::raw_log_sum_from_law)
  std::vector<acc_t> penalized_r, penalized_q;
  std::vector<double> changed_values;

  Residual(int64_t V, bool with_draft) : r(V), q(with_draft ? V : 0), block_sums((V + kBlock - 1) / kBlock) {}

  double total() const {
    double sum = 0;
    for (const double s : block_sums) sum += s;
    return sum;
  }
};

// One node's row of token_bitmask: token v is allowed iff bit v % 32 of word v / 32 is set (null: all are).
struct MaskRow {
  const int32_t* words = nullptr;
  bool allowed(int64_t v) const {
    return words == nullptr || ((static_cast<uint32_t>(words[v >> 5]) >> (v & 31)) & 1u);
  }
  // the n (<= 32, dividing 32) bits of tokens [i, i + n), i a multiple of n
  uint32_t bits(int64_t i, int n) const {
    const uint32_t word = static_cast<uint32_t>(words[i >> 5]) >> (i & 31);
    return n == 32 ? word : word & ((1u << n) - 1);
  }
};

// Lane j of the result is all ones iff bit j of `bits` is set (a blendv / select mask).
template <typename acc_t>
inline Vectorized<acc_t> lanes_of(uint32_t bits) {
  using int_t = at::vec::int_same_size_t<acc_t>;
  using IVec = Vectorized<int_t>;
  constexpr int VS = Vectorized<acc_t>::size();
  static_assert(IVec::size() == VS, "integer lanes of the float lanes' size");
  struct Powers {
    int_t v[VS];
    Powers() { for (int j = 0; j < VS; ++j) v[j] = static_cast<int_t>(int64_t{1} << j); }
  };
  static const Powers powers;
  const IVec set = (IVec(static_cast<int_t>(bits)) & IVec::loadu(powers.v)) != IVec(0);
  return at::vec::cast<acc_t>(set);
}

// The set lanes of a comparison's result, as bits.
template <typename Vec>
inline uint32_t set_lanes(const Vec& cmp) {
  return ~static_cast<uint32_t>(cmp.zero_mask()) & ((1u << Vec::size()) - 1);
}

// Top-p's threshold over the candidates x[0, n) (values) with weights w[0, n) (any order; both arrays are
// reordered): the smallest value g such that above + (the weight of the candidates with a value > g) < P,
// starting from above = 0 (so the largest value qualifies when P > 0). Exact for the given weights: each
// round takes 7 pivots at the octiles of a strided sample, weighs the candidates above each pivot in one
// vectorized pass, and compacts the part between the two pivots that bracket the boundary (about 1/8 of
// the candidates; the mass above it joins `above`); a tie group is never split. Few candidates left (or a
// round that removes none, all ties): a sort finishes.
inline double top_p_threshold(double* x, double* w, int64_t n, double P) {
  using DVec = Vectorized<double>;
  constexpr int64_t kSample = 64, kPivots = 7;
  double above = 0;  // weight of the candidates removed above the part searched, all kept (< P)
  while (n > kSample) {
    double sample[kSample];
    const int64_t stride = n / kSample;
    for (int64_t j = 0; j < kSample; ++j) sample[j] = x[j * stride];
    std::sort(sample, sample + kSample, std::greater<double>());
    double pivot[kPivots];  // descending
    DVec vp[kPivots], mass[kPivots];
    for (int64_t j = 0; j < kPivots; ++j) {
      pivot[j] = sample[(j + 1) * kSample / (kPivots + 1)];
      vp[j] = DVec(pivot[j]);
      mass[j] = DVec(0.0);
    }
    double tail[kPivots] = {};
    int64_t i = 0;
    const DVec zero(0.0);
    for (; i + DVec::size() <= n; i += DVec::size()) {
      const DVec xv = DVec::loadu(x + i), wv = DVec::loadu(w + i);
      for (int64_t j = 0; j < kPivots; ++j) mass[j] = mass[j] + DVec::blendv(zero, wv, xv > vp[j]);
    }
    for (; i < n; ++i) {
      for (int64_t j = 0; j < kPivots; ++j) tail[j] += x[i] > pivot[j] ? w[i] : 0.0;
    }
    // the first pivot whose mass above reaches P - above: the boundary is in (pivot[j], pivot[j - 1]]
    int64_t j = 0;
    double above_hi = 0, above_lo = 0;  // the masses above pivot[j - 1] and pivot[j]
    for (; j < kPivots; ++j) {
      above_lo = at::vec::vec_reduce_all<double>(std::plus<DVec>(), mass[j]) + tail[j];
      if (!(above + above_lo < P)) break;
      above_hi = above_lo;
    }
    const double hi = j > 0 ? pivot[j - 1] : std::numeric_limits<double>::infinity();
    const double lo = j < kPivots ? pivot[j] : -std::numeric_limits<double>::infinity();
    // kept: everything above hi (pivot[j - 1] itself is kept, its mass above is < P - above); dropped:
    // everything at or below lo (the mass above it reaches P - above)
    int64_t m = 0;
    for (int64_t k = 0; k < n; ++k) {
      const bool keep = (x[k] > lo) & (x[k] <= hi);  // (no branch: the outcome is random)
      x[m] = x[k];
      w[m] = w[k];
      m += keep;
    }
    above += above_hi;
    if (m == n) break;  // no progress (ties): sort what is left
    n = m;
  }
  std::vector<std::pair<double, double>> rest(n);
  for (int64_t j = 0; j < n; ++j) rest[j] = {x[j], w[j]};
  std::sort(rest.begin(), rest.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  double threshold = rest[0].first;
  for (int64_t j = 0; j < n && above < P;) {  // tie groups from the top: kept while the mass above < P
    threshold = rest[j].first;
    for (; j < n && rest[j].first == threshold; ++j) above += rest[j].second;
  }
  return threshold;
}

// row_t: the element type of the rows the laws are computed from: the logits' own (scalar_t), or acc_t when step 0
// is on (Accept::penalize writes each node's row, in acc_t, into scratch).
template <typename scalar_t, typename row_t = scalar_t>
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
  // the filters, each null when absent: top_k (B,) int32, top_p / min_p (B,) float, bitmask (B, T, W) int32
  const int32_t* top_k;
  const float *top_p, *min_p;
  const int32_t* bitmask;
  bool* masked_empty[2];  // (B, T) flags of the target's / draft's rows: -inf on every allowed token (or null)
  int64_t T, V, offset;
  bool block;  // method "block": sampling requests verify their chain by block verification (walk_block)
  bool traversal;  // method "traversal": sampling requests verify their tree by traversal (walk_traversal)
  const int64_t* row_offsets;  // (B,): node i of request b is row row_offsets[b] + i of the row tensors
  bool packed;  // rows packed (N, V) (else (B, T, V), row_offsets[b] = b * T)
  int32_t* accepted;  // (B, T), pre-filled with -1
  int32_t* num_accepted;
  int64_t* next_tokens;
  FilterOrder order = FilterOrder::kHf;  // the set top-p normalizes over (process_row)
  // step 0 (AcceptInputs), each null when off: penalties (B,), output counts (B, V), prompt bits (B, W), logit
  // bias (B, K), min-tokens (B,) with stop tokens (B, S)
  const float *repetition = nullptr, *frequency = nullptr, *presence = nullptr, *bias_values = nullptr;
  const int32_t *counts = nullptr, *prompt = nullptr, *bias_ids = nullptr, *min_tokens = nullptr, *stop_ids = nullptr;
  int64_t num_bias = 0, num_stop = 0;
  bool penalized = false;  // step 0 on (row_t is acc_t then)
  bool* stopped_empty = nullptr;  // (B, T) flags (with min_tokens): a real row min-tokens and the mask leave empty
  // logprobs (return_logprobs = num_top >= 0): (B, T), (B, T, num_top), (B, T, num_top), (B, T), pre-filled NaN / -1
  int64_t num_top = -1;
  bool processed_logprobs = false;
  float *logprobs = nullptr, *top_logprobs = nullptr;
  int64_t *top_ids = nullptr, *ranks = nullptr;

  static double reduce_sum(const Vec& v) {
    return static_cast<double>(at::vec::vec_reduce_all<acc_t>(std::plus<Vec>(), v));
  }

  // The first index of the row's max (greedy's argmax, ties to the first), read again for the few rows
  // that need it. A NaN row (reported after the walk) has none: 0 keeps the walk in bounds.
  int64_t first_argmax(const row_t* row, double max) const {
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
  double exp_row(const row_t* row, double max, double inv_t, acc_t* dst, double* block_sums) const {
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

  // ------------------------------------------------------------------------------------------------
  // the processed law of a row, for requests with a filter on
  // ------------------------------------------------------------------------------------------------
  static constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();
  static constexpr acc_t kLowest = std::numeric_limits<acc_t>::lowest();  // thresholds: -inf and NaN never pass

  struct Filters {
    int64_t k = 0;          // top-k, on iff 0 < k < V
    double top_p = 1.0;     // on iff < 1
    double min_p = 0.0;     // on iff > 0
    const int32_t* mask = nullptr;  // the request's (T, W) rows of token_bitmask
  };

  int64_t words() const { return (V + 31) / 32; }
  bool top_k_on(const Filters& f) const { return f.k > 0 && f.k < V; }
  bool any(const Filters& f) const { return top_k_on(f) || f.top_p < 1.0 || f.min_p > 0.0 || f.mask != nullptr; }

  Filters filters(int64_t b) const {
    Filters f;
    if (top_k != nullptr) f.k = top_k[b];
    if (top_p != nullptr) f.top_p = top_p[b];
    if (min_p != nullptr) f.min_p = min_p[b];
    if (bitmask != nullptr) f.mask = bitmask + row_offsets[b] * words();
    return f;
  }

  // for_each_vec over row[b0, b0 + n) with the disallowed entries at -inf; indices relative to b0.
  template <typename E, typename VecFn, typename ScalarFn>
  void masked_for_each(const E* row, int64_t b0, int64_t n, const MaskRow& mask, VecFn&& vec_fn,
                       ScalarFn&& scalar_fn) const {
    if (mask.words == nullptr) {
      for_each_vec(row + b0, n, vec_fn, scalar_fn);
      return;
    }
    constexpr uint32_t kAll = (1u << Vec::size()) - 1;
    for_each_vec(row + b0, n,
        [&](const Vec& x, int64_t i) {
          const uint32_t bits = mask.bits(b0 + i, Vec::size());
          if (bits == kAll) {
            vec_fn(x, i);
          } else {
            vec_fn(Vec::blendv(Vec(-kInf), x, lanes_of<acc_t>(bits)), i);
          }
        },
        [&](acc_t x, int64_t i) { scalar_fn(mask.allowed(b0 + i) ? x : -kInf, i); });
  }

  // The max over the allowed entries (-inf: none is finite; NaN propagates).
  acc_t masked_max(const row_t* row, const MaskRow& mask) const {
    Vec m(-kInf);
    acc_t tail = -kInf;
    masked_for_each(row, 0, V, mask, [&](const Vec& x, int64_t) { m = at::vec::maximum(m, x); },
                    [&](acc_t x, int64_t) { tail = std::isnan(tail) || x <= tail ? tail : x; });
    const acc_t lanes = at::vec::vec_reduce_all<acc_t>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, m);
    return std::isnan(lanes) || std::isnan(tail) ? std::numeric_limits<acc_t>::quiet_NaN() : std::max(lanes, tail);
  }

  // The first allowed index holding the masked max M (greedy's argmax); 0 if there is none.
  int64_t first_allowed_max(const row_t* row, const MaskRow& mask, acc_t M) const {
    if (mask.words == nullptr) return first_argmax(row, M);
    int64_t found = -1;
    for (int64_t b0 = 0; b0 < V && found < 0; b0 += kBlock) {
      masked_for_each(row, b0, std::min(kBlock, V - b0), mask,
          [&](const Vec& x, int64_t i) {
            const uint32_t equal = found < 0 ? set_lanes(x == Vec(M)) : 0;
            if (equal != 0) found = b0 + i + __builtin_ctz(equal);
          },
          [&](acc_t x, int64_t i) { if (found < 0 && x == M) found = b0 + i; });
    }
    return std::max<int64_t>(found, 0);
  }

  // The maxima of the row's groups of kGroup entries (disallowed at -inf, NaN as -inf) into `maxima`.
  static constexpr int64_t kGroup = 64;  // a multiple of every vector size, a divisor of kBlock
  void group_maxima(const row_t* row, const MaskRow& mask, std::vector<acc_t>& maxima) const {
    maxima.resize((V + kGroup - 1) / kGroup);
    for (int64_t g = 0, g0 = 0; g0 < V; ++g, g0 += kGroup) {
      Vec m(-kInf);
      acc_t tail = -kInf;
      masked_for_each(row, g0, std::min(kGroup, V - g0), mask, [&](const Vec& x, int64_t) { m = at::vec::maximum(m, x); },
                      [&](acc_t x, int64_t) { tail = x > tail ? x : tail; });
      const acc_t lanes = at::vec::vec_reduce_all<acc_t>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, m);
      maxima[g] = std::isnan(lanes) ? tail : std::max(lanes, tail);
    }
  }

  // Top-k: the k-th largest allowed value (ties counted), kLowest when fewer than k are finite. The k-th
  // largest group maximum is a lower bound (k groups reach it, so k entries do): only the entries at or
  // above it, in the groups whose maximum reaches it, are candidates; std::nth_element on those.
  acc_t top_k_threshold(const row_t* row, const MaskRow& mask, int64_t k, Residual<acc_t>& res) const {
    std::vector<acc_t>& maxima = res.group_max;
    std::vector<acc_t>& buffer = res.top_k_buffer;
    group_maxima(row, mask, maxima);
    const int64_t G = static_cast<int64_t>(maxima.size());
    acc_t bound = kLowest;
    if (k <= G) {
      buffer.assign(maxima.begin(), maxima.end());
      std::nth_element(buffer.begin(), buffer.begin() + (k - 1), buffer.end(), std::greater<acc_t>());
      bound = std::max(kLowest, buffer[k - 1]);
    }
    buffer.clear();
    const Vec vb(bound);
    for (int64_t g = 0; g < G; ++g) {
      if (!(maxima[g] >= bound)) continue;
      const int64_t g0 = g * kGroup;
      masked_for_each(row, g0, std::min(kGroup, V - g0), mask,
          [&](const Vec& x, int64_t) {
            uint32_t lanes = set_lanes(x >= vb);
            if (lanes == 0) return;
            acc_t values[Vec::size()];
            x.store(values);
            for (; lanes != 0; lanes &= lanes - 1) buffer.push_back(values[__builtin_ctz(lanes)]);
          },
          [&](acc_t x, int64_t) { if (x >= bound) buffer.push_back(x); });
    }
    if (static_cast<int64_t>(buffer.size()) < k) return kLowest;
    std::nth_element(buffer.begin(), buffer.begin() + (k - 1), buffer.end(), std::greater<acc_t>());
    return buffer[k - 1];
  }

  // Top-p's pruning floor for weights dst (exp((x - M) / t), the max's is 1) of total `total`: the largest
  // pivot tau in 4^-1 .. 4^-8 whose mass F(tau) of entries of weight >= tau reaches P (1 + 1e-5) (a margin
  // over the weights' float error); every entry of weight < tau / 2 then lies strictly below all of those
  // (the weights' error is far below a factor 2), so the mass above it is >= P: none is kept. 0 if no pivot
  // qualifies (then the floor (1 - top_p) Z / (2 V), whose entries weigh < (Z - P) / 2 together).
  double top_p_floor(const acc_t* dst, double total, double top_p) const {
    constexpr int kPivots = 8;
    Vec acc[kPivots], pivot[kPivots];
    acc_t tail[kPivots] = {};
    for (int j = 0; j < kPivots; ++j) {
      acc[j] = Vec(acc_t(0));
      pivot[j] = Vec(static_cast<acc_t>(std::ldexp(1.0, -2 * (j + 1))));
    }
    constexpr int64_t VS = Vec::size();
    int64_t i = 0;
    for (; i + VS <= V; i += VS) {
      const Vec d = Vec::loadu(dst + i);
      for (int j = 0; j < kPivots; ++j) acc[j] = acc[j] + Vec::blendv(Vec(acc_t(0)), d, d >= pivot[j]);
    }
    for (; i < V; ++i) {
      for (int j = 0; j < kPivots; ++j) tail[j] += dst[i] >= static_cast<acc_t>(std::ldexp(1.0, -2 * (j + 1))) ? dst[i] : 0;
    }
    const double P = top_p * total * (1 + 1e-5);
    for (int j = 0; j < kPivots; ++j) {
      if (reduce_sum(acc[j]) + tail[j] >= P) return std::ldexp(1.0, -2 * (j + 1)) / 2;
    }
    return total * (1.0 - top_p) / (2.0 * static_cast<double>(V));
  }

  // Min-p: the smallest value v with exp((v - M) / t) >= min_p (double math), the boundary of an upper set.
  static acc_t min_p_threshold(acc_t M, double inv_t, double min_p) {
    const double m = static_cast<double>(M);
    auto kept = [&](acc_t v) { return std::exp((static_cast<double>(v) - m) * inv_t) >= min_p; };
    const double boundary = m + std::log(min_p) / inv_t;
    if (!(boundary > static_cast<double>(kLowest))) return kLowest;
    acc_t v = std::min(static_cast<acc_t>(boundary), M);
    for (int i = 0; i < 64 && !kept(v) && v < M; ++i) v = std::nextafter(v, M);
    for (int i = 0; i < 64; ++i) {
      const acc_t lower = std::nextafter(v, -kInf);
      if (!kept(lower)) break;
      v = lower;
    }
    return v;
  }

  // dst = exp((x - M) * inv_t) on the allowed x >= threshold, 0 elsewhere, by blocks (block_sums if given);
  // the kept values are appended to `kept` when given. Returns the total.
  double exp_kept(const row_t* row, const MaskRow& mask, acc_t M, double inv_t, acc_t threshold, acc_t* dst,
                  double* block_sums, Values* kept) const {
    const Vec m(M), it(static_cast<acc_t>(inv_t)), thr(threshold), zero(acc_t(0));
    double total = 0;
    double* end = kept != nullptr ? kept->data.get() + kept->size : nullptr;  // a local cursor
    for (int64_t b0 = 0, k = 0; b0 < V; b0 += kBlock, ++k) {
      Vec sum = zero;
      double tail = 0;
      masked_for_each(row, b0, std::min(kBlock, V - b0), mask,
          [&](const Vec& x, int64_t i) {
            const Vec keep = x >= thr;
            const uint32_t lanes = set_lanes(keep);
            if (lanes == 0) {
              zero.store(dst + b0 + i);
              return;
            }
            const Vec e = Vec::blendv(zero, ((x - m) * it).exp_u20(), keep);
            e.store(dst + b0 + i);
            sum = sum + e;
            if (kept != nullptr) {
              acc_t values[Vec::size()];
              x.store(values);
              for (uint32_t l = lanes; l != 0; l &= l - 1) *end++ = values[__builtin_ctz(l)];
            }
          },
          [&](acc_t x, int64_t i) {
            const bool keep = x >= threshold;
            const acc_t e = keep ? std::exp((x - M) * static_cast<acc_t>(inv_t)) : acc_t(0);
            dst[b0 + i] = e;
            tail += e;
            if (keep && kept != nullptr) *end++ = x;
          });
      const double block = reduce_sum(sum) + tail;
      if (block_sums != nullptr) block_sums[k] = block;
      total += block;
    }
    if (kept != nullptr) kept->size = end - kept->data.get();
    return total;
  }

  // Appends the values of the entries with dst >= floor (> 0) to `out`; returns the sum of the other entries.
  double collect_above(const row_t* row, const acc_t* dst, acc_t floor, Values& out) const {
    const Vec f(floor), zero(acc_t(0));
    Vec rest = zero;
    double tail = 0;
    double* end = out.data.get() + out.size;  // (a local cursor: stores through it cannot move it)
    for_each_vec(row, V,
        [&](const Vec& x, int64_t i) {
          const Vec d = Vec::loadu(dst + i);
          const Vec big = d >= f;
          rest = rest + Vec::blendv(d, zero, big);
          uint32_t lanes = set_lanes(big);
          if (lanes == 0) return;
          acc_t values[Vec::size()];
          x.store(values);
          for (; lanes != 0; lanes &= lanes - 1) *end++ = values[__builtin_ctz(lanes)];
        },
        [&](acc_t x, int64_t i) {
          if (dst[i] >= floor) {
            *end++ = x;
          } else {
            tail += dst[i];
          }
        });
    out.size = end - out.data.get();
    return reduce_sum(rest) + tail;
  }

  // w = exp((x - M) * inv_t) in double precision for the candidates' values x; returns their sum.
  static double double_weights(const Values& x, acc_t M, double inv_t, Values& w) {
    using DVec = Vectorized<double>;
    const int64_t n = x.size;
    w.reset(n);
    w.size = n;
    const DVec it(inv_t), m(static_cast<double>(M));
    int64_t i = 0;
    for (; i + DVec::size() <= n; i += DVec::size()) ((DVec::loadu(x.data.get() + i) - m) * it).exp().store(w.data.get() + i);
    for (; i < n; ++i) w.data[i] = std::exp((x.data[i] - static_cast<double>(M)) * inv_t);
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += w.data[j];
    return sum;
  }

  // dst <- 0 where the row's value is < threshold, block sums refreshed; returns the new total.
  double drop_below(const row_t* row, acc_t threshold, acc_t* dst, double* block_sums) const {
    const Vec thr(threshold), zero(acc_t(0));
    double total = 0;
    for (int64_t b0 = 0, k = 0; b0 < V; b0 += kBlock, ++k) {
      Vec sum = zero;
      double tail = 0;
      for_each_vec(row + b0, std::min(kBlock, V - b0),
          [&](const Vec& x, int64_t i) {
            const Vec d = Vec::blendv(zero, Vec::loadu(dst + b0 + i), x >= thr);
            d.store(dst + b0 + i);
            sum = sum + d;
          },
          [&](acc_t x, int64_t i) { tail += dst[b0 + i] = x >= threshold ? dst[b0 + i] : acc_t(0); });
      const double block = reduce_sum(sum) + tail;
      if (block_sums != nullptr) block_sums[k] = block;
      total += block;
    }
    return total;
  }

  // The processed law of one row into dst (unnormalized, block sums if given): exp((x - M) / t) on the kept
  // tokens, M the masked max; the kept tokens are the allowed x >= threshold. Returns its total, 0 when no allowed
  // logit is finite (bad input, reported after the walk; M is then -inf or NaN, the threshold +inf).
  struct Law {
    double total;
    acc_t max, threshold;
  };
  Law process_row(const row_t* row, double raw_max, double inv_t, const Filters& f, const MaskRow& mask,
                  acc_t* dst, double* block_sums, Residual<acc_t>& res) const {
    const acc_t M = mask.words != nullptr ? masked_max(row, mask) : static_cast<acc_t>(raw_max);
    if (!(M > -kInf)) {
      std::fill(dst, dst + V, acc_t(0));
      if (block_sums != nullptr) std::fill(block_sums, block_sums + (V + kBlock - 1) / kBlock, 0.0);
      return {0.0, M, kInf};
    }
    const acc_t top_k_thr = top_k_on(f) ? std::max(kLowest, top_k_threshold(row, mask, f.k, res)) : kLowest;
    const acc_t min_p_thr = f.min_p > 0.0 ? min_p_threshold(M, inv_t, f.min_p) : kLowest;
    acc_t thr = std::max(top_k_thr, min_p_thr);  // (min-p's set depends on M only: the same in every order)
    if (thr == kLowest && mask.words == nullptr && !(f.top_p < 1.0)) {  // every token kept (M is not NaN: no NaN)
      return {exp_row(row, M, inv_t, dst, block_sums), M, thr};
    }
    if (!(f.top_p < 1.0)) return {exp_kept(row, mask, M, inv_t, thr, dst, block_sums, nullptr), M, thr};
    // top-p normalizes over the set `base` keeps (filter_order): the top-k set ("hf"), the min-p and top-k set
    // ("vllm"), every allowed token ("sglang"). With top-k in that set, its (few) kept tokens are the candidates;
    // else the tokens below top_p_floor (whose mass above is >= top_p Z: none is kept) are pruned first
    const acc_t base = order == FilterOrder::kHf ? top_k_thr : order == FilterOrder::kVllm ? thr : kLowest;
    Values& candidates = res.top_p_values;
    candidates.reset(V);
    const bool few = top_k_on(f) && order != FilterOrder::kSglang;
    double total = exp_kept(row, mask, M, inv_t, base, dst, block_sums, few ? &candidates : nullptr);
    double mass = 0;  // of the pruned tokens
    if (!few) {
      const double floor = top_p_floor(dst, total, f.top_p);
      mass = collect_above(row, dst, std::max(static_cast<acc_t>(floor), std::numeric_limits<acc_t>::min()),
                           candidates);
    }
    if (candidates.size > 0) {
      mass += double_weights(candidates, M, inv_t, res.top_p_weights);  // the weights that decide, in double
      thr = std::max(thr, static_cast<acc_t>(top_p_threshold(candidates.data.get(), res.top_p_weights.data.get(),
                                                             candidates.size, f.top_p * mass)));
    }
    if (thr > base) total = drop_below(row, thr, dst, block_sums);
    return {total, M, thr};
  }

  // The top logprobs' ranking: the n largest values offered, decreasing, ties by the lower id (tokens are offered in
  // increasing order: a token enters only above the n-th kept value, the equal ones kept having lower ids, and
  // after the equal ones). NaN ranks as -inf.
  static constexpr int64_t kMaxTop = 20;  // (return_logprobs <= 20, _validation)
  struct TopEntries {
    int32_t ids[kMaxTop];
    acc_t kept[kMaxTop];
    int64_t n = 0, size = 0;
    bool full = true;
    acc_t bar = -kInf;  // the n-th kept value once full
    void reset(int64_t count) {
      n = count;
      size = 0;
      full = n == 0;
      bar = n == 0 ? kInf : -kInf;  // (none enters when none is asked for)
    }
    void offer(acc_t x, int64_t v) {
      if (!(x >= kLowest)) x = -kInf;
      if (full && !(x > bar)) return;
      int64_t at = 0;
      while (at < size && !(x > kept[at])) ++at;
      for (int64_t k = std::min(size, n - 1); k > at; --k) {
        ids[k] = ids[k - 1];
        kept[k] = kept[k - 1];
      }
      ids[at] = static_cast<int32_t>(v);
      kept[at] = x;
      size = std::min(size + 1, n);
      full = size == n;
      bar = kept[size - 1];
    }
    // tokens v0 .. v0 + lanes - 1 (one comparison unless one of them enters)
    void offer_lanes(const Vec& x, int64_t v0) {
      uint32_t lanes = full ? set_lanes(x > Vec(bar)) : (1u << Vec::size()) - 1;
      if (lanes == 0) return;
      acc_t values[Vec::size()];
      x.store(values);
      for (; lanes != 0; lanes &= lanes - 1) offer(values[__builtin_ctz(lanes)], v0 + __builtin_ctz(lanes));
    }
  };

  // ------------------------------------------------------------------------------------------------
  // step 0: penalties, logit bias, min-tokens (specdec.reference.penalized_row)
  // ------------------------------------------------------------------------------------------------
  // x as computed, never fused with the next operation: vLLM rounds f * count before the subtraction (an FMA
  // would not; GCC contracts C++ by default), and the backends agree bit for bit only if every step is its own
  // rounded operation. (The empty asm makes x a value the compiler cannot see through.)
  template <typename T>
  static T unfused(T x) {
    asm volatile("" : "+m"(x));
    return x;
  }

  struct Penalty {
    acc_t repetition = 1, inv_repetition = 1, frequency = 0, presence = 0;
    bool any() const { return repetition != 1 || frequency != 0 || presence != 0; }
  };
  Penalty penalty(int64_t b) const {
    Penalty p;
    if (repetition != nullptr) {
      p.repetition = static_cast<acc_t>(repetition[b]);
      p.inv_repetition = acc_t(1) / p.repetition;
    }
    if (frequency != nullptr) p.frequency = static_cast<acc_t>(frequency[b]);
    if (presence != nullptr) p.presence = static_cast<acc_t>(presence[b]);
    return p;
  }
  // step 0's result x of a logit `given`, saturated (specdec.reference.saturated): clamped to acc_t's finite range
  // where `given` is finite (an overflow's infinity would make the law NaN), -inf kept
  static acc_t saturated(acc_t given, acc_t x) {
    constexpr acc_t top = std::numeric_limits<acc_t>::max();
    return given > -kInf ? std::min(std::max(x, -top), top) : x;
  }
  // steps a-c on one value whose token appears `count` times (output and path) and in the prompt or not; f * count
  // clamped to the finite range (inf - inf would be NaN)
  static acc_t penalize_value(acc_t x, int64_t count, bool in_prompt, const Penalty& p) {
    constexpr acc_t top = std::numeric_limits<acc_t>::max();
    if (p.repetition != 1 && (in_prompt || count > 0)) x = x * (x > 0 ? p.inv_repetition : p.repetition);
    if (p.frequency != 0) x = x - std::min(std::max(unfused(p.frequency * static_cast<acc_t>(count)), -top), top);
    if (p.presence != 0) x = x - unfused(p.presence * static_cast<acc_t>(count > 0));
    return x;
  }
  bool in_prompt(int64_t b, int64_t v) const {
    return prompt != nullptr && ((static_cast<uint32_t>(prompt[b * words() + (v >> 5)]) >> (v & 31)) & 1u);
  }

  // The draft tokens on node i's path (node 0's excluded), sorted: their multiplicities correct the counts.
  void path_tokens(int64_t b, int64_t i, std::vector<int32_t>& path) const {
    path.clear();
    for (int64_t j = i; j > 0; j = parents[b * T + j]) path.push_back(tokens[b * T + j]);
    std::sort(path.begin(), path.end());
  }

  // Request b's tokens that the penalties touch whatever the path (an output count > 0 or in the prompt), sorted,
  // with their output counts and prompt flags, and the number of tokens it generated before the tree (the sum of
  // its output counts): read once per request.
  struct OutputTokens {
    std::vector<int32_t> touched, touched_counts;
    std::vector<char> touched_in_prompt;
    int64_t generated = 0;
  };
  void output_tokens(int64_t b, OutputTokens& out) const {
    const bool counted = penalty(b).any();
    out.touched.clear();
    out.touched_counts.clear();
    out.touched_in_prompt.clear();
    out.generated = 0;
    if (counts == nullptr) return;
    const int32_t* count = counts + b * V;
    using IVec = Vectorized<int32_t>;
    int64_t v = 0;
    for (; v + IVec::size() <= V; v += IVec::size()) {  // (counts are mostly 0: the nonzero ones one by one)
      uint32_t lanes = set_lanes(at::vec::cast<float>(IVec::loadu(count + v) != IVec(0)));  // (lanes as float bits)
      for (; lanes != 0; lanes &= lanes - 1) {
        const int64_t u = v + __builtin_ctz(lanes);
        out.generated += count[u];
        if (counted) out.touched.push_back(static_cast<int32_t>(u));
      }
    }
    for (; v < V; ++v) {
      out.generated += count[v];
      if (counted && count[v] != 0) out.touched.push_back(static_cast<int32_t>(v));
    }
    if (!counted) return;
    const size_t from_counts = out.touched.size();
    for (int64_t w = 0; prompt != nullptr && w < words(); ++w) {
      for (uint32_t bits = static_cast<uint32_t>(prompt[b * words() + w]); bits != 0; bits &= bits - 1) {
        const int64_t u = w * 32 + __builtin_ctz(bits);
        if (u < V && count[u] == 0) out.touched.push_back(static_cast<int32_t>(u));
      }
    }
    std::inplace_merge(out.touched.begin(), out.touched.begin() + from_counts, out.touched.end());
    out.touched_counts.resize(out.touched.size());
    out.touched_in_prompt.resize(out.touched.size());
    for (size_t k = 0; k < out.touched.size(); ++k) {
      out.touched_counts[k] = count[out.touched[k]];
      out.touched_in_prompt[k] = in_prompt(b, out.touched[k]);
    }
  }

  // dst = node i's row src after step 0 (raw_max: src's max, NaN if it holds one, found by the copy when not
  // raw_max_known; `path`, `special`: scratch); returns its max. vLLM's order: the logit bias (entries in the order
  // given, each addition rounded), min-tokens' stop tokens at -inf, then the penalties with the counts of the output
  // and the path. Every token outside out.touched, the path, the bias and the stop tokens is left as it is (its
  // penalties subtract 0): dst is a copy of src with those few tokens computed again from src (the special ones last,
  // over the output's), and its max is src's unless a changed token held it. raw_top (or null): ranks src's values
  // for the top logprobs.
  double penalize(int64_t b, int64_t i, const scalar_t* src, acc_t* dst, acc_t& raw_max, bool raw_max_known,
                  const OutputTokens& out, std::vector<int32_t>& path, std::vector<int32_t>& special,
                  TopEntries* raw_top) const {
    const Penalty p = penalty(b);
    const bool counted = p.any();
    const int32_t* count = counts != nullptr ? counts + b * V : nullptr;
    if (raw_top == nullptr && raw_max_known) {
      load_row(src, dst, V);
    } else {  // (the copy ranks src for the top logprobs, or finds its max, as it goes)
      Vec lanes_max(-kInf), lanes_max2(-kInf);  // (two chains of maxima: one is latency-bound)
      acc_t tail_max = -kInf;
      for_each_vec(src, V,
          [&](const Vec& x, int64_t v) {
            x.store(dst + v);
            if (raw_top != nullptr) raw_top->offer_lanes(x, v);
            if ((v / Vec::size()) % 2 == 0) {
              lanes_max = at::vec::maximum(lanes_max, x);
            } else {
              lanes_max2 = at::vec::maximum(lanes_max2, x);
            }
          },
          [&](acc_t x, int64_t v) {
            dst[v] = x;
            if (raw_top != nullptr) raw_top->offer(x, v);
            tail_max = std::isnan(tail_max) || x <= tail_max ? tail_max : x;  // (NaN sticks)
          });
      if (!raw_max_known) {
        auto maximum = [](Vec x, Vec y) { return at::vec::maximum(x, y); };
        const acc_t lanes = at::vec::vec_reduce_all<acc_t>(maximum, at::vec::maximum(lanes_max, lanes_max2));
        raw_max = std::isnan(lanes) || std::isnan(tail_max) ? std::numeric_limits<acc_t>::quiet_NaN()
                                                            : std::max(lanes, tail_max);
      }
    }
    path_tokens(b, i, path);
    const bool stopping = min_tokens != nullptr && out.generated + static_cast<int64_t>(path.size()) < min_tokens[b];
    special.assign(path.begin(), path.end());
    for (int64_t k = 0; k < num_bias; ++k) special.push_back(bias_ids[b * num_bias + k]);
    for (int64_t k = 0; stopping && k < num_stop; ++k) special.push_back(stop_ids[b * num_stop + k]);
    std::sort(special.begin(), special.end());
    special.erase(std::unique(special.begin(), special.end()), special.end());
    const acc_t old_max = static_cast<acc_t>(raw_max);
    bool held_max = std::isnan(old_max);  // a changed token held src's max (then dst's is computed again)
    acc_t new_max = -kInf;  // of the changed tokens (NaN sticks)
    auto changed = [&](int64_t v, acc_t x) {
      held_max |= static_cast<acc_t>(src[v]) == old_max;
      new_max = std::isnan(new_max) || x <= new_max ? new_max : x;
      dst[v] = x;
    };
    const int64_t num_touched = static_cast<int64_t>(out.touched.size());
    int64_t touched_argmax = -1;  // the token of new_max among the output's (its value may be replaced below)
    for (int64_t k = 0; k < num_touched; ++k) {
      const int32_t v = out.touched[k];
      const acc_t given = static_cast<acc_t>(src[v]);
      const acc_t x = saturated(given, penalize_value(given, out.touched_counts[k], out.touched_in_prompt[k], p));
      if (!(x <= new_max) && !std::isnan(new_max)) touched_argmax = v;
      changed(v, x);
    }
    if (touched_argmax >= 0 && std::binary_search(special.begin(), special.end(), touched_argmax)) {
      held_max = true;  // (new_max may be a value replaced by the special tokens' loop: computed again)
    }
    for (const int32_t v : special) {
      if (v < 0) continue;  // (padding)
      const acc_t given = static_cast<acc_t>(src[v]);
      acc_t x = given;
      for (int64_t k = 0; k < num_bias; ++k) {
        if (bias_ids[b * num_bias + k] == v) x = x + static_cast<acc_t>(bias_values[b * num_bias + k]);
      }
      if (counted) {
        const auto on_path = std::equal_range(path.begin(), path.end(), v);
        x = penalize_value(x, int64_t{count[v]} + (on_path.second - on_path.first), in_prompt(b, v), p);
      }
      x = saturated(given, x);
      // (the stop tokens after the penalties, which keep a -inf as it is: the same as vLLM's order)
      for (int64_t k = 0; stopping && k < num_stop; ++k) {
        if (stop_ids[b * num_stop + k] == v) x = -kInf;
      }
      changed(v, x);
    }
    if (held_max) {
      auto maximum = [](Vec x, Vec y) { return at::vec::maximum(x, y); };
      return static_cast<double>(at::vec::reduce_all<acc_t>(maximum, dst, V));
    }
    return static_cast<double>(std::isnan(new_max) ? new_max : std::max(old_max, new_max));
  }

  // Whether min-tokens leaves request b's real node i (generated + depth tokens so far) a finite allowed token of
  // its raw row (_validation.check_rows_after_min_tokens; the rows after step 0 are not checked, like there).
  bool stop_leaves_a_token(int64_t b, int64_t i, int64_t generated, std::vector<int32_t>& path,
                           std::vector<char>& stop) const {
    path_tokens(b, i, path);
    if (generated + static_cast<int64_t>(path.size()) >= min_tokens[b]) return true;
    const scalar_t* row = target + (row_offsets[b] + i) * V;
    const MaskRow mask{bitmask != nullptr ? bitmask + (row_offsets[b] + i) * words() : nullptr};
    for (int64_t v = 0; v < V; ++v) {
      if (!stop[v] && mask.allowed(v) && static_cast<acc_t>(row[v]) > -kInf) return true;
    }
    return false;
  }

  // ------------------------------------------------------------------------------------------------
  // logprobs
  // ------------------------------------------------------------------------------------------------
  // Request b's logprobs (specdec.reference.log_law): at emitted position j (0..length), the log-law of its parent
  // row at the emitted token (the next accepted node's, then next_token); the num_top largest entries ranked by the
  // row's values (not by rounded logprobs), ties by the lower id, and the emitted token's rank (the entries whose
  // value is at least its own; its value is known before the pass). A position's log-law is log_softmax(values *
  // scale), values being the row's allowed entries >= threshold (the others, and NaN, at -inf) and m their max
  // (known from the walk): one pass over the row gives the exp sum, the top entries and the rank.
  struct LogLaw {
    double m, scale, log_sum;
    acc_t threshold;
    MaskRow mask;
    template <typename E>
    double at(const E* row, int64_t v) const {
      const acc_t x = static_cast<acc_t>(row[v]);
      const double value = mask.allowed(v) && x >= threshold ? static_cast<double>(x) : -kInfDouble;
      return (value - m) * scale - log_sum;
    }
  };
  static constexpr double kInfDouble = std::numeric_limits<double>::infinity();

  // Position j of request b: row (the raw row, or node's row after step 0), its mask, threshold, max m and scale as
  // above; writes the emitted token's logprob, its rank and the top entries. known_total (> 0, or 0: unknown): the
  // exp sum when the walk's law is this log-law (its total), so the pass only ranks.
  template <typename E>
  void write_position(int64_t b, int64_t j, const E* row, const MaskRow& mask, acc_t threshold, double m, double scale,
                      int64_t emitted, double known_total = 0) const {
    TopEntries top;
    top.reset(std::min(num_top, V));
    const acc_t given_emitted = static_cast<acc_t>(row[emitted]);
    const acc_t emitted_value = mask.allowed(emitted) && given_emitted >= threshold ? given_emitted : -kInf;
    const bool count = emitted_value > -kInf;  // (else every entry is at least its value: rank V)
    const Vec vm(static_cast<acc_t>(m)), vs(static_cast<acc_t>(scale)), thr(threshold), zero(acc_t(0)), none(-kInf);
    const Vec ve(emitted_value), one(acc_t(1));
    // at least the emitted token's value: counted in float lanes (exact below 2^24 per lane)
    Vec at_least = zero;
    int64_t at_least_tail = 0;
    if (known_total > 0) {
      masked_for_each(row, 0, V, mask,
          [&](const Vec& given, int64_t i) {
            const Vec x = Vec::blendv(none, given, given >= thr);
            if (count) at_least = at_least + Vec::blendv(zero, one, x >= ve);
            top.offer_lanes(x, i);
          },
          [&](acc_t given, int64_t i) {
            const acc_t x = given >= threshold ? given : -kInf;
            at_least_tail += count && x >= emitted_value;
            top.offer(x, i);
          });
      ranks[b * T + j] = count ? static_cast<int64_t>(reduce_sum(at_least)) + at_least_tail : V;
      write_entries(b, j, row, LogLaw{m, scale, std::log(known_total), threshold, mask}, top, emitted);
      return;
    }
    double total = 0;
    for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
      Vec sum = zero;
      double tail = 0;
      masked_for_each(row, b0, std::min(kBlock, V - b0), mask,
          [&](const Vec& given, int64_t i) {
            const Vec keep = given >= thr;  // (NaN: dropped)
            const Vec x = Vec::blendv(none, given, keep);
            sum = sum + Vec::blendv(zero, ((x - vm) * vs).exp_u20(), keep);
            if (count) at_least = at_least + Vec::blendv(zero, one, x >= ve);
            top.offer_lanes(x, b0 + i);
          },
          [&](acc_t given, int64_t i) {
            const bool keep = given >= threshold;
            const acc_t x = keep ? given : -kInf;
            tail += keep ? std::exp((x - static_cast<acc_t>(m)) * static_cast<acc_t>(scale)) : acc_t(0);
            at_least_tail += count && x >= emitted_value;
            top.offer(x, b0 + i);
          });
      total += reduce_sum(sum) + tail;
    }
    ranks[b * T + j] = count ? static_cast<int64_t>(reduce_sum(at_least)) + at_least_tail : V;
    write_entries(b, j, row, LogLaw{m, scale, std::log(total), threshold, mask}, top, emitted);
  }

  // The rank of `emitted` in a raw row (the entries at least its value; NaN entries never are), for the positions
  // whose top entries and exp sum came from the walk (step 0's copy of the row, and the law's total): the token is
  // drawn after that copy, so its rank takes a pass of its own.
  template <typename E>
  int64_t raw_rank(const E* row, int64_t emitted) const {
    const acc_t value = static_cast<acc_t>(row[emitted]);
    if (std::isnan(value)) return V;  // (as write_position: a dropped entry's value is -inf)
    const Vec ve(value), zero(acc_t(0)), one(acc_t(1));
    Vec at_least = zero;
    int64_t tail = 0;
    for_each_vec(row, V, [&](const Vec& x, int64_t) { at_least = at_least + Vec::blendv(zero, one, x >= ve); },
                 [&](acc_t x, int64_t) { tail += x >= value; });
    return static_cast<int64_t>(reduce_sum(at_least)) + tail;
  }

  template <typename E>
  void write_entries(int64_t b, int64_t j, const E* row, const LogLaw& law, const TopEntries& top,
                     int64_t emitted) const {
    logprobs[b * T + j] = static_cast<float>(law.at(row, emitted));
    for (int64_t k = 0; k < top.n; ++k) {
      const double value = static_cast<double>(top.kept[k]);
      top_logprobs[(b * T + j) * num_top + k] = static_cast<float>((value - law.m) * law.scale - law.log_sum);
      top_ids[(b * T + j) * num_top + k] = top.ids[k];
    }
  }

  // Position j of request b whose parent row is node i's, the emitted token `emitted`: "raw" reads the row as given
  // (its max from pass 1); "processed" the row after step 0 (`row`, with `max` its unmasked max) at the processed
  // law's threshold (`threshold`, kLowest when unfiltered, and the law's masked max `law_max`) or, greedy, masked
  // at temperature 1.
  // law_total (> 0, or 0: unknown): the total of the walk's law at the node, which the processed log-law of a
  // sampling request normalizes by (the same kept tokens, max and temperature), and the raw one too when the law is
  // the raw row's at temperature 1 (no step 0, no mask, no token dropped).
  void write_position_of(int64_t b, int64_t j, int64_t i, int64_t emitted, const row_t* row, acc_t law_max,
                         acc_t threshold, bool greedy, double inv_t, const Filters& f, double law_total = 0) const {
    const int64_t given = row_offsets[b] + i;
    if (!processed_logprobs) {
      const bool same_law = !greedy && !penalized && inv_t == 1.0 && f.mask == nullptr && threshold == kLowest;
      write_position(b, j, target + given * V, MaskRow{}, kLowest, target_max[given], 1.0, emitted,
                     same_law ? law_total : 0.0);
      return;
    }
    const MaskRow mask{f.mask != nullptr ? f.mask + i * words() : nullptr};
    write_position(b, j, row, mask, greedy ? kLowest : threshold, static_cast<double>(law_max), greedy ? 1.0 : inv_t,
                   emitted, greedy ? 0.0 : law_total);
  }

  // A node's laws (Accept::run's `laws`): their totals, the target's (masked) max M, and the target row they were
  // computed from (after step 0 when it is on: res' scratch, valid until the next call).
  struct NodeLaws {
    double r_sum, q_sum;
    acc_t max;
    const row_t* target_row;
    acc_t threshold;  // the target law keeps the allowed values >= threshold
  };

  // The raw row's log exp sum at temperature 1 (shifted by its max m) from its node's law, when that law is
  // exp(x - M) over every token of the row after step 0 (no mask, no token dropped): that row is the raw row but for
  // the tokens step 0 changed (out.touched, and `special`: the node's path, bias and stop tokens, as penalize left
  // them), so sum exp(raw - m) = exp(M - m) (Z - the law over the changed) + sum over the changed of exp(raw - m).
  // False (not known) when the changed tokens hold half the law's mass or more (the difference would lose digits),
  // or M and m are far apart (the law's small entries may have underflowed).
  bool raw_log_sum_from_law(const scalar_t* raw, double m, const NodeLaws& law, const acc_t* r, const OutputTokens& out,
                            const std::vector<int32_t>& special, std::vector<double>& shifted, double& log_sum) const {
    const double M = static_cast<double>(law.max);
    if (!(law.threshold == kLowest) || !(law.r_sum > 0) || !(std::abs(M - m) <= 20)) return false;  // (NaN: false)
    double changed_law = 0;
    shifted.clear();  // the changed tokens' raw - m
    auto add = [&](int64_t v) {
      changed_law += static_cast<double>(r[v]);
      shifted.push_back(static_cast<double>(static_cast<acc_t>(raw[v])) - m);
    };
    for (const int32_t v : out.touched) add(v);
    for (const int32_t v : special) {
      if (v >= 0 && !std::binary_search(out.touched.begin(), out.touched.end(), v)) add(v);
    }
    if (!(changed_law <= 0.5 * law.r_sum)) return false;
    using DVec = Vectorized<double>;
    DVec lanes(0.0);
    const int64_t n = static_cast<int64_t>(shifted.size());
    int64_t k = 0;
    for (; k + DVec::size() <= n; k += DVec::size()) lanes = lanes + DVec::loadu(shifted.data() + k).exp();
    double changed_raw = at::vec::vec_reduce_all<double>(std::plus<DVec>(), lanes);
    for (; k < n; ++k) changed_raw += std::exp(shifted[k]);
    log_sum = std::log(std::exp(M - m) * (law.r_sum - changed_law) + changed_raw);
    return true;
  }

  // The positions of a sampling walk that did not write them as it went (block and traversal verification): node
  // rows computed again. node_row(i): node i's target row after step 0 and its max.
  template <typename NodeRowFn>
  void write_logprobs(int64_t b, int64_t length, int64_t token, const Filters& f, bool filtered, double inv_t,
                      Residual<acc_t>& res, NodeRowFn&& node_row) const {
    for (int64_t j = 0; j <= length; ++j) {
      const int64_t i = accepted[b * T + j];
      const int64_t emitted = j < length ? tokens[b * T + accepted[b * T + j + 1]] : token;
      if (!processed_logprobs) {
        write_position_of(b, j, i, emitted, nullptr, 0, kLowest, false, inv_t, f);
        continue;
      }
      const auto [row, max] = node_row(i);
      const MaskRow mask{f.mask != nullptr ? f.mask + i * words() : nullptr};
      acc_t law_max = mask.words != nullptr ? masked_max(row, mask) : static_cast<acc_t>(max), threshold = kLowest;
      if (filtered) {
        const Law law = process_row(row, max, inv_t, f, mask, res.r.data(), nullptr, res);
        law_max = law.max;
        threshold = law.threshold;
      }
      write_position_of(b, j, i, emitted, row, law_max, threshold, false, inv_t, f);
    }
  }

  // Whether an allowed entry of the row is finite (the value check of a masked row).
  bool any_allowed_finite(const scalar_t* row, const int32_t* words_row) const {
    for (int64_t w = 0; w < words(); ++w) {
      uint32_t bits = static_cast<uint32_t>(words_row[w]);
      if (w == words() - 1 && V % 32 != 0) bits &= (1u << (V % 32)) - 1;
      for (; bits != 0; bits &= bits - 1) {
        if (static_cast<acc_t>(row[w * 32 + __builtin_ctz(bits)]) > -kInf) return true;
      }
    }
    return false;
  }

  // sum_x max(w r[x] / r_sum - q[x] / q_sum, 0): block verification's residual mass at weight w (an empty
  // row's law counts as 0).
  double weighted_residual_mass(const Residual<acc_t>& res, double w, double r_sum, double q_sum) const {
    const acc_t* r = res.r.data();
    const acc_t* q = res.q.data();
    const acc_t a = static_cast<acc_t>(r_sum > 0 ? w / r_sum : 0.0), c = static_cast<acc_t>(q_sum > 0 ? 1.0 / q_sum : 0.0);
    const Vec va(a), vc(c), zero(acc_t(0));
    Vec sum = zero;
    int64_t i = 0;
    for (; i + Vec::size() <= V; i += Vec::size()) {
      sum = sum + at::vec::maximum(at::vec::fmsub(Vec::loadu(r + i), va, Vec::loadu(q + i) * vc), zero);
    }
    double tail = 0;
    for (; i < V; ++i) tail += std::max(r[i] * a - q[i] * c, acc_t(0));
    return reduce_sum(sum) + tail;
  }

  // Block verification of request b's chain (Sun et al., arXiv 2403.10444, Algorithm 2; the reference's
  // block_weights): node i's laws P_i, Q_i in turn; h_i from the weight p_i = min(p_{i-1} P_{i-1}(X_i) /
  // Q_{i-1}(X_i), 1) and the mass of max(p_i P_i - Q_i, 0) (h_gamma = p_gamma); tau = the last i with
  // u_i < h_i. A weight of 0 ends the loop (every later h is 0). Then the next token from max(p_tau P_tau -
  // Q_tau, 0) (tau = gamma: P_gamma), node tau's rows computed again. Returns (tau, token).
  template <typename LawsFn>
  std::pair<int64_t, int64_t> walk_block(int64_t b, int64_t n, const Filters& f, RequestRng& rng,
                                         Residual<acc_t>& res, LawsFn&& laws) const {
    const int64_t gamma = n - 1;
    double w = 1.0, w_tau = 1.0;
    int64_t tau = 0;
    for (int64_t i = 0; i <= gamma; ++i) {
      const auto [r_sum, q_sum, M, target_row, threshold] = laws(i, i < gamma);
      if (i > 0) {
        double h = w;
        if (i < gamma) {
          const double s = weighted_residual_mass(res, w, r_sum, q_sum);
          h = s + 1.0 - w > 0 ? s / (s + 1.0 - w) : 1.0;
        }
        if (rng.uniform() < h) {
          tau = i;
          w_tau = w;
        }
      }
      if (i == gamma) break;
      const int64_t x = tokens[b * T + i + 1];
      const double big = r_sum > 0 ? res.r[x] / r_sum : 0.0, small = q_sum > 0 ? res.q[x] / q_sum : 0.0;
      const double ratio = small > 0 ? big / small : big > 0 ? std::numeric_limits<double>::infinity() : 0.0;
      w = w == 0.0 ? 0.0 : std::min(w * ratio, 1.0);
      if (w == 0.0) break;
    }
    const auto [r_sum, q_sum, M, target_row, threshold] = laws(tau, tau < gamma);
    const double total = tau == gamma ? r_sum : subtract_residual(res, r_sum, q_sum * w_tau);
    const double u = rng.uniform();
    if (total > 0) return {tau, sample(res, total, u)};
    // no law to draw from: an empty row emits 0, a residual of probability 0 (by rounding) the argmax
    if (!(r_sum > 0)) return {tau, 0};
    return {tau, first_allowed_max(target_row, MaskRow{f.mask != nullptr ? f.mask + tau * words() : nullptr}, M)};
  }

  // Traversal verification of request b's tree (the reference's _traversal_verify): post-order visits from
  // the root with weight 1. A node's current law is max(P - c Q, 0) / Z(c) (c = 0, Z = 1: P itself) and it
  // has a weight w; child x is visited with min(w L(x) / Q(x), 1); after a child's subtree failed,
  // c' = c + Z / w, S = w Z(c') / Z and w' = S / (S + 1 - w) (one pass over the node's rows); after its last
  // child a node emits with probability w (the root always: its w stays 1), else it fails to its parent. A
  // node of weight 0 fails at once, unread. res holds one node's rows at a time: `load` recomputes them (and
  // the residual at its c) when the walk comes back from a child that overwrote them. Returns (node, token).
  template <typename LawsFn>
  std::pair<int64_t, int64_t> walk_traversal(int64_t b, int64_t n, const std::vector<int64_t>& first_child,
                                             const std::vector<int64_t>& next_sibling, const Filters& f,
                                             RequestRng& rng, Residual<acc_t>& res, LawsFn&& laws) const {
    struct Node {
      double c = 0, z = 1, w = 0, r_sum = 0, q_sum = 0;
      acc_t max = 0;
      const row_t* row = nullptr;  // the target row the law was computed from (valid while res holds it)
      int64_t next_child = -1;
    };
    std::vector<Node> nodes(n);
    int64_t loaded = -1;   // the node whose rows res holds, ...
    double loaded_c = 0;   // ... as max(P - loaded_c Q, 0), with r in P's scale (loaded_c > 0) or raw (0)
    // res.r <- node v's current residual; returns its total in r's scale (r_sum raw, Z(c) after a residual)
    auto load = [&](int64_t v, double c) {
      Node& node = nodes[v];
      if (loaded != v) {
        const auto [r_sum, q_sum, M, target_row, threshold] = laws(v, first_child[v] >= 0);
        node.r_sum = r_sum;
        node.q_sum = q_sum;
        node.max = M;
        node.row = target_row;
        loaded = v;
        loaded_c = 0;
      }
      if (c > loaded_c && node.r_sum > 0 && node.q_sum > 0) {  // max(P - c Q, 0) from max(P - loaded_c Q, 0)
        subtract_residual(res, loaded_c > 0 ? 1.0 : node.r_sum, node.q_sum / (c - loaded_c));
        loaded_c = c;
      }
      double total = 0;
      for (const double s : res.block_sums) total += s;
      return loaded_c > 0 ? total : node.r_sum;
    };
    auto emit = [&](int64_t v) -> std::pair<int64_t, int64_t> {
      const double total = load(v, nodes[v].c);
      const double u = rng.uniform();
      if (total > 0) return {v, sample(res, total, u)};
      // no law to draw from: an empty row emits 0, a residual of probability 0 (by rounding) the argmax
      if (!(nodes[v].r_sum > 0)) return {v, 0};
      return {v, first_allowed_max(nodes[v].row, MaskRow{f.mask != nullptr ? f.mask + v * words() : nullptr},
                                   nodes[v].max)};
    };
    int64_t v = 0;
    double w = 1.0;
    bool entering = true;  // else v's child failed: update v, then its next child
    for (;;) {
      if (entering) {
        if (w == 0.0) {  // nothing below v can be emitted: fail, unread
          entering = false;
          v = parents[b * T + v];
          continue;
        }
        if (first_child[v] < 0) {  // a leaf emits from its own P with probability w
          if (rng.uniform() < w) return emit(v);
          entering = false;
          v = parents[b * T + v];
          continue;
        }
        nodes[v].w = w;
        nodes[v].c = 0;
        nodes[v].z = 1;
        nodes[v].next_child = first_child[v];
      } else {
        Node& node = nodes[v];
        const double c = node.c + node.z / node.w;  // (w > 0 here)
        const double z_next = load(v, c);
        const double s = node.z > 0 && node.q_sum > 0 ? node.w * z_next / node.z : 0.0;
        node.w = s + 1.0 - node.w > 0 ? s / (s + 1.0 - node.w) : 1.0;
        node.c = c;
        node.z = z_next;
        if (node.w == 0.0) {
          v = parents[b * T + v];
          continue;
        }
      }
      Node& node = nodes[v];
      const int64_t child = node.next_child;
      if (child < 0) {  // every child failed: v emits from its residual with probability w (the root: 1)
        if (v == 0 || rng.uniform() < node.w) return emit(v);
        entering = false;
        v = parents[b * T + v];
        continue;
      }
      node.next_child = next_sibling[child];
      const double total = load(v, node.c);
      const int64_t x = tokens[b * T + child];
      const double big = total > 0 ? res.r[x] / total : 0.0, small = node.q_sum > 0 ? res.q[x] / node.q_sum : 0.0;
      w = big == 0.0 ? 0.0 : small == 0.0 ? 1.0 : std::min(node.w * big / small, 1.0);
      v = child;
      entering = true;
    }
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
    const bool greedy = temperature[b] < kGreedyBelow;
    const double inv_t = greedy ? 1.0 : 1.0 / temperature[b];  // (<= 1e5)
    RequestRng rng(seeds[b], offset + offsets[b]);
    acc_t *r = res.r.data(), *q = res.q.data();
    // scanned[0 / 1][i]: the lazy statistics of node i's target / draft row are known (step 0's copy of a row finds
    // them as it goes: node_row)
    std::vector<bool> scanned[2] = {std::vector<bool>(lazy_target != nullptr ? T : 0, false),
                                    std::vector<bool>(lazy_draft != nullptr ? T : 0, false)};
    auto scan_row = [&](int64_t i, bool of_draft) {
      const RowStats<scalar_t>* stats = of_draft ? lazy_draft : lazy_target;
      if (stats == nullptr || scanned[of_draft][i]) return;
      scanned[of_draft][i] = true;
      stats->compute(row_offsets[b] + i, row_offsets[b] + i + 1);
    };
    auto scan = [&](int64_t i) {
      scan_row(i, false);
      scan_row(i, true);
    };
    const Filters f = filters(b);
    const bool filtered = any(f) || penalized;  // else the plain path, as without the filters
    OutputTokens output;
    output_tokens(b, output);
    std::vector<int32_t> path, special;
    TopEntries* rank_raw = nullptr;  // when set, step 0 of a target row ranks the raw row into it
    // Node i's target (draft: `of_draft`) row as the laws read it, after step 0 when it is on, and its max.
    auto node_row = [&](int64_t i, bool of_draft) -> std::pair<const row_t*, double> {
      const int64_t row = row_offsets[b] + i;
      const scalar_t* given = (of_draft ? draft : target) + row * V;
      if constexpr (std::is_same_v<row_t, acc_t>) {
        if (penalized) {
          acc_t* dst = of_draft ? res.penalized_q.data() : res.penalized_r.data();
          const RowStats<scalar_t>* stats = of_draft ? lazy_draft : lazy_target;
          const bool known = stats == nullptr || scanned[of_draft][i];
          acc_t raw_max = known ? static_cast<acc_t>((of_draft ? draft_max : target_max)[row]) : acc_t(0);
          const double max = penalize(b, i, given, dst, raw_max, known, output, path, special,
                                      of_draft ? nullptr : rank_raw);
          if (!known) {
            scanned[of_draft][i] = true;
            stats->record(row, raw_max);
          }
          return {dst, max};
        }
      }
      if constexpr (std::is_same_v<row_t, scalar_t>) {
        return {given, (of_draft ? draft_max : target_max)[row]};
      } else {  // (16-bit rows are read as acc_t only with step 0 on)
        TORCH_INTERNAL_ASSERT(false, "specdec::accept: acc_t rows without step 0");
        return {nullptr, 0.0};
      }
    };
    int64_t node = 0, length = 0, token = -1;
    accepted[b * T] = 0;
    // Node i's processed target law into res.r (block sums refreshed) and, when `with_q`, the draft's into res.q.
    auto laws = [&](int64_t i, bool with_q) {
      const MaskRow mask{f.mask != nullptr ? f.mask + i * words() : nullptr};
      if (!penalized) scan(i);  // (else node_row finds the statistics of the rows it reads)
      const auto [target_row, max] = node_row(i, false);
      NodeLaws out{0.0, 0.0, static_cast<acc_t>(max), target_row, kLowest};
      if (filtered) {
        const Law law = process_row(target_row, max, inv_t, f, mask, r, res.block_sums.data(), res);
        out.r_sum = law.total;
        out.max = law.max;
        out.threshold = law.threshold;
      } else {
        out.r_sum = exp_row(target_row, max, inv_t, r, res.block_sums.data());
      }
      if (with_q) {
        const auto [draft_row, q_max] = node_row(i, true);
        out.q_sum = filtered ? process_row(draft_row, q_max, inv_t, f, mask, q, nullptr, res).total
                             : exp_row(draft_row, q_max, inv_t, q, nullptr);
      }
      return out;
    };
    if (block && !greedy) {
      const auto [tau, drawn] = walk_block(b, n, f, rng, res, laws);
      for (int64_t i = 1; i <= tau; ++i) accepted[b * T + i] = static_cast<int32_t>(i);
      length = tau;
      token = drawn;
    }
    if (traversal && !greedy) {
      const auto [last, drawn] = walk_traversal(b, n, first_child, next_sibling, f, rng, res, laws);
      for (int64_t i = last; i > 0; i = parents[b * T + i]) ++length;
      for (int64_t i = last, k = length; i > 0; i = parents[b * T + i], --k) accepted[b * T + k] = static_cast<int32_t>(i);
      token = drawn;
    }
    while (!((block || traversal) && !greedy)) {
      const MaskRow mask{f.mask != nullptr ? f.mask + node * words() : nullptr};
      if (!penalized) scan(node);  // (else node_row finds the statistics of the rows it reads)
      int64_t chosen = -1;
      if (greedy) {
        // greedy: the argmax of the row after step 0 and the mask (top-k, top-p and min-p never remove it)
        const auto [target_row, max] = node_row(node, false);
        const bool masked = mask.words != nullptr || penalized;
        const acc_t M = mask.words != nullptr ? masked_max(target_row, mask) : static_cast<acc_t>(max);
        const bool empty = masked && !(M > -kInf);  // nothing allowed: stop, emit 0
        token = empty ? 0 : first_allowed_max(target_row, mask, M);
        for (int64_t c = empty ? -1 : first_child[node]; c >= 0 && chosen < 0; c = next_sibling[c]) {
          if (tokens[b * T + c] == token) chosen = c;
        }
        if (num_top >= 0) write_position_of(b, length, node, token, target_row, M, kLowest, true, inv_t, f);
      } else {
        // a leaf's draft row is never needed: only the target law is sampled there; an empty target row
        // (bad input) accepts nothing
        // raw logprobs at temperature 1, step 0 on, no mask: step 0's copy of the row ranks the raw row, and the exp
        // sum comes from the law's (raw_log_sum_from_law) when it can
        const bool raw_from_law = num_top >= 0 && !processed_logprobs && penalized && inv_t == 1.0 && f.mask == nullptr;
        TopEntries raw_top;
        if (raw_from_law) {
          raw_top.reset(std::min(num_top, V));
          rank_raw = &raw_top;
        }
        const NodeLaws law = laws(node, draft != nullptr && first_child[node] >= 0);
        rank_raw = nullptr;
        const scalar_t* raw_row = target + (row_offsets[b] + node) * V;
        const double raw_max = target_max[row_offsets[b] + node];
        double raw_log_sum = 0;
        const bool raw_known = raw_from_law && raw_log_sum_from_law(raw_row, raw_max, law, r, output, special,
                                                                    res.changed_values, raw_log_sum);
        double r_sum = law.r_sum;
        const double q_sum = law.q_sum;
        const bool empty = filtered && !(r_sum > 0);
        const bool use_draft = draft != nullptr && first_child[node] >= 0 && !empty;
        for (int64_t c = empty ? -1 : first_child[node]; c >= 0 && chosen < 0; c = next_sibling[c]) {
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
          // r_sum <= 0 after a rejection: r == q, a rejection of probability 0 happened by rounding
          token = r_sum > 0 ? sample(res, r_sum, rng.uniform())
                  : empty   ? 0
                            : first_allowed_max(law.target_row, mask, law.max);
        }
        const int64_t emitted = chosen >= 0 ? tokens[b * T + chosen] : token;
        if (raw_known) {
          write_entries(b, length, raw_row, LogLaw{raw_max, 1.0, raw_log_sum, kLowest, MaskRow{}}, raw_top, emitted);
          ranks[b * T + length] = raw_rank(raw_row, emitted);
        } else if (num_top >= 0) {  // (the row is still res' when step 0 is on: the next node's is not read yet)
          write_position_of(b, length, node, emitted, law.target_row, law.max, law.threshold, false, inv_t, f,
                            law.r_sum);
        }
      }
      if (chosen < 0) break;
      accepted[b * T + ++length] = static_cast<int32_t>(chosen);
      node = chosen;
    }
    for (int64_t i = 0; i < (packed ? n : T); ++i) scan(i);  // (a padded request's padding rows are its own)
    if (f.mask != nullptr) {  // the value check of masked rows (reported after the walk)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = row_offsets[b] + i;
        masked_empty[0][row] = !any_allowed_finite(target + row * V, f.mask + i * words());
        if (draft != nullptr) masked_empty[1][row] = !any_allowed_finite(draft + row * V, f.mask + i * words());
      }
    }
    if (stopped_empty != nullptr) {  // the value check of min-tokens (reported after the walk)
      std::vector<char> stop(V, 0);
      for (int64_t k = 0; k < num_stop; ++k) {
        if (stop_ids[b * num_stop + k] >= 0) stop[stop_ids[b * num_stop + k]] = 1;
      }
      for (int64_t i = 0; i < n; ++i) {
        stopped_empty[row_offsets[b] + i] = !stop_leaves_a_token(b, i, output.generated, path, stop);
      }
    }
    num_accepted[b] = static_cast<int32_t>(length);
    next_tokens[b] = token;
    if (num_top >= 0 && (block || traversal) && !greedy) {  // (the token-wise walk wrote them as it went)
      write_logprobs(b, length, token, f, filtered, inv_t, res, [&](int64_t i) { return node_row(i, false); });
    }
  }
};

template <typename T>
const T* data_or_null(const Tensor& x) {
  return x.defined() ? x.const_data_ptr<T>() : nullptr;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> accept_cpu(
    const Tensor& target_in, const Tensor& tokens, const Tensor& parents, const std::optional<Tensor>& draft_in,
    const Tensor& temperature, const Tensor& seeds, const Tensor& num_nodes, int64_t offset,
    const std::optional<Tensor>& offsets, const std::optional<Tensor>& top_k, const std::optional<Tensor>& top_p,
    const std::optional<Tensor>& min_p, const std::optional<Tensor>& token_bitmask, c10::string_view method, bool probs,
    const std::optional<Tensor>& row_offsets, const std::optional<Tensor>& repetition_penalty,
    const std::optional<Tensor>& frequency_penalty, const std::optional<Tensor>& presence_penalty,
    const std::optional<Tensor>& output_token_counts, const std::optional<Tensor>& prompt_token_mask,
    const std::optional<Tensor>& logit_bias_ids, const std::optional<Tensor>& logit_bias_values,
    const std::optional<Tensor>& min_tokens, const std::optional<Tensor>& stop_token_ids, c10::string_view filter_order,
    int64_t return_logprobs, c10::string_view logprobs_mode) {
  AcceptInputs in = check_accept(target_in, tokens, parents, draft_in, temperature, seeds, num_nodes, offset, offsets,
                                 top_k, top_p, min_p, token_bitmask, method, probs, row_offsets, repetition_penalty,
                                 frequency_penalty, presence_penalty, output_token_counts, prompt_token_mask,
                                 logit_bias_ids, logit_bias_values, min_tokens, stop_token_ids, filter_order,
                                 return_logprobs, logprobs_mode);
  const int64_t B = tokens.size(0), T = tokens.size(1), V = target_in.size(-1);
  const char* target_name = probs ? "target_probs" : "target_logits";
  const char* draft_name = probs ? "draft_probs" : "draft_logits";
  // mixed target/draft dtypes: both promoted (exactly) to a common one, so q is the drafter's own law
  auto dtype = draft_in.has_value() ? c10::promoteTypes(target_in.scalar_type(), draft_in->scalar_type())
                                    : target_in.scalar_type();
  // probabilities: the walk runs on their logs (log 0 = -inf), taken in float64 as the reference takes them (a
  // float32 log rounds probabilities one ulp apart to one value: greedy's argmax took the first of them);
  // negative entries are reported first, NaN / +inf / empty rows by the walk's own row checks
  if (probs) dtype = at::kDouble;
  const bool penalized = in.step0();
  auto laws_of = [&](const Tensor& x, const char* name) {
    if (!probs) return x.to(dtype).contiguous();
    TORCH_CHECK_VALUE(!x.lt(0).any().item<bool>(), name, ": contains a negative value");
    return x.to(dtype).log().contiguous();
  };
  const Tensor target = laws_of(target_in, target_name);
  const std::optional<Tensor> draft =
      draft_in.has_value() ? std::optional<Tensor>(laws_of(*draft_in, draft_name)) : std::nullopt;
  auto opts = target.options();
  Tensor accepted = at::full({B, T}, -1, opts.dtype(at::kInt));
  Tensor num_accepted = at::empty({B}, opts.dtype(at::kInt));
  Tensor next_tokens = at::empty({B}, opts.dtype(at::kLong));
  // logprobs: (B, T), (B, T, N), (B, T, N), (B, T), NaN / -1 after the emitted positions; off: (B, 0), (B, 0, 0)
  const bool with_logprobs = in.return_logprobs >= 0;
  const int64_t N = std::max<int64_t>(in.return_logprobs, 0), positions = with_logprobs ? T : 0;
  Tensor logprobs = at::full({B, positions}, std::numeric_limits<float>::quiet_NaN(), opts.dtype(at::kFloat));
  Tensor top_logprobs = at::full({B, positions, with_logprobs ? N : 0}, std::numeric_limits<float>::quiet_NaN(),
                                 opts.dtype(at::kFloat));
  Tensor top_token_ids = at::full({B, positions, with_logprobs ? N : 0}, -1, opts.dtype(at::kLong));
  Tensor token_ranks = at::full({B, positions}, -1, opts.dtype(at::kLong));
  // real rows that min-tokens' stop tokens (and the bitmask) leave without a finite value (with min_tokens)
  const Tensor stopped_empty = in.min_tokens.defined()
      ? at::zeros(target.sizes().slice(0, target.dim() - 1), opts.dtype(at::kBool)) : Tensor();
  // rows -inf on every allowed token (filled for real rows when there is a bitmask)
  Tensor masked_empty[2];
  for (auto& flags : masked_empty) {
    flags = in.token_bitmask.defined() ? at::zeros(target.sizes().slice(0, target.dim() - 1), opts.dtype(at::kBool))
                                       : Tensor();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, target.scalar_type(), "specdec::accept", [&] {
    using acc_t = acc_type_t<scalar_t>;
    RowStats<scalar_t> ts(target);
    std::optional<RowStats<scalar_t>> ds;
    if (draft.has_value()) ds.emplace(*draft);
    // (packed rows: all of them first, as rows between requests belong to no walk)
    const bool stats_in_walk = B >= at::get_num_threads() && !row_offsets.has_value();
    auto stats = [&](int64_t row_begin, int64_t row_end) {
      ts.compute(row_begin, row_end);
      if (ds.has_value()) ds->compute(row_begin, row_end);
    };
    // The walk; row_t: the rows' element type, acc_t with step 0 on (each node's row is penalized in acc_t)
    auto walk = [&](auto row_type) {
      using row_t = decltype(row_type);
      Accept<scalar_t, row_t> op{target.const_data_ptr<scalar_t>(),
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
                                in.top_k.defined() ? in.top_k.const_data_ptr<int32_t>() : nullptr,
                                in.top_p.defined() ? in.top_p.const_data_ptr<float>() : nullptr,
                                in.min_p.defined() ? in.min_p.const_data_ptr<float>() : nullptr,
                                in.token_bitmask.defined() ? in.token_bitmask.const_data_ptr<int32_t>() : nullptr,
                                {masked_empty[0].defined() ? masked_empty[0].data_ptr<bool>() : nullptr,
                                 masked_empty[1].defined() ? masked_empty[1].data_ptr<bool>() : nullptr},
                                T, V, offset, in.block, in.traversal, in.row_offsets.const_data_ptr<int64_t>(),
                                row_offsets.has_value(),
                                accepted.data_ptr<int32_t>(),
                                num_accepted.data_ptr<int32_t>(),
                                next_tokens.data_ptr<int64_t>()};
      op.order = in.filter_order;
      op.repetition = data_or_null<float>(in.repetition_penalty);
      op.frequency = data_or_null<float>(in.frequency_penalty);
      op.presence = data_or_null<float>(in.presence_penalty);
      op.counts = data_or_null<int32_t>(in.output_token_counts);
      op.prompt = data_or_null<int32_t>(in.prompt_token_mask);
      op.bias_ids = data_or_null<int32_t>(in.logit_bias_ids);
      op.bias_values = data_or_null<float>(in.logit_bias_values);
      op.num_bias = in.logit_bias_ids.defined() ? in.logit_bias_ids.size(1) : 0;
      op.min_tokens = data_or_null<int32_t>(in.min_tokens);
      op.stop_ids = data_or_null<int32_t>(in.stop_token_ids);
      op.num_stop = in.stop_token_ids.defined() ? in.stop_token_ids.size(1) : 0;
      op.penalized = penalized;
      op.stopped_empty = stopped_empty.defined() ? stopped_empty.data_ptr<bool>() : nullptr;
      op.num_top = in.return_logprobs;
      op.processed_logprobs = in.processed_logprobs;
      op.logprobs = logprobs.data_ptr<float>();
      op.top_logprobs = top_logprobs.data_ptr<float>();
      op.top_ids = top_token_ids.data_ptr<int64_t>();
      op.ranks = token_ranks.data_ptr<int64_t>();
      // Walking needs only the request's own rows: with a request for every thread, one parallel region
      // (each region wakes the thread team, costly on a busy machine) in which the walk scans its request's
      // rows (Accept::lazy_target); else rows first, then requests. Bad logits are reported after both
      // passes (outputs are the op's own, nothing of the caller's is written), and the walk stays in
      // bounds on them.
      if (!stats_in_walk) at::parallel_for(0, ts.max.numel(), 1, stats);
      at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
        Residual<acc_t> res(V, draft.has_value());
        if (penalized) {
          res.penalized_r.resize(V);
          res.penalized_q.resize(draft.has_value() ? V : 0);
        }
        for (int64_t b = begin; b < end; ++b) op.run(b, res);
      });
    };
    if (penalized) {
      walk(acc_t{});
    } else {
      walk(scalar_t{});
    }
    check_logit_rows(target_name, ts.nan, ts.posinf, ts.max, in.num_nodes, masked_empty[0], probs, stopped_empty);
    if (ds.has_value()) check_logit_rows(draft_name, ds->nan, ds->posinf, ds->max, in.num_nodes, masked_empty[1], probs);
  });
  return {accepted, num_accepted, next_tokens, logprobs, top_logprobs, top_token_ids, token_ranks};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("accept", &accept_cpu); }

}  // namespace specdec
