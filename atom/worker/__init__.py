"""atom.worker: what runs the model in an engine-core process (model runner, loaders, the
embedded model, samplers, the early-exit draft, TBO, the worker side of the KV connector).
Never imports ``atom.engine``."""
