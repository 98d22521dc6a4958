"""The fast path's CPU kernels: decode attention over the paged pool, the fused
elementwise ops of a layer (actors/fused_ops_cpu.cpp) and the blocked float32 linear
(actors/blocked_linear_cpu.cpp, used through actors/packed_linear.py), one small C++
extension built once.

Without it a decode step gathers every sequence's K/V blocks into a copy (one
`index_select` per layer) and runs SDPA over the copy: on one core that is ~0.5 ms a
layer at batch 8, mostly moving bytes twice. `paged_attention_cpu.cpp` reads the K/V
rows where they lie in the pool instead (see its header). No library offers this for
the pinned torch on CPU (vLLM's and IPEX's CPU kernels come with their own torch
builds), so it is ours: ~100 lines, built with torch's own extension builder
(`torch.utils.cpp_extension.load`, cached under ~/.cache/torch_extensions, shared by
every process of the node) on first use. Where it cannot be built (no compiler) the
fast path logs once and runs the torch attention instead, which is just as exact.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in
           ("paged_attention_cpu.cpp", "fused_ops_cpu.cpp", "blocked_linear_cpu.cpp")]
# -march=native: the build is per machine (the cache directory is too); the reassociation
# flags let the compiler vectorise the dot products and sums (float32 accumulation).
# -fopenmp: at::parallel_for is a header template that splits work across torch's intra-op
# threads only when the extension itself is built with OpenMP (torch's own is libgomp, the
# same runtime); without it the kernels ran on one thread whatever torch.set_num_threads said.
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
          "-fno-signed-zeros", "-ffp-contract=fast", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Build (or load the cached build of) the kernels; False where that is impossible."""
    try:
        from torch.utils.cpp_extension import load

        load(name="tokenmux_cpu_kernels", sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS,
             extra_ldflags=LDFLAGS, is_python_module=False, verbose=False)
        # blocked_linear is built only for AVX-512 (packed_linear.blocked_available)
        return hasattr(torch.ops.tokenmux, "paged_decode_attention") and hasattr(torch.ops.tokenmux, "add_rms_norm_")
    except Exception as exc:   # no compiler / ninja / headers: the torch path stays correct
        logger.warning("CPU paged attention kernel unavailable (%s); using the torch attention", exc)
        return False


def decode_attention(q: torch.Tensor, pool: torch.Tensor, k_offsets: torch.Tensor, ctx_lens: torch.Tensor,
                     num_kv_heads: int, window: int | None, scale: float | None = None) -> torch.Tensor:
    """q [B, H, D] (one token per sequence), pool [N] flat typed pool, k_offsets [B, NB] int64
    element offsets of this layer's K of each block, ctx_lens [B] -> [B, H * D]; scale: softmax
    scale (None: 1 / sqrt(D))."""
    B, H, D = q.shape
    out = torch.ops.tokenmux.paged_decode_attention(q.contiguous(), pool, k_offsets, ctx_lens, num_kv_heads,
                                                    window or 0, D ** -0.5 if scale is None else scale)
    return out.view(B, H * D)
