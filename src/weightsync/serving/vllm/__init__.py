"""The vLLM adapter: vLLM's own OpenAI server over `AsyncLLM`, weightsync's backend in every worker
(integrations/vllm), and the server's sync control and HTTP face on top. Its entry points are in
server.py."""
