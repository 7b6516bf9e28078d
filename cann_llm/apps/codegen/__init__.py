"""Code generation on the engine: `CodeGenerator(engine).generate_code(description, language)` and
`optimize_code(code, language)`, the code extracted from whatever shape the model's answer takes, and Python
checked by `ast` with one retry that shows the model its error."""

from cann_llm.apps.codegen.extract import extract_code
from cann_llm.apps.codegen.service import CodeGenerator, CodeResult

__all__ = ["CodeGenerator", "CodeResult", "extract_code"]
