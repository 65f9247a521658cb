// W4A8 (and W3A8, W8A8) group-quantized linears on the CPU: int8 activations against the packed
// codes, integer dot products, int32 sums per 32-channel block, fp32 scaling. The layouts and
// the arithmetic are described in w4a8_cpu.py; the PyTorch reference is w4a8_ref.py.
//
//   I[m, b, o] = sum_{i in block b} q[i, o] xq[m, i]                          (int32, exact)
//   y[m, o]    = sum_G s[G, o] sum_{b in G} d[m, b] I[m, b, o] - sum_G sz[G, o] xs[m, G]
//
// Three paths, chosen per call (`path`): 2 = AVX-512 VNNI (vpdpbusd, 16 output columns per
// vector), 1 = AVX2 (vpmaddubsw + vpmaddwd), 0 = portable C++. The SIMD paths are compiled
// with function target attributes, so one library holds all three whatever flags it was built
// with; w4a8_caps() says which ones this CPU runs.

#include "cpu_simd.h"

#include <algorithm>
#include <numeric>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define W4A8_X86 1
#endif

namespace {

constexpr int TILE = 16;  // output columns per tile
constexpr int BLK = 32;   // input channels per activation block
constexpr int MR_MAX = 4; // rows of x per pass over a tile

// Bytes of one (tile, 32-channel block) of the packed weight.
constexpr int64_t block_bytes(int bits) { return bits == 4 ? 256 : bits == 8 ? 512 : 192; }

struct Args {
  const int8_t* xq;  // [M, K]
  const float* d;    // [M, K / 32]
  const float* xs;   // [M, G]
  const uint8_t* w;  // [N / 16, K / 32, block_bytes]
  const float* s;    // [G, N]
  const float* sz;   // [G, N]
  float* y;          // [M, N]
  int64_t M, K, N, g;
  const uint16_t* s16 = nullptr;  // the symmetric form: fp16 scales [G, N] and one zero point
  float zc = 0.0f;                // (s and sz unused): y = sum_G s (acc_G - zc xs_G)
};

// The weight's scales: fp32 s and sz = s z [G, N] (`half` 0), or fp16 s [G, N] and the one zero
// point *sz of symmetric codes (`half` 1).
Args make_args(const int8_t* xq, const float* d, const float* xs, const uint8_t* w,
               const void* s, const float* sz, float* y, int64_t M, int64_t K, int64_t N,
               int64_t g, int half) {
  Args a{xq, d, xs, w, (const float*)s, sz, y, M, K, N, g};
  if (half) a.s16 = (const uint16_t*)s, a.zc = *sz, a.s = a.sz = nullptr;
  return a;
}

// IEEE half -> float (the portable path's reading of fp16 scales).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) return (sign ? -1.0f : 1.0f) * std::ldexp((float)m, -24);
  const uint32_t u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- portable C++ --------------------------------------------------------------------------

// Code of channel k (within the block) of column j of one packed (tile, block).
inline int code_at(const uint8_t* blk, int bits, int k, int j) {
  const int u = k & 3;
  if (bits == 8) return blk[(k >> 2) * 64 + j * 4 + u];
  if (bits == 4) {
    const int step = k >> 3, hi = (k >> 2) & 1;
    return (blk[step * 64 + j * 4 + u] >> (4 * hi)) & 15;
  }
  const int c4 = k >> 2;  // k4-step 0..7: crumb (c4 % 4) of chunk c4 / 4, high bit c4
  const int lo = (blk[(c4 >> 2) * 64 + j * 4 + u] >> (2 * (c4 & 3))) & 3;
  const int hi = (blk[128 + j * 4 + u] >> c4) & 1;
  return lo | (hi << 2);
}

void tile_scalar(const Args& a, int bits, int64_t t, int64_t m0, int64_t mr) {
  const int64_t KB = a.K / BLK, G = a.K / a.g, bpg = a.g / BLK, col0 = t * TILE;
  const uint8_t* wt = a.w + t * KB * block_bytes(bits);
  for (int64_t m = m0; m < m0 + mr; ++m) {
    float y[TILE] = {};
    for (int64_t gi = 0; gi < G; ++gi) {
      float acc[TILE] = {};
      for (int64_t b = gi * bpg; b < (gi + 1) * bpg; ++b) {
        const uint8_t* blk = wt + b * block_bytes(bits);
        const int8_t* x = a.xq + m * a.K + b * BLK;
        int32_t I[TILE] = {};
        for (int k = 0; k < BLK; ++k)
          for (int j = 0; j < TILE; ++j) I[j] += code_at(blk, bits, k, j) * (int32_t)x[k];
        const float d = a.d[m * KB + b];
        for (int j = 0; j < TILE; ++j) acc[j] += (float)I[j] * d;
      }
      const float xs = a.xs[m * G + gi];
      const int64_t at = gi * a.N + col0;
      for (int j = 0; j < TILE; ++j)
        y[j] += a.s16 ? (acc[j] - a.zc * xs) * half_to_float(a.s16[at + j])
                      : acc[j] * a.s[at + j] - xs * a.sz[at + j];
    }
    for (int j = 0; j < TILE; ++j) a.y[m * a.N + col0 + j] = y[j];
  }
}

#ifdef W4A8_X86

// ---- AVX-512 VNNI --------------------------------------------------------------------------

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,fma")))

// The int32 sums I of one 32-channel block for MR rows and NT tiles (tile stride `tstride`
// bytes), added into acc as fp32 times the rows' block scales.
VNNI inline __m512i dot4(__m512i acc, __m512i w, const int8_t* x) {
  int32_t a;
  std::memcpy(&a, x, 4);
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(a));
}

