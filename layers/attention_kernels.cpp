// Decode attention on CPU (layers/attention_kernels.py defines the op; layers/attention.py's
// `_decode_attention` calls it): one query per row, its keys and values read in place through
// any strides (the paged cache's strided view or its gathered copy), float32 accumulation.
//
// One task per row (per row and KV group when there are fewer rows than threads): a KV
// group's query heads share each key and value row, widened to float32 once for them, so K
// and V are read once per step (SmolLM2 at 64 rows x 130 keys reads 6.4 MB a layer in bf16).
// Per task: the scores of every unmasked key for each head (a dot product of 4 independent
// FMA chains), a float32 softmax, then the value rows weighted into the heads' outputs. Keys
// whose additive mask is -inf are skipped, so a stale or non-finite cache entry past a row's
// length never reaches the result. A row with no unmasked key gets zeros (torch's softmax
// would give NaN; such rows are padding).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include "cpu_simd.h"

namespace {

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

#if SZ_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 -> float32: the 16 bits moved up
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// the cache lines of row[0..bytes) on their way to L1, `ahead` positions before they are read
// (a row's positions lie in blocks scattered over the pool; the hardware prefetcher does not
// follow a stream across pages)
inline void prefetch(const void* row, int64_t bytes) {
#if SZ_AVX2
  const char* p = static_cast<const char*>(row);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
#endif
}
constexpr int64_t ahead = 4;

// sum_x q[x] * k[x] over x < d (k widened already: `widened`)
inline float dot(const float* __restrict q, const float* __restrict k, int64_t d) {
  int64_t x = 0;
  float s = 0.f;
#if SZ_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; x + 32 <= d; x += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + x), load8(k + x), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + x + 8), load8(k + x + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + x + 16), load8(k + x + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + x + 24), load8(k + x + 24), a3);
  }
  for (; x + 8 <= d; x += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + x), load8(k + x), a0);
  s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
  for (; x < d; ++x) s += q[x] * k[x];
  return s;
}

// out[0..d) = float(row[0..d)): a key or value row widened once for all the heads of its group
template <typename T>
inline const float* widened(const T* __restrict row, float* __restrict out, int64_t d) {
  int64_t x = 0;
#if SZ_AVX2
  for (; x + 8 <= d; x += 8) _mm256_storeu_ps(out + x, load8(row + x));
#endif
  for (; x < d; ++x) out[x] = widen(row[x]);
  return out;
}
inline const float* widened(const float* row, float*, int64_t) { return row; }

