"""Reading settings YAML (sweep files, ``train --config`` files, ``key=value`` overrides) safely.

``yaml.safe_load``'s types, plus rules that only a mistake or an attack breaks:

- a file holds at most ``MAX_CHARS`` bytes, refused by its size before it is read (``load_file``),
  and a document has at most ``MAX_CHARS`` characters and nests at most ``MAX_DEPTH`` levels;
- with every alias counted at each place it is used, it holds at most ``MAX_NODES`` values, and no
  anchor contains itself: an alias bomb ("billion laughs") is refused from its composed node
  graph, before any value is built or printed;
- a mapping names each key once (YAML would keep the last of duplicate keys without a word).

Floats may be written as YAML 1.2 and Python write them (``1e-05``, ``3E4``): YAML 1.1, which
PyYAML follows, reads those as strings, a surprise in a ``learning_rate``."""

from __future__ import annotations

import re
import reprlib
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from lora_bench.errors import ConfigError
from lora_bench.fileio import TooLarge, read_capped

MAX_NODES = 100_000  # values in a document with its aliases expanded: settings files hold hundreds
MAX_CHARS = 1_000_000  # a settings file is a few kilobytes
MAX_DEPTH = 50  # nesting levels: a sweep file needs four
MERGE_TAG = "tag:yaml.org,2002:merge"


class UnsafeDocument(yaml.YAMLError):
    """A document refused before it is built: nested too deeply, too large once its aliases are
    expanded, or an anchor that contains itself."""


class SettingsLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with an expansion limit, no duplicate keys, and YAML 1.2 floats."""

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_DEPTH:
                raise UnsafeDocument(f"the document nests more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Node:
        node = super().compose_document()
        _check_expansion(node)
        return node

    def construct_mapping(self, node: Node, deep: bool = False) -> dict:
        if isinstance(node, MappingNode):
            first_line: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue  # '<<' merges keys in on purpose; the mapping's own keys win
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = key in first_line
                except TypeError:
                    continue  # an unhashable key: the base constructor reports it
                if seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {short_repr(key)} (first given on line {first_line[key] + 1})",
                        key_node.start_mark)
                first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


# YAML 1.2 / Python float spellings that YAML 1.1 leaves as strings: an exponent without a dot
# (1e-05, 3E4) or with an unsigned exponent (1.5e3).
SettingsLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_expansion(root: Node | None) -> None:
    """Count the values of the document as if every alias were copied out, without copying:
    each node's expanded size is computed once (an alias shares its anchor's node)."""
    if root is None:
        return
    size: dict[int, int] = {}
    open_nodes: set[int] = set()  # on the current path: meeting one again is a cycle
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:  # iterative post-order
        node, children_done = stack.pop()
        if children_done:
            open_nodes.discard(id(node))
            size[id(node)] = 1 + sum(size[id(c)] for c in _children(node))
            if size[id(node)] > MAX_NODES:
                if len(size) > MAX_NODES:  # as many values written out: no alias made them
                    raise UnsafeDocument(f"the document holds more than {MAX_NODES:,} values; a settings or "
                                         "sweep file holds hundreds (split it, or use a grid of fewer values)")
                raise UnsafeDocument(f"the document expands to more than {MAX_NODES:,} values once its "
                                     "aliases are copied out (an alias bomb?); write the values out instead")
            continue
        if id(node) in size:
            continue
        open_nodes.add(id(node))
        stack.append((node, True))
        for child in reversed(_children(node)):
            if id(child) in open_nodes:
                raise UnsafeDocument(f"an anchor contains itself (line {child.start_mark.line + 1})")
            if id(child) not in size:
                stack.append((child, False))


def load(text: str | bytes, *, source: str | None = None) -> Any:
    """The document in ``text``; ConfigError (naming ``source``) when it is not valid YAML or is
    refused by the rules above."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError([f"not UTF-8 text ({e.reason} at byte {e.start})"], source=source) from None
    if len(text) > MAX_CHARS:
        raise ConfigError([f"refused: {len(text):,} characters; a settings file holds at most {MAX_CHARS:,}"],
                          source=source)
    try:
        return yaml.load(text, Loader=SettingsLoader)  # a SafeLoader subclass
    except UnsafeDocument as e:
        raise ConfigError([f"refused: {e}"], source=source) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"not valid YAML: {_yaml_problem(e)}"], source=source) from None
    except ValueError as e:  # an integer too long for int(): Python's own limit
        raise ConfigError([f"not valid YAML: {short_repr(str(e))}"], source=source) from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """What PyYAML found wrong and where, without the line of the document it would quote: the file
    may not be a settings file at all (a key, a password file), and its content stays unshown."""
    if isinstance(e, yaml.MarkedYAMLError):
        what = "; ".join(p for p in (e.context, e.problem) if p) or "a syntax error"
        mark = e.problem_mark or e.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        return (what if len(what) <= 160 else what[:159] + "…") + where
    return str(e).splitlines()[0][:160]


def read_file(path: Path) -> bytes:
    """The bytes of a settings file, read only if it holds at most ``MAX_CHARS`` bytes; ConfigError
    (naming the file) otherwise."""
    try:
        return read_capped(path, MAX_CHARS)
    except TooLarge as e:
        raise ConfigError([f"refused: {e.size:,} bytes; a settings file holds at most {MAX_CHARS:,}"],
                          source=str(path)) from None
    except OSError as e:
        raise ConfigError([f"cannot read it ({e.strerror or e})"], source=str(path)) from None


def load_file(path: Path) -> Any:
    """The document in the settings file ``path`` (see ``read_file`` and ``load``)."""
    return load(read_file(path), source=str(path))


def parse_scalar(text: str) -> Any:
    """A ``key=value`` override's value, read as a value in a YAML file is: ``4`` an int, ``1e-5``
    a float, ``true`` a bool, ``null`` or nothing None, anything else text."""
    if text.strip() == "":
        return None
    return load(text, source=f"value {short_repr(text)}")


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, without building the whole repr of a huge
    value first (a long string, a big nested list, an integer of thousands of digits)."""
    if isinstance(value, bool) or value is None:
        text = repr(value)
    elif isinstance(value, int):
        digits = value.bit_length() * 0.30103
        text = repr(value) if digits < limit else f"<an integer of about {int(digits):,} digits>"
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, str):
        text = repr(value[: limit + 1])
    else:
        text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def describe(value: Any) -> str:
    """What kind of value a document holds, without quoting it ("text of 1,234 characters", "a list
    of 3 items"): for a file that may not be meant as settings at all."""
    if isinstance(value, str):
        return f"text of {len(value):,} characters"
    if isinstance(value, list):
        return f"a list of {len(value):,} items"
    if isinstance(value, bool) or value is None:
        return "true or false" if isinstance(value, bool) else "nothing"
    return "a number" if isinstance(value, (int, float)) else f"a {type(value).__name__}"


def _make_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 2, 4, 4, 4, 4
    r.maxstring, r.maxother, r.maxlong = 40, 40, 40
    return r


_REPR = _make_repr()
