"""The built-in verifiers on tricky answers, and which built-in a row's data_source selects."""

from __future__ import annotations

import pytest

from rlharvest.services.trainer.rewards.builtin import (
    BUILTIN_REWARDS,
    code_reward,
    exact_reward,
    extract_program,
    resolve_reward,
    reward_for,
)
from rlharvest.services.trainer.rewards.pool import RewardFailure
from rlharvest.services.trainer.rewards.verifier import math_reward


@pytest.mark.parametrize("completion, reference, reward", [
    ("... so she pays 1234 dollars.\n#### 1,234", "1234", 1.0),  # thousands separator
    ("#### 1234", "1,234", 1.0),
    ("#### $5", "5", 1.0),  # a unit of formatting
    ("The change is #### -3", "-3", 1.0),  # negatives
    ("#### 3", "-3", 0.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # fractions by value
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\boxed{0.333333}", "1/3", 0.0),  # a rounded decimal is not the exact answer
    ("\\boxed{2.0}", "2", 1.0),
    ("#### 1e3", "1000", 1.0),  # scientific notation
    ("#### 50%", "50", 1.0),  # percent
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{\\frac{2}{3}", "2/3", 0.0),  # cut off mid-box: no answer
    ("\\boxed{1} first, then \\boxed{7}", "7", 1.0),  # the last answer counts
    ("#### 4\n...\n#### 9", "9", 1.0),
    ("I do not know.", "7", 0.0),  # missing answer: 0, no exception
    ("", "7", 0.0),
    ("#### 1, 2, 3", "1,2,3", 1.0),  # a list, not a thousands separator
    ("#### 1,2", "12", 0.0),
    ("the answer is \\text{Paris}.", "paris", 1.0),
])
def test_math_verifier_table(completion, reference, reward):
    assert math_reward("", completion, reference) == reward


@pytest.mark.parametrize("completion, reference, reward", [
    ("  Paris \n", "Paris", 1.0),
    ("New   York", "New York", 1.0),
    ("paris", "Paris", 0.0),  # case counts
    ("Paris.", "Paris", 0.0),
    ("", "", 0.0),  # an empty reference matches nothing
])
def test_exact_match_table(completion, reference, reward):
    assert exact_reward("", completion, reference) == reward


@pytest.mark.parametrize("source, name", [
    ("openai/gsm8k", "math"), ("gsm8k", "math"), ("lighteval/MATH", "math"),
    ("numina_aops_forum", "math"), ("aime2024", "math"), ("codecontests", "code"),
    ("taco", "code"), ("code_alpaca_tests", "code"),
])
def test_data_sources_select_their_built_in(source, name):
    assert reward_for(source) is BUILTIN_REWARDS[name]


def test_an_unknown_data_source_is_refused_unless_there_is_a_default():
    with pytest.raises(ValueError, match="no built-in reward for 'my_quiz'; known sources"):
        reward_for("my_quiz")
    with pytest.raises(ValueError, match="an empty data_source"):
        reward_for("")
    assert reward_for("my_quiz", default="exact") is exact_reward


def test_rewards_resolve_by_name_or_import_path():
    assert resolve_reward("math") is math_reward
    assert resolve_reward("rlharvest.services.trainer.rewards.verifier:math_reward") is math_reward
    with pytest.raises(ValueError, match="unknown reward 'maths'"):
        resolve_reward("maths")


CASES = '{"inputs": ["1 2\\n", "5 7\\n"], "outputs": ["3\\n", "12\\n"]}'


def test_code_reward_is_the_fraction_of_cases_passed_in_the_sandbox():
    right = "```python\nprint(sum(map(int, input().split())))\n```"
    half = "print(3)"
    assert code_reward("", right, CASES) == 1.0
    assert code_reward("", half, CASES) == 0.5
    assert extract_program("text\n```python\nprint(1)\n```\nmore") == "print(1)\n"


@pytest.mark.parametrize("reference, message", [
    ("not json", "not test cases"),
    ('{"inputs": ["1"], "outputs": []}', "equally long"),
])
def test_code_reward_refuses_malformed_test_cases_with_the_reason(reference, message):
    with pytest.raises(RewardFailure, match=message):
        code_reward("", "print(1)", reference)
