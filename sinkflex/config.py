"""Typed configuration: one pydantic model per component, validated on load.

Configs are YAML files (configs/). Unknown keys and bad values raise `ConfigError`
with the dotted path of the bad field, e.g. ``rollout.sampling.temperature: Input
should be greater than or equal to 0``.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

T = TypeVar("T", bound=BaseModel)


class ConfigError(ValueError):
    """A config file is missing, is not YAML, or has a bad or unknown field."""


def _numeric(annotation: Any) -> bool:
    """True for int, float and unions of them with other types (Optional[int], int | str), not bool."""
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_numeric(a) for a in typing.get_args(annotation)) and bool not in typing.get_args(annotation)
    return False


class StrictModel(BaseModel):
    """Base of every config section: unknown fields are errors, instances are frozen, a float
    is finite (YAML's ``.inf`` / ``.nan`` are refused), and a boolean is not a number (pydantic's
    lax mode would read YAML's ``true`` as 1 for an int field)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _numeric(field.annotation):
            raise ValueError(f"expected a number, got the boolean {str(value).lower()} (YAML reads true/false/yes/no/on/off as booleans)")
        return value


def merge_dicts(base: dict, patch: dict) -> dict:
    """`patch` merged into `base` recursively: nested dicts merge, anything else replaces."""
    out = dict(base)
    for key, value in patch.items():
        out[key] = merge_dicts(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def validate_config(data: Any, model: type[T], source: str = "<config>") -> T:
    """Validates `data` against `model`.

    Raises:
        ConfigError: naming each bad field by its dotted path.
    """
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"invalid config {source}:\n" + describe_errors(err, lambda: config_json_schema(model))) from None
    except RecursionError:
        raise ConfigError(f"invalid config {source}: nested too deeply") from None


def config_json_schema(model: type[BaseModel]) -> dict:
    """`model`'s JSON schema for error messages: its ``config_json_schema()`` classmethod when
    it has one (an experiment config whose sections are typed at load), else pydantic's."""
    custom = getattr(model, "config_json_schema", None)
    return custom() if callable(custom) else model.model_json_schema()


def _json_pointer(schema: dict, ref: str) -> dict:
    """The node a local JSON pointer names in `schema` (e.g. ``#/properties/learner/$defs/OptimConfig``), {} if none."""
    node: Any = schema
    for key in ref.removeprefix("#").strip("/").split("/"):
        node = node.get(key.replace("~1", "/").replace("~0", "~"), {}) if isinstance(node, dict) else {}
    return node if isinstance(node, dict) else {}


def _field_names_at(schema: dict, path: Sequence[Any]) -> list[str]:
    """The property names of the object at `path` (a pydantic error's location, less its last
    part) in the JSON `schema`, following local ``$ref``s, ``anyOf`` branches, ``items`` for a
    list index and ``additionalProperties`` for a mapping's key; [] where the path leaves it."""
    def objects(node: dict, depth: int = 0) -> list[dict]:
        if depth > 32:  # a recursive schema
            return []
        if "$ref" in node:
            return objects(_json_pointer(schema, node["$ref"]), depth + 1)
        out = [node] if "properties" in node or "items" in node or "additionalProperties" in node else []
        for branch in node.get("anyOf", []) + node.get("allOf", []):
            out += objects(branch, depth + 1)
        return out

    nodes = objects(schema)
    for part in path:
        nxt = []
        for node in nodes:
            if isinstance(part, int) and isinstance(node.get("items"), dict):
                nxt += objects(node["items"])
            elif str(part) in node.get("properties", {}):
                nxt += objects(node["properties"][str(part)])
            elif isinstance(node.get("additionalProperties"), dict):
                nxt += objects(node["additionalProperties"])
        nodes = nxt
    return sorted({name for node in nodes for name in node.get("properties", {})})


def _field_paths(schema: dict, max_depth: int = 6) -> list[str]:
    """Every dotted field path of the JSON `schema` (objects' properties, local ``$ref``s and
    ``anyOf`` branches followed; lists and mappings not entered), shortest first."""
    out: list[str] = []
    todo: list[tuple[str, dict, int]] = [("", schema, 0)]
    while todo:
        prefix, node, depth = todo.pop(0)
        if "$ref" in node:
            node = _json_pointer(schema, node["$ref"])
        for branch in node.get("anyOf", []) + node.get("allOf", []):
            todo.append((prefix, branch, depth))
        if depth >= max_depth:
            continue
        for key, child in node.get("properties", {}).items():
            path = f"{prefix}.{key}" if prefix else key
            out.append(path)
            if isinstance(child, dict):
                todo.append((path, child, depth + 1))
    return list(dict.fromkeys(out))


#: a field whose value an error message does not repeat (its name's last part says it may hold a
#: credential: api_key, redis_url, tracking_uri, password, auth_token, ...)
_SECRET_FIELD = re.compile(r"(^|_)(key|password|passwd|secret|token|credentials?|url|uri|auth|acl)$", re.I)


def secret_field(dotted: str) -> bool:
    """True when a field on the dotted path `dotted` (``services.redis_url``) may hold a credential."""
    return any(_SECRET_FIELD.search(part) for part in dotted.split("."))


def _shown_assignment(assignment: str) -> str:
    """A ``--set`` assignment as messages repeat it: the value hidden (``=<hidden>``) when the field
    may hold a credential (`secret_field`), cut at 200 characters."""
    key, sep, _ = assignment.partition("=")
    return _bounded(f"{key}=<hidden>" if sep and secret_field(key.strip()) else assignment, 200)


def describe_errors(err: ValidationError, schema: Callable[[], dict] | None = None) -> str:
    """One indented line per error of `err`: ``  dotted.path: message``, with the value given when
    it is a scalar (a string cut at 80 characters) of a field whose name does not suggest a
    credential (`secret_field`): ``  run.steps: Input should be greater
    than or equal to 1 (got -1)``; a rule between fields
    (a model validator's ValueError, no location of its own) as its message alone, which names
    the fields. With `schema` (called once, only if needed: the config's JSON schema), an
    unknown field gets the closest known name at its place (`difflib.get_close_matches`):
    ``rollout.group_sise: Extra inputs are not permitted (did you mean 'group_size'?)``."""
    cache: list[dict] = []

    def hint(e) -> str:
        if schema is None or e["type"] != "extra_forbidden" or not e["loc"]:
            return ""
        name = str(e["loc"][-1])
        if "[" in name:  # `--set a.list[0]=x`: no index syntax, not a misspelt field
            return " (--set takes no [index]: set the whole list, e.g. field=[a, b])"
        try:
            if not cache:
                cache.append(schema())
            names = _field_names_at(cache[0], e["loc"][:-1])
            # the exact name elsewhere first: `rollout.top_k` is a field of rollout_service.agent, not a typo of top_p
            elsewhere = [p for p in _field_paths(cache[0]) if p.rsplit(".", 1)[-1] == name and "." in p][:3]
        except Exception:  # noqa: BLE001 - a suggestion never hides the error itself
            return ""
        if elsewhere:  # `name` is a known field name here: nothing to escape
            return f" ({name!r} is a field of {' and '.join(p.rsplit('.', 1)[0] for p in elsewhere)})"
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.7)
        return f" (did you mean {close[0]!r}?)" if close else ""

    def given(e) -> str:
        value = e.get("input")
        if e["type"] in ("extra_forbidden", "missing") or not (value is None or isinstance(value, (str, int, float))):
            return ""
        if secret_field(".".join(map(str, e["loc"]))):  # an API key, a password, a URL with credentials
            return ""
        return f" (got {printable(_bounded(repr(value), 80))})"

    def line(e) -> str:
        where = ".".join(printable(_bounded(str(p), 80)) for p in e["loc"])
        msg = printable(_bounded(e["msg"], 500))  # a validator's message may quote a name from the config as it is
        if not where and e["type"] == "value_error":
            return "  " + msg.removeprefix("Value error, ")
        return f"  {where or '<root>'}: {msg}{given(e)}{hint(e)}"

    errors = err.errors()
    lines = [line(e) for e in errors[:MAX_ERRORS_SHOWN]]
    if len(errors) > MAX_ERRORS_SHOWN:
        lines.append(f"  ... and {len(errors) - MAX_ERRORS_SHOWN} more")
    return "\n".join(lines)


