"""The built-in verifiable rewards, and which one a dataset row gets by its ``data_source``.

Every built-in keeps the reward-function contract of ``docs/rewards.md``: ``(prompt, completion,
reference) -> float`` in [0, 1], deterministic, and a verdict with a reason raised as
``RewardFailure`` (the code reward's crashed or timed-out program), never another exception for
anything a completion contains. ``tests/unit/test_reward_contract.py`` checks each against it.
"""

from __future__ import annotations

import json
import re

from rlharvest.services.trainer.rewards.pool import (
    RewardFailure,
    RewardFn,
    caller_gave_up,
    load_reward_fn,
)
from rlharvest.services.trainer.rewards.sandbox import SandboxLimits, StdioCase, run_case
from rlharvest.services.trainer.rewards.verifier import math_reward

# The code reward's limits per test case: generous for a contest-style program, and what a
# hung candidate costs at most. Cases run one after another, so one call may take
# CODE_REWARD_WORST_S; the trainer's config refuses a code reward timeout below it.
CODE_LIMITS = SandboxLimits(wall_s=5.0, cpu_s=5.0)
MAX_CODE_CASES = 16
# Around each case's wall limit: its temporary directory, the interpreter's (and the isolating
# namespace's) start, killing and reaping the process group.
CODE_CASE_OVERHEAD_S = 0.5
CODE_REWARD_WORST_S = MAX_CODE_CASES * (CODE_LIMITS.wall_s + CODE_CASE_OVERHEAD_S)
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def exact_reward(prompt: str, completion: str, reference: str) -> float:
    """1.0 when the completion equals the reference after trimming and collapsing whitespace;
    case counts (an answer "Paris" is not "paris" in exact-match tasks, which is their point)."""
    def canon(text: str) -> str:
        return " ".join(text.split())
    return 1.0 if canon(completion) == canon(reference) and canon(reference) else 0.0


def extract_program(completion: str) -> str:
    """The last ```python fenced block, else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def parse_test_cases(reference: str) -> list[StdioCase]:
    """``{"inputs": [...], "outputs": [...]}`` (the PRIME/veRL test-case layout) as cases."""
    try:
        cases = json.loads(reference)
        inputs, outputs = cases["inputs"], cases["outputs"]
    except (ValueError, TypeError, KeyError) as exc:
        raise RewardFailure(f"the reference is not test cases {{\"inputs\": [...], "
                            f"\"outputs\": [...]}}: {exc}") from None
    if not isinstance(inputs, list) or not isinstance(outputs, list) or \
            len(inputs) != len(outputs) or not inputs:
        raise RewardFailure("the reference needs equally long, non-empty 'inputs' and "
                            "'outputs' lists")
    if len(inputs) > MAX_CODE_CASES:
        raise RewardFailure(f"{len(inputs)} test cases, above the limit of {MAX_CODE_CASES}")
    return [StdioCase(str(i), str(stdin), str(stdout))
            for i, (stdin, stdout) in enumerate(zip(inputs, outputs))]


def code_reward(prompt: str, completion: str, reference: str) -> float:
    """The fraction of test cases the completion's program passes in the sandbox. Partial credit
    rather than all-or-nothing: with few cases per problem it separates a group's samples better
    (GRPO learns nothing from a group that all scored 0)."""
    cases = parse_test_cases(reference)
    program = extract_program(completion)
    passed = 0
    for done, case in enumerate(cases):
        # Once the pool stopped waiting (its timeout), the score reaches no one; further cases
        # would only hold sandbox processes outside the pool's concurrency limit.
        if caller_gave_up():
            raise RewardFailure(f"abandoned by its caller after {done} of {len(cases)} cases")
        passed += run_case(program, case, CODE_LIMITS).passed
    return passed / len(cases)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "exact": exact_reward,
    "code": code_reward,
}

# veRL's data_source values (and common ones of its recipes) -> the built-in that verifies them.
DATA_SOURCE_REWARDS: dict[str, str] = {
    "gsm8k": "math", "openai/gsm8k": "math", "math": "math", "lighteval/math": "math",
    "digitallearninggmbh/math-lighteval": "math", "hiyouga/geometry3k": "math",
    "aime": "math", "deepscaler": "math", "math_dapo": "math",
    "codecontests": "code", "apps": "code", "taco": "code", "primeintellect": "code",
    "livecodebench": "code", "exact": "exact",
}
# Families of sources named with a prefix (numina_aops_forum, aime2024, ...).
_PREFIXES: tuple[tuple[str, str], ...] = (("numina_", "math"), ("aime", "math"),
                                          ("math", "math"), ("code", "code"))


def builtin_for_source(data_source: str) -> str | None:
    key = data_source.strip().lower()
    if key in DATA_SOURCE_REWARDS:
        return DATA_SOURCE_REWARDS[key]
    return next((name for prefix, name in _PREFIXES if key.startswith(prefix)), None)


def reward_for(data_source: str, default: str | None = None) -> RewardFn:
    """The built-in reward for rows of ``data_source`` (``default`` when none is known)."""
    name = builtin_for_source(data_source) if data_source else None
    if name is None and default is not None:
        return resolve_reward(default)
    if name is None:
        shown = repr(data_source) if data_source else "an empty data_source"
        raise ValueError(f"no built-in reward for {shown}; known sources: "
                         f"{', '.join(sorted(DATA_SOURCE_REWARDS))} (and numina_*, aime*, math*, "
                         f"code*)")
    return BUILTIN_REWARDS[name]


def resolve_reward(spec: str) -> RewardFn:
    """A built-in name (math, exact, code) or ``package.module:function``."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}: use a built-in ({', '.join(BUILTIN_REWARDS)}) "
                         "or 'package.module:function'")
    return load_reward_fn(spec)
