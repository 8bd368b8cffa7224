// tree_attention: attention of T draft-tree queries over the committed prefix plus their ancestors.
//
//   q                (B, T, Hq, D) fp16/bf16/fp32/fp64
//   k_cache, v_cache (B, L_max, Hkv, D) contiguous or (num_blocks, block_size, Hkv, D) paged, q's dtype or
//                    float8_e4m3fn / float8_e5m2 holding K / k_scale and V / v_scale; v_cache's head dim Dv <= D
//                    (MLA's absorbed form: v_cache = k_cache[..., :Dv], the latent rows' leading channels)
//   cache_lens       (B,) int32: committed tokens; the tree's K/V sit at positions L .. L + T - 1
//   tree_mask        (B, T, ceil(T/32)) int32: node i sees tree position L + j iff bit j of tree_mask[b, i]
//   block_table      (B, max_blocks) int32 or None
//   num_nodes        (B,) int32/int64: nodes i >= num_nodes[b] are padding (out = 0, lse = -inf)
//   scale            float
//   k_scale, v_scale float > 0, per-tensor dequantization scales (1 unless the cache is float8)
//   window_left      int: -1 = no window, else (>= T - 1) node i, at position L + depth_i (depth_i = the
//                    tree nodes it sees - 1), sees only committed positions >= L + depth_i - window_left
//   logits_soft_cap  float >= 0: c > 0 turns every score s into c * tanh(s / c) before masking; 0 = off
//   sinks            (Hq,) float32 or None: query head h's softmax denominator gains exp(sinks[h]) (gpt-oss's
//                    attention sinks: a logit with no value, neither scaled nor capped; -inf = no sink)
// -> out (B, T, Hq, Dv) q.dtype, lse (B, T, Hq) float32 (natural-log sum of exp of the scaled, capped scores,
//    and of the sink)
//
// One work item per (request, KV head): its T x G query rows (G = Hq / Hkv, the GQA group) share every
// K/V row, so each row is loaded (and converted to fp32) once for all of them. When V is K's leading channels
// (MLA: one latent row per position, one KV head for all Hq heads) the loaded K row is V too: each position's
// Dqk channels are read once. Flash-style online
// softmax over blocks of kKeys keys, all in fp32 (fp64 for fp64 inputs). The scales are folded in where
// they cost nothing: k_scale into the pre-scaled queries (q * scale * k_scale . K = q * scale . K * k_scale),
// v_scale into the final normalization (out = O * v_scale / sum). Matrices are kept with the
// query rows on the vector lanes (transposed: Q^T, S^T, O^T), so both products are broadcast-FMA
// register tiles and the softmax statistics of a whole vector of query rows update at once.
// With few query rows (T x G <= kFewRows: decode, and a drafter's first levels) most lanes of that layout
// would idle, so the rows are kept as rows instead, with D on the lanes: each key's dot product with every
// row is reduced across the lanes, and O += p V adds a scaled V row to each output row.
// A sliding window starts the key blocks at the item's smallest window start (the keys before it are
// never read) and masks, per query row, the keys between that and the row's own start; the soft cap is
// applied to each block's scores (vectorized tanh) before the masks. A sink joins a row's softmax statistics once,
// when the row is written (write_rows), as one more score with no value.
#include "specdec.h"

