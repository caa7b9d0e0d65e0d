"""vLLM's own OpenAI server, with weightsync's parts on top (`weightsync serve --engine vllm`).

    server.py     assembly and lifecycle: the port, vLLM's app (build_app + init_app_state),
                  weightsync's parts, start-up 503s, SIGTERM
    engine.py     vLLM's arguments (its own parser), preload, AsyncLLM, the warm-up
    worker.py     the receiver inside vLLM's worker (worker_extension_cls), its pausing sink
    doorbell.py   the worker asks the API process to pause/commit/abort (Unix socket, JSON)
    control.py    the API process's pauses, version and sync state
    http.py       weightsync's routes and middleware (auth, gate, weight versions on responses)
    versions.py   weight versions recorded per HTTP request as vLLM's outputs pass
    internals.py  the one module that reads vLLM internals (streamed tokens' versions)

Importing this package imports no vLLM: server.py imports it when it runs.
"""
