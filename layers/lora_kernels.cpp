// The LoRA deltas of a decode batch mixing adapters (layers/multi_lora.py; built at first use
// by layers/lora_kernels.py): Punica's SGMV shrink and expand (Chen et al. 2023), on one CPU
// thread. The tokens that use an adapter come grouped by slot (`tokens`: token ids, the
// group of slot lo + j in tokens[seg[j]:seg[j + 1]]), so each used adapter's A and B are read
// once per call, and every token multiplies only its own adapter's weights.
//
// Both are register tiles of up to 4 tokens x 16 output columns (`tile`): each weight row
// is read once per 4 tokens of its group, and the accumulators are independent vector lanes
// (no horizontal sums; a dot product per A row would be bound by one FMA chain's latency:
// 14 us against 2-3 us for QKV's shrink at SmolLM2's shapes). A is kept transposed for it.
//
// One thread: a hook's work is a few tens of microseconds, less than an OpenMP fork / join on
// a shared host. Each token's result is computed the same way whatever else is in the batch
// (no blocking that depends on the group sizes), so a row's output does not depend on its
// neighbours.
#include <torch/extension.h>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>
// AVX2 + FMA tiles where the compiler targets them, plain loops else
#include "cpu_simd.h"

namespace {

// y_t[0..8V) (+)= sum_{k < K} x_t[k] m[k * ld + 0..8V) for CT tokens t: CT x V accumulator
// vectors kept in registers (independent FMA chains, no horizontal sums), each row of m read
// once for the CT tokens.
template <int CT, int V>
inline void tile(const float* const* x, const float* __restrict m, int64_t ld, int64_t K,
                 float* const* y, bool accumulate) {
#if SZ_AVX2
  __m256 acc[CT][V];
  for (int t = 0; t < CT; ++t)
    for (int v = 0; v < V; ++v)
      acc[t][v] = accumulate ? _mm256_loadu_ps(y[t] + 8 * v) : _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 mv[V];
    for (int v = 0; v < V; ++v) mv[v] = _mm256_loadu_ps(m + k * ld + 8 * v);
    for (int t = 0; t < CT; ++t) {
      const __m256 b = _mm256_broadcast_ss(x[t] + k);
      for (int v = 0; v < V; ++v) acc[t][v] = _mm256_fmadd_ps(b, mv[v], acc[t][v]);
    }
  }
  for (int t = 0; t < CT; ++t)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(y[t] + 8 * v, acc[t][v]);
#else
  for (int t = 0; t < CT; ++t) {
    float a[8 * V];
    for (int q = 0; q < 8 * V; ++q) a[q] = accumulate ? y[t][q] : 0.f;
    for (int64_t k = 0; k < K; ++k)
      for (int q = 0; q < 8 * V; ++q) a[q] += x[t][k] * m[k * ld + q];
    for (int q = 0; q < 8 * V; ++q) y[t][q] = a[q];
  }
#endif
}

// Tiles of 8V columns from column w on, while they fit in width, for one or two tokens.
template <int V>
inline void tiles(const float* const* x, int ct, const float* m, int64_t ld, int64_t K,
                  int64_t width, float* const* y, bool accumulate, int64_t& w) {
  for (; w + 8 * V <= width; w += 8 * V) {
    float* yw[2] = {y[0] + w, ct == 2 ? y[1] + w : nullptr};
    if (ct == 2) tile<2, V>(x, m + w, ld, K, yw, accumulate);
    else tile<1, V>(x, m + w, ld, K, yw, accumulate);
  }
}

// y_t[0..width) (+)= x_t m[:, 0..width) (m [K, ld] row-major) for the c tokens t (x_t of K
// elements): 2 tokens x 32 columns at a time (8 FMA chains: two FMA units of 4 cycles'
// latency), narrower tiles for the rest.
inline void times(const float* const* x, int64_t c, const float* m, int64_t ld, int64_t K,
                  int64_t width, float* const* y, bool accumulate) {
  for (int64_t i = 0; i < c; i += 2) {
    const int ct = i + 1 < c ? 2 : 1;
    int64_t w = 0;
    tiles<4>(x + i, ct, m, ld, K, width, y + i, accumulate, w);
    tiles<2>(x + i, ct, m, ld, K, width, y + i, accumulate, w);
    tiles<1>(x + i, ct, m, ld, K, width, y + i, accumulate, w);
    for (; w < width; ++w)  // fewer than 8 columns left
      for (int64_t u = i; u < i + ct; ++u) {
        float a = accumulate ? y[u][w] : 0.f;
        for (int64_t k = 0; k < K; ++k) a += x[u][k] * m[k * ld + w];
        y[u][w] = a;
      }
  }
}

void check_groups(const at::Tensor& tokens, const at::Tensor& seg, int64_t lo, int64_t slots,
                  int64_t n) {
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 1 && tokens.is_contiguous(),
              "lora kernels: tokens must be a contiguous int64 vector");
  TORCH_CHECK(seg.scalar_type() == at::kLong && seg.dim() == 1 && seg.is_contiguous() &&
                  seg.size(0) >= 1,
              "lora kernels: seg must be a contiguous int64 vector of group offsets");
  const int64_t k = seg.size(0) - 1;
  TORCH_CHECK(lo >= 0 && lo + k <= slots, "lora kernels: slots ", lo, "..", lo + k,
              " out of ", slots);
  const int64_t* s = seg.data_ptr<int64_t>();
  const int64_t* t = tokens.data_ptr<int64_t>();
  TORCH_CHECK(s[0] == 0 && s[k] == tokens.size(0), "lora kernels: seg must run 0..tokens");
  for (int64_t j = 0; j < k; ++j) TORCH_CHECK(s[j] <= s[j + 1], "lora kernels: seg not sorted");
  for (int64_t i = 0; i < tokens.size(0); ++i)
    TORCH_CHECK(t[i] >= 0 && t[i] < n, "lora kernels: token ", t[i], " out of ", n);
}

}  // namespace

