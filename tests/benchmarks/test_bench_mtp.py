"""scripts/bench_mtp.py trains its MTP layer with transformers' decoder block and its own
formula; atom must compute the same drafts from the written checkpoint, or the benchmark's
acceptance would measure a mismatch. On the tests' tiny DeepSeek-V3: about 2 s of training
(so no weight keeps its initial value), the layer written at ``model.layers.3.*``, then atom's
draft logits (the target's post-norm hidden rows through :class:`MTPProposer`'s catch-up) equal
the trainee's at a prompt's last position. The target's final norm is made random, so a
layer fed the pre-norm hidden state on one side would fail (checked)."""

from __future__ import annotations

import importlib.util
import pathlib

import torch

from atom.worker.model_loader import load_model_weights
from atom.worker.model_runner import ModelRunner
from atom.worker.mtp_proposer import MTPProposer
from tests.models.runner_parity import BLOCK_SIZE, NUM_KV_BLOCKS, BlockPool, random_tokens, seq_of
from tests.moe_utils import DEEPSEEK_V3

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_mtp.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_mtp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trained_mtp_layer_drafts_in_atom_as_in_training(tmp_path):
    bench = _bench()
    torch.set_num_threads(1)
    target = bench.build_target(tmp_path, branch_scale=0.5, config=DEEPSEEK_V3)
    with torch.no_grad():  # a final norm that is not all ones: pre- and post-norm rows differ
        target.model.norm.weight.copy_(0.5 + torch.rand(DEEPSEEK_V3["hidden_size"]))
    target.save_pretrained(tmp_path)
    sequences = [random_tokens(24, 512, seed=s) for s in range(4)]
    trained = bench.train_mtp(target, sequences, seconds=2.0)
    assert trained["num_steps"] >= 1
    bench.write_mtp_layer(tmp_path, trained["tensors"])

    prompt = random_tokens(17, 512, seed=9)
    trainee = bench.MTPTrainee(target)  # the trained weights back into a trainee
    heads = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
             "shared_head.norm": "head_norm"}
    block = {k.removeprefix("model.layers.3."): v for k, v in _fused(trained["tensors"]).items()}
    for name, attr in heads.items():
        getattr(trainee, attr).data.copy_(block.pop(f"{name}.weight"))
    trainee.block.load_state_dict(block, strict=True)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        hidden = target.model(ids[:, :-1]).last_hidden_state
        _, ref = trainee.forward(hidden, ids[:, 1:], torch.arange(len(prompt) - 1))

    config, weights = load_model_weights(str(tmp_path), torch.float32)
    runner = ModelRunner(config, weights, dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS,
                         block_size=BLOCK_SIZE, max_model_len=256, num_mtp_layers=1)
    proposer = MTPProposer(runner)
    seq, pool = seq_of(prompt[:-1]), BlockPool()
    pool.grow(seq, len(prompt) - 1)
    proposer.record(runner.execute_model([(seq, len(prompt) - 1)]).hidden_states)
    seq.num_computed_tokens = len(prompt) - 1
    seq.token_ids = list(prompt)  # the "sampled" token after the prompt
    entry = proposer._catch_up(seq)
    pool.grow(seq, len(seq.token_ids) + 1)
    ours = runner.mtp.compute_logits(proposer._forward([entry], step_idx=0), step_idx=0)[0]
    torch.testing.assert_close(ours, ref[0, -1].float(), atol=1e-3, rtol=1e-4)


def _fused(tensors: dict) -> dict:
    """The per-expert tensors of the written layer fused back as transformers v5 keeps them."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    prefix = "model.layers.3.mlp.experts."
    num_experts = DEEPSEEK_V3["n_routed_experts"]
    out[prefix + "gate_up_proj"] = torch.stack([torch.cat(
        [tensors[f"{prefix}{e}.gate_proj.weight"], tensors[f"{prefix}{e}.up_proj.weight"]])
        for e in range(num_experts)])
    out[prefix + "down_proj"] = torch.stack([tensors[f"{prefix}{e}.down_proj.weight"]
                                             for e in range(num_experts)])
    return out
