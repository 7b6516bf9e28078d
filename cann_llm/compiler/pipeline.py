"""The ordered pass list: one flat recipe, read top to bottom."""

from __future__ import annotations

import numpy as np

from cann_llm.compiler.config import CompileConfig
from cann_llm.compiler.pass_manager import Pass
from cann_llm.compiler.tokenizer_files import tokenizer_files
from cann_llm.passes.absorb_latent_attention import AbsorbLatentAttention
from cann_llm.passes.canonicalize_gemm import CanonicalizeGemm
from cann_llm.passes.canonicalize_layout import CanonicalizeLayout
from cann_llm.passes.canonicalize_flipped_rotary import CanonicalizeFlippedRotary
from cann_llm.passes.canonicalize_pair_rotary import CanonicalizePairRotary
from cann_llm.passes.canonicalize_split_rotary import CanonicalizeSplitRotary
from cann_llm.passes.check_cache_layout import CheckCacheLayout
from cann_llm.passes.compress_float_weights import CompressFloatWeights
from cann_llm.passes.convert_attention import ConvertAttention
from cann_llm.passes.convert_group_query_attention import ConvertGroupQueryAttention
from cann_llm.passes.convert_layer_norms import ConvertSimplifiedLayerNorm, ConvertSkipSimplifiedLayerNorm
from cann_llm.passes.convert_integer_matmul import ConvertIntegerMatMul
from cann_llm.passes.convert_matmul_nbits import ConvertMatMulNBits
from cann_llm.passes.convert_multi_head_attention import ConvertMultiHeadAttention
from cann_llm.passes.convert_precision import ConvertPrecision
from cann_llm.passes.drop_carried_state import DropCarriedState
from cann_llm.passes.drop_table_slices import DropTableSlices
from cann_llm.passes.convert_rms_normalization import ConvertRmsNormalization
from cann_llm.passes.eliminate_dead_code import EliminateDeadCode
from cann_llm.passes.eliminate_identity import EliminateIdentity
from cann_llm.passes.expand_onnxruntime_rewrites import ExpandOnnxRuntimeRewrites
from cann_llm.passes.expand_rotary_embedding import ExpandRotaryEmbedding
from cann_llm.passes.fold_constants import FoldConstants
from cann_llm.passes.fuse_add_rms_norm import FuseAddRmsNorm
from cann_llm.passes.fuse_attention import FuseAttention
from cann_llm.passes.fuse_moe import FuseMoe
from cann_llm.passes.fuse_qkv import FuseQkv
from cann_llm.passes.fuse_rms_norm import FuseRmsNorm
from cann_llm.passes.fuse_swiglu import FuseSwiGlu
from cann_llm.passes.hoist_head_transpose import HoistHeadTranspose
from cann_llm.passes.infer_shapes import InferShapes
from cann_llm.passes.inline_cache_branch import InlineCacheBranch
from cann_llm.passes.name_causal_lm_io import NameCausalLmIo
from cann_llm.passes.paged_kv_cache import PagedKvCache
from cann_llm.passes.per_sequence_rotary import PerSequenceRotary
from cann_llm.passes.split_grouped_qkv import SplitGroupedQkv
from cann_llm.passes.split_head_parts import SplitHeadParts
from cann_llm.passes.split_interleaved_qkv import SplitInterleavedQkv
from cann_llm.passes.split_unit_head_axis import SplitUnitHeadAxis
from cann_llm.passes.prune_logits import PruneLogits
from cann_llm.passes.remove_logits_to_keep import RemoveLogitsToKeep
from cann_llm.passes.quant.calibration_windows import declared_positions, text_samples, window_length
from cann_llm.passes.quant.quantize_weights import QuantizeWeights
from cann_llm.passes.split_alibi_buffer import SplitAlibiBuffer
from cann_llm.passes.truncate_layers import TruncateLayers
from cann_llm.passes.unfold_batched_heads import UnfoldBatchedHeads
from cann_llm.passes.weight_spill import WeightSpill
from cann_llm.runtime.errors import AtcError, invalid_value
from cann_llm.runtime.safe_files import read_text


def calibration_samples(cfg: CompileConfig) -> list[np.ndarray]:
    """Token windows of the calibration text, tokenized with the model's own tokenizer, none longer than the
    model's config.json says it reads (E10001 for a seq_len given longer)."""
    from cann_llm.runtime.tokenizer import TextTokenizer

    quant = cfg.quantization
    files = tokenizer_files(cfg)
    if not files:
        raise AtcError("E10001", "calibration", "--compress_weight_conf",
                       f"{quant.method} calibrates on text and needs the model's tokenizer: give --tokenizer=DIR.")
    length = window_length(quant, declared_positions(cfg.model))
    ids = TextTokenizer(files).encode(read_text(quant.calibration_text))
    samples = text_samples(ids, quant.num_samples, length)
    if not samples:
        raise invalid_value(quant.calibration_text, quant.parameter("calibration_text"),
                            f"The text has {len(ids)} tokens, fewer than one sample of {length}.")
    return samples


def _samples_if_useful(cfg: CompileConfig | None) -> list[np.ndarray] | None:
    """Calibration samples when a method needs them, or when the accuracy level is chosen per layer and
    the model's tokenizer is at hand (without one, the level stays 0: exact float activations)."""
    quant = cfg.quantization if cfg is not None else None
    if quant is None:
        return None
    if quant.needs_calibration:
        return calibration_samples(cfg)
    if quant.accuracy_level == "auto" and quant.bits == 4 and tokenizer_files(cfg):
        return calibration_samples(cfg)
    return None