// Shrink: xa[i] = A[lo + j] x[tokens[i]] for the tokens i of group j.
// x: float32 [n, in] contiguous; at: float32 [slots, in, P] contiguous (A transposed, P = parts
// x R). Returns float32 [len(tokens), P].
at::Tensor shrink(const at::Tensor& x, const at::Tensor& at, int64_t lo, const at::Tensor& tokens,
                  const at::Tensor& seg) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "lora shrink: x must be contiguous float32 [n, in]");
  TORCH_CHECK(at.scalar_type() == at::kFloat && at.dim() == 3 && at.is_contiguous() &&
                  at.size(1) == x.size(1),
              "lora shrink: at must be contiguous float32 [slots, in, P] with x's in");
  check_groups(tokens, seg, lo, at.size(0), x.size(0));
  const int64_t K = x.size(1), P = at.size(2), k = seg.size(0) - 1;
  const int64_t* t = tokens.data_ptr<int64_t>();
  const int64_t* s = seg.data_ptr<int64_t>();
  at::Tensor xa = at::empty({tokens.size(0), P}, x.options());
  float* out = xa.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  std::vector<const float*> rows;
  std::vector<float*> dest;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t c = s[j + 1] - s[j];
    rows.resize(c);
    dest.resize(c);
    for (int64_t i = 0; i < c; ++i) {
      rows[i] = xp + t[s[j] + i] * K;
      dest[i] = out + (s[j] + i) * P;
    }
    times(rows.data(), c, at.data_ptr<float>() + (lo + j) * K * P, P, K, P, dest.data(), false);
  }
  return xa;
}

// Expand: out[tokens[i], row + w] += sum_{r < R} xa[i, q R + r] bt[lo + j, r, col + w] for each
// run (q, col, row, len) of `runs`, w < len, the tokens i of group j. A run is a block of
// consecutive output rows of one part q whose B^T columns are consecutive too (a part of
// QKV has one run per KV group, since the parts' rows interleave).
// xa: float32 [len(tokens), parts x R]; bt: float32 [slots, R, C] contiguous (every part's B
// transposed, side by side); runs: int64 [n runs, 4] contiguous; out: float32 [n, N]
// contiguous, added to in place.
void expand(const at::Tensor& xa, const at::Tensor& bt, const at::Tensor& runs, int64_t lo,
            const at::Tensor& tokens, const at::Tensor& seg, at::Tensor out) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous(),
              "lora expand: out must be contiguous float32 [n, out]");
  TORCH_CHECK(bt.scalar_type() == at::kFloat && bt.dim() == 3 && bt.is_contiguous(),
              "lora expand: bt must be contiguous float32 [slots, R, C]");
  const int64_t R = bt.size(1), C = bt.size(2), N = out.size(1);
  TORCH_CHECK(xa.scalar_type() == at::kFloat && xa.dim() == 2 && xa.is_contiguous() &&
                  xa.size(0) == tokens.size(0) && R > 0 && xa.size(1) % R == 0,
              "lora expand: xa must be contiguous float32 [tokens, parts x R]");
  const int64_t P = xa.size(1);
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.dim() == 2 && runs.size(1) == 4 &&
                  runs.is_contiguous(),
              "lora expand: runs must be contiguous int64 [n, 4]");
  const int64_t nr = runs.size(0);
  const int64_t* ru = runs.data_ptr<int64_t>();
  for (int64_t u = 0; u < nr; ++u) {
    const int64_t* r = ru + 4 * u;
    TORCH_CHECK(r[0] >= 0 && (r[0] + 1) * R <= P && r[1] >= 0 && r[3] >= 0 &&
                    r[1] + r[3] <= C && r[2] >= 0 && r[2] + r[3] <= N,
                "lora expand: run ", u, " out of range");
  }
  check_groups(tokens, seg, lo, bt.size(0), out.size(0));
  const int64_t k = seg.size(0) - 1;
  const int64_t* t = tokens.data_ptr<int64_t>();
  const int64_t* s = seg.data_ptr<int64_t>();
  const float* xp = xa.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::vector<const float*> src;
  std::vector<float*> dest;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t c = s[j + 1] - s[j];
    src.resize(c);
    dest.resize(c);
    const float* bp = bt.data_ptr<float>() + (lo + j) * R * C;
    for (int64_t u = 0; u < nr; ++u) {  // each run of B^T's columns, added into out
      const int64_t* r4 = ru + 4 * u;
      for (int64_t i = 0; i < c; ++i) {
        src[i] = xp + (s[j] + i) * P + r4[0] * R;
        dest[i] = op + t[s[j] + i] * N + r4[2];
      }
      times(src.data(), c, bp + r4[1], C, R, r4[3], dest.data(), true);
    }
  }
}

// shrink then expand in one call (a column-parallel base, or a row-parallel one at tp 1), on
// x [..., in] and out [..., N] as [n, in] and [n, N] (out contiguous: added to in place)
void add(const at::Tensor& x, const at::Tensor& at, const at::Tensor& bt, const at::Tensor& runs,
         int64_t lo, const at::Tensor& tokens, const at::Tensor& seg, at::Tensor out) {
  TORCH_CHECK(out.is_contiguous() && out.dim() >= 1, "lora add: out must be contiguous");
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
  expand(shrink(x2, at, lo, tokens, seg), bt, runs, lo, tokens, seg,
         out.view({-1, out.size(-1)}));
}

int64_t simd() { return SZ_AVX2; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("shrink", &shrink);
  m.def("expand", &expand);
  m.def("add", &add);
  m.def("simd", &simd);
}