template <int BITS, int MR, int NT>
VNNI inline void block_vnni(const uint8_t* blk, int64_t tstride, const int8_t* const* x,
                            const float* d, __m512* acc) {
  __m512i I[MR * NT];
  for (int i = 0; i < MR * NT; ++i) I[i] = _mm512_setzero_si512();
  const __m512i m4 = _mm512_set1_epi8(15);
#define dot(r, n, w, k) (I[(r) * NT + (n)] = dot4(I[(r) * NT + (n)], (w), x[r] + (k)))
  if constexpr (BITS == 8) {
    for (int st = 0; st < 8; ++st)
      for (int n = 0; n < NT; ++n) {
        const __m512i w = _mm512_loadu_si512(blk + n * tstride + st * 64);
        for (int r = 0; r < MR; ++r) dot(r, n, w, 4 * st);
      }
  } else if constexpr (BITS == 4) {
    for (int st = 0; st < 4; ++st)
      for (int n = 0; n < NT; ++n) {
        const __m512i v = _mm512_loadu_si512(blk + n * tstride + st * 64);
        const __m512i lo = _mm512_and_si512(v, m4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        for (int r = 0; r < MR; ++r) dot(r, n, lo, 8 * st), dot(r, n, hi, 8 * st + 4);
      }
  } else {  // 3 bits: two chunks of 2-bit crumbs, then the high bits
    const __m512i m2 = _mm512_set1_epi8(3), b2 = _mm512_set1_epi8(4);
    for (int n = 0; n < NT; ++n) {
      const __m512i h = _mm512_loadu_si512(blk + n * tstride + 128);
      for (int ch = 0; ch < 2; ++ch) {
        const __m512i v = _mm512_loadu_si512(blk + n * tstride + ch * 64);
        for (int c = 0; c < 4; ++c) {
          const int c4 = 4 * ch + c;
          const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(v, 2 * c), m2);
          const __m512i hb = c4 <= 2 ? _mm512_slli_epi16(h, 2 - c4) : _mm512_srli_epi16(h, c4 - 2);
          const __m512i w = _mm512_ternarylogic_epi32(lo, hb, b2, 0xF8);  // lo | (hb & 4)
          for (int r = 0; r < MR; ++r) dot(r, n, w, 4 * c4);
        }
      }
    }
  }
#undef dot
  for (int r = 0; r < MR; ++r) {
    const __m512 dv = _mm512_set1_ps(d[r]);
    for (int n = 0; n < NT; ++n)
      acc[r * NT + n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[r * NT + n]), dv, acc[r * NT + n]);
  }
}

