"""A prefill's attention alone: the native PagedAttention of every layer over one prompt, this checkout's
library against the library of another revision, alternating.

    python benchmarks/prefill_attention.py [--baseline REV] [--tokens 512] [--threads 1] [--runs 25] [--avx2]

One onnxruntime session per library of one PagedAttention node a layer (SmolLM2's shapes by default: 30
layers, 9 query heads on 3 KV heads of 64, pages of 128, packed qkv with rotary cos/sin), one sequence of
--tokens prompt tokens as in the engine's first prefill step, on one process-wide pool of --threads. With
--baseline the native library is built a second time from that revision's sources (git show) with the same
compiler and flags, and the two sessions run in turn, so machine noise falls on both alike; their outputs
are compared. Prints the median and the fastest run of each, and the ratio of medians. --avx2 builds both
with `-mno-avx512f` (the AVX2 tiles).
"""

from __future__ import annotations

import statistics

import click
import numpy as np
import onnx
from onnx import helper

from cann_llm.runtime.lowering import POOL_KEY, POOL_VALUE, with_pool_inputs
from cann_llm.runtime.ops import CUSTOM_DOMAIN, PAGED_METADATA, PagedAttentionInput

from native_ab import alternate, comparison, sessions_of


def attention_model(layers: int, heads: int, kv_heads: int, dim: int, page: int) -> onnx.ModelProto:
    """`layers` PagedAttention nodes on packed qkv with rotary, node i on layer i of the pool."""
    names = {PagedAttentionInput.QUERY: "qkv", PagedAttentionInput.COS: "cos", PagedAttentionInput.SIN: "sin"}
    inputs = [helper.make_tensor_value_info("qkv", onnx.TensorProto.FLOAT, [1, "T", (heads + 2 * kv_heads) * dim]),
              helper.make_tensor_value_info("cos", onnx.TensorProto.FLOAT, ["T", dim]),
              helper.make_tensor_value_info("sin", onnx.TensorProto.FLOAT, ["T", dim])]
    for meta in PAGED_METADATA:
        names[meta.slot] = meta.name
        kind = onnx.TensorProto.INT64 if meta.dtype == np.int64 else onnx.TensorProto.INT32
        inputs.append(helper.make_tensor_value_info(meta.name, kind, list(meta.shape)))
    node_inputs = [names.get(slot, "") for slot in PagedAttentionInput]
    nodes = [helper.make_node("PagedAttention", node_inputs, [f"out{layer}"], domain=CUSTOM_DOMAIN, num_heads=heads,
                              kv_num_heads=kv_heads, head_dim=dim, scale=dim ** -0.5, layer=layer, page_size=page)
             for layer in range(layers)]
    outputs = [helper.make_tensor_value_info(f"out{layer}", onnx.TensorProto.FLOAT, None) for layer in range(layers)]
    graph = helper.make_graph(nodes, "prefill_attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CUSTOM_DOMAIN, 1)])
    return with_pool_inputs(model)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--baseline", default=None, help="a git revision whose library runs beside this checkout's")
@click.option("--tokens", default=512, show_default=True, help="prompt tokens of the one sequence")
@click.option("--layers", default=30, show_default=True)
@click.option("--heads", default=9, show_default=True)
@click.option("--kv-heads", default=3, show_default=True)
@click.option("--head-dim", default=64, show_default=True)
@click.option("--page-size", default=128, show_default=True)
@click.option("--threads", default=1, show_default=True, help="onnxruntime's threads (1: the kernel alone)")
@click.option("--runs", default=25, show_default=True)
@click.option("--avx2", is_flag=True, help="build both libraries with -mno-avx512f (the AVX2 tiles)")
def main(baseline, tokens, layers, heads, kv_heads, head_dim, page_size, threads, runs, avx2):
    """Time a prefill's attention over every layer, against --baseline's library when given."""
    flags = ("-mno-avx512f",) if avx2 else ()
    sessions = sessions_of(attention_model(layers, heads, kv_heads, head_dim, page_size).SerializeToString(),
                           baseline, threads, flags)
    pages = -(-tokens // page_size)
    rng = np.random.default_rng(0)
    angles = np.arange(tokens)[:, None] * rng.uniform(0.001, 0.5, head_dim)[None]
    shape = (layers, pages, kv_heads, page_size, head_dim)
    feeds = {"qkv": rng.standard_normal((1, tokens, (heads + 2 * kv_heads) * head_dim), dtype=np.float32),
             "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32),
             "query_start_loc": np.array([0, tokens], np.int32), "seq_lens": np.array([tokens], np.int32),
             "block_tables": rng.permutation(pages).astype(np.int32)[None],
             POOL_KEY: np.zeros(shape, np.float32), POOL_VALUE: np.zeros(shape, np.float32)}
    feeds["slot_mapping"] = (feeds["block_tables"][0, np.arange(tokens) // page_size] * page_size
                             + np.arange(tokens) % page_size).astype(np.int64)
    times, outputs = alternate(sessions, feeds, runs)
    for name, spent in times.items():
        click.echo(f"{name:<16} median {statistics.median(spent) * 1e3:8.2f} ms   fastest {min(spent) * 1e3:8.2f} ms  "
                   f"({layers} layers, {tokens} tokens, {threads} thread{'s' * (threads > 1)})")
    line = comparison(times, outputs)
    if line:
        click.echo(line)

if __name__ == "__main__":
    main()
