"""The deployment graph as text (for the console) and as a PNG (for exp_dir), from the plan."""

from __future__ import annotations

from pathlib import Path

from flagscale.adaptors import matplotlib_figure, networkx
from flagscale.plan import Plan

REQUEST, RESPONSE = "request", "response"


def describe(plan: Plan) -> list[str]:
    graph = plan.graph
    assert graph is not None
    if graph.request_fields is None:
        fields = "any JSON object"
    else:
        fields = ", ".join(
            f"{f.name}: {f.type}" + ("" if f.required else f" = {f.default!r}") for f in graph.request_fields
        )
    lines = [f"POST {plan.endpoint}{graph.route}  {{{fields}}}"]
    for node in graph.nodes:
        inputs = ", ".join(node.depends) if node.depends else f"{REQUEST} (keyword arguments)"
        replicas = node.describe_replicas()
        line = (
            f"  {inputs} -> {node.serve_id}  [{node.class_name} in {Path(node.module_path).name}, replicas {replicas}]"
        )
        if node.engine_params:
            line += "  calls " + ", ".join(f"engine {sid} (as {param})" for param, sid in node.engine_params.items())
        lines.append(line)
    lines.append(f"  {graph.sink} -> {RESPONSE}")
    return lines


def draw(plan: Plan, path: Path) -> Path:
    """Request -> custom nodes (left to right by depth) -> response; engines dashed, next to their callers."""
    graph = plan.graph
    assert graph is not None
    dag = networkx.DiGraph()
    for node in graph.nodes:
        for dep in node.depends or [REQUEST]:
            dag.add_edge(dep, node.serve_id)
    dag.add_edge(graph.sink, RESPONSE)
    for depth, layer in enumerate(networkx.topological_generations(dag)):
        for name in layer:
            dag.nodes[name]["layer"] = depth
    calls = [(node.serve_id, engine) for node in graph.nodes for engine in node.engine_params.values()]
    for caller, engine in calls:
        dag.add_node(engine, layer=dag.nodes[caller]["layer"])
    pos = networkx.multipartite_layout(dag, subset_key="layer")
    for caller, engine in calls:  # engines below their caller
        pos[engine] = (pos[caller][0], pos[caller][1] - 0.6)

    fig = matplotlib_figure.Figure(figsize=(2.2 * (max(networkx.get_node_attributes(dag, "layer").values()) + 1), 4.5))
    ax = fig.subplots()
    engines = sorted({engine for _, engine in calls})
    custom = [n.serve_id for n in graph.nodes]
    networkx.draw_networkx_nodes(
        dag, pos, nodelist=[REQUEST, RESPONSE], node_color="#dddddd", node_shape="s", node_size=1600, ax=ax
    )
    networkx.draw_networkx_nodes(dag, pos, nodelist=custom, node_color="#9ecae1", node_size=1800, ax=ax)
    if engines:
        networkx.draw_networkx_nodes(
            dag, pos, nodelist=engines, node_color="#fdae6b", node_shape="h", node_size=2000, ax=ax
        )
    data_edges = [e for e in dag.edges if e not in calls]
    networkx.draw_networkx_edges(dag, pos, edgelist=data_edges, arrows=True, arrowsize=18, node_size=1800, ax=ax)
    networkx.draw_networkx_edges(dag, pos, edgelist=calls, style="dashed", arrows=True, node_size=2000, ax=ax)
    networkx.draw_networkx_labels(dag, pos, font_size=9, ax=ax)
    ax.set_title(f"{plan.app_name}: POST {graph.route}" + ("   (dashed: engine calls)" if engines else ""))
    ax.margins(0.15)
    ax.set_axis_off()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
