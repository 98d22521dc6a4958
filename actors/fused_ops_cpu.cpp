// Elementwise pieces of the fast path's decoder layer, fused, on CPU (float32, bfloat16).
//
// At decode batch sizes each of these touches a few KB, so what they cost is the number
// of torch ops (~5-30 us each on one core: dispatch, allocation, a pass over memory):
// RMSNorm alone is seven of them in torch's CPU decomposition. Here each is one pass
// with float32 accumulation (SiLU stays torch's: its vectorised exp is faster than a
// scalar loop here):
//   add_rms_norm_  x += delta (in place), returns rms_norm(x) * weight
//   rms_norm       rms_norm(x) * weight
//   rope_write_kv_ rotates q and k of the fused qkv rows in place (rotate-half RoPE) and
//                  copies each token's k and v into its pool row
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

namespace {

template <typename T>
void norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) { const float v = static_cast<float>(xr[i]); ss += v * v; }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i)   // normalised in float32, cast, then scaled (transformers' order)
      out[r * n + i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(static_cast<float>(xr[i]) * inv)));
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, hidden] tensor");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [hidden] tensor of x's dtype");
}

// x [T, hidden] -> [T, hidden]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1),
                        static_cast<float>(eps));
  });
  return out;
}

// x [T, hidden] += delta [T, hidden]; -> rms_norm(x) [T, hidden]
at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, double eps) {
  check_rows(x, w);
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.is_contiguous() && delta.scalar_type() == x.scalar_type(),
              "delta must be a contiguous tensor shaped and typed as x");
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* dp = delta.data_ptr<scalar_t>();
    for (int64_t i = 0, n = x.numel(); i < n; ++i) xp[i] = static_cast<scalar_t>(static_cast<float>(xp[i]) + static_cast<float>(dp[i]));
    norm_rows<scalar_t>(xp, w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

template <typename T>
void rope_head(T* x, const T* cos, const T* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float a = static_cast<float>(x[d]), b = static_cast<float>(x[d + half]);
    // x * cos + rotate_half(x) * sin, each product rounded to T as torch does
    const T a_out = static_cast<T>(static_cast<float>(static_cast<T>(a * static_cast<float>(cos[d]))) +
                                   static_cast<float>(static_cast<T>(-b * static_cast<float>(sin[d]))));
    const T b_out = static_cast<T>(static_cast<float>(static_cast<T>(b * static_cast<float>(cos[d + half]))) +
                                   static_cast<float>(static_cast<T>(a * static_cast<float>(sin[d + half]))));
    x[d] = a_out;
    x[d + half] = b_out;
  }
}

// qkv [T, (H + 2 Hkv) * D]: q and k heads rotated in place; k and v of token t copied to
// pool[k_rows[t] + layer_offset ...] and 16 * Hkv * D elements later (V follows K in a block).
void rope_write_kv_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& pool,
                    const at::Tensor& k_rows, int64_t layer_offset, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be a contiguous [T, (H + 2 Hkv) * D] tensor");
  const int64_t T = qkv.size(0), D = cos.size(1), row = num_kv_heads * D;
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "qkv width must be (H + 2 Hkv) * D");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == T && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos and sin must be contiguous [T, D] tensors of qkv's dtype");
  TORCH_CHECK(pool.dim() == 1 && pool.is_contiguous() && pool.scalar_type() == qkv.scalar_type(),
              "pool must be a flat contiguous tensor of qkv's dtype");
  TORCH_CHECK(k_rows.dim() == 1 && k_rows.size(0) == T && k_rows.is_contiguous() && k_rows.scalar_type() == at::kLong,
              "k_rows must be a contiguous int64 [T] tensor");
  const int64_t* rows = k_rows.data_ptr<int64_t>();
  const int64_t n = pool.numel();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(rows[t] + layer_offset >= 0 && rows[t] + layer_offset + 16 * row + row <= n, "KV row outside the pool");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_write_kv_", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    scalar_t* pp = pool.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    const int64_t width = qkv.size(1);
    for (int64_t t = 0; t < T; ++t) {
      scalar_t* x = base + t * width;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) rope_head<scalar_t>(x + h * D, cp + t * D, sp + t * D, D);
      scalar_t* k_dst = pp + rows[t] + layer_offset;
      const scalar_t* k = x + num_heads * D;
      std::copy(k, k + row, k_dst);
      std::copy(k + row, k + 2 * row, k_dst + 16 * row);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmux, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_write_kv_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) pool, Tensor k_rows, int layer_offset, "
        "int num_heads, int num_kv_heads) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm_));
  m.impl("rope_write_kv_", c10::DispatchKey::CPU, TORCH_FN(rope_write_kv_));
}
