// KIVI attention products on the CPU, reading the codes where they are stored (the layout is
// described in kivi_ref.py, the products in kivi_cpu.py).
//
// A token's codes are W = D b / 32 int32 words, word j holding channels (32 / b) j + i at bits
// b i. Eight channels come out of a word at a time by shifting a splat of it; then
//   qk: K_hat[t, c] = kz[t / G, c] + ks[t / G, c] code[t, c]      (G tokens per K group)
//       scores[m, t] = sum_c q[m, c] K_hat[t, c]                    (8-lane sums per query)
//   pv: V_hat[t, c] = vz[t, c / G] + vs[t, c / G] code[t, c]      (G channels per V group)
//       out[m, c] += p[m, t] V_hat[t, c]                            (one accumulator row per query)
// The V groups must be whole vectors of 8 channels (G % 8 == 0).

#include "cpu_simd.h"

namespace {

using namespace cpu_simd;

// Channels 8 v .. 8 v + 7 of the token whose words start at w, as fp32.
inline f8 codes8(const int32_t* w, int v, int bits) {
  const int per = 32 / bits, j = 8 * v / per, first = 8 * v % per;
  const uint32_t word = (uint32_t)w[j];
  const u8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const u8 x = ((u8{} + word) >> ((lane + (uint32_t)first) * (uint32_t)bits)) &
               (uint32_t)((1u << bits) - 1);
  return __builtin_convertvector(x, f8);
}

}  // namespace

extern "C" {

// scores [BH, M, n] = q [BH, M, D] @ K_hat^T; codes [BH, cap, W] int32, kz/ks [BH, cap / G, D]
// fp16; fp32 q and out, everything contiguous.
void kivi_qk(const float* q, float* out, int64_t BH, int64_t M, int64_t D, const int32_t* codes,
             const uint16_t* kz, const uint16_t* ks, int64_t n, int64_t cap, int64_t G,
             int bits, int nthreads) {
  const int64_t W = D * bits / 32, groups = n / G, V = D / 8;
  const int64_t chunk = chunk_of(BH, groups, nthreads, 2);
  const int64_t per_bh = (groups + chunk - 1) / chunk, units = BH * per_bh;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t bh = u / per_bh, g0 = (u % per_bh) * chunk;
    const int64_t g1 = std::min(groups, g0 + chunk);
    const float* qb = q + bh * M * D;
    std::vector<float> z(D), s(D);
    std::vector<f8> x(V);  // K_hat of one token
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t meta = (bh * (cap / G) + g) * D;
      for (int64_t c = 0; c < D; ++c)
        z[c] = half_to_float(kz[meta + c]), s[c] = half_to_float(ks[meta + c]);
      for (int64_t t = g * G; t < (g + 1) * G; ++t) {
        const int32_t* w = codes + (bh * cap + t) * W;
        for (int64_t v = 0; v < V; ++v)
          x[v] = load8(&z[8 * v]) + load8(&s[8 * v]) * codes8(w, (int)v, bits);
        for (int64_t m = 0; m < M; ++m) {
          f8 acc = {};
          for (int64_t v = 0; v < V; ++v) acc += load8(qb + m * D + 8 * v) * x[v];
          out[(bh * M + m) * n + t] = hsum(acc);
        }
      }
    }
  }
}

// out [BH, M, D] = p [BH, M, n] @ V_hat; codes [BH, cap, W] int32, vz/vs [BH, cap, D / G]
// fp16; fp32 p and out, everything contiguous.
void kivi_pv(const float* p, float* out, int64_t BH, int64_t M, int64_t D, const int32_t* codes,
             const uint16_t* vz, const uint16_t* vs, int64_t n, int64_t cap, int64_t G,
             int bits, int nthreads) {
  const int64_t W = D * bits / 32, V = D / 8, GD = D / G;
  const int64_t chunk = chunk_of(BH, n, nthreads, 64);
  const int64_t per_bh = std::max<int64_t>((n + chunk - 1) / chunk, 1), units = BH * per_bh;
  std::vector<float> part((size_t)units * M * D, 0.0f);  // per unit: its share of out[bh]
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t bh = u / per_bh, t0 = (u % per_bh) * chunk, t1 = std::min(n, t0 + chunk);
    const float* pb = p + bh * M * n;
    float* acc = &part[(size_t)u * M * D];
    std::vector<float> z(GD), s(GD);
    for (int64_t t = t0; t < t1; ++t) {
      const int32_t* w = codes + (bh * cap + t) * W;
      for (int64_t j = 0; j < GD; ++j) {
        z[j] = half_to_float(vz[(bh * cap + t) * GD + j]);
        s[j] = half_to_float(vs[(bh * cap + t) * GD + j]);
      }
      for (int64_t v = 0; v < V; ++v) {
        const f8 x = z[8 * v / G] + s[8 * v / G] * codes8(w, (int)v, bits);
        for (int64_t m = 0; m < M; ++m)
          store8(acc + m * D + 8 * v, load8(acc + m * D + 8 * v) + pb[m * n + t] * x);
      }
    }
  }
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t i = 0; i < M * D; ++i) {
      float s = 0.0f;
      for (int64_t k = 0; k < per_bh; ++k) s += part[(size_t)(bh * per_bh + k) * M * D + i];
      out[bh * M * D + i] = s;
    }
}

}  // extern "C"
