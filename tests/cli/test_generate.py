"""`cann-run generate`, `chat` and `bench` end to end, each in its own process (as users run them: the
commands make onnxruntime's process-wide thread pool, which a test process must not inherit)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from generation_utils import compile_tiny_chat_model

from cann_llm.runtime.engine.engine import LLMEngine

CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def chat_om(tmp_path_factory):
    return compile_tiny_chat_model(tmp_path_factory, CHAT_TEMPLATE, "chat")


def _cann_run(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", *argv], capture_output=True, text=True, input=stdin,
                          timeout=300)


def test_generate_prints_the_engines_greedy_text(chat_om, tmp_path):
    result = _cann_run("generate", "--model", str(chat_om), "--prompt", "hello", "--temperature", "0",
                       "--max_new_tokens", "24", "--kv_cache_pages", "16", "--json", str(tmp_path / "g.json"))
    assert result.returncode == 0, result.stderr
    with LLMEngine(chat_om, kv_cache_pages=16) as engine:
        expected = engine.generate("hello", max_new_tokens=24, temperature=0)
    assert result.stdout.rstrip("\n") == expected
    report = json.loads((tmp_path / "g.json").read_text())
    assert report["text"] == expected and report["output_tokens"] == 24 and report["finish_reason"] == "length"
    assert "[INFO] prompt 5 tokens" in result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == f"loading {chat_om} …" and lines[1].startswith("loaded in ")


def test_chat_keeps_the_conversation_and_reuses_it(chat_om):
    result = _cann_run("chat", "--model", str(chat_om), "--temperature", "0", "--max_new_tokens", "8",
                       "--kv_cache_pages", "16", "--system", "x" * 150, stdin="first question\nsecond one\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("assistant> ") == 2 and "user> second one" in result.stdout
    stats = [re.match(r"\[INFO\] prompt (\d+) tokens \((\d+) from the prefix cache\), (\d+) generated", line)
             for line in result.stderr.splitlines() if line.startswith("[INFO] prompt")]
    (first, cached_first, _), (_, cached_second, _) = [tuple(map(int, m.groups())) for m in stats]
    # the second turn takes at least the whole first prompt from the cache, past its last page boundary (the
    # tiny model's answer is random bytes, which need not come back as the same tokens once rendered)
    assert cached_first == 0 and first > 128 and cached_second >= first


def test_a_long_chat_never_outgrows_its_context(chat_om):
    """200 turns in a 512-token context: the earliest turns are summarised by the model whenever the next
    would not fit, and every turn's prompt and reply stay within it."""
    turns = [f"turn {i}: tell me something new" for i in range(200)]
    result = _cann_run("chat", "--model", str(chat_om), "--temperature", "0", "--max_new_tokens", "16",
                       "--kv_cache_pages", "16", "--max_context_len", "512", stdin="\n".join(turns) + "\n")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("assistant> ") == 200
    prompts = [int(m) for m in re.findall(r"\[INFO\] prompt (\d+) tokens", result.stderr)]
    assert len(prompts) == 200 and max(prompts) + 16 <= 512
    summaries = re.findall(r"summarised the (\d+) earliest messages in (\d+) tokens", result.stderr)
    assert len(summaries) >= 10 and all(int(messages) % 2 == 0 for messages, _ in summaries)  # whole exchanges


@pytest.mark.parametrize("argv,code", [(["--prompt", ""], "E10001"), (["--prompt", "x", "--top_p", "0"], None)])
def test_bad_requests_exit_with_a_message(chat_om, argv, code):
    result = _cann_run("generate", "--model", str(chat_om), *argv)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    if code:
        assert code in result.stderr


def test_a_missing_model_is_a_coded_error(tmp_path):
    result = _cann_run("generate", "--model", str(tmp_path / "none.om"), "--prompt", "x")
    assert result.returncode == 1 and "E13001" in result.stderr and "Traceback" not in result.stderr


