// Weight-only low-bit matmuls on CPU for layers/quant (kernels.py builds this at first use).
//
// y[m, n] = sum_k x[m, k] w[n, k] with w held in one of formats.py's layouts. Activations stay
// float32 (bf16 inputs are widened by the caller): each weight row is de-quantized into a
// float32 row buffer of `in` elements (L1/L2-resident) and dotted with every input row, so a
// weight byte is read once per call whatever the row count. Parallel over output rows.
// AVX2 + FMA + F16C code where the compiler targets them (-mavx2 -mfma -mf16c), portable
// scalar code otherwise; the de-quantization loops are plain loops the compiler vectorizes.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SZ_AVX2 1
#else
#define SZ_AVX2 0
#endif

namespace {

enum Fmt { INT8 = 0, INT4 = 1, Q8_0 = 2, Q4_0 = 3, Q4_1 = 4, Q4_K = 5, Q6_K = 6 };

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if SZ_AVX2
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// One weight's storage, as raw row pointers and row strides (in elements of each tensor).
struct QW {
  int fmt;
  int64_t in;
  int64_t group;  // int4 group size
  const uint8_t* p0; int64_t s0;   // qweight / blocks
  const float* p1; int64_t s1;     // scales (int8, int4)
  const float* p2; int64_t s2;     // zeros (int4)
};

// De-quantize output row n into buf[0..in): exactly formats.dequantize's values.
void dequant_row(const QW& w, int64_t n, float* __restrict buf) {
  const int64_t K = w.in;
  switch (w.fmt) {
    case INT8: {
      const int8_t* q = reinterpret_cast<const int8_t*>(w.p0 + n * w.s0);
      const float s = w.p1[n * w.s1];
      for (int64_t k = 0; k < K; ++k) buf[k] = static_cast<float>(q[k]) * s;
      break;
    }
    case INT4: {
      const uint8_t* q = w.p0 + n * w.s0;
      const float* sc = w.p1 + n * w.s1;
      const float* ze = w.p2 + n * w.s2;
      const int64_t g = w.group;
      for (int64_t b = 0; b < K / g; ++b) {
        const float s = sc[b], z = ze[b];
        const uint8_t* qb = q + b * g / 2;
        float* o = buf + b * g;
        for (int64_t i = 0; i < g / 2; ++i) {
          o[2 * i] = (static_cast<float>(qb[i] & 0xF) - z) * s;
          o[2 * i + 1] = (static_cast<float>(qb[i] >> 4) - z) * s;
        }
      }
      break;
    }
    case Q8_0: {
      const uint8_t* r = w.p0 + n * w.s0;
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = r + b * 34;
        const float d = half_to_float(blk);
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
        float* o = buf + b * 32;
        for (int i = 0; i < 32; ++i) o[i] = d * static_cast<float>(q[i]);
      }
      break;
    }
    case Q4_0:
    case Q4_1: {
      const bool has_min = w.fmt == Q4_1;
      const int bb = has_min ? 20 : 18, off = has_min ? 4 : 2;
      const uint8_t* r = w.p0 + n * w.s0;
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = r + b * bb;
        const float d = half_to_float(blk);
        const uint8_t* q = blk + off;
        float* o = buf + b * 32;
        if (has_min) {
          const float m = half_to_float(blk + 2);
          for (int i = 0; i < 16; ++i) {
            o[i] = d * static_cast<float>(q[i] & 0xF) + m;
            o[i + 16] = d * static_cast<float>(q[i] >> 4) + m;
          }
        } else {
          for (int i = 0; i < 16; ++i) {
            o[i] = d * (static_cast<float>(q[i] & 0xF) - 8.0f);
            o[i + 16] = d * (static_cast<float>(q[i] >> 4) - 8.0f);
          }
        }
      }
      break;
    }
    case Q4_K: {
      const uint8_t* r = w.p0 + n * w.s0;
      for (int64_t b = 0; b < K / 256; ++b) {
        const uint8_t* blk = r + b * 144;
        const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
        const uint8_t* sc = blk + 4;
        const uint8_t* q = blk + 16;
        float* o = buf + b * 256;
        for (int j = 0; j < 8; ++j) {  // ggml's get_scale_min_k4
          int s, m;
          if (j < 4) { s = sc[j] & 63; m = sc[j + 4] & 63; }
          else {
            s = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
            m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
          }
          const float ds = d * static_cast<float>(s), dm = dmin * static_cast<float>(m);
          const uint8_t* qq = q + (j / 2) * 32;
          const int shift = (j & 1) * 4;
          float* oo = o + j * 32;
          for (int i = 0; i < 32; ++i)
            oo[i] = ds * static_cast<float>((qq[i] >> shift) & 0xF) - dm;
        }
      }
      break;
    }
    case Q6_K: {
      const uint8_t* r = w.p0 + n * w.s0;
      for (int64_t b = 0; b < K / 256; ++b) {
        const uint8_t* blk = r + b * 210;
        const uint8_t* ql = blk;
        const uint8_t* qh = blk + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const float d = half_to_float(blk + 208);
        float* o = buf + b * 256;
        for (int h = 0; h < 2; ++h) {
          const uint8_t* l = ql + 64 * h;
          const uint8_t* hb = qh + 32 * h;
          float* oh = o + 128 * h;
          const int8_t* sh = sc + 8 * h;
          for (int i = 0; i < 32; ++i) {
            const int q1 = ((l[i] & 0xF) | ((hb[i] & 3) << 4)) - 32;
            const int q2 = ((l[i + 32] & 0xF) | (((hb[i] >> 2) & 3) << 4)) - 32;
            const int q3 = ((l[i] >> 4) | (((hb[i] >> 4) & 3) << 4)) - 32;
            const int q4 = ((l[i + 32] >> 4) | (((hb[i] >> 6) & 3) << 4)) - 32;
            const int is = i / 16;
            oh[i] = d * static_cast<float>(sh[is]) * static_cast<float>(q1);
            oh[i + 32] = d * static_cast<float>(sh[is + 2]) * static_cast<float>(q2);
            oh[i + 64] = d * static_cast<float>(sh[is + 4]) * static_cast<float>(q3);
            oh[i + 96] = d * static_cast<float>(sh[is + 6]) * static_cast<float>(q4);
          }
        }
      }
      break;
    }
    default:
      TORCH_CHECK(false, "unknown low-bit format code ", w.fmt);
  }
}

