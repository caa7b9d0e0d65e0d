"""The transformers engine, served in process behind weightsync's own OpenAI subset."""
