"""Dotted overrides (`--set`), `sinkflex-rl config show` / `config schema` and `--version`."""

import json
import tomllib
from importlib.metadata import version as dist_version
from pathlib import Path

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from sinkflex_rl.cli import app
from sinkflex_rl.config import TrainConfig, experiment_schema, load_train_config, service_configs
from sinkflex.config import ConfigError, merge_dicts, set_dotted, validate_config

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "configs" / "demo.yaml"
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
ADDRS = {"env": "127.0.0.1:1", "reward": "127.0.0.1:2", "rollout": "127.0.0.1:3", "learner": "127.0.0.1:4"}


def _cli(*args):
    return CliRunner().invoke(app, list(args))


# --------------------------------------------------------------------------- set_dotted


def test_set_dotted_parses_values_as_yaml_and_creates_sections():
    data = {"run": {"steps": 3, "name": "x"}}
    out = set_dotted(data, "run.steps=8")
    assert out == {"run": {"steps": 8, "name": "x"}} and data == {"run": {"steps": 3, "name": "x"}}  # input untouched
    assert set_dotted({}, "a.b.c=true") == {"a": {"b": {"c": True}}}
    assert set_dotted({}, "a=null") == {"a": None} == set_dotted({}, "a=")
    assert set_dotted({}, "a=1e-5") == {"a": 1e-5}  # a float, as in the file (YAML 1.2; PyYAML alone reads a string)
    assert set_dotted({}, "a=1.5e-5") == {"a": 1.5e-5}
    assert set_dotted({}, 'a="8"') == {"a": "8"}
    assert set_dotted({}, "a=[x, y]") == {"a": ["x", "y"]}
    assert set_dotted({}, "a=b=c") == {"a": "b=c"}  # the first = splits


@pytest.mark.parametrize("assignment, message", [
    ("rollout.group_size", "expected dotted.field=value"),
    ("=3", "expected dotted.field=value"),
    ("rollout..group_size=3", "expected dotted.field=value"),
    ("run.steps.x=1", "run.steps is 3, not a section with fields"),
    ("run.name=[unclosed", "not valid YAML"),
])
def test_set_dotted_rejects_malformed_assignments(assignment, message):
    with pytest.raises(ConfigError, match=message) as err:
        set_dotted({"run": {"steps": 3}}, assignment)
    assert repr(assignment) in str(err.value)


# --------------------------------------------------------------------------- overrides on load


def test_overrides_are_applied_in_order_and_reach_the_derived_service_configs():
    cfg = load_train_config(DEMO, ["rollout.group_size=16", "run.steps=5", "rollout.temperature=0.7", "run.steps=6",
                                   "learner_service.optim.lr=3.0e-5", "env_service.max_sessions=7"])
    assert cfg.rollout.group_size == 16 and cfg.run.steps == 6  # the later override wins
    assert cfg.task.tasks_per_step == 10 and cfg.warm_start.lr == 2.0e-4  # the file's other values stay
    out = service_configs(cfg, "/m", ADDRS, "redis://x", None)
    assert out["learner_service"].optim.total_steps == 6 and out["learner_service"].optim.lr == 3.0e-5
    assert out["learner_service"].grpo.temperature == out["rollout_service"].agent.temperature == 0.7
    assert out["env_service"].max_sessions == 7 and out["env_service"].default_max_steps == 30