#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace specdec {
namespace {

constexpr int64_t kRows = 4;                                  // rows of a register tile
constexpr int64_t kMaxVecs = SPECDEC_VEC_REGISTERS >= 32 ? 4 : 2;  // vectors of query rows per tile
constexpr int64_t kKeys = 64;                                 // keys per block (a multiple of kRows)
constexpr int64_t kFewRows = 8;  // at most this many query rows per item: the row layout (bench: T=1..4, G=2..3)
// the tile layout runs an item's nodes in groups of this many, each over the keys up to the last tree position any
// of them sees: a prefill chunk's first nodes skip the later nodes' keys (a causal chunk of 256 does 62% of the
// work); trees of up to this many nodes (verification) stay one group, reading the prefix once
constexpr int64_t kGroupNodes = 64;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <typename acc_t>
inline Vectorized<acc_t> fast_exp(const Vectorized<acc_t>& x) {
  return x.exp_u20();  // exp(-inf) = 0; a few ulp, far below the fp32 test tolerance
}

// One register tile: C[i, m] for i < kRows, m < NV vectors:  C = X Y  or  C = C * rescale[m] + X Y,
// summed over r < R, with X(i, r) = X[i * xi + r * xr] broadcast and Y[r, :] = Y[r * ys ...] loaded.
template <typename acc_t, int64_t NV, bool kRescale>
inline void tile(const acc_t* X, int64_t xi, int64_t xr, const acc_t* Y, int64_t ys, int64_t R, acc_t* C,
                 int64_t cs, const acc_t* rescale) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t VS = Vec::size();
  Vec acc[kRows][NV];
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t v = 0; v < NV; ++v) {
      acc[i][v] = kRescale ? Vec::loadu(C + i * cs + v * VS) * Vec::loadu(rescale + v * VS) : Vec(acc_t(0));
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    Vec y[NV];
    for (int64_t v = 0; v < NV; ++v) y[v] = Vec::loadu(Y + r * ys + v * VS);
    for (int64_t i = 0; i < kRows; ++i) {
      const Vec x(X[i * xi + r * xr]);
      for (int64_t v = 0; v < NV; ++v) acc[i][v] = at::vec::fmadd(x, y[v], acc[i][v]);
    }
  }
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t v = 0; v < NV; ++v) acc[i][v].store(C + i * cs + v * VS);
  }
}

// Products of at least this many multiply-adds go to ATen's GEMM (MKL / oneDNN: cache blocking, several times
// the register tiles' rate at MLA's shapes, D 576 x 256 query rows: bench/results/mla-cpu.md); smaller ones stay
// on the register tiles, which cost no call.
constexpr int64_t kBlasWork = int64_t{1} << 20;

// C (rows x Mp, row stride Mp) as in `tile`; rows a multiple of kRows, Mp of the vector size.
template <typename acc_t, bool kRescale>
void gemm(int64_t rows, int64_t Mp, const acc_t* X, int64_t xi, int64_t xr, const acc_t* Y, int64_t R, acc_t* C,
          const acc_t* rescale = nullptr) {
  if (rows * Mp * R >= kBlasWork) {  // (inside a parallel_for: ATen runs it on this thread)
    const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<acc_t>::value);
    const Tensor x = at::from_blob(const_cast<acc_t*>(X), {rows, R}, {xi, xr}, options);
    const Tensor y = at::from_blob(const_cast<acc_t*>(Y), {R, Mp}, {Mp, 1}, options);
    Tensor c = at::from_blob(C, {rows, Mp}, {Mp, 1}, options);
    if (kRescale) {
      c.mul_(at::from_blob(const_cast<acc_t*>(rescale), {1, Mp}, options));
      c.addmm_(x, y);
    } else {
      at::mm_out(c, x, y);
    }
    return;
  }
  constexpr int64_t VS = Vectorized<acc_t>::size();
  for (int64_t i = 0; i < rows; i += kRows) {
    int64_t m = 0;
    for (; m + kMaxVecs * VS <= Mp; m += kMaxVecs * VS) {
      tile<acc_t, kMaxVecs, kRescale>(X + i * xi, xi, xr, Y + m, Mp, R, C + i * Mp + m, Mp, kRescale ? rescale + m : nullptr);
    }
    for (; m < Mp; m += VS) {
      tile<acc_t, 1, kRescale>(X + i * xi, xi, xr, Y + m, Mp, R, C + i * Mp + m, Mp, kRescale ? rescale + m : nullptr);
    }
  }
}

// scalar_t: q's and out's dtype; cache_t: the caches', scalar_t or a float8 type.
template <typename scalar_t, typename cache_t>
struct TreeAttention {
  using acc_t = acc_type_t<scalar_t>;
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t VS = Vec::size();

  const scalar_t* q;  // contiguous (B, T, Hq, D)
  CacheRows<const cache_t> k, v;
  const int32_t* cache_lens;
  const int32_t* tree_mask;  // contiguous (B, T, W)
  const int32_t* num_nodes;
  const int64_t* row_offsets;  // (B,): node i of request b is row row_offsets[b] + i of q, tree_mask, out, lse
  bool packed;  // rows packed (N, ...): only real nodes' rows are written (else padded, row_offsets[b] = b * T)
  int64_t T, Hq, Hkv, D, Dv, W;  // D: q's and K's head dim; Dv: V's and out's (<= D)
  bool v_from_k;  // V is the first Dv channels of K's rows (the same memory): loaded once, as K
  acc_t q_scale;  // scale * k_scale
  acc_t v_scale;
  int64_t window_left;  // -1: no window
  acc_t soft_cap;       // 0: no cap
  const float* sinks;   // (Hq,), or nullptr: no sinks
  scalar_t* out;  // contiguous (B, T, Hq, D)
  float* lse;     // contiguous (B, T, Hq)

