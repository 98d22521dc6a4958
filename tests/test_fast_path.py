"""The fast path (EngineConfig.kernels="fast") checked against the reference path the way
kernel libraries check theirs: on every zoo architecture and the families of
tests/family_checkpoints.py, prefill logits within 1e-4
relative of the reference, and wherever greedy output diverges from the reference, the
reference's top-2 logits at that step are a near tie. Each model runs twice: with the
default packing threshold and with every linear weight packed (threshold 0), so the
packed kernels (blocked and oneDNN, actors/packed_linear.py) run on the tiny shapes too. Weights go through the real host cache
and slots, so what is checked is what a swap-in puts in front of the kernels.
"""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from family_checkpoints import FAMILIES

from actors import layer_kernels, packed_linear, paged_attention_cpu
from actors.device_memory import DeviceMemory
from actors.engine import Engine, EngineConfig
from actors.host_cache import HostWeightCache
from actors.kernel_path import KernelPath
from actors.layers import paged_attention
from actors.model_runner import ModelRunner, SeqChunk
from actors.model_spec import ModelSpec
from actors.weight_layout import WeightLayout
from actors.weight_slots import WeightSlots
from actors.zoo.zoo import TINY_MODELS, ensure_model
from tests import moe_checkpoints
from tests.greedy_reference import hf_greedy
from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams

LOGIT_RTOL = 1e-4
TIE_MARGIN = 1e-4      # relative to the largest |logit| of that row
STEPS = 12
PROMPT_LENGTHS = [1, 5, 16, 17, 31, 40]
MODELS = list(TINY_MODELS) + ["llama-10m"] + list(FAMILIES)   # every family; llama-10m packs by default


def _params(path: Path, kernels: str, prefix: str, layout: WeightLayout | None = None
            ) -> tuple[ModelSpec, dict, WeightSlots]:
    spec = ModelSpec.from_dir(path)
    layout = layout or KernelPath(kernels, "cpu").weight_layout(path, torch.float32)
    mem = DeviceMemory(4096 + layout.total_bytes + 4096, 4096, 1)
    slots = WeightSlots(mem, HostWeightCache(prefix=prefix), {"m": layout})
    slots.ensure_resident("m")
    return spec, slots.params("m"), slots


def _kv(spec: ModelSpec) -> torch.Tensor:   # [slabs, blocks_per_slab, L, 2, 16, Hkv, D], NaN where unwritten
    return torch.full((2, 24, spec.num_layers, 2, 16, spec.num_kv_heads, spec.head_dim), float("nan"))


def _greedy(runner: ModelRunner, params: dict, prompts: list[list[int]]) -> tuple[torch.Tensor, list, list]:
    """Prefill logits [B, V], then per step the tokens and logits of a greedy decode."""
    kv = _kv(runner.spec)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    chunks = [SeqChunk(p, 0, t) for p, t in zip(prompts, tables)]
    logits = runner.forward(params, chunks, kv)
    prefill, tokens, step_logits = logits, [], []
    for _ in range(STEPS):
        next_tokens = logits.argmax(-1).tolist()
        tokens.append(next_tokens)
        step_logits.append(logits)
        chunks = [SeqChunk([t], c.start_pos + len(c.token_ids), c.block_ids) for c, t in zip(chunks, next_tokens)]
        logits = runner.forward(params, chunks, kv)
    return prefill, tokens, step_logits


@pytest.fixture
def prefix():
    p = f"tokenmux-test-fast-{uuid.uuid4().hex[:10]}"
    yield p
    for f in Path("/dev/shm").glob(p + "-*"):
        f.unlink(missing_ok=True)


