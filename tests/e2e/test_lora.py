"""End to end: LoRA adapters served as models (issue 52). Real Ray, real vLLM (CPU) engines on the demo model, three
generated rank-8 adapters (flagscale/demo_model.py's ensure_demo_lora, B nonzero), the OpenAI SDK.

First, with no deployment: a bad adapter path is refused before anything starts. Then one deployment, two replicas,
shared by the tests in order: /v1/models lists each adapter with its base as `parent` -> each adapter answers
(completion and streamed chat) through the router, differently from the base model for the same prompt at
temperature 0 -> the router's /metrics count each adapter's requests -> `run` again with one adapter added and one
removed: loaded and unloaded in place (the engines' processes are the same ones), while a client keeps asking the
adapters that stay, without a failed request -> the router's admin call (the engine key) adds one adapter and
removes another, again in place and without a failed request -> a replica whose engine is killed is replaced, and
the new one has the whole set, the one given at run time, before it is READY -> stop, nothing left.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import psutil
import pytest

from flagscale.cluster.processes import session_members
from flagscale.demo_model import ensure_demo_lora
from tests.conftest import STATUS_WAIT_S, demo_engine_args, run_cli, status_cli, wait_for, write_config

PORT = 19301
ADAPTERS = ("sql", "bot", "doc")
PROMPT = "the quick brown fox"


def node(adapters: dict[str, str]) -> dict:
    return {
        "serve_id": "demo",
        "engine": "vllm",
        "engine_args": demo_engine_args(served_model_name="demo"),
        "lora": {"adapters": adapters, "max_loras": 2},
        "resources": {"num_replicas": 2, "num_cpus": 1},
    }


def test_a_bad_adapter_path_is_refused_before_anything_starts(tmp_path):
    exp = tmp_path / "exp"
    conf = write_config(tmp_path / "conf", [node({"sql": str(tmp_path / "no-such-adapter")})], exp, PORT)
    result = run_cli(conf, timeout=300)
    assert result.returncode != 0
    assert f"LoRA adapter 'sql': {tmp_path}/no-such-adapter is no directory" in result.output, result.output
    assert "serve[0](demo).lora.adapters.sql" in result.output
    assert not (exp / "state.json").exists()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    paths = {name: str(ensure_demo_lora(name)) for name in (*ADAPTERS, "new", "extra")}
    exp_dir = root / "exp"
    conf = write_config(root / "conf", [node({name: paths[name] for name in ADAPTERS})], exp_dir, PORT)
    result = run_cli(conf, timeout=900)
    state_path = exp_dir / "state.json"
    sessions = [h["session"] for h in json.loads(state_path.read_text())["hosts"]] if state_path.exists() else []
    yield {"conf": conf, "root": root, "exp_dir": exp_dir, "run": result, "sessions": sessions, "paths": paths}
    if state_path.exists():  # a test failed before the stop test ran
        run_cli(conf, "action=stop", timeout=300)


@pytest.fixture(scope="module")
def client(deployment):
    assert deployment["run"].returncode == 0, deployment["run"].output
    return openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", timeout=120, max_retries=0)


def models(client) -> dict[str, str | None]:
    return {m.id: getattr(m, "parent", None) for m in client.models.list().data}


def test_models_lists_each_adapter_with_its_base(client):
    assert models(client) == {"demo": None, "sql": "demo", "bot": "demo", "doc": "demo"}


def complete(client, model: str) -> str:
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, seed=1)
    assert answer.model == model and answer.usage.completion_tokens == 12
    return answer.choices[0].text


def test_each_adapter_answers_differently_from_the_base_model(client):
    base = complete(client, "demo")
    answers = {name: complete(client, name) for name in ADAPTERS}
    assert all(text != base for text in answers.values()), (base, answers)
    assert len(set(answers.values())) == len(ADAPTERS), answers  # each adapter is its own
    for name in ADAPTERS:  # the same adapter answers alike on either replica (temperature 0)
        assert complete(client, name) == answers[name]


@pytest.mark.parametrize("model", ADAPTERS)
def test_each_adapter_streams_chat_and_completions(client, model):
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [c for c in chat if c.choices and c.choices[0].delta.content]
    assert len(chunks) >= 3 and all(c.model == model for c in chunks)
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, seed=1, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == complete(client, model)


def test_router_metrics_count_each_adapters_requests(client):
    text = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=30).read().decode()
    for name in ADAPTERS:
        assert f'flagscale_router_requests_total{{model="{name}"' in text, name


def status_json(deployment) -> dict:
    result = status_cli(deployment["conf"], "output=json")
    assert result.returncode == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{") :])


def engine_pids(deployment) -> set[int]:
    return {r["engine_pid"] for r in status_json(deployment)["replicas"]}


class AdapterLoad:
    """A client asking the adapters that stay one request after another until stopped."""

    def __init__(self, client, stay: tuple[str, ...] = ("sql", "bot")):
        self.client, self.stop, self.ok, self.failures = client, threading.Event(), 0, []
        self.stay = stay
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                complete(self.client, self.stay[n % len(self.stay)])
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                self.failures.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> AdapterLoad:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(120)


def test_run_again_adds_and_removes_adapters_in_place(deployment, client):
    before = engine_pids(deployment)
    paths = deployment["paths"]
    changed = {name: paths[name] for name in ("sql", "bot", "new")}  # doc removed, new added
    write_config(deployment["conf"], [node(changed)], deployment["exp_dir"], PORT)
    with AdapterLoad(client) as load:
        result = run_cli(deployment["conf"], timeout=600)
        assert result.returncode == 0, result.output
        assert "serve.demo.lora.adapters.new: added" in result.output
        wait_for(lambda: load.ok >= 4, 120, "the client's requests after the update")
    assert not load.failures, load.failures
    assert models(client) == {"demo": None, "sql": "demo", "bot": "demo", "new": "demo"}
    assert complete(client, "new") != complete(client, "demo")
    with pytest.raises(openai.NotFoundError):
        complete(client, "doc")
    assert engine_pids(deployment) == before  # loaded in place: no engine restarted
    state = json.loads((deployment["exp_dir"] / "state.json").read_text())
    assert set(state["extra"]["config"]["serve"]["demo"]["lora"]["adapters"]) == {"sql", "bot", "new"}


def admin(body: dict | None, key: str) -> tuple[int, dict]:
    """GET (body None) or POST /admin/adapters with `key`: (status, JSON answer)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{PORT}/admin/adapters",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def test_the_admin_call_adds_and_removes_adapters_in_place(deployment, client):
    before = engine_pids(deployment)
    key = (deployment["exp_dir"] / "engine_api_key").read_text().strip()
    change = {"model": "demo", "add": {"extra": deployment["paths"]["extra"]}, "remove": ["bot"]}
    assert admin(change, "none")[0] == 401  # a client's key is no admin key
    status, answer = admin({"model": "demo", "add": {"bad": "/no/such/adapter"}}, key)
    assert status == 400 and "LoRA adapter 'bad': /no/such/adapter is no directory" in answer["error"]["message"]
    with AdapterLoad(client, stay=("sql", "new")) as load:
        status, answer = admin(change, key)
        assert status == 200, answer
        assert all(r["loaded"] == ["extra", "new", "sql"] and not r["dropping"] for r in answer["replicas"].values())
        assert len(answer["replicas"]) == 2, answer
        wait_for(lambda: load.ok >= 4, 120, "the client's requests after the change")
    assert not load.failures, load.failures
    # every router process serves the new set (the one answering here may not be the one that took the call)
    wanted = {"demo": None, "sql": "demo", "new": "demo", "extra": "demo"}
    wait_for(lambda: models(client) == wanted, 30, "/v1/models to list the new set")
    assert complete(client, "extra") != complete(client, "demo")
    with pytest.raises(openai.NotFoundError):
        complete(client, "bot")
    assert engine_pids(deployment) == before  # loaded in place: no engine restarted
    assert admin(None, key)[1]["models"]["demo"]["given_at_run_time"] is True
    table = status_cli(deployment["conf"]).stdout
    assert "'demo': adapters given at run time (POST /admin/adapters): extra, new, sql" in " ".join(table.split())