  // Per-thread scratch, sized for the largest item: Dp = D rounded to kRows (Dr: to VS, the row layout's),
  // Mp = T * G rounded to VS. kb, vb: a block's K and V rows (V's Dv <= D channels), zero past D (past Dv).
  struct Scratch {
    int64_t Dp, Dr, Mp;
    std::vector<acc_t> qt, ot, s, kb, vb, row_max, row_sum, alpha;
    std::vector<int64_t> start;  // per node: its first visible committed position (with a window)
    Scratch(int64_t D, int64_t T, int64_t G)
        : Dp(round_up(D, kRows)), Dr(round_up(D, VS)), Mp(round_up(T * G, VS)),
          qt(std::max(Dp * Mp, kFewRows * Dr)), ot(std::max(Dp * Mp, kFewRows * Dr)),
          s(std::max(kKeys * Mp, kFewRows * kKeys), 0), kb(kKeys * std::max(Dp, Dr), 0),
          vb(kKeys * std::max(Dp, Dr), 0), row_max(Mp), row_sum(Mp), alpha(Mp), start(T) {}
  };

  bool visible(int64_t b, int64_t node, int64_t j) const {
    return (static_cast<uint32_t>(tree_mask[(row_offsets[b] + node) * W + j / 32]) >> (j % 32)) & 1u;
  }

  // the last tree position (0 .. T-1) a node sees: its mask row's highest bit (itself, in a topological order)
  int64_t last_seen(int64_t b, int64_t node) const {
    for (int64_t word = W - 1; word >= 0; --word) {
      uint32_t bits = static_cast<uint32_t>(tree_mask[(row_offsets[b] + node) * W + word]);
      if (word == W - 1 && T % 32 != 0) bits &= (uint32_t{1} << (T % 32)) - 1;
      if (bits) return word * 32 + 31 - __builtin_clz(bits);
    }
    return -1;
  }

  // depth of a node: the tree nodes it sees (bits j < T of its mask row) minus itself
  int64_t depth(int64_t b, int64_t node) const {
    int64_t seen = 0;
    for (int64_t word = 0; word < W; ++word) {
      uint32_t bits = static_cast<uint32_t>(tree_mask[(row_offsets[b] + node) * W + word]);
      if (word == W - 1 && T % 32 != 0) bits &= (uint32_t{1} << (T % 32)) - 1;
      seen += __builtin_popcount(bits);
    }
    return seen - 1;
  }

  void run(int64_t b, int64_t kv_head, Scratch& w) const {
    const int64_t n = num_nodes[b], L = cache_lens[b], M = n * (Hq / Hkv);
    // keys: the committed prefix and the real nodes' tree positions (padding nodes' rows are never seen);
    // with a window, node i sees the prefix from start[i] on, and the blocks begin at the smallest start
    int64_t first = 0;
    if (window_left >= 0) {
      first = L;
      for (int64_t node = 0; node < n; ++node) {
        w.start[node] = std::max<int64_t>(0, L + depth(b, node) - window_left);
        first = std::min(first, w.start[node]);
      }
    }
    for (int64_t n0 = 0; n0 < n; n0 += M <= kFewRows ? n : kGroupNodes) {
      std::fill(w.row_max.begin(), w.row_max.end(), -std::numeric_limits<acc_t>::infinity());
      std::fill(w.row_sum.begin(), w.row_sum.end(), acc_t(0));
      if (M <= kFewRows) {
        run_rows(b, kv_head, first, w);
      } else {
        run_tiles(b, kv_head, first, n0, std::min(n, n0 + kGroupNodes), w);
      }
    }
    for (int64_t node = n; node < (packed ? n : T); ++node) {  // a padded request's padding rows
      for (int64_t g = 0; g < Hq / Hkv; ++g) {
        const int64_t row = (row_offsets[b] + node) * Hq + kv_head * (Hq / Hkv) + g;
        std::fill(out + row * Dv, out + (row + 1) * Dv, scalar_t(0));
        lse[row] = -std::numeric_limits<float>::infinity();
      }
    }
  }

