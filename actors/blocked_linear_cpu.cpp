// float32 linear layer over weights in a column-blocked layout, for decode batch sizes on CPU.
//
// At decode batch sizes (a few rows) a linear layer is one pass over its weight, and what
// it costs is how fast the kernel streams that weight. oneDNN's packed fp32 kernel reads
// it at ~13 GB/s on one core of this project's AMD EPYC (AVX-512) hosts at batch 8 (MKL's
// sgemm ~7) against ~25 GB/s for a plain read; at 8 rows fp32 the FMA units cap a core at
// about the same ~20 GB/s. This kernel gets ~16-22 GB/s by keeping the whole batch in
// registers:
//
//   layout   w [N/32][K][32]: for each block of 32 output features, the 32 weights of
//            input k side by side, so a block is one contiguous 128*K-byte stream
//   tile     up to MR rows x 32 outputs of accumulators live in registers; per input k,
//            two vector loads of the weight and one broadcast FMA per row and vector
//            (GCC's vector types; AVX-512 builds only, see below)
//   order    threads split the blocks; rows beyond MR run as further tiles over the same
//            block while it is still in L1/L2 (prefill), so a weight leaves memory once
//
// Accumulation is float32 in input order per output, like a plain dot product; the bias
// seeds the accumulators. Checked against F.linear in tests/test_fast_path.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

namespace {

constexpr int64_t BLOCK = 32;          // output features per block: two 16-float vectors
// Built for AVX-512 only (-march=native on a CPU that has it): 8 rows x 2 accumulators and
// the block row of weights fill 18 of the 32 zmm registers. AVX2 builds of the scheme ran
// 2.5-18x slower than oneDNN's AVX2 kernel (16 ymm registers do not hold a useful tile), so
// there the op is not built and every packed matrix goes to oneDNN (actors/packed_linear.py).
#if defined(__AVX512F__)
#define TOKENMUX_BLOCKED_LINEAR 1
constexpr int64_t MR = 8;              // rows per tile

typedef float v16 __attribute__((vector_size(64), aligned(4)));

inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof(v16)); return v; }

// out[r, 0:BLOCK] = bias + sum_k xt[k, r] * w[k, :] for r < M; xt [K][MR], w [K][BLOCK].
// One named array per half of the block (not a 2-D array): GCC keeps these in registers.
template <int M>
void tile(const float* xt, const float* w, const float* bias, float* out, int64_t K, int64_t ldo) {
  v16 a0[M], a1[M];
  for (int m = 0; m < M; ++m) {
    a0[m] = bias != nullptr ? load(bias) : v16{};
    a1[m] = bias != nullptr ? load(bias + 16) : v16{};
  }
  for (int64_t k = 0; k < K; ++k) {
    const v16 w0 = load(w + k * BLOCK), w1 = load(w + k * BLOCK + 16);
    const float* xk = xt + k * MR;
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      a0[m] += xk[m] * w0;
      a1[m] += xk[m] * w1;
    }
  }
  for (int m = 0; m < M; ++m) {
    std::memcpy(out + m * ldo, &a0[m], sizeof(v16));
    std::memcpy(out + m * ldo + 16, &a1[m], sizeof(v16));
  }
}

using Tile = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t);

template <int... M>
constexpr auto make_tiles(std::integer_sequence<int, M...>) { return std::array<Tile, sizeof...(M)>{tile<M + 1>...}; }
constexpr auto TILES = make_tiles(std::make_integer_sequence<int, MR>{});

// x [T, K] float32, w [N/32, K, 32] float32, bias [N] or none -> [T, N]
at::Tensor blocked_linear(const at::Tensor& x_in, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be a float32 [T, in] tensor");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == BLOCK && w.is_contiguous() && w.scalar_type() == at::kFloat,
              "w must be a contiguous float32 [out/32, in, 32] blocked weight");
  TORCH_CHECK(w.size(1) == x_in.size(1), "x has ", x_in.size(1), " features, the weight takes ", w.size(1));
  const int64_t T = x_in.size(0), K = x_in.size(1), NB = w.size(0), N = NB * BLOCK;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "bias must be a contiguous float32 [", N, "] tensor");
    bp = bias->data_ptr<float>();
  }
  const at::Tensor x = x_in.contiguous();
  auto out = at::empty({T, N}, x.options());
  if (T == 0) return out;
  // the rows of each tile transposed: xt[c][k][r] = x[c * MR + r][k], so a tile broadcasts from one line per k
  // (a last tile of M < MR rows reads only its M; the rest of its lines is never read, so not cleared)
  const int64_t tiles = (T + MR - 1) / MR;
  auto xt = at::empty({tiles, K, MR}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xtp = xt.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) xtp[((t / MR) * K + k) * MR + t % MR] = xp[t * K + k];
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t c = 0; c < tiles; ++c) {
        const int64_t rows = std::min(MR, T - c * MR);
        TILES[rows - 1](xtp + c * K * MR, wp + b * K * BLOCK, bp == nullptr ? nullptr : bp + b * BLOCK,
                        op + c * MR * N + b * BLOCK, K, N);
      }
  });
  return out;
}

#endif  // TOKENMUX_BLOCKED_LINEAR

}  // namespace

#ifdef TOKENMUX_BLOCKED_LINEAR
TORCH_LIBRARY_FRAGMENT(tokenmux, m) {
  m.def("blocked_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("blocked_linear", c10::DispatchKey::CPU, TORCH_FN(blocked_linear));
}
#endif
