// shardzoo::quant_linear's CPU kernel (kernels.py defines the op and its Python fallback):
// the same choice of kernel as kernels.py's `_kernel_linear`, made in C++ so that a compiled
// decode step's ~120 calls reach the kernels through the dispatcher alone, without a Python
// frame each. kernels.py passes its constants once (`configure_op`, when the kernels load)
// and the activations' choice with every call (`q8_isa`).
#include "kernels.h"
#include <ATen/core/dispatch/Dispatcher.h>
#include <algorithm>
#include <string>

namespace {

struct OpConfig {
  int64_t gemv_rows = 16;           // up to this many input rows: gemv, above: slabs + GEMM
  int64_t slab_bytes = 4 << 20;     // float32 bytes of weight rows de-quantized at a time
  bool onednn = false;              // slabs by oneDNN's inner product (layers/gemm.py)
};
OpConfig config;

int64_t format_code(c10::string_view fmt) {
  static const char* names[] = {"int8", "int4", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k"};
  for (int64_t i = 0; i < 7; ++i)
    if (fmt == names[i]) return i;
  TORCH_CHECK(false, "shardzoo::quant_linear: unknown format '", std::string(fmt), "'");
}

bool has_32_blocks(int64_t code) { return code <= 4; }  // int8 int4 q8_0 q4_0 q4_1

at::Tensor gemm_nt(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b) {
  if (!config.onednn) return at::linear(x, w, b);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, w, b, std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                          c10::optional<std::string>(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// prefill: float32 slabs of weight rows de-quantized, then one GEMM each
at::Tensor slabs(const at::Tensor& x, int64_t code, int64_t N, int64_t group,
                 const at::Tensor& t0, const c10::optional<at::Tensor>& t1,
                 const c10::optional<at::Tensor>& t2, const c10::optional<at::Tensor>& bias) {
  const int64_t K = x.size(1);
  const int64_t rows = std::max<int64_t>(64, config.slab_bytes / (4 * std::max<int64_t>(K, 1)));
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  for (int64_t start = 0; start < N; start += rows) {
    const int64_t n = std::min(rows, N - start);
    const at::Tensor w = dequant(code, K, group, start, n, t0, t1, t2);
    c10::optional<at::Tensor> b;
    if (bias.has_value()) b = bias->narrow(0, start, n).to(at::kFloat);
    y.narrow(1, start, n).copy_(gemm_nt(x, w, b));
  }
  return y;
}

at::Tensor quant_linear_cpu(const at::Tensor& x, c10::string_view fmt, int64_t out_features,
                            int64_t group, const at::Tensor& t0,
                            const c10::optional<at::Tensor>& t1,
                            const c10::optional<at::Tensor>& t2,
                            const c10::optional<at::Tensor>& bias, int64_t q8_isa) {
  const int64_t code = format_code(fmt);
  at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
  if (x2.scalar_type() != at::kFloat || x2.stride(-1) != 1) x2 = x2.to(at::kFloat).contiguous();
  const int64_t M = x2.size(0), K = x2.size(1);
  at::Tensor y;
  if (q8_isa > 0 && has_32_blocks(code) && K % 32 == 0 && simd())
    y = gemv_q8(x2, code, out_features, group, t0, t1, t2, bias, q8_isa);
  else if (M <= config.gemv_rows)
    y = gemv(x2, code, out_features, group, t0, t1, t2, bias);
  else
    y = slabs(x2, code, out_features, group, t0, t1, t2, bias);
  if (y.scalar_type() != x.scalar_type()) y = y.to(x.scalar_type());
  if (x.dim() == 2) return y;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(out_features);
  return y.view(shape);
}

}  // namespace

void configure_op(int64_t gemv_rows, int64_t slab_bytes, bool onednn) {
  config = OpConfig{gemv_rows, slab_bytes, onednn};
}

// the schema is kernels.py's (torch.library); this adds the CPU kernel to it
TORCH_LIBRARY_IMPL(shardzoo, CPU, m) {
  m.impl("quant_linear", &quant_linear_cpu);
}