template <int BITS, int MR, int NT, bool HALF>  // HALF: the symmetric form (a.s16, a.zc)
VNNI void tiles_vnni(const Args& a, int64_t t, int64_t m0) {
  const int64_t KB = a.K / BLK, G = a.K / a.g, bpg = a.g / BLK, col0 = t * TILE;
  const int64_t tstride = KB * block_bytes(BITS);
  const uint8_t* wt = a.w + t * tstride;
  __m512 y[MR * NT];
  for (int i = 0; i < MR * NT; ++i) y[i] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < G; ++gi) {
    __m512 acc[MR * NT];
    for (int i = 0; i < MR * NT; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = gi * bpg; b < (gi + 1) * bpg; ++b) {
      const int8_t* x[MR];
      float d[MR];
      for (int r = 0; r < MR; ++r) x[r] = a.xq + (m0 + r) * a.K + b * BLK, d[r] = a.d[(m0 + r) * KB + b];
      block_vnni<BITS, MR, NT>(wt + b * block_bytes(BITS), tstride, x, d, acc);
    }
    for (int n = 0; n < NT; ++n) {
      const int64_t at = gi * a.N + col0 + n * TILE;
      if constexpr (HALF) {
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(a.s16 + at)));
        for (int r = 0; r < MR; ++r) {
          const __m512 zx = _mm512_set1_ps(a.zc * a.xs[(m0 + r) * G + gi]);
          y[r * NT + n] = _mm512_fmadd_ps(_mm512_sub_ps(acc[r * NT + n], zx), s, y[r * NT + n]);
        }
      } else {
        const __m512 s = _mm512_loadu_ps(a.s + at);
        const __m512 sz = _mm512_loadu_ps(a.sz + at);
        for (int r = 0; r < MR; ++r) {
          __m512& yy = y[r * NT + n];
          yy = _mm512_fmadd_ps(acc[r * NT + n], s, yy);
          yy = _mm512_fnmadd_ps(_mm512_set1_ps(a.xs[(m0 + r) * G + gi]), sz, yy);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NT; ++n) _mm512_storeu_ps(a.y + (m0 + r) * a.N + col0 + n * TILE, y[r * NT + n]);
}

// ---- AVX2 ----------------------------------------------------------------------------------

#define AVX2 __attribute__((target("avx2,fma,f16c")))

// One 32-byte half (8 columns) of a tile: I over one block for MR rows. vpmaddubsw sums pairs
// of u8 x s8 products into int16 without overflow for codes < 16 (4 k-steps of 2 x 15 x 127
// stay under 2^15), so the int16 sums are widened once per block; 8-bit codes are split into
// their nibbles, each summed so, then combined as 16 hi + lo in int32.
AVX2 inline __m256i bcast4(const int8_t* x) {
  int32_t a;
  std::memcpy(&a, x, 4);
  return _mm256_set1_epi32(a);
}

