"""LLMEngine's behaviour beyond greedy equality: pages come back, preemption, chunking, the prefix cache,
streaming, asyncio, chat templates, and refusals."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time

import pytest
from conftest import compile_to
from generation_utils import NEW_TOKENS, compile_tiny_chat_model, hf_greedy, mixed_prompts

from cann_llm import LLMEngine

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def paged_om(tmp_path_factory):
    return compile_tiny_chat_model(tmp_path_factory, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def small_pages_om(tmp_path_factory):
    """The same model with 16-token pages, so sequences cross page boundaries while they decode."""
    from cann_llm.models.tiny import tiny_onnx

    folder = tmp_path_factory.mktemp("paged16")
    return compile_to(tiny_onnx("llama", dynamo=False, with_past=True), folder / "m", enable_paged_attention=True,
                      paged_config=_paged_config(folder, 16))


def _greedy(engine, prompts, **kwargs):
    requests = [engine.submit(p, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, **kwargs) for p in prompts]
    return [r.result() and r.output_ids for r in requests], requests


@pytest.mark.parametrize("drafts", [0, 4])
def test_preemption_by_recompute_keeps_greedy_output_and_frees_every_page(small_pages_om, drafts):
    prompts = mixed_prompts(8, seed=5, low=20, high=60)
    # 12 pages of 16 tokens: the admitted sequences outgrow them while they decode
    with LLMEngine(small_pages_om, max_batch_size=8, max_context_len=256, kv_cache_pages=12,
                   num_speculative_tokens=drafts, speculative_max_batch=8) as engine:
        outputs, requests = _greedy(engine, prompts)
        assert outputs == hf_greedy("llama", tuple(map(tuple, prompts)))
        assert engine.stats.preemptions > 0 and sum(r.stats.preemptions for r in requests) > 0
        assert (engine.stats.accepted_tokens > 0) == bool(drafts)
        assert engine.blocks.num_free == engine.blocks.num_pages


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_an_output_that_outgrows_the_whole_pool_ends_with_length(small_pages_om, prefix_caching):
    """Alone, its prompt in chunks of 32 tokens, a sequence grows past the pool (10 pages of 16 tokens: 70 prompt
    tokens and 100 wanted). Preempted, it came back chunk by chunk to the same page, forever (with its prompt's
    pages from the prefix cache, or, as a hybrid's, without). It ends with reason "length" and the 91 tokens
    the pool held."""
    prompt = mixed_prompts(1, seed=3, low=70, high=71)[0]
    with LLMEngine(small_pages_om, kv_cache_pages=10, max_num_batched_tokens=32, max_context_len=512,
                   enable_prefix_caching=prefix_caching) as engine:
        request = engine.submit(prompt, max_new_tokens=100, temperature=0, ignore_eos=True)
        assert request.future.result(timeout=60) is not None
        assert request.finish_reason == "length" and len(request.output_ids) == 10 * 16 - 70 + 1
        assert engine.blocks.num_free == engine.blocks.num_pages


def test_flash_prefill_keeps_greedy_output(tmp_path):
    from cann_llm.models.tiny import tiny_onnx

    om = compile_to(tiny_onnx("qwen2", dynamo=True, with_past=True), tmp_path / "m", enable_paged_attention=True,
                    enable_flash_attention=True)
    prompts = mixed_prompts(6, seed=8, low=64, high=190)  # long enough for the flash path
    with LLMEngine(om, max_batch_size=6, max_context_len=256, kv_cache_pages=16) as engine:
        outputs, _ = _greedy(engine, prompts)
    assert outputs == hf_greedy("qwen2", tuple(map(tuple, prompts)))


def test_chunked_prefill_keeps_greedy_output(paged_om):
    prompts = mixed_prompts(4, seed=6, low=40, high=60)
    with LLMEngine(paged_om, max_batch_size=4, max_context_len=256, kv_cache_pages=16,
                   max_num_batched_tokens=7) as engine:
        outputs, _ = _greedy(engine, prompts)
    assert outputs == hf_greedy("llama", tuple(map(tuple, prompts)))


def test_a_shared_prefix_is_taken_from_the_cache(small_pages_om):
    system = mixed_prompts(1, seed=7, low=50, high=51)[0]
    first, second = system + [5, 6, 7], system + [9, 10]
    with LLMEngine(small_pages_om, kv_cache_pages=32, max_context_len=256) as engine:
        outputs, requests = _greedy(engine, [first])
        later, later_requests = _greedy(engine, [second])
    # three whole 16-token pages shared, the 2 tokens after them copied from the first's partly filled page
    assert requests[0].stats.cached_tokens == 0 and later_requests[0].stats.cached_tokens == 50
    assert outputs + later == hf_greedy("llama", (tuple(first), tuple(second)))


@pytest.mark.parametrize("page_size", [16, 128])
def test_a_follow_up_turn_recomputes_only_its_new_tokens(paged_om, small_pages_om, page_size):
    """A chat's next turn is its history (the last prompt and the answer) plus a few new tokens: everything
    but the answer's last token (never computed) comes from the cache, wherever the pages end."""
    first = mixed_prompts(1, seed=8, low=37, high=38)[0]
    with LLMEngine(small_pages_om if page_size == 16 else paged_om, kv_cache_pages=32, max_context_len=256) as engine:
        (answer,), _ = _greedy(engine, [first])
        follow_up = first + answer + [11, 12, 13]
        (later,), (request,) = _greedy(engine, [follow_up])
    assert request.stats.cached_tokens == len(first) + len(answer) - 1
    assert [answer, later] == hf_greedy("llama", (tuple(first), tuple(follow_up)))


def _paged_config(folder, page_size: int) -> str:
    path = folder / "paged.json"
    path.write_text(json.dumps({"page_size": page_size}))
    return str(path)


def test_cancelled_requests_return_their_pages(paged_om):
    with LLMEngine(paged_om, max_context_len=256, kv_cache_pages=8) as engine:
        # no step runs before all three are submitted, and once each has a token the next step waits for the
        # cancels: none can finish first on a busy machine
        submitted, gate, run, requests = threading.Event(), threading.Event(), engine.runner.run, []

        def held_once_tokens_are_out(batch):
            submitted.wait(timeout=60)
            if all(r.output_ids for r in requests):
                gate.wait(timeout=60)
            return run(batch)

        engine.runner.run = held_once_tokens_are_out
        requests += [engine.submit([5] * 30, max_new_tokens=200, temperature=0, ignore_eos=True) for _ in range(3)]
        submitted.set()
        while not all(r.output_ids for r in requests):
            time.sleep(0.01)
        for request in requests:
            request.cancel()
        gate.set()
        assert [r.result() is not None for r in requests] == [True] * 3
        assert {r.finish_reason for r in requests} == {"cancelled"}
        assert all(len(r.output_ids) < 200 for r in requests)
        deadline = time.time() + 120
        while engine.blocks.num_free != 8 and time.time() < deadline:
            time.sleep(0.01)
        assert engine.blocks.num_free == 8


def test_a_request_past_its_deadline_ends_with_timeout_and_the_others_go_on(paged_om):
    with LLMEngine(paged_om, max_context_len=256, kv_cache_pages=8) as engine:
        gate, run, requests = threading.Event(), engine.runner.run, []

        def held_once_a_token_is_out(batch):  # until the deadline is posted: nothing finishes first
            if requests and requests[0].output_ids:
                gate.wait(timeout=60)
            return run(batch)

        engine.runner.run = held_once_a_token_is_out
        requests += [engine.submit([5] * 30, max_new_tokens=200, temperature=0, ignore_eos=True),
                     engine.submit([6] * 30, max_new_tokens=20, temperature=0, ignore_eos=True)]
        while not requests[0].output_ids:
            time.sleep(0.01)
        timed, other = requests
        timed.expire_at(time.monotonic())
        gate.set()
        assert timed.result() is not None and other.result() is not None
        assert timed.finish_reason == "timeout" and len(timed.output_ids) < 200
        assert other.finish_reason == "length" and len(other.output_ids) == 20
        deadline = time.time() + 120
        while engine.blocks.num_free != 8 and time.time() < deadline:
            time.sleep(0.01)
        assert engine.blocks.num_free == 8


def test_stream_async_and_batch_agree_with_generate(paged_om):
    prompt = "hello there"
    with LLMEngine(paged_om, max_context_len=256, kv_cache_pages=16) as engine:
        text = engine.generate(prompt, max_new_tokens=20, temperature=0, ignore_eos=True)
        assert "".join(engine.stream(prompt, max_new_tokens=20, temperature=0, ignore_eos=True)) == text
        assert engine.generate_batch([prompt, prompt], max_new_tokens=20, temperature=0, ignore_eos=True) == [text] * 2

        async def together():
            return await asyncio.gather(*(engine.generate_async(prompt, max_new_tokens=20, temperature=0,
                                                                ignore_eos=True) for _ in range(4)))

        assert asyncio.run(together()) == [text] * 4
        sampled = {engine.generate(prompt, max_new_tokens=20, temperature=1.0, seed=3, ignore_eos=True) for _ in range(2)}
        assert len(sampled) == 1


def test_stop_strings_and_per_request_stats(paged_om):
    with LLMEngine(paged_om, max_context_len=256, kv_cache_pages=16) as engine:
        full = engine.generate("abc", max_new_tokens=30, temperature=0, ignore_eos=True)
        stop = full[5:8]
        request = engine.submit("abc", max_new_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
        assert request.result() == full[:full.index(stop)] and request.finish_reason == "stop"
        stats = engine.submit("abc", max_new_tokens=10, temperature=0, ignore_eos=True)
        stats.result()
        assert stats.stats.prompt_tokens == 3 and stats.stats.output_tokens == 10
        assert 0 < stats.stats.ttft_s <= stats.stats.total_s


def test_drafts_change_no_request_output(paged_om):
    requests = [("abc", {"temperature": 0}), ("hello there", {"temperature": 0, "repetition_penalty": 1.3}),
                ("abc", {"temperature": 0.9, "seed": 3}), ("xyz", {"temperature": 1.2, "top_k": 20, "top_p": 0.9, "seed": 1})]
    texts = {}
    for drafts in (0, 4):
        with LLMEngine(paged_om, max_context_len=256, kv_cache_pages=16, num_speculative_tokens=drafts) as engine:
            handles = [engine.submit(prompt, max_new_tokens=40, ignore_eos=True, **params) for prompt, params in requests]
            texts[drafts] = [(h.result(), h.output_ids) for h in handles]
            stop = texts[drafts][0][0][9:12]
            stopped = engine.submit("abc", max_new_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
            texts[drafts].append((stopped.result(), stopped.finish_reason))
            assert (engine.stats.accepted_tokens > 0) == bool(drafts)
    assert texts[4] == texts[0]


def test_chat_renders_the_template_and_reuses_history(paged_om):
    with LLMEngine(paged_om, max_context_len=512, kv_cache_pages=16) as engine:
        messages = [{"role": "system", "content": "be brief " * 20}, {"role": "user", "content": "hi"}]
        ids = engine.chat_prompt(messages)
        assert engine.tokenizer.decode(ids) == "<system>" + "be brief " * 20 + "\n<user>hi\n<assistant>"
        reply = engine.chat(messages, max_new_tokens=8, temperature=0, ignore_eos=True)
        turn = engine.submit(engine.chat_prompt(messages + [{"role": "assistant", "content": reply},
                                                            {"role": "user", "content": "more"}]),
                             max_new_tokens=8, temperature=0, ignore_eos=True)
        turn.result()
        assert turn.stats.cached_tokens >= 128  # the first page of history came from the prefix cache
        # a role outside OpenAI's is refused, as the server refuses it, not rendered as the template likes
        with pytest.raises(ValueError, match=r"a message's role is one of system, developer, user, assistant, tool "
                                             r"\(or one the chat template names\), not 'wizard'"):
            engine.chat([{"role": "wizard", "content": "hi"}], max_new_tokens=2)


@pytest.mark.parametrize("prompt,message", [("", "empty"), ([1] * 300, "max_context_len")])
def test_bad_requests_are_refused(paged_om, prompt, message):
    with LLMEngine(paged_om, max_context_len=256, kv_cache_pages=16) as engine:
        with pytest.raises(ValueError, match=message):
            engine.submit(prompt)
        with pytest.raises(ValueError, match="temperature"):
            engine.submit("x", temperature=-1)


def test_closing_cancels_what_is_in_flight(paged_om):
    engine = LLMEngine(paged_om, max_context_len=256, kv_cache_pages=8)
    # the tiny model makes 200 tokens in a few tens of milliseconds: no step runs before the request is in
    # hand, and once its first token is out the next step waits until close() has begun, so the request is
    # still in flight then however busy the machine is
    submitted, gate, run, requests = threading.Event(), threading.Event(), engine.runner.run, []

    def held_once_a_token_is_out(batch):
        submitted.wait(timeout=60)
        if requests[0].output_ids:
            gate.wait(timeout=60)
        return run(batch)

    engine.runner.run = held_once_a_token_is_out
    requests.append(engine.submit([5] * 20, max_new_tokens=200, temperature=0, ignore_eos=True))
    submitted.set()
    request = requests[0]
    while not request.output_ids:
        time.sleep(0.01)
    closing = threading.Thread(target=engine.close)
    closing.start()
    while not engine._closed:
        time.sleep(0.001)
    gate.set()
    closing.join(timeout=60)
    assert not closing.is_alive()
    assert request.finish_reason == "cancelled" and request.future.done()
    request.cancel()  # after close: nothing left to do, and no error
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit("x")


def test_a_layer_whose_attention_did_not_fuse_still_gets_its_cache(tmp_path):
    # layer 0's attention read through a constant If (folded away, but the fusion no longer matches): one
    # FusedAttention, yet both layers' past inputs must be fed, or every request fails at its first step
    import onnx
    from onnx import TensorProto, helper

    from cann_llm.models.tiny import tiny_onnx
    from cann_llm.runtime.artifact import OmFile

    source = tiny_onnx("llama", dynamo=False, with_past=True)
    model = onnx.load(source)
    index, node = next((i, n) for i, n in enumerate(model.graph.node)
                       if n.name == "/model/model/layers.0/self_attn/MatMul_1")
    inner = onnx.NodeProto.FromString(node.SerializeToString())
    inner.output[0] += "_branch"
    branch = helper.make_graph([inner], "branch", [], [helper.make_tensor_value_info(inner.output[0], TensorProto.FLOAT, None)])
    model.graph.node[index].CopyFrom(helper.make_node("If", ["always"], [node.output[0]], then_branch=branch,
                                                      else_branch=branch))
    model.graph.node.insert(index, helper.make_node("Constant", [], ["always"],
                                                    value=helper.make_tensor("always", TensorProto.BOOL, [], [True])))
    onnx.save(model, tmp_path / "model.onnx")
    shutil.copy(source.with_name("tokenizer.json"), tmp_path)
    om = compile_to(tmp_path / "model.onnx", tmp_path / "m")
    artifact = OmFile(om)
    assert [n.op_type for n in artifact.graph().graph.node].count("FusedAttention") == 1
    assert artifact.metadata["model"]["num_layers"] == 2
    prompts = mixed_prompts(3, seed=9)
    with LLMEngine(om, max_batch_size=3, max_context_len=128) as engine:
        outputs, _ = _greedy(engine, prompts)
    assert outputs == hf_greedy("llama", tuple(map(tuple, prompts)))


def test_a_memory_budget_sizes_the_pool_in_whole_pages(small_pages_om):
    with LLMEngine(small_pages_om, kv_cache_memory_mb=1, kv_cache_pages=3) as engine:
        dims = engine.dims
        per_page = 2 * dims["num_layers"] * 16 * dims["num_kv_heads"] * dims["head_dim"] * 4  # K and V, float32
        assert engine.blocks.num_pages == engine.runner.pool.num_pages == 2**20 // per_page
        assert engine.runner.pool.nbytes <= 2**20 < engine.runner.pool.nbytes + per_page


def test_a_budget_too_small_for_one_page_is_refused_with_e10001():
    from cann_llm.runtime.engine.engine import _pages_in
    from cann_llm.runtime.errors import AtcError

    smollm2 = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}  # a 128-token page: 5.6 MiB of K and V
    assert _pages_in(6, smollm2, 128) == 1
    with pytest.raises(AtcError, match="E10001.*--kv_cache_memory_mb.*one page of 128 tokens takes 5.6 MiB"):
        _pages_in(5, smollm2, 128)


def test_a_step_time_target_holds_the_running_batch_down(paged_om):
    """A runner slowed past the target: the engine lets fewer sequences run at once, and all still finish."""
    prompts = mixed_prompts(8, seed=11, low=4, high=8)
    with LLMEngine(paged_om, max_batch_size=8, max_context_len=256, kv_cache_pages=32,
                   max_step_latency_ms=5) as engine:
        run = engine.runner.run

        def slow(batch):
            time.sleep(0.002 * len(batch.seqs))  # 2 ms a sequence: at most two fit in 5 ms
            return run(batch)

        engine.runner.run = slow
        outputs, _ = _greedy(engine, prompts)
        assert engine.scheduler.batch_cap <= 3
    assert outputs == hf_greedy("llama", tuple(map(tuple, prompts)))


def test_a_prompt_the_whole_pool_cannot_hold_is_refused_and_an_output_ends_at_its_end(small_pages_om):
    """A prompt past the pool is refused, naming the setting and the pages it needs; an output is bounded by
    the pool as by max_context_len, ending with "length" where the pool is full."""
    with LLMEngine(small_pages_om, kv_cache_pages=2, max_context_len=256) as engine:
        with pytest.raises(ValueError, match=r"^kv_cache_pages gives a pool of 2 pages of 16 tokens; the prompt's "
                                             r"33 tokens need 3"):
            engine.submit([5] * 33, max_new_tokens=2)
        request = engine.submit([5] * 5, max_new_tokens=100, temperature=0, ignore_eos=True)
        assert request.result() is not None and request.finish_reason == "length" and len(request.output_ids) < 100
    with LLMEngine(small_pages_om, kv_cache_memory_mb=1, max_context_len=4096) as engine:
        with pytest.raises(ValueError, match="^kv_cache_memory_mb gives a pool of"):
            engine.submit([5] * 4000, max_new_tokens=1)


def test_the_default_pool_fits_in_half_the_machines_memory(small_pages_om):
    """Without kv_cache_pages or kv_cache_memory_mb: 1024 pages, or as many as half the machine's memory holds
    if fewer. A 7B model's cache (32 layers, 32 KV heads of 128) takes 128 MiB a page of 128 tokens: 1024 of
    them (128 GiB) were more than a 24 GiB machine maps, and every engine on such a model failed to start."""
    from cann_llm.runtime.engine.engine import default_pages
    from cann_llm.runtime.memory import total_bytes

    seven_b = {"num_layers": 32, "num_kv_heads": 32, "head_dim": 128}
    assert default_pages(seven_b, 128, 24 * 2**30) == 96
    assert default_pages(seven_b, 128, 100 * 2**30) == 400
    assert default_pages(seven_b, 128, 2**20) == 1  # never none
    assert default_pages(seven_b, 128, None) == 1024
    with LLMEngine(small_pages_om) as engine:
        expected = default_pages({**engine.dims}, engine.page_size, total_bytes())
        assert engine.blocks.num_pages == expected == 1024  # a tiny model's pages are small


def test_a_pool_the_machine_cannot_map_is_e10001_naming_its_setting(small_pages_om):
    from cann_llm.runtime.errors import AtcError

    with pytest.raises(AtcError) as error:
        LLMEngine(small_pages_om, kv_cache_pages=10**13)
    assert error.value.code == "E10001" and "--kv_cache_pages" in error.value.message
    assert "more than this machine can map" in error.value.message
