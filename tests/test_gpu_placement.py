"""GPU placement of the local launcher (sinkflex_rl/placement.py, README "On a GPU box"), all on CPU:
the split on several layouts, the refusals by name, each launched process's CUDA_VISIBLE_DEVICES
and torchrun --nproc_per_node, the CPU default unchanged, and scripts/bootstrap-gpu.sh exiting 1
before installing anything on a machine without an NVIDIA GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollout_service.engine import resolve_engine_dtype
from sinkflex_rl.config import LocalConfig, load_train_config
from sinkflex_rl.local import OFFLINE
from sinkflex_rl.placement import Placement, place, visible_gpus
from sinkflex.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EIGHT = [str(i) for i in range(8)]


# -- the pure function -----------------------------------------------------------------------
def test_eight_gpus_engine_two_learner_six():
    p = place(LocalConfig(engine_gpus=2), EIGHT)
    assert p.cuda_visible_devices == {"env": "", "reward": "", "rollout": "0,1", "learner": "2,3,4,5,6,7"}
    assert (p.learner_nproc, p.engine_tp, p.user_sim_tp, p.gpu_memory_utilization) == (6, 2, 0, None)
    assert p.env("env") == {"CUDA_VISIBLE_DEVICES": ""} and p.env("learner") == {"CUDA_VISIBLE_DEVICES": "2,3,4,5,6,7"}


def test_eight_gpus_with_a_user_simulator_and_learner_procs_that_agree():
    p = place(LocalConfig(engine_gpus=1, user_sim_gpus=1, learner_procs=6), EIGHT, user_sim=True)
    assert p.cuda_visible_devices == {"env": "", "reward": "", "rollout": "0", "user_sim": "1", "learner": "2,3,4,5,6,7"}
    assert (p.learner_nproc, p.engine_tp, p.user_sim_tp) == (6, 1, 1)


def test_listed_gpus_in_their_order_and_uuids():
    p = place(LocalConfig(gpus=[6, 7, 3]), EIGHT)
    assert p.cuda_visible_devices["rollout"] == "6" and p.cuda_visible_devices["learner"] == "7,3"
    uuids = ["GPU-aaa", "GPU-bbb"]
    assert place(LocalConfig(), uuids).cuda_visible_devices["learner"] == "GPU-bbb"


def test_one_gpu_is_shared_only_when_asked():
    with pytest.raises(ConfigError, match=r"the learner would get 0 GPUs: 1 visible GPU\(s\) \['0'\], all taken by "
                                          r"local.engine_gpus 1; .*local.share_gpus: true"):
        place(LocalConfig(), ["0"])
    p = place(LocalConfig(share_gpus=True), ["0"], user_sim=True)
    assert p.cuda_visible_devices == {"env": "", "reward": "", "rollout": "0", "user_sim": "0", "learner": "0"}
    assert (p.learner_nproc, p.engine_tp, p.user_sim_tp, p.gpu_memory_utilization) == (1, 1, 1, 0.3)
    p = place(LocalConfig(share_gpus=True, engine_gpus=2, shared_gpu_memory_utilization=0.25), ["0", "1"])
    assert p.cuda_visible_devices["rollout"] == "0,1" and p.learner_nproc == 2 and p.gpu_memory_utilization == 0.25


@pytest.mark.parametrize("local, visible, user_sim, message", [
    (dict(engine_gpus=9), EIGHT, False, r"local.engine_gpus 9 = 9 GPU\(s\) asked, but the run has 8 \(8 visible GPU"),
    (dict(engine_gpus=4, user_sim_gpus=5), EIGHT, True,
     r"local.engine_gpus 4 \+ local.user_sim_gpus 5 = 9 GPU\(s\) asked, but the run has 8"),
    (dict(engine_gpus=3, share_gpus=True), ["0", "1"], False,
     r"local.engine_gpus 3 with local.share_gpus: 3 GPU\(s\) asked, but the run has 2"),
    (dict(gpus=[0, 1, 8]), EIGHT, False, r"local.gpus asks for 3 GPU\(s\) \['0', '1', '8'\], but \['8'\] not visible "
                                         r"\(8 visible"),
    (dict(gpus=[0]), [], False, r"local.gpus asks for 1 GPU\(s\) \['0'\], but \['0'\] not visible \(0 visible: \[\]"),
    (dict(gpus=[1, 1, 2]), EIGHT, False, r"local.gpus lists \['1'\] more than once"),
    (dict(engine_gpus=1, user_sim_gpus=1), ["0", "1"], True, r"the learner would get 0 GPUs: 2 visible GPU\(s\) "
                                                             r"\['0', '1'\], all taken by local.engine_gpus 1 \+ "
                                                             r"local.user_sim_gpus 1"),
    (dict(learner_procs=8), EIGHT, True, r"local.learner_procs \(8\) disagrees with the GPU split: 8 GPU\(s\) - "
                                         r"local.engine_gpus 1 \+ local.user_sim_gpus 1 = 6 learner GPU\(s\).*"
                                         r"set local.learner_procs: 6"),
    (dict(learner_procs=1, share_gpus=True), ["0", "1"], False, r"local.learner_procs \(1\) disagrees .*2 GPU\(s\) "
                                                                r"shared by all"),
])
def test_refusals_name_the_fields_and_numbers(local, visible, user_sim, message):
    with pytest.raises(ConfigError, match=message):
        place(LocalConfig(**local), visible, user_sim=user_sim)


def test_cpu_is_no_placement_and_gpus_empty_hides_them():
    assert place(LocalConfig(), []) == Placement(learner_nproc=1)
    assert place(LocalConfig(learner_procs=3, engine_gpus=4), [], user_sim=True) == Placement(learner_nproc=3)
    assert place(LocalConfig(), []).env("learner") == {}
    hidden = place(LocalConfig(gpus=[], learner_procs=2), EIGHT)
    assert not hidden.on_gpus and hidden.learner_nproc == 2
    assert {p: hidden.env(p) for p in ("env", "rollout", "learner")} == {p: {"CUDA_VISIBLE_DEVICES": ""}
                                                                         for p in ("env", "rollout", "learner")}


def test_visible_gpus(tmp_path):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ["2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == [] and visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert visible_gpus({"PATH": str(tmp_path)}) == []  # no nvidia-smi on PATH: no NVIDIA driver
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0\\n1\\n'\n")
    smi.chmod(0o755)
    assert visible_gpus({}, nvidia_smi=str(smi)) == ["0", "1"]
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2; exit 9\n")
    assert visible_gpus({}, nvidia_smi=str(smi)) == []


def test_config_time_refusal_and_the_gpt_oss_config():
    cfg = load_train_config(ROOT / "configs" / "gpt-oss-20b.yaml")
    p = place(cfg.local, EIGHT, user_sim=cfg.launches_user_sim())
    assert p.cuda_visible_devices == {"env": "", "reward": "", "rollout": "0", "user_sim": "1", "learner": "2,3,4,5,6,7"}
    assert p.learner_nproc == cfg.local.learner_procs == 6
    with pytest.raises(ConfigError, match=r"local.learner_procs \(8\) disagrees with the GPU split"):
        load_train_config(ROOT / "configs" / "gpt-oss-20b.yaml", ["local.learner_procs=8"])
    with pytest.raises(ConfigError, match=r"local.engine_gpus 8 \+ local.user_sim_gpus 1 = 9 GPU\(s\) asked"):
        load_train_config(ROOT / "configs" / "gpt-oss-20b.yaml", ["local.engine_gpus=8", "local.learner_procs=1"])


# -- the launcher's processes -----------------------------------------------------------------
class RecordingLauncher:
    """Records the specs launch_local starts, starts nothing."""

    def __init__(self):
        self.specs = []

    def start_all(self, specs, ready_timeout=0.0):
        self.specs.extend(specs)
        return specs


def _launch(monkeypatch, tmp_path, config, overrides=(), visible=None):
    import sinkflex_rl.local as local

    monkeypatch.setattr(local, "resolve_model", lambda name, hub=None: str(tmp_path / "model"))
    monkeypatch.setattr(local, "prepare_task_files", lambda cfg: [])
    monkeypatch.setattr(local, "check_task_selection", lambda *a, **k: None)  # the task files above are not written
    monkeypatch.setattr(local, "write_demonstrations_for", lambda *a, **k: None)
    cfg = load_train_config(ROOT / "configs" / config, [f"run.output_dir={tmp_path / 'run'}",
                                                        "services.redis_url=redis://127.0.0.1:1/0", *overrides])
    launcher = RecordingLauncher()
    local.launch_local(cfg, launcher, visible=visible)
    specs = {s.name: s for s in launcher.specs}
    rollout = yaml.safe_load((cfg.run.dir() / "configs" / "rollout_service.yaml").read_text())
    return cfg, specs, rollout


def _nproc(spec) -> str:
    return next(a for a in spec.argv if a.startswith("--nproc_per_node="))


def test_launcher_env_for_each_process_on_eight_gpus(monkeypatch, tmp_path):
    _, specs, rollout = _launch(monkeypatch, tmp_path, "retail.yaml", ["local.engine_gpus=2"], visible=EIGHT)
    cvd = {name: s.env.get("CUDA_VISIBLE_DEVICES") for name, s in specs.items()}
    assert cvd == {"env": "", "reward": "", "user_sim": "2", "rollout": "0,1", "learner": "3,4,5,6,7"}
    assert all(s.env.get("REDIS_URL") == "redis://127.0.0.1:1/0" for n, s in specs.items() if n != "user_sim")
    assert _nproc(specs["learner"]) == "--nproc_per_node=5"
    assert rollout["engine"]["tensor_parallel_size"] == 2 and rollout["engine"]["gpu_memory_utilization"] is None
    assert specs["user_sim"].argv[-2:] == ["--tensor-parallel-size", "1"]


def test_launcher_on_one_shared_gpu(monkeypatch, tmp_path):
    _, specs, rollout = _launch(monkeypatch, tmp_path, "demo.yaml", ["local.share_gpus=true"], visible=["0"])
    assert {n: s.env.get("CUDA_VISIBLE_DEVICES") for n, s in specs.items()} == {"env": "", "reward": "", "rollout": "0",
                                                                                  "learner": "0"}
    assert _nproc(specs["learner"]) == "--nproc_per_node=1"
    assert rollout["engine"]["tensor_parallel_size"] == 1 and rollout["engine"]["gpu_memory_utilization"] == 0.3


def test_launcher_refuses_before_starting_anything(monkeypatch, tmp_path):
    import sinkflex_rl.local as local

    launcher = RecordingLauncher()
    cfg = load_train_config(ROOT / "configs" / "demo.yaml", [f"run.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="the learner would get 0 GPUs"):
        local.launch_local(cfg, launcher, visible=["0"])
    cfg = load_train_config(ROOT / "configs" / "demo.yaml", [f"run.output_dir={tmp_path / 'run'}",
                                                             "rollout_service.engine.tensor_parallel_size=4"])
    with pytest.raises(ConfigError, match=r"rollout_service.engine.tensor_parallel_size \(4\) disagrees with "
                                          r"local.engine_gpus \(1\)"):
        local.launch_local(cfg, launcher, visible=EIGHT)
    assert launcher.specs == [] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("config", ["demo.yaml", "retail.yaml"])
def test_cpu_default_argv_and_env_unchanged(monkeypatch, tmp_path, config):
    """No GPU visible (CUDA_VISIBLE_DEVICES unset, no nvidia-smi on PATH, as on this machine):
    exactly the commands and environments the launcher built before placement existed (the
    rollout engine's CPU core binding, `local.engine_cpu_threads_bind`, the learner's malloc
    settings, `local.learner_glibc_tunables`, and the user simulator's --dtype and cores,
    `local.user_sim_dtype` and `local.user_sim_cpu_threads_bind`, aside)."""
    from sinkflex_rl.local import engine_cpu_env, learner_cpu_env

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                               if not (Path(p) / "nvidia-smi").exists()))
    cfg, specs, rollout = _launch(monkeypatch, tmp_path, config)  # visible: detected
    redis = {"REDIS_URL": "redis://127.0.0.1:1/0", **OFFLINE}  # services run offline (local folders only)
    cfgs = cfg.run.dir() / "configs"
    py = sys.executable
    for name, module in [("env", "env_service"), ("reward", "reward_service"), ("rollout", "rollout_service")]:
        port = specs[name].address.rsplit(":", 1)[1]
        assert specs[name].argv == [py, "-m", module, "--config", str(cfgs / f"{module}.yaml"), "--port", port,
                                    "--no-metrics"]
        engine = engine_cpu_env("all", user_sim_bind="all" if config == "retail.yaml" else None) if name == "rollout" else {}
        assert specs[name].env == {**redis, **engine}
    port = specs["learner"].address.rsplit(":", 1)[1]
    assert specs["learner"].argv == [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                                     "-m", "learner_service", "--config", str(cfgs / "learner_service.yaml"), "--port", port,
                                     "--no-metrics"]
    assert specs["learner"].env == {**redis, **learner_cpu_env(cfg.local, on_gpus=False)}
    if config == "retail.yaml":
        sim = specs["user_sim"]
        assert sim.env == {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0)))), **OFFLINE}
        assert sim.argv[:3] == [py, "-m", "vllm.entrypoints.openai.api_server"]
        flags = dict(zip(sim.argv[3::2], sim.argv[4::2]))
        assert {k: flags[k] for k in ("--dtype", "--seed", "--served-model-name", "--host")} == {
            "--dtype": resolve_engine_dtype("auto"), "--seed": str(cfg.run.seed), "--served-model-name": "user-sim",
            "--host": "127.0.0.1"}
        assert flags["--kv-cache-memory-bytes"] == str(int(cfg.local.user_sim_kv_cache_gib * (1 << 30)))
        assert sim.argv[-2:] == ["--enforce-eager", "--disable-log-stats"]
        assert "--tensor-parallel-size" not in sim.argv and "--gpu-memory-utilization" not in sim.argv
    else:
        assert "user_sim" not in specs
    assert rollout["engine"]["tensor_parallel_size"] == 1 and rollout["engine"]["gpu_memory_utilization"] is None


def test_cpu_engine_arguments_unchanged():
    """The vLLM engine's keyword arguments on CPU: tensor parallelism and memory fraction are
    added only when placed on GPUs (read from the source: constructing an Engine starts vLLM)."""
    src = (ROOT / "rollout_service" / "engine.py").read_text()
    assert 'if tensor_parallel_size != 1:' in src and 'if gpu_memory_utilization is not None:' in src


# -- scripts/bootstrap-gpu.sh without a GPU -----------------------------------------------------
SCRIPT = ROOT / "scripts" / "bootstrap-gpu.sh"


def _path_without_nvidia_smi(extra: Path | None = None) -> str:
    dirs = [p for p in os.environ["PATH"].split(os.pathsep) if p and not (Path(p) / "nvidia-smi").exists()]
    return os.pathsep.join([str(extra), *dirs] if extra else dirs)


def _bootstrap_gpu(tmp_path, *args, path, venv=None):
    venv = venv or tmp_path / "venv-gpu"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "SINKFLEX_VENV", "CUDA_VISIBLE_DEVICES")}
    env.update(PATH=path, SINKFLEX_VENV=str(venv), PYTHON=sys.executable)
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)


def _fake_smi(tmp_path, body: str) -> Path:
    fake = tmp_path / "fakebin"
    fake.mkdir(exist_ok=True)
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + body + "\n")
    smi.chmod(0o755)
    return fake


def test_bootstrap_gpu_without_nvidia_smi_exits_1_before_installing(tmp_path):
    venv = tmp_path / "venv-gpu"
    r = _bootstrap_gpu(tmp_path, path=_path_without_nvidia_smi())  # a real install run, not --check
    assert r.returncode == 1
    assert r.stderr.strip().startswith("[bootstrap-gpu] error: no NVIDIA GPU driver: nvidia-smi is not on PATH.")
    assert "on a CPU machine use scripts/bootstrap.sh" in r.stderr
    assert "installing" not in r.stderr and r.stdout == ""
    assert not venv.exists()


def test_bootstrap_gpu_with_a_failing_driver_exits_1_before_installing(tmp_path):
    fake = _fake_smi(tmp_path, "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9")
    r = _bootstrap_gpu(tmp_path, path=_path_without_nvidia_smi(fake))
    assert r.returncode == 1
    assert "[bootstrap-gpu] error: nvidia-smi failed (no NVIDIA GPU, or the driver is not loaded): NVIDIA-SMI has failed" \
        in r.stderr
    assert not (tmp_path / "venv-gpu").exists()


def test_bootstrap_gpu_check_with_a_gpu_and_a_cpu_torch_venv(tmp_path):
    fake = _fake_smi(tmp_path, "echo '0, NVIDIA H100 80GB HBM3, 81559 MiB'")
    r = _bootstrap_gpu(tmp_path, "--check", path=_path_without_nvidia_smi(fake))
    assert r.returncode == 0, r.stderr
    assert "[bootstrap-gpu] GPUs: 0, NVIDIA H100 80GB HBM3, 81559 MiB" in r.stderr
    assert not (tmp_path / "venv-gpu").exists()
    # an existing venv whose torch is the CPU build (this project's .venv; only read, and --check
    # never installs): refused by name
    cpu_venv = Path(sys.executable).parent.parent
    r = _bootstrap_gpu(tmp_path, "--check", path=_path_without_nvidia_smi(fake), venv=cpu_venv)
    assert r.returncode == 1
    assert f"torch in {cpu_venv} does not see CUDA (torch.cuda.is_available() is False)" in r.stderr
    assert "installing" not in r.stderr


def test_cpu_user_sim_threads_bind():
    """local.user_sim_cpu_threads_bind → the user simulator's VLLM_CPU_OMP_THREADS_BIND."""
    from sinkflex_rl.local import user_sim_cpu_env

    assert user_sim_cpu_env("all", cores=[0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1"}
    assert user_sim_cpu_env("last", cores=[0, 1, 2]) == {"VLLM_CPU_OMP_THREADS_BIND": "2"}
    assert user_sim_cpu_env("0-3") == {"VLLM_CPU_OMP_THREADS_BIND": "0-3"}
    assert set(user_sim_cpu_env("all")["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == {str(c) for c in os.sched_getaffinity(0)}


@pytest.mark.parametrize("bind", ["all", "last"])
def test_no_cores_to_bind_is_an_error_that_says_so(bind):
    from sinkflex_rl.local import engine_cpu_env, user_sim_cpu_env

    with pytest.raises(ValueError, match="core list is empty"):
        user_sim_cpu_env(bind, cores=[])
    with pytest.raises(ValueError, match="core list is empty"):
        engine_cpu_env("all", user_sim_bind=bind, cores=[])
    assert user_sim_cpu_env("0-1", cores=[]) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}  # passed through: no cores read


@pytest.mark.parametrize("bind, engine_nice", [("all", True), ("last", False), ("1", False)])
def test_user_simulator_server_cores_and_priority(monkeypatch, tmp_path, bind, engine_nice):
    """The launcher gives the user simulator's server `local.user_sim_cpu_threads_bind` and, on every
    core beside the engine, the engine's lower priority; the engine leaves out the last core only
    when the user simulator has it alone."""
    import sinkflex_rl.local as local
    from sinkflex_rl.local import engine_cpu_env, user_sim_cpu_env

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _, specs, _ = _launch(monkeypatch, tmp_path, "retail.yaml", [f"local.user_sim_cpu_threads_bind={bind}"], visible=[])
    assert specs["user_sim"].env == {**user_sim_cpu_env(bind), **OFFLINE}
    assert specs["user_sim"].nice == (local.ENGINE_NICE if engine_nice else 0)
    assert specs["rollout"].env["VLLM_CPU_OMP_THREADS_BIND"] == engine_cpu_env("all", user_sim_bind=bind)["VLLM_CPU_OMP_THREADS_BIND"]
    assert specs["rollout"].nice == local.ENGINE_NICE


def test_cpu_engine_threads_bind():
    """local.engine_cpu_threads_bind → vLLM's OpenMP variables for the CPU rollout engine."""
    from sinkflex_rl.local import engine_cpu_env

    assert engine_cpu_env("all", cores=[0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    # a local user simulator on every core shares them; bound to the last alone, the engine keeps the others
    assert engine_cpu_env("all", user_sim_bind="all", cores=[0, 1])["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert engine_cpu_env("all", user_sim_bind="last", cores=[0, 1, 2])["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert engine_cpu_env("all", user_sim_bind="last", cores=[3])["VLLM_CPU_OMP_THREADS_BIND"] == "3"
    assert engine_cpu_env("all", user_sim_bind="1", cores=[0, 1])["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert engine_cpu_env("auto") == {}
    assert engine_cpu_env("nobind") == {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert set(engine_cpu_env("all")["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == {str(c) for c in os.sched_getaffinity(0)}


@pytest.mark.parametrize("overrides, expected", [
    ([], "all"),  # synchronous: the engine runs while the learner waits
    (["rollout.max_staleness=1"], "auto"),  # asynchronous: both at once, vLLM's default
    (["rollout.max_staleness=1", "local.engine_cpu_threads_bind=0"], "0"),
])
def test_cpu_engine_binding_follows_the_mode(monkeypatch, tmp_path, overrides, expected):
    import sinkflex_rl.local as local
    from sinkflex_rl.local import engine_cpu_env

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _, specs, _ = _launch(monkeypatch, tmp_path, "demo.yaml", overrides, visible=[])
    assert specs["rollout"].env == {"REDIS_URL": "redis://127.0.0.1:1/0", **OFFLINE, **engine_cpu_env(expected)}
    # bound to every core, the engine runs at a lower priority; the others as the launcher
    assert specs["rollout"].nice == (local.ENGINE_NICE if expected == "all" else 0)
    assert all(s.nice == 0 for n, s in specs.items() if n != "rollout")


def test_cpu_learner_glibc_tunables():
    """local.learner_glibc_tunables → the CPU learner's GLIBC_TUNABLES, unless GPUs, None, or the
    user's own GLIBC_TUNABLES; and a process started with it really runs under those settings."""
    import subprocess
    import sys

    from sinkflex_rl.config import LEARNER_GLIBC_TUNABLES, LocalConfig
    from sinkflex_rl.local import learner_cpu_env

    local = LocalConfig()
    assert learner_cpu_env(local, on_gpus=False, environ={}) == {"GLIBC_TUNABLES": LEARNER_GLIBC_TUNABLES}
    assert learner_cpu_env(local, on_gpus=True, environ={}) == {}
    assert learner_cpu_env(LocalConfig(learner_glibc_tunables=None), on_gpus=False, environ={}) == {}
    assert learner_cpu_env(local, on_gpus=False, environ={"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {}
    # glibc takes the default, and it works: once the heap has grown (a 256 MiB tensor), 32 MiB
    # tensors (the size from which glibc maps each allocation fresh) allocated and freed ten times
    # fault their pages in ten times by default, and are served from the heap when tuned
    code = ("import torch, resource\n"
            "for _ in range(3): torch.empty(64 << 20).fill_(1.0)\n"
            "f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "for _ in range(10): torch.empty(8 << 20).fill_(1.0)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)\n")
    faults = {}
    for name, env in (("default", {}), ("tuned", learner_cpu_env(local, on_gpus=False, environ={}))):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**{k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}, **env})
        assert out.returncode == 0, out.stderr[-2000:]
        faults[name] = int(out.stdout.split()[-1])
    assert faults["default"] > 10 * 6000 and faults["tuned"] < 1000, faults  # 8192 pages of 4 KiB each time


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_user_simulator_server_dtype(monkeypatch, tmp_path, dtype):
    """The user simulator's vLLM server gets `local.user_sim_dtype` as --dtype, auto resolved by the
    rollout engine's rule on this CPU (vLLM CPU's own default, bf16 on every CPU, is left to no one)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _, specs, rollout = _launch(monkeypatch, tmp_path, "retail.yaml", [f"local.user_sim_dtype={dtype}"], visible=[])
    argv = specs["user_sim"].argv
    want = resolve_engine_dtype(dtype, cuda=False)
    assert want in ("bfloat16", "float32") and argv[argv.index("--dtype") + 1] == want
    assert rollout["engine"]["dtype"] == "auto"  # the policy engine's own setting is its own


@pytest.mark.parametrize("bind", ["LAST", "abc", "-1", "0 1", ""])
def test_user_simulator_cores_refuse_what_vllm_cannot_read(tmp_path, bind):
    with pytest.raises(ConfigError, match=r"local.user_sim_cpu_threads_bind"):
        load_train_config(ROOT / "configs" / "demo-dual.yaml", [f"run.output_dir={tmp_path}", f"local.user_sim_cpu_threads_bind={bind!r}"])


@pytest.mark.parametrize("bind", ["ALL", "last", "0 1", "", "0|", "cores"])
def test_engine_cores_refuse_what_vllm_cannot_read(tmp_path, bind):
    with pytest.raises(ConfigError, match=r"local.engine_cpu_threads_bind"):
        load_train_config(ROOT / "configs" / "demo.yaml", [f"run.output_dir={tmp_path}", f"local.engine_cpu_threads_bind={bind!r}"])


@pytest.mark.parametrize("field", ["engine_cpu_threads_bind", "user_sim_cpu_threads_bind"])
def test_a_core_list_written_with_a_colon_is_refused_not_read_as_base_60(tmp_path, field):
    """YAML 1.1 (PyYAML) reads an unquoted ``1:2`` as the number 62, which would pass the pattern
    as core 62; the config loader reads it as the text it is (YAML 1.2), and the pattern refuses it.
    Likewise ``010`` is core 10, not octal 8."""
    for source in ("file", "--set"):
        path, overrides = tmp_path / f"{source}.yaml", []
        if source == "file":
            path.write_text(f"run:\n  output_dir: {tmp_path}\nlocal:\n  {field}: 1:2\n")
        else:
            path.write_text(f"run:\n  output_dir: {tmp_path}\n")
            overrides.append(f"local.{field}=1:2")
        with pytest.raises(ConfigError, match=rf"local.{field}: String should match pattern"):
            load_train_config(path, overrides)  # as 62, it passed
    # YAML 1.1 reads "010" as octal 8: core 8, not core 10 (YAML 1.2, read here: 10)
    path = tmp_path / "octal.yaml"
    path.write_text(f"run:\n  output_dir: {tmp_path}\nlocal:\n  {field}: 010\n")
    assert getattr(load_train_config(path).local, field) == "10"
    from sinkflex.config import load_yaml

    assert load_yaml("a: 1:2\nb: 1:30.5\nc: 12\nd: 0x1f\ne: 1e-5\nf: 010\ng: 0o17\nh: 1_000") == \
        {"a": "1:2", "b": "1:30.5", "c": 12, "d": 31, "e": 1e-5, "f": 10, "g": 15, "h": "1_000"}


@pytest.mark.parametrize("bind, expected", [("0-3|4-7", "0-3|4-7"), ("nobind", "nobind"), ("1", "1")])
def test_engine_cores_take_vllms_own_forms(tmp_path, bind, expected):
    cfg = load_train_config(ROOT / "configs" / "demo.yaml", [f"run.output_dir={tmp_path}", f"local.engine_cpu_threads_bind={bind}"])
    assert cfg.local.engine_cpu_threads_bind == expected


def test_user_simulator_dtype_refuses_an_unknown_name(tmp_path):
    with pytest.raises(ConfigError, match=r"local.user_sim_dtype"):
        load_train_config(ROOT / "configs" / "retail.yaml", [f"run.output_dir={tmp_path}", "local.user_sim_dtype=fp8"])


def test_user_simulator_server_dtype_follows_the_placement_not_the_launcher(monkeypatch, tmp_path):
    """auto resolves for where the server runs: vLLM's own auto on the GPUs placed for it, the CPU
    rule when the run's GPUs are hidden (`local.gpus: []`) whatever the launcher's process sees."""
    _, specs, _ = _launch(monkeypatch, tmp_path / "gpu", "retail.yaml", visible=EIGHT)
    argv = specs["user_sim"].argv
    assert argv[argv.index("--dtype") + 1] == "auto"
    _, specs, _ = _launch(monkeypatch, tmp_path / "cpu", "retail.yaml", visible=[])
    argv = specs["user_sim"].argv
    assert argv[argv.index("--dtype") + 1] == resolve_engine_dtype("auto", cuda=False)