@pytest.mark.parametrize("assignment, message", [
    ("rollout.group_size=0", "rollout.group_size: Input should be greater than or equal to 1"),
    ("rollout.group_sise=4", "rollout.group_sise: Extra inputs are not permitted"),
    ("run.steps=many", "run.steps: Input should be a valid integer"),
    ("task.order=random", "task.order: Input should be 'shuffled' or 'stratified'"),
    ("learner_service.grpo.temperature=0.5", "learner_service.grpo.temperature is derived from rollout.temperature"),
    ("learner_service.optim.lr=-1", "optim.lr: Input should be greater than 0"),  # a service section, checked at load
    ("env_service.bogus=1", "bogus: Extra inputs are not permitted"),
    # YAML reads yes/on/true as booleans; pydantic's lax mode would take them as 1 for a number
    ("rollout.group_size=true", "rollout.group_size: Value error, expected a number, got the boolean true"),
    ("learner_service.optim.lr=yes", "learner_service.optim.lr: Value error, expected a number, got the boolean true"),
    ("rollout_service.engine.kv_cache_gib=off", "rollout_service.engine.kv_cache_gib: Value error, expected a number, got the boolean false"),
    # infinity would pass gt=0 and dump as null (config show's output would not load back)
    ("learner_service.optim.lr=.inf", "learner_service.optim.lr: Input should be a finite number"),
    ("rollout.temperature=.nan", "rollout.temperature: Input should be a finite number"),
    ("local.gpus=[true,false]", "local.gpus: Value error, a GPU id is a CUDA device index (0, 1, ...) or a UUID string, not True"),
    ("local.gpus=[-1]", "local.gpus: Value error, a GPU id is a CUDA device index (0, 1, ...) or a UUID string, not -1"),
])
def test_a_bad_override_names_its_dotted_field_and_the_override(assignment, message):
    with pytest.raises(ConfigError) as err:
        load_train_config(DEMO, ["run.name=ok", assignment])
    assert message in str(err.value)
    assert f"{DEMO} --set run.name=ok --set {assignment}" in str(err.value)


def test_files_that_are_not_configs_are_named(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 1000 + "]" * 1000)
    with pytest.raises(ConfigError, match="is nested too deeply to be a config"):
        load_train_config(deep)
    with pytest.raises(ConfigError, match="the value is nested too deeply"):
        load_train_config(DEMO, ["run.name=" + "[" * 1000 + "]" * 1000])
    with pytest.raises(ConfigError, match="config /dev/null is not a regular file"):
        load_train_config("/dev/null")


def test_train_prints_errors_as_written_on_stderr(tmp_path):
    """No rich markup in what the user wrote ([bold] stays), one unwrapped line per error."""
    result = _cli("train", "-c", str(DEMO), "--set", 'run.name="[bold]x"', "--set", "rollout.group_size=0",
                  "--output-dir", str(tmp_path / "run"))
    assert result.exit_code == 2 and "--set run.name=\"[bold]x\"" in result.stderr and result.stdout == ""


def test_booleans_still_set_boolean_fields():
    cfg = load_train_config(DEMO, ["env_service.reward_on_termination=true", "learner_service.model.gradient_checkpointing=off"])
    assert cfg.section("env_service")["reward_on_termination"] is True
    assert cfg.section("learner_service")["model"]["gradient_checkpointing"] is False


def test_an_override_fails_exactly_like_the_same_field_in_the_file(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(merge_dicts(yaml.safe_load(DEMO.read_text()), {"rollout": {"max_turns": 0}})))
    with pytest.raises(ConfigError) as in_file:
        load_train_config(path)
    with pytest.raises(ConfigError) as overridden:
        load_train_config(DEMO, ["rollout.max_turns=0"])
    assert str(in_file.value).split(":", 1)[1] == str(overridden.value).split(":", 1)[1]  # all but the source


# --------------------------------------------------------------------------- the CLI


def test_train_rejects_a_bad_override_before_launching_anything(tmp_path):
    result = _cli("train", "-c", str(DEMO), "--set", "rollout.group_size=0", "--output-dir", str(tmp_path / "run"))
    assert result.exit_code == 2
    assert "rollout.group_size: Input should be greater than or equal to 1" in result.output
    assert not (tmp_path / "run").exists()
    result = _cli("train", "-c", str(DEMO), "--steps", "0", "--output-dir", str(tmp_path / "run"))
    assert result.exit_code == 2 and "run.steps: Input should be greater than or equal to 1" in result.output
    assert not (tmp_path / "run").exists()


