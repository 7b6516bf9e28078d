"""`cann-run serve --ray` on a real Ray cluster on 127.0.0.1: a head node and a second worker node, each a
process with one CPU of its own, started and stopped here. Two replicas of a tiny model behind one endpoint,
driven with the official openai client and plain HTTP: answers equal the engine's, requests sharing a long
prefix land on one replica (read from the replicas' own prefix-cache counters), and a replica killed under
load loses no request without an error while Ray brings it back."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import pytest
from generation_utils import compile_tiny_chat_model
from served import free_port

from cann_llm.runtime.engine.engine import LLMEngine

CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def om(tmp_path_factory):
    return compile_tiny_chat_model(tmp_path_factory, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def engine(om):
    with LLMEngine(om, kv_cache_pages=64, max_context_len=4096, threads=1) as engine:
        yield engine


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    store = 80 * 2 ** 20
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": store})
    cluster.add_node(num_cpus=1, object_store_memory=store)
    cluster.wait_for_nodes(timeout=180)  # a second raylet on a busy host can take Ray's 30 s default
    yield cluster
    cluster.shutdown()


class RayServer:
    """`cann-run serve --ray` joined to `cluster`, as a user starts it against their cluster."""

    def __init__(self, cluster, *argv: str, replicas: int = 2):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")  # a pipe nobody reads could fill and block the server
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cann_llm.cli.cann_run", "serve", "--ray", "--ray-address", cluster.address,
             "--port", str(self.port), "--replicas", str(replicas), *argv],
            stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        self.wait_for(lambda replicas_now: len(replicas_now) == replicas, "every replica to report")

    def _said(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def replicas(self) -> list[dict]:
        try:
            response = httpx.get(f"{self.url}/replicas", timeout=60)
        except httpx.TransportError:
            return []
        return [r for r in response.json()["replicas"] if r["status"] == "ok"] if response.status_code == 200 else []

    def wait_for(self, condition, what: str, timeout: float = 180) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self._said()
            now = self.replicas()
            if condition(now):
                return now
            time.sleep(0.25)
        raise TimeoutError(f"waited {timeout} s for {what}")

    def per_replica(self, name: str) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics/replicas", timeout=60).text
        return {m.group(1): float(m.group(2))
                for m in re.finditer(rf'^{re.escape(name)}\{{model_name="tiny",replica="([^"]+)"\}} (\S+)$', text, re.M)}

    def settled(self, name: str, total: float, timeout: float = 120) -> dict[str, float]:
        """`per_replica(name)` once the replicas' reports add up to `total` (they report within a second)."""
        deadline = time.monotonic() + timeout
        while sum((seen := self.per_replica(name)).values()) != total:
            assert time.monotonic() < deadline, f"{name} reached {sum(seen.values())}, not {total}"
            time.sleep(0.1)
        return seen

    def quiet(self, name: str, timeout: float = 120) -> dict[str, float]:
        """`per_replica(name)` once two reads over a reporting interval agree (earlier requests all reported)."""
        seen, deadline = self.per_replica(name), time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(1.2)
            now = self.per_replica(name)
            if now == seen:
                return now
            seen = now
        raise TimeoutError(f"{name} still changing after {timeout} s")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=120)


@pytest.fixture(scope="module")
def ray_server(cluster, om):
    server = RayServer(cluster, "--model", f"tiny={om}", "--kv_cache_pages", "64", "--max_context_len", "4096")
    yield server
    server.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def test_replicas_run_one_on_each_node_and_answer_as_the_engine_does(ray_server, engine):
    replicas = ray_server.wait_for(lambda now: len(now) == 2, "both replicas to report")
    assert len({r["node"] for r in replicas}) == 2 and len({r["pid"] for r in replicas}) == 2
    api = client(ray_server)
    assert [m.id for m in api.models.list()] == ["tiny"]
    for prompt in ("hello", "the quick brown fox", "0123456789"):
        expected = engine.generate(prompt, max_new_tokens=24, temperature=0)
        assert api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0).choices[0].text == expected
        streamed = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True)
        pieces = [chunk.choices[0].text for chunk in streamed]
        assert "".join(pieces) == expected and len(pieces) > 2
    messages = [{"role": "user", "content": "Say something"}]
    expected_chat = engine.chat(messages, max_new_tokens=12, temperature=0)
    reply = api.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == expected_chat
    deltas = [c.choices[0].delta.content or "" for c in api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True)]
    assert "".join(deltas) == expected_chat