// dot products of one float row `a` (length K) with R rows of x (row stride ldx): out[r].
template <int R>
inline void dot_rows(const float* __restrict a, const float* __restrict x, int64_t ldx,
                     int64_t K, float* out) {
#if SZ_AVX2
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) { acc0[r] = _mm256_setzero_ps(); acc1[r] = _mm256_setzero_ps(); }
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 a0 = _mm256_loadu_ps(a + k), a1 = _mm256_loadu_ps(a + k + 8);
    for (int r = 0; r < R; ++r) {
      acc0[r] = _mm256_fmadd_ps(a0, _mm256_loadu_ps(x + r * ldx + k), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(a1, _mm256_loadu_ps(x + r * ldx + k + 8), acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 s = _mm256_add_ps(acc0[r], acc1[r]);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float v = _mm_cvtss_f32(h);
    for (int64_t kk = k; kk < K; ++kk) v += a[kk] * x[r * ldx + kk];
    out[r] = v;
  }
#else
  for (int r = 0; r < R; ++r) {
    float v0 = 0.f, v1 = 0.f, v2 = 0.f, v3 = 0.f;
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
      v0 += a[k] * x[r * ldx + k]; v1 += a[k + 1] * x[r * ldx + k + 1];
      v2 += a[k + 2] * x[r * ldx + k + 2]; v3 += a[k + 3] * x[r * ldx + k + 3];
    }
    for (; k < K; ++k) v0 += a[k] * x[r * ldx + k];
    out[r] = (v0 + v1) + (v2 + v3);
  }
#endif
}

