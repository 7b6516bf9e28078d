"""Speculative decoding with a draft model: a smaller artifact with the same tokenizer proposes the next
tokens of each decoding sequence, greedily, and the target verifies them in its next step.

The draft keeps its own paged KV cache: one draft sequence per target sequence, synchronised before each
proposal with the target's tokens (what the target rejected is recomputed from where they part). Its
proposals are greedy, so the engine's verification (keep going while the target's sample equals the draft
token; cann_llm/runtime/engine/engine.py) is the rejection sampling of Leviathan et al. and Chen et al. for a
deterministic draft: a draft token is kept with the target's probability of it, and a rejected position is
drawn from the target's distribution without it. Outputs are the target's alone, greedy or sampled.

How many tokens a sequence drafts follows how many of its drafts were kept (as prompt lookup's length
does, cann_llm/runtime/engine/speculation.py): a draft that is mostly rejected costs the target rows for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cann_llm.runtime.engine.block_manager import BlockManager
from cann_llm.runtime.engine.kv_cache import PagePool
from cann_llm.runtime.engine.runner import PagedRunner
from cann_llm.runtime.engine.sampling import SamplingParams
from cann_llm.runtime.engine.scheduler import ScheduledBatch
from cann_llm.runtime.engine.sequence import Sequence
from cann_llm.runtime.engine.speculation import HIT_RATE_WEIGHT, draft_length
from cann_llm.runtime.errors import invalid_value
from cann_llm.runtime.executor import Executor
from cann_llm.runtime.loader import load_artifact

_GREEDY = SamplingParams(temperature=0)


@dataclass
class _Drafting:
    """The draft model's copy of one target sequence, and how its drafts have fared."""

    seq: Sequence
    proposed_at: int = 0                # the target's length when the last draft was made
    proposed: list[int] = field(default_factory=list)
    hit_rate: float = 0.8


class DraftModelProposer:
    """Drafts up to `num_tokens` tokens per sequence with the artifact at `path` (paged, the target's
    vocabulary), its KV cache `num_pages` pages."""

    def __init__(self, path: str, num_tokens: int, num_pages: int, vocab_size: int, backend: str = "onnxruntime",
                 threads: int | None = None, native_matmul: bool = True):
        loaded = load_artifact(path)
        if not loaded.paged:
            raise invalid_value(path, "draft_model",
                                "The draft model must be compiled with a paged KV cache (atc --enable_paged_attention=1).")
        if loaded.metadata["model"].get("recurrent_layers"):
            raise invalid_value(path, "draft_model", "The draft model carries recurrent states (a hybrid's), which "
                                "hold every token they took in and cannot give back the drafts the target rejects.")
        if int(loaded.metadata["model"]["vocab_size"]) != vocab_size:
            raise invalid_value(path, "draft_model", f"The draft model's vocabulary has "
                                f"{loaded.metadata['model']['vocab_size']} tokens, the target's {vocab_size}: a "
                                f"draft must share the target's tokenizer.")
        dims, page_size = loaded.metadata["model"], loaded.kv_cache["page_size"]
        pool = PagePool.of(dims, num_pages, page_size)
        self.runner = PagedRunner(Executor(loaded, backend, threads, native_matmul=native_matmul), pool)
        self.blocks = BlockManager(num_pages, page_size, enable_prefix_caching=False)
        self.num_tokens = num_tokens
        self._drafting: dict[int, _Drafting] = {}

    def propose_batch(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """A draft for each target sequence (whose last token is not yet computed), at most its limit."""
        drafting, lengths = [], []
        for seq, limit in zip(seqs, limits):
            state = self._sync(seq)
            length = min(limit, self.num_tokens, draft_length(state.hit_rate, self.num_tokens))
            if length > 0 and self.blocks.can_hold(state.seq, len(state.seq.token_ids) + length):
                self.blocks.reserve(state.seq, len(state.seq.token_ids) + length)
                drafting.append(state)
                lengths.append(length)
        for step in range(max(lengths, default=0)):
            active = [(s, n) for s, n in zip(drafting, lengths) if n > step]
            batch = ScheduledBatch([s.seq for s, _ in active], [s.seq.num_uncomputed for s, _ in active])
            logits = np.asarray(self.runner.run(batch))
            for (state, _), row in zip(active, logits):
                state.seq.num_computed = len(state.seq.token_ids)
                state.seq.token_ids.append(int(np.argmax(row)))
        for state in drafting:
            state.proposed = state.seq.token_ids[state.proposed_at:]
        # every sequence was synced above: one that drafted nothing has an empty proposal
        return [self._drafting[seq.seq_id].proposed for seq in seqs]

    def observe(self, seq_id: int, token: int) -> None:
        """Drafts are scored when the next is made (how many of the last were kept)."""

    def forget(self, seq_id: int) -> None:
        """Free a finished sequence's draft pages."""
        state = self._drafting.pop(seq_id, None)
        if state is not None:
            self.blocks.free(state.seq)

    def _sync(self, seq: Sequence) -> _Drafting:
        """The draft copy of `seq`, made to hold the target's tokens (its cache kept where they agree), with
        its last draft scored."""
        state = self._drafting.get(seq.seq_id)
        if state is None:
            state = self._drafting[seq.seq_id] = _Drafting(Sequence(list(seq.token_ids), _GREEDY))
        else:
            kept = 0
            for drafted, taken in zip(state.proposed, seq.token_ids[state.proposed_at:]):
                if drafted != taken:
                    break
                kept += 1
            # each drafted token up to the first rejected one is a trial, as prompt lookup counts them
            for held in [1] * kept + ([0] if kept < len(state.proposed) else []):
                state.hit_rate += HIT_RATE_WEIGHT * (held - state.hit_rate)
            agree = 0
            for mine, theirs in zip(state.seq.token_ids, seq.token_ids):
                if mine != theirs:
                    break
                agree += 1
            state.seq.token_ids = list(seq.token_ids)
            state.seq.num_computed = min(state.seq.num_computed, agree, len(seq.token_ids) - 1)
        state.proposed_at, state.proposed = len(seq.token_ids), []
        return state
