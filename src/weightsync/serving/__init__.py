"""The rollout server: an Engine behind an OpenAI-compatible HTTP API, with a WeightReceiver
that lands weight syncs into the engine's live tensors while the engine loop is paused.

Needs the `server` extra (fastapi, uvicorn, httpx, prometheus-client); `import weightsync` does not.
"""
