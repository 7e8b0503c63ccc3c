"""charts/sinkflex/values.schema.json: Helm's own lint and render (helm-python-sdk, Helm's Go
code; no `helm` binary is needed) refuse bad values, naming the value, and accept the shipped
values files; the schema describes exactly the keys of values.yaml."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from sinkflex.config import merge_dicts
from tests.fixtures.deploy import ALL_OPTIONAL_VALUES, CHART, MULTI_GPU_VALUES, NAMESPACE, render_chart

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())


def _lint(values):
    import helm_python as helm

    return helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version="v1.30.0")


@pytest.mark.parametrize("values", [DEFAULTS, yaml.safe_load((CHART / "values-gpt-oss-20b.yaml").read_text()),
                                    MULTI_GPU_VALUES, ALL_OPTIONAL_VALUES], ids=["values", "gpt-oss-20b", "multi-gpu", "optional"])
def test_shipped_values_satisfy_the_schema(values):
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(merge_dicts(DEFAULTS, values))) == []


def test_the_schema_has_exactly_the_keys_of_values_yaml():
    def walk(schema, values, path):
        props = schema.get("properties")
        if props is None or schema.get("additionalProperties") is not False:
            return []
        out = [f"{path}{k}: in the schema, not in values.yaml" for k in props if k not in values]
        out += [f"{path}{k}: in values.yaml, not in the schema" for k in values if k not in props]
        for k in set(props) & set(values):
            if isinstance(values[k], dict):
                out += walk(props[k], values[k], f"{path}{k}.")
        return out

    assert walk(SCHEMA, DEFAULTS, "") == []


@pytest.mark.parametrize("values, where, why", [
    ({"rollout": {"replicas": 0}}, "/rollout/replicas", "minimum: got 0, want 1"),
    ({"learner": {"gpusPerNode": "8"}}, "/learner/gpusPerNode", "got string, want integer"),
    ({"rollout": {"replica": 2}}, "/rollout", "additional properties 'replica' not allowed"),
    ({"bogus": 1}, "", "additional properties 'bogus' not allowed"),
    ({"redis": {"port": 70000}}, "/redis/port", "maximum: got 70,000, want 65,535"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy", "value must be one of"),
    ({"sharedStorage": {"size": "lots"}}, "/sharedStorage/size", "does not match pattern"),
    ({"sharedStorage": {"accessModes": ["RWX"]}}, "/sharedStorage/accessModes/0", "value must be one of"),
    ({"learner": {"resources": {"limits": {"memory": "4 GB"}}}}, "/learner/resources/limits/memory", ""),
    ({"env": {"image": {"repository": ""}}}, "/env/image/repository", "minLength"),
    ({"userSim": {"extraArgs": ["--x", 3]}}, "/userSim/extraArgs/1", "got number, want string"),
    ({"serviceMonitor": {"interval": "soon"}}, "/serviceMonitor/interval", "does not match pattern"),
    ({"trainingConfig": ""}, "/trainingConfig", "minLength"),
    ({"warmStart": {"waitForServicesSeconds": -1}}, "/warmStart/waitForServicesSeconds", "minimum: got -1, want 0"),
    ({"tasks": {"enable": False}}, "/tasks", "additional properties 'enable' not allowed"),
])
def test_helm_lint_and_render_refuse_bad_values_naming_them(values, where, why):
    from helm_python import HelmValuesError

    report = _lint(values)
    assert report["errors"], values
    errors = "\n".join(report["errors"])
    assert f"- at '{where}'" in errors and why in errors, errors
    with pytest.raises(HelmValuesError, match=f"at '{where}'"):
        render_chart(values)
    # and for anyone validating without Helm: the values merged over values.yaml, as Helm does
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(merge_dicts(DEFAULTS, values)))


def test_template_rules_between_values_keep_their_own_messages():
    """Rules that need two values (a GPU layout) stay in the templates, with their messages."""
    from helm_python import HelmRenderError

    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors({"learner": {"nodes": 0}})) == []
    with pytest.raises(HelmRenderError, match=r"learner.nodes \(0\) and learner.gpusPerNode \(1\) must be >= 1"):
        render_chart({"learner": {"nodes": 0}})
