"""flagscale.adaptors: a heavy module is imported at its first use, once, and not when flagscale is imported."""

import subprocess
import sys
import threading

from flagscale.adaptors import LazyImport


def test_first_attribute_access_imports_the_module_once():
    lazy = LazyImport("json")
    assert "not imported yet" in repr(lazy)
    assert lazy.dumps({"a": 1}) == '{"a": 1}'
    assert lazy.load() is sys.modules["json"]
    assert "imported" in repr(lazy) and "not" not in repr(lazy)


def test_threads_share_one_import():
    lazy = LazyImport("decimal")
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(lazy.load())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(seen) == 8 and all(m is seen[0] for m in seen)


def test_a_missing_module_fails_at_first_use_naming_it():
    lazy = LazyImport("no_such_module_for_flagscale")
    try:
        lazy.load()
    except ModuleNotFoundError as exc:
        assert "no_such_module_for_flagscale" in str(exc)
    else:
        raise AssertionError("a missing module must raise at first use")


def test_importing_the_cluster_layer_does_not_import_ray():
    code = (
        "import sys, flagscale.cluster.ray_compat, flagscale.cluster.ray_existing, flagscale.cluster.ray_node_tasks; "
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
