"""Benchmarks of tokenmux's parts, each a measurement side by side with its baseline.

    tokenmux bench engine --json FILE     (or: python -m load_tests.bench.engine_bench ...)

What flows through the engine benchmark, section by section (each writes its figures
into one JSON document, saved after every section so a cut-short run keeps its results):

    swap.py       host cache -> device slot through WeightSlots.ensure_resident, interleaved
                  with a raw copy of the same bytes            -> swap_s, memcpy_limit_s
    cold_load.py  from_pretrained in a fresh process, page cache warm and evicted
                                                                -> cold_load_s
    decode.py     Engine vs transformers generate(), batch 8, same tokens, alternating
                                                                -> decode_tps, hf_generate_tps
    overhead.py   8 models active in one Engine: step time outside the model forward
                                                                -> scheduler_overhead_frac
    shapes.py     random-weight checkpoints of real 1B-7B shapes (the GPU run)

Only torch, transformers, safetensors and tokenizers are needed (no ray, no fastapi), so
the benchmark runs on a bare GPU machine with `python3 -m load_tests.bench.engine_bench`.
"""
