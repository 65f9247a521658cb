// The CPU kernels as torch operators, called from the dispatcher with no Python between a
// compiled decode step and the kernel (native.ops() builds them; the fake shapes are in Python).
//
//   w4a8_linear(Tensor x, Tensor packed, Tensor s, Tensor sz, int bits, int g, int path) -> Tensor
//     w4a8_cpu.cpp's product (w4a8_cpu.py): float32 or bfloat16 x [..., K] read as it is (other
//     dtypes converted to float32), the int8 activations in per-thread scratch, y [..., N] in x's
//     dtype. packed: uint8 [N / 16, K / 32, bytes] (w4a8_cpu.pack), s and sz: float32 [K / g, N],
//     or (symmetric codes) s float16 [K / g, N] and sz the one float32 zero point;
//     path: 2 AVX-512 VNNI, 1 AVX2, 0 portable (w4a8_caps() says which this CPU runs).
//
//   w4a8_experts(Tensor x, Tensor w, Tensor e, Tensor gu_packed, Tensor gu_s, Tensor gu_sz,
//                Tensor dn_packed, Tensor dn_s, Tensor dn_sz,
//                int gu_bits, int gu_g, int dn_bits, int dn_g, int path) -> Tensor
//     w4a8_cpu.cpp's SiLU-gated experts over the rows of x [M, H] routed to e [M, k] with
//     weights w [M, k] (w4a8_cpu.Experts): every expert's forms stacked along a leading dim E,
//     the gate_up projections' ([E, 2I / 16, H / 32, bytes], [E, H / gu_g, 2I], sz [E, 1] or as
//     s) and the down projections' ([E, H / 16, I / 32, bytes], [E, I / dn_g, H], ...);
//     y [M, H] in x's dtype.
//
//   skinny_linear(Tensor x, Tensor w, Tensor? b, int path) -> Tensor
//     skinny_cpu.cpp's fp32 product x [..., K] w [N, K]^T + b for a few rows (skinny_cpu.py):
//     float32 x, contiguous float32 w (nn.Linear's layout) and bias; path: 2 AVX-512, 1 AVX2,
//     0 portable (skinny_caps()).
//
//   rms_norm(Tensor x, Tensor w, float eps, float offset) -> Tensor
//     the decoder's RMSNorm (rms_norm_ref.py) over the last dim of x (fp32, bf16 or fp16), w of
//     x's dtype; one pass a row, the squares summed in a fixed order.
//
//   cache_attention(Tensor q, Tensor k, Tensor v, Tensor lo, Tensor hi, float scale,
//                   Tensor? sinks) -> Tensor
//     paged_attn_cpu.cpp's fixed-order attention over a contiguous cache (paged_attn_cpu.py):
//     q [B, H, Tq, D], k [B, Hkv, L, D] and v [B, Hkv, L, Dv] (fp16 or fp32, unit stride along
//     channels), query (b, t) sees slots lo[b, t] .. hi[b, t] - 1 (int64 [B, Tq]); fp32 out
//     [B, H, Tq, Dv]; sinks: none, or float32 [H] attention-sink logits (gpt-oss).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <torch/library.h>

#include <vector>

extern "C" {
void w4a8_quantize(const float* x, int8_t* xq, float* d, float* xs, int64_t M, int64_t K,
                   int64_t g);
void w4a8_quantize_bf16(const uint16_t* x, int8_t* xq, float* d, float* xs, int64_t M,
                        int64_t K, int64_t g);
void w4a8_gemm(const int8_t* xq, const float* d, const float* xs, const uint8_t* w,
               const void* s, const float* sz, float* y, int64_t M, int64_t K, int64_t N,
               int64_t g, int bits, int path, int nthreads, int half);
void w4a8_experts(const float* x, const int64_t* e, const float* wts, int64_t M, int64_t k,
                  int64_t H, int64_t I, const uint8_t* const* gu_w, const void* const* gu_s,
                  const float* const* gu_sz, int64_t gu_g, int gu_bits, int gu_half,
                  const uint8_t* const* dn_w, const void* const* dn_s,
                  const float* const* dn_sz, int64_t dn_g, int dn_bits, int dn_half, float* y,
                  int path, int nthreads);
void skinny_linear(const float* x, const float* w, const float* b, float* y, int64_t M,
                   int64_t K, int64_t N, int path, int nthreads);
void range_attention(const float* q, float* out, const void* k, const void* v, int64_t kb,
                     int64_t kh, int64_t ks, int64_t vb, int64_t vh, int64_t vs,
                     const int64_t* lo, const int64_t* hi, int64_t B, int64_t H, int64_t Hkv,
                     int64_t Tq, int64_t L, int64_t D, int64_t Dv, float scale,
                     const float* sinks, int half, int nthreads);
}

