"""The graph passes the compiler runs: each rewrites a canonicalised graph, one job a file."""

import cann_llm.runtime  # noqa: E402,F401 - its settings of onnxruntime come before any import of onnxruntime here
