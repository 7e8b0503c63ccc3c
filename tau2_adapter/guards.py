"""Bounds on τ²-Bench tools whose arguments can make them compute for hours.

τ²-Bench's retail and airline toolkits have a ``calculate(expression)`` tool that checks the
expression's characters (digits, ``+ - * / ( ) .`` and spaces) and then ``eval``s it. ``**`` passes
that check, so one tool call such as ``calculate("9**9**9")`` (a 370-million-digit integer) keeps
the process computing a big-integer power for many minutes while holding Python's GIL: every
other session of the env server stalls with it (measured: ``9**10**7`` held a
``get_users`` step of another session for 5.7 s), and so does the reward service, which replays
the trajectory's tool calls when it scores it. A policy exploring during RL can write that.

`install()` wraps those tools once per process, in the env service (`env_service.catalog`) and the
reward service (`reward_service.scoring`) alike, so that both give the same answer to the same
call (the reward's replay compares tool answers with the trajectory's): an expression whose
integer values could exceed `MAX_INT_BITS` bits anywhere (an upper bound computed from the
expression's syntax tree, without evaluating it) raises ``ValueError`` at once, which τ²-Bench
turns into the tool's error message, as it does for any bad expression. Any other expression goes
to τ²-Bench's own ``calculate`` unchanged, as does the tool's schema (name, docstring, signature).
"""

from __future__ import annotations

import ast
import functools
import math
import threading

#: The most bits an integer inside a ``calculate`` expression may reach (an upper bound from
#: the syntax tree). 2**1e5 is ~30,000 decimal digits, ~1e30103: far beyond a float (the tool
#: returns ``float(...)``, whose largest value is ~1.8e308), and each such operation takes
#: well under a millisecond.
MAX_INT_BITS = 100_000

#: τ²-Bench's toolkits with ``calculate`` (module, class).
CALCULATE_TOOLKITS = (("tau2.domains.retail.tools", "RetailTools"), ("tau2.domains.airline.tools", "AirlineTools"))

_installed = False
_lock = threading.Lock()


def _bits(node: ast.AST) -> float | None:
    """An upper bound of log2 |value| of `node`'s value when it is an integer; None when it is a
    float (float arithmetic takes constant time whatever the numbers: no bound needed)."""
    if isinstance(node, ast.Expression):
        return _bits(node.body)
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, int) and not isinstance(v, bool):
            return float(abs(v).bit_length())
        return None
    if isinstance(node, ast.UnaryOp):
        return _bits(node.operand)
    if isinstance(node, ast.BinOp):
        a, b = _bits(node.left), _bits(node.right)
        if a is None or b is None or isinstance(node.op, ast.Div):
            return None  # a float operand, or true division: a float
        if isinstance(node.op, (ast.Add, ast.Sub)):
            out = max(a, b) + 1
        elif isinstance(node.op, ast.Mult):
            out = a + b
        elif isinstance(node.op, ast.Pow):
            e = _constant_int(node.right)
            out = max(a, 1.0) * (abs(e) if e is not None else 2.0 ** min(b, 1100.0))  # |exponent| <= 2**b
        else:  # //, and what else the character check lets through
            out = a
        if out > MAX_INT_BITS:
            raise ValueError(f"the expression's numbers would grow past {MAX_INT_BITS} bits (about "
                             f"{int(MAX_INT_BITS * math.log10(2))} digits) at {ast.unparse(node)[:80]!r}: give a smaller "
                             "expression (calculate takes +, -, *, / on ordinary numbers)")
        return out
    return None  # anything else: τ²-Bench's eval refuses it


def _constant_int(node: ast.AST) -> int | None:
    """`node`'s value when it is an integer literal, with its sign (``-3``), else None."""
    sign = 1
    while isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        sign, node = (-sign if isinstance(node.op, ast.USub) else sign), node.operand
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return sign * node.value
    return None


def check_expression(expression: str) -> None:
    """Raises ValueError when ``calculate(expression)`` could build an integer of more than
    `MAX_INT_BITS` bits. An expression that does not parse is left to τ²-Bench's own checks."""
    if not isinstance(expression, str) or "*" not in expression:
        return  # no product or power: sums of the expression's own numbers stay small
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return  # τ²-Bench's eval raises its own error for it
    try:
        _bits(tree)
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None


def _guard(calculate):
    @functools.wraps(calculate)  # same name, docstring, signature and is_tool marks: the same tool schema
    def guarded(self, expression: str) -> str:
        check_expression(expression)
        return calculate(self, expression)

    guarded.__sinkflex_guarded__ = True
    return guarded


def install() -> None:
    """Wraps τ²-Bench's ``calculate`` tools (`CALCULATE_TOOLKITS`) with `check_expression`, once per
    process; idempotent and thread-safe. A toolkit that τ²-Bench no longer ships is skipped."""
    global _installed
    with _lock:
        if _installed:
            return
        import importlib

        for module, name in CALCULATE_TOOLKITS:
            try:
                cls = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                continue
            tool = cls.__dict__.get("calculate")
            if tool is not None and not getattr(tool, "__sinkflex_guarded__", False):
                setattr(cls, "calculate", _guard(tool))
        _installed = True
