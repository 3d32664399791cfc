"""Deployment graph validation and request checks: pure logic, no Ray."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from flagscale.config.graph import build_graph_plan, find_cycle, topological_order
from flagscale.config.load import ConfigSources, load_config
from flagscale.config.request import bind
from flagscale.errors import ConfigError

NODES = """
class Root:
    def forward(self, prompt, times):
        return prompt * times

class One:
    def forward(self, x):
        return x

class Two:
    async def forward(self, x, y):
        return x + y

class NoForward:
    pass

class Flexible:
    def forward(self, *parts):
        return parts

class UsesEngine:
    def __init__(self, llm):
        self.llm = llm
    def forward(self, prompt, times):
        return prompt

class NeedsSomething:
    def __init__(self, tokenizer):
        pass
    def forward(self, prompt, times):
        return prompt
"""


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    (tmp_path / "serve").mkdir()
    (tmp_path / "nodes.py").write_text(textwrap.dedent(NODES))
    return tmp_path


def node(serve_id, cls, depends=(), module="nodes.py", **extra):
    return {"serve_id": serve_id, "module": module, "name": cls, "depends": list(depends), **extra}


def diamond():
    return [node("A", "Root"), node("B", "One", ["A"]), node("C", "One", ["A"]), node("D", "Two", ["B", "C"])]


def plan(conf: Path, nodes, engines=None, deploy=None):
    deploy = (
        {"name": "/generate", "request": {"args": ["prompt", "times"], "types": ["str", "int"]}}
        if deploy is None
        else deploy
    )
    cfg = {
        "experiment": {"exp_name": "t", "exp_dir": str(conf / "exp"), "runner": {"deploy": deploy}},
        "serve": nodes,
    }
    sources = ConfigSources(main=str(conf / "serve.yaml"), serve=str(conf / "serve" / "nodes.yaml"))
    return build_graph_plan(load_config(cfg, sources), sources, engines or {})


def error(conf: Path, nodes, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        plan(conf, nodes, **kwargs)
    return str(info.value)


def test_diamond_plan(conf):
    graph = plan(conf, diamond())
    assert [n.serve_id for n in graph.nodes][0] == "A" and graph.nodes[-1].serve_id == "D"
    assert graph.sink == "D" and graph.route == "/generate"
    assert graph.node("D").depends == ["B", "C"]
    assert graph.node("A").module_path == str((conf / "nodes.py").resolve())


def test_autoscaling_and_resources_reach_the_plan(conf):
    nodes = diamond()
    nodes[1]["resources"] = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2, "num_cpus": 0.5}
    b = plan(conf, nodes).node("B")
    assert b.num_replicas is None
    assert b.autoscaling == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2}
    assert b.ray_actor_options == {"num_cpus": 0.5}


def test_cycle_is_printed(conf):
    nodes = [node("A", "Root"), node("B", "One", ["A", "D"]), node("C", "One", ["B"]), node("D", "One", ["C"])]
    message = error(conf, nodes)
    assert "dependency cycle" in message and "B -> D -> C -> B" in message and "nodes.yaml" in message


def test_self_dependency_is_a_cycle(conf):
    assert "A -> A" in error(conf, [node("A", "One", ["A"])])


def test_unknown_dependency(conf):
    message = error(conf, [node("A", "Root"), node("B", "One", ["Z"])])
    assert "unknown dependency 'Z'" in message and "serve[1](B)" in message


def test_several_sinks(conf):
    message = error(conf, [node("A", "Root"), node("B", "One", ["A"]), node("C", "One", ["A"])])
    assert "exactly one sink" in message and "B, C" in message


def test_zero_sinks_when_entry_has_no_custom_node(conf):
    engine = {"serve_id": "llm", "engine": "vllm", "engine_args": {"model": "/m"}}
    message = error(conf, [engine], engines={"llm": "llm"})
    assert "no sink" in message and "experiment.runner.deploy" in message


def test_module_file_missing(conf):
    message = error(conf, [node("A", "Root", module="missing.py")])
    assert "module file 'missing.py' not found" in message and "serve[0](A)" in message


def test_module_relative_to_working_dir(conf, monkeypatch):
    monkeypatch.chdir(conf.parent)
    assert plan(conf, [node("A", "Root", module=f"{conf.name}/nodes.py")]).sink == "A"


def test_class_missing(conf):
    message = error(conf, [node("A", "Nope")])
    assert "no class 'Nope'" in message and "nodes.py" in message


def test_class_without_forward(conf):
    assert "NoForward has no forward method" in error(conf, [node("A", "Root"), node("B", "NoForward", ["A"])])


def test_forward_arity_against_depends(conf):
    message = error(conf, [node("A", "Root"), node("B", "One", ["A"]), node("C", "One", ["A", "B"])])
    assert "does not take 2 positional argument(s)" in message and "serve[2](C)" in message
    message = error(conf, [node("A", "Root"), node("B", "Two", ["A"])])
    assert "does not take 1 positional" in message
    assert plan(conf, [node("A", "Root"), node("B", "One", ["A"]), node("C", "Flexible", ["A", "B"])]).sink == "C"


def test_root_forward_must_take_the_request_fields(conf):
    message = error(conf, [node("A", "One")])
    assert "does not accept request field(s) ['prompt', 'times']" in message


def test_request_args_types_mismatch(conf):
    deploy = {"name": "/g", "request": {"args": ["prompt", "times"], "types": ["str"]}}
    assert "does not match request.args" in error(conf, [node("A", "Root")], deploy=deploy)


def test_unsupported_type_name(conf):
    deploy = {"name": "/g", "request": {"args": ["prompt", "times"], "types": ["str", "integer"]}}
    message = error(conf, [node("A", "Root")], deploy=deploy)
    assert "unsupported type 'integer'" in message and "supported: str, int" in message


def test_engine_nodes_are_reached_by_client_not_depends(conf):
    engine = {"serve_id": "llm", "engine": "vllm", "engine_args": {"model": "/m"}}
    message = error(conf, [engine, node("A", "Root"), node("B", "One", ["llm"])], engines={"llm": "demo"})
    assert "engine nodes are not graph steps" in message and "parameter 'llm'" in message
    graph = plan(conf, [engine, node("A", "UsesEngine")], engines={"llm": "demo"})
    assert graph.node("A").engine_params == {"llm": "llm"} and graph.engine_models == {"llm": "demo"}


def test_constructor_parameter_must_name_an_engine(conf):
    assert "'tokenizer' of NeedsSomething has no default" in error(conf, [node("A", "NeedsSomething")])


def test_route_may_not_shadow_openai_routes(conf):
    assert "collides" in error(conf, [node("A", "Root")], deploy={"name": "/v1/completions"})


def test_import_error_names_the_file(conf):
    (conf / "broken.py").write_text("import not_a_module_anywhere\n")
    message = error(conf, [node("A", "Root", module="broken.py")])
    assert "importing the module failed" in message and "broken.py" in message


def test_cycle_and_order_helpers():
    assert find_cycle({"a": [], "b": ["a"], "c": ["a", "b"]}) is None
    assert find_cycle({"a": ["c"], "b": ["a"], "c": ["b"]}) == ["a", "c", "b", "a"]
    assert topological_order({"d": ["b", "c"], "c": ["a"], "b": ["a"], "a": []}) == ["a", "b", "c", "d"]


def test_check_request(conf):
    graph = plan(conf, diamond())

    def check_request(graph, payload):
        return bind(graph.request_fields, payload)[1]

    assert check_request(graph, {"prompt": "x", "times": 2}) is None
    assert "must be int, got str" in check_request(graph, {"prompt": "x", "times": "2"})
    assert "must be int, got bool" in check_request(graph, {"prompt": "x", "times": True})
    assert "missing required request field(s) ['times']" in check_request(graph, {"prompt": "x"})
    assert "unexpected request field(s) ['extra']" in check_request(graph, {"prompt": "x", "times": 1, "extra": 0})
    assert "JSON object" in check_request(graph, ["x"])


def test_reserved_serve_ids(conf):
    assert "'graph' is reserved" in error(conf, [node("graph", "Root")])


def test_edited_module_code_is_an_in_place_change(conf):
    """A custom node's code is part of what runs: `run` again after editing the file redeploys that node."""
    from flagscale.update import diff, snapshot

    sources = ConfigSources(main=str(conf / "serve.yaml"), serve=str(conf / "serve" / "nodes.yaml"))
    cfg = {
        "experiment": {"exp_name": "t", "exp_dir": str(conf / "exp"), "runner": {"deploy": {"name": "/generate"}}},
        "serve": [node("A", "Root")],
    }

    def snap():
        config = load_config(cfg, sources)
        return snapshot(config, None, build_graph_plan(config, sources, {}))

    before = snap()
    assert diff(before, snap()) == []
    with (conf / "nodes.py").open("a") as f:
        f.write("\n# edited\n")
    (change,) = diff(before, snap())
    assert change.path == "serve.A.module_digest" and change.in_place
