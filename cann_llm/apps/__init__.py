"""Applications built on the engine: a customer-service bot and a code-generation service."""
