// The keyed uniforms of inference/sampling.py (`uniforms`) in one pass: sampling.py's torch
// form makes ~30 passes of int64 tensor ops over the vocabulary for every sampled row.
// Integer arithmetic mod 2^32 (layers/dropout.py's mix32 with its multipliers passed in) and
// the same float64 operations in the same order, so the values are the torch form's bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>

namespace {

inline uint32_t mix32(uint32_t x, uint32_t m1, uint32_t m2) {
  x ^= x >> 16;
  x *= m1;
  x ^= x >> 15;
  x *= m2;
  return x ^ (x >> 16);
}

}  // namespace

// ids: int64 [n] in [0, 2^32) -> float64 [n] in (0, 1); key, khi, klo, m1, m2 in [0, 2^32)
at::Tensor keyed_uniforms(const at::Tensor& ids, int64_t key, int64_t khi, int64_t klo,
                          int64_t m1, int64_t m2) {
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1,
              "keyed_uniforms: ids must be a 1-D int64 CPU tensor");
  const at::Tensor in = ids.contiguous();
  at::Tensor out = at::empty({in.size(0)}, in.options().dtype(at::kDouble));
  const int64_t* p = in.data_ptr<int64_t>();
  double* q = out.data_ptr<double>();
  const uint32_t k = static_cast<uint32_t>(key), kh = static_cast<uint32_t>(khi),
                 kl = static_cast<uint32_t>(klo), a = static_cast<uint32_t>(m1),
                 b = static_cast<uint32_t>(m2);
  at::parallel_for(0, in.size(0), 16384, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint32_t h = mix32(static_cast<uint32_t>(p[i]) ^ k, a, b);
      const uint32_t hi = mix32(h ^ kh, a, b) >> 11;
      const uint32_t lo = mix32(h ^ kl, a, b);
      // (hi 2^32 + lo + 0.5) 2^-53 in float64 as sampling.py does it: hi 2^32 is exact, so
      // a compiler fusing it with + lo into one fma rounds the same
      q[i] = ((static_cast<double>(hi) * 4294967296.0 + static_cast<double>(lo)) + 0.5) *
             0x1p-53;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("keyed_uniforms", &keyed_uniforms);
}
