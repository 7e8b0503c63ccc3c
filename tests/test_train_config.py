"""The experiment config of `sinkflex-rl train`: shipped configs load, bad fields are named."""

from pathlib import Path

import pytest
import yaml

from sinkflex.config import ConfigError, merge_dicts
from sinkflex_rl.config import TrainConfig, load_train_config, service_configs

ROOT = Path(__file__).resolve().parent.parent
ADDRS = {"env": "127.0.0.1:1", "reward": "127.0.0.1:2", "rollout": "127.0.0.1:3", "learner": "127.0.0.1:4"}


@pytest.mark.parametrize("name", ["demo", "retail", "gpt-oss-20b"])
def test_shipped_configs_derive_every_service_config(name):
    cfg = load_train_config(ROOT / "configs" / f"{name}.yaml")
    out = service_configs(cfg, "/models/policy", ADDRS, "redis://127.0.0.1:6379/0", "http://127.0.0.1:8000/v1")
    learner, rollout = out["learner_service"], out["rollout_service"]
    # what the job derives: the learner's log-probs use the engine's temperature, one group per task
    assert learner.grpo.temperature == cfg.rollout.temperature
    assert learner.batch.groups_per_step == cfg.task.tasks_per_step
    assert learner.model.path == rollout.engine.model == "/models/policy"
    assert learner.rollout_address == ADDRS["rollout"] and rollout.env_address == ADDRS["env"]
    assert out["env_service"].user_base_url == "http://127.0.0.1:8000/v1"
    # synchronous by default: on-policy only, no weight update inside a Rollout request
    assert cfg.rollout.max_staleness == learner.max_staleness == 0 and rollout.weight_updates == "between_requests"


def test_max_staleness_reaches_the_learner_and_the_rollout_service():
    cfg = load_train_config(ROOT / "configs" / "demo.yaml", ["rollout.max_staleness=2"])
    out = service_configs(cfg, "/models/policy", ADDRS, "redis://127.0.0.1:6379/0", None)
    assert out["learner_service"].max_staleness == 2 and out["rollout_service"].weight_updates == "between_turns"


def test_the_lr_schedule_spans_every_optimizer_step_of_the_run():
    """optim.total_steps counts optimiser steps: run.steps x ppo_epochs x mini_batches, so that a
    linear schedule reaches 0 at the last RL step (with total_steps = run.steps it reached 0
    after run.steps / (epochs x mini-batches) RL steps and the rest trained at lr 0)."""
    from transformers import get_scheduler
    import torch

    over = ["run.steps=10", "learner_service.grpo.mini_batches=2", "learner_service.grpo.ppo_epochs=3",
            "learner_service.optim.scheduler=linear"]
    cfg = load_train_config(ROOT / "configs" / "demo-dual.yaml", over)
    optim = service_configs(cfg, "/m", ADDRS, "redis://x", None)["learner_service"].optim
    assert optim.total_steps == cfg.learner_service.optim.total_steps == 60
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    sched = get_scheduler(optim.scheduler, opt, num_warmup_steps=0, num_training_steps=optim.total_steps)
    lrs = []
    for _ in range(60):  # the learner's order: optimizer.step() then scheduler.step()
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[0] == optim.lr and lrs[6 * 5] == pytest.approx(optim.lr / 2) and lrs[-1] > 0  # RL step 10's are > 0
    # written in the section, it is the section's
    cfg = load_train_config(ROOT / "configs" / "demo-dual.yaml", over + ["learner_service.optim.total_steps=7"])
    assert service_configs(cfg, "/m", ADDRS, "redis://x", None)["learner_service"].optim.total_steps == 7
    # without epochs or mini-batches written: one optimiser step per RL step
    assert load_train_config(ROOT / "configs" / "demo.yaml").learner_service.optim.total_steps == 8


