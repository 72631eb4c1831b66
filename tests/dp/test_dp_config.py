"""DP engine options: CLI flags generated from EngineConfig (routing and KV events included),
validation, delayer default."""

from __future__ import annotations

import argparse

import pytest

from atom.config import (
    EngineConfig,
    add_engine_args,
    config_from_args,
    oversubscription_warning,
    resolve_num_threads,
)


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(argv))


def test_dp_flags():
    config = _parse(["--data-parallel-size", "2", "--dp-load-balance", "round_robin",
                     "--no-prefill-delayer", "--prefill-delayer-max-delay-passes", "7",
                     "--prefill-delayer-kv-low-watermark", "0.25"])
    assert (config.data_parallel_size, config.dp_load_balance, config.prefill_delayer,
            config.prefill_delayer_max_delay_passes, config.prefill_delayer_kv_low_watermark) == (
        2, "round_robin", False, 7, 0.25)
    assert not config.resolved_prefill_delayer()
    default = _parse([])
    assert default.prefill_delayer is None and default.prefill_delayer_kv_low_watermark is None
    assert _parse(["--prefill-delayer"]).resolved_prefill_delayer()


def test_delayer_default_follows_dp_size():
    assert not EngineConfig().resolved_prefill_delayer()
    assert EngineConfig(data_parallel_size=2).resolved_prefill_delayer()


def test_routing_and_kv_events_flags():
    config = _parse(["--data-parallel-size", "2", "--dp-load-balance", "cache_aware",
                     "--dp-load-guard-abs-threshold", "4", "--dp-load-guard-rel-threshold", "2",
                     "--dp-cache-aware-min-match-ratio", "0.25",
                     "--kv-events-endpoint", "tcp://*:5557",
                     "--kv-events-replay-endpoint", "tcp://*:5567", "--kv-events-topic", "kv",
                     "--kv-events-buffer-size", "50"])
    assert (config.dp_load_guard_abs_threshold, config.dp_load_guard_rel_threshold,
            config.dp_cache_aware_min_match_ratio) == (4, 2.0, 0.25)
    events = config.resolved_kv_events()
    assert (events.endpoint, events.replay_endpoint, events.topic, events.buffer_size) == (
        "tcp://*:5557", "tcp://*:5567", "kv", 50)
    assert _parse([]).resolved_kv_events() is None  # off by default


@pytest.mark.parametrize("bad", [dict(data_parallel_size=0), dict(dp_load_balance="random"),
                                 dict(prefill_delayer_max_delay_passes=0),
                                 dict(prefill_delayer_kv_low_watermark=1.5),
                                 dict(dp_load_guard_abs_threshold=-1),
                                 dict(dp_load_guard_rel_threshold=0.5),
                                 dict(dp_cache_aware_min_match_ratio=1.5),
                                 dict(dp_load_balance="cache_aware", enable_prefix_caching=False),
                                 dict(kv_events_endpoint="tcp://127.0.0.1"),
                                 dict(kv_events_endpoint="tcp://127.0.0.1:5557",
                                      kv_events_buffer_size=0)])
def test_validation(bad):
    with pytest.raises(ValueError):
        EngineConfig(**bad)


def test_thread_count_is_decided_in_one_place():
    assert resolve_num_threads(3, num_local_ranks=2, env={"OMP_NUM_THREADS": "7"}, num_cpus=8) == 3
    assert resolve_num_threads(None, num_local_ranks=2, env={"OMP_NUM_THREADS": "7"}, num_cpus=8) == 7
    assert resolve_num_threads(None, num_local_ranks=2, env={}, num_cpus=8) == 4
    assert resolve_num_threads(None, num_local_ranks=3, env={}, num_cpus=2) == 1


def test_more_ranks_than_cores_is_warned_about():
    assert oversubscription_warning(2, num_cpus=2) is None
    warning = oversubscription_warning(3, num_cpus=2)
    assert "3 engine processes on 2 CPU cores" in warning and "at most 2" in warning
