"""The real-model path end to end: HF-format checkpoints built locally (a byte-level BPE tokenizer,
a chat template, safetensors weights), a GSM8K-style dataset file, the math verifier, and the
whole stack as processes. Exactly the path a user's own Qwen3 or Llama checkpoint takes."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlharvest.models.hf_checkpoint import build_checkpoint
from rlharvest.models.model_tokenizer import load_tokenizer
from rlharvest.cli import main as cli
from rlharvest.services.trainer import checkpoint, gsm8k
from rlharvest.services.trainer.datasets import FileTask, load_rows
from rlharvest.services.trainer.rewards.verifier import math_reward

from .test_trainer import (
    manager_status,
    metric,
    preempt_once_it_holds_requests,
    scrape,
    start_job,
    start_trainer,
    wait_trainer,
    worker_versions,
)

pytestmark = pytest.mark.integration
STEPS = 3
NEW_TOKENS = 12
SAMPLE = re.compile(r'sample of step (\d+): reward ([-\d.]+) for completion (".*") '
                    r'\(reference (".*")\)$')


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen3 and a tiny Llama checkpoint, and a GSM8K-style JSONL in the veRL layout."""
    root = tmp_path_factory.mktemp("real")
    made = {family: build_checkpoint(root / family, family=family, size="tiny", seed=3)
            for family in ("qwen3", "llama")}
    data = root / "gsm8k.jsonl"
    gsm8k.write(data, gsm8k.generate(64, seed=5))
    return {**made, "data": data}


def samples_logged(log: str) -> list[tuple[int, float, str, str]]:
    found = []
    for line in log.splitlines():
        match = SAMPLE.search(json.loads(line)["msg"]) if line.startswith("{") else None
        if match:
            step, reward, completion, reference = match.groups()
            found.append((int(step), float(reward), json.loads(completion), json.loads(reference)))
    return found


@pytest.mark.parametrize("family", ["qwen3", "llama"])
async def test_grpo_runs_on_a_local_hf_checkpoint_and_dataset_and_a_sigkill_loses_no_token(
        stack, etcd_client, artefacts, family):
    model = str(artefacts[family])
    flags = ("--model", model, "--max-len", "256", "--max-running", "8", "--step-delay-s", "0.05")
    # The spot worker is slow, so it certainly holds requests when it is SIGKILLed.
    spot = ("--model", model, "--max-len", "256", "--max-running", "8", "--step-delay-s", "1")
    manager = await start_job(stack, 2, *flags, spot=True, spot_flags=spot)
    preempted = asyncio.create_task(
        preempt_once_it_holds_requests(stack, manager, "w1", "w2", *flags))
    try:
        trainer, metrics_port = await start_trainer(
            stack, "trainer", "--model", model, "--data", str(artefacts["data"]),
            "--steps", str(STEPS), "--prompts-per-step", "4", "--samples-per-prompt", "4",
            "--max-new-tokens", str(NEW_TOKENS), "--lr", "1e-3", "--backend", "torch")
        st = await wait_trainer(trainer, lambda s: s.state == "done")
        assert preempted.done(), "the spot worker never held a request"
    finally:
        preempted.cancel()
    assert [s.step for s in st.steps] == list(range(1, STEPS + 1))
    for s in st.steps:
        assert s.weight_version == s.step - 1 and s.published_version == s.step, s
        assert s.tokens > 0 and 0.0 <= s.mean_reward <= 1.0, s
        assert 0 < s.train_compute_s < s.step_time_s, s  # Algorithm 1's t_train
    # The kill moved requests with their tokens: nothing regenerated, no step retried.
    assert metric(scrape(manager.metrics_port), 'rlh_manager_migrations_total{cause="lost"}') > 0
    assert (await manager_status(manager.endpoint)).tokens_regenerated == 0
    assert metric(scrape(metrics_port), 'rlh_trainer_steps_total{outcome="retried"}') == 0
    # Completions were decoded by the checkpoint's tokenizer (no special tokens left in) and
    # scored by the math verifier, as the dataset's data_source "gsm8k" selects.
    tokenizer = load_tokenizer(model)
    specials = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")
    logged = samples_logged(trainer.process.log_tail(2000))
    assert [step for step, *_ in logged] == list(range(1, STEPS + 1))
    for _, reward, completion, reference in logged:
        assert reward == pytest.approx(math_reward("", completion, reference))
        assert not any(s in completion for s in specials), completion
        assert tokenizer.decode(tokenizer.encode(completion)) == completion
    # Every worker, the replacement included, pulled the last published version.
    deadline = time.monotonic() + 60
    while set((await worker_versions(etcd_client)).values()) != {st.weight_version}:
        assert time.monotonic() < deadline, await worker_versions(etcd_client)
        await asyncio.sleep(0.2)
    assert st.weight_version == STEPS


