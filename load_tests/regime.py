"""The regime of a load test, said before it is measured: what queueing predicts for token vs request.

Two numbers decide it (Aegaeon's argument, in queueing terms):

    decode / TTFT = mean decode time of a request (mean output length x decode step)
                    / the TTFT budget
    TBT slack     = TBT SLO / decode step: how many models' batches could take turns on a
                    device and still give each stream a token within its TBT budget
                    (switch costs eat into it)

Request-level multiplexing serves models first come, first served: a request of model B that
lands behind a running batch of model A waits for A's requests to finish, about one mean
decode time. Token-level multiplexing is processor sharing between models: B's batch takes
turns with A's at once, each slowed by the share it gives up, which the TBT slack pays for.

    decode / TTFT > 1 and slack >= 2  FCFS waits blow the TTFT budget, sharing fits the TBT
                                      budget: token should hold the higher rate
    decode / TTFT <= 1                a wait behind another model fits the TTFT budget:
                                      both should hold about the same rate (request-level
                                      saves the switches)
    slack < 2                         a device cannot keep two models' streams in SLO at
                                      once: sharing cannot help; expect parity or request ahead
"""
from __future__ import annotations

from typing import Sequence

from cluster.planner.workloads import TraceRequest
from scheduler.slo import SLO

MIN_SHARING_SLACK = 2.0  # two models' batches taking turns need at least this TBT slack


def regime(requests: Sequence[TraceRequest], slo: SLO, decode_s: float) -> dict:
    """The regime of one workload at one SLO on a device whose decode step takes decode_s."""
    if not requests:
        raise ValueError("a regime needs the workload's requests")
    if not decode_s > 0:
        raise ValueError(f"decode_s must be > 0, got {decode_s!r}")
    mean_output = sum(r.output_len for r in requests) / len(requests)
    mean_decode_s = mean_output * decode_s
    decode_vs_ttft = mean_decode_s / slo.ttft_s
    slack = slo.tbt_s / decode_s
    if slack < MIN_SHARING_SLACK:
        prediction = ("parity or request ahead: the TBT slack leaves no room for two models' batches to take "
                      "turns within the TBT budget, so sharing the device cannot help")
        favours = "request"
    elif decode_vs_ttft > 1:
        prediction = ("token ahead: a request that lands behind another model's batch waits about one mean "
                      "decode time under FCFS (request-level), more than the TTFT budget, while processor "
                      f"sharing (token-level) fits up to ~{slack:.0f} models' turns in the TBT budget")
        favours = "token"
    else:
        prediction = ("about the same: a wait behind another model's batch fits inside the TTFT budget, so "
                      "FCFS misses little; token-level pays switches request-level does not")
        favours = "neither"
    return {"mean_output_tokens": round(mean_output, 2), "decode_step_s": decode_s,
            "mean_decode_s": round(mean_decode_s, 6), "ttft_slo_s": slo.ttft_s, "tbt_slo_s": slo.tbt_s,
            "decode_vs_ttft": round(decode_vs_ttft, 3), "tbt_slack": round(slack, 2), "favours": favours,
            "prediction": prediction, "when": "said before measuring"}


def describe(r: dict) -> str:
    """One paragraph for a report."""
    return (f"Regime ({r.get('when', 'said before measuring')}): a request's mean decode time is {r['mean_decode_s']:.3g} s "
            f"({r['mean_output_tokens']:.0f} tokens x {r['decode_step_s']:.3g} s) against a TTFT budget of "
            f"{r['ttft_slo_s']:.3g} s (ratio {r['decode_vs_ttft']:.2f}); TBT slack = TBT SLO / step = "
            f"{r['tbt_slo_s']:.3g} / {r['decode_step_s']:.3g} = {r['tbt_slack']:.1f}. Queueing predicts: "
            f"{r['prediction']}.")
