"""What a captured CUDA graph holds: its nodes by type (kernels, memsets, copies, event nodes), read
from the driver's debug dump (``cudaGraphDebugDotPrint``). A graph must be created with
``new_graph(debug=True)`` to keep its node list after instantiation; replays are unaffected."""

from __future__ import annotations

import bisect
import os
import re
import tempfile
import warnings
from pathlib import Path

import torch

# A node's attributes open after its quoted name and close at the first `"]` + `;` after them (edge
# attributes open too; they name no node type). Matched as two patterns, not one `name[(.*?)"];`:
# one lazy pattern scans to the end of the dump from every opening it cannot close (edge
# attributes without a quoted last value), quadratic in the graph's size.
_DOT_OPEN = re.compile(r'"graph_\d+_node_\d+"\s*\[')
_DOT_CLOSE = re.compile(r'"\s*\]\s*;')
_DOT_TYPE = re.compile(r"\b(KERNEL|MEMCPY|MEMSET|HOST|GRAPH|EMPTY|WAIT_EVENT|EVENT_RECORD|EXT_SEMAS_SIGNAL|"
                       r"EXT_SEMAS_WAIT|MEM_ALLOC|MEM_FREE|BATCH_MEM_OP|CONDITIONAL)\b")
_DOT_KERNEL_NAME = re.compile(r"([A-Za-z_$][\w$.]*)\s*\\?<\\?<\\?<")


def new_graph(debug: bool) -> torch.cuda.CUDAGraph:
    """A CUDA graph; with ``debug``, one that keeps its node list for ``graph_nodes`` (call
    ``instantiate`` after its capture)."""
    if not debug:
        return torch.cuda.CUDAGraph()
    try:  # the graph kept after capture; instantiated by ``instantiate`` (or its first replay)
        return torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:  # a torch without keep_graph: debug mode keeps it
        graph = torch.cuda.CUDAGraph()
        graph.enable_debug_mode()
        return graph


def instantiate(graph: torch.cuda.CUDAGraph) -> None:
    """Instantiate a kept graph now, so its first replay does not pay for it (no-op otherwise)."""
    fn = getattr(graph, "instantiate", None)
    if fn is not None:
        try:
            fn()
        except RuntimeError:  # already instantiated at the end of its capture
            pass


def parse_graph_dot(text: str) -> dict[str, list[str]] | None:
    """Node types of a cudaGraphDebugDotPrint dump: {"KERNEL": [kernel names], "MEMSET": [...], ...};
    None when no node could be read (another dump format)."""
    nodes: dict[str, list[str]] = {}
    for body in _attribute_bodies(text):
        m = _DOT_TYPE.search(body)
        if m is None:
            continue
        kind = m.group(1)
        name = ""
        if kind == "KERNEL":
            k = _DOT_KERNEL_NAME.search(body)
            name = k.group(1) if k else "?"
        nodes.setdefault(kind, []).append(name)
    return nodes or None


def _attribute_bodies(text: str):
    """Each opened attribute list's text up to its closing `"]` + `;`, in order, none overlapping;
    an opening after the last close has none. One pass over the dump."""
    closes = [m.start() for m in _DOT_CLOSE.finditer(text)]
    end = 0
    for m in _DOT_OPEN.finditer(text):
        if m.start() < end:  # inside the previous list's text
            continue
        i = bisect.bisect_left(closes, m.end())
        if i == len(closes):
            return
        yield text[m.end():closes[i]]
        end = _DOT_CLOSE.match(text, closes[i]).end()


def graph_nodes(graph: torch.cuda.CUDAGraph) -> dict[str, list[str]] | None:
    """The parsed debug dump of a graph made by ``new_graph(debug=True)``; None when the dump could
    not be written or read."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # debug_dump announces itself with warnings
        path = os.path.join(tmp, "graph.dot")
        try:
            graph.debug_dump(path)
        except RuntimeError:
            return None
        if not os.path.exists(path):
            return None
        return parse_graph_dot(Path(path).read_text(errors="replace"))


def kernel_count(graph: torch.cuda.CUDAGraph) -> int | None:
    """How many kernel nodes a debug-mode graph holds (None when its dump is unreadable)."""
    nodes = graph_nodes(graph)
    return None if nodes is None else len(nodes.get("KERNEL", []))
