// PackKV attention products on the CPU, decoding one 16-token pack at a time (the format is
// described in packkv_ref.py, the products in packkv_cpu.py).
//
// A work unit is a range of pack rows of one row bh. Per pack row it cuts each channel's 16
// codes (code - pmin, the "rest") out of the bit stream into a D x 16 fp32 tile that stays in
// L1, then forms x_hat = tmin + tstep (pmin + rest) per slot as packkv_ref.values does and
//   qk: scores[m, s]  = sum_c q[m, c] x_hat[s, c]       (vector accumulators per query)
//   pv: out[m, c]    += sum_s p[m, s] x_hat[s, c]       (vector accumulators per query, channel)
// Queries go four at a time. With AVX2 or AVX-512 a channel's 16 codes come out of its w words
// by one byte shuffle, one variable shift and one mask (tables per width), and the pack's
// metadata fields eight at a time by a gather; otherwise by scalar shifts.

#include "cpu_simd.h"

namespace {

using namespace cpu_simd;

constexpr int PACK = 16;
constexpr int MAX_WIDTH = 15;  // a width field has at most 4 bits; the format writes up to 8
constexpr int QT = 4;          // queries per tile
constexpr int H = PACK / L;    // vectors per pack of 16 slots

struct Packed {
  const uint16_t* tmin;   // [BH, cap] fp16 bits
  const int8_t* lstep;    // [BH, cap]
  const uint16_t* pmeta;  // [BH, cap / 16, meta_words]
  const int32_t* poff;    // [BH, cap / 16]
  const uint16_t* data;   // [n_words]
  int64_t n_words, n, cap, meta_words, rows;  // rows: BH * cap / 16, of pmeta and poff
  int mbits, fbits;
};

struct Tables {
  float step[256];  // tstep = 2^(lstep / 8), indexed by the byte of lstep
#ifdef CPU_SIMD
  // code i of a w-bit channel: bytes b, b + 1 of its 16 (b = i w / 8) into 32-bit lane i,
  // shifted right by i w % 8 and masked to w bits
  alignas(64) uint8_t shuf[MAX_WIDTH + 1][4 * PACK];
  alignas(64) int32_t shift[MAX_WIDTH + 1][PACK];
  int32_t mask[MAX_WIDTH + 1];
#endif
  Tables() {
    for (int b = 0; b < 256; ++b) step[b] = std::exp2((float)(int8_t)b / 8.0f);
#ifdef CPU_SIMD
    std::memset(shuf, 0x80, sizeof shuf);  // 0x80: a zero byte
    std::memset(shift, 0, sizeof shift);
    std::memset(mask, 0, sizeof mask);     // widths above 8 (not written) decode as 0
    for (int w = 1; w <= 8; ++w) {
      mask[w] = (1 << w) - 1;
      for (int i = 0; i < PACK; ++i) {
        int bit = i * w, byte = bit >> 3;
        shuf[w][4 * i] = (uint8_t)byte;
        shuf[w][4 * i + 1] = byte < 15 ? (uint8_t)(byte + 1) : 0x80;
        shift[w][i] = bit & 7;
      }
    }
#endif
  }
};

const Tables T;

// The 16 rests of one channel: bits [i w, (i + 1) w) of the w words at data[off].
inline void decode16(const Packed& a, int64_t off, int w, float* rest) {
#ifdef CPU_SIMD
  __m128i b;
  if (off + 8 <= a.n_words) {
    b = _mm_loadu_si128((const __m128i*)(a.data + off));
  } else {  // the last packs: read no further than the stream's end
    uint16_t buf[8] = {0};
    for (int64_t j = 0; j < 8 && off + j < a.n_words; ++j) buf[j] = a.data[off + j];
    b = _mm_loadu_si128((const __m128i*)buf);
  }
#if CPU_SIMD == 512
  __m512i x = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(b), _mm512_load_si512(T.shuf[w]));
  x = _mm512_srlv_epi32(x, _mm512_load_si512(T.shift[w]));
  _mm512_storeu_ps(rest, _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(T.mask[w]))));
#else
  const __m256i bb = _mm256_broadcastsi128_si256(b), mask = _mm256_set1_epi32(T.mask[w]);
  for (int h = 0; h < 2; ++h) {
    __m256i x = _mm256_shuffle_epi8(bb, _mm256_load_si256((const __m256i*)(T.shuf[w] + 32 * h)));
    x = _mm256_srlv_epi32(x, _mm256_load_si256((const __m256i*)(T.shift[w] + 8 * h)));
    _mm256_storeu_ps(rest + 8 * h, _mm256_cvtepi32_ps(_mm256_and_si256(x, mask)));
  }
