"""The public Python face of the project: `from cann_llm import ...` (compile, run, generate).

Each name is imported on first use: every command lives under this package (`cann_llm.cli`), and `atc`
should not pay for the engine, nor `cann-run` for the compiler. Type checkers read the same names from
`__init__.pyi` (tests/test_public_api.py holds the two equal)."""

from __future__ import annotations

from importlib import import_module as _import_module

_HOMES = {
    "__version__": "cann_llm.compiler",
    "compile_model": "cann_llm.compiler.compile",
    "CompileConfig": "cann_llm.compiler.config",
    "Executor": "cann_llm.runtime",
    "LoadedModel": "cann_llm.runtime",
    "load_artifact": "cann_llm.runtime",
    "Conversation": "cann_llm.runtime.conversation",
    "ConversationManager": "cann_llm.runtime.conversation",
    "ConversationSettings": "cann_llm.runtime.conversation",
    "EngineConfig": "cann_llm.runtime.engine.config",
    "EngineClosed": "cann_llm.runtime.engine.engine",
    "EngineStats": "cann_llm.runtime.engine.engine",
    "GenerationFailed": "cann_llm.runtime.engine.engine",
    "LLMEngine": "cann_llm.runtime.engine.engine",
    "Request": "cann_llm.runtime.engine.engine",
    "CompletionOutput": "cann_llm.runtime.engine.outputs",
    "RequestOutput": "cann_llm.runtime.engine.outputs",
    "SamplingParams": "cann_llm.runtime.engine.sampling",
    "RequestStats": "cann_llm.runtime.engine.sequence",
    "TokenLogprob": "cann_llm.runtime.engine.sequence",
    "SettingError": "cann_llm.runtime.engine.setting_error",
    "StructuredOutput": "cann_llm.runtime.engine.structured",
    "AtcError": "cann_llm.runtime.errors",
    "LongContext": "cann_llm.runtime.long_context",
    "Selection": "cann_llm.runtime.long_context",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'cann_llm' has no attribute {name!r}")
    value = getattr(_import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
