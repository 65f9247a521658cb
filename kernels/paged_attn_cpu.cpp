// Batch-invariant attention over the paged KV cache (the layout is described in
// compress/decoder/kv/paged.py, the contract in paged_attn_cpu.py).
//
// Each query (row b, head h, column t) is computed by one thread, alone, in one fixed order:
// its n = hi[b, t] visible keys j = 0 .. n-1 (pool slot gather[b, j], KV head h / (H / Hkv))
//   s_j = scale * sum_d q[d] k_j[d]        (8 fixed lanes over d, then a fixed horizontal sum)
//   m = max_j s_j,  l = sum_j exp(s_j - m) in j order,  out = (sum_j exp(s_j - m) v_j) / l
// With attention sinks (gpt-oss: one logit z_h per query head, a key whose value is 0) m also
// takes z_h and l starts at exp(z_h - m). So its result does not depend on the other rows, the other queries of its row, the padded
// key length or the thread count: the same bits alone or in any batch. n = 0 (padding) gives 0.

#include "cpu_simd.h"

namespace {

using namespace cpu_simd;

// Eight channels as fp32 lanes (F16C's conversion where the build has it).
inline f8 load8_as_float(const float* p) { return load8(p); }
inline f8 load8_as_float(const uint16_t* p) {
  f8 v;
#ifdef CPU_SIMD
  const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&v, &x, sizeof v);
#else
  for (int u = 0; u < 8; ++u) v[u] = half_to_float(p[u]);
#endif
  return v;
}

template <class T>
inline float as_float(T v);
template <>
inline float as_float<float>(float v) { return v; }
template <>
inline float as_float<uint16_t>(uint16_t v) { return half_to_float(v); }

// Key j (0 .. n - 1) of query (b, t) sits at slot key(b, t, j) of row b's keys (row b starts
// kb / vb elements in; a slot is ks / vs elements, a KV head kh / vh); n = count(b, t) <= L.
template <class T, class Key, class Count>
void attend(const float* q, float* out, const T* kp, const T* vp, int64_t kb, int64_t ks,
            int64_t kh, int64_t vb, int64_t vs, int64_t vh, Key key, Count count, int64_t B,
            int64_t H, int64_t Hkv, int64_t Tq, int64_t L, int64_t D, int64_t Dv, float scale,
            const float* sinks, int nthreads) {
  const int64_t group = H / Hkv;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H, hk = h / group;
    std::vector<float> s(L);
    for (int64_t t = 0; t < Tq; ++t) {
      const float* qq = q + (bh * Tq + t) * D;
      float* o = out + (bh * Tq + t) * Dv;
      const int64_t n = std::min<int64_t>(count(b, t), L);
      for (int64_t d = 0; d < Dv; ++d) o[d] = 0.0f;
      if (n <= 0) continue;
      float m = sinks ? sinks[h] : -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const T* k = kp + b * kb + key(b, t, j) * ks + hk * kh;
        f8 lanes = {};
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) lanes += load8(qq + d) * load8_as_float(k + d);
        for (; d < D; ++d) lanes[0] += qq[d] * as_float<T>(k[d]);
        const float dot = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
                          ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
        s[j] = dot * scale;
        m = std::max(m, s[j]);
      }
      float l = sinks ? std::exp(sinks[h] - m) : 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        const float w = std::exp(s[j] - m);
        l += w;
        const T* v = vp + b * vb + key(b, t, j) * vs + hk * vh;
        int64_t d = 0;
        for (; d + 8 <= Dv; d += 8) store8(o + d, load8(o + d) + w * load8_as_float(v + d));
        for (; d < Dv; ++d) o[d] += w * as_float<T>(v[d]);
      }
      const float inv = 1.0f / l;
      for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
    }
  }
}

// attend() over K/V stored as fp16 (half = 1) or fp32.
template <class Key, class Count>
void attend_stored(int half, const float* q, float* out, const void* k, const void* v,
                   int64_t kb, int64_t ks, int64_t kh, int64_t vb, int64_t vs, int64_t vh,
                   Key key, Count count, int64_t B, int64_t H, int64_t Hkv, int64_t Tq, int64_t L,
                   int64_t D, int64_t Dv, float scale, const float* sinks, int nthreads) {
  if (half)
    attend<uint16_t>(q, out, (const uint16_t*)k, (const uint16_t*)v, kb, ks, kh, vb, vs, vh, key,
                     count, B, H, Hkv, Tq, L, D, Dv, scale, sinks, nthreads);
  else
    attend<float>(q, out, (const float*)k, (const float*)v, kb, ks, kh, vb, vs, vh, key, count,
                  B, H, Hkv, Tq, L, D, Dv, scale, sinks, nthreads);
}

}  // namespace

extern "C" {

// q [B, H, Tq, D] fp32, out [B, H, Tq, Dv] fp32; K/V pools of fp32 (half = 0) or fp16 (half = 1)
// with slot strides ks/vs and head strides kh/vh (elements); gather [B, L] pool slots; hi [B, Tq]
// visible keys per query; sinks fp32 [H] or null.
void paged_attention(const float* q, float* out, const void* kpool, const void* vpool,
                     int64_t ks, int64_t kh, int64_t vs, int64_t vh, const int64_t* gather,
                     const int64_t* hi, int64_t B, int64_t H, int64_t Hkv, int64_t Tq, int64_t L,
                     int64_t D, int64_t Dv, float scale, const float* sinks, int half,
                     int nthreads) {
  auto key = [=](int64_t b, int64_t, int64_t j) { return gather[b * L + j]; };
  auto count = [=](int64_t b, int64_t t) { return hi[b * Tq + t]; };
  attend_stored(half, q, out, kpool, vpool, 0, ks, kh, 0, vs, vh, key, count, B, H, Hkv, Tq, L,
                D, Dv, scale, sinks, nthreads);
}

// The same over a contiguous cache: row b's keys K[b, :, lo[b, t] .. hi[b, t] - 1] (strides kb,
// kh, ks of K [B, Hkv, L, D], likewise V), the visible range of query (b, t).
void range_attention(const float* q, float* out, const void* k, const void* v, int64_t kb,
                     int64_t kh, int64_t ks, int64_t vb, int64_t vh, int64_t vs,
                     const int64_t* lo, const int64_t* hi, int64_t B, int64_t H, int64_t Hkv,
                     int64_t Tq, int64_t L, int64_t D, int64_t Dv, float scale,
                     const float* sinks, int half, int nthreads) {
  auto key = [=](int64_t b, int64_t t, int64_t j) { return lo[b * Tq + t] + j; };
  auto count = [=](int64_t b, int64_t t) { return hi[b * Tq + t] - lo[b * Tq + t]; };
  attend_stored(half, q, out, k, v, kb, ks, kh, vb, vs, vh, key, count, B, H, Hkv, Tq, L, D, Dv,
                scale, sinks, nthreads);
}

}  // extern "C"
