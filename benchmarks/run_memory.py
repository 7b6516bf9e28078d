"""Resident memory of an engine serving one request at a time, beside its speed, in one process:

    python benchmarks/run_memory.py --om .cache/peers/smollm2-int4.om [--prompt-tokens 32] [--new-tokens 128]
                                    [--prefill 512] [--kv-cache-pages 64] [--threads 2]

Prints VmRSS and VmHWM (the peak) after loading, after a greedy decode of --new-tokens tokens (EOS held
off), and after a prefill of --prefill tokens, with the decode rate and the prefill time. Run it on two
commits to compare what a change does to memory.
"""

from __future__ import annotations

import time

import click

from cann_llm.runtime.engine.engine import LLMEngine


def resident_mb() -> dict[str, int]:
    """This process's VmRSS and VmHWM in MiB."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) // 1024
    return found


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", "om_path", required=True, help="the artifact")
@click.option("--prompt-tokens", default=32, show_default=True)
@click.option("--new-tokens", default=128, show_default=True)
@click.option("--prefill", default=512, show_default=True, help="tokens of the prefill measured after the decode")
@click.option("--kv-cache-pages", default=64, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--host-attention", is_flag=True, help="the segmented plan: attention as host kernels between sessions")
def main(om_path: str, prompt_tokens: int, new_tokens: int, prefill: int, kv_cache_pages: int, threads: int,
         host_attention: bool) -> None:
    """Print memory after load, decode and prefill, and the decode and prefill speed."""
    with LLMEngine(om_path, max_batch_size=1, max_context_len=max(prefill, prompt_tokens + new_tokens) + 8,
                   kv_cache_pages=kv_cache_pages, threads=threads, process_thread_pool=True,
                   host_attention=host_attention) as engine:
        click.echo(f"loaded        {resident_mb()}")
        engine.generate([5 + i % 100 for i in range(prompt_tokens)], max_new_tokens=8, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        engine.generate([7 + i % 100 for i in range(prompt_tokens)], max_new_tokens=new_tokens, temperature=0.0,
                        ignore_eos=True)
        rate = new_tokens / (time.perf_counter() - start)
        click.echo(f"decode        {resident_mb()}  {rate:.1f} tok/s (TTFT included)")
        start = time.perf_counter()
        engine.generate([9 + i % 150 for i in range(prefill)], max_new_tokens=1, temperature=0.0, ignore_eos=True)
        click.echo(f"prefill {prefill}   {resident_mb()}  {time.perf_counter() - start:.3f} s")


if __name__ == "__main__":
    main()