def test_config_show_prints_the_resolved_experiment_which_reloads_to_the_same_config(tmp_path):
    result = _cli("config", "show", "-c", str(DEMO), "--set", "rollout.group_size=4", "--set", "validation.trials=3")
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.stdout)
    assert result.stdout.startswith(f"# {DEMO} --set rollout.group_size=4 --set validation.trials=3, resolved")
    assert shown["rollout"]["group_size"] == 4 and shown["validation"]["trials"] == 3
    assert shown["run"]["step_timeout_s"] == 3600.0 and shown["local"]["max_restarts"] == 3  # defaults filled in
    assert shown["task"]["generate"] == {"kind": "solo", "train": 256, "test": 64, "seed": 0}
    assert shown["learner_service"] == {"optim": {"lr": 2.0e-5, "eps": 1.0e-5, "scheduler": "linear", "warmup_steps": 0},
                                "batch": {"micro_batch_size": 80, "shared_prefix_across_groups": True},
                                "grpo": {"beta": 0.0}}  # service sections as written
    again = tmp_path / "shown.yaml"
    again.write_text(result.stdout)
    assert load_train_config(again) == load_train_config(DEMO, ["rollout.group_size=4", "validation.trials=3"])


@pytest.mark.parametrize("name", ["1e3", "1E5", "010", "yes", "0x1f", "1_000"])
def test_config_show_quotes_a_string_the_loader_would_read_as_a_number(tmp_path, name):
    """`run.name: "1e3"` is a string; written unquoted, the config loader (YAML 1.2 floats) would
    read it back as 1000.0 and refuse it."""
    result = _cli("config", "show", "-c", str(DEMO), "--set", f'run.name="{name}"')
    assert result.exit_code == 0, result.output
    again = tmp_path / "shown.yaml"
    again.write_text(result.stdout)
    assert load_train_config(again).run.name == name


def test_config_show_with_local_gpus_reloads(tmp_path):
    """learner_procs left out stays unset in the shown file: the GPU split decides it again on load."""
    sets = ["local.gpus=[0,1,2]", "local.engine_gpus=1"]
    result = _cli("config", "show", "-c", str(DEMO), *[a for s in sets for a in ("--set", s)])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout)["local"]["learner_procs"] is None
    again = tmp_path / "shown.yaml"
    again.write_text(result.stdout)
    assert load_train_config(again) == load_train_config(DEMO, sets)


def test_config_show_services_gives_each_launched_services_config():
    result = _cli("config", "show", "-c", str(DEMO), "--services", "--set", "rollout.temperature=0.8", "--set", "run.steps=5")
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.stdout)
    assert list(shown) == ["env_service", "reward_service", "rollout_service", "learner_service"]
    env, rollout, learner = shown["env_service"], shown["rollout_service"], shown["learner_service"]
    assert env["domains"] == ["mock"] and env["default_max_steps"] == 30 and env["reward_on_termination"] is False
    assert env["task_files"] == {"mock": ["runs/demo/tasks"]}  # the generated task set
    assert env["user_base_url"] is None  # solo mode: no user simulator, no user endpoint
    assert shown["reward_service"]["preload_envs"] == ["mock"]  # the run's domain, not retail
    assert rollout["agent"]["temperature"] == learner["grpo"]["temperature"] == 0.8
    assert rollout["agent"]["max_groups_in_flight"] == 32 and rollout["engine"]["max_model_len"] == 4096
    assert (learner["optim"]["total_steps"], learner["batch"]["groups_per_step"], learner["optim"]["lr"]) == (5, 10, 2.0e-5)
    assert learner["warm_start"]["demonstrations"] == "runs/demo/warm_start/demonstrations.pb"
    assert learner["model"]["path"] == rollout["engine"]["model"] == "<launch>"
    assert learner["rollout_address"] == rollout["env_address"] == rollout["redis_url"] == "<launch>"
    # each is a valid config of its service
    from learner_service.config import LearnerConfig

    assert validate_config(learner, LearnerConfig).optim.total_steps == 5


def test_config_show_names_a_bad_override_and_exits_2():
    result = _cli("config", "show", "-c", str(DEMO), "--set", "warm_start.epochs=0")
    assert result.exit_code == 2
    assert "warm_start.epochs: Input should be greater than or equal to 1" in result.stderr and result.stdout == ""
    result = _cli("config", "show", "-c", str(ROOT / "configs" / "missing.yaml"))
    assert result.exit_code == 2 and "config file not found" in result.stderr


