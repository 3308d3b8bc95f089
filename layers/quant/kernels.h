// The low-bit matmul kernels of kernels.cpp, for quant_op.cpp (the op around them).
#pragma once
#include <torch/extension.h>

// x: float32 [M, in] (unit column stride) -> float32 [M, out], float32 activations.
at::Tensor gemv(const at::Tensor& x, int64_t fmt, int64_t out_features, int64_t group,
                const at::Tensor& t0, const c10::optional<at::Tensor>& t1,
                const c10::optional<at::Tensor>& t2, const c10::optional<at::Tensor>& bias);

// As gemv with x rounded to 8 bits per 32-block (the 32-block formats, in % 32 == 0, AVX2).
at::Tensor gemv_q8(const at::Tensor& x, int64_t fmt, int64_t out_features, int64_t group,
                   const at::Tensor& t0, const c10::optional<at::Tensor>& t1,
                   const c10::optional<at::Tensor>& t2, const c10::optional<at::Tensor>& bias,
                   int64_t isa);

// The float32 rows [start, start + rows) of the weight: [rows, in].
at::Tensor dequant(int64_t fmt, int64_t in, int64_t group, int64_t start, int64_t rows,
                   const at::Tensor& t0, const c10::optional<at::Tensor>& t1,
                   const c10::optional<at::Tensor>& t2);

int64_t simd();
