// Shared by the C++ CPU kernels: the instruction set they were built for, fp32 vectors of L
// lanes (GCC and Clang vector extensions), and fp16 -> fp32.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CPU_SIMD 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CPU_SIMD 256
#endif

namespace cpu_simd {

#if CPU_SIMD == 512
constexpr int L = 16;  // fp32 lanes of a vector
#else
constexpr int L = 8;
#endif

typedef float fv __attribute__((vector_size(4 * L)));
typedef float f8 __attribute__((vector_size(32)));
typedef uint32_t u8 __attribute__((vector_size(32)));

inline fv load(const float* p) {
  fv v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, fv v) { std::memcpy(p, &v, sizeof v); }

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof v); }

template <class V>
inline float hsum(V v) {
  float s = 0.0f;
  for (size_t j = 0; j < sizeof v / sizeof(float); ++j) s += v[j];
  return s;
}

inline float half_to_float(uint16_t h) {
#ifdef CPU_SIMD
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) {
    float f = std::ldexp((float)m, -24);
    return sign ? -f : f;
  }
  uint32_t bits = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// Pieces of a row of work per unit: whole rows with one thread, else about four units per
// thread (at least `least` pieces each).
inline int64_t chunk_of(int64_t rows, int64_t pieces, int nthreads, int64_t least) {
  if (nthreads <= 1) return std::max<int64_t>(pieces, 1);
  int64_t target = std::max<int64_t>(1, rows * pieces / (4 * nthreads));
  return std::max<int64_t>(std::min(pieces, std::max<int64_t>(target, least)), 1);
}

}  // namespace cpu_simd
