// Skinny fp32 matmuls on the CPU: y [M, N] = x [M, K] w[N, K]^T (+ b [N]) for a few rows M, the
// weight in nn.Linear's row-major layout, read once for all M rows. The arithmetic and the
// dispatch are described in skinny_cpu.py; the PyTorch reference is F.linear.
//
//   y[m, n] = sum_k x[m, k] w[n, k] + b[n]       (fp32 products and sums, lane-wise then a tree)
//
// Each pass takes R weight rows and all M activation rows: R x M vector accumulators, one load
// of a weight vector feeding M fused multiply-adds. Three paths, chosen per call (`path`):
// 2 = AVX-512 (16 lanes, masked tail), 1 = AVX2 (8 lanes, scalar tail), 0 = portable C++. The
// SIMD paths are compiled with function target attributes, so one library holds all three
// whatever flags it was built with; skinny_caps() says which ones this CPU runs.

#include "cpu_simd.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SKINNY_X86 1
#endif

namespace {

constexpr int M_MAX = 8;
constexpr int PREFETCH = 128;  // floats ahead in each weight row (software prefetch into L1)

struct Args {
  const float* x;  // [M, K]
  const float* w;  // [N, K]
  const float* b;  // [N] or null
  float* y;        // [M, N]
  int64_t M, K, N;
};

// Weight rows per pass for M activation rows: R x M accumulators stay within the registers.
constexpr int rows_for(int M) { return M <= 2 ? 8 : M <= 4 ? 6 : M <= 6 ? 4 : 3; }

void rows_scalar(const Args& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < a.M; ++m) {
      const float* x = a.x + m * a.K;
      const float* w = a.w + n * a.K;
      float acc = 0.0f;
      for (int64_t k = 0; k < a.K; ++k) acc += x[k] * w[k];
      a.y[m * a.N + n] = acc + (a.b ? a.b[n] : 0.0f);
    }
}

#ifdef SKINNY_X86
#define AVX512 __attribute__((target("avx512f,fma")))
#define AVX2 __attribute__((target("avx2,fma")))

// Rows n0 .. n0 + r of the weight (r <= R) against the M rows of x.
template <int M, int R>
AVX512 void pass512(const Args& a, int64_t n0, int r) {
  __m512 acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) acc[i][m] = _mm512_setzero_ps();
  const float* w[R];
  for (int i = 0; i < R; ++i) w[i] = a.w + (n0 + (i < r ? i : 0)) * a.K;
  const int64_t K = a.K, tail = K % 16;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = (k + 16 <= K) ? (__mmask16)0xFFFF : (__mmask16)((1u << tail) - 1);
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_maskz_loadu_ps(mask, a.x + m * K + k);
    for (int i = 0; i < R; ++i) {
      _mm_prefetch((const char*)(w[i] + k + PREFETCH), _MM_HINT_T0);
      const __m512 wv = _mm512_maskz_loadu_ps(mask, w[i] + k);
      for (int m = 0; m < M; ++m) acc[i][m] = _mm512_fmadd_ps(wv, xv[m], acc[i][m]);
    }
  }
  for (int i = 0; i < r; ++i) {
    const float bias = a.b ? a.b[n0 + i] : 0.0f;
    for (int m = 0; m < M; ++m) a.y[m * a.N + n0 + i] = _mm512_reduce_add_ps(acc[i][m]) + bias;
  }
}

AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int M, int R>
AVX2 void pass256(const Args& a, int64_t n0, int r) {
  // 16 ymm registers: R x M accumulators plus one weight and the M activation vectors
  constexpr int R2 = (R * M + M + 1 <= 16) ? R : (15 - M) / M > 0 ? (15 - M) / M : 1;
  for (int i0 = 0; i0 < r; i0 += R2) {
    const int rr = r - i0 < R2 ? r - i0 : R2;
    __m256 acc[R2][M];
    for (int i = 0; i < R2; ++i)
      for (int m = 0; m < M; ++m) acc[i][m] = _mm256_setzero_ps();
    const float* w[R2];
    for (int i = 0; i < R2; ++i) w[i] = a.w + (n0 + i0 + (i < rr ? i : 0)) * a.K;
    const int64_t K = a.K, K8 = K - K % 8;
    for (int64_t k = 0; k < K8; k += 8) {
      __m256 xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_ps(a.x + m * K + k);
      for (int i = 0; i < R2; ++i) {
        if ((k & 15) == 0) _mm_prefetch((const char*)(w[i] + k + PREFETCH), _MM_HINT_T0);
        const __m256 wv = _mm256_loadu_ps(w[i] + k);
        for (int m = 0; m < M; ++m) acc[i][m] = _mm256_fmadd_ps(wv, xv[m], acc[i][m]);
      }
    }
    for (int i = 0; i < rr; ++i) {
      const float bias = a.b ? a.b[n0 + i0 + i] : 0.0f;
      for (int m = 0; m < M; ++m) {
        float s = hsum256(acc[i][m]);
        for (int64_t k = K8; k < K; ++k) s += a.x[m * K + k] * w[i][k];
        a.y[m * a.N + n0 + i0 + i] = s + bias;
      }
    }
  }
}

template <int M>
void rows_simd(const Args& a, int path, int64_t n0, int64_t n1) {
  constexpr int R = rows_for(M);
  for (int64_t n = n0; n < n1; n += R) {
    const int r = (int)std::min<int64_t>(R, n1 - n);
    if (path == 2)
      pass512<M, R>(a, n, r);
    else
      pass256<M, R>(a, n, r);
  }
}

void rows(const Args& a, int path, int64_t n0, int64_t n1) {
  if (path == 0) return rows_scalar(a, n0, n1);
  switch (a.M) {
    case 1: return rows_simd<1>(a, path, n0, n1);
    case 2: return rows_simd<2>(a, path, n0, n1);
    case 3: return rows_simd<3>(a, path, n0, n1);
    case 4: return rows_simd<4>(a, path, n0, n1);
    case 5: return rows_simd<5>(a, path, n0, n1);
    case 6: return rows_simd<6>(a, path, n0, n1);
    case 7: return rows_simd<7>(a, path, n0, n1);
    default: return rows_simd<8>(a, path, n0, n1);
  }
}
#else
void rows(const Args& a, int, int64_t n0, int64_t n1) { rows_scalar(a, n0, n1); }
#endif

// Weight rows per unit of work: a multiple of every rows_for(M).
constexpr int64_t BLOCK = 48;

// y [M, N] = x [M, K] w [N, K]^T + b (b may be null) for the weight rows n0 .. n1 - 1, on the
// calling thread; M > 8 in chunks of 8.
void rows_all_m(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t K,
                int64_t N, int path, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < M; m0 += M_MAX) {
    const Args a{x + m0 * K, w, b, y + m0 * N, std::min<int64_t>(M_MAX, M - m0), K, N};
    rows(a, path, n0, n1);
  }
}

}  // namespace

extern "C" {

// Bit 0: the portable path (always), bit 1: AVX2 + FMA, bit 2: AVX-512F, as this CPU runs them.
int skinny_caps() {
  int caps = 1;
#ifdef SKINNY_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) caps |= 2;
  if (__builtin_cpu_supports("avx512f") && (caps & 2)) caps |= 4;
#endif
  return caps;
}

// y [M, N] = x [M, K] w [N, K]^T + b (b may be null): the weight rows spread over `nthreads`
// OpenMP threads in blocks of BLOCK rows.
void skinny_linear(const float* x, const float* w, const float* b, float* y, int64_t M,
                   int64_t K, int64_t N, int path, int nthreads) {
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
  for (int64_t u = 0; u < blocks; ++u)
    rows_all_m(x, w, b, y, M, K, N, path, u * BLOCK, std::min<int64_t>(N, (u + 1) * BLOCK));
}

}  // extern "C"
