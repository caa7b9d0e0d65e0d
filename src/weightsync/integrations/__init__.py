"""Backends that plug weightsync into other frameworks: one module per framework.

Each module imports its framework at module level and registers itself there; nothing in
weightsync imports them, so `import weightsync` never needs them. The framework imports the
module by name (verl: `checkpoint_engine.custom_backend_module=weightsync.integrations.verl`).
"""
