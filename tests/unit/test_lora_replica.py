"""A replica's LoRA adapters (flagscale/replica/adapters.py): the set its node should have, loaded and unloaded
through the engine's runtime routes; one that fails to load is left out, with the engine's reason."""

from __future__ import annotations

from flagscale import engines
from flagscale.replica.adapters import AdapterSet

VLLM = engines.get("vllm")


class FakeRoutes:
    """The engine's runtime LoRA routes: what was asked, and the paths whose load fails."""

    def __init__(self, failing: tuple[str, ...] = ()):
        self.calls: list[tuple[str, dict]] = []
        self.failing = failing

    def __call__(self, path: str, body: dict) -> str | None:
        self.calls.append((path, body))
        if body.get("lora_path") in self.failing:
            return "HTTP 400: invalid adapter"
        return None


def test_adapters_added_removed_and_moved_are_loaded_unloaded_and_replaced():
    adapters, routes = AdapterSet(), FakeRoutes()
    adapters.sync(VLLM, {"a": "/a", "b": "/b"}, routes)
    assert adapters.loaded == {"a": "/a", "b": "/b"}
    assert [c[0] for c in routes.calls] == ["/v1/load_lora_adapter"] * 2
    routes.calls.clear()
    done = adapters.sync(VLLM, {"a": "/a2", "c": "/c"}, routes)  # b removed, a moved, c added
    assert adapters.loaded == {"a": "/a2", "c": "/c"}
    assert routes.calls == [
        ("/v1/unload_lora_adapter", {"lora_name": "b"}),
        ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a2", "load_inplace": True}),
        ("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "/c", "load_inplace": False}),
    ]
    assert done == ["adapter 'b' unloaded", "adapter 'a' loaded from /a2", "adapter 'c' loaded from /c"]
    routes.calls.clear()
    adapters.sync(VLLM, {"a": "/a2", "c": "/c"}, routes)  # the same set again: nothing asked
    assert routes.calls == []


def test_an_adapter_that_fails_to_load_is_left_out_with_why_until_it_loads():
    adapters = AdapterSet()
    adapters.sync(VLLM, {"a": "/a", "bad": "/bad"}, FakeRoutes(failing=("/bad",)))
    assert adapters.loaded == {"a": "/a"}
    assert adapters.errors == {"bad": "loading /bad failed: HTTP 400: invalid adapter"}
    adapters.sync(VLLM, {"a": "/a", "bad": "/bad"}, FakeRoutes())  # tried again on the next change
    assert adapters.loaded == {"a": "/a", "bad": "/bad"} and adapters.errors == {}
    adapters.sync(VLLM, {}, FakeRoutes())
    assert adapters.loaded == {} and adapters.errors == {}


# vLLM 0.32's /metrics on a CPU engine with max_loras 2 (a probe of the demo model): one label set per state seen,
# its value when it was last set
LORA_INFO = """# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7959505991091497e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters="sql"} 1.795950599038382e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="bot,sql",waiting_lora_adapters="doc"} 1.7959506e+09
"""


def test_the_engines_report_of_the_adapters_it_runs_is_its_newest_label_set():
    assert VLLM.lora_running(LORA_INFO) == ["bot", "doc", "sql"]
    assert VLLM.lora_running(LORA_INFO.replace("1.7959506e+09", "1.0")) == []  # idle now
    assert VLLM.lora_running("# nothing about adapters\n") is None
    assert engines.get("llama_cpp").lora_running(LORA_INFO) is None