  // query row m = node * G + g of item (b, kv_head): its rows of q, out and lse
  int64_t query_row(int64_t b, int64_t kv_head, int64_t m) const {
    const int64_t G = Hq / Hkv;
    return (row_offsets[b] + m / G) * Hq + kv_head * G + m % G;
  }

  // a block's keys p0 .. p0 + count - 1 into kb, vb (stride `stride`, converted to acc_t); returns where V's rows
  // are: vb, or kb when V is K's leading channels (not loaded again)
  acc_t* load_block(int64_t b, int64_t kv_head, int64_t p0, int64_t count, int64_t stride, Scratch& w) const {
    for (int64_t j = 0; j < count; ++j) {
      load_row(k(b, p0 + j) + kv_head * k.head_stride, w.kb.data() + j * stride, D);
      if (!v_from_k) load_row(v(b, p0 + j) + kv_head * v.head_stride, w.vb.data() + j * stride, Dv);
    }
    return v_from_k ? w.kb.data() : w.vb.data();
  }

  // soft cap, then -inf for what query row m may not see among the block's keys: committed keys before its
  // window start, tree keys that are not its ancestors-or-self. Score (key j, row m) is s[j * sj + m * sm];
  // `values` entries of s from s[0] on are whole vectors to cap.
  // Rows are the item's query rows m0 .. m0 + M - 1.
  void mask_block(int64_t b, int64_t L, int64_t p0, int64_t count, int64_t m0, int64_t M, acc_t* s, int64_t sj,
                  int64_t sm, int64_t values, const Scratch& w) const {
    if (soft_cap > 0) {  // s <- c * tanh(s / c)
      const Vec cap(soft_cap);
      for (int64_t i = 0; i < values; i += VS) (cap * (Vec::loadu(s + i) / cap).tanh()).store(s + i);
    }
    constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
    const int64_t G = Hq / Hkv;
    if (window_left >= 0 && p0 < L) {
      const int64_t prefix = std::min(count, L - p0);
      for (int64_t m = 0; m < M; ++m) {
        const int64_t hidden = std::min(prefix, w.start[(m0 + m) / G] - p0);
        for (int64_t j = 0; j < hidden; ++j) s[j * sj + m * sm] = kNegInf;
      }
    }
    for (int64_t j = std::max<int64_t>(0, L - p0); j < count; ++j) {
      for (int64_t m = 0; m < M; ++m) {
        if (!visible(b, (m0 + m) / G, p0 + j - L)) s[j * sj + m * sm] = kNegInf;
      }
    }
  }

  // out and lse of the item's query rows m0 .. m0 + M - 1 from O (row m0 + m, dim d at o[m * om + d * od]) and the
  // softmax statistics, a sink folded in: exp(sink) joins the sum (both at the larger of the max and the sink),
  // O is rescaled alike; a sink of -inf leaves max, sum and O as they are (rescale exp(0) = 1, exp(-inf) = 0)
  void write_rows(int64_t b, int64_t kv_head, int64_t m0, int64_t M, const acc_t* o, int64_t om, int64_t od,
                  const Scratch& w) const {
    constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
    for (int64_t m = 0; m < M; ++m) {
      const int64_t row = query_row(b, kv_head, m0 + m);
      acc_t row_max = w.row_max[m], row_sum = w.row_sum[m], rescale = 1;
      if (sinks != nullptr) {
        const acc_t sink = sinks[row % Hq], new_max = std::max(row_max, sink);
        const acc_t shift = new_max == kNegInf ? acc_t(0) : new_max;
        rescale = std::exp(row_max - shift);
        row_sum = row_sum * rescale + std::exp(sink - shift);
        row_max = new_max;
      }
      const acc_t inv = v_scale * rescale / row_sum;
      for (int64_t d = 0; d < Dv; ++d) out[row * Dv + d] = static_cast<scalar_t>(o[m * om + d * od] * inv);
      lse[row] = static_cast<float>(row_max + std::log(row_sum));
    }
  }