namespace {

at::Tensor skinny_linear_op(const at::Tensor& x, const at::Tensor& w,
                            const c10::optional<at::Tensor>& b, int64_t path) {
  const int64_t K = x.size(-1), N = w.size(0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.dim() == 2 &&
                  w.size(1) == K && w.is_contiguous(),
              "compress::skinny_linear: x [..., K] and a contiguous w [N, K], both float32; "
              "got x ",
              x.sizes(), " ", x.scalar_type(), ", w ", w.sizes(), " ", w.scalar_type());
  const bool has_b = b.has_value() && b->defined();
  TORCH_CHECK(!has_b || (b->scalar_type() == at::kFloat && b->numel() == N && b->is_contiguous()),
              "compress::skinny_linear: the bias is a contiguous float32 [N]");
  const at::Tensor xc = x.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  skinny_linear(xc.data_ptr<float>(), w.data_ptr<float>(),
                has_b ? b->data_ptr<float>() : nullptr, y.data_ptr<float>(),
                xc.numel() / std::max<int64_t>(K, 1), K, N, (int)path, at::get_num_threads());
  return y;
}

// y = w * round(x / sqrt(mean(x^2) + eps)) (offset 0, Llama's order), or round(x / sqrt(...) *
// (offset + w)) (Gemma's), per row of x [..., D] in fp32: the squares summed in 8 lanes over
// the channels, then a fixed tree, so a row's bits do not depend on the other rows.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t D, float eps,
                   float offset) {
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * D;
      T* yr = y + r * D;
      float acc[8] = {};
      int64_t d = 0;
      for (; d + 8 <= D; d += 8)
        for (int j = 0; j < 8; ++j) {
          const float v = static_cast<float>(xr[d + j]);
          acc[j] += v * v;
        }
      for (int j = 0; d < D; ++d, ++j) {
        const float v = static_cast<float>(xr[d]);
        acc[j] += v * v;
      }
      const float sum =
          ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
      for (int64_t k = 0; k < D; ++k) {
        const float xhat = static_cast<float>(xr[k]) * inv, wk = static_cast<float>(w[k]);
        yr[k] = offset == 0.0f ? static_cast<T>(wk * static_cast<float>(static_cast<T>(xhat)))
                               : static_cast<T>(xhat * (offset + wk));
      }
    }
  });
}

at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& w, double eps, double offset) {
  const int64_t D = x.size(-1);
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.size(0) == D &&
                  w.is_contiguous(),
              "compress::rms_norm: w is a contiguous [D] of x's dtype; got x ", x.sizes(), " ",
              x.scalar_type(), ", w ", w.sizes(), " ", w.scalar_type());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = D ? xc.numel() / D : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                            y.data_ptr<scalar_t>(), rows, D, (float)eps, (float)offset);
  });
  return y;
}

// The two forms of a W4A8 weight's scales (w4a8_cpu.prepare): fp32 s and sz = s z, or fp16 s and
// one fp32 zero point (symmetric codes); n such weights stacked (w4a8_cpu.Experts: s [n, G, N],
// and n zero points in the fp16 form).
bool scales_fit(const at::Tensor& s, const at::Tensor& sz, int64_t n = 1) {
  if (!s.is_contiguous() || !sz.is_contiguous() || sz.scalar_type() != at::kFloat) return false;
  if (s.scalar_type() == at::kHalf) return sz.numel() == n;
  return s.scalar_type() == at::kFloat && sz.sizes() == s.sizes();
}

