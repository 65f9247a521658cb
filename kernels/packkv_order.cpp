// PackKV's greedy token order (packkv_ref.order_greedy is the reference, with the rule) on the CPU.
//
// Per block row (one OpenMP work unit), per slot: a pack's first token is the remaining one with
// the lowest (lower) median code; every other slot takes the remaining token with the smallest
//   key = (sum_c bit_length(span_c)) * 256 C + sum_c span_c,  span_c = max(hi_c, x_c) - min(lo_c, x_c)
// (first index on ties), over the C channels of K and V codes side by side. With AVX2 the spans
// of 32 channels come from byte max / min / sub, their bit lengths from two nibble lookups
// (pshufb), and both sums from sad_epu8.

#include "cpu_simd.h"

namespace {

inline int bit_length(unsigned b) { return b ? 32 - __builtin_clz(b) : 0; }

// lower median (sorted index (C - 1) / 2) of C codes, by a histogram
int lower_median(const uint8_t* x, int64_t C) {
  int count[256] = {0};
  for (int64_t c = 0; c < C; ++c) ++count[x[c]];
  int64_t want = (C - 1) / 2, seen = 0;
  for (int v = 0; v < 256; ++v) {
    seen += count[v];
    if (seen > want) return v;
  }
  return 255;
}

// key of joining token x to the pack whose channel ranges are [lo, hi]
inline int64_t grow_key(const uint8_t* lo, const uint8_t* hi, const uint8_t* x, int64_t C) {
  int64_t bits = 0, span = 0, c = 0;
#ifdef __AVX2__
  // bit length of a byte: max(bit length of its high nibble + 4 (0 if 0), of its low nibble)
  const __m256i nib = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
  const __m256i tlo = _mm256_setr_epi8(0, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4,  //
                                       0, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4);
  const __m256i thi = _mm256_setr_epi8(0, 5, 6, 6, 7, 7, 7, 7, 8, 8, 8, 8, 8, 8, 8, 8,  //
                                       0, 5, 6, 6, 7, 7, 7, 7, 8, 8, 8, 8, 8, 8, 8, 8);
  __m256i acc_bits = zero, acc_span = zero;
  for (; c + 32 <= C; c += 32) {
    __m256i v = _mm256_loadu_si256((const __m256i*)(x + c));
    __m256i mx = _mm256_max_epu8(_mm256_loadu_si256((const __m256i*)(hi + c)), v);
    __m256i mn = _mm256_min_epu8(_mm256_loadu_si256((const __m256i*)(lo + c)), v);
    __m256i sp = _mm256_sub_epi8(mx, mn);
    __m256i bl = _mm256_max_epu8(
        _mm256_shuffle_epi8(tlo, _mm256_and_si256(sp, nib)),
        _mm256_shuffle_epi8(thi, _mm256_and_si256(_mm256_srli_epi16(sp, 4), nib)));
    acc_bits = _mm256_add_epi64(acc_bits, _mm256_sad_epu8(bl, zero));
    acc_span = _mm256_add_epi64(acc_span, _mm256_sad_epu8(sp, zero));
  }
  alignas(32) int64_t b4[4], s4[4];
  _mm256_store_si256((__m256i*)b4, acc_bits);
  _mm256_store_si256((__m256i*)s4, acc_span);
  bits = b4[0] + b4[1] + b4[2] + b4[3];
  span = s4[0] + s4[1] + s4[2] + s4[3];
#endif
  for (; c < C; ++c) {
    unsigned s = std::max(hi[c], x[c]) - std::min(lo[c], x[c]);
    bits += bit_length(s);
    span += s;
  }
  return bits * 256 * C + span;
}

void order_row(const uint8_t* x, int64_t* perm, int64_t T, int64_t C, int64_t pack) {
  std::vector<int> seed(T);
  std::vector<char> taken(T, 0);
  std::vector<uint8_t> lo(C), hi(C);
  for (int64_t t = 0; t < T; ++t) seed[t] = lower_median(x + t * C, C);
  for (int64_t s = 0; s < T; ++s) {
    int64_t pick = -1;
    if (s % pack == 0) {
      for (int64_t t = 0; t < T; ++t)
        if (!taken[t] && (pick < 0 || seed[t] < seed[pick])) pick = t;
      std::memcpy(lo.data(), x + pick * C, C);
      std::memcpy(hi.data(), x + pick * C, C);
    } else {
      int64_t best = 0;
      for (int64_t t = 0; t < T; ++t) {
        if (taken[t]) continue;
        int64_t k = grow_key(lo.data(), hi.data(), x + t * C, C);
        if (pick < 0 || k < best) pick = t, best = k;
      }
      const uint8_t* v = x + pick * C;
      for (int64_t c = 0; c < C; ++c) {
        lo[c] = std::min(lo[c], v[c]);
        hi[c] = std::max(hi[c], v[c]);
      }
    }
    taken[pick] = 1;
    perm[s] = pick;
  }
}

}  // namespace

extern "C" {

// perm [N, T] int64: the greedy order of each row of codes [N, T, C] uint8 (contiguous).
void packkv_order_greedy(const uint8_t* codes, int64_t* perm, int64_t N, int64_t T, int64_t C,
                         int64_t pack, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(dynamic) if (nthreads > 1)
  for (int64_t r = 0; r < N; ++r) order_row(codes + r * T * C, perm + r * T, T, C, pack);
}

}  // extern "C"
