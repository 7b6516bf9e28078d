"""Greedy decoding that recomputes the whole sequence each step: the reference a test model's compiled
artifact is held to, free of any cache handling of its own."""

from __future__ import annotations

from collections.abc import Callable

import torch


def recomputed_greedy(logits_of: Callable[[torch.Tensor], torch.Tensor], prompt: list[int],
                      new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens after `prompt`; `logits_of(ids [1, T])` gives the logits of the last position
    at `[0, -1]`."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(logits_of(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]
