"""Each sequence's recurrent states between the steps of a paged hybrid (Qwen3.5, LFM2, Granite 4.0-H): the
rows a paged artifact takes as `past.N.conv|recurrent` and gives back as `present.N.*`, one a scheduled
sequence (cann_llm/passes/paged_recurrent.py).

A state holds every token its sequence has computed, in a fixed size: a sequence computed from its first
token again (a recomputing preemption) starts from zeros, and nothing can be taken back or shared, so a
hybrid runs without prefix caching or speculation.
"""

from __future__ import annotations

import numpy as np

from cann_llm.runtime.signature import STATE_NAME, present_name


class StatePool:
    """The states of the sequences a paged hybrid is running, by sequence id."""

    def __init__(self, signature: dict):
        # each state input's row shape and dtype (its first axis is the step's sequences)
        self.rows = {value["name"]: (tuple(value["shape"][1:]), np.dtype(value["dtype"]))
                     for value in signature["inputs"] if STATE_NAME.match(value["name"])}
        self.presents = [present_name(name) for name in self.rows]
        self._held: dict[int, dict[str, np.ndarray]] = {}

    def __bool__(self) -> bool:
        return bool(self.rows)

    def feeds(self, seqs) -> dict[str, np.ndarray]:
        """The step's state inputs for `seqs`, in order: zeros for a sequence computed from its first token."""
        for seq in seqs:
            if seq.num_computed == 0:
                self._held[seq.seq_id] = {name: np.zeros(shape, dtype) for name, (shape, dtype) in self.rows.items()}
            elif seq.seq_id not in self._held:  # its tokens so far are in no state: it would go on from nothing
                raise RuntimeError(f"sequence {seq.seq_id} has {seq.num_computed} tokens computed and no state held")
        if len(seqs) == 1:  # one sequence's rows are the step's as they are: no copy (23 MB at Granite-4.0-H-350M's)
            held = self._held[seqs[0].seq_id]
            return {name: held[name][None] for name in self.rows}
        return {name: np.stack([self._held[seq.seq_id][name] for seq in seqs]) for name in self.rows}

    def keep(self, seqs, outputs: dict[str, np.ndarray]) -> None:
        """Take each sequence's new states from the step's `outputs` (rows in the order of `seqs`): copies, so
        no sequence's state holds on to a whole step's output, but for a step of one sequence, whose output is
        its row alone."""
        for name, present in zip(self.rows, self.presents):
            rows = outputs[present]
            for index, seq in enumerate(seqs):
                self._held[seq.seq_id][name] = rows[index] if len(seqs) == 1 else rows[index].copy()

    def release(self, seq_id: int) -> None:
        self._held.pop(seq_id, None)

    def clear(self) -> None:
        self._held.clear()