def build_pipeline(cfg: CompileConfig | None, progress: bool = False, spill: WeightSpill | None = None,
                   origin: str | None = None) -> list[Pass]:
    """The passes `cfg` asks for, in order; switched-off ones are skipped by the runner, not dropped here.
    `progress`: the weight quantization shows its calibration and quantization on stderr; `spill`: it keeps
    the weights it packs on disk until they are written (cann_llm/passes/weight_spill.py); `origin`: the low
    precision most of the model's weights were in before compute_in_float32 raised them
    (cann_llm/passes/upcast_float_compute.py)."""
    quant = cfg.quantization if cfg is not None else None
    passes: list[Pass] = [
        # Phase 0: canonical form, so that later patterns see one spelling of each structure. Folding
        # runs twice: shapes inferred after the first round make more Shape → Gather chains static.
        InlineCacheBranch(),  # a merged decoder (Optimum's legacy If on use_cache_branch) as its with-cache branch
        InferShapes(),
        # onnxruntime's own ops written back first: shape inference stops at them (FusedMatMul), and the
        # folding and canonical forms below need the shapes past them
        NameCausalLmIo(),  # input_ids and logits where the export named them otherwise (every pass after reads them)
        DropCarriedState(),  # cache inputs only handed back as outputs (transformers' exporter's sliding-window state)
        RemoveLogitsToKeep(),  # every position's logits where a trace of transformers' logits_to_keep picked one
        ExpandOnnxRuntimeRewrites(),  # onnxruntime's FusedMatMul, QuickGelu and rotate_half Split, as standard ops
        ConvertIntegerMatMul(),  # its dynamic quantization's matmuls, as MatMuls of QDQ operands
        FoldConstants(),
        EliminateIdentity(),
        InferShapes(),
        FoldConstants(),
        EliminateIdentity(),
        DropTableSlices(),  # rotary buffers' first rows sliced before a Gather by positions (transformers < 4.38)
        SplitAlibiBuffer(),  # ALiBi and the causal mask in one buffer (Baichuan-13B), as the two the fusion reads
        CanonicalizeLayout(),
        CanonicalizeGemm(),
        EliminateDeadCode(),
        InferShapes(),
        # Phase 1: normalisation (and onnxruntime's quantized matmul, whose layout MatMulInt4 shares)
        ConvertMatMulNBits(),
        ConvertRmsNormalization(),
        ConvertSimplifiedLayerNorm(),
        ConvertSkipSimplifiedLayerNorm(),
        FuseRmsNorm(),
        FuseAddRmsNorm(),
        # Phase 2: attention and MLP
        ConvertAttention(),
        ConvertGroupQueryAttention(paged=cfg is not None and cfg.paging is not None),
        ConvertMultiHeadAttention(),
        ExpandRotaryEmbedding(),  # the rotary ops the conversions left, in the spelling attention fusion reads
        CanonicalizePairRotary(),  # ChatGLM's rotation of pairs on a view of them, in that spelling too
        CanonicalizeSplitRotary(),  # gpt-oss's rotation of each head's two halves, likewise
        CanonicalizeFlippedRotary(),  # nanochat's rotate_half the other way round, likewise
        SplitUnitHeadAxis(),  # GPTBigCode's q/k/v cut from a view with a head axis of one
        HoistHeadTranspose(),  # GPT-J's and CodeGen's heads rotated before their transpose
        SplitInterleavedQkv(),  # GPT-NeoX's head-by-head q/k/v, as three blocks
        SplitHeadParts(),  # Qwen3.5's heads of [query | gate], as two blocks
        SplitGroupedQkv(),  # Falcon's and InternLM2's q/k/v packed by KV group, as three blocks
        UnfoldBatchedHeads(),  # BLOOM's heads folded into the batch for its MatMuls
    ]
    if cfg is not None and cfg.paging is not None:
        # DeepSeek's latent attention over its cached latent, whose shape the graph's I/O then takes: only where the
        # cache leaves the I/O
        passes.append(AbsorbLatentAttention())
    passes += [
        FuseAttention(),
        CheckCacheLayout(),  # a sequence-first cache whose attention did not fuse, refused by name
        FuseQkv(),
        FuseMoe(),  # before SwiGlu: the routed experts' SiLU is the op's, the shared expert's SwiGlu's
        FuseSwiGlu(),
    ]
    if cfg is not None and cfg.keep_layers:
        # a draft model: the layers past the kept ones go before their weights are quantized or calibrated
        passes.append(TruncateLayers(cfg.keep_layers))
    passes += [
        # Phase 3: weights (QDQ weights are repacked whether or not compression was asked for)
        QuantizeWeights(quant, _samples_if_useful(cfg), progress=progress, spill=spill),
    ]
    if cfg is not None and cfg.paging is not None:
        # Phase 4: batches without padding over the runtime's page pool
        passes += [PagedKvCache(cfg.paging.page_size, cfg.enable_flash_attention), PerSequenceRotary(), PruneLogits()]
    if cfg is not None:
        # Phase 5: the dtype float weights are stored in (cann_llm/passes/precision_config.py), then how float32 ones are
        passes.append(ConvertPrecision(cfg.precision.storing(origin)))
        if cfg.compress_fp32_weight:
            passes.append(CompressFloatWeights(spill))
    return passes


def known_passes() -> dict[str, bool]:
    """{name: whether a fusion switch turns it off} of every pass a compile can run, whichever its flags."""
    conditional = (AbsorbLatentAttention, TruncateLayers, PagedKvCache, PerSequenceRotary, PruneLogits, ConvertPrecision,
                   CompressFloatWeights)
    return {p.name: p.switchable for p in (*build_pipeline(None), *conditional)}