  // The tile layout: query rows on the lanes (Q^T, S^T, O^T), for the nodes n0 .. n1 - 1 (rows m0 = n0 * G on).
  void run_tiles(int64_t b, int64_t kv_head, int64_t first, int64_t n0, int64_t n1, Scratch& w) const {
    const int64_t G = Hq / Hkv, m0 = n0 * G, M = (n1 - n0) * G, Mp = round_up(M, VS), Dp = w.Dp;
    int64_t seen = -1;  // the group's last visible tree position: later keys are masked for all its rows
    for (int64_t node = n0; node < n1; ++node) seen = std::max(seen, last_seen(b, node));
    const int64_t L = cache_lens[b], keys = L + std::min(seen + 1, static_cast<int64_t>(num_nodes[b]));
    acc_t *qt = w.qt.data(), *ot = w.ot.data(), *s = w.s.data(), *kb = w.kb.data(), *vb = w.vb.data();
    // Q^T (Dp x Mp), pre-scaled by q_scale; padding lanes and dims are 0
    std::fill(qt, qt + Dp * Mp, acc_t(0));
    std::fill(ot, ot + Dp * Mp, acc_t(0));
    for (int64_t m = 0; m < M; ++m) {
      const scalar_t* src = q + query_row(b, kv_head, m0 + m) * D;
      for (int64_t d = 0; d < D; ++d) qt[d * Mp + m] = static_cast<acc_t>(src[d]) * q_scale;
    }
    for (int64_t p0 = first; p0 < keys; p0 += kKeys) {
      const int64_t count = std::min(kKeys, keys - p0), rows = round_up(count, kRows);
      // (V's channels Dv .. Dp only reach O^T's rows past Dv, never written out)
      acc_t* vrows = load_block(b, kv_head, p0, count, Dp, w);
      std::fill(kb + count * Dp, kb + rows * Dp, acc_t(0));
      std::fill(vb + count * Dp, vb + rows * Dp, acc_t(0));
      // S^T = K Q^T (rows x Mp): scores of every key in the block against every query row
      gemm<acc_t, false>(rows, Mp, kb, Dp, 1, qt, Dp, s);
      mask_block(b, L, p0, count, m0, M, s, Mp, 1, count * Mp, w);
      std::fill(s + count * Mp, s + rows * Mp, -std::numeric_limits<acc_t>::infinity());
      update_softmax(s, rows, Mp, w);
      // O^T = O^T * alpha + V^T P^T  (Dv rounded to kRows x Mp)
      gemm<acc_t, true>(round_up(Dv, kRows), Mp, vrows, 1, Dp, s, rows, ot, w.alpha.data());
    }
    write_rows(b, kv_head, m0, M, ot, 1, Mp, w);
  }

