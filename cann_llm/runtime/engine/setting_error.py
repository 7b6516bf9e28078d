"""The refusal of a request or setting, naming the setting it is about, so a command line can name its flag
and a server its request field without reading the message."""

from __future__ import annotations


class SettingError(ValueError):
    """A ValueError about one setting: `setting` is a `SamplingParams` or `EngineConfig` field, `prompt` for
    the prompt itself (its tokens, its text, its length), or `tokenizer` for text given to a model compiled
    without one."""

    def __init__(self, setting: str, message: str):
        super().__init__(message)
        self.setting = setting

    def __reduce__(self):  # whole across processes (multiprocessing, a Ray replica's refusal)
        return type(self), (self.setting, str(self))