template <int BITS, int MR>
AVX2 inline void half_avx2(const uint8_t* blk, int half, const int8_t* const* x, __m256i* I) {
  const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi16(1);
  __m256i s16[MR], h16[MR];
  for (int r = 0; r < MR; ++r) s16[r] = h16[r] = _mm256_setzero_si256();
#define bx(r, k) bcast4(x[r] + (k))
  if constexpr (BITS == 8) {
    for (int st = 0; st < 8; ++st) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + st * 64 + 32 * half));
      const __m256i lo = _mm256_and_si256(v, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      for (int r = 0; r < MR; ++r) {
        const __m256i xa = bx(r, 4 * st);
        s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, xa));
        h16[r] = _mm256_add_epi16(h16[r], _mm256_maddubs_epi16(hi, xa));
      }
      if (st == 3)  // 4 steps of each nibble fill the int16 sums: widen them
        for (int r = 0; r < MR; ++r) {
          I[r] = _mm256_add_epi32(I[r], _mm256_madd_epi16(s16[r], one));
          I[r] = _mm256_add_epi32(I[r], _mm256_madd_epi16(h16[r], _mm256_set1_epi16(16)));
          s16[r] = h16[r] = _mm256_setzero_si256();
        }
    }
    for (int r = 0; r < MR; ++r) {
      I[r] = _mm256_add_epi32(I[r], _mm256_madd_epi16(s16[r], one));
      I[r] = _mm256_add_epi32(I[r], _mm256_madd_epi16(h16[r], _mm256_set1_epi16(16)));
    }
    return;
  } else if constexpr (BITS == 4) {
    for (int st = 0; st < 4; ++st) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + st * 64 + 32 * half));
      const __m256i lo = _mm256_and_si256(v, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      for (int r = 0; r < MR; ++r) {
        s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, bx(r, 8 * st)));
        h16[r] = _mm256_add_epi16(h16[r], _mm256_maddubs_epi16(hi, bx(r, 8 * st + 4)));
      }
    }
  } else {
    const __m256i m2 = _mm256_set1_epi8(3), b2 = _mm256_set1_epi8(4);
    const __m256i h = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * half));
    for (int ch = 0; ch < 2; ++ch) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + ch * 64 + 32 * half));
      for (int c = 0; c < 4; ++c) {
        const int c4 = 4 * ch + c;
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(v, 2 * c), m2);
        const __m256i hb = c4 <= 2 ? _mm256_slli_epi16(h, 2 - c4) : _mm256_srli_epi16(h, c4 - 2);
        const __m256i w = _mm256_or_si256(lo, _mm256_and_si256(hb, b2));
        for (int r = 0; r < MR; ++r)
          s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(w, bx(r, 4 * c4)));
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    I[r] = _mm256_add_epi32(I[r], _mm256_madd_epi16(_mm256_add_epi16(s16[r], h16[r]), one));
#undef bx
}

template <int BITS, int MR, bool HALF>
AVX2 void tile_avx2(const Args& a, int64_t t, int64_t m0) {
  const int64_t KB = a.K / BLK, G = a.K / a.g, bpg = a.g / BLK, col0 = t * TILE;
  const uint8_t* wt = a.w + t * KB * block_bytes(BITS);
  for (int half = 0; half < 2; ++half) {
    const int64_t c0 = col0 + 8 * half;
    __m256 y[MR];
    for (int r = 0; r < MR; ++r) y[r] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < G; ++gi) {
      __m256 acc[MR];
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t b = gi * bpg; b < (gi + 1) * bpg; ++b) {
        const int8_t* x[MR];
        __m256i I[MR];
        for (int r = 0; r < MR; ++r) x[r] = a.xq + (m0 + r) * a.K + b * BLK, I[r] = _mm256_setzero_si256();
        half_avx2<BITS, MR>(wt + b * block_bytes(BITS), half, x, I);
        for (int r = 0; r < MR; ++r)
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[r]), _mm256_set1_ps(a.d[(m0 + r) * KB + b]), acc[r]);
      }
      if constexpr (HALF) {
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(a.s16 + gi * a.N + c0)));
        for (int r = 0; r < MR; ++r) {
          const __m256 zx = _mm256_set1_ps(a.zc * a.xs[(m0 + r) * G + gi]);
          y[r] = _mm256_fmadd_ps(_mm256_sub_ps(acc[r], zx), s, y[r]);
        }
      } else {
        const __m256 s = _mm256_loadu_ps(a.s + gi * a.N + c0);
        const __m256 sz = _mm256_loadu_ps(a.sz + gi * a.N + c0);
        for (int r = 0; r < MR; ++r) {
          y[r] = _mm256_fmadd_ps(acc[r], s, y[r]);
          y[r] = _mm256_fnmadd_ps(_mm256_set1_ps(a.xs[(m0 + r) * G + gi]), sz, y[r]);
        }
      }
    }
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(a.y + (m0 + r) * a.N + c0, y[r]);
  }
}