def test_bench_measures_and_writes_json(chat_om, tmp_path):
    from cann_llm.models.tiny import tiny_onnx

    out = tmp_path / "bench.json"
    result = _cann_run("bench", "--model", str(chat_om), "--onnx", str(tiny_onnx("llama", dynamo=False, with_past=True)),
                       "--requests", "6", "--concurrency", "1,3", "--prompt_lengths", "8,40", "--output_lengths", "4,12",
                       "--prefill_tokens", "32", "--decode_tokens", "8", "--repeats", "1", "--long_prefill", "256",
                       "--kv_cache_pages", "16", "--max_context_len", "256", "--num_speculative_tokens", "4",
                       "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert set(report["batch1"]) == {"engine", "engine+lookup", "onnxruntime"}
    assert all(report["batch1"][side][key] > 0 for side in ("engine", "onnxruntime") for key in ("prefill", "decode"))
    lookup = report["batch1"]["engine+lookup"]
    assert lookup["decode"] > 0 and lookup["num_speculative_tokens"] == 4 and 0 <= lookup["accepted_share"] <= 1
    # the lowest concurrency is served again without drafts
    assert [(row["concurrency"], row["lookup"]) for row in report["serving"]] == [(1, 4), (3, 4), (1, 0)]
    assert all(row["requests"] == 6 and row["output_tokens"] >= 6 * 4 for row in report["serving"])
    assert 1 <= report["serving"][1]["peak_sequences"] <= 3  # how many overlap depends on timing
    # --max_batch_size left out: raised past its default of 8 only where a level needs it (none here)
    assert (report["settings"]["max_batch_size"], report["settings"]["max_context_len"]) == (8, 257)
    assert 0 < report["serving"][1]["kv_page_utilisation"] <= 1
    prefill = report["long_prefill"][0]
    assert prefill["tokens"] == 256 and prefill["kv_pages_mb"] > 0 and prefill["peak_rss_added_mb"] >= 0
    assert "aggregate tok/s at concurrency 3 / concurrency 1 (lookup 0)" in result.stdout
    resident = report["resident_memory"]
    assert 0 < resident["after_load_mb"] <= resident["peak_mb"] and resident["includes_onnxruntime_loop"] is True
    line = f"resident memory: {resident['after_load_mb']:.0f} MB once loaded, peak {resident['peak_mb']:.0f} MB"
    assert line in result.stdout
    lines = result.stderr.splitlines()
    assert lines[0] == f"loading {chat_om} …" and lines[1].startswith("loaded in ")
    for desc, count, unit in (("batch-1", 1, "round"), ("concurrency 1", 6, "request"), ("concurrency 3", 6, "request"),
                              ("long prefills", 1, "prefill")):
        assert f"{desc}: started, {count} {unit}s" in lines
        assert any(line.startswith(f"{desc}: {count} {unit}s in ") for line in lines)


def test_bench_json_to_stdout_keeps_the_table_on_stderr(chat_om):
    result = _cann_run("bench", "--model", str(chat_om), "--requests", "2", "--concurrency", "1",
                       "--prompt_lengths", "8,16", "--output_lengths", "2,4", "--prefill_tokens", "16",
                       "--decode_tokens", "4", "--repeats", "1", "--long_prefill", "", "--kv_cache_pages", "16",
                       "--max_context_len", "64", "--json", "-", "--log-level", "error")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["serving"][0]["requests"] == 2 and report["settings"]["max_context_len"] == 129  # raised to fit its prompts
    assert "batch 1            prefill tok/s" in result.stderr and "loading" not in result.stderr


def test_generate_answers_from_a_context_file_that_does_not_fit(chat_om, tmp_path):
    document = tmp_path / "doc.txt"
    words = [f"filler{i} " * 40 for i in range(60)]  # ~21K bytes, a token a byte: far past the context
    words[41] = "the harbour passphrase is amber-falcon " * 5
    document.write_text("\n".join(words))
    result = _cann_run("generate", "--model", str(chat_om), "--context_file", str(document), "--prompt",
                       "What is the harbour passphrase?", "--temperature", "0", "--max_new_tokens", "8",
                       "--max_context_len", "1024", "--kv_cache_pages", "16")
    assert result.returncode == 0, result.stderr
    passages, kept, total = map(int, re.search(r"context: (\d+) passages, (\d+) of the document's (\d+) tokens",
                                               result.stderr).groups())
    prompt = int(re.search(r"\[INFO\] prompt (\d+) tokens", result.stderr).group(1))
    assert total > 20_000 and kept < 1024 and passages >= 1 and prompt + 8 <= 1024


@pytest.fixture(scope="module")
def contiguous_om(tmp_path_factory, chat_om):
    """The same tiny model and tokenizer with contiguous past/present I/O."""
    import shutil

    from conftest import compile_to

    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("llama", dynamo=False, with_past=True)
    folder = tmp_path_factory.mktemp("tokenizer")
    shutil.copy(source.with_name("tokenizer.json"), folder / "tokenizer.json")
    return compile_to(source, tmp_path_factory.mktemp("om") / "contiguous", tokenizer=str(folder))


BENCH_SMALL = ("--requests", "2", "--concurrency", "1", "--prompt_lengths", "8,16", "--output_lengths", "2,4",
               "--prefill_tokens", "16", "--decode_tokens", "4", "--repeats", "1", "--long_prefill", "",
               "--max_context_len", "64", "--log-level", "error")


def test_bench_of_a_contiguous_artifact_prints_its_table_and_writes_json(contiguous_om, tmp_path):
    out = tmp_path / "bench.json"
    result = _cann_run("bench", "--model", str(contiguous_om), *BENCH_SMALL, "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["paged"] is False and report["serving"][0]["kv_page_utilisation"] is None
    row = next(line for line in result.stdout.splitlines() if re.match(r"\s+1\s+0\s+2 ", line))
    assert row.split()[-2] == "-"  # no pages to report


@pytest.mark.parametrize("argv,code,flag", [
    (["--concurrency", "a,b"], "E10001", "--concurrency"), (["--concurrency", "0"], "E10001", "--concurrency"),
    (["--concurrency", "-1"], "E10001", "--concurrency"), (["--concurrency", ""], "E10001", "--concurrency"),
    (["--prompt_lengths", "16,8"], "E10001", "--prompt_lengths"), (["--prompt_lengths", "8"], "E10001", "--prompt_lengths"),
    (["--output_lengths", "0,4"], "E10001", "--output_lengths"), (["--long_prefill", "abc"], "E10001", "--long_prefill"),
    (["--text", "{tmp}/absent.txt"], "E13001", "absent.txt"), (["--text", "{tmp}/latin1.txt"], "E13001", "not UTF-8"),
    (["--text", "{tmp}/empty.txt"], "E10001", "--text"), (["--onnx", "{tmp}/absent.onnx"], "E13001", "absent.onnx"),
    (["--onnx", "{tmp}/empty.txt"], "E10001", "--onnx"),
])
def test_bench_refuses_a_bad_flag_with_its_code_before_measuring(chat_om, tmp_path, argv, code, flag):
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
    (tmp_path / "empty.txt").write_text(" \n")
    argv = [word.format(tmp=tmp_path) for word in argv]
    result = _cann_run("bench", "--model", str(chat_om), "--kv_cache_pages", "16", *BENCH_SMALL, *argv,
                       "--json", str(tmp_path / "bench.json"))
    assert result.returncode == 1 and f"[ERROR] {code}" in result.stderr and flag in result.stderr, result.stderr
    assert "E19999" not in result.stderr and not (tmp_path / "bench.json").exists()


@pytest.mark.parametrize("argv,flag,words", [
    (["--prompt", "word " * 60, "--kv_cache_pages", "2"], "--kv_cache_pages", "the prompt's"),
    (["--prompt", "hi", "--kv_cache_pages", str(10**12)], "--kv_cache_pages", "more than this machine can map"),
    (["--prompt", "hi", "--seed", "-5"], "--seed", "0<=x<="),
    (["--prompt", "hi", "--stop", ""], "--stop", "stop strings must not be empty"),
    (["--prompt", "hi", "--temperature", "nan"], "--temperature", "finite"),
    (["--prompt", "hi", "--temperature", "1e-30"], "--temperature", "at least 0.001"),
    (["--prompt", "hi", "--repetition_penalty", "0.001"], "--repetition_penalty", "0.01<=x<=100"),
    (["--prompt", "hi", "--draft_model", "{om}"], "--num_speculative_tokens", "at least 1"),
    (["--prompt", "hi", "--chat_template_file", "{tmp}/broken.jinja"], "--chat_template_file", "not a jinja template"),
    (["--prompt", "Hi \udcff"], "--prompt", "not valid UTF-8"),
    (["--prompt", "hi", "--max_new_token", "3"], "--max_new_token", "Did you mean '--max_new_tokens'?"),
])
def test_generate_names_the_flag_it_refuses(chat_om, tmp_path, argv, flag, words):
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }")
    argv = [word.format(om=chat_om, tmp=tmp_path) for word in argv]
    result = _cann_run("generate", "--model", str(chat_om), "--temperature", "0", *argv)
    assert result.returncode == 1 and "[ERROR] E10001" in result.stderr, result.stderr
    assert f"parameter {flag} is invalid" in result.stderr or f"Value {flag} for" in result.stderr, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr


def test_generate_settings_are_checked_before_the_model_loads(chat_om):
    result = _cann_run("generate", "--model", str(chat_om), "--prompt", "hi", "--temperature", "nan")
    assert result.returncode == 1 and "loading" not in result.stderr


@pytest.mark.parametrize("argv,stdin,flag", [
    ([], "Hi \udcff\n", "stdin"), (["--message", "Hi \udcff"], None, "--message"),
    (["--message", "hi", "--system", "Hi \udcff"], None, "--system"),
    (["--message", "hi", "--message", "", "--message", "bye"], None, "--message"),
    (["--max_context_len", "64", "--message", "w" * 100], None, "--message"),
])
def test_chat_refuses_a_turn_it_cannot_take_naming_where_it_came_from(chat_om, argv, stdin, flag):
    result = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "chat", "--model", str(chat_om), "--max_new_tokens",
                             "4", "--kv_cache_pages", "16", *argv], capture_output=True, timeout=300,
                            input=None if stdin is None else stdin.encode("utf-8", "surrogateescape"),
                            env={**__import__("os").environ, "PYTHONUTF8": "1"})
    stderr = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 1 and f"parameter {flag} is invalid" in stderr and "Traceback" not in stderr, stderr
    assert b"user> bye" not in result.stdout