struct Scratch {
  std::vector<int8_t> xq;
  std::vector<float> d, xs, y;
};

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& s,
                       const at::Tensor& sz, int64_t bits, int64_t g, int64_t path) {
  const int64_t K = x.size(-1), N = s.size(1);
  TORCH_CHECK(K % 32 == 0 && g % 32 == 0 && K % g == 0 && N % 16 == 0,
              "compress::w4a8_linear: K = ", K, ", g = ", g, ", N = ", N,
              " do not fit the kernel (K and g multiples of 32, N of 16)");
  TORCH_CHECK(bits == 3 || bits == 4 || bits == 8, "compress::w4a8_linear: bits = ", bits);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && scales_fit(s, sz) &&
                  s.size(0) == K / g,
              "compress::w4a8_linear: packed must be contiguous uint8, s and sz contiguous "
              "float32 [K / g, N], or s float16 [K / g, N] and sz one float32 zero point");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor xc = (bf16 || x.scalar_type() == at::kFloat) ? x.contiguous()
                                                          : x.to(at::kFloat).contiguous();
  const int64_t M = xc.numel() / K;
  thread_local Scratch t;
  t.xq.resize(M * K), t.d.resize(M * (K / 32)), t.xs.resize(M * (K / g));
  if (bf16)
    w4a8_quantize_bf16(reinterpret_cast<const uint16_t*>(xc.data_ptr()), t.xq.data(),
                       t.d.data(), t.xs.data(), M, K, g);
  else
    w4a8_quantize(xc.data_ptr<float>(), t.xq.data(), t.d.data(), t.xs.data(), M, K, g);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  const bool direct = y.scalar_type() == at::kFloat;
  if (!direct) t.y.resize(M * N);
  float* yf = direct ? y.data_ptr<float>() : t.y.data();
  w4a8_gemm(t.xq.data(), t.d.data(), t.xs.data(), packed.data_ptr<uint8_t>(), s.data_ptr(),
            sz.data_ptr<float>(), yf, M, K, N, g, (int)bits, (int)path, at::get_num_threads(),
            s.scalar_type() == at::kHalf);
  if (y.scalar_type() == at::kBFloat16) {
    auto* out = y.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < M * N; ++i) out[i] = c10::BFloat16(yf[i]);
  } else if (!direct) {
    y.copy_(at::from_blob(yf, shape, at::kFloat));
  }
  return y;
}

at::Tensor w4a8_experts_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& e,
                           const at::Tensor& gu_packed, const at::Tensor& gu_s,
                           const at::Tensor& gu_sz, const at::Tensor& dn_packed,
                           const at::Tensor& dn_s, const at::Tensor& dn_sz, int64_t gu_bits,
                           int64_t gu_g, int64_t dn_bits, int64_t dn_g, int64_t path) {
  TORCH_CHECK(x.dim() == 2 && e.dim() == 2 && w.sizes() == e.sizes() && e.size(0) == x.size(0),
              "compress::w4a8_experts: x [M, H], w and e [M, k]; got x ", x.sizes(), ", w ",
              w.sizes(), ", e ", e.sizes());
  TORCH_CHECK(gu_s.dim() == 3 && dn_s.dim() == 3, "compress::w4a8_experts: scales [E, G, N]");
  const int64_t E = gu_packed.size(0), M = x.size(0), H = x.size(1), k = e.size(1);
  const int64_t I = dn_s.size(1) * dn_g;
  TORCH_CHECK(H % 32 == 0 && I % 32 == 0 && gu_g % 32 == 0 && dn_g % 32 == 0 &&
                  H % gu_g == 0 && I % dn_g == 0 && (2 * I) % 16 == 0 && H % 16 == 0,
              "compress::w4a8_experts: H = ", H, ", I = ", I, " and the group sizes do not fit");
  const auto bytes = [](int64_t bits) { return bits == 4 ? 256 : bits == 8 ? 512 : 192; };
  // one form per projection, every expert's stacked (w4a8_cpu.Experts): [E, ...] each
  TORCH_CHECK(gu_packed.scalar_type() == at::kByte && dn_packed.scalar_type() == at::kByte &&
                  gu_packed.is_contiguous() && dn_packed.is_contiguous() &&
                  scales_fit(gu_s, gu_sz, E) && scales_fit(dn_s, dn_sz, E) && gu_s.size(0) == E &&
                  dn_s.size(0) == E && dn_packed.size(0) == E &&
                  gu_s.size(1) == H / gu_g && gu_s.size(2) == 2 * I && dn_s.size(2) == H &&
                  gu_packed.numel() == E * (2 * I / 16) * (H / 32) * bytes(gu_bits) &&
                  dn_packed.numel() == E * (H / 16) * (I / 32) * bytes(dn_bits),
              "compress::w4a8_experts: the stacked forms do not match E = ", E, ", H = ", H,
              ", I = ", I, " (w4a8_cpu.Experts)");
  const at::Tensor ec = e.to(at::kLong).contiguous(), wc = w.to(at::kFloat).contiguous();
  const int64_t* ep = ec.data_ptr<int64_t>();
  for (int64_t i = 0; i < M * k; ++i)
    TORCH_CHECK(ep[i] >= 0 && ep[i] < E, "compress::w4a8_experts: expert ", ep[i], " of ", E);
  std::vector<const uint8_t*> gw(E), dw(E);
  std::vector<const void*> gs(E), ds(E);
  std::vector<const float*> gz(E), dz(E);
  const auto* gp = gu_packed.data_ptr<uint8_t>();
  const auto* dp = dn_packed.data_ptr<uint8_t>();
  const auto* gsp = (const char*)gu_s.data_ptr();
  const auto* dsp = (const char*)dn_s.data_ptr();
  const float* gzp = gu_sz.data_ptr<float>();
  const float* dzp = dn_sz.data_ptr<float>();
  const int64_t gsz = gu_sz.numel() / E, dsz = dn_sz.numel() / E;
  for (int64_t i = 0; i < E; ++i) {
    gw[i] = gp + i * (gu_packed.numel() / E), dw[i] = dp + i * (dn_packed.numel() / E);
    gs[i] = gsp + i * gu_s.stride(0) * gu_s.element_size();
    ds[i] = dsp + i * dn_s.stride(0) * dn_s.element_size();
    gz[i] = gzp + i * gsz, dz[i] = dzp + i * dsz;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, H}, x.options().dtype(at::kFloat));
  w4a8_experts(xf.data_ptr<float>(), ep, wc.data_ptr<float>(), M, k, H, I, gw.data(), gs.data(),
               gz.data(), gu_g, (int)gu_bits, gu_s.scalar_type() == at::kHalf, dw.data(),
               ds.data(), dz.data(), dn_g, (int)dn_bits, dn_s.scalar_type() == at::kHalf,
               y.data_ptr<float>(), (int)path, at::get_num_threads());
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

