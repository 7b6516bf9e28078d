"""The public Python face of the project: `from cann_llm import ...` (compile, run, generate)."""

from compiler import __version__
from compiler.compile import compile_model
from compiler.config import CompileConfig
from runtime import Executor, LoadedModel, load_artifact
from runtime.conversation import Conversation, ConversationManager, ConversationSettings
from runtime.engine.config import EngineConfig
from runtime.engine.engine import EngineClosed, EngineStats, GenerationFailed, LLMEngine, Request
from runtime.engine.outputs import CompletionOutput, RequestOutput
from runtime.engine.sampling import SamplingParams
from runtime.engine.sequence import RequestStats, TokenLogprob
from runtime.engine.setting_error import SettingError
from runtime.engine.structured import StructuredOutput
from runtime.errors import AtcError
from runtime.long_context import LongContext, Selection

__all__ = ["AtcError", "CompileConfig", "CompletionOutput", "Conversation", "ConversationManager",
           "ConversationSettings", "EngineClosed", "EngineConfig", "EngineStats", "Executor", "GenerationFailed",
           "LLMEngine", "LoadedModel", "LongContext", "Request", "RequestOutput", "RequestStats", "SamplingParams",
           "Selection", "SettingError", "StructuredOutput", "TokenLogprob", "__version__", "compile_model",
           "load_artifact"]
