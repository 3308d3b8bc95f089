// The 8-bit-activation tile kernel of kernels.cpp, included once per instruction set:
// SZ_NS names the namespace, SZ_TARGET the functions' target attribute, SZ_DOT(u, s) the
// per-32-bit-lane sum of four u8 x s8 products (AVX-512 VNNI's vpdpbusd, or AVX2's
// vpmaddubsw + vpmaddwd), SZ_MR the most input rows a tile holds in registers.
//
// A tile is 4 output rows x MR input rows: every 32-block of the 4 weight rows is decoded
// once into 32 bytes of integer values and multiplied with the MR rows' 8-bit blocks, so a
// weight byte is read once per MR input rows (once per call for MR >= M), and each input
// block once per 4 weight rows. A block contributes a dx sum_i q_i xq_i + c sx (formats'
// (a, c) as in kernels.cpp's nibble_block; dx, sx the input block's scale and scaled sum),
// accumulated in float32 across blocks.
namespace SZ_NS {

// the 32 integer values of block b of row n (u8: |q| for the signed formats) and the signed
// values for the sign trick (signed formats only)
template <int F>
SZ_TARGET inline __m256i decode(const QW& w, int64_t n, int64_t b, __m256i* sgn) {
  const uint8_t* row = w.p0 + n * w.s0;
  if (F == Q8_0 || F == INT8) {
    const uint8_t* q = F == Q8_0 ? row + b * 34 + 2 : row + b * 32;
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    *sgn = v;
    return _mm256_sign_epi8(v, v);
  }
  const uint8_t* q = F == INT4 ? row + b * 16 : F == Q4_0 ? row + b * 18 + 2 : row + b * 20 + 4;
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// (a, c) of block b of the 4 rows base[i] (= row rows[i]) as two float32 vectors, the fp16
// ones converted 4 or 8 at a time (the same values as one at a time: fp16 -> fp32 is exact)
template <int F>
SZ_TARGET inline void scales(const QW& w, const uint8_t* const* base, const int64_t* rows,
                             int64_t b, __m128* va, __m128* vc) {
  if (F == Q4_1) {  // each block starts with its two halves d, m: one 32-bit load per row
    const __m128i h = _mm_setr_epi32(
        static_cast<int>(load_u32(base[0] + b * 20)), static_cast<int>(load_u32(base[1] + b * 20)),
        static_cast<int>(load_u32(base[2] + b * 20)), static_cast<int>(load_u32(base[3] + b * 20)));
    const __m256 f = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(h),
                                              _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    *va = _mm256_castps256_ps128(f);
    *vc = _mm256_extractf128_ps(f, 1);
  } else if (F == Q8_0 || F == Q4_0) {
    const int64_t stride = F == Q8_0 ? 34 : 18;
    const __m128i h = _mm_setr_epi16(
        static_cast<short>(load_u16(base[0] + b * stride)),
        static_cast<short>(load_u16(base[1] + b * stride)),
        static_cast<short>(load_u16(base[2] + b * stride)),
        static_cast<short>(load_u16(base[3] + b * stride)), 0, 0, 0, 0);
    *va = _mm_cvtph_ps(h);
    *vc = F == Q4_0 ? _mm_mul_ps(*va, _mm_set1_ps(-8.f)) : _mm_setzero_ps();
  } else if (F == INT8) {
    *va = _mm_set1_ps(1.f);
    *vc = _mm_setzero_ps();
  } else {  // INT4: group g's scale s and zero z: (a, c) = (s, -s z)
    float a[4], c[4];
    const int64_t g = (b * 32) / w.group;
    for (int i = 0; i < 4; ++i) {
      a[i] = w.p1[rows[i] * w.s1 + g];
      c[i] = -a[i] * w.p2[rows[i] * w.s2 + g];
    }
    *va = _mm_loadu_ps(a);
    *vc = _mm_loadu_ps(c);
  }
}

// the 4 int32 sums of p[0..3]'s 8 lanes each
SZ_TARGET inline __m128i sum4(const __m256i* p) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]),
                                      _mm256_hadd_epi32(p[2], p[3]));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// y[m, n + i] = dot + bias for the 4 output rows rows[i] = n + i (the last one repeated