at::Tensor cache_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& lo, const at::Tensor& hi, double scale,
                           const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "compress::cache_attention: q, k "
              "and v are [B, H, Tq, D], [B, Hkv, L, D] and [B, Hkv, L, Dv]");
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), L = k.size(2), Dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == L &&
                  k.size(3) == D && Hkv > 0 && H % Hkv == 0,
              "compress::cache_attention: shapes q ", q.sizes(), ", k ", k.sizes(), ", v ",
              v.sizes(), " do not match");
  const bool half = k.scalar_type() == at::kHalf;
  TORCH_CHECK((half || k.scalar_type() == at::kFloat) && v.scalar_type() == k.scalar_type() &&
                  k.stride(3) == 1 && v.stride(3) == 1,
              "compress::cache_attention: k and v are fp16 or fp32 with unit channel stride");
  TORCH_CHECK(lo.scalar_type() == at::kLong && hi.scalar_type() == at::kLong &&
                  lo.numel() == B * Tq && hi.numel() == B * Tq,
              "compress::cache_attention: lo and hi are int64 [B, Tq]");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->numel() == H &&
                                      sinks->is_contiguous()),
              "compress::cache_attention: sinks are a contiguous float32 [H]");
  const at::Tensor qf = q.to(at::kFloat).contiguous(), l = lo.contiguous(), h = hi.contiguous();
  at::Tensor out = at::empty({B, H, Tq, Dv}, q.options().dtype(at::kFloat));
  range_attention(qf.data_ptr<float>(), out.data_ptr<float>(), k.data_ptr(), v.data_ptr(),
                  k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                  l.data_ptr<int64_t>(), h.data_ptr<int64_t>(), B, H, Hkv, Tq, L, D, Dv,
                  (float)scale, sinks.has_value() ? sinks->data_ptr<float>() : nullptr,
                  half ? 1 : 0, at::get_num_threads());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compress, m) {
  m.def("w4a8_linear(Tensor x, Tensor packed, Tensor s, Tensor sz, int bits, int g, int path) "
        "-> Tensor");
  m.def("w4a8_experts(Tensor x, Tensor w, Tensor e, Tensor gu_packed, Tensor gu_s, "
        "Tensor gu_sz, Tensor dn_packed, Tensor dn_s, Tensor dn_sz, int gu_bits, int gu_g, "
        "int dn_bits, int dn_g, int path) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor w, Tensor? b, int path) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps, float offset) -> Tensor");
  m.def("cache_attention(Tensor q, Tensor k, Tensor v, Tensor lo, Tensor hi, float scale, "
        "Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(compress, CPU, m) {
  m.impl("w4a8_linear", &w4a8_linear);
  m.impl("w4a8_experts", &w4a8_experts_op);
  m.impl("cache_attention", &cache_attention);
  m.impl("skinny_linear", &skinny_linear_op);
  m.impl("rms_norm", &rms_norm_op);
}