  // The row layout (M <= kFewRows): q, O (M x Dr) and the block's scores S (M x kKeys) row by row.
  void run_rows(int64_t b, int64_t kv_head, int64_t first, Scratch& w) const {
    const int64_t L = cache_lens[b], keys = L + num_nodes[b], M = num_nodes[b] * (Hq / Hkv), Dr = w.Dr;
    const int64_t Dvr = round_up(Dv, VS);  // V's dims, whole vectors (<= Dr)
    acc_t *qr = w.qt.data(), *orow = w.ot.data(), *s = w.s.data(), *kb = w.kb.data(), *vb = w.vb.data();
    std::fill(qr, qr + M * Dr, acc_t(0));
    std::fill(orow, orow + M * Dr, acc_t(0));
    for (int64_t m = 0; m < M; ++m) {
      const scalar_t* src = q + query_row(b, kv_head, m) * D;
      for (int64_t d = 0; d < D; ++d) qr[m * Dr + d] = static_cast<acc_t>(src[d]) * q_scale;
    }
    constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
    const auto plus = [](const Vec& x, const Vec& y) { return x + y; };
    const auto max = [](const Vec& x, const Vec& y) { return at::vec::maximum(x, y); };
    // K and V rows are read in place when they need no conversion and no padding, else from kb, vb
    constexpr bool kInPlace = std::is_same_v<cache_t, acc_t>;
    // (V's rows are read Dvr values wide: in place only if those are its own, or K's when V is K's channels)
    const bool in_place = kInPlace && Dr == D && (v_from_k || Dvr == Dv);
    const acc_t* krow[kKeys];
    const acc_t* vrow[kKeys];
    for (int64_t p0 = first; p0 < keys; p0 += kKeys) {
      const int64_t count = std::min(kKeys, keys - p0);
      if (in_place) {
        if constexpr (kInPlace) {
          for (int64_t j = 0; j < count; ++j) {
            krow[j] = k(b, p0 + j) + kv_head * k.head_stride;
            vrow[j] = v_from_k ? krow[j] : v(b, p0 + j) + kv_head * v.head_stride;
          }
        }
      } else {
        const acc_t* vrows = load_block(b, kv_head, p0, count, Dr, w);
        for (int64_t j = 0; j < count; ++j) {
          std::fill(kb + j * Dr + D, kb + (j + 1) * Dr, acc_t(0));  // (the tile layout may have left values there)
          if (!v_from_k) std::fill(vb + j * Dr + Dv, vb + (j + 1) * Dr, acc_t(0));
          krow[j] = kb + j * Dr;
          vrow[j] = vrows + j * Dr;
        }
      }
      for (int64_t j = 0; j < count; ++j) {  // S[m, j] = q_m . k_j
        for (int64_t m = 0; m < M; ++m) {
          Vec acc(acc_t(0));
          for (int64_t d = 0; d < Dr; d += VS) {
            acc = at::vec::fmadd(Vec::loadu(qr + m * Dr + d), Vec::loadu(krow[j] + d), acc);
          }
          s[m * kKeys + j] = at::vec::vec_reduce_all<acc_t>(plus, acc);
        }
      }
      mask_block(b, L, p0, count, 0, M, s, 1, kKeys, M * kKeys, w);
      for (int64_t m = 0; m < M; ++m) {  // online softmax of row m over the block, then O_m = O_m alpha + P V
        acc_t* sm = s + m * kKeys;
        std::fill(sm + count, sm + kKeys, kNegInf);
        Vec block_max(kNegInf);
        for (int64_t j = 0; j < kKeys; j += VS) block_max = at::vec::maximum(block_max, Vec::loadu(sm + j));
        const acc_t new_max = std::max(w.row_max[m], at::vec::vec_reduce_all<acc_t>(max, block_max));
        const acc_t shift = new_max == kNegInf ? acc_t(0) : new_max;  // nothing seen yet: exp(-inf) = 0
        Vec sum(acc_t(0));
        for (int64_t j = 0; j < kKeys; j += VS) {
          const Vec p = fast_exp(Vec::loadu(sm + j) - Vec(shift));
          p.store(sm + j);
          sum = sum + p;
        }
        const acc_t alpha = std::exp(w.row_max[m] - shift);
        w.row_max[m] = new_max;
        w.row_sum[m] = w.row_sum[m] * alpha + at::vec::vec_reduce_all<acc_t>(plus, sum);
        for (int64_t d = 0; d < Dvr; d += VS) {  // one output vector accumulated in a register over the block
          Vec acc = Vec::loadu(orow + m * Dr + d) * Vec(alpha);
          for (int64_t j = 0; j < count; ++j) acc = at::vec::fmadd(Vec(sm[j]), Vec::loadu(vrow[j] + d), acc);
          acc.store(orow + m * Dr + d);
        }
      }
    }
    write_rows(b, kv_head, 0, M, orow, Dr, 1, w);
  }

  // Online softmax over one block of scores S^T (rows x Mp), a vector of query rows at a time:
  // new max, alpha = exp(old max - new max), S^T <- exp(S^T - new max), running sum <- sum * alpha + sum P.
  static void update_softmax(acc_t* s, int64_t rows, int64_t Mp, Scratch& w) {
    const Vec neg_inf(-std::numeric_limits<acc_t>::infinity()), zero(acc_t(0));
    for (int64_t m = 0; m < Mp; m += VS) {
      Vec block_max = neg_inf;
      for (int64_t j = 0; j < rows; ++j) block_max = at::vec::maximum(block_max, Vec::loadu(s + j * Mp + m));
      const Vec old_max = Vec::loadu(w.row_max.data() + m);
      const Vec new_max = at::vec::maximum(old_max, block_max);
      const Vec shift = Vec::blendv(new_max, zero, new_max == neg_inf);  // rows with nothing seen yet: exp(-inf) = 0
      Vec sum = zero;
      for (int64_t j = 0; j < rows; ++j) {
        const Vec p = fast_exp(Vec::loadu(s + j * Mp + m) - shift);
        p.store(s + j * Mp + m);
        sum = sum + p;
      }
      const Vec alpha = fast_exp(old_max - shift);
      alpha.store(w.alpha.data() + m);
      new_max.store(w.row_max.data() + m);
      (Vec::loadu(w.row_sum.data() + m) * alpha + sum).store(w.row_sum.data() + m);
    }
  }
};