// past n1, not stored) and MR input rows (y row stride ldy). A block's 4 x MR integer sums are
// exact; each is scaled once (a dx, 4 output rows per float32 vector) and added to acc in
// block order, c sx likewise.
template <int F, int MR>
SZ_TARGET void tile(const QW& w, int64_t n, int64_t n1, const int8_t* xq, int64_t K,
                    const float* dx, const float* sx, int64_t nblk, const float* bias, float* y,
                    int64_t ldy) {
  constexpr bool SIGNED = F == Q8_0 || F == INT8;
  int64_t row[4];
  for (int i = 0; i < 4; ++i) row[i] = std::min<int64_t>(n + i, n1 - 1);
  __m128 acc[MR], cacc[MR];
  for (int r = 0; r < MR; ++r) { acc[r] = _mm_setzero_ps(); cacc[r] = _mm_setzero_ps(); }
  const int64_t bytes = block_bytes(F);
  const int64_t ahead = bytes < 32 ? PREFETCH_FAR_BYTES : PREFETCH_BYTES;  // kernels.cpp
  const uint8_t* base[4];
  for (int i = 0; i < 4; ++i) base[i] = w.p0 + row[i] * w.s0;
  for (int64_t b = 0; b < nblk; ++b) {
    __m256i u[4], s[4];
    __m128 va, vc;
    for (int i = 0; i < 4; ++i)  // the 4 row streams, then the next tile's 4 rows
      prefetch_row(base[i], base[i] + 4 * w.s0, b * bytes + ahead, nblk * bytes);
    for (int i = 0; i < 4; ++i) u[i] = decode<F>(w, row[i], b, &s[i]);
    scales<F>(w, base, row, b, &va, &vc);
    for (int r = 0; r < MR; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * 32));
      __m256i p[4];
      for (int i = 0; i < 4; ++i) p[i] = SZ_DOT(u[i], SIGNED ? _mm256_sign_epi8(xv, s[i]) : xv);
      const __m128 d = _mm_mul_ps(va, _mm_set1_ps(dx[r * nblk + b]));
      acc[r] = _mm_fmadd_ps(d, _mm_cvtepi32_ps(sum4(p)), acc[r]);
      if (!SIGNED) cacc[r] = _mm_fmadd_ps(vc, _mm_set1_ps(sx[r * nblk + b]), cacc[r]);
    }
  }
  float rs[4] = {1.f, 1.f, 1.f, 1.f}, bn[4] = {0.f, 0.f, 0.f, 0.f};
  for (int i = 0; i < 4; ++i) {
    if (F == INT8) rs[i] = w.p1[row[i] * w.s1];
    if (bias) bn[i] = bias[row[i]];
  }
  for (int r = 0; r < MR; ++r) {
    float out[4];
    _mm_storeu_ps(out, _mm_add_ps(acc[r], cacc[r]));
    for (int i = 0; i < 4 && n + i < n1; ++i) y[r * ldy + n + i] = out[i] * rs[i] + bn[i];
  }
}