#if SZ_AVX2
// Fused AVX2 path for the formats of 32-element blocks (q8_0, q4_0, q4_1, int4, int8 with
// in % 32 == 0): each block is decoded to 4 vectors of its integer values q (as floats) and
// contributes a * sum_i q_i x_i + c * sum_i x_i, with (a, c) = (d, 0) q8_0, (d, -8 d) q4_0,
// (d, m) q4_1, (s, -s z) int4 (x permuted so each byte's low nibbles meet the even elements),
// (1, 0) int8 (its row scale applied at the end). xs holds the inputs' block sums.
inline __m256 cvt8(__m128i bytes_lo8_unsigned) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes_lo8_unsigned));
}

inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// Block b (32 elements) of output row n of a 4-bit 32-block format (int4, q4_0, q4_1): its
// 16 bytes of nibbles and (a, c) such that the block's weights are a q + c.
inline const uint8_t* nibble_block(const QW& w, int64_t n, int64_t b, float* a, float* c) {
  const uint8_t* row = w.p0 + n * w.s0;
  if (w.fmt == INT4) {
    const int64_t g = (b * 32) / w.group;
    *a = w.p1[n * w.s1 + g];
    *c = -*a * w.p2[n * w.s2 + g];
    return row + b * 16;
  }
  if (w.fmt == Q4_0) {
    *a = half_to_float(row + b * 18);
    *c = -8.f * *a;
    return row + b * 18 + 2;
  }
  *a = half_to_float(row + b * 20);
  *c = half_to_float(row + b * 20 + 2);
  return row + b * 20 + 4;
}

template <int R>
inline void finish_rows(const QW& w, int64_t n, const __m256* acc, const float* cacc,
                        float* out) {
  const float rs = w.fmt == INT8 ? w.p1[n * w.s1] : 1.f;
  for (int r = 0; r < R; ++r) out[r] = (hsum(acc[r]) + cacc[r]) * rs;
}

// bytes of one 32-element block of a 32-block format
inline int64_t block_bytes(int fmt) {
  return fmt == Q8_0 ? 34 : fmt == INT8 ? 32 : fmt == INT4 ? 16 : fmt == Q4_0 ? 18 : 20;
}

// Software prefetch distance of q8_tile.h's tiles, bytes ahead of each of their 4 weight row
// streams: the hardware prefetchers lose 4 streams a few hundred bytes apart, so cold weights
// were read at 14 GB/s for q8_0's 34-byte blocks. bench/quant_matmul.py's 3072 x 576 at 1
// row, cold, 8-bit activations, 2026-12-07 (2-core Zen 4): q8_0 133 -> 62 us, q4_1 58 -> 45,
// int8 61 -> 49; 512 was the best of 512 / 640 / 768 / 1024 for q8_0. fused_row reads one
// row at a time, one stream the hardware follows: a prefetch there made it 5-15% slower.
constexpr int64_t PREFETCH_BYTES = 512;
// The 4-bit formats' tiles (blocks of 16-20 bytes) and the one-row stream of q8_tile.h
// `row_stream` prefetch further ahead: past the tile's 4 rows, into the rows after them (rows
// lie one after another). 3072 x 576 at 1 row, cold, interleaved A/B (2026-12-07): q4_1 512
// -> 1024 bytes 0.91x the time, -> 2048 0.87x of that, -> 4096 0.83x of that (31 us: 35
// GB/s), 8192 no better; q4_0 alike.
constexpr int64_t PREFETCH_FAR_BYTES = 4096;

// prefetch `off` bytes into the row at `row` (row_bytes long), or past its end into the row
// `next` (the next one this thread reads); a prefetch never faults, whatever the address
inline void prefetch_row(const uint8_t* row, const uint8_t* next, int64_t off,
                         int64_t row_bytes) {
  _mm_prefetch(reinterpret_cast<const char*>(off < row_bytes ? row + off
                                                             : next + (off - row_bytes)),
               _MM_HINT_T0);
}

