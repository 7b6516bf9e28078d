"""A decode step's attention alone: the native PagedAttention of every layer over many sequences' pages.

    python benchmarks/decode_attention.py [--sequences 21] [--context 320] [--threads 2] [--runs 20] [--baseline REV]

One onnxruntime session of one PagedAttention node a layer (SmolLM2's shapes by default: 30 layers, 9
query heads on 3 KV heads of 64, pages of 128), each node on its own layer of a page pool filled with
random keys and values, the pages of each sequence scattered over the pool as a long-running engine's
are; one query row a sequence, as in a decode step of --sequences sequences of --context tokens. The pool
(every layer's keys and values of every sequence) is far larger than the caches, so the keys and values
come from memory as they do in the engine. Prints the median time of a step's attention and the bytes of
keys and values it read per second. The concurrency mix of benchmarks/peers_concurrency.py decodes about
21 sequences of about 320 tokens a step. With --baseline the library of that git revision runs beside this
checkout's (benchmarks/native_ab.py), the two alternating run by run, their outputs compared.
"""

from __future__ import annotations

import statistics

import click
import numpy as np
import onnx
from onnx import helper

from cann_llm.runtime.lowering import POOL_KEY, POOL_VALUE, with_pool_inputs
from cann_llm.runtime.ops import CUSTOM_DOMAIN, PAGED_METADATA

from native_ab import alternate, comparison, sessions_of


def attention_model(layers: int, heads: int, kv_heads: int, dim: int, page: int) -> onnx.ModelProto:
    """`layers` PagedAttention nodes, node i on layer i, all reading one packed qkv input."""
    nodes, outputs = [], []
    for layer in range(layers):
        nodes.append(helper.make_node("PagedAttention", ["qkv", "", "", "", "", *(m.name for m in PAGED_METADATA)],
                                      [f"out{layer}"], domain=CUSTOM_DOMAIN, num_heads=heads, kv_num_heads=kv_heads,
                                      head_dim=dim, scale=dim ** -0.5, layer=layer, page_size=page))
        outputs.append(helper.make_tensor_value_info(f"out{layer}", onnx.TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info("qkv", onnx.TensorProto.FLOAT, [1, "T", (heads + 2 * kv_heads) * dim])]
    for meta in PAGED_METADATA:
        kind = onnx.TensorProto.INT64 if meta.dtype == np.int64 else onnx.TensorProto.INT32
        inputs.append(helper.make_tensor_value_info(meta.name, kind, list(meta.shape)))
    graph = helper.make_graph(nodes, "decode_attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CUSTOM_DOMAIN, 1)])
    return with_pool_inputs(model)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--sequences", default=21, show_default=True, help="sequences decoding in the step")
@click.option("--context", default=320, show_default=True, help="tokens of each sequence, the new one included")
@click.option("--layers", default=30, show_default=True)
@click.option("--heads", default=9, show_default=True)
@click.option("--kv-heads", default=3, show_default=True)
@click.option("--head-dim", default=64, show_default=True)
@click.option("--page-size", default=128, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--runs", default=20, show_default=True)
@click.option("--baseline", default=None, help="a git revision whose library runs beside this checkout's")
def main(sequences, context, layers, heads, kv_heads, head_dim, page_size, threads, runs, baseline):
    """Time a decode step's attention over every layer, against --baseline's library when given."""
    sessions = sessions_of(attention_model(layers, heads, kv_heads, head_dim, page_size).SerializeToString(),
                           baseline, threads)
    per_sequence = -(-context // page_size)
    pages = sequences * per_sequence
    rng = np.random.default_rng(0)
    shape = (layers, pages, kv_heads, page_size, head_dim)
    key, value = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    tables = rng.permutation(pages).astype(np.int32).reshape(sequences, per_sequence)
    metadata = (np.arange(sequences + 1, dtype=np.int32), np.full(sequences, context, np.int32), tables,
                (tables[:, (context - 1) // page_size] * page_size + (context - 1) % page_size).astype(np.int64))
    feeds = {"qkv": rng.standard_normal((1, sequences, (heads + 2 * kv_heads) * head_dim), dtype=np.float32),
             POOL_KEY: key, POOL_VALUE: value, **dict(zip((m.name for m in PAGED_METADATA), metadata))}
    times, outputs = alternate(sessions, feeds, runs)
    read = sequences * context * layers * kv_heads * head_dim * 4 * 2
    for name, spent in times.items():
        median = statistics.median(spent)
        click.echo(f"{name}: {sequences} sequences of {context} tokens, {layers} layers: {median * 1e3:.2f} ms a "
                   f"step's attention, keys and values {read / 1e6:.0f} MB at {read / median / 1e9:.1f} GB/s")
    line = comparison(times, outputs)
    if line:
        click.echo(line)

if __name__ == "__main__":
    main()