def test_generate_json_to_stdout_streams_the_text_to_stderr_and_error_level_hides_info(chat_om):
    result = _cann_run("generate", "--model", str(chat_om), "--prompt", "hello", "--temperature", "0",
                       "--max_new_tokens", "6", "--kv_cache_pages", "16", "--json", "-", "--log-level", "error")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["output_tokens"] == 6 and report["text"] in result.stderr
    assert "[INFO]" not in result.stderr and "loading" not in result.stderr


def test_a_mistyped_command_is_named_and_the_msame_call_still_runs(chat_om):
    result = _cann_run("genrate", "--model", str(chat_om), "-p", "hi")
    assert result.returncode == 1 and "No such command 'genrate'" in result.stderr and "'generate'" in result.stderr
    assert "[ERROR] E10001" in result.stderr
    missing = _cann_run("generate", "--model", str(chat_om), "--prompt", "x", "--context_file", "absent.txt")
    assert missing.returncode == 1 and "[ERROR] E13001" in missing.stderr and "absent.txt" in missing.stderr


def test_ctrl_c_ends_generate_by_sigint_with_one_line(chat_om):
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "cann_llm.cli.cann_run", "generate", "--model", str(chat_om), "--prompt", "hi",
                             "--max_new_tokens", "30000", "--max_context_len", "32768", "--kv_cache_pages", "256",
                             "--temperature", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    proc.stdout.read(1)  # generating: the engine's worker is running
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGINT, stderr.decode()[-2000:]
    assert b"Traceback" not in stderr and stderr.decode().rstrip().endswith("was stopped by SIGINT")


