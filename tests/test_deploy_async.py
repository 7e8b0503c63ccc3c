"""rollout.max_staleness (docs/async.md) in compose and the chart: the value reaches every
container, the services derive the same configs as the embedded default from it, the chart
refuses what sinkflex_rl/config.py refuses, and the KEDA lag target counts the lag the
asynchronous loop holds by design (tasksPerStep × (maxStaleness + 1) groups).

Charts are rendered by Helm's own code (helm-python-sdk, offline), as in test_deploy_chart.py.
"""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
import yaml

from sinkflex.config import merge_dicts
from tests.fixtures.deploy import (
    ALL_OPTIONAL_VALUES,
    CHART,
    by_kind,
    deploy_environ,
    render_chart,
    workloads,
)

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
#: Every SinkFlex container (not Redis, not the helm test Pod) derives its config from the experiment.
SINKFLEX_COMPONENTS = {"env", "reward", "rollout", "learner", "user-sim", "train"}


def async_values(**extra) -> dict:
    return merge_dicts(copy.deepcopy(ALL_OPTIONAL_VALUES), {"maxStaleness": 1, "tasksPerStep": 8, **extra})


def container_envs(manifests) -> dict[str, dict[str, str]]:
    out = {}
    for w in workloads(manifests):
        comp = w["metadata"]["labels"]["app.kubernetes.io/component"]
        for c in w["spec"]["template"]["spec"]["containers"]:
            out[f"{w['metadata']['name']}/{c['name']}"] = (comp, {e["name"]: e.get("value") for e in c.get("env", [])})
    return out


def lag_counts(manifests) -> set[str]:
    return {so["spec"]["triggers"][0]["metadata"]["lagCount"] for so in by_kind(manifests, "ScaledObject").values()}


# --------------------------------------------------------------------------- chart: max_staleness 1

def test_chart_max_staleness_1_reaches_every_container_and_the_derived_configs(script, experiment, tmp_path):
    """Rendered with maxStaleness 1: every SinkFlex container has SINKFLEX_MAX_STALENESS=1, and
    sinkflex-service, given a container's environment, derives the asynchronous configs
    (learner_service.max_staleness 1, weight updates between turns) exactly as sinkflex_rl.config does."""
    from sinkflex_rl.config import TrainConfig, load_train_config, weight_updates
    from learner_service.config import LearnerConfig
    from rollout_service.config import RolloutConfig
    from sinkflex.config import load_config

    manifests = render_chart(async_values(tasksPerStep=2))
    envs = container_envs(manifests)
    seen = set()
    for name, (comp, env) in envs.items():
        if comp not in SINKFLEX_COMPONENTS:
            continue
        seen.add(comp)
        assert env["SINKFLEX_MAX_STALENESS"] == "1", name
        assert env["SINKFLEX_TASKS_PER_STEP"] == "2", name
    assert seen == SINKFLEX_COMPONENTS

    # what the rollout, learner and driver containers run on that environment
    (_, chart_env), = [v for k, v in envs.items() if v[0] == "learner" and "worker" not in k]
    environ = deploy_environ(experiment, tmp_path, SINKFLEX_MAX_STALENESS=chart_env["SINKFLEX_MAX_STALENESS"],
                             SINKFLEX_TASKS_PER_STEP=chart_env["SINKFLEX_TASKS_PER_STEP"])
    _, path = script.derive("learner", environ)
    learner = load_config(path, LearnerConfig)
    assert (learner.max_staleness, learner.batch.groups_per_step) == (1, 2)
    _, path = script.derive("rollout", environ)
    assert load_config(path, RolloutConfig).weight_updates == weight_updates(1) == "between_turns"
    _, path = script.derive("train", environ)
    train = load_config(path, TrainConfig)
    assert train.rollout.max_staleness == 1 and train.services.external()
    assert load_train_config(path).rollout.max_staleness == 1


def test_chart_default_leaves_the_experiments_value():
    """maxStaleness null (the default): SINKFLEX_MAX_STALENESS is empty, the experiment's value holds."""
    for name, (comp, env) in container_envs(render_chart()).items():
        if comp in SINKFLEX_COMPONENTS:
            assert env["SINKFLEX_MAX_STALENESS"] == "" and env["SINKFLEX_TASKS_PER_STEP"] == "", name
    # configOverrides' rollout.max_staleness is the release's value too
    envs = container_envs(render_chart({"configOverrides": {"rollout": {"max_staleness": 2}}}))
    assert {env["SINKFLEX_MAX_STALENESS"] for comp, env in envs.values() if comp in SINKFLEX_COMPONENTS} == {"2"}


# --------------------------------------------------------------------------- KEDA lag target

@pytest.mark.parametrize("k, groups, lag", [(0, 8, 8), (1, 8, 16), (3, 16, 64)])
def test_keda_lag_target_is_groups_per_step_times_k_plus_1(k, groups, lag):
    """With asynchronous rollouts the stream legitimately holds up to k + 1 steps of groups
    that the learner has not read (docs/async.md); one replica's target is that lag."""
    assert lag_counts(render_chart(async_values(maxStaleness=k, tasksPerStep=groups))) == {str(lag)}