#: `describe_errors` lists at most this many errors (then how many more), each name on the path
#: cut at 80 characters and each message at 500: a config of junk gets a bounded message.
MAX_ERRORS_SHOWN = 50


def _bounded(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 15] + f"… ({len(text)} chars)"


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping with a key twice is an error (PyYAML keeps the
    last one silently; YAML 1.2 says keys are unique), that ``1e-5`` is a float, as in YAML
    1.2 (PyYAML follows YAML 1.1, which needs ``1.0e-5`` and reads ``1e-5`` as a string), and
    that ``1:2`` is the string it looks like and ``010`` is 10, as in YAML 1.2 (YAML 1.1 reads
    base-60 numbers, ``1:2`` is 62, and octal, ``010`` is 8: a core list written that way would
    become other cores silently; its ``1_000`` and ``0b11`` are strings here).

    Ours stays rather than ruamel.yaml: its 1.2 mode reads ``yes`` / ``off`` as strings and its
    1.1 mode reads ``y`` / ``n`` as booleans, so neither keeps the configs' meaning (PyYAML's 1.1
    scalars, 1.2 floats, unique keys), which these 20 lines over PyYAML's loader do."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # unhashable keys: the base class reports them
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


#: YAML 1.1's int and float resolvers go (both read base 60, ``1:2``; its ints read ``010`` as
#: octal 8 and allow ``_``); ours below replace them with YAML 1.2's
_UniqueKeyLoader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
#: YAML 1.2 core schema integers: decimal (``010`` is 10), ``0o`` octal, ``0x`` hexadecimal
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789"))


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                 |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                 |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                 |[-+]?\.(?:inf|Inf|INF)
                 |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, quoting every string that `load_yaml` would read as something else
    (``"1e3"``, a float to `load_yaml` though not to PyYAML's own loader), so that what
    `dump_yaml` writes, `load_yaml` reads back the same."""


_Dumper.yaml_implicit_resolvers = _UniqueKeyLoader.yaml_implicit_resolvers


def dump_yaml(data: Any, **kwargs: Any) -> str:
    """`yaml.safe_dump(data, sort_keys=False, **kwargs)` that `load_yaml` reads back as `data`."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, **kwargs)


#: The most values (mappings, lists and scalars, counted as often as aliases repeat them) a
#: config document may expand to: far above any real config, far below what a "billion laughs"
#: document of nested aliases expands to (one of 1 KB made `config show` take 6.6 GB in a minute).
MAX_YAML_VALUES = 1_000_000


class YAMLTooLarge(yaml.YAMLError):
    """A document that expands to more than `MAX_YAML_VALUES` values."""


def _check_expansion(data: Any, limit: int = MAX_YAML_VALUES) -> None:
    """Counts `data`'s values as a reader of it would meet them (an alias once per use); raises
    `YAMLTooLarge` past `limit`, after at most `limit` steps (a self-referencing alias included)."""
    seen, stack = 0, [data]
    while stack:
        node = stack.pop()
        seen += 1
        if seen > limit:
            raise YAMLTooLarge(f"the document expands to more than {limit:,} values (aliases repeat what their anchor "
                               "names: nested ones multiply); write the values out, or use fewer aliases")
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple, set)):
            stack.extend(node)


