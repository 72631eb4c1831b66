"""atom.layers: building blocks several model families share: the decoder skeleton
(:mod:`~atom.layers.decoder`), attention, MLP, MoE, norm, rotary, the packed linear, and
checkpoint reading (:mod:`~atom.layers.weights`)."""
