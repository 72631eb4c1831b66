"""LLMEngine's side of a rank failure, against a scripted client (no processes, no model): the
client's RankFailedError leads to recover(), then every unfinished request is sent again as a
resumed request carrying each choice's tokens so far (finished choices marked), and the
stream goes on with no token repeated; with resumption off, or past MAX_RESUMES_PER_REQUEST,
requests end with ``finish_reason="error"`` marked as rank failures; a client that cannot
recover makes the engine dead.
"""

from __future__ import annotations

import pytest

from atom.config import EngineConfig
from atom.engine.llm_engine import DEAD, MAX_RESUMES_PER_REQUEST, SERVING, LLMEngine
from atom.engine.core_client import EngineCoreClient
from atom.engine.liveness import DEAD as DEAD_RANK
from atom.engine.liveness import EngineDeadError, RankFailedError, RankFailure
from atom.messages import EngineRuntime, ResumedChoice, SeqOutput
from atom.sampling_params import SamplingParams

RUNTIME = EngineRuntime(num_kv_blocks=8, max_model_len=64, vocab_size=100, eos_token_ids=(2,),
                        kv_cache_bytes=1, dtype="float32")


def _failure() -> RankFailedError:
    return RankFailedError([RankFailure(1, DEAD_RANK, "exited, killed by SIGKILL")])


class ScriptedClient(EngineCoreClient):
    """Returns the scripted outputs step by step; an exception in the script is raised."""

    def __init__(self, script, *, can_recover: bool = True):
        self.runtime, self.script, self.can_recover = RUNTIME, list(script), can_recover
        self.sent, self.num_recoveries = [], 0

    def add_request(self, request, data_parallel_rank=None, *, session_id=None):
        self.sent.append(request)
        return 0

    def abort(self, request_ids):
        pass

    def finish(self, seq_keys, stop_reasons):
        pass

    def get_outputs(self, timeout_s=None):
        item = self.script.pop(0) if self.script else []
        if isinstance(item, BaseException):
            raise item
        return item

    def call_utility_per_rank(self, method, *, timeout_s=None):
        return [{}]

    def is_alive(self):
        return True

    def shutdown(self):
        pass

    def recover(self, error):
        if not self.can_recover:
            raise EngineDeadError(f"{error} (stays down)")
        self.num_recoveries += 1

    def membership(self):
        return {"generation": self.num_recoveries}


def _out(request_id, index, tokens, finish=None, logprob=0.0):
    return SeqOutput(request_id=request_id, index=index, new_token_ids=tokens,
                     finish_reason=finish, cumulative_logprob=logprob)


def _engine(client, **options) -> LLMEngine:
    config = EngineConfig(skip_tokenizer_init=True, **options)
    return LLMEngine(config, client_factory=lambda config, extra_eos: client)


def _finished(engine: LLMEngine, max_steps: int = 20) -> dict:
    done = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError("requests did not finish")


def test_unfinished_requests_are_resumed_with_their_tokens_and_go_on():
    client = ScriptedClient([
        [_out("a", 0, [5], logprob=-1.0), _out("b", 0, [6]), _out("b", 1, [7])],
        [_out("b", 1, [8], finish="length")],
        _failure(),
        [_out("a", 0, [9], finish="length", logprob=-3.0), _out("b", 0, [10], finish="length")],
    ])
    engine = _engine(client)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    engine.add_request("b", [4], SamplingParams(n=2, max_tokens=2, prompt_logprobs=1))
    done = _finished(engine)
    resumed = {r.request_id: r for r in client.sent[2:]}
    assert resumed["a"].resumed == [ResumedChoice([5], -1.0, False)]
    assert resumed["a"].prompt_token_ids == [1, 2, 3] and resumed["a"].sampling_params.max_tokens == 2
    assert resumed["b"].resumed == [ResumedChoice([6], 0.0, False), ResumedChoice([7, 8], 0.0, True)]
    assert resumed["b"].sampling_params.prompt_logprobs is None  # received with the first token
    assert done["a"].outputs[0].token_ids == [5, 9] and done["a"].outputs[0].cumulative_logprob == -3.0
    assert [c.token_ids for c in done["b"].outputs] == [[6, 10], [7, 8]]
    assert engine.status.state == SERVING and "recovered from" in engine.status.message
    assert (engine.num_resumed_requests, engine.num_unresumed_requests) == (2, 0)


def test_without_resumption_in_flight_requests_end_with_an_error():
    client = ScriptedClient([[_out("a", 0, [5])], _failure()])
    engine = _engine(client, resume_on_rank_failure=False)
    engine.add_request("a", [1], SamplingParams(max_tokens=4))
    (out,) = _finished(engine).values()
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == [5]
    assert "dp rank 1 is dead" in out.outputs[0].error and out.extra["rank_failure"]
    assert client.num_recoveries == 1 and len(client.sent) == 1
    assert engine.num_unresumed_requests == 1


def test_a_request_in_flight_at_too_many_failures_is_not_resumed_again():
    client = ScriptedClient([_failure()] * (MAX_RESUMES_PER_REQUEST + 1))
    engine = _engine(client)
    engine.add_request("a", [1], SamplingParams(max_tokens=4))
    (out,) = _finished(engine).values()
    assert out.outputs[0].finish_reason == "error" and out.extra["rank_failure"]
    assert len(client.sent) == 1 + MAX_RESUMES_PER_REQUEST


def test_a_client_that_cannot_recover_makes_the_engine_dead():
    client = ScriptedClient([_failure()], can_recover=False)
    engine = _engine(client)
    engine.add_request("a", [1], SamplingParams(max_tokens=4))
    with pytest.raises(EngineDeadError, match="dp rank 1 is dead"):
        engine.step()
    assert engine.status.state == DEAD and "stays down" in engine.status.message