# --------------------------------------------------------------------------- the schema


def _errors(doc):
    schema = json.loads(_cli("config", "schema").stdout)
    return [(list(e.absolute_path), e.validator) for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]


def test_config_schema_is_a_valid_json_schema_every_shipped_config_satisfies():
    result = _cli("config", "schema")
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    assert schema == experiment_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert set(schema["properties"]) == set(TrainConfig.model_fields)
    assert schema["properties"]["learner_service"]["$defs"]["OptimConfig"]["properties"]["lr"]["exclusiveMinimum"] == 0
    for path in CONFIGS:
        assert _errors(yaml.safe_load(path.read_text())) == [], path.name
    assert _errors({}) == []  # every section has defaults; the job fills in model paths and addresses


def test_config_schema_rejects_bad_fields_in_every_kind_of_section():
    demo = yaml.safe_load(DEMO.read_text())
    for patch, where, rule in [
        ({"rollout": {"group_size": 0}}, ["rollout", "group_size"], "minimum"),
        ({"run": {"stepz": 3}}, ["run"], "additionalProperties"),
        ({"task": {"order": "random"}}, ["task", "order"], "enum"),
        ({"learner_service": {"optim": {"lr": -1}}}, ["learner_service", "optim", "lr"], "exclusiveMinimum"),
        ({"learner_service": {"grpo": {"bogus": 1}}}, ["learner_service", "grpo"], "additionalProperties"),
        # a field the job derives is not in a service section's schema: written there, it is refused
        ({"learner_service": {"grpo": {"temperature": 1.0}}}, ["learner_service", "grpo"], "additionalProperties"),
        ({"rollout_service": {"agent": {"tool_format": "xml"}}}, ["rollout_service", "agent", "tool_format"], "enum"),
        ({"env_service": {"max_sessions": 0}}, ["env_service", "max_sessions"], "minimum"),
        ({"reward_service": {"judge": {"base_url": "http://x"}}}, ["reward_service", "judge"], "anyOf"),  # judge.model missing
    ]:
        assert (where, rule) in _errors(merge_dicts(demo, patch)), patch


def test_version_is_the_packages():
    result = _cli("--version")
    assert result.exit_code == 0
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert result.stdout == f"sinkflex-rl {pyproject}\n"
    assert dist_version("sinkflex-rl") == pyproject


