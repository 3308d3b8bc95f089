// SZ_AVX2: 1 where the compiler targets AVX2 + FMA (layers/cpu_extension.py passes -mavx2
// -mfma -mf16c when torch reports AVX2 or AVX-512), with <immintrin.h> included; 0 else,
// and the kernels that include this take their plain loops.
#pragma once
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SZ_AVX2 1
#else
#define SZ_AVX2 0
#endif
