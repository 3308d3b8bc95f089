// The 8-bit-activation tile kernel of kernels.cpp, included once per instruction set:
// SZ_NS names the namespace, SZ_TARGET the functions' target attribute, SZ_DOT(u, s) the
// per-32-bit-lane sum of four u8 x s8 products (AVX-512 VNNI's vpdpbusd, or AVX2's
// vpmaddubsw + vpmaddwd), SZ_MR the most input rows a tile holds in registers.
//
// A tile is NR output rows x MR input rows: every 32-block of the NR weight rows is decoded
// once into 32 bytes of integer values and multiplied with the MR rows' 8-bit blocks, so a
// weight byte is read once per MR input rows (once per call for MR >= M), and each input
// block once per NR weight rows. A block contributes a dx sum_i q_i xq_i + c sx
// (formats' (a, c) as in kernels.cpp's nibble_block; dx, sx the input block's scale and
// scaled sum), accumulated in float32 across blocks, in the block order of q8_row.
namespace SZ_NS {

// the 32 integer values of block b of row n (u8: |q| for the signed formats), the signed
// values for the sign trick (signed formats only), and (a, c)
template <int F>
SZ_TARGET inline __m256i decode(const QW& w, int64_t n, int64_t b, __m256i* sgn, float* a,
                                float* c) {
  const uint8_t* row = w.p0 + n * w.s0;
  if (F == Q8_0 || F == INT8) {
    const uint8_t* q = F == Q8_0 ? row + b * 34 + 2 : row + b * 32;
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    *a = F == Q8_0 ? half_to_float(row + b * 34) : 1.f;
    *c = 0.f;
    *sgn = v;
    return _mm256_sign_epi8(v, v);
  }
  const uint8_t* q;
  if (F == INT4) {
    const int64_t g = (b * 32) / w.group;
    *a = w.p1[n * w.s1 + g];
    *c = -*a * w.p2[n * w.s2 + g];
    q = row + b * 16;
  } else if (F == Q4_0) {
    *a = half_to_float(row + b * 18);
    *c = -8.f * *a;
    q = row + b * 18 + 2;
  } else {
    *a = half_to_float(row + b * 20);
    *c = half_to_float(row + b * 20 + 2);
    q = row + b * 20 + 4;
  }
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

SZ_TARGET inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// y[m, n + i] = tile dot + bias for i < NR, m < MR (y row stride ldy)
template <int F, int NR, int MR>
SZ_TARGET void tile(const QW& w, int64_t n, const int8_t* xq, int64_t K, const float* dx,
                    const float* sx, int64_t nblk, const float* bias, float* y, int64_t ldy) {
  constexpr bool SIGNED = F == Q8_0 || F == INT8;
  __m256 acc[NR][MR];
  float cacc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < MR; ++r) { acc[i][r] = _mm256_setzero_ps(); cacc[i][r] = 0.f; }
  for (int64_t b = 0; b < nblk; ++b) {
    __m256i u[NR], s[NR];
    float a[NR], c[NR];
    for (int i = 0; i < NR; ++i) u[i] = decode<F>(w, n + i, b, &s[i], &a[i], &c[i]);
    for (int r = 0; r < MR; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * 32));
      const float d = dx[r * nblk + b];
      for (int i = 0; i < NR; ++i) {
        const __m256i p = SZ_DOT(u[i], SIGNED ? _mm256_sign_epi8(xv, s[i]) : xv);
        acc[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(a[i] * d), _mm256_cvtepi32_ps(p), acc[i][r]);
        if (!SIGNED) cacc[i][r] += c[i] * sx[r * nblk + b];
      }
    }
  }
  for (int i = 0; i < NR; ++i) {
    const float rs = F == INT8 ? w.p1[(n + i) * w.s1] : 1.f;
    const float bn = bias ? bias[n + i] : 0.f;
    for (int r = 0; r < MR; ++r) y[r * ldy + n + i] = (hsum8(acc[i][r]) + cacc[i][r]) * rs + bn;
  }
}

// output rows [n0, n1) for every input row: tiles of 4 output rows (single rows at the end)
// and SZ_MR, 2 or 1 input rows
template <int F>
SZ_TARGET void rows(const QW& w, int64_t n0, int64_t n1, int64_t M, const int8_t* xq,
                    int64_t K, const float* dx, const float* sx, int64_t nblk,
                    const float* bias, float* y, int64_t N) {
  int64_t n = n0;
  for (; n < n1; n += 4) {
    const bool four = n + 4 <= n1;
    int64_t m = 0;
    for (; m < M;) {
      const int64_t left = M - m;
      const int8_t* xm = xq + m * K;
      const float* dm = dx + m * nblk;
      const float* sm = sx + m * nblk;
      float* ym = y + m * N;
      if (left >= SZ_MR) {
        if (four) tile<F, 4, SZ_MR>(w, n, xm, K, dm, sm, nblk, bias, ym, N);
        else for (int64_t j = n; j < n1; ++j) tile<F, 1, SZ_MR>(w, j, xm, K, dm, sm, nblk, bias, ym, N);
        m += SZ_MR;
      } else if (left >= 2) {
        if (four) tile<F, 4, 2>(w, n, xm, K, dm, sm, nblk, bias, ym, N);
        else for (int64_t j = n; j < n1; ++j) tile<F, 1, 2>(w, j, xm, K, dm, sm, nblk, bias, ym, N);
        m += 2;
      } else {
        if (four) tile<F, 4, 1>(w, n, xm, K, dm, sm, nblk, bias, ym, N);
        else for (int64_t j = n; j < n1; ++j) tile<F, 1, 1>(w, j, xm, K, dm, sm, nblk, bias, ym, N);
        m += 1;
      }
    }
  }
}

SZ_TARGET void run(const QW& w, int64_t n0, int64_t n1, int64_t M, const int8_t* xq,
                   int64_t K, const float* dx, const float* sx, const float* bias, float* y,
                   int64_t N) {
  const int64_t nblk = K / 32;
  switch (w.fmt) {
    case INT8: rows<INT8>(w, n0, n1, M, xq, K, dx, sx, nblk, bias, y, N); break;
    case INT4: rows<INT4>(w, n0, n1, M, xq, K, dx, sx, nblk, bias, y, N); break;
    case Q8_0: rows<Q8_0>(w, n0, n1, M, xq, K, dx, sx, nblk, bias, y, N); break;
    case Q4_0: rows<Q4_0>(w, n0, n1, M, xq, K, dx, sx, nblk, bias, y, N); break;
    default: rows<Q4_1>(w, n0, n1, M, xq, K, dx, sx, nblk, bias, y, N); break;
  }
}

}  // namespace SZ_NS