def test_requests_sharing_a_long_prefix_land_on_the_replica_that_cached_it(ray_server):
    api = client(ray_server)
    landed = []
    for system in ("You answer questions about the ACME company's products. " * 12,
                   "Tu reponds aux questions sur les services de la societe Globex. " * 12):
        before = ray_server.quiet("cann_llm:prefix_cache_queries_total")  # earlier requests all reported
        before_hits = ray_server.per_replica("cann_llm:prefix_cache_hits_total")
        queried, shortest = 0, None
        for question in ("What do you sell?", "Where are you?", "Who runs it?", "How old is it?"):
            reply = api.chat.completions.create(model="tiny", max_tokens=4, temperature=0, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": question}])
            queried += reply.usage.prompt_tokens
            shortest = min(shortest or reply.usage.prompt_tokens, reply.usage.prompt_tokens)
        after = ray_server.settled("cann_llm:prefix_cache_queries_total", sum(before.values()) + queried)
        grew = {r for r in after if after[r] != before.get(r, 0)}
        assert len(grew) == 1, f"one group's prompts spread over {grew}"
        (replica,) = grew
        hits = ray_server.per_replica("cann_llm:prefix_cache_hits_total")[replica] - before_hits.get(replica, 0)
        # the three prompts after the first found the shared system prompt in that replica's cache (all of each
        # prompt but its question, a few tokens)
        assert hits >= 3 * (shortest - 24)
        landed.append(replica)
    assert landed[0] != landed[1], "the second prefix went where the first was cached, not to the idle replica"


def test_metrics_sum_the_replicas_and_a_conversation_stays_on_its_replica(ray_server):
    api = client(ray_server)
    name = "cann_llm:generation_tokens_total"
    before = sum(ray_server.quiet(name).values())
    first = api.chat.completions.create(model="tiny", max_tokens=6, temperature=0, extra_body={"conversation_id": "c-1"},
                                        messages=[{"role": "user", "content": "My name is Ada."}])
    second = api.chat.completions.create(model="tiny", max_tokens=6, temperature=0, extra_body={"conversation_id": "c-1"},
                                         messages=[{"role": "user", "content": "What is my name?"}])
    # the second turn's prompt holds the first turn and its answer: kept by the replica that served it
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    apart = ray_server.settled(name, before + first.usage.completion_tokens + second.usage.completion_tokens)
    deadline = time.monotonic() + 60
    # both replicas count while each has reported within 5 s: a starved reporter thread may miss a beat
    while not re.search(r"^cann_llm:replicas 2\.0$", text := httpx.get(f"{ray_server.url}/metrics", timeout=60).text,
                        re.M):
        assert time.monotonic() < deadline, "the merged metrics did not count both replicas within 60 s"
        time.sleep(0.25)
    merged = float(re.search(rf'^{name}\{{model_name="tiny"\}} (\S+)$', text, re.M).group(1))
    assert merged == sum(apart.values()) and len(apart) == 2


def test_what_the_ingress_cannot_route_the_replica_refuses_in_openais_shape(ray_server):
    response = httpx.post(f"{ray_server.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    response = httpx.post(f"{ray_server.url}/v1/completions", content=b"x" * (5 * 2 ** 20), timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == 413


@pytest.mark.parametrize("argv, code, said", [
    (["--replicas", "3"], "E13017", "3 replicas of 1 CPU need 3 CPUs; the cluster has 2"),
    (["--replicas", "1"], "E10055", "an application named 'cann-llm' already runs on the cluster"),
])
def test_a_deployment_the_cluster_cannot_take_is_refused_and_leaves_the_running_one_alone(ray_server, cluster, om,
                                                                                        argv, code, said):
    running = {r["pid"] for r in ray_server.wait_for(lambda now: len(now) == 2, "both replicas to report")}
    result = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "serve", "--ray", "--ray-address", cluster.address,
                             "--port", str(free_port()), "--model", f"tiny={om}", *argv],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and code in result.stderr and said in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    # the same two processes: a refused deployment neither stopped nor replaced a replica
    ray_server.wait_for(lambda now: {r["pid"] for r in now} == running, "the same two replicas to report")
    assert client(ray_server).models.list().data[0].id == "tiny"


def test_a_replica_killed_under_load_fails_or_retries_each_request_and_ray_restarts_it(ray_server, engine):
    prompts = [f"request number {i}: tell me more" for i in range(8)]
    new_tokens = 1500
    results: list = [None] * len(prompts)

    def run(i: int) -> None:
        # EOS held off: every request runs its 1,500 tokens, so the victim is still busy when it is killed
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": new_tokens, "temperature": 0}
        try:
            if i % 2:  # streamed: once a piece is out, a failure can only be reported in the stream
                text = "".join(c.choices[0].text for c in client(ray_server).completions.create(
                    **body, stream=True, extra_body={"ignore_eos": True}))
                results[i] = ("ok", text, False)
            else:
                response = httpx.post(f"{ray_server.url}/v1/completions", json={**body, "ignore_eos": True}, timeout=600)
                if response.status_code == 200:
                    results[i] = ("ok", response.json()["choices"][0]["text"],
                                  response.headers.get("x-replica-retried") == "1")
                else:
                    results[i] = ("error", response.status_code, response.json()["error"]["message"])
        except openai.APIError as error:
            results[i] = ("error", getattr(error, "status_code", None), str(error))
        except Exception as error:  # reported below, not lost with the thread
            results[i] = ("raised", None, repr(error))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    # the replicas report what they run about every second, so a report can be older than the work it shows:
    # the victim is chosen on a fresh one (the ages read first, so the counts read after are at least as new)
    busy: list = []
    deadline = time.monotonic() + 60
    while not busy:
        assert time.monotonic() < deadline, "no replica reported running requests"
        time.sleep(0.05)
        fresh = {r["replica"]: r["pid"] for r in ray_server.replicas() if r["reported_s_ago"] < 0.3}
        running = ray_server.per_replica("cann_llm:num_requests_running")
        busy = sorted((running[r], r) for r in fresh if running.get(r, 0) >= 1)
    victim = busy[-1][1]
    pid = fresh[victim]
    os.kill(pid, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=600)
    assert not any(thread.is_alive() for thread in threads), "a request hung after its replica died"

    expected = engine.generate_batch(prompts, max_tokens=new_tokens, temperature=0, ignore_eos=True)
    affected = 0
    for i, result in enumerate(results):
        if result[0] == "ok":
            assert result[1] == expected[i]
            affected += result[2]
        else:
            assert result[0] == "error" and "retry" in result[2], result
            affected += 1
    assert affected >= 1, "the killed replica was running requests, yet none was retried or failed"

    replicas = ray_server.wait_for(lambda now: len(now) == 2 and pid not in {r["pid"] for r in now},
                                   "Ray to replace the killed replica")
    assert victim not in {r["replica"] for r in replicas}
    answer = client(ray_server).completions.create(model="tiny", prompt=prompts[0], max_tokens=24, temperature=0)
    assert answer.choices[0].text == engine.generate(prompts[0], max_new_tokens=24, temperature=0)


@pytest.mark.parametrize("argv, code", [
    (["--replicas", "2"], "E10055"),
    (["--ray", "--autoscale", "3:1"], "E10001"),
    (["--ray", "--quota-tokens", "100"], "E10055"),
])
def test_scale_out_flags_are_checked_before_anything_starts(om, argv, code):
    result = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "serve", "--model", f"tiny={om}", *argv],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 1 and code in result.stderr and "Traceback" not in result.stderr


