"""atom.kernels: attention and other hot ops (torch reference, compiled CPU kernels, GPU kernels when a GPU is there)."""