template <int BITS, bool HALF>
void run_avx2(const Args& a, int64_t t, int64_t m0, int64_t mr) {
  switch (mr) {
    case 1: return tile_avx2<BITS, 1, HALF>(a, t, m0);
    case 2: return tile_avx2<BITS, 2, HALF>(a, t, m0);
    case 3: return tile_avx2<BITS, 3, HALF>(a, t, m0);
    default: return tile_avx2<BITS, 4, HALF>(a, t, m0);
  }
}

// NT tiles starting at t for rows m0 .. m0 + mr - 1 (mr <= 4): more tiles per pass for fewer
// rows, so that one row still has independent chains of vpdpbusd.
template <int BITS, bool HALF>
void run_vnni(const Args& a, int64_t t, int nt, int64_t m0, int64_t mr) {
  if (nt == 4 && mr == 1) return tiles_vnni<BITS, 1, 4, HALF>(a, t, m0);
  if (nt >= 2 && mr <= 2) {
    for (int i = 0; i + 2 <= nt; i += 2)
      mr == 1 ? tiles_vnni<BITS, 1, 2, HALF>(a, t + i, m0) : tiles_vnni<BITS, 2, 2, HALF>(a, t + i, m0);
    if (nt % 2 == 0) return;
    t += nt - 1, nt = 1;
  }
  for (int i = 0; i < nt; ++i) switch (mr) {
      case 1: tiles_vnni<BITS, 1, 1, HALF>(a, t + i, m0); break;
      case 2: tiles_vnni<BITS, 2, 1, HALF>(a, t + i, m0); break;
      case 3: tiles_vnni<BITS, 3, 1, HALF>(a, t + i, m0); break;
      default: tiles_vnni<BITS, 4, 1, HALF>(a, t + i, m0); break;
    }
}

#endif  // W4A8_X86

#ifdef W4A8_X86
// The SIMD paths' tiles for one form of the scales (HALF), by width.
template <bool HALF>
void simd_tiles(const Args& a, int bits, int path, int64_t t, int nt, int64_t m0, int64_t mr) {
  if (path == 2) {
    if (bits == 4) return run_vnni<4, HALF>(a, t, nt, m0, mr);
    if (bits == 8) return run_vnni<8, HALF>(a, t, nt, m0, mr);
    return run_vnni<3, HALF>(a, t, nt, m0, mr);
  }
  for (int i = 0; i < nt; ++i) {
    if (bits == 4) run_avx2<4, HALF>(a, t + i, m0, mr);
    else if (bits == 8) run_avx2<8, HALF>(a, t + i, m0, mr);
    else run_avx2<3, HALF>(a, t + i, m0, mr);
  }
}
#endif

void run_tiles(const Args& a, int bits, int path, int64_t t, int nt, int64_t m0, int64_t mr) {
#ifdef W4A8_X86
  if (path == 2 || path == 1)
    return a.s16 ? simd_tiles<true>(a, bits, path, t, nt, m0, mr)
                 : simd_tiles<false>(a, bits, path, t, nt, m0, mr);
#endif
  for (int i = 0; i < nt; ++i) tile_scalar(a, bits, t + i, m0, mr);
}