def test_a_reader_that_closes_stdout_ends_generate_with_sigpipes_status(chat_om):
    proc = subprocess.Popen([sys.executable, "-m", "cann_llm.cli.cann_run", "generate", "--model", str(chat_om), "--prompt", "hi",
                             "--max_new_tokens", "2000", "--kv_cache_pages", "32", "--temperature", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=300) == 141 and b"Traceback" not in stderr and b"ERROR" not in stderr


def test_cann_run_alone_lists_its_commands():
    result = _cann_run()
    assert result.returncode == 0 and "Commands:" in result.stdout and "generate" in result.stdout
    assert result.stderr == ""


def test_bench_runs_every_client_of_its_highest_concurrency_at_once(chat_om, tmp_path):
    """--max_batch_size left at its default of 8: a concurrency of 12 raises it, or 4 clients would wait."""
    out = tmp_path / "bench.json"
    result = _cann_run("bench", "--model", str(chat_om), "--requests", "12", "--concurrency", "12",
                       "--prompt_lengths", "8,12", "--output_lengths", "4,6", "--prefill_tokens", "16",
                       "--decode_tokens", "4", "--repeats", "1", "--long_prefill", "", "--kv_cache_pages", "32",
                       "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["settings"]["max_batch_size"] == 12


def test_generate_continues_token_ids_on_a_model_compiled_without_a_tokenizer(tmp_path, tiny_llama_path):
    """W10009's artifact takes token ids: `--prompt_ids` gives them and the ids generated are printed (it
    could only be refused before). Exactly one of --prompt and --prompt_ids, and ids only where no text is
    needed."""
    import shutil

    from conftest import compile_to

    (tmp_path / "bare").mkdir()
    shutil.copyfile(tiny_llama_path, tmp_path / "bare" / "model.onnx")  # no tokenizer.json beside this copy
    om = compile_to(tmp_path / "bare" / "model.onnx", tmp_path / "bare_om", enable_paged_attention=True)
    result = _cann_run("generate", "--model", str(om), "--prompt_ids", "5, 6,7", "--temperature", "0",
                       "--max_new_tokens", "12", "--kv_cache_pages", "16")
    assert result.returncode == 0, result.stderr
    with LLMEngine(om, kv_cache_pages=16) as engine:
        request = engine.submit([5, 6, 7], max_new_tokens=12, temperature=0)
        request.result()
        expected = request.output_ids
    assert [int(word) for word in result.stdout.split()] == expected and len(expected) == 12
    for argv, said in ((["--prompt", "hi", "--prompt_ids", "1"], "one of them"), ([], "one of them"),
                       (["--prompt_ids", "1,x"], "non-negative integers"), (["--prompt_ids", "1,²"], "integers"),
                       (["--prompt_ids", "1,99999"], "--prompt_ids"),
                       (["--prompt_ids", "1", "--chat_template"], "--chat_template takes text")):
        result = _cann_run("generate", "--model", str(om), *argv)
        assert result.returncode == 1 and "E10001" in result.stderr and said in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