def test_a_replica_whose_engine_is_killed_comes_back_with_the_full_set(deployment, client):
    wanted = {"demo", "sql", "new", "extra"}  # the set the admin call gave
    (victim, *_) = status_json(deployment)["replicas"]
    psutil.Process(victim["engine_pid"]).children()[0].kill()  # engine_proc's child: vLLM's server

    def replaced() -> list[dict] | None:  # two READY replicas again, the killed one gone, each with every adapter
        replicas = [r for r in status_json(deployment)["replicas"] if r["state"] == "READY"]
        ids = {r["replica_id"] for r in replicas}
        ok = (
            len(replicas) == 2 and victim["replica_id"] not in ids and all(set(r["models"]) == wanted for r in replicas)
        )
        return replicas if ok else None

    replicas = wait_for(replaced, STATUS_WAIT_S, "the killed replica replaced, with every adapter loaded")
    assert all(not r["adapter_errors"] for r in replicas)
    for name in ("sql", "new", "extra"):
        assert complete(client, name) != complete(client, "demo")


def test_stop_leaves_nothing(deployment, client):
    assert deployment["sessions"]
    result = run_cli(deployment["conf"], "action=stop", timeout=300)
    assert result.returncode == 0, result.output
    assert not [p for s in deployment["sessions"] for p in session_members(s)]
    assert not (deployment["exp_dir"] / "state.json").exists()