@pytest.mark.parametrize("pack_all", [False, True], ids=["default-packing", "all-packed"])
@pytest.mark.parametrize("name", MODELS)
def test_fast_path_matches_the_reference_within_kernel_tolerances(name, pack_all, prefix, monkeypatch, tmp_path):
    if pack_all:
        monkeypatch.setattr(layer_kernels, "PACK_MIN_ELEMENTS", 0)
    path = FAMILIES[name](tmp_path / name) if name in FAMILIES else ensure_model(name)
    spec, ref_params, _ = _params(path, "reference", prefix + "-r")
    _, fast_params, _ = _params(path, "fast", prefix + "-f")
    packed = sum(packed_linear.is_packed(v) for v in fast_params.values())
    assert packed > 0 if (pack_all or name == "llama-10m") else packed == 0
    g = torch.Generator().manual_seed(len(name))
    prompts = [torch.randint(8, spec.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    ref_prefill, ref_tokens, ref_logits = _greedy(ModelRunner(spec, "cpu"), ref_params, prompts)
    fast_prefill, fast_tokens, _ = _greedy(ModelRunner(spec, "cpu", kernels="fast"), fast_params, prompts)

    rel = (fast_prefill - ref_prefill).abs().max() / ref_prefill.abs().max()
    assert rel <= LOGIT_RTOL, f"{name}: prefill logits differ by {rel:.2e} relative"
    for b in range(len(prompts)):
        for step, (r, f) in enumerate(zip(ref_tokens, fast_tokens)):
            if r[b] != f[b]:   # only the first divergence is comparable: the contexts differ after it
                top2 = ref_logits[step][b].topk(2).values
                margin = float(top2[0] - top2[1]) / float(ref_logits[step][b].abs().max())
                assert margin < TIE_MARGIN, f"{name} seq {b} step {step}: diverged with margin {margin:.2e}"
                break


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    per_expert = moe_checkpoints.save(moe_checkpoints.mixtral_config(num_hidden_layers=3), root / "per-expert")
    return {"per-expert": per_expert, "stacked": moe_checkpoints.stack_experts(per_expert, root / "stacked"),
            "qwen3-moe": moe_checkpoints.save(moe_checkpoints.qwen3_moe_config(), root / "qwen3-moe")}


# per-expert: each expert's gate/up and down alone, packed (CPU); stacked: every expert in one
# [E * 2I, hidden] and one [E * hidden, I] tensor (the grouped GEMM's layout, CUDA's)
@pytest.mark.parametrize("form", ["packed", "stacked"])
@pytest.mark.parametrize("checkpoint", ["per-expert", "stacked", "qwen3-moe"])
def test_moe_fast_path_gives_transformers_greedy_tokens(moe_paths, checkpoint, form, prefix, monkeypatch):
    """The fast MoE layouts, from either way a checkpoint stores experts: greedy output equals
    transformers' generate, token for token."""
    monkeypatch.setattr(layer_kernels, "PACK_MIN_ELEMENTS", 0)
    path = moe_paths[checkpoint]
    spec = ModelSpec.from_dir(path)
    layout = WeightLayout.from_dir(path, dtype=torch.float32, plan=layer_kernels.fast_plan(
        spec, pack=form == "packed" and KernelPath("fast", "cpu").packs(torch.float32)))
    stacked_name = layer_kernels.layer_names(spec, 0).moe.fast_stacked[0]
    assert (stacked_name in layout.names()) == (form == "stacked" or not packed_linear.available())
    _, params, _ = _params(path, "fast", prefix, layout)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(8, spec.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    _, tokens, _ = _greedy(ModelRunner(spec, "cpu", kernels="fast"), params, prompts)
    for b, prompt in enumerate(prompts):
        want = hf_greedy(path, prompt, STEPS)
        got = [step[b] for step in tokens][:len(want)]
        assert got == want, f"{checkpoint} / {form}: prompt of {len(prompt)} tokens"


# (96, 80): the blocked layout where the C++ kernels build; (100, 80): 100 output
# features are not whole blocks of 32, so oneDNN's format, which pads its own blocks.
@pytest.mark.parametrize("shape", [(96, 80), (100, 80)], ids=["blocked", "onednn"])
def test_packed_weights_are_viewed_in_place_so_a_swap_in_changes_what_the_kernel_reads(shape):
    fmt = packed_linear.packed_format(shape, torch.float32)
    assert fmt.blocked == (shape[0] % 32 == 0 and packed_linear.blocked_available())
    assert fmt.nbytes >= shape[0] * shape[1] * 4
    a, b = torch.randn(shape), torch.randn(shape)
    slot = torch.zeros(fmt.nbytes + 64, dtype=torch.uint8)[64:]
    packed_linear.pack_into(slot, a, fmt)
    view = packed_linear.packed_view(slot, shape, torch.float32, fmt)
    x = torch.randn(5, shape[1])
    torch.testing.assert_close(packed_linear.linear(x, view), F.linear(x, a), rtol=1e-5, atol=1e-5)
    staged = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    packed_linear.pack_into(staged, b, fmt)
    slot.copy_(staged)   # what WeightSlots.ensure_resident does: one bulk copy
    torch.testing.assert_close(packed_linear.linear(x, view), F.linear(x, b), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="contiguous CPU bytes"):
        packed_linear.packed_view(slot[:-1], shape, torch.float32, fmt)


@pytest.mark.skipif(not packed_linear.blocked_available(),
                    reason="the blocked kernel is built for AVX-512 only (absent or hidden here), or the CPU kernels "
                           "could not be built")
@pytest.mark.parametrize("threads", [1, 2])
def test_blocked_linear_equals_f_linear_at_every_batch_size(threads):
    """Rows run in register tiles of up to 8 with a tail, blocks split across threads:
    every row count from an empty batch to a prefill, with and without bias."""
    shape = (160, 72)
    fmt = packed_linear.packed_format(shape, torch.float32)
    w, bias = torch.randn(shape), torch.randn(shape[0])
    slot = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    packed_linear.pack_into(slot, w, fmt)
    view = packed_linear.packed_view(slot, shape, torch.float32, fmt)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (0, 1, 2, 3, 7, 8, 9, 16, 21, 130):
            x = torch.randn(rows, shape[1])
            torch.testing.assert_close(packed_linear.linear(x, view), F.linear(x, w), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(packed_linear.linear(x, view, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="features"):
            packed_linear.linear(torch.randn(2, shape[1] + 1), view)
    finally:
        torch.set_num_threads(before)


def test_fast_layout_fuses_exactly_and_names_different_cache_files():
    path = ensure_model("qwen2-tiny-a")   # tied embeddings, q/k/v bias
    spec = ModelSpec.from_dir(path)
    plain = WeightLayout.from_dir(path)
    fast = WeightLayout.from_dir(path, plan=layer_kernels.fast_plan(spec, pack=False))
    assert plain.fingerprint() != fast.fingerprint()
    names = layer_kernels.layer_names(spec, 0)
    qkv = next(e for e in fast.entries if e.name == names.qkv)
    assert [s.name for s in qkv.sources] == [names.q, names.k, names.v]
    assert qkv.shape == ((spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim, spec.hidden_size)
    assert names.q not in fast.names() and names.qkv_bias in fast.names()
    assert layer_kernels.LM_HEAD not in fast.names()   # small tied head: the embedding serves both


@pytest.mark.skipif(not paged_attention_cpu.available(), reason="the CPU attention kernel could not be built")
@pytest.mark.parametrize("dtype, window", [(torch.float32, None), (torch.float32, 20), (torch.bfloat16, None)])
def test_cpu_decode_attention_kernel_equals_the_torch_attention(dtype, window):
    B, H, Hkv, D, L, NB = 5, 6, 2, 16, 3, 4
    pool = torch.randn(3, 7, L, 2, 16, Hkv, D).to(dtype)            # [slabs, per_slab, L, 2, 16, Hkv, D]
    ctx = torch.tensor([1, 16, 17, 40, 64])
    blocks = torch.randperm(21)[:B * NB].view(B, NB)
    for b in range(B):   # NaN past each context: the kernel must never read it
        for p in range(int(ctx[b]), NB * 16):
            g = int(blocks[b, p // 16])
            pool[g // 7, g % 7, :, :, p % 16] = float("nan")
    layer, row = 1, 16 * Hkv * D
    offsets = (blocks // 7 * pool.stride(0) + blocks % 7 * pool.stride(1) + 2 * layer * row).view(-1)
    flat = pool.view(-1)
    q = torch.randn(B, H, D).to(dtype)
    got = paged_attention_cpu.decode_attention(q, flat, offsets.view(B, NB), ctx, Hkv, window)
    S = NB * 16
    k_pos, q_pos = torch.arange(S), (ctx - 1)[:, None]
    allowed = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    mask = torch.zeros(B, S, dtype=dtype).masked_fill(~allowed, float("-inf"))
    mask = mask[:, None, None].expand(B, 1, H // Hkv, S)
    unwritten = torch.tensor([b * S + p for b in range(B) for p in range(int(ctx[b]), S)])
    windows = flat.as_strided((flat.numel() - row + 1, row), (1, 1))
    want = paged_attention(q, windows, torch.cat([offsets, offsets + row]), mask, unwritten, (B, 1), None, Hkv)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_engine_on_the_fast_path_swaps_packed_weights_and_keeps_its_tokens(monkeypatch):
    monkeypatch.setattr(layer_kernels, "PACK_MIN_ELEMENTS", 0)   # every weight packed: swaps move packed bytes
    names = ["llama-tiny-a", "qwen2-tiny-b", "mistral-tiny-a"]
    paths = {n: ensure_model(n) for n in names}
    path_ = KernelPath("fast", "cpu")
    slot = max(path_.weight_layout(p, torch.float32).total_bytes for p in paths.values())
    kv = 8 << 20
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[11, 12, 13], list(range(20, 45))]

    def run(models: list[str], num_slots: int) -> dict:
        engine = Engine(EngineConfig(budget_bytes=kv + num_slots * (slot + 4096), kv_bytes=kv, num_slots=num_slots,
                                     slab_bytes=256 * 1024, host_kv_bytes=0, kernels="fast"))
        for n in models:
            engine.register_model(n, paths[n])
        for n in models:
            for i, p in enumerate(prompts):
                engine.add_request(GenerateRequest(f"{n}-{i}", n, tuple(p), params))
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for frame in engine.step():
                out.setdefault(frame.request_id, []).extend(frame.token_ids)
        assert engine.slots.stats()["num_swaps"] >= (len(models) if num_slots < len(models) else 1)
        return out

    together = run(names, num_slots=2)   # three models, two slots: packed weights swap in and out
    for n in names:
        alone = run([n], num_slots=1)
        assert {k: v for k, v in together.items() if k.startswith(n)} == alone


@pytest.mark.skipif(bool(KernelPath("fast", "cpu").refusal(torch.bfloat16)),
                    reason=KernelPath("fast", "cpu").refusal(torch.bfloat16))
def test_opt_in_bf16_fast_path_runs_packed_and_stays_close(monkeypatch, prefix):
    monkeypatch.setattr(layer_kernels, "PACK_MIN_ELEMENTS", 0)
    path = ensure_model("mistral-tiny-b")
    spec = ModelSpec.from_dir(path)
    layout = KernelPath("fast", "cpu").weight_layout(path, torch.bfloat16)
    assert all(e.dtype == torch.bfloat16 for e in layout.entries) and any(e.packed for e in layout.entries)
    mem = DeviceMemory(4096 + layout.total_bytes + 4096, 4096, 1)
    slots = WeightSlots(mem, HostWeightCache(prefix=prefix), {"m": layout})
    slots.ensure_resident("m")
    _, ref_params, _ = _params(path, "reference", prefix + "-r")
    prompts = [list(range(10, 10 + n)) for n in PROMPT_LENGTHS]
    chunks = [SeqChunk(p, 0, list(range(i * 8, i * 8 + 8))) for i, p in enumerate(prompts)]
    kv16 = _kv(spec).to(torch.bfloat16)
    fast = ModelRunner(spec, "cpu", kernels="fast").forward(slots.params("m"), chunks, kv16)
    ref = ModelRunner(spec, "cpu").forward(ref_params, chunks, _kv(spec))
    assert torch.isfinite(fast).all()
    assert (fast - ref).abs().max() / ref.abs().max() < 0.05      # bf16: ~3 significant digits
    assert (fast.argmax(-1) == ref.argmax(-1)).sum() >= len(prompts) - 1


# What an AVX2-only CPU sees, reproduced on any x86-64 host by torch's and oneDNN's own caps.
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
AVX2_PROBE = """
import json, subprocess, torch
from torch.utils.cpp_extension import _get_build_directory
from actors import packed_linear, paged_attention_cpu
from actors.kernel_path import KernelPath, cpu_features
built = paged_attention_cpu.available()
name = paged_attention_cpu.build_name_and_flags()[0]
code = subprocess.run(["objdump", "-d", f"{_get_build_directory(name, False)}/{name}.so"], capture_output=True,
                      text=True).stdout if built else ""
print(json.dumps({"features": cpu_features(), "refusal": KernelPath("fast", "cpu").refusal(torch.bfloat16),
                  "reference_packs": KernelPath("reference", "cpu").packs(torch.bfloat16),
                  "fp32_blocked": packed_linear.packed_format((96, 80), torch.float32).blocked,
                  "built": built, "zmm": "%zmm" in code, "ymm": "%ymm" in code}))
"""


@pytest.mark.skipif("avx2" not in Path("/proc/cpuinfo").read_text(), reason="not an x86-64 CPU with AVX2")
def test_an_avx2_cpu_runs_fast_float32_without_avx512_and_refuses_fast_bf16():
    """With AVX-512 hidden no AVX-512 feature counts, the fast bf16 path is refused with the
    reason, float32 matrices go to oneDNN, and our kernels are built without AVX-512 code."""
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", AVX2_PROBE], capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parents[1], env={**os.environ, **AVX2_ONLY})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.splitlines()[-1])
    features = r["features"]
    assert features["torch_capability"] == "AVX2" and features["avx2"]
    assert not any(features[f] for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"))
    assert not features["blocked_f32"] and not features["onednn_bf16"] and not r["fp32_blocked"]
    assert "AVX512-BF16 or AMX" in r["refusal"] and "use dtype float32" in r["refusal"]
    assert r["reference_packs"] is False
    if r["built"]:
        assert not r["zmm"] and r["ymm"]   # AVX2 code, no AVX-512 register anywhere