def _write(tmp_path, data):
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(merge_dicts(yaml.safe_load((ROOT / "configs/demo.yaml").read_text()), data)))
    return path


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"rollout": {"group_size": 0}}, "rollout.group_size"),
        ({"run": {"stepz": 3}}, "run.stepz: Extra inputs are not permitted"),
        # a fact the job derives cannot be written a second time in a service section
        ({"learner_service": {"grpo": {"temperature": 1.0}}},
         "learner_service.grpo.temperature: Value error, learner_service.grpo.temperature is derived from rollout.temperature"),
        ({"learner_service": {"batch": {"groups_per_step": 9}}}, "batch.groups_per_step is derived from task.tasks_per_step"),
        ({"services": {"env_address": "h:1", "reward_address": "h:2"}}, "missing: rollout_address, learner_address"),
        ({"rollout": {"max_staleness": -1}}, "rollout.max_staleness"),
        ({"learner_service": {"max_staleness": 0}}, "learner_service.max_staleness is derived from rollout.max_staleness"),
        ({"rollout_service": {"weight_updates": "between_requests"}},
         "rollout_service.weight_updates is derived from rollout.max_staleness"),
        ({"rollout_service": {"agent": {"max_turns": 3}}}, "rollout_service.agent.max_turns is derived from rollout.max_turns"),
        ({"rollout_service": {"envs": {"mock": {"reward": "env"}}}}, "rollout_service.envs.mock.reward is derived from task.reward"),
        ({"learner_service": {"publish_every": 2}}, "learner_service.publish_every is derived from the controller"),
        ({"learner_service": {"warm_start": {"epochs": 3}}}, "learner_service.warm_start is derived from the warm_start section"),
        ({"learner": {"optim": {"lr": 1e-5}}}, "learner: Value error, the section 'learner' is now 'learner_service'"),
        ({"warm_start": {"demonstrations": 8}}, "warm_start.demonstrations (a number of train tasks) is now warm_start.tasks"),
        ({"rollout": {"max_staleness": 1}, "learner_service": {"grpo": {"old_logprobs": "recompute"}}}, "use 'engine'"),
        ({"task": {"generate": {"domain": "mock"}}}, "task.generate.domain is not a setting: tasks are generated for task.env"),
        ({"task": {"env": "retail", "generate": {}}}, "task.generate makes tasks for τ²-Bench's mock domain only; task.env is 'retail'"),
    ],
)
def test_bad_fields_are_named(tmp_path, patch, message):
    with pytest.raises(ConfigError) as err:
        load_train_config(_write(tmp_path, patch))
    assert message in str(err.value)


def test_bad_service_section_is_named(tmp_path):
    from sinkflex_rl.config import TrainConfig
    from sinkflex.config import validate_config

    path = _write(tmp_path, {"learner_service": {"grpo": {"beta": -1}}, "env_service": {"max_sessions": 0}})
    with pytest.raises(ConfigError) as err:  # at load: each section is typed by its service's class
        load_train_config(path)
    assert "  learner_service.grpo.beta: Input should be greater than or equal to 0" in str(err.value)
    with pytest.raises(ConfigError, match=r"  learner_service\.grpo\.beta: Input should be greater"):  # configs built in code too
        validate_config(yaml.safe_load(path.read_text()), TrainConfig)
    with pytest.raises(ConfigError, match="env_service: Value error, must be a mapping of EnvServiceConfig fields, not list"):
        validate_config({"env_service": ["mock"]}, TrainConfig)


def _load_error(path) -> str:
    """The ConfigError message of loading the experiment at `path` (which must fail)."""
    with pytest.raises(ConfigError) as err:
        load_train_config(path)
    return str(err.value)


def test_job_and_service_section_errors_are_named_together(tmp_path):
    """A bad job field does not hide a bad service field: one load names both."""
    path = _write(tmp_path, {"run": {"steps": -3}, "learner_service": {"optim": {"lr": "fast"}},
                             "rollout_service": {"engine": {"kv_cache_gib": -1}}})
    text = _load_error(path)
    assert "  run.steps: Input should be greater than or equal to 1" in text
    assert "  learner_service.optim.lr: Input should be a valid number" in text
    assert "  rollout_service.engine.kv_cache_gib: Input should be greater than 0" in text
    assert "env_service" not in text  # a section the file does not write is not blamed