template <int R>
void fused_row(const QW& w, int64_t n, const float* x, int64_t ldx, const float* xs,
               int64_t nblk, float* out) {
  const int64_t K = w.in;
  __m256 acc[R];
  float cacc[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); cacc[r] = 0.f; }
  const uint8_t* row = w.p0 + n * w.s0;
  const __m128i m4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256 q0, q1, q2, q3;
    float a, c;
    if (w.fmt == Q8_0 || w.fmt == INT8) {
      const int8_t* q = w.fmt == Q8_0 ? reinterpret_cast<const int8_t*>(row + b * 34 + 2)
                                      : reinterpret_cast<const int8_t*>(row + b * 32);
      const __m128i v0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
      const __m128i v1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
      q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0));
      q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8)));
      q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1));
      q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8)));
      a = w.fmt == Q8_0 ? half_to_float(row + b * 34) : 1.f;
      c = 0.f;
    } else {
      const uint8_t* q = nibble_block(w, n, b, &a, &c);
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
      const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
      q0 = cvt8(lo); q1 = cvt8(_mm_srli_si128(lo, 8));
      q2 = cvt8(hi); q3 = cvt8(_mm_srli_si128(hi, 8));
    }
    const __m256 va = _mm256_set1_ps(a);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + b * 32;
      __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xr));
      t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xr + 8), t);
      t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xr + 16), t);
      t = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xr + 24), t);
      acc[r] = _mm256_fmadd_ps(va, t, acc[r]);
      cacc[r] += c * xs[r * nblk + b];
    }
  }
  finish_rows<R>(w, n, acc, cacc, out);
}
#endif

#if SZ_AVX2
// 8-bit-activation path (llama.cpp's scheme: ggml's vec_dot_q4_1_q8_1 and relatives): each
// input row is quantized per 32-block to xq = round(x / dx), dx = max|x| / 127, and a block
// contributes a dx sum_i q_i xq_i + c sx (sx = dx sum_i xq_i); q8_tile.h's tiles of 4 output
// x up to 2 (AVX2) or 8 (AVX-512) input rows, once with AVX2's u8 x s8 multiply-adds and, where the compiler knows
// them, once with AVX-512 VNNI's (chosen at run time by cpuid). (a, c) as for fused_row.
#define SZ_NS avx2
#define SZ_TARGET
#define SZ_MR 2
#define SZ_DOT(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1))
#include "q8_tile.h"
#undef SZ_NS
#undef SZ_TARGET
#undef SZ_MR
#undef SZ_DOT
#if defined(__GNUC__) && (defined(__clang__) ? __clang_major__ >= 9 : __GNUC__ >= 9)
#define SZ_VNNI 1
#define SZ_NS vnni
#define SZ_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define SZ_MR 8  // 32 vector registers: 16 accumulators + a block of 4 rows
#define SZ_DOT(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s))
#include "q8_tile.h"
#undef SZ_NS
#undef SZ_TARGET
#undef SZ_MR
#undef SZ_DOT
#else
#define SZ_VNNI 0
#endif

// whether this CPU (and its OS) runs the AVX-512 VNNI tiles
bool cpu_has_vnni() {
#if SZ_VNNI
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;
#endif
}

// x's rows quantized per 32-block (int4: each block's even elements first, its nibbles):
// xq [M, K] int8, dx [M, K/32] the scales, sx [M, K/32] dx times the block's integer sum
void quantize_rows(const float* xp, int64_t ldx, int64_t M, int64_t K, bool int4,
                   int8_t* xq, float* dx, float* sx) {
  const int64_t nblk = K / 32;
  const __m256 sign = _mm256_set1_ps(-0.f);
  float tmp[32];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t bb = 0; bb < nblk; ++bb) {
      const float* src = xp + m * ldx + bb * 32;
      if (int4) {
        for (int i = 0; i < 16; ++i) { tmp[i] = src[2 * i]; tmp[16 + i] = src[2 * i + 1]; }
        src = tmp;
      }
      __m256 v[4], mx = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(src + 8 * j);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float d = _mm_cvtss_f32(h) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      __m256i q[4];
      for (int j = 0; j < 4; ++j)  // round half to even, as nearbyint
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(id)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                         _mm256_add_epi32(q[2], q[3]));
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
      // packs interleave 128-bit lanes: the permute puts the 32 bytes back in order
      const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
      const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + bb * 32), p8);
      dx[m * nblk + bb] = d;
      sx[m * nblk + bb] = d * static_cast<float>(_mm_cvtsi128_si32(t));
    }
}
#endif

