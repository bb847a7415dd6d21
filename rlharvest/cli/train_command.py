"""`rlharvest train`: GRPO on your own checkpoint and dataset, on the local stack.

    rlharvest train --model ./Qwen3-0.6B --data ./gsm8k.parquet --reward math --steps 50

starts etcd, a transfer agent, the rollout manager, rollout workers and the trainer as local
processes (as `rlharvest up` does), shows a progress bar per step and the per-step table of
`make run`, and writes checkpoints, TensorBoard curves, a plot and ``steps.json`` under ``--out``.
Everything a run can be refused for (the model directory, the dataset, the reward, a prompt that
cannot fit) is checked here first, in a second, before any process starts.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer
from pydantic import ValidationError
from rich.console import Console

from rlharvest.common.local_etcd import free_port
from rlharvest.cli.driver import PreemptionSchedule, Run, drive
from rlharvest.cli.report import step_table, write_report
from rlharvest.cli.launcher import LocalStack
from rlharvest.services.trainer.config import TrainerConfig

console = Console()


@dataclass(frozen=True)
class Checked:
    """What the pre-flight learnt: enough to size the workers."""

    context_tokens: int
    longest_prompt: int
    rewards: str  # e.g. "reward by data_source: gsm8k" or "reward math"


def preflight(cfg: TrainerConfig) -> Checked:
    """Everything the trainer or a worker would refuse, refused now; ValueError says what."""
    # Here, not at the top: they load torch, and every `rlharvest` command imports this module.
    from rlharvest.models.decoder_weights import decoder_config
    from rlharvest.models.model_tokenizer import load_tokenizer
    from rlharvest.services.rollout_worker.decoder_forward import check_servable
    from rlharvest.services.trainer.task_setup import build_task_setup

    config = decoder_config(cfg.model)
    context = int(config.max_position_embeddings)
    check_servable(config, context)
    setup = build_task_setup(cfg, load_tokenizer(cfg.model), context)
    rewards = (f"reward by data_source: {', '.join(sorted(setup.by_source))}"
               if setup.by_source else f"reward {cfg.reward or cfg.reward_fn}")
    return Checked(context, setup.longest_prompt, rewards)


def _start(log_dir: Path, cfg: TrainerConfig, checked: Checked, workers: int, max_running: int,
           trainer_flags: list[str]) -> Run:
    """The local stack, its services started; stopped again when one fails to start."""
    stack = LocalStack(log_dir)
    with stack.stopped_on_error():
        return _start_services(stack, cfg, checked, workers, max_running, trainer_flags)


def _start_services(stack: LocalStack, cfg: TrainerConfig, checked: Checked, workers: int,
                    max_running: int, trainer_flags: list[str]) -> Run:
    stack.start_etcd()
    common = ["--lease-ttl", "2", "--json-logs"]
    stack.start("transfer_agent", "agent", ["--agent-id", "agent-0", *common])
    manager_port = free_port()
    stack.start("rollout_manager", "manager", [
        "--manager-id", "manager-0", "--port", str(manager_port),
        "--max-new-tokens", str(cfg.max_new_tokens), *common])
    # A KV slot holds the longest prompt plus the completion, not the model's whole context:
    # a real model's 32k-40k context times max_running slots would not fit in memory.
    max_len = min(checked.context_tokens, checked.longest_prompt + cfg.max_new_tokens)
    for i in range(workers):
        stack.start("rollout_worker", f"worker-{i}", [
            "--worker-id", f"worker-{i}", "--model", cfg.model, "--job", "default",
            "--agent-pull", "--max-running", str(max_running), "--max-len", str(max_len),
            *common])
    port = free_port()
    stack.start("trainer", "trainer", ["--trainer-id", "trainer-0", "--port", str(port),
                                       "--no-exit-when-done", *trainer_flags, *common])
    return Run(stack, f"127.0.0.1:{port}", [f"127.0.0.1:{manager_port}"], None, [])


def trainer_flags(cfg: TrainerConfig) -> list[str]:
    """The trainer's command line for ``cfg`` (only what differs from its defaults)."""
    flags: list[str] = []
    defaults = TrainerConfig.model_validate({})
    for name in ("model", "data", "data_fields", "reward", "reward_fn", "steps",
                 "prompts_per_step", "samples_per_prompt", "micro_batch_groups", "max_new_tokens",
                 "temperature", "lr", "backend", "checkpoint_dir", "checkpoint_every",
                 "tensorboard_dir", "wandb_project", "data_seed", "max_prompt_tokens",
                 "torch_threads"):
        value = getattr(cfg, name)
        if value != getattr(defaults, name):
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