def test_service_sections_are_typed_and_dump_as_written(tmp_path):
    """Each service section is its service's own config class, merged over what the job derives
    (LAUNCH where only the start knows it); model_dump writes the sections as the file did, so a
    dumped experiment loads back to the same one."""
    from sinkflex_rl.config import LAUNCH, TrainConfig
    from env_service.config import EnvServiceConfig
    from learner_service.config import LearnerConfig
    from rollout_service.config import RolloutConfig
    from sinkflex.config import validate_config

    path = _write(tmp_path, {"learner_service": {"grpo": {"beta": 0.02}}, "rollout": {"temperature": 0.7}})
    cfg = load_train_config(path)
    assert isinstance(cfg.learner_service, LearnerConfig) and isinstance(cfg.rollout_service, RolloutConfig)
    assert isinstance(cfg.env_service, EnvServiceConfig)
    assert cfg.learner_service.grpo.beta == 0.02 and cfg.learner_service.grpo.temperature == 0.7  # the file's, and the job's
    assert cfg.learner_service.batch.groups_per_step == cfg.task.tasks_per_step
    assert cfg.rollout_service.agent.temperature == 0.7 and cfg.rollout_service.engine.model == LAUNCH
    assert cfg.learner_service.model.path == LAUNCH and cfg.learner_service.optim.total_steps == cfg.run.steps
    dumped = cfg.model_dump(mode="json")
    assert dumped["learner_service"] == cfg.section("learner_service") and dumped["learner_service"]["grpo"] == {"beta": 0.02}
    assert "model" not in dumped["learner_service"] and "model" not in dumped["rollout_service"]["engine"]  # derived: not written
    again = validate_config(dumped, TrainConfig)
    assert again == cfg and again.model_dump(mode="json") == dumped
    launched = service_configs(cfg, "/m", ADDRS, "redis://x", None)  # at launch: the same sections, real values
    assert launched["learner_service"].model.path == "/m" and launched["learner_service"].grpo == cfg.learner_service.grpo


def test_missing_and_non_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_train_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as err:
        load_train_config(bad)
    assert f'in "{bad}", line' in str(err.value) and "<unicode string>" not in str(err.value)  # the file, located
    with pytest.raises(ConfigError, match="is a directory"):
        load_train_config(tmp_path)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_train_config(binary)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_train_config(listing)
    for text in ("", "\n", "# run:\n#   steps: 3\n"):  # nothing, or only comments: a mistake, not "defaults"
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        with pytest.raises(ConfigError, match=r"empty\.yaml is empty \(no YAML document\)"):
            load_train_config(empty)
    explicit = tmp_path / "defaults.yaml"
    explicit.write_text("{}\n")
    assert load_train_config(explicit).run.steps == TrainConfig().run.steps


def test_generated_tasks_need_the_local_launcher_a_warm_start_does_not(tmp_path):
    from sinkflex_rl.config import TrainConfig
    from sinkflex.config import ConfigError, validate_config

    services = {f"{k}_address": "127.0.0.1:1" for k in ("env", "reward", "rollout", "learner")}
    # running services (compose): the warm-start job wrote the demonstrations, the learner trains on them
    external = validate_config({"services": services, "warm_start": {"enabled": True}}, TrainConfig)
    assert external.warm_start.enabled and external.services.external()
    with pytest.raises(ConfigError, match="task.generate needs the local launcher"):
        validate_config({"services": services, "task": {"env": "mock", "generate": {"train": 4, "test": 2}}}, TrainConfig)
    with pytest.raises(ConfigError, match="task.generate makes tasks for τ²-Bench.s mock domain only"):
        validate_config({"task": {"env": "retail", "generate": {"train": 4, "test": 2}}, "models": {"user_simulator": None},
                         "services": {}}, TrainConfig)
    cfg = validate_config({"task": {"env": "mock", "solo_mode": True, "generate": {"train": 4, "test": 2}},
                           "warm_start": {"enabled": True}, "models": {"user_simulator": None}}, TrainConfig)
    assert cfg.warm_start.enabled and cfg.task.generate.train == 4


def test_a_bad_service_field_fails_at_load_not_at_launch(tmp_path):
    from sinkflex_rl.config import load_train_config
    from sinkflex.config import ConfigError

    for section, field, msg in [("env_service", {"bogus_field": 1}, "  env_service.bogus_field: Extra inputs"),
                                ("learner_service", {"optim": {"lr": -1}}, "  learner_service.optim.lr"),
                                ("rollout_service", {"agent": {"max_turns": 0}}, "  rollout_service.agent.max_turns")]:
        path = tmp_path / f"{section}.yaml"
        path.write_text(yaml.safe_dump({section: field}))
        with pytest.raises(ConfigError, match=msg) as err:
            load_train_config(path)
        assert str(path) in str(err.value)


