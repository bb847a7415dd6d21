"""Dual-SLO admission on a simulated serving device (ROSE Fig. 9 and App. D analogues).

The co-executor's real scheduler and admission (``rlharvest/services/coexecutor/``) driven by
``rlharvest/sim/coexec.py`` with a virtual clock and exact profiles, on a synthetic bursty serving trace
(``rlharvest/sim/serving_trace.py``: diurnal peak 1.7x the mean, Gamma inter-arrivals CV 2, lognormal
lengths), while a rollout job always has decode steps to run. The SLOs are set the paper's way:
1.6x serving alone's P99 TTFT and TPOT at density 1. For each policy, in one run on the same
trace: serving P99 TTFT and TPOT, SLO attainment, and the rollout harvested (rollout busy time
as a share of what a dedicated device runs in the same time). Harvest and the serving busy share
are taken over the traffic window [0, --seconds], the same span for every row. Prints one table
and writes it to ``results/coexec_admission.md`` (``coexec_admission_quick.md`` with --quick).

This is a simulation, not a measurement of processes: it shows what the policies decide, with
profiles that are exact by construction. ``--seeds`` repeats over traces: medians [spread].

    python bench/coexec_admission.py [--quick] [--seconds 120] [--rps 2] [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.services.coexecutor.admission import (  # noqa: E402
    AdmissionPolicy,
    DualSloAdmission,
    SlackMode,
    SloConfig,
)
from rlharvest.services.coexecutor.latency_profile import LatencyProfile  # noqa: E402
from rlharvest.cli.loadgen import quantile  # noqa: E402
from rlharvest.sim.coexec import CoexecResult, simulate  # noqa: E402
from rlharvest.sim.serving_trace import TraceRequest, synthetic  # noqa: E402
from results_file import results_path  # noqa: E402


# A device where a 256-token prefill takes ~53 ms and a decode step 8.5 ms + 0.5 ms per sequence.
PROFILE = LatencyProfile.linear(prefill_base_s=0.002, prefill_per_token_s=2e-4,
                                decode_base_s=0.008, decode_per_seq_s=5e-4)
ROLLOUT_STEP_S = PROFILE.decode_s(16)  # one decode step of a 16-request rollout batch
# (label, policy, slack mode, margin as a share of each budget). Without a margin rollout
# stretches every decode gap to B_TPOT, so any request arriving meanwhile pushes a gap over it.
MARGIN = 0.3
VARIANTS = [(f"dual, queue-aware, margin {MARGIN:.0%}", AdmissionPolicy.DUAL,
             SlackMode.QUEUE_AWARE, MARGIN),
            ("dual, queue-aware, no margin", AdmissionPolicy.DUAL, SlackMode.QUEUE_AWARE, 0.0),
            ("dual, paper Eq. 1-2, no margin", AdmissionPolicy.DUAL, SlackMode.PAPER, 0.0),
            (f"ttft_only, margin {MARGIN:.0%}", AdmissionPolicy.TTFT_ONLY,
             SlackMode.QUEUE_AWARE, MARGIN),
            (f"tpot_only, margin {MARGIN:.0%}", AdmissionPolicy.TPOT_ONLY,
             SlackMode.QUEUE_AWARE, MARGIN),
            ("always", AdmissionPolicy.ALWAYS, SlackMode.QUEUE_AWARE, 0.0)]


def run(requests: list[TraceRequest], slo: SloConfig, policy: AdmissionPolicy,
        mode: SlackMode, rollout: bool, until: float, window: float) -> CoexecResult:
    admission = DualSloAdmission(slo, PROFILE, policy, mode)
    return simulate(requests, admission, rollout_cost_s=ROLLOUT_STEP_S if rollout else None,
                    until_s=until, window_s=window)


def shares(result: CoexecResult) -> tuple[float, float]:
    """(harvest, serving busy share) over the traffic window, not over the run's end_s."""
    assert result.window_s is not None
    return (result.rollout_busy_in_window_s / result.window_s,
            result.serving_busy_in_window_s / result.window_s)


def tails(result: CoexecResult) -> tuple[float, float]:
    served = [rid for rid, r in result.served.items() if r.ttft_s == r.ttft_s]
    return (quantile([result.served[rid].ttft_s for rid in served], 0.99),
            quantile([result.tpot_s(rid) for rid in served], 0.99))


