"""Config YAML read with bounded cost, and config values shortened before they appear in a message.

`yaml.safe_load` runs no code, but a few hundred bytes of nested aliases ("billion laughs") describe a value
of billions of items: composing it is cheap (aliases share nodes), yet anything that walks the value (an
error message's `repr`, a copy, a JSON dump) runs out of time and memory. `load_yaml` composes the document
with a loader that refuses more than `MAX_NODES` nodes or `MAX_DEPTH` levels while it reads, then counts
the value's size with every alias expanded (each shared node counted once per reference, in time linear in
the nodes actually written) and refuses it beyond `MAX_NODES`, as it does recursive aliases. Real config
files have a few dozen nodes.

`short_repr(value)` is `repr` limited in length, items and depth (`reprlib`), for error messages and warnings
that echo a value read from a file.
"""

from __future__ import annotations

import reprlib
from typing import IO, Any

import yaml

MAX_NODES = 100_000  # a config file has tens; large generated ones hundreds
MAX_DEPTH = 64


class DocumentTooLargeError(yaml.YAMLError):
    """A YAML document whose value, with its aliases expanded, is too large (or too deep, or recursive)."""


class _BoundedSafeLoader(yaml.SafeLoader):
    """yaml.SafeLoader that stops composing past MAX_NODES nodes or MAX_DEPTH levels."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._composed = 0
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._composed += 1
        self._depth += 1
        try:
            if self._composed > MAX_NODES:
                raise DocumentTooLargeError(f"the document has more than {MAX_NODES} values")
            if self._depth > MAX_DEPTH:
                raise DocumentTooLargeError(f"the document nests values more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def expanded_size(node: yaml.Node, limit: int = MAX_NODES) -> int:
    """The number of nodes of `node` with every alias expanded; DocumentTooLargeError beyond `limit` or
    for a recursive alias. Each distinct node is visited once (sizes are memoized)."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    while stack:
        current, children_done = stack.pop()
        key = id(current)
        if key in sizes and not children_done:
            continue
        children = _children(current)
        if not children_done:
            if key in on_path:
                raise DocumentTooLargeError("the document holds a recursive alias (a value that contains itself)")
            on_path.add(key)
            stack.append((current, True))
            for child in children:
                if id(child) in on_path:
                    raise DocumentTooLargeError("the document holds a recursive alias (a value that contains itself)")
                if id(child) not in sizes:
                    stack.append((child, False))
            continue
        on_path.discard(key)
        size = 1 + sum(sizes[id(child)] for child in children)
        if size > limit:
            raise DocumentTooLargeError(
                f"with its aliases (&anchor / *alias) expanded, the document has more than {limit} values "
                "(nested aliases that multiply a value: a 'billion laughs' document)"
            )
        sizes[key] = size
    return sizes[id(node)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def load_yaml(stream: str | bytes | IO[Any]) -> Any:
    """`yaml.safe_load(stream)` that refuses, with DocumentTooLargeError (a yaml.YAMLError), documents too
    large, too deep or recursive once aliases are expanded, before building any Python value."""
    loader = _BoundedSafeLoader(stream)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded_size(node)
        try:
            return loader.construct_document(node)
        except ValueError as exc:  # e.g. an integer of more than 4300 digits (sys.get_int_max_str_digits)
            raise yaml.YAMLError(f"a value cannot be read: {str(exc)[:200]}") from exc
    finally:
        loader.dispose()


_SHORT = reprlib.Repr()
_SHORT.maxstring = 60
_SHORT.maxother = 60
_SHORT.maxlong = 40
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = _SHORT.maxdict = 6
_SHORT.maxlevel = 3
MAX_SHOWN = 120


def short_repr(value: Any, limit: int = MAX_SHOWN) -> str:
    """`repr(value)` of at most about `limit` characters, whatever the value's size or depth."""
    text = _SHORT.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_keys(keys: Any, limit: int = 200) -> str:
    """`keys` (sorted, each shortened) comma-separated, as many as fit in about `limit` characters, then
    "... and N more": keys read from a file can be many and long."""
    ordered = sorted(keys, key=str)
    shown: list[str] = []
    for key in ordered:
        text = key if isinstance(key, str) and len(key) <= 40 else short_repr(key, 40)
        if shown and sum(len(t) + 2 for t in shown) + len(text) > limit:
            break
        shown.append(text)
    rest = len(ordered) - len(shown)
    return ", ".join(shown) + (f" ... and {rest} more" if rest else "")
