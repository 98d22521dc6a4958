"""Command-line options of the engine benchmark, kept free of heavy imports so that
`tokenmux --help` and the CLI's parser stay fast (the benchmark itself loads lazily)."""
from __future__ import annotations

import argparse

SECTIONS = ("swap", "cold", "decode", "overhead", "metrics", "bandwidth")
DEFAULT_SECTIONS = ("swap", "cold", "decode", "overhead", "metrics")   # bandwidth: decode at batch 1 vs the memory limit
DTYPES = ("float32", "bfloat16", "float16")
KERNELS = ("fast", "reference")   # actors/kernel_path.py


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the results here as JSON")
    parser.add_argument("--model", default="llama-100m", help="zoo model measured (default: llama-100m)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument("--dtype", choices=DTYPES, help="weights and KV dtype (default: the checkpoint's)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--kernels", choices=KERNELS, default="fast",
                        help="engine kernel path: fast (fused, packed weights / CUDA graphs) or reference "
                             "(transformers' arithmetic); default fast")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions per figure; medians reported")
    parser.add_argument("--swap-repeats", type=int, default=9, help="swap-ins (and raw copies) timed")
    parser.add_argument("--cold-repeats", type=int, default=2,
                        help="fresh-process loads per page-cache state (warm, evicted)")
    parser.add_argument("--batch", type=int, default=8, help="requests decoded together")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="mean prompt length (+-4)")
    parser.add_argument("--overhead-models", type=int, default=8, help="models active at once")
    parser.add_argument("--overhead-requests", type=int, default=4, help="requests per model")
    parser.add_argument("--overhead-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--overhead-repeats", type=int, default=5,
                        help="timed runs of the overhead section (mean and 95%% interval reported)")
    parser.add_argument("--metrics-pairs", type=int, default=500,
                        help="alternating on/off window pairs of the metrics section")
    parser.add_argument("--metrics-window", type=float, default=0.3,
                        help="seconds per window of the metrics section")
    parser.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: {','.join(DEFAULT_SECTIONS)})")
    parser.add_argument("--shape-sections", help="sections for the --shapes models (default: --sections)")
    parser.add_argument("--shapes", default="",
                        help="also measure random-weight models of real shapes, e.g. llama3-1b,qwen2.5-7b")
    parser.add_argument("--shape-repeats", type=int, default=2, help="repetitions for each --shapes model")
    parser.add_argument("--shape-overhead-models", type=int, default=4,
                        help="models (one --shapes checkpoint under several names) in its overhead run")
    parser.add_argument("--max-seconds", type=float,
                        help="start no new section after this many seconds (results so far are kept)")


def check_args(args: argparse.Namespace) -> list[str]:
    """Validate the numbers; returns the selected sections. Bad input -> ValueError."""
    for name in ("repeats", "swap_repeats", "cold_repeats", "batch", "new_tokens", "prompt_tokens",
                 "overhead_models", "overhead_requests", "overhead_tokens", "overhead_repeats", "shape_repeats",
                 "shape_overhead_models", "metrics_pairs"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not args.metrics_window > 0:
        raise ValueError(f"--metrics-window must be > 0, got {args.metrics_window}")
    if args.max_seconds is not None and args.max_seconds <= 0:
        raise ValueError(f"--max-seconds must be > 0, got {args.max_seconds}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.prompt_tokens < 5:
        raise ValueError(f"--prompt-tokens must be >= 5 (prompts vary by +-4 tokens), got {args.prompt_tokens}")
    sections = _sections("--sections", args.sections)
    args.shape_sections = _sections("--shape-sections", args.shape_sections) if args.shape_sections else sections
    return sections


def _sections(option: str, text: str) -> list[str]:
    sections = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        raise ValueError(f"{option}: unknown or empty {unknown or sections}; choose from {', '.join(SECTIONS)}")
    return sections
