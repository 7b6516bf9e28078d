"""`EngineConfig`: every setting of an `LLMEngine`, with the one set of defaults the CLI's options take too."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from cann_llm.runtime.engine.checked import boolean, integer, real, text
from cann_llm.runtime.engine.setting_error import SettingError
from cann_llm.runtime.executor import BACKENDS


@dataclass(frozen=True)
class EngineConfig:
    """How an `LLMEngine` batches, pages and drafts; each field's `help` metadata is its CLI option's help.

    A paged artifact gets a pool of `kv_cache_pages` pages of its compiled page size; an artifact with
    contiguous past/present I/O reserves `max_context_len` tokens per sequence instead.
    """

    max_batch_size: int = field(default=8, metadata={"help": "sequences running at once", "min": 1})
    max_context_len: int = field(default=4096, metadata={
        "help": "tokens of prompt and output per sequence (at most a position table's rows + 1: GPT-2's)", "min": 2})
    kv_cache_pages: int | None = field(default=None, metadata={
        "help": "pages in the KV pool (paged artifacts; default: 1024, or as many as fit in half of this machine's "
                "memory if fewer)", "min": 1})
    kv_cache_memory_mb: int | None = field(default=None, metadata={
        "help": "the KV pool's size in MiB instead of a page count: as many pages as fit (paged artifacts)",
        "min": 1})
    max_step_latency_ms: int | None = field(default=None, metadata={
        "help": "adapt how many sequences run at once to keep a decode step under this many ms (default: "
                "max_batch_size always)", "min": 1})
    max_num_batched_tokens: int = field(default=512, metadata={
        "help": "token budget of one step (longer prompts are prefilled in chunks)", "min": 1})
    priority_aging_s: int = field(default=10, metadata={
        "help": "seconds of waiting after which a request counts one priority level more urgent", "min": 1})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV pages of a prompt prefix seen before (paged artifacts)"})
    backend: str = field(default="onnxruntime", metadata={"help": "kernels that run the graph",
                                                          "choices": BACKENDS})
    threads: int | None = field(default=None, metadata={
        "help": "intra-op threads of onnxruntime (default: its own choice)", "min": 1})
    host_attention: bool = field(default=False, metadata={
        "help": "run paged attention as host kernels between onnxruntime sessions, not inside one session "
                "(what happens anyway where no C compiler can build the native op)"})
    native_matmul: bool = field(default=True, metadata={
        "help": "matmuls by the native library's kernels: 4- and 8-bit ones with int8 activations where the CPU "
                "has AVX-512 VNNI or AVX2, float32 ones (weights laid out in panels at load) where it has AVX-512 "
                "(off: onnxruntime's MatMulNBits and MatMul; the same numbers within float rounding)"})
    huge_pages: bool = field(default=True, metadata={
        "help": "read the weights the native matmuls stream from huge pages, where the kernel gives them: the 4- "
                "and 8-bit ones copied into them (a decode step ~5% faster, but each process holds its own copy "
                "where the artifact's pages are shared by every process mapping it), float32 panels laid out in "
                "them (~3-4% faster), F28 panels from the artifact's own mapping (~6% faster, no copy); not with "
                "--share_weights"})
    share_weights: bool = field(default=False, metadata={
        "help": "map onnxruntime's pre-packed weights from a cache on disk (written at the first load on this "
                "machine, about twice the artifact's size; $CANN_LLM_CACHE or ~/.cache/cann-llm), so processes "
                "serving the same artifact share one copy instead of holding one each"})
    # not an option: only a process the CLI owns may share onnxruntime's process-wide pool (see LLMEngine)
    process_thread_pool: bool = field(default=False, metadata={"cli": False})
    num_speculative_tokens: int = field(default=0, metadata={
        "help": "draft tokens per decode step by prompt lookup, verified in the same step; 0 is off", "min": 0})
    draft_model: str | None = field(default=None, metadata={
        "help": "a smaller paged artifact with the same tokenizer that drafts --num_speculative_tokens tokens a "
                "step instead of prompt lookup (e.g. the INT4 artifact of the same model)", "path": True})
    speculative_max_batch: int = field(default=4, metadata={
        "help": "draft only while at most this many sequences run", "min": 1})
    chat_template_file: str | None = field(default=None, metadata={
        "help": "a jinja chat template file to use instead of the one compiled into the artifact", "path": True})

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if value is not None or "None" not in item.type:
                kind = item.type.split(" |")[0]
                checks = {"int": integer, "float": real, "bool": boolean, "str": text}
                object.__setattr__(self, item.name, checks[kind](item.name, value))
        for item in fields(self):
            value, low = getattr(self, item.name), item.metadata.get("min")
            if low is not None and value is not None and value < low:
                raise SettingError(item.name, f"{item.name} must be at least {low}, not {value}")
        if self.draft_model is not None and self.num_speculative_tokens < 1:
            raise SettingError("num_speculative_tokens",
                               "a draft model drafts num_speculative_tokens tokens a step: set it to at least 1")
        if self.backend not in BACKENDS:
            raise SettingError("backend", f"backend must be one of {', '.join(BACKENDS)}, not {self.backend!r}")
