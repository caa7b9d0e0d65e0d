"""The transformers engine's adapter: the engine on one thread of the server's process, behind
weightsync's own OpenAI subset, inside the HTTP face. Its entry points are in startup.py."""
