"""Exact-answer verifier for math-style completions: extract the final answer, normalise, compare.

Rule-based and deterministic: the same completion always earns the same reward, which keeps
GRPO's group statistics meaningful. Numbers compare by value ("0.50" == "1/2" == "\\frac{1}{2}",
"1e3" == "1,000", "$5" == "5", "50%" == "50") within a relative tolerance of ``REL_TOL``;
everything else by normalised text.

The tolerance is 1e-9, relative: tight enough that a rounded decimal is not taken for a fraction
("0.333333" != "1/3": a model that rounds has not found the exact answer GSM8K and MATH ask for),
loose enough that float formatting noise never decides ("2.0000000001" == "2").
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\boxed\s*\{")
_MARKERS = (
    re.compile(r"####\s*(.+)"),  # GSM8K
    re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*(.+)", re.IGNORECASE),
)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced (answers like \\frac{1}{2} nest)."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for pos in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth == 0:
            return text[start:pos]
    return None  # unbalanced: the completion was cut off mid-answer


def extract_answer(completion: str) -> str | None:
    """The final answer: last \\boxed{}, else the text after "####"/"answer is", else the last
    number in the completion. None when there is nothing answer-like or the box is cut off."""
    if _BOXED.search(completion):
        # The completion chose to box its answer; a cut-off box is no answer, not a fallback
        # to whatever number happens to be inside it.
        return _last_boxed(completion)
    for marker in _MARKERS:
        found = marker.findall(completion)
        if found:
            return found[-1].strip().splitlines()[0] if found[-1].strip() else None
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


REL_TOL = 1e-9


def normalize_answer(answer: str) -> str:
    """Canonical text: no TeX wrappers, units of formatting, or trailing punctuation."""
    text = _FRAC.sub(r"\1/\2", answer)
    text = re.sub(r"\\(?:text|mathrm|mbox)\s*\{([^{}]*)\}", r"\1", text)
    text = text.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("$", "")
    text = text.replace("\\%", "%")
    text = re.sub(r"\s+", "", text).strip(".").lower()
    if text.endswith("%") and _as_number(text[:-1]) is not None:
        text = text[:-1]  # "50%" answers "50": GSM8K's references drop the sign
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")  # thousands separators, not a tuple
    return text


def _as_number(text: str) -> Fraction | None:
    try:
        return Fraction(text)  # also "1e3", "-0.5", "3/4"
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str, reference: str, rel_tol: float = REL_TOL) -> bool:
    pred, ref = normalize_answer(predicted), normalize_answer(reference)
    pred_num, ref_num = _as_number(pred), _as_number(ref)
    if pred_num is not None and ref_num is not None:
        return abs(pred_num - ref_num) <= rel_tol * max(abs(ref_num), abs(pred_num))
    return pred == ref


def verify(completion: str, reference: str) -> bool:
    """Whether the completion's final answer equals ``reference``."""
    predicted = extract_answer(completion)
    return predicted is not None and answers_match(predicted, reference)


def math_reward(prompt: str, completion: str, reference: str) -> float:
    """Reward-function form (see ``pool.RewardFn``): 1.0 for a correct final answer, else 0.0."""
    return 1.0 if verify(completion, reference) else 0.0