def test_without_an_address_it_starts_a_cluster_of_its_own_autoscaled_and_drains_it_on_sigterm(om, engine):
    """The first SIGTERM drains: the routes stay, new requests and /health get OpenAI's 503; a second ends the
    grace, and a stream still running ends with an error event and [DONE]."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "cann_llm.cli.cann_run", "serve", "--ray", "--autoscale", "1:2",
                                "--port", str(port), "--model", f"tiny={om}", "--max_context_len", "32768",
                                "--kv_cache_pages", "256", "--shutdown-grace", "600"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    signals = 0
    try:
        _lines_until(process, "ready in", timeout=300)
        head = [pid for pid in _children(process.pid) if "ray.scripts.scripts" in _command(pid)]
        assert len(head) == 1, "the local head node is not this process's own"
        node = _children(head[0])
        assert node, "the head node runs no process"
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
        assert health["status"] == "ok" and health["replicas"] == 1  # autoscaled from its minimum
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                            json={"model": "tiny", "prompt": "hello", "max_tokens": 16, "temperature": 0})
        assert answer.json()["choices"][0]["text"] == engine.generate("hello", max_new_tokens=16, temperature=0)

        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 32000, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
                for line in response.iter_lines():
                    events.append(line)
                    started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(120), "the stream sent nothing"
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while (health := httpx.get(f"{url}/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "the drain did not begin"
            time.sleep(0.05)
        assert (health.status_code, health.json(), health.headers["retry-after"]) == (503, {"status": "shutting down"}, "1")
        refused = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["message"] == "the server is shutting down"
        assert reader.is_alive(), "the stream ended within the grace, before the second signal"
        process.send_signal(signal.SIGTERM)
        signals = 2
        reader.join(timeout=120)
        said = [line for line in events if line]
        assert said[-1] == "data: [DONE]" and json.loads(said[-2].removeprefix("data: "))["error"]["code"] == 503
        assert len(said) > 3  # text came before the cut
    finally:
        if not signals:
            process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0
    deadline = time.monotonic() + 60
    while any(os.path.exists(f"/proc/{pid}") for pid in [*head, *node]):
        assert time.monotonic() < deadline, "the cluster it started outlived it"
        time.sleep(0.2)


def _lines_until(process: subprocess.Popen, start: str, timeout: float) -> list[str]:
    """`process`'s stderr lines up to one starting with `start`, read on a thread (to the end, so the pipe
    never fills) so a silent process fails the test at the deadline instead of hanging it."""
    lines, found = [], threading.Event()

    def read() -> None:
        for line in process.stderr:
            lines.append(line)
            if line.startswith(start):
                found.set()

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout), "".join(lines)
    return lines


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                if entry.isdigit() and int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return found


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

