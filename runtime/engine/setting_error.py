"""The refusal of a request or setting, naming the setting it is about, so a command line can name its flag
and a server its request field without reading the message."""

from __future__ import annotations


class SettingError(ValueError):
    """A ValueError about one setting: `setting` is a `SamplingParams` or `EngineConfig` field, or `prompt`
    for the prompt itself (its tokens, its text, its length)."""

    def __init__(self, setting: str, message: str):
        super().__init__(message)
        self.setting = setting