#endif
#else
  if (w == 0 || w > 8) {
    for (int i = 0; i < PACK; ++i) rest[i] = 0.0f;
    return;
  }
  const uint32_t mask = (1u << w) - 1;
  for (int i = 0; i < PACK; ++i) {
    int64_t bit = (int64_t)i * w, word = off + (bit >> 4);  // word + 1 <= off + w: inside
    uint32_t pair = a.data[word] | (word + 1 < a.n_words ? (uint32_t)a.data[word + 1] << 16 : 0u);
    rest[i] = (float)((pair >> (bit & 15)) & mask);
  }
#endif
}

// Pack row r of row bh: pmin per channel, the D x 16 tile of rests, tmin and tstep per slot.
struct Tile {
  std::vector<float> pmin, rest;
  std::vector<int32_t> width;
  float tmin[PACK], step[PACK];
  explicit Tile(int D) : pmin(D), rest((size_t)D * PACK), width(D) {}

  // pmin[c], width[c] of channels c0 .. D-1 from the f-bit fields of pack row `row`'s metadata.
  void fields(const Packed& a, const uint16_t* meta, int c0, int D) {
    const uint32_t fmask = (1u << a.fbits) - 1, mmask = (1u << a.mbits) - 1;
    for (int c = c0; c < D; ++c) {
      int64_t bit = (int64_t)c * a.fbits, word = bit >> 4;
      uint32_t pair = meta[word] | (word + 1 < a.meta_words ? (uint32_t)meta[word + 1] << 16 : 0u);
      uint32_t f = (pair >> (bit & 15)) & fmask;
      width[c] = (int32_t)(f >> a.mbits);
      pmin[c] = (float)(f & mmask);
    }
  }

  void load(const Packed& a, int64_t bh, int64_t r, int D) {
    const int64_t row = bh * (a.cap / PACK) + r;
    const uint16_t* meta = a.pmeta + row * a.meta_words;
    int c0 = 0;
#ifdef CPU_SIMD
    // eight fields at a time: 4 bytes gathered from each field's first byte (which may run up
    // to 3 bytes into the next row; so not for the tensor's last row)
    if (row + 1 < a.rows) {
      const __m256i f = _mm256_set1_epi32(a.fbits);
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i fmask = _mm256_set1_epi32((1 << a.fbits) - 1);
      const __m256i mmask = _mm256_set1_epi32((1 << a.mbits) - 1);
      const __m128i mbits = _mm_cvtsi32_si128(a.mbits);
      for (; c0 + 8 <= D; c0 += 8) {
        __m256i bit = _mm256_mullo_epi32(_mm256_add_epi32(lane, _mm256_set1_epi32(c0)), f);
        __m256i v = _mm256_i32gather_epi32((const int*)meta, _mm256_srli_epi32(bit, 3), 1);
        v = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_and_si256(bit, _mm256_set1_epi32(7))),
                             fmask);
        _mm256_storeu_si256((__m256i*)&width[c0], _mm256_srl_epi32(v, mbits));
        _mm256_storeu_ps(&pmin[c0], _mm256_cvtepi32_ps(_mm256_and_si256(v, mmask)));
      }
    }
#endif
    fields(a, meta, c0, D);
    int64_t off = a.poff[row];
    for (int c = 0; c < D; ++c) {
      decode16(a, off, width[c], &rest[(size_t)c * PACK]);
      off += width[c];
    }
    const int64_t s0 = bh * a.cap + r * PACK;
    for (int i = 0; i < PACK; ++i) {
      tmin[i] = half_to_float(a.tmin[s0 + i]);
      step[i] = T.step[(uint8_t)a.lstep[s0 + i]];
    }
  }
};

// scores[m, 16 r .. 16 r + 15] for the MT queries q[m] = q0 + m D.
template <int MT>
void qk_tile(const Tile& t, const float* q0, int D, float* out, int64_t n) {
  fv acc[MT][H] = {}, tm[H], st[H];
  for (int h = 0; h < H; ++h) tm[h] = load(t.tmin + h * L), st[h] = load(t.step + h * L);
  for (int c = 0; c < D; ++c) {
    fv x[H];
    for (int h = 0; h < H; ++h)
      x[h] = tm[h] + st[h] * (load(&t.rest[(size_t)c * PACK + h * L]) + t.pmin[c]);
    for (int m = 0; m < MT; ++m) {
      const float qc = q0[m * D + c];
      for (int h = 0; h < H; ++h) acc[m][h] += qc * x[h];
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < H; ++h) store(out + m * n + h * L, acc[m][h]);
}

// Adds pack row r's share for the MT probability rows p[m] = p0 + m n (slots 16 r ..) to the
// lane accumulators lanes[m][c]: p times x_hat, formed per slot as packkv_ref.values does.
template <int MT>
void pv_tile(const Tile& t, const float* p0, int64_t n, int D, fv* lanes) {
  fv pm[MT][H], tm[H], st[H];
  for (int h = 0; h < H; ++h) tm[h] = load(t.tmin + h * L), st[h] = load(t.step + h * L);
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < H; ++h) pm[m][h] = load(p0 + m * n + h * L);
  for (int c = 0; c < D; ++c) {
    fv x[H];
    for (int h = 0; h < H; ++h)
      x[h] = tm[h] + st[h] * (load(&t.rest[(size_t)c * PACK + h * L]) + t.pmin[c]);
    for (int m = 0; m < MT; ++m) {
      fv s = pm[m][0] * x[0];
      for (int h = 1; h < H; ++h) s += pm[m][h] * x[h];
      lanes[(size_t)m * D + c] += s;
    }
  }
}