std::tuple<Tensor, Tensor> tree_attention_cpu(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                              const Tensor& cache_lens, const Tensor& tree_mask_in,
                                              const std::optional<Tensor>& block_table, const Tensor& num_nodes_in,
                                              double scale, double k_scale, double v_scale, int64_t window_left,
                                              double logits_soft_cap, const std::optional<Tensor>& row_offsets_in,
                                              int64_t max_nodes, const std::optional<Tensor>& sinks_in) {
  Tensor num_nodes = check_tree_attention(q_in, k_in, v_in, cache_lens, tree_mask_in, block_table, num_nodes_in,
                                          scale, k_scale, v_scale, window_left, logits_soft_cap, row_offsets_in,
                                          max_nodes, sinks_in);
  const bool packed = row_offsets_in.has_value();
  const Tensor q = q_in.contiguous(), tree_mask = tree_mask_in.contiguous(), lens = cache_lens.contiguous();
  const Tensor sinks = sinks_in.has_value() ? sinks_in->contiguous() : Tensor();
  // rows are read as D contiguous values; any other layout is copied once
  const Tensor k_cache = k_in.stride(-1) == 1 ? k_in : k_in.contiguous();
  const Tensor v_cache = v_in.stride(-1) == 1 ? v_in : v_in.contiguous();
  const int64_t B = packed ? row_offsets_in->size(0) : q.size(0), T = packed ? max_nodes : q.size(1);
  const int64_t Hq = q.size(-2), D = q.size(-1), Hkv = k_cache.size(-2), Dv = v_cache.size(-1);
  // (checked: a v_cache in K's memory with K's strides is k_cache[..., :Dv])
  const bool v_from_k = v_cache.data_ptr() == k_cache.data_ptr() && v_cache.strides() == k_cache.strides();
  std::vector<int64_t> out_shape(q.sizes().begin(), q.sizes().end());
  out_shape.back() = Dv;
  Tensor out = at::empty(out_shape, q.options());
  Tensor lse = at::empty(q.sizes().slice(0, q.dim() - 1), q.options().dtype(at::kFloat));
  Tensor row_offsets = packed ? row_offsets_in->to(at::kLong).contiguous() : at::empty({B}, lse.options().dtype(at::kLong));
  if (!packed) {
    for (int64_t b = 0; b < B; ++b) row_offsets.data_ptr<int64_t>()[b] = b * T;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "specdec::tree_attention", [&] {
    auto launch = [&](auto cache_tag) {
      using cache_t = decltype(cache_tag);
      using acc_t = acc_type_t<scalar_t>;
      using Op = TreeAttention<scalar_t, cache_t>;
      const Op op{q.const_data_ptr<scalar_t>(),
                  CacheRows<const cache_t>(k_cache.const_data_ptr<cache_t>(), k_cache, block_table),
                  CacheRows<const cache_t>(v_cache.const_data_ptr<cache_t>(), v_cache, block_table),
                  lens.const_data_ptr<int32_t>(), tree_mask.const_data_ptr<int32_t>(),
                  num_nodes.const_data_ptr<int32_t>(), row_offsets.const_data_ptr<int64_t>(), packed, T, Hq, Hkv,
                  D, Dv, tree_mask.size(-1), v_from_k,
                  static_cast<acc_t>(scale * k_scale), static_cast<acc_t>(v_scale), window_left,
                  static_cast<acc_t>(logits_soft_cap), sinks.defined() ? sinks.const_data_ptr<float>() : nullptr,
                  out.data_ptr<scalar_t>(), lse.data_ptr<float>()};
      at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
        typename Op::Scratch scratch(D, T, Hq / Hkv);
        for (int64_t item = begin; item < end; ++item) op.run(item / Hkv, item % Hkv, scratch);
      });
    };
    // the checks allow a cache in q's dtype or a float8 one
    switch (k_cache.scalar_type()) {
      case at::kFloat8_e4m3fn: return launch(c10::Float8_e4m3fn{});
      case at::kFloat8_e5m2: return launch(c10::Float8_e5m2{});
      default: return launch(scalar_t{});
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }

}  // namespace specdec
