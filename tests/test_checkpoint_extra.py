"""The checkpoint's extra state is JSON, and nothing in a checkpoint is unpickled (learner_service.checkpoint)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from learner_service.checkpoint import (
    EXTRA_JSON,
    EXTRA_PT,
    _rng_state,
    extra_from_json,
    extra_to_json,
    load_extra,
)


def _extra() -> dict:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    gen = torch.Generator().manual_seed(7)
    return {"scheduler": sched.state_dict(), "shuffle_gen": gen.get_state(), "rng": [_rng_state(), _rng_state()],
            "world": 2, "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "int_keys": {1: "a"}}


def _same(a, b) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def test_extra_state_round_trips_through_json():
    extra = _extra()
    text = extra_to_json(extra)
    json.loads(text)  # plain JSON
    back = extra_from_json(text)
    _same(extra, back)
    random.setstate(back["rng"][0]["python"])  # restorable as is
    torch.set_rng_state(back["rng"][0]["torch"])
    torch.Generator().set_state(back["shuffle_gen"])


def test_json_extra_is_preferred_and_old_extra_pt_still_loads(tmp_path):
    extra = _extra()
    torch.save(extra, tmp_path / EXTRA_PT)  # a checkpoint of an older version
    _same(load_extra(tmp_path), extra)
    (tmp_path / EXTRA_JSON).write_text(extra_to_json({"world": 3}))
    assert load_extra(tmp_path) == {"world": 3}


class _Evil:
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_an_extra_pt_with_arbitrary_objects_is_refused_without_running_it(tmp_path, capsys):
    torch.save({"scheduler": _Evil()}, tmp_path / EXTRA_PT)
    with pytest.raises(ValueError, match=r"extra\.pt.*weights_only=True"):
        load_extra(tmp_path)
    assert "unpickled!" not in capsys.readouterr().out


def test_missing_extra_state_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="extra.json"):
        load_extra(tmp_path)