// Queries m0 .. M-1 in tiles of QT: calls f.template operator()<MT>(m) per tile.
template <class F>
void by_tiles(int64_t M, F&& f) {
  for (int64_t m = 0; m < M; m += QT) {
    switch (std::min<int64_t>(QT, M - m)) {
      case 1: f.template operator()<1>(m); break;
      case 2: f.template operator()<2>(m); break;
      case 3: f.template operator()<3>(m); break;
      default: f.template operator()<4>(m); break;
    }
  }
}

}  // namespace

extern "C" {

// Vector bits of the library's build: 512 (AVX-512), 256 (AVX2), 0 (portable C++).
int cpu_simd_bits() {
#ifdef CPU_SIMD
  return CPU_SIMD;
#else
  return 0;
#endif
}

// scores [BH, M, n] = q [BH, M, D] @ k_hat^T, fp32, all contiguous.
void packkv_qk(const float* q, float* out, int64_t BH, int64_t M, int64_t D,
               const uint16_t* tmin, const int8_t* lstep, const uint16_t* pmeta,
               const int32_t* poff, const uint16_t* data, int64_t n_words, int64_t n,
               int64_t cap, int64_t meta_words, int mbits, int fbits, int nthreads) {
  const Packed a{tmin, lstep, pmeta, poff, data, n_words, n, cap, meta_words, BH * (cap / PACK),
                 mbits, fbits};
  const int64_t rows = n / PACK, chunk = chunk_of(BH, rows, nthreads, 4);
  const int64_t per_bh = (rows + chunk - 1) / chunk, units = BH * per_bh;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t bh = u / per_bh, r0 = (u % per_bh) * chunk, r1 = std::min(rows, r0 + chunk);
    const float* qb = q + bh * M * D;
    Tile t((int)D);
    for (int64_t r = r0; r < r1; ++r) {
      t.load(a, bh, r, (int)D);
      float* ob = out + bh * M * n + r * PACK;
      by_tiles(M, [&]<int MT>(int64_t m) {
        qk_tile<MT>(t, qb + m * D, (int)D, ob + m * n, n);
      });
    }
  }
}

// out [BH, M, D] = p [BH, M, n] @ v_hat, fp32, all contiguous.
void packkv_pv(const float* p, float* out, int64_t BH, int64_t M, int64_t D,
               const uint16_t* tmin, const int8_t* lstep, const uint16_t* pmeta,
               const int32_t* poff, const uint16_t* data, int64_t n_words, int64_t n,
               int64_t cap, int64_t meta_words, int mbits, int fbits, int nthreads) {
  const Packed a{tmin, lstep, pmeta, poff, data, n_words, n, cap, meta_words, BH * (cap / PACK),
                 mbits, fbits};
  const int64_t rows = n / PACK, chunk = chunk_of(BH, rows, nthreads, 4);
  const int64_t per_bh = std::max<int64_t>((rows + chunk - 1) / chunk, 1), units = BH * per_bh;
  std::vector<float> part((size_t)units * M * D);  // per unit: its share of out[bh]
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t bh = u / per_bh, r0 = (u % per_bh) * chunk, r1 = std::min(rows, r0 + chunk);
    const float* pb = p + bh * M * n;
    std::vector<fv> lanes((size_t)M * D, fv{});
    Tile t((int)D);
    for (int64_t r = r0; r < r1; ++r) {
      t.load(a, bh, r, (int)D);
      by_tiles(M, [&]<int MT>(int64_t m) {
        pv_tile<MT>(t, pb + m * n + r * PACK, n, (int)D, &lanes[(size_t)m * D]);
      });
    }
    float* o = &part[(size_t)u * M * D];
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < D; ++c) {
        o[m * D + c] = hsum(lanes[(size_t)m * D + c]);
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
