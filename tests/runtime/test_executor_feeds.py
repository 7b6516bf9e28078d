"""`Executor.run` names what is wrong with the feeds it is given (an input misspelt, one missing, a rank
off, an output the model does not have), where onnxruntime would name an internal tensor or ignore a feed."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import compile_to

from cann_llm import Executor, load_artifact
from cann_llm.runtime.errors import AtcError


@pytest.fixture(scope="module")
def executor(tmp_path_factory, tiny_llama_path):
    return Executor(load_artifact(compile_to(tiny_llama_path, tmp_path_factory.mktemp("om") / "llama")))


def _feeds(executor: Executor) -> dict[str, np.ndarray]:
    feeds = {}
    for value in executor.loaded.metadata["signature"]["inputs"]:
        shape = [1 if not isinstance(d, int) or d < 0 else d for d in value["shape"]]
        if value["name"].startswith("past_key_values"):
            shape[2] = 0
        feeds[value["name"]] = np.ones(shape, value["dtype"])
    return feeds


def test_the_feeds_as_the_signature_has_them_run(executor):
    assert executor.run(_feeds(executor), ["logits"])["logits"].ndim == 3


@pytest.mark.parametrize("change, message", [
    (lambda f: f.update(input_idz=f.pop("input_ids")),
     r"no input named 'input_idz'; 'input_ids' not fed: the model's inputs are input_ids"),
    (lambda f: f.pop("attention_mask"), r"'attention_mask' not fed"),
    (lambda f: f.update(input_ids=f["input_ids"][0]), r"input 'input_ids' has 2 dimensions .*; the feed has 1 \[1\]"),
])
def test_feeds_unlike_the_signature_are_refused_by_name(executor, change, message):
    feeds = _feeds(executor)
    change(feeds)
    with pytest.raises(ValueError, match=message):
        executor.run(feeds)


def test_an_unknown_output_and_feeds_that_are_not_a_dict_are_refused(executor):
    with pytest.raises(ValueError, match="no output named 'logitz'"):
        executor.run(_feeds(executor), ["logitz"])
    with pytest.raises(TypeError, match="feeds are a dict"):
        executor.run(None)


def test_a_folder_given_as_the_artifact_is_e13001_is_a_directory(tmp_path):
    with pytest.raises(AtcError, match="E13001.*Is a directory"):
        load_artifact(tmp_path)
