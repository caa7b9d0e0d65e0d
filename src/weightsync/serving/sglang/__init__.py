"""`weightsync serve --engine sglang`: SGLang's own server and routes, with weightsync's receiver
in every TP worker (server.py); SGLang's arguments, engine and app (launch.py); weight versions on
its OpenAI responses (versions.py)."""
