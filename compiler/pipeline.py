"""The ordered pass list: one flat recipe, read top to bottom."""

from __future__ import annotations

from compiler.config import CompileConfig
from compiler.pass_manager import Pass
from passes.eliminate_dead_code import EliminateDeadCode
from passes.eliminate_identity import EliminateIdentity
from passes.fold_constants import FoldConstants
from passes.fuse_add_rms_norm import FuseAddRmsNorm
from passes.fuse_attention import FuseAttention
from passes.fuse_qkv import FuseQkv
from passes.fuse_rms_norm import FuseRmsNorm
from passes.fuse_swiglu import FuseSwiGlu
from passes.infer_shapes import InferShapes
from passes.quantize_weights import QuantizeWeights


def build_pipeline(cfg: CompileConfig | None) -> list[Pass]:
    """The passes `cfg` asks for, in order; switched-off ones are skipped by the runner, not dropped here."""
    quant = cfg.quantization if cfg is not None else None
    return [
        # Phase 0: canonical form, so that later patterns see one spelling of each structure. Folding
        # runs twice: shapes inferred after the first round make more Shape → Gather chains static.
        InferShapes(),
        FoldConstants(),
        EliminateIdentity(),
        InferShapes(),
        FoldConstants(),
        EliminateIdentity(),
        EliminateDeadCode(),
        InferShapes(),
        # Phase 1: normalisation
        FuseRmsNorm(),
        FuseAddRmsNorm(),
        # Phase 2: attention and MLP
        FuseAttention(),
        FuseQkv(),
        FuseSwiGlu(),
        # Phase 3: weights (QDQ weights are repacked whether or not compression was asked for)
        QuantizeWeights(quant.bits, quant.group_size, quant.symmetric, quant.skip_layers) if quant else QuantizeWeights(),
    ]