def load_yaml(text: str):
    """`yaml.safe_load(text)`, with duplicate mapping keys an error and a document that expands to
    more than `MAX_YAML_VALUES` values through aliases an error (`yaml.YAMLError` both)."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except ValueError as err:  # a scalar PyYAML cannot convert: an integer of more than 4300 digits
        raise yaml.YAMLError(f"a value cannot be read: {str(err)[:300]}") from None
    _check_expansion(data)
    return data


def located(errors: Sequence[ValidationError], sections: Sequence[str], title: str) -> ValidationError:
    """One `ValidationError` holding every error of `errors`, each located under its section's
    name (``errors[i]`` under ``sections[i]``): sections validated on their own, reported as
    fields of the enclosing config (pydantic's `ValidationError.from_exception_data`)."""
    return ValidationError.from_exception_data(title, [
        {"type": e["type"], "loc": (section, *e["loc"]), "input": e["input"], **({"ctx": e["ctx"]} if "ctx" in e else {})}
        for err, section in zip(errors, sections, strict=True) for e in err.errors(include_url=False)])


def read_yaml(path: str | Path) -> dict:
    """The YAML mapping in the file at `path`, not validated.

    Raises:
        ConfigError: the file is missing, a directory, not UTF-8, not valid YAML, empty (no YAML
            document: nothing, or only comments; ``{}`` asks for every default explicitly), or not
            a mapping.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config {path} is a directory, not a YAML file")
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if not path.is_file():
        raise ConfigError(f"config {path} is not a regular file")
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ConfigError(f"config {path} is nested too deeply to be a config") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config {path} is not UTF-8 text: {err}") from None
    except yaml.YAMLError as err:
        for mark in (getattr(err, "context_mark", None), getattr(err, "problem_mark", None)):
            if mark is not None:  # PyYAML names a str's marks "<unicode string>": the file instead
                mark.name = str(path)
        raise ConfigError(f"config {path} is not valid YAML: {err}") from None
    if data is None:
        raise ConfigError(f"config {path} is empty (no YAML document): write the sections to set, or {{}} for every "
                          "default")
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a YAML mapping of sections, got {type(data).__name__}")
    return data


def set_dotted(data: dict, assignment: str) -> dict:
    """`data` with one ``dotted.path=value`` assignment applied (a command line's ``--set``).

    The value is parsed as YAML, as it would be in the file (``8`` is an int, ``true`` a bool,
    ``null`` or nothing None, ``[a, b]`` a list, ``"8"`` a string); mappings on the path that do
    not exist yet are created. `data` is not modified.

    Raises:
        ConfigError: no ``=``, an empty name on the path, a value that is not YAML, or a path
            that goes through a value that is not a mapping; the message names the assignment.
    """
    key, sep, text = assignment.partition("=")
    shown = _shown_assignment(assignment)  # what the errors echo: a value may be megabytes, or a credential
    key = key.strip()
    parts = key.split(".")
    secret = secret_field(key)
    if not sep or not key or any(not p for p in parts):
        raise ConfigError(f"--set {shown!r}: expected dotted.field=value, e.g. rollout.group_size=8")
    try:
        value = load_yaml(text) if text.strip() else None
    except RecursionError:
        raise ConfigError(f"--set {shown[:80]!r}: the value is nested too deeply") from None
    except yaml.YAMLError as err:
        detail = "" if secret else f": {printable(_bounded(str(err), 500))}"
        raise ConfigError(f"--set {shown!r}: the value is not valid YAML{detail}") from None
    out = dict(data)
    node = out
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = {}
        elif not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            value = "set" if secret else printable(repr(child)[:200])  # `where` is on the assignment's path
            raise ConfigError(f"--set {shown!r}: {where} is {value}, not a section with fields")
        node[part] = dict(child)
        node = node[part]
    node[parts[-1]] = value
    return out


def load_config(path: str | Path, model: type[T], overrides: Sequence[str] = ()) -> T:
    """Loads a YAML file into `model`, with ``dotted.path=value`` overrides applied in order
    (`set_dotted`) before it is validated, so a bad override fails like a bad field in the file.

    Raises:
        ConfigError: missing file, invalid YAML, a malformed override, or a bad field (named by
            its dotted path; the message names the file and the overrides).
    """
    data = read_yaml(path)
    for assignment in overrides:
        data = set_dotted(data, assignment)
    return validate_config(data, model, source=describe_source(path, overrides))


def describe_source(path: str | Path, overrides: Sequence[str] = ()) -> str:
    """How errors name a config: the file, then each override (``x.yaml --set a.b=1``), each
    cut at 200 characters and at most 20 of them (then how many more), control characters
    escaped (`printable`), the value of a field that may hold a credential hidden."""
    shown = [printable(f"--set {_shown_assignment(a)}") for a in overrides[:20]]
    more = [f"(and {len(overrides) - 20} more --set)"] if len(overrides) > 20 else []
    return " ".join([printable(_bounded(str(path), 500)), *shown, *more])


def printable(text: str) -> str:
    """`text` with every non-printable character (newline, escape, bidi controls such as
    U+202E) written as its Python escape, so a name from a config cannot forge or reorder
    lines of an error message."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