// out[x] += p * v[x] over x < d (v widened already)
inline void axpy(float p, const float* __restrict v, float* __restrict out, int64_t d) {
  int64_t x = 0;
#if SZ_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (; x + 8 <= d; x += 8)
    _mm256_storeu_ps(out + x, _mm256_fmadd_ps(pv, load8(v + x), _mm256_loadu_ps(out + x)));
#endif
  for (; x < d; ++x) out[x] += p * v[x];
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const float* mask,
         int64_t mask_b, int64_t mask_t, float scale, at::Tensor& out) {
  const int64_t b = q.size(0), n = q.size(1), d = q.size(3);
  const int64_t g = k.size(1), sk = k.size(2), dv = v.size(3), hq = n / g;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const float ninf = -std::numeric_limits<float>::infinity();
  // one task per row: a position's keys of all g groups lie side by side in the cache
  // ([block, position, group, d]), so walking the positions reads each block's keys (and then
  // values) as one run of memory, which the hardware prefetcher streams. Fewer rows than
  // threads (one long prompt's decode): one task per (row, group), so every thread works.
  const int64_t parts = b < at::get_num_threads() ? g : 1, span = g / parts;
  at::parallel_for(0, b * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(n * d), scores(n * sk), acc(n * dv), row(std::max(d, dv));
    std::vector<int64_t> keys(sk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / parts, j0 = task % parts * span, j1 = j0 + span;
      const int64_t h0 = j0 * hq, h1 = j1 * hq;  // this task's query heads
      for (int64_t h = h0; h < h1; ++h) {
        const T* qh = qp + i * qs0 + h * qs1;
        for (int64_t x = 0; x < d; ++x) qf[h * d + x] = widen(qh[x]) * scale;
      }
      int64_t m = 0;  // the unmasked keys
      for (int64_t t = 0; t < sk; ++t)
        if (mask == nullptr || mask[i * mask_b + t * mask_t] != ninf) keys[m++] = t;
      std::fill(acc.begin() + h0 * dv, acc.begin() + h1 * dv, 0.f);
      const T* ki = kp + i * ks0;
      const T* vi = vp + i * vs0;
      for (int64_t c = 0; c < m; ++c) {
        const int64_t t = keys[c];
        if (c + ahead < m)
          for (int64_t j = j0; j < j1; ++j)
            prefetch(ki + keys[c + ahead] * ks2 + j * ks1, d * sizeof(T));
        const float add = mask == nullptr ? 0.f : mask[i * mask_b + t * mask_t];
        for (int64_t j = j0; j < j1; ++j) {
          const float* kt = widened(ki + t * ks2 + j * ks1, row.data(), d);
          for (int64_t h = j * hq; h < (j + 1) * hq; ++h)
            scores[h * sk + c] = dot(qf.data() + h * d, kt, d) + add;
        }
      }
      for (int64_t h = h0; h < h1 && m > 0; ++h) {  // softmax over the m unmasked keys
        float* sc = scores.data() + h * sk;
        const float top = *std::max_element(sc, sc + m);
        float total = 0.f;
        for (int64_t c = 0; c < m; ++c) total += (sc[c] = std::exp(sc[c] - top));
        const float inv = 1.f / total;
        for (int64_t c = 0; c < m; ++c) sc[c] *= inv;
      }
      for (int64_t c = 0; c < m; ++c) {
        if (c + ahead < m)
          for (int64_t j = j0; j < j1; ++j)
            prefetch(vi + keys[c + ahead] * vs2 + j * vs1, dv * sizeof(T));
        for (int64_t j = j0; j < j1; ++j) {
          const float* vt = widened(vi + keys[c] * vs2 + j * vs1, row.data(), dv);
          for (int64_t h = j * hq; h < (j + 1) * hq; ++h)
            axpy(scores[h * sk + c], vt, acc.data() + h * dv, dv);
        }
      }
      T* o = op + i * n * dv;  // out [b, n, 1, dv], contiguous
      for (int64_t x = h0 * dv; x < h1 * dv; ++x) o[x] = static_cast<T>(acc[x]);
    }
  });
}

// softmax(q k^T * scale + mask) v for q [b, n, 1, d], k [b, g, sk, d], v [b, g, sk, dv]
// (last dim contiguous, other strides free; g divides n), mask None or float32 broadcastable
// to [b, 1, 1, sk] (additive: 0 or -inf) -> [b, n, 1, dv] in q's dtype (float32 or bf16)
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask_in, double scale) {
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q_in.size(2) == 1,
              "decode_attention: q [b, n, 1, d], k [b, g, sk, d], v [b, g, sk, dv]");
  TORCH_CHECK(k.scalar_type() == q_in.scalar_type() && v.scalar_type() == q_in.scalar_type() &&
              (q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16),
              "decode_attention: q, k, v float32 or bfloat16, all the same");
  const int64_t b = q_in.size(0), n = q_in.size(1), g = k.size(1), sk = k.size(2);
  TORCH_CHECK(k.size(0) == b && v.size(0) == b && v.size(1) == g && v.size(2) == sk &&
              g > 0 && n % g == 0 && k.size(3) == q_in.size(3),
              "decode_attention: mismatched shapes");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1,
              "decode_attention: keys and values need a contiguous last dim");
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  at::Tensor mask;
  const float* mp = nullptr;
  int64_t mask_b = 0, mask_t = 0;
  if (mask_in.has_value()) {
    TORCH_CHECK(mask_in->scalar_type() == at::kFloat, "decode_attention: float32 mask");
    mask = mask_in->expand({b, 1, 1, sk});
    mp = mask.data_ptr<float>();
    mask_b = mask.stride(0);
    mask_t = mask.stride(3);
  }
  at::Tensor out = at::empty({b, n, 1, v.size(3)}, q.options());
  if (q.scalar_type() == at::kFloat)
    run<float>(q, k, v, mp, mask_b, mask_t, static_cast<float>(scale), out);
  else
    run<at::BFloat16>(q, k, v, mp, mask_b, mask_t, static_cast<float>(scale), out);
  return out;
}

int64_t simd() { return SZ_AVX2; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention);
  m.def("simd", &simd);
}