QW make_qw(int64_t fmt, int64_t in, int64_t group, const at::Tensor& t0,
           const c10::optional<at::Tensor>& t1, const c10::optional<at::Tensor>& t2) {
  TORCH_CHECK(t0.device().is_cpu() && t0.dim() == 2 && t0.stride(1) == 1,
              "low-bit kernel: storage must be 2-D CPU tensors with unit column stride");
  QW w{static_cast<int>(fmt), in, group, nullptr, 0, nullptr, 0, nullptr, 0};
  w.p0 = static_cast<const uint8_t*>(t0.data_ptr());
  w.s0 = t0.stride(0) * t0.element_size();
  if (t1.has_value()) {
    TORCH_CHECK(t1->scalar_type() == at::kFloat && t1->stride(1) == 1);
    w.p1 = t1->data_ptr<float>(); w.s1 = t1->stride(0);
  }
  if (t2.has_value()) {
    TORCH_CHECK(t2->scalar_type() == at::kFloat && t2->stride(1) == 1);
    w.p2 = t2->data_ptr<float>(); w.s2 = t2->stride(0);
  }
  return w;
}

}  // namespace

// x: float32 [M, in] (row stride arbitrary, unit column stride); returns float32 [M, out].
at::Tensor gemv(const at::Tensor& x, int64_t fmt, int64_t out_features, int64_t group,
                const at::Tensor& t0, const c10::optional<at::Tensor>& t1,
                const c10::optional<at::Tensor>& t2, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "low-bit kernel: x must be float32 [M, in] with unit column stride");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const QW w = make_qw(fmt, K, group, t0, t1, t2);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  float* yp = y.data_ptr<float>();
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value()) { b = bias->to(at::kFloat).contiguous(); bp = b.data_ptr<float>(); }
  // grain: enough rows that a thread's share is worth the fork (~64K weights)
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1));
#if SZ_AVX2
  const int f = w.fmt;
  if ((f == Q8_0 || f == Q4_0 || f == Q4_1 || f == INT4 || f == INT8) && K % 32 == 0) {
    // block sums of x, and for int4 x with each 32-block's even elements first
    const int64_t nblk = K / 32;
    std::vector<float> xs(M * nblk), xperm;
    const float* xuse = xp;
    int64_t ldu = ldx;
    if (f == INT4) {
      xperm.resize(M * K);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < nblk; ++b)
          for (int i = 0; i < 16; ++i) {
            xperm[m * K + b * 32 + i] = xp[m * ldx + b * 32 + 2 * i];
            xperm[m * K + b * 32 + 16 + i] = xp[m * ldx + b * 32 + 2 * i + 1];
          }
      xuse = xperm.data();
      ldu = K;
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < nblk; ++b) {
        float t = 0.f;
        for (int i = 0; i < 32; ++i) t += xuse[m * ldu + b * 32 + i];
        xs[m * nblk + b] = t;
      }
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      float acc[4];
      for (int64_t n = n0; n < n1; ++n) {
        const float bn = bp ? bp[n] : 0.f;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) {
          fused_row<4>(w, n, xuse + m * ldu, ldu, xs.data() + m * nblk, nblk, acc);
          for (int r = 0; r < 4; ++r) yp[(m + r) * N + n] = acc[r] + bn;
        }
        for (; m + 2 <= M; m += 2) {
          fused_row<2>(w, n, xuse + m * ldu, ldu, xs.data() + m * nblk, nblk, acc);
          for (int r = 0; r < 2; ++r) yp[(m + r) * N + n] = acc[r] + bn;
        }
        for (; m < M; ++m) {
          fused_row<1>(w, n, xuse + m * ldu, ldu, xs.data() + m * nblk, nblk, acc);
          yp[m * N + n] = acc[0] + bn;
        }
      }
    });
    return y;
  }
