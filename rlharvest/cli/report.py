"""What a run shows when it ends: did the reward rise (pure), the table of its steps, and the
report files (``steps.json`` and a plot)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from rich.table import Table

from rlharvest.common.pb import trainer_pb2 as tpb
from rlharvest.cli.demo_serving import StepServing

RISE_WINDOW = 3  # steps averaged at each end: one step's reward is too noisy to compare


# ---- did it learn? (pure) ---------------------------------------------------------------------

def reward_ends(rewards: list[float], window: int = RISE_WINDOW) -> tuple[float, float, int]:
    """Mean reward of the first and of the last ``k`` steps, ``k`` = min(window, half the run),
    so the two ends never share a step; returns (first, last, k)."""
    k = min(window, len(rewards) // 2)
    if k < 1:
        raise ValueError(f"need at least 2 steps to compare, got {len(rewards)}")
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k, k


def rise_failure(rewards: list[float], min_rise: float,
                 window: int = RISE_WINDOW) -> str | None:
    """Why the run does not show learning, or None when the reward rose by ``min_rise``."""
    if len(rewards) < 2:
        return f"only {len(rewards)} step(s) finished: too few to tell whether reward rose"
    first, last, k = reward_ends(rewards, window)
    if last - first >= min_rise:
        return None
    return (f"reward did not rise: mean of the last {k} steps {last:.3f} vs the first {k} "
            f"{first:.3f} (needed +{min_rise:g}); try more --steps or a higher --lr")


# ---- the report -------------------------------------------------------------------------------

def step_table(status: tpb.TrainerStatus, events: dict[int, list[str]],
               title: str = "rlharvest demo: one GRPO step per row",
               serving: dict[int, StepServing] | None = None) -> Table:
    """One row per step; with ``serving``, the co-executor's columns: SLO attainment of the
    serving requests finished in the step (of how many) and rollout tokens harvested there."""
    table = Table(title=title)
    columns = ["step", "version", "reward", "time s", "tokens/s", "micro", "migr", "N_prem",
               "T_seed", "Δ changed"]
    if serving is not None:
        columns += ["serving SLO", "harvested"]
    tail = any(s.round for s in status.steps)
    if tail:
        columns += ["round", "deferred", "discarded"]
    for column in [*columns, "events"]:
        table.add_column(column, justify="right" if column != "events" else "left")
    for s in status.steps:
        row = [str(s.step), str(s.weight_version), f"{s.mean_reward:.3f}", f"{s.step_time_s:.2f}",
               f"{s.tokens_per_second:.0f}", str(s.micro_batches), str(s.migrations),
               str(s.n_prem or "-"), f"{s.t_seed_s:.1f}",
               f"{s.published_changed:.1%}" if s.published_version else "-"]
        if serving is not None:
            served = serving.get(s.step)
            row += ["-" if served is None or served.attainment is None
                    else f"{served.attainment:.0%} of {served.requests}",
                    "-" if served is None else str(served.harvested_tokens)]
        if tail:
            row += [f"{s.round} {s.prompts_launched}", str(s.prompts_deferred),
                    str(s.tokens_discarded)]
        table.add_row(*row, "; ".join(events.get(s.step, [])))
    return table


def plot_run(status: tpb.TrainerStatus, events: dict[int, list[str]], path: Path,
             title: str = "GRPO on the addition task (tiny Qwen3, CPU)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s.step for s in status.steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [s.mean_reward for s in status.steps], marker="o")
    top.set_ylabel("mean reward")
    top.set_title(title)
    bottom.bar(steps, [s.tokens_per_second for s in status.steps], color="tab:green")
    bottom.set_ylabel("tokens trained / s")
    bottom.set_xlabel("step")
    for step, texts in events.items():
        if any("SIGKILL" in t for t in texts):
            for ax in (top, bottom):
                ax.axvline(step, color="tab:red", linestyle="--", linewidth=1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(status: tpb.TrainerStatus, events: dict[int, list[str]], out: Path,
                 plot_name: str, title: str | None = None,
                 serving: dict[int, StepServing] | None = None) -> str:
    """``steps.json`` (one object per step) and the plot under ``out``; says where they are.
    The plot needs matplotlib (the ``dev`` extra): a plain install writes the steps alone."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for s in status.steps:
        row = {"step": s.step, "weight_version": s.weight_version, "reward": s.mean_reward,
               "step_time_s": s.step_time_s, "tokens_per_second": s.tokens_per_second,
               "migrations": s.migrations, "n_prem": s.n_prem, "t_seed_s": s.t_seed_s,
               "events": events.get(s.step, [])}
        if s.round:
            row.update(round=s.round, prompts_launched=s.prompts_launched,
                       prompts_deferred=s.prompts_deferred, tokens_discarded=s.tokens_discarded)
        if serving is not None and (served := serving.get(s.step)) is not None:
            row.update(serving_requests=served.requests, serving_attained=served.attained,
                       harvested_tokens=served.harvested_tokens)
        rows.append(row)
    (out / "steps.json").write_text(json.dumps(rows, indent=1))
    if importlib.util.find_spec("matplotlib") is None:
        return f"steps in {out / 'steps.json'} (no plot: matplotlib is not installed)"
    plot_run(status, events, out / plot_name, *([title] if title else []))
    return f"plot {out / plot_name}, steps in {out / 'steps.json'}"