@pytest.mark.parametrize("level, shown", [("WARNING", False), ("DEBUG", True)])
def test_tau2_import_notices_are_dropped_below_debug(level, shown):
    """`quiet_tau2_logs` keeps tau2's warnings but drops its import-time "No .env file found"
    and "Sonnet thinking is disabled" (every tau2 import prints them; they say nothing about the run)."""
    import subprocess
    import sys

    code = (f"from tau2_adapter.logs import quiet_tau2_logs; quiet_tau2_logs({level!r}); "
            "import tau2.utils.utils, tau2.utils.llm_utils; from loguru import logger; logger.warning('still shown')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "still shown" in out.stderr
    assert ("No .env file found" in out.stderr) is shown
    assert ("Sonnet thinking is disabled" in out.stderr) is shown


# --------------------------------------------------------------------------- bad run folders and envs
# Found by a new user's bad-input pass: a run folder that cannot be created was a traceback (train and
# eval); `--output-dir ""` trained into runs/<name> as if it were not given; an unknown task.env
# launched the env, reward and rollout services (the vLLM engine) before the env service refused it.


def _one_line(result, code: int, *words: str) -> str:
    out = result.output
    assert result.exit_code == code, out
    assert "Traceback" not in out and (result.exception is None or isinstance(result.exception, SystemExit)), out
    for w in words:
        assert w in out, (w, out)
    return out


def test_a_run_folder_that_cannot_be_created_is_one_line_before_anything_starts(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out_dir in (a_file, a_file / "sub"):
        _one_line(_cli("train", "-c", str(DEMO), "--output-dir", str(out_dir)), 2,
                  f"run.output_dir: cannot use {out_dir} as the run folder: a file is in the way")
    _one_line(_cli("train", "-c", str(DEMO), "--output-dir", ""), 2, "run.output_dir: String should have at least 1 character")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    _one_line(_cli("eval", "--policy", str(model), "-c", str(DEMO), "-o", str(a_file)), 2,
              f"--output-dir: cannot use {a_file} as the run folder: a file is in the way")
    assert not (tmp_path / "runs").exists()


def test_an_unknown_task_env_stops_train_before_any_service_starts(tmp_path):
    """models.policy is a missing folder too: were the env not checked first, the run would stop
    on the policy (still before any service starts), with another message."""
    cfg = tmp_path / "x.yaml"
    cfg.write_text("task: {env: nosuchenv, solo_mode: true}\nmodels: {policy: /nonexistent/model, user_simulator: null}\n")
    out = _one_line(_cli("train", "-c", str(cfg), "--output-dir", str(tmp_path / "run")), 2,
                    "task.env: unknown tau2 domain 'nosuchenv'; tau2 ships", "services.env_address")
    assert "models.policy" not in out
    assert not (tmp_path / "run" / "configs").exists()  # no service config written: nothing launched


def test_task_env_outside_env_service_domains_is_refused_at_load(tmp_path):
    cfg = tmp_path / "x.yaml"
    cfg.write_text("task: {env: mock, solo_mode: true}\nenv_service: {domains: [retail]}\n")
    _one_line(_cli("config", "show", "-c", str(cfg)), 2, "task.env 'mock' is not among env_service.domains (retail)")
    cfg.write_text("task: {env: mock, solo_mode: true}\nenv_service: {domains: [retail, mock]}\n")
    assert _cli("config", "show", "-c", str(cfg)).exit_code == 0


@pytest.mark.parametrize("seed", ["-1", "4294967296", "99999999999999999999999"])
def test_a_seed_the_engine_cannot_take_is_refused_at_load(seed):
    """Found by a bad-input pass: run.seed -1 or >= 2**32 loaded, then the rollout engine died at
    start (vLLM seeds numpy with it: 'Seed must be between 0 and 2**32 - 1'), minutes in; a huge one
    would also overflow RolloutRequest.seed (int64) mid-run."""
    _one_line(_cli("config", "show", "-c", str(DEMO), "--set", f"run.seed={seed}"), 2, "run.seed: Input should be")
    from pydantic import ValidationError

    from rollout_service.config import RolloutConfig

    with pytest.raises(ValidationError, match=r"engine\.seed\n  Input should be"):
        RolloutConfig.model_validate({"engine": {"model": "m", "seed": int(seed)}})
    assert RolloutConfig.model_validate({"engine": {"model": "m", "seed": 2**32 - 1}}).engine.seed == 2**32 - 1
    assert _cli("config", "show", "-c", str(DEMO), "--set", "run.seed=4294967295").exit_code == 0


def test_a_policy_that_is_not_there_stops_eval_and_train_before_the_embedded_redis_starts(tmp_path):
    """Found by a bad-input pass: `eval --policy /no/such -c …` started the embedded Redis before it
    looked for the model, and named the field models.policy, which the user never wrote."""
    out = _one_line(_cli("eval", "--policy", "no such model!", "-c", str(DEMO), "-o", str(tmp_path / "e")), 2,
                    "--policy: model 'no such model!' is neither a folder")
    assert "models.policy" not in out and not (tmp_path / "e" / "redis").exists()
    for policy, said in ((str(tmp_path / "no-such"), f"--policy: no such folder: {tmp_path / 'no-such'}"),
                         ("", "--policy: empty")):  # a path that is not there; "" (was the current folder)
        _one_line(_cli("eval", "--policy", policy), 2, said)
    _one_line(_cli("train", "-c", str(DEMO), "--output-dir", str(tmp_path / "t"), "--set", f"models.policy={tmp_path / 'no-such'}"),
              2, "models.policy: model")
    assert not (tmp_path / "t" / "redis").exists()


class _Recorder:
    """A launcher that records what launch_local would start and starts nothing."""

    def __init__(self):
        self.specs = []

    def watch(self, *a, **k):
        pass

    def start_all(self, specs, ready_timeout=0.0):
        self.specs.extend(specs)


@pytest.mark.parametrize("sets, message", [
    (["task.eval_split=tets"], "task.eval_split: env 'mock' has no split 'tets' (its splits: base, test, train)"),
    (["task.train_split=trian"], "task.train_split: env 'mock' has no split 'trian'"),
    (["task.task_ids=[gen_nope, create_task_1]"], "task.task_ids: env 'mock' has no task 'gen_nope'"),
])
def test_a_split_or_task_the_env_lacks_stops_the_launch_before_anything_starts(tmp_path, monkeypatch, sets, message):
    """Found by a bad-input pass: a typo'd split (task.eval_split: tets) was found only by the
    controller once the engine and the learner had loaded, minutes in, and ended in a traceback
    (the env's NOT_FOUND); unknown task_ids likewise after the launch. Now the launch refuses them
    before anything starts, naming the field and the splits there are."""
    import sinkflex_rl.local as local

    monkeypatch.setattr(local, "resolve_model", lambda name, hub=None: str(tmp_path / "model"))
    cfg = load_train_config(DEMO, [f"run.output_dir={tmp_path / 'run'}", "services.redis_url=redis://127.0.0.1:1/0", *sets])
    launcher = _Recorder()
    with pytest.raises(ConfigError) as err:
        local.launch_local(cfg, launcher, visible=[])
    assert message in str(err.value) and launcher.specs == []


def test_the_controller_names_a_split_a_running_env_lacks(tmp_path):
    """With an env server that runs already (nothing to check before the launch), the controller's
    NOT_FOUND for a split is a ConfigError naming the field (train exits 2), not a traceback."""
    from env_service.client import LocalEnvClient
    from env_service.config import EnvServiceConfig
    from sinkflex_rl.controller import Controller

    cfg = load_train_config(DEMO, [f"run.output_dir={tmp_path / 'run'}", "task.generate=null", "task.eval_split=tets",
                                   "warm_start.enabled=false"])

    class Clients:
        env = LocalEnvClient(EnvServiceConfig(domains=("mock",), user_base_url=None))
        reward = rollout = learner = None

        def close(self):
            pass

    controller = Controller(cfg, Clients())
    with pytest.raises(ConfigError, match="task.eval_split: split 'tets' of env 'mock': the env service says: .*unknown split"):
        controller.eval_tasks()


def _laughs(levels: int = 9) -> str:
    lines = ["    a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"    a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines)


def test_a_config_of_nested_aliases_is_refused_in_a_second_not_expanded(tmp_path):
    """Found by a bad-input pass: a 1 KB experiment file of nested YAML aliases (a "billion laughs"
    document) under env_service.user_llm_extra_args (any values) made `config show` grow to 6.6 GB
    in a minute (killed at the time limit): validation and dumping walk every alias. Now the
    document is refused at load, also through --set, and a self-referencing alias too; the
    message of a huge --set is cut."""
    import time

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("env_service:\n  user_llm_extra_args:\n" + _laughs() + "\n")
    t0 = time.monotonic()
    _one_line(_cli("config", "show", "-c", str(bomb)), 2, f"config {bomb} is not valid YAML: the document expands to more "
              "than 1,000,000 values")
    assert time.monotonic() - t0 < 30
    value = "{" + _laughs().replace("\n", ",").replace("    ", "") + "}"
    out = _one_line(_cli("config", "show", "-c", str(DEMO), "--set", f"env_service.user_llm_extra_args={value}"), 2,
                    "the value is not valid YAML: the document expands to more than 1,000,000 values")
    assert len(out) < 2000
    loop = tmp_path / "loop.yaml"
    loop.write_text("env_service:\n  user_llm_extra_args: &a {x: *a}\n")
    _one_line(_cli("config", "show", "-c", str(loop)), 2, "expands to more than 1,000,000 values")
    few = tmp_path / "few.yaml"  # aliases as configs use them: fine
    few.write_text("rollout: &r {max_turns: 3}\nvalidation: {trials: 2}\nenv_service:\n  user_llm_extra_args: {a: *r, b: *r}\n")
    assert _cli("config", "show", "-c", str(few)).exit_code == 0


@pytest.mark.parametrize("address, problem", [
    ("not an address", "is not host:port with a port in 1–65535"), ("127.0.0.1:99999", "with a port in 1–65535"),
    (":5", "with a port in 1–65535"), ("x y:5", "the host has white space"), ("::1:50051", "an IPv6 host goes in brackets"),
])
def test_a_malformed_service_address_is_refused_at_load(address, problem):
    """Found by a bad-input pass: `services.*_address: "not an address"` loaded, and train then sat
    without a word until killed; the CLI's own --address flags were already checked."""
    sets = [f"services.{k}_address=127.0.0.1:{i + 1}" for i, k in enumerate(("env", "reward", "rollout", "learner"))]
    sets += ["task.generate=null", "warm_start.enabled=false", f"services.rollout_address={json.dumps(address)}"]
    _one_line(_cli("config", "show", "-c", str(DEMO), *[a for s in sets for a in ("--set", s)]), 2,
              f"services.rollout_address: Value error, {address!r} is not host:port", problem)
    _one_line(_cli("config", "show", "-c", str(DEMO), "--set", f"task.reward_address={json.dumps(address)}"), 2,
              "task.reward_address: Value error")


@pytest.mark.parametrize("address", ["sf-env:50051", "127.0.0.1:1", "[::1]:50051", "unix:/tmp/env.sock", "dns:///env:50051"])
def test_service_addresses_in_use_load(address):
    sets = [f"services.{k}_address=127.0.0.1:{i + 1}" for i, k in enumerate(("env", "reward", "rollout", "learner"))]
    sets += ["task.generate=null", "warm_start.enabled=false", f"services.env_address={json.dumps(address)}"]
    result = _cli("config", "show", "-c", str(DEMO), *[a for s in sets for a in ("--set", s)])
    assert result.exit_code == 0, result.output


def test_services_that_run_elsewhere_are_waited_for_aloud_and_named_when_absent(tmp_path, caplog, env_server):
    """Found by a bad-input pass: `train` with services.*_address pointing where nothing listens
    printed nothing at all (not even with -v) while it waited, for up to half an hour, then failed
    deep in the controller. Now it says which service it waits for, and names the field and
    address when the wait ends; a service that answers is not waited for."""
    import socket

    from sinkflex_rl.local import wait_for_running_services

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nothing = f"127.0.0.1:{s.getsockname()[1]}"
    sets = ["task.generate=null", "warm_start.enabled=false", f"services.env_address={nothing}",
            "services.reward_address=127.0.0.1:2", "services.rollout_address=127.0.0.1:3", "services.learner_address=127.0.0.1:4"]
    cfg = load_train_config(DEMO, sets)
    with caplog.at_level("WARNING"), pytest.raises(ConfigError) as err:
        wait_for_running_services(cfg, timeout_s=1.5, note_every_s=0.5)
    assert f"services.env_address: nothing SERVING the env service at {nothing} within 1.5 s" in str(err.value)
    assert f"waiting for the env service at {nothing} (services.env_address) to be SERVING" in caplog.text
    only_env = load_train_config(DEMO, ["task.generate=null", f"services.env_address={env_server}", "env_service=null"])
    assert only_env.services.env_only()
    wait_for_running_services(only_env, timeout_s=30)  # the real env server answers at once


def test_an_integer_of_more_than_4300_digits_is_a_yaml_error_not_a_traceback(tmp_path):
    """Found by a bad-input pass: `--set rollout.group_size=<5000 nines>` (or the same in the file)
    was a traceback: PyYAML's int conversion raised Python's 4300-digit ValueError."""
    huge = "9" * 5000
    out = _one_line(_cli("config", "show", "-c", str(DEMO), "--set", f"rollout.group_size={huge}"), 2,
                    "the value is not valid YAML: a value cannot be read: Exceeds the limit (4300 digits)")
    assert len(out) < 1500
    cfg = tmp_path / "x.yaml"
    cfg.write_text(f"rollout:\n  group_size: {huge}\n")
    _one_line(_cli("config", "show", "-c", str(cfg)), 2, f"config {cfg} is not valid YAML: a value cannot be read")