def test_a_generated_task_set_is_not_reused_with_other_settings(tmp_path):
    from sinkflex_rl.config import TrainConfig
    from sinkflex_rl.local import prepare_task_files
    from sinkflex.config import ConfigError, validate_config

    def cfg(train):
        return validate_config({"run": {"output_dir": str(tmp_path / "run")}, "models": {"user_simulator": None},
                                "task": {"env": "mock", "solo_mode": True, "generate": {"train": train, "test": 2}}}, TrainConfig)

    (files,) = prepare_task_files(cfg(4))
    assert (tmp_path / "run" / "tasks" / "tasks.json").is_file()
    assert prepare_task_files(cfg(4)) == [files]  # the same settings: reused
    with pytest.raises(ConfigError, match="delete the folder or choose another run.output_dir"):
        prepare_task_files(cfg(6))


def test_stratified_order_deals_strata_round_robin():
    from sinkflex_rl.controller import stratified_order

    ids = ["c1", "c2", "s1", "c3", "u1", "s2", "c4", "u2"]
    kind = {i: {"c": "create", "s": "status", "u": "update"}[i[0]] for i in ids}
    out = stratified_order(ids, kind)
    assert sorted(out) == sorted(ids)
    assert out == ["c1", "s1", "u1", "c2", "s2", "u2", "c3", "c4"]  # each stratum keeps its own order
    # every block of 3 while all strata last holds one of each
    assert all(len({kind[i] for i in out[k : k + 3]}) == 3 for k in (0, 3))
    assert stratified_order([], {}) == []
    assert stratified_order(["a", "b"], {}) == ["a", "b"]  # no strata known: the order is kept


def test_per_purpose_breaks_validation_down_by_task_purpose():
    from sinkflex_rl.controller import per_purpose

    rewards = {"c1": [1.0, 0.0], "c2": [1.0, 1.0], "s1": [0.0, 0.0], "x": [1.0], "empty": []}
    purpose = {"c1": "Create a task.", "c2": "Create a task.", "s1": "Set a status."}
    out = per_purpose(rewards, purpose)
    assert {p: (v["tasks"], v["mean_at_1"]) for p, v in out.items()} == {
        "": (1, 1.0),  # a task with no known purpose
        "Create a task.": (2, 0.75), "Set a status.": (1, 0.0)}
    # each with its 95 % t interval over the family's tasks (zero width for one task)
    assert (out["Set a status."]["ci_low"], out["Set a status."]["ci_high"]) == (0.0, 0.0)
    # two task means 0.5 and 1.0: 0.75 ± t(0.975, 1) · 0.25 = 0.75 ± 12.7062 · 0.25
    assert out["Create a task."]["ci_high"] - 0.75 == pytest.approx(12.7062 * 0.25, rel=1e-4)
    assert list(out) == sorted(out) and per_purpose({}, {}) == {}


