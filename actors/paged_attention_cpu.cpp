// Decode attention straight over the paged KV pool, on CPU (the fast path's kernel).
//
// One query token per sequence. Each (sequence, KV head) reads its cached K and V rows
// where they lie in the pool -- block j of sequence b starts at element k_offsets[b, j]
// (that layer's K; its V follows R = 16 * Hkv * D elements later) -- so nothing is
// gathered into a copy first, and positions past a sequence's context are never read
// (unwritten pool slots may hold NaN). The G query heads sharing a KV head reuse each K
// and V row while it is in cache. Scores are exact softmax over [start, ctx), start =
// ctx - window for a sliding window; float32 accumulation for float and bfloat16 pools.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
void decode_attention(const T* q, const T* pool, const int64_t* k_offsets, const int64_t* ctx_lens, T* out,
                      int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t NB, int64_t window, float scale) {
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * D;        // one position's K (or V) of all KV heads
  const int64_t block_kv = 16 * row;  // a block's K, then its V
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv;
      const int64_t n = ctx_lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      const int64_t len = n - start;
      scores.assign(G * len, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(q[(b * H + h * G + g) * D + d]) * scale;
      for (int64_t t = start; t < n; ++t) {
        const T* k = pool + k_offsets[b * NB + t / 16] + (t % 16) * row + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qg[d] * static_cast<float>(k[d]);
          scores[g * len + (t - start)] = s;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> norm(G);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        const float mx = *std::max_element(sg, sg + len);
        float sum = 0.f;
        for (int64_t i = 0; i < len; ++i) {
          sg[i] = std::exp(sg[i] - mx);
          sum += sg[i];
        }
        norm[g] = 1.f / sum;
      }
      for (int64_t t = start; t < n; ++t) {
        const T* v = pool + k_offsets[b * NB + t / 16] + block_kv + (t % 16) * row + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + (t - start)];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += p * static_cast<float>(v[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + h * G + g) * D + d] = static_cast<T>(acc[g * D + d] * norm[g]);
    }
  });
}

// q [B, H, D], pool [N] (the pool as one flat typed tensor), k_offsets [B, NB] int64,
// ctx_lens [B] int64 (>= 1) -> [B, H, D]
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& k_offsets,
                                  const at::Tensor& ctx_lens, int64_t num_kv_heads, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, H, D] tensor");
  TORCH_CHECK(pool.dim() == 1 && pool.is_contiguous() && pool.scalar_type() == q.scalar_type(),
              "pool must be a flat contiguous tensor of q's dtype");
  TORCH_CHECK(k_offsets.dim() == 2 && k_offsets.is_contiguous() && k_offsets.scalar_type() == at::kLong &&
                  k_offsets.size(0) == q.size(0), "k_offsets must be a contiguous int64 [B, NB] tensor");
  TORCH_CHECK(ctx_lens.dim() == 1 && ctx_lens.is_contiguous() && ctx_lens.scalar_type() == at::kLong &&
                  ctx_lens.size(0) == q.size(0), "ctx_lens must be a contiguous int64 [B] tensor");
  TORCH_CHECK(num_kv_heads > 0 && q.size(1) % num_kv_heads == 0, "num_kv_heads must divide the query heads");
  auto out = at::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), NB = k_offsets.size(1);
  const int64_t* ctx = ctx_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(ctx[b] >= 1 && ctx[b] <= NB * 16, "context length out of range");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention<scalar_t>(q.data_ptr<scalar_t>(), pool.data_ptr<scalar_t>(), k_offsets.data_ptr<int64_t>(), ctx,
                               out.data_ptr<scalar_t>(), B, H, num_kv_heads, D, NB, window,
                               static_cast<float>(scale));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenmux, m) {
  m.def("paged_decode_attention(Tensor q, Tensor pool, Tensor k_offsets, Tensor ctx_lens, int num_kv_heads, "
        "int window, float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
}
