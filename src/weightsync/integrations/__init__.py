"""Backends that plug weightsync into other frameworks: one module per framework.

Nothing in weightsync imports them, so `import weightsync` never needs their frameworks. A module
that registers itself with its framework imports it at module level, and the framework imports
the module by name (verl: `checkpoint_engine.custom_backend_module=weightsync.integrations.verl`);
one that is passed to its framework as objects needs no import of it (trl: `rollout_func=`,
`weight_transfer=`).
"""