app = typer.Typer(add_completion=False, help=__doc__)


@app.command()
def train(model: str = typer.Option(..., help="a local HF checkpoint directory (or a preset)"),
          data: Path = typer.Option(..., help="a JSONL or Parquet dataset (veRL layout)"),
          reward: str = typer.Option("", help="math, exact, code or package.module:function; "
                                              "empty = by each row's data_source"),
          data_fields: str = typer.Option("", help="field mapping for another layout, e.g. "
                                                   "'prompt=question,ground_truth=answer'"),
          data_seed: int = typer.Option(0, help="seed of the per-epoch shuffle"),
          steps: int = typer.Option(10, min=1, help="RL steps to train"),
          workers: int = typer.Option(2, min=1, help="rollout workers"),
          prompts: int = typer.Option(8, min=1, help="P0: prompts per step"),
          samples: int = typer.Option(8, min=2, help="R0: samples per prompt"),
          micro_batch_groups: int = typer.Option(2, min=1, help="m_b: groups per micro-batch"),
          max_new_tokens: int = typer.Option(256, min=1, help="completion length limit"),
          temperature: float = typer.Option(1.0, min=0.0),
          lr: float = typer.Option(1e-6, help="learning rate"),
          max_running: int = typer.Option(16, min=1, help="requests a worker runs at once"),
          backend: str = typer.Option("deepspeed", help="trainer backend: deepspeed or torch"),
          checkpoint_every: int = typer.Option(5, min=1),
          out: Path = typer.Option(Path("train-out"), help="checkpoints, curves, plot, steps"),
          tensorboard_dir: Optional[Path] = typer.Option(None, help="default: OUT/tensorboard"),
          wandb_project: str = typer.Option("", help="also log to this W&B project"),
          log_dir: Optional[Path] = typer.Option(None, help="service logs (default: a temp dir)"),
          timeout: float = typer.Option(0.0, min=0.0, help="give up after this many seconds; "
                                                           "0 = never")) -> None:
    """Train MODEL on DATA with GRPO; Ctrl-C stops the stack cleanly."""
    try:
        cfg = TrainerConfig.model_validate(dict(
            model=model, data=str(data), reward=reward, data_fields=data_fields,
            data_seed=data_seed, steps=steps,
            prompts_per_step=prompts, samples_per_prompt=samples,
            micro_batch_groups=micro_batch_groups, max_new_tokens=max_new_tokens,
            temperature=temperature, lr=lr, backend=backend,
            checkpoint_dir=str(out / "checkpoints"), checkpoint_every=checkpoint_every,
            tensorboard_dir=str(tensorboard_dir or out / "tensorboard"),
            wandb_project=wandb_project))
        checked = preflight(cfg)
    except (ValidationError, ValueError, OSError) as exc:
        console.print(f"[bold red]cannot train[/]: {exc}")
        raise typer.Exit(2) from None
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="rlharvest-train-"))
    console.print(f"[bold]rlharvest train[/]: {model} on {data} ({checked.rewards}; longest prompt "
                  f"{checked.longest_prompt} tokens); {steps} steps of {prompts}x{samples}, "
                  f"{workers} workers; logs in {log_dir}")
    started = time.monotonic()
    try:
        run = _start(log_dir, cfg, checked, workers, max_running, trainer_flags(cfg))
    except (TimeoutError, RuntimeError) as exc:  # a service never came up: stopped already
        console.print(f"[bold red]cannot train[/]: {exc}; logs in {log_dir}")
        raise typer.Exit(1) from None
    try:
        status = asyncio.run(drive(run, PreemptionSchedule((), 1), steps, timeout or float("inf")))
    except (TimeoutError, RuntimeError) as exc:
        console.print(f"[bold red]training stopped[/]: {exc}")
        raise typer.Exit(1) from None
    finally:
        run.stack.stop()
    if status.state == "failed":
        console.print(f"[bold red]training failed[/]: {status.error}; logs in {log_dir}")
        raise typer.Exit(1)
    title = f"GRPO: {Path(model).name} on {data.name}"
    console.print(step_table(status, run.events, title=title))
    report = write_report(status, run.events, out, "train.png", title)
    console.print(f"done in {time.monotonic() - started:.0f}s: checkpoints in {out / 'checkpoints'}"
                  f", curves in {cfg.tensorboard_dir}, {report}")