// One input row (decode at batch 1) of the 8-bit formats (q8_0, int8): output rows [n0, n1)
// one after the other, each row's blocks in order, so a thread reads its rows as one
// sequential stream, which the hardware prefetchers follow (the tiles read 4 rows' streams
// at once), helped by a software prefetch PREFETCH_FAR_BYTES ahead (SmolLM2's q8_0 weights
// in a model's order 0.92x the time with it: each matrix starts a stream the hardware takes
// a few lines to find). Per output row the tiles' own arithmetic, in their order: a block's
// integer sum exact, then acc = fma(a dx, sum, acc) block after block (these formats have no
// offset term: c = 0): the same bits as tile<F, 1>, so a row's result does not depend on the
// batch it is in. The 4-bit formats keep the tiles (their per-block scale work, once per 4
// rows in a tile, made this stream 2-12% slower).
template <int F>
SZ_TARGET void row_stream(const QW& w, int64_t n0, int64_t n1, const int8_t* xq,
                          const float* dx, int64_t nblk, const float* bias, float* y) {
  static_assert(F == Q8_0 || F == INT8, "row_stream: the signed 8-bit formats only");
  constexpr int64_t bytes = F == Q8_0 ? 34 : 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.p0 + n * w.s0;
    __m128 acc = _mm_setzero_ps();
    for (int64_t b0 = 0; b0 < nblk; b0 += 4) {
      const int nb = static_cast<int>(std::min<int64_t>(4, nblk - b0));
      // the stream PREFETCH_FAR_BYTES ahead (into the next rows), one line at a time
      const uint8_t* ahead = row + b0 * bytes + PREFETCH_FAR_BYTES;
      for (int64_t off = 0; off < 4 * bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
      __m256i p[4];
      for (int j = 0; j < 4; ++j) {
        if (j < nb) {
          __m256i sg;
          const __m256i u = decode<F>(w, n, b0 + j, &sg);
          const __m256i xv =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (b0 + j) * 32));
          p[j] = SZ_DOT(u, _mm256_sign_epi8(xv, sg));
        } else {
          p[j] = _mm256_setzero_si256();
        }
      }
      alignas(16) int32_t sums[4];
      _mm_store_si128(reinterpret_cast<__m128i*>(sums), sum4(p));  // block j's exact sum
      for (int j = 0; j < nb; ++j) {
        const float a = F == Q8_0 ? half_to_float(row + (b0 + j) * bytes) : 1.f;
        const __m128 d = _mm_mul_ss(_mm_set_ss(a), _mm_set_ss(dx[b0 + j]));
        acc = _mm_fmadd_ss(d, _mm_cvtsi32_ss(_mm_setzero_ps(), sums[j]), acc);
      }
    }
    // the tile's out = acc + cacc with cacc = +0: acc starts at +0 and round-to-nearest
    // never makes it -0 again, so acc itself
    const float rs = F == INT8 ? w.p1[n * w.s1] : 1.f, bn = bias ? bias[n] : 0.f;
    y[n] = _mm_cvtss_f32(acc) * rs + bn;
  }
}

// output rows [n0, n1) for every input row: tiles of 4 output rows and SZ_MR, 4, 2 or 1
// input rows
template <int F>
SZ_TARGET void rows(const QW& w, int64_t n0, int64_t n1, int64_t M, const int8_t* xq,
                    int64_t K, const float* dx, const float* sx, int64_t nblk,
                    const float* bias, float* y, int64_t N) {
  if constexpr (F == Q8_0 || F == INT8) {
    if (M == 1) {
      row_stream<F>(w, n0, n1, xq, dx, nblk, bias, y);
      return;
    }
  }
  for (int64_t n = n0; n < n1; n += 4)
    for (int64_t m = 0; m < M;) {
      const int64_t left = M - m;
      const int8_t* xm = xq + m * K;
      const float* dm = dx + m * nblk;
      const float* sm = sx + m * nblk;
      float* ym = y + m * N;
      if (left >= SZ_MR) {
        tile<F, SZ_MR>(w, n, n1, xm, K, dm, sm, nblk, bias, ym, N);
        m += SZ_MR;
      } else if (SZ_MR > 4 && left >= 4) {
        tile<F, 4>(w, n, n1, xm, K, dm, sm, nblk, bias, ym, N);
        m += 4;
      } else if (left >= 2) {
        tile<F, 2>(w, n, n1, xm, K, dm, sm, nblk, bias, ym, N);
        m += 2;
      } else {
        tile<F, 1>(w, n, n1, xm, K, dm, sm, nblk, bias, ym, N);
        m += 1;
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
