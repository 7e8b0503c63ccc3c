"""charts/sinkflex/README.md is generated from values.yaml's comments (scripts/chart_readme.py)
and up to date: every value of values.yaml has its row with its real default, and the comment
above a key is its description."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import yaml

from tests.fixtures.deploy import CHART, ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import chart_readme  # noqa: E402


def _leaves(data, prefix=""):
    for k, v in data.items():
        if isinstance(v, dict) and v and not any(set(c) & set("./") for c in v):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_readme_is_up_to_date():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "chart_readme.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr + "\n(run: python scripts/chart_readme.py)"
    assert (CHART / "README.md").read_text() == chart_readme.render()


def test_every_value_has_its_row_and_default():
    text = chart_readme.render()
    rows = {m.group(1): (m.group(2), m.group(3), m.group(4))
            for m in re.finditer(r"^\| `([^`]+)` \| (\w+) \| (.*?) \| (.*) \|$", text, re.M)}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for key, value in _leaves(values):
        parts = key.split(".")
        # the row of the key, or of the flow mapping it sits in ({type: RuntimeDefault})
        n = next((n for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in rows), None)
        assert n is not None, key
        shown = json.loads(rows[".".join(parts[:n])][1].strip("`").replace("\\|", "|"))
        for part in parts[n:]:
            shown = shown[part]
        assert shown == value, key
    assert rows["serviceAccount.create"] == ("bool", "`true`", 'Make one (named `name`, or the release\'s full name). '
                                                               'false: use `name` (or "default").')
    assert rows["learner.nodes"][0:2] == ("int", "`1`")
    assert rows["gpuNodes.nodeSelector"][1] == '`{"nvidia.com/gpu.present": "true"}`'  # a label map is one value
    assert "\n### Redis\n" in text and "\n### Helm test\n" in text
    assert "SmolLM2-135M-Instruct" in text.split("## Values")[0]


def test_parser_takes_the_comment_block_right_above_a_key(tmp_path):
    (tmp_path / "Chart.yaml").write_text("name: x\ndescription: d\nversion: 1.0.0\nappVersion: '2'\n")
    (tmp_path / "values.yaml").write_text(
        "# head\n\n# -- first\n# line two\na: 1\n\n# orphan\n\nb:\n  # inner | pipe\n  c: [x]\n"
        "# ---------------------------------- part two\n# of d\nd: {e: 1}\n")
    _, items = chart_readme.parse(tmp_path / "values.yaml")
    assert items == [
        {"key": "a", "type": "int", "default": 1, "doc": "first line two", "block": False},
        {"key": "b.c", "type": "list", "default": ["x"], "doc": "inner | pipe", "block": False},
        {"section": "part two"},
        {"key": "d", "type": "object", "default": {"e": 1}, "doc": "of d", "block": False},
    ]
    assert "| `b.c` | list | `[\"x\"]` | inner \\| pipe |" in chart_readme.render(tmp_path / "values.yaml")