inline float as_f32(float v) { return v; }
inline float as_f32(uint16_t v) {  // bfloat16 bits
  const uint32_t u = (uint32_t)v << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
void quantize_rows(const T* x, int8_t* xq, float* d, float* xs, int64_t M, int64_t K, int64_t g) {
  const int64_t KB = K / BLK, bpg = g / BLK;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t gi = 0; gi < K / g; ++gi) {
      float sum = 0.0f;
      for (int64_t b = gi * bpg; b < (gi + 1) * bpg; ++b) {
        const T* xb = x + m * K + b * BLK;
        float xf[BLK], amax = 0.0f;
        for (int k = 0; k < BLK; ++k) xf[k] = as_f32(xb[k]), amax = std::max(amax, std::fabs(xf[k]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t bsum = 0;
        for (int k = 0; k < BLK; ++k) {
          const int32_t v = (int32_t)std::nearbyint(xf[k] * inv);
          xq[m * K + b * BLK + k] = (int8_t)v;
          bsum += v;
        }
        d[m * KB + b] = amax / 127.0f;
        sum += d[m * KB + b] * (float)bsum;
      }
      xs[m * (K / g) + gi] = sum;
    }
}

}  // namespace

extern "C" {

// Bit 0: the portable path (always), bit 1: AVX2, bit 2: AVX-512 VNNI, as this CPU runs them.
int w4a8_caps() {
  int caps = 1;
#ifdef W4A8_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) caps |= 2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni"))
    caps |= 4;
#endif
  return caps;
}

// Per row m and 32-channel block b of fp32 x [M, K]: d = absmax / 127, xq = round(x * 127 /
// absmax) (half to even; 0 for an all-zero block), and xs[m, G] = sum_{b in G} d sum xq.
void w4a8_quantize(const float* x, int8_t* xq, float* d, float* xs, int64_t M, int64_t K,
                   int64_t g) {
  quantize_rows(x, xq, d, xs, M, K, g);
}

// The same from bfloat16 x (the high halves of fp32 values).
void w4a8_quantize_bf16(const uint16_t* x, int8_t* xq, float* d, float* xs, int64_t M,
                        int64_t K, int64_t g) {
  quantize_rows(x, xq, d, xs, M, K, g);
}

// y [M, N] fp32 from the quantized activations and a packed weight (layouts in w4a8_cpu.py);
// its scales as make_args reads them (`half`).
void w4a8_gemm(const int8_t* xq, const float* d, const float* xs, const uint8_t* w,
               const void* s, const float* sz, float* y, int64_t M, int64_t K, int64_t N,
               int64_t g, int bits, int path, int nthreads, int half) {
  const Args a = make_args(xq, d, xs, w, s, sz, y, M, K, N, g, half);
  const int64_t tiles = N / TILE;
  const int nt = M == 1 ? 4 : M == 2 ? 2 : 1;  // tiles per unit of work
  const int64_t units = (tiles + nt - 1) / nt;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t t = u * nt;
    const int n = (int)std::min<int64_t>(nt, tiles - t);
    for (int64_t m0 = 0; m0 < M; m0 += MR_MAX)
      run_tiles(a, bits, path, t, n, m0, std::min<int64_t>(MR_MAX, M - m0));
  }
}

// Both steps in one call; xq, d and xs are the caller's scratch.
void w4a8_linear(const float* x, int8_t* xq, float* d, float* xs, const uint8_t* w,
                 const void* s, const float* sz, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t g, int bits, int path, int nthreads, int half) {
  w4a8_quantize(x, xq, d, xs, M, K, g);
  w4a8_gemm(xq, d, xs, w, s, sz, y, M, K, N, g, bits, path, nthreads, half);
}


// A mixture-of-experts MLP over a few rows (w4a8_cpu.py's `experts`): for each routed slot
// s = (m, j) of the S = M k slots, with e = e[m, j] and the SiLU-gated expert
//   h = W_gu[e] x_m  (2I columns, gate first),  a = silu(h[:I]) * h[I:],  z_s = W_dn[e] a,
//   y[m] = sum_j w[m, j] z_(m, j), the j in ascending expert order (fp32).
// x is quantized once; the slots are grouped by expert, so an expert routed from several rows
// is read once for them; each projection of all the routed experts is one parallel loop over
// (expert, tiles) units. gu_* and dn_* hold one pointer per expert (w4a8_cpu.prepare's form,
// its scales as make_args reads them: gu_half, dn_half).
void w4a8_experts(const float* x, const int64_t* e, const float* wts, int64_t M, int64_t k,
                  int64_t H, int64_t I, const uint8_t* const* gu_w, const void* const* gu_s,
                  const float* const* gu_sz, int64_t gu_g, int gu_bits, int gu_half,
                  const uint8_t* const* dn_w, const void* const* dn_s,
                  const float* const* dn_sz, int64_t dn_g, int dn_bits, int dn_half, float* y,
                  int path, int nthreads) {
  const int64_t S = M * k, N1 = 2 * I;
  std::vector<int64_t> order(S);  // the slots by ascending expert (a row's in its own order)
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return e[a] < e[b]; });
  struct Group { int64_t expert, start, n; };
  std::vector<Group> groups;
  for (int64_t r = 0; r < S; ++r) {
    if (r == 0 || e[order[r]] != e[order[r - 1]]) groups.push_back({e[order[r]], r, 0});
    ++groups.back().n;
  }
  // x's rows quantized once, then gathered into the sorted order
  const int64_t KB1 = H / BLK, G1 = H / gu_g, KB2 = I / BLK, G2 = I / dn_g;
  std::vector<int8_t> xq0(M * H), xq(S * H), aq(S * I);
  std::vector<float> d0(M * KB1), xs0(M * G1), d(S * KB1), xs(S * G1);
  std::vector<float> h(S * N1), a(S * I), ad(S * KB2), axs(S * G2), z(S * H);
  w4a8_quantize(x, xq0.data(), d0.data(), xs0.data(), M, H, gu_g);
  for (int64_t r = 0; r < S; ++r) {
    const int64_t m = order[r] / k;
    std::memcpy(&xq[r * H], &xq0[m * H], H);
    std::memcpy(&d[r * KB1], &d0[m * KB1], KB1 * sizeof(float));
    std::memcpy(&xs[r * G1], &xs0[m * G1], G1 * sizeof(float));
  }
  // one projection of every routed expert: units of nt tiles of one group's expert
  auto project = [&](const int8_t* q, const float* qd, const float* qs, int64_t K, int64_t N,
                     int64_t g, int bits, int half, const uint8_t* const* W,
                     const void* const* Sc, const float* const* Sz, float* out) {
    struct Unit { int64_t group, t; int nt; };
    std::vector<Unit> units;
    const int64_t tiles = N / TILE;
    for (int64_t gi = 0; gi < (int64_t)groups.size(); ++gi) {
      const int nt = groups[gi].n == 1 ? 4 : groups[gi].n == 2 ? 2 : 1;
      for (int64_t t = 0; t < tiles; t += nt)
        units.push_back({gi, t, (int)std::min<int64_t>(nt, tiles - t)});
    }
    const int64_t KB = K / BLK, G = K / g, n_units = (int64_t)units.size();
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t u = 0; u < n_units; ++u) {
      const Group& gr = groups[units[u].group];
      const Args args = make_args(q + gr.start * K, qd + gr.start * KB, qs + gr.start * G,
                                  W[gr.expert], Sc[gr.expert], Sz[gr.expert],
                                  out + gr.start * N, gr.n, K, N, g, half);
      for (int64_t m0 = 0; m0 < gr.n; m0 += MR_MAX)
        run_tiles(args, bits, path, units[u].t, units[u].nt, m0, std::min<int64_t>(MR_MAX, gr.n - m0));
    }
  };
  project(xq.data(), d.data(), xs.data(), H, N1, gu_g, gu_bits, gu_half, gu_w, gu_s, gu_sz,
          h.data());
  for (int64_t r = 0; r < S; ++r)
    for (int64_t i = 0; i < I; ++i) {
      const float gt = h[r * N1 + i], up = h[r * N1 + I + i];
      a[r * I + i] = gt / (1.0f + std::exp(-gt)) * up;
    }
  w4a8_quantize(a.data(), aq.data(), ad.data(), axs.data(), S, I, dn_g);
  project(aq.data(), ad.data(), axs.data(), I, H, dn_g, dn_bits, dn_half, dn_w, dn_s, dn_sz,
          z.data());
  std::fill(y, y + M * H, 0.0f);
  for (int64_t r = 0; r < S; ++r) {  // in the sorted order: each row's experts ascending
    float* ym = y + order[r] / k * H;
    const float wj = wts[order[r]];
    for (int64_t c = 0; c < H; ++c) ym[c] += wj * z[r * H + c];
  }
}

}  // extern "C"
