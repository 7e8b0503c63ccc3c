"""Runs protos/buf.gen.yaml for chosen languages; checks the committed TypeScript code.

    python scripts/buf_generate.py                    # every language this machine can build
    python scripts/buf_generate.py --lang ts          # regenerate examples/clinic/src/gen
    python scripts/buf_generate.py --lang python,go --out /tmp/gen   # into /tmp/gen/<lang>
    python scripts/buf_generate.py --check            # exit 1 if examples/clinic/src/gen is stale
    python scripts/buf_generate.py --list             # the languages and whether they can build here

buf is the pinned `buf-bin` wheel (.venv/bin/buf; `buf` on PATH otherwise). The plugins are
local: Python through grpcio-tools (scripts/protoc_gen_grpc_tools.py), TypeScript through
ts-proto from examples/clinic/node_modules (`npm ci` there), Go through protoc-gen-go and
protoc-gen-go-grpc on PATH. A language whose plugins are missing is skipped with the reason
(an error when asked for by --lang).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
TEMPLATE = PROTOS / "buf.gen.yaml"
CLINIC = ROOT / "examples" / "clinic"
NODE_BIN = CLINIC / "node_modules" / ".bin"
LANGS = ("python", "ts", "go")


def buf_binary() -> str:
    venv_buf = Path(sys.executable).parent / "buf"
    found = str(venv_buf) if venv_buf.exists() else shutil.which("buf")
    if not found:
        raise SystemExit("buf not found: install the dev extras (buf-bin) or put buf on PATH")
    return found


def _local(plugin: dict) -> list[str]:
    local = plugin.get("local", [])
    return [local] if isinstance(local, str) else list(local)


def language(plugin: dict) -> str:
    cmd = " ".join(_local(plugin))
    if "protoc_gen_grpc_tools" in cmd:
        return "python"
    if "protoc-gen-ts_proto" in cmd:
        return "ts"
    if "protoc-gen-go" in cmd:
        return "go"
    raise ValueError(f"buf.gen.yaml: a plugin of no known language: {plugin}")


def _env() -> dict:
    return {**os.environ, "PATH": os.pathsep.join([str(NODE_BIN), os.environ.get("PATH", "")])}


def missing(lang: str) -> str:
    """Why `lang` cannot be generated on this machine ('' when it can)."""
    path = _env()["PATH"]
    if lang == "python":
        try:
            import grpc_tools  # noqa: F401
        except ImportError:
            return "grpcio-tools is not installed"
        return ""
    if lang == "ts":
        if not shutil.which("node"):
            return "node is not on PATH"
        if not shutil.which("protoc-gen-ts_proto", path=path):
            return f"ts-proto is not installed (run `npm ci` in {CLINIC.relative_to(ROOT)})"
        return ""
    if lang == "go":
        absent = [p for p in ("protoc-gen-go", "protoc-gen-go-grpc") if not shutil.which(p, path=path)]
        return f"{' and '.join(absent)} not on PATH (needs a Go toolchain: go install ...)" if absent else ""
    raise ValueError(f"unknown language {lang!r}; languages: {', '.join(LANGS)}")


def generate(langs: list[str], out: Path | None = None) -> dict[str, Path]:
    """Runs buf generate with the template's plugins of `langs`.

    With `out`, each language's files go to out/<lang> instead of the template's paths.
    Returns language -> output directory.
    """
    template = yaml.safe_load(TEMPLATE.read_text())
    plugins, dirs = [], {}
    for plugin in template["plugins"]:
        lang = language(plugin)
        if lang not in langs:
            continue
        plugin = dict(plugin)
        if out is not None:
            plugin["out"] = str(out / lang)
        dirs[lang] = (PROTOS / plugin["out"]).resolve()
        plugins.append(plugin)
    if not plugins:
        raise SystemExit(f"no plugins for {langs} in {TEMPLATE}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "buf.gen.yaml"
        path.write_text(yaml.safe_dump({**template, "plugins": plugins}, sort_keys=False))
        proc = subprocess.run([buf_binary(), "generate", "--template", str(path)], cwd=PROTOS, env=_env(),
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"buf generate ({', '.join(langs)}) failed:\n{proc.stdout}{proc.stderr}")
    return dirs


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def stale_ts() -> list[str]:
    """Files of examples/clinic/src/gen that differ from a fresh generation (or are missing/extra)."""
    committed = CLINIC / "src" / "gen"
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(["ts"], Path(tmp))["ts"]
        new, old = _files(fresh), _files(committed)
        bad = sorted(new ^ old)
        bad += sorted(f for f in new & old if not filecmp.cmp(fresh / f, committed / f, shallow=False))
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lang", help=f"comma-separated, of {', '.join(LANGS)} (default: all that can build here)")
    parser.add_argument("--out", type=Path, help="write each language to OUT/<lang> instead of buf.gen.yaml's paths")
    parser.add_argument("--check", action="store_true", help="exit 1 if examples/clinic/src/gen is stale")
    parser.add_argument("--list", action="store_true", help="list the languages and whether they can build here")
    args = parser.parse_args()
    if args.list:
        for lang in LANGS:
            why = missing(lang)
            print(f"{lang}: {'ok' if not why else 'skipped: ' + why}")
        return 0
    if args.check:
        why = missing("ts")
        if why:
            print(f"cannot check the TypeScript code: {why}", file=sys.stderr)
            return 2
        bad = stale_ts()
        if bad:
            print("stale generated TypeScript in examples/clinic/src/gen (run scripts/buf_generate.py --lang ts):\n  "
                  + "\n  ".join(bad), file=sys.stderr)
            return 1
        return 0
    if args.lang:
        langs = [s.strip() for s in args.lang.split(",") if s.strip()]
        for lang in langs:
            why = missing(lang)
            if why:
                print(f"cannot generate {lang}: {why}", file=sys.stderr)
                return 2
    else:
        langs = []
        for lang in LANGS:
            why = missing(lang)
            if why:
                print(f"skipping {lang}: {why}", file=sys.stderr)
            else:
                langs.append(lang)
    for lang, where in generate(langs, args.out).items():
        print(f"{lang}: {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