def one_seed(seed: int, args: argparse.Namespace) -> dict[str, tuple[float, ...]]:
    def trace(density: float) -> list[TraceRequest]:
        return synthetic(args.seconds, args.rps, seed=seed, density=density, max_tokens=1024)

    until = args.seconds + 30  # let the last requests finish: their TTFT and TPOT count
    # Harvest and the serving busy share are taken over [0, seconds], the window the arrivals
    # fall in, for every row alike. The 30 s after it exist only to finish the last requests:
    # there rollout has the device to itself (no slack to harvest, just an idle device), and
    # each run's end_s differs (serving alone stops when its last request is done), so dividing
    # by end_s counted that tail as harvest and gave each row another denominator. [0, last
    # arrival + its completion] would differ per run too. Work done after the window (the last
    # requests' tails, a few seconds) is left out of both shares alike.
    window = args.seconds
    calm = SloConfig(1e9, 1e9)  # serving alone never waits on rollout: any SLO
    alone = run(trace(1.0), calm, AdmissionPolicy.DUAL, SlackMode.QUEUE_AWARE, False, until,
                window)
    ttft99, tpot99 = tails(alone)
    slo = SloConfig(1.6 * ttft99, 1.6 * tpot99)
    rows = {"serving alone": (ttft99, tpot99, alone.attained(slo.ttft_s, slo.tpot_s),
                              *shares(alone))}
    for density in (1.5, 2.0):  # what the denser traffic costs serving without any rollout
        dense = run(trace(density), calm, AdmissionPolicy.DUAL, SlackMode.QUEUE_AWARE, False,
                    until, window)
        rows[f"serving alone at density {density}"] = (
            *tails(dense), dense.attained(slo.ttft_s, slo.tpot_s), *shares(dense))
    for i, (name, policy, mode, margin) in enumerate(VARIANTS):
        slo_m = SloConfig(slo.ttft_s, slo.tpot_s, margin)
        for density in ((1.0, 1.5, 2.0) if i == 0 else (1.0,)):
            result = run(trace(density), slo_m, policy, mode, True, until, window)
            label = name if density == 1.0 else f"{name} at density {density}"
            rows[label] = (*tails(result), result.attained(slo.ttft_s, slo.tpot_s),
                           *shares(result))
    rows["_slo"] = (slo.ttft_s, slo.tpot_s)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--rps", type=float, default=2.0)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.seeds = 30.0, 1
    started = time.perf_counter()
    runs = [one_seed(seed, args) for seed in range(args.seeds)]
    slo = runs[0]["_slo"]
    lines = [f"synthetic trace: {args.seconds:.0f} s at {args.rps} req/s (density 1), "
             f"{args.seeds} seed(s); SLOs of seed 0 = 1.6x serving-alone P99: TTFT "
             f"{1000 * slo[0]:.0f} ms, TPOT {1000 * slo[1]:.1f} ms; rollout step "
             f"{1000 * ROLLOUT_STEP_S:.1f} ms",
             f"{'variant':46s} {'P99 TTFT':>9s} {'P99 TPOT':>9s} {'attained':>9s} "
             f"{'serving':>8s} {'harvest [spread]':>18s}"]
    for label in [k for k in runs[0] if not k.startswith("_")]:
        cols = list(zip(*(r[label] for r in runs)))
        med = [statistics.median(c) for c in cols]
        spread = f"[{min(cols[3]):.0%}-{max(cols[3]):.0%}]" if args.seeds > 1 else ""
        lines.append(f"{label:46s} {1000 * med[0]:7.0f}ms {1000 * med[1]:7.1f}ms "
                     f"{med[2]:9.1%} {med[4]:8.0%} {med[3]:8.0%} {spread}")
    lines.append(f"harvest: rollout busy time in [0, {args.seconds:.0f} s] (the traffic "
                 "window) / the window, i.e. what a dedicated device runs in the same time; "
                 "serving: the device's serving busy share of the same window")
    print("\n".join(lines))
    # --quick (what `make bench` runs) must not overwrite the full results the README cites.
    out = results_path("coexec_admission", args.quick)
    command = " ".join(["python bench/coexec_admission.py", *sys.argv[1:]])
    out.write_text(f"# Dual-SLO admission, simulated\n\n`{command}`, "
                   f"{time.strftime('%Y-%m-%d')}; simulated time, wall "
                   f"{time.perf_counter() - started:.0f} s\n\n```\n" + "\n".join(lines)
                   + "\n```\n")


if __name__ == "__main__":
    main()