def test_train_command_runs_a_users_checkpoint_and_dataset_and_writes_its_report(
        artefacts, tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "rlharvest.cli.main", "train", "--model",
         str(artefacts["qwen3"]), "--data", str(artefacts["data"]), "--steps", "2",
         "--workers", "1", "--prompts", "2", "--samples", "2", "--micro-batch-groups", "1",
         "--max-new-tokens", "8", "--backend", "torch", "--checkpoint-every", "1",
         "--out", str(out), "--log-dir", str(tmp_path / "logs"), "--timeout", "240"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "one GRPO step per row" not in result.stdout  # its own title, not the demo's
    steps = json.loads((out / "steps.json").read_text())
    assert [s["step"] for s in steps] == [1, 2]
    assert (out / "train.png").stat().st_size > 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def gpt2_directory(tmp_path) -> str:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    return str(tmp_path / "gpt2")


@pytest.mark.parametrize("change, expected", [
    (lambda a, t: ["--model", str(t / "nowhere")], "nowhere"),
    (lambda a, t: ["--model", gpt2_directory(t)], "got model_type 'gpt2'"),
    (lambda a, t: ["--data", str(t / "missing.jsonl")], "missing.jsonl"),
    (lambda a, t: ["--reward", "no_such_reward"], "no_such_reward"),
])
def test_train_command_refuses_an_unusable_model_dataset_or_reward_before_starting(
        artefacts, tmp_path, change, expected):
    args = {"--model": str(artefacts["qwen3"]), "--data": str(artefacts["data"])}
    overrides = change(artefacts, tmp_path)
    args[overrides[0]] = overrides[1]
    # In process: the refusal comes from the preflight, before any process would start (a
    # subprocess here only paid torch's import four times over).
    result = CliRunner().invoke(cli.app, ["train", *[part for pair in args.items()
                                                     for part in pair]])
    assert result.exit_code == 2, result.output
    said = "".join(result.output.split("\n"))  # rich wraps long lines at the terminal width
    assert said.startswith("cannot train") and expected in said, result.output


async def test_a_sigkilled_trainer_resumes_a_dataset_run_at_its_saved_data_position(
        stack, etcd_client, artefacts, tmp_path):
    model, data, ckpt = str(artefacts["qwen3"]), str(artefacts["data"]), tmp_path / "ckpt"
    await start_job(stack, 1, "--model", model, "--max-len", "256", "--max-running", "8")
    flags = ["--model", model, "--data", data, "--data-seed", "11", "--prompts-per-step", "2",
             "--samples-per-prompt", "2", "--micro-batch-groups", "1", "--max-new-tokens", "4",
             "--backend", "torch", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    first, _ = await start_trainer(stack, "trainer", "--steps", "0", *flags)
    await wait_trainer(first, lambda s: s.steps_done >= 2)
    first.process.kill()  # SIGKILL: the newest complete checkpoint is where it resumes
    saved = int(checkpoint.list_checkpoints(ckpt)[-1].name.rsplit("-", 1)[-1])
    again, _ = await start_trainer(stack, "trainer-again", "--steps", str(saved + 2), *flags)
    st = await wait_trainer(again, lambda s: s.state == "done")
    assert st.resumed_from_step == saved
    # Each step's logged sample is its first prompt: item (step - 1) * 2 of the shuffled data.
    task = FileTask(load_rows(data), seed=11)
    before = {s: ref for s, _, _, ref in samples_logged(first.process.log_tail(3000))}
    after = {s: ref for s, _, _, ref in samples_logged(again.process.log_tail(3000))}
    assert sorted(after) == [saved + 1, saved + 2]
    for step, reference in {**before, **after}.items():
        assert reference == task.item((step - 1) * 2).answer, step


async def test_agentic_steps_play_dataset_items_through_a_checkpoints_tokenizer(
        stack, etcd_client, artefacts):
    """--env calculator --data: each GSM8K row is an episode of the tool loop (CALC / ANSWER),
    played turn by turn on a local Qwen3 checkpoint through the manager; every text the
    environment writes is encoded by the checkpoint's own tokenizer, and turns stop at its
    EOS ids. Steps apply and publish as text steps do."""
    model = str(artefacts["qwen3"])
    await start_job(stack, 1, "--model", model, "--max-len", "384", "--max-running", "16")
    trainer, metrics_port = await start_trainer(
        stack, "trainer", "--model", model, "--data", str(artefacts["data"]),
        "--env", "calculator", "--env-max-turns", "2", "--env-context", "384", "--steps", "2",
        "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "8",
        "--backend", "torch")
    st = await wait_trainer(trainer, lambda s: s.state == "done")
    assert [s.step for s in st.steps] == [1, 2]
    for s in st.steps:
        assert s.published_version == s.step and s.tokens > 0, s
    text = scrape(metrics_port)
    assert metric(text, 'rlh_trainer_trajectories_total{outcome="played"}') == 8
    assert metric(text, 'rlh_trainer_trajectories_total{outcome="failed"}') == 0


async def test_the_runner_encodes_observations_with_the_models_tokenizer(artefacts):
    from rlharvest.services.trainer.environments.calculator import Calculator
    from rlharvest.services.trainer.tasks import TaskItem
    from rlharvest.services.trainer.environments.runner import PlayConfig, play

    tok = load_tokenizer(str(artefacts["qwen3"]))
    task = TaskItem(0, "What is 12 * 7?", "84")
    histories: list[list[int]] = []
    action = tok.encode_plain("CALC 12 * 7")

    async def generate(trajectory_id: str, turn: int, history: list[int], seed: int):
        histories.append(list(history))
        return action, [-0.5] * len(action)

    cfg = PlayConfig(max_turns=2, max_new_tokens=8, context=384)
    out = await play(generate, Calculator(), "t", 0, cfg, tok, task)
    first = Calculator().reset(0, task)
    assert histories[0] == tok.encode(first) == out.prompt_ids
    assert histories[1] == tok.encode(first) + action + tok.encode_plain("\n= 84\n")
    reply = [False] * len(tok.encode_plain("\n= 84\n"))
    assert out.trained == ([True] * len(action) + reply) * 2  # observations never train
