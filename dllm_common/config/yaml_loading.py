"""Reading a pipeline config: YAML refused when it writes a key twice or its aliases expand too far
(`UniqueKeyLoader`), `--set` overrides, the schema check (`validate_schema`) and its errors, each naming the
dotted key path, the bad value and what is allowed."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from dllm_common.config.errors import ConfigError, cut, shown
from dllm_common.config.sections import special_file
from dllm_common.config.spec import PipelineSpec


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        path = cut(".".join(str(p) for p in e["loc"]) or "<top level>", 120)
        value = shown(e.get("input"), 200)
        if e["type"] == "extra_forbidden":
            parent = _section_for(e["loc"][:-1])
            allowed = sorted(parent.model_fields) if parent else []
            lines.append(f"  {path}: unknown key (value {value}); allowed keys here: {allowed}")
        elif not e["loc"] or (e["type"] == "value_error" and f"{path}" in e["msg"]):
            # a rule that names its keys itself (across sections, or across one section's keys): its message alone,
            # not the whole section or config it was given
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {path}: {e['msg']} (got {value})")
    return "\n".join(lines)


def _section_for(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = PipelineSpec
    parts = iter(loc)
    for part in parts:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if get_origin(annotation) is dict:  # `dict[str, Section]` (eval.overrides): skip the key, enter the section
            annotation = get_args(annotation)[1]
            if next(parts, None) is None:
                return None
        if not isinstance(annotation, type) or not issubclass(annotation, BaseModel):
            return None
        model = annotation
    return model


class DuplicateKeyError(ValueError):
    """A key written twice in one YAML mapping: YAML itself would keep the last and drop the first, silently."""

    def __init__(self, key: str, first: int, second: int):
        self.key, self.first, self.second = key, first, second
        lines = f"on line {first}" if first == second else f"on line {first} and on line {second}"
        super().__init__(
            f"{key} appears twice ({lines}); YAML would silently keep only the second, so merge the two or delete one"
        )


# how much a document's aliases (*name) may add to what is written, in values and characters: a config repeats a
# block or two, while nested anchors (a "billion laughs" document) expand 1 KB into gigabytes once copied
ALIAS_EXPANSION_LIMIT = 1_000_000


class AliasExpansionError(ValueError):
    """A YAML document whose aliases would expand it past `ALIAS_EXPANSION_LIMIT` (or forever): refused before
    anything is built or copied from it."""


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml's SafeLoader, refusing a mapping that holds a key twice (`DuplicateKeyError` names its dotted path and
    both lines) and aliases that expand too far (`AliasExpansionError`) before anything is built from the
    document."""

    def compose_document(self):  # yaml's own, keeping the anchors' names for the error message
        self.get_event()
        node = self.compose_node(None, None)
        self.get_event()
        self.anchor_names = {id(n): name for name, n in self.anchors.items()}
        self.anchors = {}
        return node

    def construct_document(self, node):
        _refuse_duplicate_keys(node)
        _refuse_alias_expansion(node, getattr(self, "anchor_names", {}))
        return super().construct_document(node)


def _refuse_alias_expansion(root: yaml.Node, anchor_names: dict[int, str]) -> None:
    """Size the document as it would be once every alias is copied out (values + scalar characters), counting
    each node once (memoized), so a bomb is sized in microseconds and never expanded."""
    size: dict[int, int] = {}  # expanded size of each node
    nodes: dict[int, yaml.Node] = {}
    busy: set[int] = set()

    def children(node: yaml.Node) -> list[yaml.Node]:
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        if isinstance(node, yaml.MappingNode):
            return [n for pair in node.value for n in pair]
        return []

    def expanded(node: yaml.Node) -> int:
        key = id(node)
        if key in size:
            return size[key]
        if key in busy:
            name = anchor_names.get(key, "?")
            raise AliasExpansionError(
                f"the anchor &{name} (line {node.start_mark.line + 1}) holds an alias of itself (*{name}), which "
                "would expand forever; write the value out"
            )
        busy.add(key)
        own = 1 + (len(node.value) if isinstance(node, yaml.ScalarNode) else 0)
        size[key] = own + sum(expanded(child) for child in children(node))
        busy.discard(key)
        nodes[key] = node
        return size[key]

    total = expanded(root)
    written = sum(1 + (len(n.value) if isinstance(n, yaml.ScalarNode) else 0) for n in nodes.values())
    if total - written <= ALIAS_EXPANSION_LIMIT:
        return
    uses: collections.Counter[int] = collections.Counter(id(c) for n in nodes.values() for c in children(n))
    worst = max((k for k in anchor_names if uses[k] > 1), key=lambda k: size[k] * (uses[k] - 1), default=None)
    which = (
        f" (&{anchor_names[worst]} on line {nodes[worst].start_mark.line + 1}, {size[worst]} of them, is repeated by "
        f"{uses[worst] - 1} aliases)"
        if worst is not None
        else ""
    )
    raise AliasExpansionError(
        f"its YAML aliases would expand it to {total} values and characters, more than {ALIAS_EXPANSION_LIMIT} "
        f"beyond what is written{which}; write the repeated parts out instead of nesting aliases"
    )


