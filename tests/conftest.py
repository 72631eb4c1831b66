"""Suite-wide settings, applied before any test module imports torch."""

import os

import pytest

# The suite runs two xdist workers plus engine processes on a couple of cores: OpenMP threads
# that spin at barriers would burn the time slices their descheduled peers need (atom's default
# is a short spin, right for a machine the engine has to itself). Child processes inherit this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# One torch thread per process, for the same reason: an engine's default (the cores it may run
# on, right for a machine it has to itself) puts two threads in every OpenMP team while the two
# workers and their engines already keep both cores busy, and a team waits at each barrier for
# its descheduled thread (test_llm_parity: 345 s with two threads, 127 s with one, on a loaded
# machine). A test that needs another count sets it (``num_threads``, ``torch.set_num_threads``
# or its own environment).
os.environ.setdefault("OMP_NUM_THREADS", "1")


# The extensions that pick the compiled kernels' paths (kernels/csrc/vec.h: -march=native).
_KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                 "amx_tile", "amx_bf16")


def pytest_report_header(config):
    """The CPU the kernel tests ran on: which paths they cover depends on it (a native build
    has only the paths of the CPU's extensions; tests/kernels/isa_variants.py builds others)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return "cpu: unknown (no /proc/cpuinfo)"
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    have = [f for f in _KERNEL_FLAGS if f in flags]
    missing = [f for f in _KERNEL_FLAGS if f not in flags]
    return (f"cpu: {model}; kernel paths: {' '.join(have) or 'scalar only'}; "
            f"without: {' '.join(missing)}")


@pytest.fixture(scope="session")
def embedded_hf_model(tmp_path_factory):
    """transformers' own float32 model of the embedded GGUF, in eval mode: the reference of the
    parity tests (transformers reads the GGUF itself, independently of atom's loader).

    Reading the GGUF takes transformers ~30 s (it re-parses the metadata for every tensor), so
    the first test process of a run to need it saves what it read as a Hugging Face folder in
    the run's temporary folder (shared by the xdist workers, under a lock); the others load
    that folder in about a second. Nothing outlives the run.
    """
    import fcntl

    import torch
    from transformers import AutoModelForCausalLM

    from atom.worker.embedded_model import ensure_embedded_gguf

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's folder, above each worker's own
    folder = shared / "embedded-hf-reference"
    with open(shared / "embedded-hf-reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "config.json").exists():
            path = ensure_embedded_gguf()
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32).eval()
            _save_dequantized(model, folder)
            return model
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _save_dequantized(model, folder) -> None:
    """``model`` (read from a GGUF: transformers refuses to save it) saved as a plain float
    Hugging Face folder: the same weights in a model of the same class without the GGUF
    quantization config; loading it gives bit-identical logits."""
    import copy

    import torch

    config = copy.deepcopy(model.config)
    del config.quantization_config
    with torch.device("meta"):
        plain = type(model)(config)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    tmp = folder.with_name(folder.name + ".tmp")
    plain.save_pretrained(str(tmp))
    tmp.rename(folder)  # complete or absent: a process killed half-way leaves only the .tmp
