#!/usr/bin/env python3
"""Renders a Helm chart like `helm template`, or lints it like `helm lint`, with Helm's own Go
code (helm-python-sdk, installed in .venv): no `helm` binary and no cluster are needed.

    .venv/bin/python scripts/helm_template.py                          # charts/sinkflex, its defaults
    .venv/bin/python scripts/helm_template.py -f my-values.yaml --release rl --namespace rl
    .venv/bin/python scripts/helm_template.py --set learner.nodes=2 --set learner.gpusPerNode=4
    .venv/bin/python scripts/helm_template.py -f my-values.yaml --output-dir /tmp/rendered
    .venv/bin/python scripts/helm_template.py -f my-values.yaml --lint [--strict]

As `helm template [NAME] [CHART] -f ... --set ...`: the values files are merged in order (`-`
reads stdin), then each --set over them; Helm validates the result against values.schema.json
and refuses a bad value with its own message naming it (`- at '/rollout/replicas': minimum: got
0, want 1`); the chart is rendered client-side, the manifests in Helm's install order, each
under its `# Source:` line, the test hooks last (--skip-tests drops them). With --output-dir
each template's manifests go to DIR/<chart>/templates/<file> instead. The release is
`release-name` in namespace `default` ($HELM_NAMESPACE) unless given, as with Helm.
--lint runs `helm lint` on the chart with the same values (--strict: warnings fail too).

Exit status 0; 1 with `Error: ...` on stderr for a bad values file or --set, a value the schema
refuses, a template's own check (`fail`), or a failed lint.

Two differences from the helm CLI, both because the SDK takes values as JSON: an integer given by
--set reaches the templates as a JSON number, as values from files always do (only a number of
1e6 or more printed without a cast renders differently), and `--set list[0]=x` replaces a list
that a values file set instead of changing its first item.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CHART = ROOT / "charts" / "sinkflex"
MAX_ERROR_LINES, MAX_ERROR_CHARS = 40, 4000

#: releaseutil.InstallOrder (helm.sh/helm/v4/pkg/release/v1/util/kind_sorter.go).
INSTALL_ORDER = {kind: i for i, kind in enumerate((
    "PriorityClass", "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange", "PodSecurityPolicy",
    "PodDisruptionBudget", "ServiceAccount", "Secret", "SecretList", "ConfigMap", "StorageClass",
    "PersistentVolume", "PersistentVolumeClaim", "CustomResourceDefinition", "ClusterRole",
    "ClusterRoleList", "ClusterRoleBinding", "ClusterRoleBindingList", "Role", "RoleList", "RoleBinding",
    "RoleBindingList", "Service", "DaemonSet", "Pod", "ReplicationController", "ReplicaSet", "Deployment",
    "HorizontalPodAutoscaler", "StatefulSet", "Job", "CronJob", "IngressClass", "Ingress", "APIService",
    "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
))}
HOOK_ANNOTATION = "helm.sh/hook"
HOOK_EVENTS = frozenset({"pre-install", "post-install", "pre-delete", "post-delete", "pre-upgrade",
                         "post-upgrade", "pre-rollback", "post-rollback", "test", "test-success"})
TEST_EVENTS = frozenset({"test", "test-success"})
_GO_SPACE = "\t\n\v\f\r \x85\xa0"  # unicode.IsSpace, as far as YAML text goes
_DOC_SEP = re.compile(r"(?:^|[\t\n\f\r ]*\n)---[\t\n\f\r ]*")  # releaseutil.SplitManifests' sep
_SOURCE = re.compile(r"(?:^|\n)---\n# Source: ([^\n]*)\n")


class Failure(Exception):
    """A refusal, printed as `Error: <message>` with exit status 1."""


# --------------------------------------------------------------------------- values

def merge_maps(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """loader.MergeMaps: b over a, maps merged recursively, anything else replaced."""
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_maps(out[k], v)
        else:
            out[k] = v
    return out


def yaml_documents(text: str) -> list[str]:
    """The documents of a YAML stream as k8s.io/apimachinery's YAMLReader splits it (what Helm's
    loader.LoadValues reads a values file with): at lines starting `---`, which may be followed
    only by blanks or a comment."""
    if not text:
        return []
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    docs, buffer = [], ""
    for n, line in enumerate(lines):
        if n < len(lines) - 1 or text.endswith("\n"):
            line = line.removesuffix("\r")  # bufio.ReadLine drops "\r\n"
        if line.startswith("---"):
            rest = line[3:].strip(_GO_SPACE)
            if rest and rest[0] != "#":
                raise ValueError(f"invalid Yaml document separator: {rest}")
            if buffer:
                docs.append(buffer)
                buffer = ""
                continue
        buffer += line + "\n"
    if buffer:
        docs.append(buffer)
    return docs


def read_values_file(path: str) -> dict[str, Any]:
    """One -f file as Helm reads it: every YAML document of it, merged in order."""
    import helm_python as helm

    if path.strip() == "-":
        raw = sys.stdin.buffer.read()
    elif re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path):
        raise Failure(f"{path}: values from a URL are not fetched here; download the file and pass its path")
    else:
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            reason = (e.strerror or str(e))
            raise Failure(f"open {path}: {reason[:1].lower()}{reason[1:]}") from None
    try:
        docs = yaml_documents(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise Failure(f"failed to parse {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        raise Failure(f"failed to parse {path}: error reading yaml document: {e}") from None
    values: dict[str, Any] = {}
    for doc in docs:
        try:
            values = merge_maps(values, helm.values_from_yaml(doc))
        except helm.HelmValuesError as e:
            raise Failure(f"failed to parse {path}: cannot unmarshal yaml document: {e.detail}") from None
    return values


def merged_values(files: list[str], sets: list[str]) -> dict[str, Any]:
    """values.Options.MergeValues: the -f files in order, then each --set (Helm's strvals parser)."""
    import helm_python as helm

    values: dict[str, Any] = {}
    for path in files:
        values = merge_maps(values, read_values_file(path))
    for expression in sets:
        try:
            values = merge_maps(values, helm.parse_set_string(expression))
        except helm.HelmValuesError as e:
            raise Failure(f"failed parsing --set data: {e.detail}") from None
    return values


# --------------------------------------------------------------------------- hooks

def _install_rank(kind: str) -> tuple[int, int | str]:
    """releaseutil.lessByKind as a stable sort key: known kinds in install order, then unknown
    kinds alphabetically."""
    return (0, INSTALL_ORDER[kind]) if kind in INSTALL_ORDER else (1, kind)


def split_manifests(text: str) -> list[str]:
    """releaseutil.SplitManifests: the YAML documents of one rendered template, in order."""
    docs = _DOC_SEP.split(text.lstrip(_GO_SPACE))
    return [d.lstrip(_GO_SPACE) for d in docs if d.strip(_GO_SPACE)]


def sort_manifests(rendered: dict[str, str]) -> tuple[list[tuple[str, str]], list[tuple[str, str, list[str]]]]:
    """releaseutil.SortManifests over a chart's rendered templates: the plain manifests
    ``(template, text)`` and the hooks ``(template, text, events)``, each in install order.
    Templates are assumed to parse (Helm's install, run first, refuses those that do not)."""
    import helm_python as helm

    manifests: list[tuple[str, str, str]] = []
    hooks: list[tuple[str, str, str, list[str]]] = []
    for template in sorted(rendered):
        content = rendered[template]
        if os.path.basename(template).startswith("_") or not content.strip(_GO_SPACE):
            continue
        if template.endswith("NOTES.txt"):
            continue  # renderResources takes the notes out before sorting
        for doc in split_manifests(content):
            try:
                head = helm.values_from_yaml(doc)
            except helm.HelmValuesError:
                head = {}
            kind = str(head.get("kind") or "")
            metadata = head.get("metadata") if isinstance(head.get("metadata"), dict) else {}
            annotations = metadata.get("annotations") if isinstance(metadata.get("annotations"), dict) else {}
            if HOOK_ANNOTATION not in annotations:
                manifests.append((kind, template, doc))
                continue
            events = [e.strip().lower() for e in str(annotations[HOOK_ANNOTATION]).split(",")]
            if all(e in HOOK_EVENTS for e in events):  # an unknown hook type: Helm skips the object
                hooks.append((kind, template, doc, events))
    manifests.sort(key=lambda m: _install_rank(m[0]))
    hooks.sort(key=lambda h: _install_rank(h[0]))
    return [(t, d) for _, t, d in manifests], [(t, d, e) for _, t, d, e in hooks]


def manifest_entries(manifest: str) -> list[tuple[str, str]]:
    """A release manifest (`---\\n# Source: T\\nTEXT\\n` per object) back into ``(T, TEXT)``;
    TEXT never holds a line starting `---`, so the split is exact."""
    marks = list(_SOURCE.finditer(manifest))
    entries = []
    for m, nxt in zip(marks, marks[1:] + [None]):
        end = nxt.start() if nxt else len(manifest)
        text = manifest[m.end():end]
        entries.append((m.group(1), text.removesuffix("\n") if nxt is None else text))
    return entries


# --------------------------------------------------------------------------- template, lint

def render(chart: str, values: dict[str, Any], release: str, namespace: str, skip_tests: bool = False
           ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """`helm template`: Helm's client-only install (schema validation, render, the manifests in
    install order) and the chart's hooks. Returns ``(manifests, hooks)`` as ``(template, text)``."""
    import helm_python as helm

    with helm.Config(storage_driver="memory", namespace=namespace) as cfg, helm.Chart.load(chart) as loaded:
        release_ = cfg.install(loaded, release, values, dry_run="client", namespace=namespace)
        # The SDK's release summary has no hooks: they come from the same render, sorted as Helm does.
        rendered = loaded.render(values, name=release, namespace=namespace, is_install=True)
    _, hooks = sort_manifests(rendered)
    hooks_out = [(t, d) for t, d, events in hooks if not (skip_tests and TEST_EVENTS & set(events))]
    return manifest_entries(release_.get("manifest") or ""), hooks_out


def template_text(manifests: list[tuple[str, str]], hooks: list[tuple[str, str]]) -> str:
    """What `helm template` prints to stdout."""
    body = "".join(f"---\n# Source: {t}\n{d}\n" for t, d in manifests)
    return body.strip(_GO_SPACE) + "\n" + "".join(f"---\n# Source: {t}\n{d}\n" for t, d in hooks)


def write_output_dir(out_dir: Path, manifests: list[tuple[str, str]], hooks: list[tuple[str, str]]) -> list[Path]:
    """`helm template --output-dir`: each object appended to DIR/<template> (created fresh on the
    first write of this run)."""
    written: list[Path] = []
    for template, text in [*manifests, *hooks]:
        path = out_dir / template
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a" if path in written else "w") as f:
            f.write(f"---\n# Source: {template}\n{text}\n")
        print(f"wrote {out_dir}/{template}")
        if path not in written:
            written.append(path)
    print()  # helm template prints its (here empty) stdout manifest after the file list
    return written


def lint(chart: str, shown: str, values: dict[str, Any], namespace: str, strict: bool) -> str:
    """`helm lint`: the report as Helm prints it; a failed chart raises Failure with the report."""
    import helm_python as helm

    report = helm.lint(chart, values, strict=strict, namespace=namespace)
    severity = ("UNKNOWN", "INFO", "WARNING", "ERROR")
    lines = [f"==> Linting {shown}"]
    if not report["messages"]:
        lines += [f"Error {e}" for e in report["errors"]]
    for m in report["messages"]:
        sev = severity[m["severity"]] if 0 <= m["severity"] < len(severity) else "UNKNOWN"
        lines.append(f"[{sev}] {m['path']}: {m['error']}")
    failed = 1 if report["errors"] else 0
    text = "\n".join(lines) + "\n\n"
    summary = f"{max(report['total_charts_linted'], 1)} chart(s) linted, {failed} chart(s) failed"
    if failed:  # Helm prints the report to stdout; here it goes with the error, on stderr
        raise Failure(summary + "\n" + text)
    return text + summary + "\n"


# --------------------------------------------------------------------------- command line

def error_block(message: str) -> str:
    """`Error: <message>`, cut to MAX_ERROR_LINES lines and MAX_ERROR_CHARS characters."""
    lines = message.rstrip().splitlines() or ["(no message)"]
    cut = len(lines) - MAX_ERROR_LINES
    if cut > 0:
        lines = lines[:MAX_ERROR_LINES] + [f"... ({cut} more lines)"]
    text = "Error: " + "\n".join(lines)
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + f"... ({len(text) - MAX_ERROR_CHARS} more characters)"
    return text + "\n"


def _shown(chart: Path, given: bool) -> str:
    if given:
        return str(chart)
    rel = os.path.relpath(chart)
    return rel if not rel.startswith("..") else str(chart)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("chart", nargs="?", type=Path, help=f"chart directory or .tgz (default: {_shown(DEFAULT_CHART, False)})")
    p.add_argument("-f", "--values", dest="values", action="append", default=[], metavar="FILE",
                   help="values file, merged over the previous ones (repeatable; - reads stdin)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a value, Helm's --set syntax (a.b=1,c={x,y}); repeatable, applied after the files")
    p.add_argument("--release", default="release-name", metavar="NAME", help="release name (default: release-name)")
    p.add_argument("--namespace", "-n", default=os.environ.get("HELM_NAMESPACE") or "default", metavar="NS",
                   help="release namespace (default: $HELM_NAMESPACE or default)")
    p.add_argument("--output-dir", metavar="DIR", help="write each template's manifests under DIR")
    p.add_argument("--skip-tests", action="store_true", help="leave the chart's test hooks out")
    p.add_argument("--lint", action="store_true", help="run `helm lint` on the chart with these values instead")
    p.add_argument("--strict", action="store_true", help="with --lint: fail on lint warnings too")
    return p


def run(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.output_dir is not None:  # Path("") would be the current directory
        if not a.output_dir.strip():
            p.error("--output-dir: an empty path (leave the option out to print the manifests)")
        a.output_dir = Path(a.output_dir)
    chart = a.chart if a.chart is not None else DEFAULT_CHART
    try:
        try:
            import helm_python as helm
        except ImportError as e:
            raise Failure(f"helm-python-sdk is not importable from {sys.executable} ({e}); "
                          "run this with .venv/bin/python") from None
        try:
            values = merged_values(a.values, a.sets)
            if a.lint:
                sys.stdout.write(lint(str(chart), _shown(chart, a.chart is not None), values, a.namespace, a.strict))
                return 0
            manifests, hooks = render(str(chart), values, a.release, a.namespace, a.skip_tests)
        except helm.HelmError as e:
            raise Failure(e.detail or str(e)) from None
        except RecursionError:  # the SDK's JSON round trip of a values file nested ~1,000 deep
            raise Failure("the values are nested too deeply to be chart values") from None
        if a.output_dir is not None:
            write_output_dir(a.output_dir, manifests, hooks)
        else:
            sys.stdout.write(template_text(manifests, hooks))
        return 0
    except Failure as e:
        sys.stdout.flush()
        sys.stderr.write(error_block(str(e)))
        return 1
    except OSError as e:  # writing --output-dir
        sys.stderr.write(error_block(str(e)))
        return 1


if __name__ == "__main__":
    sys.exit(run())
