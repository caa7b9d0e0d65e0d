"""vLLM's own OpenAI server, with weightsync's sync control and HTTP face on top."""
