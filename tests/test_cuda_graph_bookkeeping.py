"""The CUDA-graph runner's bookkeeping, run on a CPU: buckets, padding, the static buffers
and the per-step copy into them. On a CPU a "graph" re-runs the forward over the same
static buffers (actors/cuda_graphs.py `_EagerReplay`), so everything but the capture
itself runs here: the copy that broke every CUDA decode (a stride-0 view as a static
buffer) fails on a CPU exactly as on a GPU.
"""
from __future__ import annotations

import copy
from dataclasses import fields

import pytest
import torch

from actors.cuda_graphs import BATCH_BUCKETS, DecodeGraphs, _copy_step
from actors.model_runner import ModelRunner, SeqChunk
from actors.zoo.zoo import ensure_model
from tests.test_model_runner import Blocks, Model, generate, make_prompts

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def model():
    return Model(ensure_model("llama-tiny-b"))


def _graphed(model: Model) -> ModelRunner:
    return ModelRunner(model.spec, torch.device("cpu"), cuda_graphs=True)


def _steps(model: Model, runner: ModelRunner, batch: int, num_steps: int) -> list[torch.Tensor]:
    """Logits of a prefill then `num_steps` greedy decode steps of `batch` sequences."""
    kv = model.new_kv()
    blocks = Blocks(kv.shape[0] * kv.shape[1], seed=batch)
    prompts = make_prompts(model.spec.vocab_size, seed=batch)[:batch]
    chunks = [SeqChunk(p, 0, blocks.table(len(p) + num_steps + 1)) for p in prompts]
    out = [runner.forward(model.params, chunks, kv).clone()]
    for _ in range(num_steps):
        tokens = out[-1].argmax(-1).tolist()
        chunks = [SeqChunk([t], c.start_pos + len(c.token_ids), c.block_ids) for c, t in zip(chunks, tokens)]
        out.append(runner.forward(model.params, chunks, kv).clone())   # a graph reuses its output
    return out


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_graphed_decode_equals_eager_decode_at_padded_buckets(model, batch):
    """Batch 3 pads to 4 and 5 to 8 (padding rows repeat the last sequence); the block bucket
    grows as the sequences cross 16-token boundaries, so several graphs are captured and
    each is replayed with new index tensors copied into its static buffers."""
    eager = _steps(model, ModelRunner(model.spec, torch.device("cpu")), batch, num_steps=20)
    runner = _graphed(model)
    graphed = _steps(model, runner, batch, num_steps=20)
    assert runner.graphs.num_replays >= 20
    for step, (a, b) in enumerate(zip(eager, graphed)):
        assert a.shape == b.shape == (batch, model.spec.vocab_size)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-4, msg=f"step {step}")   # GEMMs of 8 rows vs 5


def test_graphed_greedy_tokens_equal_hf_generate(model):
    """The whole graphed decode of a mixed batch (prompts of 1..47 tokens, scattered
    blocks) gives transformers' greedy tokens."""
    prompts = make_prompts(model.spec.vocab_size)
    model_graphed = copy.copy(model)   # the same weights and references, the graphed runner
    model_graphed.runner = _graphed(model)
    assert generate(model_graphed, prompts) == [model.reference(p) for p in prompts]


def test_every_static_buffer_owns_its_elements(model):
    """copy_ refuses a destination whose elements overlap; a static buffer must not be a
    broadcast (stride-0) view. Checked on every tensor of a padded step."""
    runner = _graphed(model)
    kv = model.new_kv()
    chunks = [SeqChunk([7], 20, [3, 9]), SeqChunk([8], 4, [5])]
    bucket = runner.graphs.bucket(chunks)
    assert bucket == (2, 2)
    step = runner._prepare(chunks, kv, torch.float32, bucket)
    for f in fields(step):
        value = getattr(step, f.name)
        for t in value if isinstance(value, tuple) else (value,):
            if isinstance(t, torch.Tensor):
                assert 0 not in t.stride() or t.numel() <= 1, f"{f.name} has a stride-0 dimension"
    again = runner._prepare([SeqChunk([9], 21, [3, 9]), SeqChunk([1], 5, [5])], kv, torch.float32, bucket)
    _copy_step(step, again)   # what every replay does
    assert torch.equal(step.input_ids, again.input_ids) and torch.equal(step.mask, again.mask)


def test_buckets_round_batch_and_blocks_up_and_refuse_prefill():
    graphs = DecodeGraphs(lambda *a: None, torch.device("cpu"))
    one = SeqChunk([1], 0, [0])
    assert graphs.bucket([one]) == (1, 1)
    assert graphs.bucket([one] * 3) == (4, 1)
    assert graphs.bucket([SeqChunk([1], 16 * 4, list(range(5)))]) == (1, 8)   # 5 blocks -> 8
    assert graphs.bucket([SeqChunk([1, 2], 0, [0])]) is None                  # a prefill runs eagerly
    assert graphs.bucket([one] * (BATCH_BUCKETS[-1] + 1)) is None              # past the largest bucket


def test_a_failing_copy_is_what_the_old_mask_did():
    """The bug class itself: copy_ into an expanded (stride-0) tensor raises on a CPU."""
    base = torch.zeros(2, 1, 5)
    expanded = base[:, None].expand(2, 4, 1, 5).reshape(2, 4, 5)
    with pytest.raises(RuntimeError, match="more than one element"):
        expanded.copy_(torch.ones(2, 4, 5))
