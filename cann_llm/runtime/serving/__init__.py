"""The HTTP server: FastAPI on uvicorn over one LLMEngine per model (`cann-run serve`)."""