#endif
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> buf(K + 16);
    float acc[4];
    for (int64_t n = n0; n < n1; ++n) {
      dequant_row(w, n, buf.data());
      const float bn = bp ? bp[n] : 0.f;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        dot_rows<4>(buf.data(), xp + m * ldx, ldx, K, acc);
        for (int r = 0; r < 4; ++r) yp[(m + r) * N + n] = acc[r] + bn;
      }
      for (; m < M; ++m) {
        dot_rows<1>(buf.data(), xp + m * ldx, ldx, K, acc);
        yp[m * N + n] = acc[0] + bn;
      }
    }
  });
  return y;
}

// As gemv, with x quantized to 8 bits per 32-block first (quantize_rows, the tiles of
// q8_tile.h). Only for the 32-block formats with in % 32 == 0 on AVX2 (kernels.py checks).
// isa: 2 the AVX-512 VNNI tiles where the CPU has them (else AVX2), 1 the AVX2 tiles.
at::Tensor gemv_q8(const at::Tensor& x, int64_t fmt, int64_t out_features, int64_t group,
                   const at::Tensor& t0, const c10::optional<at::Tensor>& t1,
                   const c10::optional<at::Tensor>& t2, const c10::optional<at::Tensor>& bias,
                   int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "low-bit kernel: x must be float32 [M, in] with unit column stride");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % 32 == 0, "8-bit activations need in % 32 == 0");
  const QW w = make_qw(fmt, K, group, t0, t1, t2);
  TORCH_CHECK(w.fmt == INT8 || w.fmt == INT4 || w.fmt == Q8_0 || w.fmt == Q4_0 || w.fmt == Q4_1,
              "8-bit activations: format code ", fmt, " has no 32-element blocks");
  at::Tensor y = at::empty({M, N}, x.options());
#if SZ_AVX2
  float* yp = y.data_ptr<float>();
  at::Tensor b;
  const float* bp = nullptr;
  if (bias.has_value()) { b = bias->to(at::kFloat).contiguous(); bp = b.data_ptr<float>(); }
  const int64_t nblk = K / 32;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * nblk), sx(M * nblk);
  quantize_rows(x.data_ptr<float>(), x.stride(0), M, K, w.fmt == INT4, xq.data(), dx.data(),
                sx.data());
  const bool use_vnni = isa >= 2 && cpu_has_vnni();
  // strips of 4 output rows; grain: enough strips that a thread's share is worth the fork
  const int64_t strips = (N + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, 16384 / K);
  at::parallel_for(0, strips, grain, [&](int64_t s0, int64_t s1) {
    const int64_t n0 = s0 * 4, n1 = std::min(N, s1 * 4);
#if SZ_VNNI
    if (use_vnni) {
      vnni::run(w, n0, n1, M, xq.data(), K, dx.data(), sx.data(), bp, yp, N);
      return;
    }
#endif
    avx2::run(w, n0, n1, M, xq.data(), K, dx.data(), sx.data(), bp, yp, N);
  });
#else
  TORCH_CHECK(false, "8-bit activations need the AVX2 build");
#endif
  return y;
}

// The float32 rows [start, start + rows) of the weight: [rows, in].
at::Tensor dequant(int64_t fmt, int64_t in, int64_t group, int64_t start, int64_t rows,
                   const at::Tensor& t0, const c10::optional<at::Tensor>& t1,
                   const c10::optional<at::Tensor>& t2) {
  const QW w = make_qw(fmt, in, group, t0, t1, t2);
  at::Tensor y = at::empty({rows, in}, at::kFloat);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / in), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dequant_row(w, start + r, yp + r * in);
  });
  return y;
}

int64_t simd() { return SZ_AVX2; }

// 2 where gemv_q8 runs AVX-512 VNNI tiles on this CPU, 1 AVX2, 0 none
int64_t q8_isa() {
#if SZ_AVX2
  return cpu_has_vnni() ? 2 : 1;
#else
  return 0;
#endif
}

void configure_op(int64_t gemv_rows, int64_t slab_bytes, bool onednn);  // quant_op.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv);
  m.def("dequant", &dequant);
  m.def("simd", &simd);
  m.def("gemv_q8", &gemv_q8);
  m.def("q8_isa", &q8_isa);
  m.def("configure_op", &configure_op);
}
