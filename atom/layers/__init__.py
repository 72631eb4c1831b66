"""atom.layers: building blocks several model families share (MoE today)."""
