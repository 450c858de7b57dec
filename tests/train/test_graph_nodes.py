"""Reading a captured CUDA graph's node list from the driver's debug dump (train/graph_nodes.py):
node types and kernel names, edge attributes ignored, in one pass over the dump."""

import time

from lora_bench.train.graph_nodes import parse_graph_dot


def _kernel(i: int, name: str) -> str:
    return (f'"graph_0_node_{i}"[style="solid" shape="record" label="{{KERNEL\\n| {{ID | {i} | void {name}'
            f'\\<\\<\\<\\{{80,1,1\\}},\\{{128,1,1\\}},0\\>\\>\\>}}\\n| {{priority | 0}}}}"];\n')


def _dump(nodes: list[str], edges: list[str]) -> str:
    return ('digraph dot {\nsubgraph cluster_1 {\nlabel="graph_0" graph[style="dashed"];\n'
            + "".join(nodes) + "".join(edges) + "}\n}\n")


def test_node_types_and_kernel_names_are_read_and_edges_are_not_nodes():
    nodes = [_kernel(0, "at::native::vectorized_elementwise_kernel"),
             '"graph_0_node_1"[style="solid" shape="record" label="{MEMSET\\n| {ID | 1}}"];\n',
             _kernel(2, "cutlass::Kernel2"),
             '"graph_0_node_3"[style="solid" shape="record" label="{MEMCPY\\n| {ID | 3}}"];\n',
             '"graph_0_node_4"[style="solid" shape="record" label="{EVENT_RECORD\\n| {ID | 4}}"];\n']
    edges = ['"graph_0_node_0" -> "graph_0_node_1" [style="solid"];\n',
             '"graph_0_node_1" -> "graph_0_node_2";\n',
             '"graph_0_node_2" -> "graph_0_node_3" [color=black];\n']
    got = parse_graph_dot(_dump(nodes, edges))
    assert got == {"KERNEL": ["vectorized_elementwise_kernel", "Kernel2"],  # the name, less its scope
                   "MEMSET": [""], "MEMCPY": [""], "EVENT_RECORD": [""]}
    assert parse_graph_dot("digraph dot {\n}\n") is None  # no node: another format


def test_a_dump_of_a_large_graph_is_read_in_one_pass():
    """A packed 1558M step's graphs hold tens of thousands of nodes and edges; edge attributes
    without a quoted last value open a list that no `"];` closes before the end of the dump.
    Matched by one lazy pattern, each such edge scanned to the end: minutes for this dump."""
    n = 30_000
    nodes = [_kernel(i, f"k{i % 7}") for i in range(n)]
    edges = [f'"graph_0_node_{i}" -> "graph_0_node_{i + 1}" [style=solid];\n' for i in range(n - 1)]
    text = _dump(nodes, edges)
    t0 = time.perf_counter()
    got = parse_graph_dot(text)
    seconds = time.perf_counter() - t0
    assert len(got["KERNEL"]) == n and got["KERNEL"][:8] == [f"k{i % 7}" for i in range(8)]
    # one pass over ~10 MB takes well under a second; the quadratic scan ~n²/2 edge-section steps
    assert seconds < 15, f"{seconds:.1f} s to read a dump of {len(text) / 1e6:.0f} MB"