def test_duplicate_keys_bad_optimiser_values_and_rules_between_fields_are_clear(tmp_path):
    """A key written twice is an error (PyYAML would keep the last one silently); AdamW's betas
    and the scheduler name are checked at load; a rule between fields is reported as its own
    message, which names the fields (no ``<root>: Value error,`` prefix)."""
    path = tmp_path / "dup.yaml"
    path.write_text("run:\n  name: x\nrun:\n  name: y\n")
    with pytest.raises(ConfigError, match="not valid YAML: duplicate key 'run'"):
        load_train_config(path)
    demo = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
    for override, message in [
        ("learner_service.optim.betas=[0.9, 2]", "  learner_service.optim.betas: Value error, each of AdamW's betas must be in [0, 1)"),
        ("learner_service.optim.scheduler=nosuch", "  learner_service.optim.scheduler: Input should be 'constant'"),
        ("learner_service=5", "\n  learner_service: Value error, must be a mapping of LearnerConfig fields, not int"),
        ("learner_service.grpo.temperature=0.5", "\n  learner_service.grpo.temperature: Value error, "
                                                 "learner_service.grpo.temperature is derived from rollout.temperature"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_train_config(demo, [override])
        assert message in str(err.value) and "<root>" not in str(err.value), (override, str(err.value))


def test_null_sections_non_mapping_sections_and_yaml_floats(tmp_path):
    """A job section written as null or empty means its defaults (as a service section does);
    every service section that is not a mapping is named along with the job's errors; ``1e-5``
    reads as a float in the file and in --set (YAML 1.2, not PyYAML's 1.1 string)."""
    from sinkflex_rl.config import TrainConfig

    empty = tmp_path / "null_sections.yaml"
    empty.write_text("run:\nlocal: null\nlearner_service:\n")
    assert load_train_config(empty).run == TrainConfig().run
    bad = tmp_path / "shapes.yaml"
    bad.write_text("run: [1, 2]\nlearner_service: [a]\nenv_service: 5\n")
    text = _load_error(bad)
    assert "  run: Input should be a valid dictionary" in text
    assert "  learner_service: Value error, must be a mapping of LearnerConfig fields, not list" in text
    assert "  env_service: Value error, must be a mapping of EnvServiceConfig fields, not int" in text
    floats = tmp_path / "floats.yaml"
    floats.write_text("learner_service:\n  optim:\n    lr: 3e-5\n")
    cfg = load_train_config(floats, ["learner_service.grpo.clip_eps_low=1e-1"])
    assert cfg.section("learner_service")["optim"]["lr"] == 3e-5 and cfg.section("learner_service")["grpo"]["clip_eps_low"] == 0.1


def test_an_error_names_the_value_given_unless_the_field_may_hold_a_credential():
    """``run.steps: Input should be ... (got -1)``: the scalar that was refused, cut at 80 characters;
    never the value of a key, password, token or URL field (it may be a credential)."""
    demo = ROOT / "configs" / "demo.yaml"
    for override, line in [
        ("run.steps=-1", "  run.steps: Input should be greater than or equal to 1 (got -1)"),
        ("rollout.temperature=hot", "  rollout.temperature: Input should be a valid number, unable to parse string as a number (got 'hot')"),
        ("run.steps=null", "  run.steps: Input should be a valid integer (got None)"),
        (f"rollout.temperature={'h' * 500}", f"  rollout.temperature: Input should be a valid number, unable to parse string as a number (got '{'h' * 50}"),
        ("env_service.user_api_key=12345", "  env_service.user_api_key: Input should be a valid string"),
        ("services.redis_url=12345", "  services.redis_url: Input should be a valid string"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_train_config(demo, [override])
        got = str(err.value).splitlines()[1]
        assert got.startswith(line) and len(got) < 250, (override, got)
        assert "12345" not in str(err.value)  # nor the header, which repeats the --set: "user_api_key=<hidden>"


def test_a_credential_given_with_set_is_never_repeated_and_messages_stay_one_line_a_piece(tmp_path):
    demo = ROOT / "configs" / "demo.yaml"
    for override in ["logging.mlflow.tracking_uri=5", "services.redis_url=[redis://:hunter2@host", "env_service.user_api_key=[5"]:
        with pytest.raises(ConfigError) as err:
            load_train_config(demo, [override])
        text = str(err.value)
        assert override.partition("=")[0] + "=<hidden>" in text and override.partition("=")[2] not in text, text
    with pytest.raises(ConfigError, match=r"\(got -5\)"):  # a token *id* is no credential
        load_train_config(demo, ["learner_service.batch.pad_token_id=-5"])
    secret = tmp_path / "secret.yaml"
    secret.write_text('services:\n  redis_url: "redis://:FILE-SECRET@host:6379"\n')
    with pytest.raises(ConfigError) as err:
        load_train_config(secret, ["services.redis_url.db=1"])
    assert "FILE-SECRET" not in str(err.value) and "services.redis_url is set, not a section" in str(err.value)
    # a name from the file quoted in a validator's message cannot start a line of its own
    forged = tmp_path / "forged.yaml"
    forged.write_text('reward_service:\n  task_files: {"evil\\n  run.steps: fine\\u202e": [" "]}\n')
    text = _load_error(forged)
    assert len(text.splitlines()) == 2 and "evil\\n  run.steps: fine\\u202e" in text, text


def test_error_messages_are_bounded(tmp_path):
    """A config of junk gets a bounded message: at most MAX_ERRORS_SHOWN errors, long names cut."""
    from sinkflex.config import MAX_ERRORS_SHOWN

    junk = tmp_path / "junk.yaml"
    junk.write_text("run:\n" + "".join(f"  typo_{i}: 1\n" for i in range(500)) + f"  ? {'k' * 100_000}\n  : 1\n")
    with pytest.raises(ConfigError) as err:
        load_train_config(junk)
    text = str(err.value)
    assert len(text) < 20_000 and f"... and {501 - MAX_ERRORS_SHOWN} more" in text


@pytest.mark.parametrize("name", ["", "../../tmp/x", "a/b", ".hidden", "x" * 101])
def test_run_name_is_one_folder_name(tmp_path, name):
    """run.name becomes runs/<name>: an empty name, a path or a 101-character name is refused."""
    with pytest.raises(ConfigError, match=r"run\.name: String should match pattern"):
        load_train_config(_write(tmp_path, {"run": {"name": name}}))


@pytest.mark.parametrize(("override", "line"), [
    ("rollout.group_sise=4", "rollout.group_sise: Extra inputs are not permitted (did you mean 'group_size'?)"),
    ("learner_service.optim.lrr=1e-5", "learner_service.optim.lrr: Extra inputs are not permitted (did you mean 'lr'?)"),
    ("rollout_service.engine.dtyp=auto", "rollout_service.engine.dtyp: Extra inputs are not permitted (did you mean 'dtype'?)"),
    ("learner_servce.optim.lr=1e-5", "learner_servce: Extra inputs are not permitted (did you mean 'learner_service'?)"),
    ("zzz=1", "zzz: Extra inputs are not permitted\n"),  # nothing close: no suggestion
    # the exact name at another place beats a close one here
    ("rollout.tool_format=qwen3", "rollout.tool_format: Extra inputs are not permitted ('tool_format' is a field of rollout_service.agent)"),
])
def test_an_unknown_field_gets_the_closest_known_name(override, line):
    """A misspelt field, in a job section, a service section (typed at load) or at the top, is
    named with the closest field at its place (the experiment's schema, difflib)."""
    with pytest.raises(ConfigError) as err:
        load_train_config(ROOT / "configs" / "demo.yaml", overrides=[override])
    assert "  " + line in str(err.value) + "\n"


def test_a_service_config_suggests_too():
    from learner_service.config import LearnerConfig
    from sinkflex.config import validate_config

    with pytest.raises(ConfigError, match=r"optim\.weight_decy: Extra inputs are not permitted \(did you mean 'weight_decay'\?\)"):
        validate_config({"run_dir": "/tmp/x", "model": {"path": "/tmp/m"}, "optim": {"weight_decy": 0.1}}, LearnerConfig)


def test_config_errors_escape_control_characters_and_bound_the_overrides(tmp_path):
    """(break-it findings) a field name with a newline or a bidi control cannot forge or reorder
    lines of the message; the header names at most 20 overrides, each cut; `[index]` in a --set
    name is explained, not taken for a misspelt field."""
    bad = tmp_path / "nl.yaml"
    bad.write_text('rollout:\n  "group_sise\\nrollout.x: fake\\u202e": 3\n')
    with pytest.raises(ConfigError) as err:
        load_train_config(bad)
    lines = str(err.value).splitlines()
    assert lines[1] == "  rollout.group_sise\\nrollout.x: fake\\u202e: Extra inputs are not permitted" and len(lines) == 2
    with pytest.raises(ConfigError) as err:
        load_train_config(ROOT / "configs" / "demo.yaml", overrides=[f"run.name={'x' * 1000}"] * 30 + ["run.nmae=1"])
    header = str(err.value).splitlines()[0]
    assert len(header) < 20 * 210 + 600 and "(and 11 more --set)" in header
    with pytest.raises(ConfigError, match=r"local\.gpus\[0\]: Extra inputs are not permitted \(--set takes no \[index\]"):
        load_train_config(ROOT / "configs" / "demo.yaml", overrides=["local.gpus[0]=3"])


def test_learner_run_dir_is_the_run_folders(tmp_path):
    """learner_service.run_dir is where the driver resumes from and reads the learner's metrics:
    derived from the run folder, and not writable in the section (naming where it comes from)."""
    with pytest.raises(ConfigError, match=r"learner_service\.run_dir is derived from run\.output_dir"):
        load_train_config(ROOT / "configs" / "demo.yaml", overrides=["learner_service.run_dir=/tmp/elsewhere"])
    out = tmp_path / "run"
    cfg = load_train_config(ROOT / "configs" / "demo.yaml", overrides=[f"run.output_dir={out}"])
    assert cfg.learner_service.run_dir == str(out / "learner")