def test_keda_lag_target_from_config_overrides_or_explicit():
    values = merge_dicts(copy.deepcopy(ALL_OPTIONAL_VALUES), {"maxStaleness": None, "tasksPerStep": None,
                         "configOverrides": {"rollout": {"max_staleness": 2}, "task": {"tasks_per_step": 4}}})
    assert lag_counts(render_chart(values)) == {"12"}
    assert lag_counts(render_chart(async_values(keda={"lagCount": 5}))) == {"5"}


def test_keda_without_the_experiments_shape_fails_naming_the_values():
    from helm_python import HelmRenderError

    values = merge_dicts(copy.deepcopy(ALL_OPTIONAL_VALUES), {"maxStaleness": None})
    with pytest.raises(HelmRenderError, match=r"keda.lagCount null means tasksPerStep × \(maxStaleness \+ 1\)"):
        render_chart(values)
    render_chart(merge_dicts(values, {"keda": {"lagCount": 16}}))  # an explicit target needs neither


# --------------------------------------------------------------------------- the chart refuses what sinkflex_rl.config refuses

REFUSED = [
    ({"maxStaleness": 1, "configOverrides": {"rollout": {"max_staleness": 1}}},
     r"maxStaleness and configOverrides.rollout.max_staleness both set rollout.max_staleness", "both set"),
    ({"maxStaleness": 1, "configOverrides": {"learner_service": {"max_staleness": 1}}},
     r"learner_service.max_staleness is derived from rollout.max_staleness", "learner_service.max_staleness is derived"),
    ({"maxStaleness": 0, "configOverrides": {"rollout_service": {"weight_updates": "between_requests"}}},
     r"rollout_service.weight_updates is derived from rollout.max_staleness", "weight_updates is derived"),
    ({"maxStaleness": 1, "configOverrides": {"learner_service": {"grpo": {"old_logprobs": "recompute"}}}},
     r"old_logprobs \"recompute\"", "recompute"),
    ({"tasksPerStep": 8, "configOverrides": {"learner_service": {"batch": {"groups_per_step": 8}}}},
     r"learner_service.batch.groups_per_step is derived from task.tasks_per_step", "groups_per_step is derived"),
    ({"configOverrides": {"learner": {"optim": {"lr": 1e-5}}}},
     r"the section 'learner' is now 'learner_service'", "the section 'learner' is now 'learner_service'"),
]


@pytest.mark.parametrize("values, chart_error, config_error", REFUSED, ids=[
    "two-values", "learner-max-staleness", "weight-updates", "recompute", "groups-per-step", "old-section-name"])
def test_chart_refuses_what_driver_config_refuses(values, chart_error, config_error, script, experiment, tmp_path):
    from helm_python import HelmRenderError

    from sinkflex.config import ConfigError

    with pytest.raises(HelmRenderError, match=chart_error):
        render_chart(values)
    # the same values given to the containers (compose's variables, the chart's env) fail there too
    environ = deploy_environ(experiment, tmp_path, SINKFLEX_CONFIG_OVERRIDES=json.dumps(values["configOverrides"]),
                             SINKFLEX_MAX_STALENESS=str(values.get("maxStaleness", "")),
                             SINKFLEX_TASKS_PER_STEP=str(values.get("tasksPerStep", "")))
    with pytest.raises((ConfigError, ValueError), match=config_error):
        script.derive("learner", environ)


@pytest.mark.parametrize("values", [{"maxStaleness": -1}, {"tasksPerStep": 0}, {"maxStaleness": "1"},
                                    {"keda": {"lagCount": 0}}])
def test_schema_types_the_new_values(values):
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(merge_dicts(DEFAULTS, values)))
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(merge_dicts(DEFAULTS, async_values()))) == []


# --------------------------------------------------------------------------- sinkflex-service and compose

def test_service_environment_sets_the_mode(script, experiment, tmp_path):
    from rollout_service.config import RolloutConfig
    from sinkflex.config import load_config

    environ = deploy_environ(experiment, tmp_path)
    _, path = script.derive("rollout", environ)
    assert load_config(path, RolloutConfig).weight_updates == "between_requests"  # the experiment's k = 0
    _, path = script.derive("rollout", {**environ, "SINKFLEX_MAX_STALENESS": "2"})
    assert load_config(path, RolloutConfig).weight_updates == "between_turns"
    # one value, one place: setting it in the overrides too, or not a number, is an error naming both
    with pytest.raises(ValueError, match=r"SINKFLEX_MAX_STALENESS and SINKFLEX_CONFIG_OVERRIDES' rollout.max_staleness both set"):
        script.derive("rollout", {**environ, "SINKFLEX_MAX_STALENESS": "2",
                                  "SINKFLEX_CONFIG_OVERRIDES": '{"rollout": {"max_staleness": 2}}'})
    with pytest.raises(ValueError, match="SINKFLEX_MAX_STALENESS must be an integer"):
        script.derive("rollout", {**environ, "SINKFLEX_MAX_STALENESS": "one"})


def test_compose_passes_max_staleness_to_every_sinkflex_service(compose):
    for name, svc in compose["services"].items():
        if name == "redis":
            continue
        env = svc["environment"]
        assert env["SINKFLEX_MAX_STALENESS"] == "${MAX_STALENESS:-}", name
        assert env["SINKFLEX_TASKS_PER_STEP"] == "${TASKS_PER_STEP:-}", name
