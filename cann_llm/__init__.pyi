"""What `cann_llm` exports, for type checkers: each name re-exported by its `as` name, from the module
`__init__.py` loads it from on first use."""

from cann_llm.compiler import __version__ as __version__
from cann_llm.compiler.compile import compile_model as compile_model
from cann_llm.compiler.config import CompileConfig as CompileConfig
from cann_llm.runtime import Executor as Executor
from cann_llm.runtime import LoadedModel as LoadedModel
from cann_llm.runtime import load_artifact as load_artifact
from cann_llm.runtime.conversation import Conversation as Conversation
from cann_llm.runtime.conversation import ConversationManager as ConversationManager
from cann_llm.runtime.conversation import ConversationSettings as ConversationSettings
from cann_llm.runtime.engine.config import EngineConfig as EngineConfig
from cann_llm.runtime.engine.engine import EngineClosed as EngineClosed
from cann_llm.runtime.engine.engine import EngineStats as EngineStats
from cann_llm.runtime.engine.engine import GenerationFailed as GenerationFailed
from cann_llm.runtime.engine.engine import LLMEngine as LLMEngine
from cann_llm.runtime.engine.engine import Request as Request
from cann_llm.runtime.engine.outputs import CompletionOutput as CompletionOutput
from cann_llm.runtime.engine.outputs import RequestOutput as RequestOutput
from cann_llm.runtime.engine.sampling import SamplingParams as SamplingParams
from cann_llm.runtime.engine.sequence import RequestStats as RequestStats
from cann_llm.runtime.engine.sequence import TokenLogprob as TokenLogprob
from cann_llm.runtime.engine.setting_error import SettingError as SettingError
from cann_llm.runtime.engine.structured import StructuredOutput as StructuredOutput
from cann_llm.runtime.errors import AtcError as AtcError
from cann_llm.runtime.long_context import LongContext as LongContext
from cann_llm.runtime.long_context import Selection as Selection

