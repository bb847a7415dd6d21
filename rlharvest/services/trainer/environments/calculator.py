"""A tool-use environment over dataset items: a question, a calculator, a checked answer.

It plays one dataset item per episode (``reset(seed, task)``: ``--data`` rows such as GSM8K's,
or the built-in task's items). The first observation is the item's question and the rules. Each
turn the model writes either a calculation or its answer:

- ``CALC <expression>``: the environment evaluates ``+ - * / ( )`` over numbers and answers
  ``= <value>`` (or says why it could not); the episode goes on;
- ``ANSWER <number>``: the episode ends with reward 1 when the number equals the item's
  reference answer (compared as numbers, so ``586`` = ``586.0``), else 0.

A turn with neither ends the episode with 0 after ``max_steps`` turns. The answer may also be
given as GSM8K's ``#### <number>``. The calculator parses with ``ast`` and evaluates only those
operators, never ``eval``: a model's text must not run code.

Why this environment: agentic RL on a dataset is a tool loop around a question with a checkable
answer (search, a sandbox, a calculator). This is the smallest such loop that needs no network,
and ``--env calculator --data gsm8k.jsonl`` exercises every part of it with a real checkpoint.
"""

from __future__ import annotations

import ast
import math
import operator
import re

from rlharvest.services.trainer.environments.interface import EnvStep
from rlharvest.services.trainer.tasks import TaskItem

RULES = ("Write CALC <expression> to compute (+ - * / and parentheses), "
         "or ANSWER <number> to answer.")
_CALC = re.compile(r"CALC\s+(.+)", re.IGNORECASE)
_ANSWER = re.compile(r"(?:ANSWER|####)\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}
_MAX_ABS = 1e15  # larger intermediate values are refused: no pathological arithmetic


class Calculator:
    def __init__(self, max_steps: int = 6) -> None:
        self.max_steps = max_steps
        self._answer: float | None = None
        self._steps = 0

    def reset(self, seed: int, task: TaskItem) -> str:
        """``seed`` does not change an item's episode: the question is the item's."""
        self._answer = _number(task.answer)
        self._steps = 0
        return f"{task.prompt}\n{RULES}\n"

    def step(self, action: str) -> EnvStep:
        self._steps += 1
        out_of_steps = self._steps >= self.max_steps
        answer = _ANSWER.search(action)
        if answer is not None:
            given = _number(answer.group(1))
            right = given is not None and self._answer is not None and \
                math.isclose(given, self._answer, rel_tol=1e-9, abs_tol=1e-9)
            return EnvStep("\n", 1.0 if right else 0.0, True)
        calc = _CALC.search(action)
        if calc is None:
            return EnvStep("\nNot understood. " + RULES + "\n", 0.0, out_of_steps)
        try:
            value = evaluate(calc.group(1).strip().splitlines()[0])
            reply = f"\n= {_format(value)}\n"
        except ValueError as exc:
            reply = f"\nCannot compute: {exc}\n"
        return EnvStep(reply, 0.0, out_of_steps)


def evaluate(expression: str) -> float:
    """``expression`` of numbers, ``+ - * /`` and parentheses; ValueError says what is wrong."""
    try:
        tree = ast.parse(expression.replace(",", ""), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        value = float(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _eval(node.operand)
        value = -inner if isinstance(node.op, ast.USub) else inner
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        value = _OPS[type(node.op)](left, right)
    else:
        raise ValueError(f"only numbers, + - * / and parentheses ({type(node).__name__})")
    if not math.isfinite(value) or abs(value) > _MAX_ABS:
        raise ValueError("the value is out of range")
    return value


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def _format(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:.6g}"
