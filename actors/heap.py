"""A serving process's long-lived heap, kept out of the cyclic garbage collector's way.

CPython's collector is stop-the-world, and a pass over the oldest generation walks every
tracked object alive: in a worker that has imported torch, transformers and Ray that is
~235k objects and 100-125 ms on this project's 2-core CI host (measured: `gc.collect()` after
those imports), a pause in which no stream gets a token. On the published CPU run the
engine thread stalled 126 ms in one such pass, 22x the TBT SLO. Almost nothing there is
ever garbage: modules, models, the KV pool, the tokenizers. `gc.freeze()` moves what is
alive now into a permanent generation the collector never walks, so later passes walk only
what serving allocates since (the field's practice: vLLM's engine core, API server and
workers, SGLang and TensorRT-LLM freeze their start-up heap the same way). The cost is
bounded: a frozen object that becomes garbage later is freed by reference counting as
usual; only one in a reference cycle stays until the process ends.

    freeze_heap()               at the end of a process's start-up (collects first, so the
                                start-up's own garbage is not frozen)
    freeze_heap(collect=False)  after loading more long-lived state while serving (a model
                                registered; no full pass on the hot path)
"""
from __future__ import annotations

import gc


def freeze_heap(collect: bool = True) -> int:
    """Move every object alive now out of the collector's generations; returns how many the
    permanent generation holds. collect: run a full pass first (start-up only: it is the
    very pause this avoids later)."""
    if collect:
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
