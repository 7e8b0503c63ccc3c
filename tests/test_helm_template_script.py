"""scripts/helm_template.py: `helm template` / `helm lint` for charts/sinkflex without a helm
binary (Helm's own Go code through helm-python-sdk): what it prints, the values it merges, the
bad values it refuses (exit 1, Helm's message naming the value, no traceback), and its lint."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from tests.fixtures.deploy import CHART, ROOT, render_chart, strip

SCRIPT = ROOT / "scripts" / "helm_template.py"
sys.path.insert(0, str(ROOT / "scripts"))
import helm_template


def run(*args: str, cwd=None, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True,
                          cwd=cwd, input=stdin, timeout=60)


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def named(manifests: list[dict], kind: str) -> dict[str, dict]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def assert_refused(result: subprocess.CompletedProcess, *expected: str) -> None:
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith("Error: ") and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) <= helm_template.MAX_ERROR_LINES + 1
    for text in expected:
        assert text in result.stderr, result.stderr


# --------------------------------------------------------------------------- rendering

def test_renders_the_default_chart_like_helm_template(tmp_path):
    result = run(cwd=tmp_path)  # the default chart is found from anywhere
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.startswith("---\n# Source: sinkflex/templates/")
    manifests = docs(result.stdout)
    # helm template's defaults: release "release-name" in namespace "default"
    assert "release-name-sinkflex-learner" in named(manifests, "StatefulSet")
    assert "release-name-sinkflex-learner-worker" not in named(manifests, "StatefulSet")  # 1 node
    # Helm's install order (a NetworkPolicy first, the train Job last), then the test hook
    assert manifests[0]["kind"] == "NetworkPolicy"
    assert [m["kind"] for m in manifests[-2:]] == ["Job", "Pod"]
    assert manifests[-1]["metadata"]["annotations"]["helm.sh/hook"] == "test"
    # one `# Source:` line per object
    sources = re.findall(r"^# Source: (\S+)$", result.stdout, re.MULTILINE)
    assert len(sources) == len(manifests)


def test_same_objects_as_the_chart_fixtures():
    result = run("--release", "sf", "--namespace", "rl")
    assert result.returncode == 0, result.stderr
    mine = {(m["kind"], m["metadata"]["name"]) for m in docs(result.stdout)}
    assert mine == {(m["kind"], m["metadata"]["name"]) for m in map(strip, render_chart())}


def test_two_node_gpu_learner():
    result = run("--set", "learner.nodes=2", "--set", "learner.gpusPerNode=4", "--release", "sf", "-n", "rl")
    assert result.returncode == 0, result.stderr
    sets = named(docs(result.stdout), "StatefulSet")
    master, worker = sets["sf-sinkflex-learner"], sets["sf-sinkflex-learner-worker"]
    assert (master["spec"]["replicas"], worker["spec"]["replicas"]) == (1, 1)
    for sts in (master, worker):
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 4
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert (env["NNODES"], env["NPROC_PER_NODE"]) == ("2", "4")
    assert "nvidia.com/gpu: 4" in result.stdout


def test_values_files_merge_in_order_then_set(tmp_path):
    (tmp_path / "a.yaml").write_text("learner:\n  nodes: 3\n  gpusPerNode: 2\n")
    # a second file, in two YAML documents (Helm merges them in order too)
    (tmp_path / "b.yaml").write_text("learner:\n  gpusPerNode: 8\n---\nlearner:\n  gpusPerNode: 4\n")
    result = run("-f", str(tmp_path / "a.yaml"), "-f", str(tmp_path / "b.yaml"), "--set", "learner.nodes=2")
    assert result.returncode == 0, result.stderr
    worker = named(docs(result.stdout), "StatefulSet")["release-name-sinkflex-learner-worker"]
    assert worker["spec"]["replicas"] == 1  # nodes=2 from --set, over the first file's 3
    (c,) = worker["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4  # the last document of the last file
    # `-f -` reads stdin
    piped = run("-f", "-", stdin="learner: {nodes: 2, gpusPerNode: 4}\n")
    assert piped.returncode == 0, piped.stderr
    assert "release-name-sinkflex-learner-worker" in named(docs(piped.stdout), "StatefulSet")


def test_output_dir_and_skip_tests(tmp_path):
    out = tmp_path / "rendered"
    result = run("--output-dir", str(out), "--skip-tests")
    assert result.returncode == 0, result.stderr
    learner = (out / "sinkflex" / "templates" / "learner.yaml").read_text()
    assert learner.startswith("---\n# Source: sinkflex/templates/learner.yaml\n")
    assert {"Service", "StatefulSet"} <= {m["kind"] for m in docs(learner)}
    assert f"wrote {out}/sinkflex/templates/learner.yaml" in result.stdout
    assert not (out / "sinkflex" / "templates" / "tests").exists()  # --skip-tests
    assert "# Source: sinkflex/templates/tests/" not in run("--skip-tests").stdout


# --------------------------------------------------------------------------- refusals

def test_a_bad_values_file_is_refused_naming_the_values(tmp_path):
    bad = tmp_path / "my-values.yaml"
    bad.write_text("rollout:\n  replica: 2\n  replicas: -1\n")  # misspelt key, negative replicas
    result = run("-f", str(bad))
    assert_refused(result, "values don't meet the specifications of the schema",
                   "- at '/rollout/replicas': minimum: got -1, want 1",
                   "- at '/rollout': additional properties 'replica' not allowed")


@pytest.mark.parametrize("content, expected", [
    ("learner: [\n", "failed to parse {path}: cannot unmarshal yaml document: error converting YAML to JSON"),
    ("a: 1\n---x\n", "failed to parse {path}: error reading yaml document: invalid Yaml document separator: x"),
    (b"\xff\xfe: 1\n", "failed to parse {path}: not UTF-8 text"),
], ids=["yaml", "separator", "encoding"])
def test_an_unreadable_values_file_is_refused(tmp_path, content, expected):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert_refused(run("-f", str(bad)), expected.format(path=bad))
    assert_refused(run("-f", str(tmp_path / "missing.yaml")), f"open {tmp_path / 'missing.yaml'}: no such file")


def test_template_checks_and_bad_flags_are_refused():
    assert_refused(run("--set", "learner.nodes=0"),
                   "execution error at (sinkflex/templates/learner.yaml",
                   "learner.nodes (0) and learner.gpusPerNode (1) must be >= 1")
    assert_refused(run("--set", "learner.nodes"), "failed parsing --set data: key \"nodes\" has no value")
    assert_refused(run("--release", "Bad_Name"), 'release name "Bad_Name": invalid release name')
    assert_refused(run(str(CHART.parent / "no-such-chart")), "no such file or directory")


def test_error_block_is_bounded():
    block = helm_template.error_block("\n".join(f"line {i}" for i in range(500)))
    assert block.startswith("Error: line 0\n") and block.endswith("\n")
    assert len(block.splitlines()) == helm_template.MAX_ERROR_LINES + 1
    assert "(460 more lines)" in block
    assert len(helm_template.error_block("x" * 100_000)) < helm_template.MAX_ERROR_CHARS + 100


# --------------------------------------------------------------------------- lint

def test_lint_passes_on_the_default_chart():
    result = run("--lint", "--strict")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("==> Linting charts/sinkflex\n")
    assert result.stdout.endswith("1 chart(s) linted, 0 chart(s) failed\n")
    assert "[ERROR]" not in result.stdout and "[WARNING]" not in result.stdout


def test_lint_fails_on_bad_values(tmp_path):
    bad = tmp_path / "my-values.yaml"
    bad.write_text("rollout:\n  replicas: 0\n")
    assert_refused(run("--lint", "-f", str(bad)), "1 chart(s) linted, 1 chart(s) failed",
                   "[ERROR] values.yaml: - at '/rollout/replicas': minimum: got 0, want 1")


# --------------------------------------------------------------------------- Helm's ordering

def test_the_hook_sorter_orders_manifests_as_helm_does():
    """The hooks (absent from the SDK's release summary) are sorted by a port of Helm's
    SortManifests: on the manifests it gives exactly Helm's install manifest."""
    import helm_python as helm

    values = {"learner": {"nodes": 2, "gpusPerNode": 2}, "serviceMonitor": {"enabled": True}}
    with helm.Config(storage_driver="memory") as cfg, helm.Chart.load(CHART) as chart:
        release = cfg.install(chart, "sf", values, dry_run="client", namespace="rl")
        rendered = chart.render(values, name="sf", namespace="rl", is_install=True)
    manifests, hooks = helm_template.sort_manifests(rendered)
    # randAlphaNum per render: Redis' passwords, the ACL file of their hashes, the secret's checksum
    random = re.compile(r'([\w-]*password: |users\.acl: |checksum/secret: )"[^"]*"')
    ported = "".join(f"---\n# Source: {t}\n{d}\n" for t, d in manifests)
    assert random.sub(r"\1", ported) == random.sub(r"\1", release["manifest"])
    assert [(t, e) for t, _, e in hooks] == [("sinkflex/templates/tests/grpc-health.yaml", ["test"])]


def test_yaml_documents_split_like_kubernetes_yaml_reader():
    split = helm_template.yaml_documents
    assert split("") == [] and split("a: 1") == ["a: 1\n"]
    assert split("---\na: 1\n--- # two\nb: 2\r\n---\n") == ["---\na: 1\n", "b: 2\n"]
    with pytest.raises(ValueError, match="invalid Yaml document separator: b: 2"):
        split("a: 1\n--- b: 2\n")


def test_deep_values_and_an_empty_output_dir_are_refused(tmp_path):
    """(break-it findings) a values file nested past Python's recursion limit in the SDK's JSON
    round trip is a clear error, not a traceback; an empty --output-dir is refused instead of
    writing into the current directory."""
    deep = tmp_path / "deep.yaml"
    text = "x"
    for _ in range(1100):
        text = "{a: " + text + "}"
    deep.write_text(text)
    assert_refused(run("-f", str(deep)), "nested too deeply")
    result = run("--output-dir", "", cwd=tmp_path)
    assert result.returncode == 2 and "--output-dir: an empty path" in result.stderr
    assert list(tmp_path.iterdir()) == [deep]
