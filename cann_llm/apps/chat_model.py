"""A request to the applications' chat model that must leave room in its context for the answer:
`fitting_prompt` gives the prompt or refuses the request with `DoesNotFit`, which the services answer with
422 and the commands with E10001."""

from __future__ import annotations


class DoesNotFit(ValueError):
    """A request the model's context cannot hold with room for its answer; the message says by how much."""


def fitting_prompt(engine, messages: list[dict], max_new_tokens: int) -> list[int]:
    """`messages` through the chat template of `engine`, as token ids; DoesNotFit when they leave less than
    `max_new_tokens` of the context for the answer."""
    ids = engine.chat_prompt(messages)
    if len(ids) + max_new_tokens > engine.max_context_len:
        raise DoesNotFit(f"the request does not fit the context: {len(ids)} prompt tokens and {max_new_tokens} "
                         f"for the answer, {engine.max_context_len} allowed")
    return ids