def _refuse_duplicate_keys(root: yaml.Node) -> None:
    queue, seen = collections.deque([(root, "")]), set()
    while queue:  # breadth first: the outermost duplicate is the one named
        node, path = queue.popleft()
        if id(node) in seen:  # an anchor used again (or a recursive structure): checked once
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            lines: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: overriding is what it is for
                    continue
                name = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.start_mark)
                where = f"{path}.{name}" if path else name
                line = key_node.start_mark.line + 1
                if (key_node.tag, name) in lines:
                    raise DuplicateKeyError(where, lines[(key_node.tag, name)], line)
                lines[(key_node.tag, name)] = line
                queue.append((value_node, where))
        elif isinstance(node, yaml.SequenceNode):
            queue.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))


def load_yaml(text: str) -> Any:
    """YAML text as Python data, refusing a key written twice (`UniqueKeyLoader`)."""
    return yaml.load(text, Loader=UniqueKeyLoader)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` → (['a','b','c'], value parsed as YAML)."""
    if "=" not in item:
        raise ConfigError(f"override {shown(item)} must look like dotted.key=value")
    key, raw = item.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {shown(item)} has an empty key")
    if raw == "":
        return key.strip().split("."), ""
    try:
        return key.strip().split("."), load_yaml(raw)
    except (DuplicateKeyError, AliasExpansionError) as exc:
        raise ConfigError(f"override {shown(item)}: {exc}") from None
    except yaml.YAMLError as exc:
        where = f" ({exc.problem})" if getattr(exc, "problem", None) else ""
        raise ConfigError(
            f"override {shown(item)}: the value {shown(raw)} is not valid YAML{where}; quote it as a string or fix the "
            "brackets"
        ) from None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    data = json.loads(json.dumps(raw))  # deep copy of plain data
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {shown(item)}: {shown(k)} is not a section")
            node = child
        node[keys[-1]] = value
    return data


# the largest config file read, in bytes: the shipped configs are a few KB, and PyYAML parses 0.2-0.4 MB a second of
# prompts on 2 cores (far less of short values): a 50 MB prompt took 60 s and 1.9 GB before it was refused
# (docs/operations.md, "Bad input: refused as early as it can be seen")
CONFIG_MAX_BYTES = 1 << 20


def read_yaml(path: str | Path) -> dict:
    """The config file at `path` as a mapping; what is no YAML file, or one over `CONFIG_MAX_BYTES` (from its size,
    before it is read), is one `ConfigError` line."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {p} is a directory; pass the path of a YAML file, e.g. configs/quickstart.yaml")
    kind = special_file(p)
    if kind:
        raise ConfigError(
            f"config file {p} is {kind}, not a file (a config is read more than once in a run); write the config to "
            "a file and pass its path"
        )
    if not p.is_file():
        raise ConfigError(f"config file not found: {p} (pass the path of a YAML file, e.g. configs/quickstart.yaml)")
    try:
        with open(p, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            data = handle.read(CONFIG_MAX_BYTES + 1) if size <= CONFIG_MAX_BYTES else b""
    except OSError as exc:
        raise ConfigError(f"config file {p} cannot be read ({exc.strerror or exc})") from None
    if size > CONFIG_MAX_BYTES or len(data) > CONFIG_MAX_BYTES:  # the second: it grew while it was read
        raise ConfigError(
            f"config file {p} is {max(size, len(data))} bytes, more than the {CONFIG_MAX_BYTES} a config may hold "
            "(the shipped ones are a few KB); shorten its long values, e.g. eval.prompts entries (only the first "
            "eval.num_samples are sampled)"
        )
    try:
        raw = load_yaml(_universal_newlines(data.decode("utf-8")))
    except (DuplicateKeyError, AliasExpansionError) as exc:
        raise ConfigError(f"config file {p}: {exc}") from None
    except RecursionError:  # yaml's parser recurses once per level of nesting
        raise ConfigError(
            f"config file {p} nests its lists or mappings too deeply to read; a pipeline config is a few levels deep"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {p} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            "is it the YAML file you meant?"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
    if raw is None:
        raise ConfigError(
            f"config file {p} is empty; a pipeline needs at least its sections (start from configs/quickstart.yaml)"
        )
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def _universal_newlines(text: str) -> str:
    """`\\r\\n` and `\\r` as `\\n`, as `Path.read_text` reads a file (line numbers in errors stay the file's)."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def validate_schema(raw: dict, source: str = "<dict>") -> PipelineSpec:
    """`raw` checked against the schema alone; `strategies.options.validate_config` also checks every strategy's
    options, and `strategies.options.load_config` reads a pipeline file."""
    try:
        return PipelineSpec.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None
