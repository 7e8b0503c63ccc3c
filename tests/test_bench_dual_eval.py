"""benchmarks/bench_dual_eval.py reads its arms (``NAME: [--set F=V]... [--env K=V]...``) or says
which one it cannot read."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_dual_eval", Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dual_eval.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_an_arm_gives_its_overrides_and_environment():
    assert bench.parse_arm("default:") == {"name": "default", "sets": [], "env": {}}
    assert bench.parse_arm("compiled: --set rollout_service.engine.enforce_eager=false --env OMP_WAIT_POLICY=PASSIVE") == {
        "name": "compiled", "sets": ["rollout_service.engine.enforce_eager=false"], "env": {"OMP_WAIT_POLICY": "PASSIVE"}}
    assert bench.parse_arm("q: --env 'A=x y'")["env"] == {"A": "x y"}


@pytest.mark.parametrize("text, said", [
    ("default", "an arm is 'NAME:"),
    (": --set a=1", "an arm is 'NAME:"),
    ("x: --foo 1", "expected --set F=V or --env K=V, got --foo 1"),
    ("x: --env NOEQUALS", "expected --set F=V or --env K=V, got --env NOEQUALS"),
    ("x: --set", "'--set' has no value"),
])
def test_an_arm_it_cannot_read_is_named(text, said):
    with pytest.raises(argparse.ArgumentTypeError) as err:
        bench.parse_arm(text)
    assert said in str(err.value)
