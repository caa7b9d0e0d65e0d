"""A folder that `weightsync serve --engine vllm` puts first on the PYTHONPATH of vLLM's processes
where Triton cannot run: its sitecustomize.py keeps Triton out of each (serving/vllm/noise.py)."""
