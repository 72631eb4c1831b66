"""DP engine options: CLI flags generated from EngineConfig (routing and KV events included),
validation, the prefill policy default, and the replaced ``--prefill-delayer`` flags."""

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
                     "--prefill-policy", "coalescer", "--prefill-delayer-max-delay-passes", "7",
                     "--prefill-delayer-kv-low-watermark", "0.25",
                     "--prefill-coalescer-target-fill", "0.5",
                     "--prefill-coalescer-ttft-max-ticks", "40",
                     "--prefill-coalescer-partial-max-ticks", "4",
                     "--prefill-coalescer-stall-ticks", "2",
                     "--prefill-coalescer-kv-high-watermark", "0.8",
                     "--prefill-coalescer-max-queue-ticks", "100",
                     "--prefill-decode-interval", "2", "--dp-trace", "/tmp/trace"])
    assert (config.data_parallel_size, config.dp_load_balance, config.prefill_policy,
            config.prefill_delayer_max_delay_passes, config.prefill_delayer_kv_low_watermark) == (
        2, "round_robin", "coalescer", 7, 0.25)
    assert (config.prefill_coalescer_target_fill, config.prefill_coalescer_ttft_max_ticks,
            config.prefill_coalescer_partial_max_ticks, config.prefill_coalescer_stall_ticks,
            config.prefill_coalescer_kv_high_watermark,
            config.prefill_coalescer_max_queue_ticks) == (0.5, 40, 4, 2, 0.8, 100)
    assert (config.prefill_decode_interval, config.dp_trace) == (2, "/tmp/trace")
    default = _parse([])
    assert (default.prefill_policy, default.prefill_decode_interval, default.dp_trace,
            default.prefill_coalescer_max_queue_ticks) == (None, 0, None, None)


def test_policy_default_follows_dp_size():
    assert EngineConfig().resolved_prefill_policy() == "none"
    assert EngineConfig(data_parallel_size=2).resolved_prefill_policy() == "delayer"
    assert EngineConfig(data_parallel_size=2, prefill_policy="none").resolved_prefill_policy() == (
        "none")


@pytest.mark.parametrize("flag, replacement", [("--prefill-delayer", "--prefill-policy"),
                                               ("--no-prefill-delayer", "--prefill-policy")])
def test_replaced_flags_say_what_to_use(flag, replacement, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(["--data-parallel-size", "2", flag])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} was replaced" in err and replacement in err
    with pytest.raises(TypeError, match="prefill_policy='delayer' or 'none'"):
        EngineConfig.from_kwargs(data_parallel_size=2, prefill_delayer=False)


@pytest.mark.parametrize("argv, kwargs, hint", [
    (["-dp", "2"], None, "-dp is vLLM's option: atom spells it --data-parallel-size N"),
    (["-tp", "2"], None, "-tp is vLLM's option: atom has no tensor parallelism: scale with "
                         "--data-parallel-size N"),
    (["--tensor-parallel-size", "2"], dict(tensor_parallel_size=2),
     "atom has no tensor parallelism: scale with --data-parallel-size N"),
    (["--num-redundant-experts", "2"], dict(num_redundant_experts=2),
     "atom spells it --eplb-num-redundant-experts N (eplb_num_redundant_experts)"),
    (["--eplb-config", '{"window_size": 100}'], dict(eplb_config={"window_size": 100}),
     "--eplb-window-size, --eplb-step-interval, --eplb-num-redundant-experts"),
    (["--enable-dbo"], dict(enable_dbo=True), "atom's two-batch overlap is --enable-tbo"),
])
def test_vllm_spellings_name_the_atom_option(argv, kwargs, hint, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(["--data-parallel-size", "2", *argv])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # (atom's parsers: one line)
    assert f"error: {argv[0]} is vLLM's option: " in last and hint in last
    if kwargs is not None:  # LLM(...) keywords: the same hint
        with pytest.raises(TypeError, match="is vLLM's option: ") as info:
            EngineConfig.from_kwargs(**kwargs)
        assert hint in str(info.value)


def test_tbo_needs_data_and_expert_parallelism():
    with pytest.raises(ValueError, match="enable_tbo=True needs data parallelism"):
        EngineConfig(enable_tbo=True)
    with pytest.raises(ValueError, match=r"set enable_expert_parallel \(--enable-expert-parallel\)"):
        EngineConfig(data_parallel_size=2, enable_tbo=True)
    on = EngineConfig(data_parallel_size=2, enable_expert_parallel=True, enable_tbo=True)
    assert on.enable_tbo and not on.with_data_parallel_size(1).enable_tbo  # a shrink drops it


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
                                      kv_events_buffer_size=0),
                                 dict(prefill_policy="nagle"), dict(prefill_decode_interval=-1),
                                 dict(prefill_coalescer_ttft_max_ticks=0),
                                 dict(prefill_coalescer_target_fill=0.0),
                                 dict(prefill_coalescer_max_queue_ticks=0)])
def test_validation(bad):
    with pytest.raises(ValueError):
        EngineConfig(**{"data_parallel_size": 2, **bad})


@pytest.mark.parametrize("option", [dict(prefill_policy="delayer"),
                                    dict(prefill_decode_interval=2), dict(dp_trace="/tmp/t")])
def test_prefill_settings_need_data_parallelism(option):
    with pytest.raises(ValueError, match="needs data parallelism"):
        EngineConfig(**option)
    assert EngineConfig(prefill_policy="none").resolved_prefill_policy() == "none"


def test_thread_count_is_decided_in_one_place():
    assert resolve_num_threads(3, num_local_ranks=2, env={"OMP_NUM_THREADS": "7"}, num_cpus=8) == 3
    assert resolve_num_threads(None, num_local_ranks=2, env={"OMP_NUM_THREADS": "7"}, num_cpus=8) == 7
    assert resolve_num_threads(None, num_local_ranks=2, env={}, num_cpus=8) == 4
    assert resolve_num_threads(None, num_local_ranks=3, env={}, num_cpus=2) == 1


def test_more_ranks_than_cores_is_warned_about():
    assert oversubscription_warning(2, num_cpus=2) is None
    warning = oversubscription_warning(3, num_cpus=2)
    assert "3 engine processes on 2 CPU cores" in warning and "at most 2" in warning


def test_rank_failure_flags_and_the_shrunk_config(caplog):
    config = _parse(["--data-parallel-size", "2", "--engine-hang-timeout-s", "5",
                     "--on-rank-failure", "replace", "--no-resume-on-rank-failure"])
    assert (config.engine_hang_timeout_s, config.on_rank_failure,
            config.resume_on_rank_failure) == (5.0, "replace", False)
    default = _parse([])
    assert (default.engine_hang_timeout_s, default.on_rank_failure,
            default.resume_on_rank_failure) == (10.0, "shrink", True)
    for bad in (dict(engine_hang_timeout_s=1.0), dict(on_rank_failure="pray")):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    dp3 = EngineConfig(data_parallel_size=3, prefill_policy="coalescer", dp_trace="/tmp/t")
    assert dp3.with_data_parallel_size(2).prefill_policy == "coalescer"
    one = dp3.with_data_parallel_size(1)  # the DP-only options no longer apply, and say so
    assert (one.data_parallel_size, one.prefill_policy, one.dp_trace) == (1, None, None)
    assert "prefill_policy='coalescer', dp_trace='/tmp/t' no longer apply" in caplog.text


def test_eplb_flags_and_their_checks():
    config = _parse(["--data-parallel-size", "2", "--enable-expert-parallel", "--enable-eplb",
                     "--eplb-num-redundant-experts", "2", "--eplb-window-size", "10",
                     "--eplb-step-interval", "30", "--eplb-min-balancedness", "0.8",
                     "--eplb-fake-uniform"])
    assert (config.enable_eplb, config.eplb_num_redundant_experts, config.eplb_window_size,
            config.eplb_step_interval, config.eplb_min_balancedness,
            config.eplb_fake_uniform) == (True, 2, 10, 30, 0.8, True)
    default = _parse([])
    assert (default.enable_eplb, default.eplb_num_redundant_experts, default.eplb_window_size,
            default.eplb_step_interval, default.eplb_fake_uniform) == (False, 0, 1000, 3000, False)
    on = dict(data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True)
    for bad, match in ((dict(on, eplb_window_size=40, eplb_step_interval=30), "longer than"),
                       (dict(on, eplb_num_redundant_experts=-1), ">= 0"),
                       (dict(on, eplb_min_balancedness=1.5), r"\[0, 1\]"),
                       (dict(on, eplb_step_interval=0), ">= 1"),
                       (dict(data_parallel_size=2, eplb_num_redundant_experts=2), "needs enable_eplb"),
                       (dict(data_parallel_size=2, eplb_num_redundant_experts=2,
                             eplb_fake_uniform=True), "and eplb_fake_uniform need enable_eplb"),
                       (dict(data_parallel_size=2, enable_eplb=True), "enable_expert_parallel"),
                       (dict(enable_expert_parallel=True, enable_eplb=True), "data parallelism")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)
    one = EngineConfig(**on, eplb_num_redundant_experts=2).with_data_parallel_size(1)
    assert (one.enable_eplb, one.eplb_num_redundant_experts) == (False, 0)


def test_record_expert_load_flag_and_its_checks():
    config = _parse(["--data-parallel-size", "2", "--enable-expert-parallel",
                     "--record-expert-load", "--eplb-window-size", "8",
                     "--eplb-step-interval", "8"])
    assert (config.record_expert_load, config.enable_eplb) == (True, False)
    assert config.resolved_record_expert_load() and not EngineConfig().resolved_record_expert_load()
    assert EngineConfig(data_parallel_size=2, enable_expert_parallel=True,
                        enable_eplb=True).resolved_record_expert_load()
    with pytest.raises(ValueError, match="record_expert_load counts the experts' tokens under "
                                         "expert parallelism: set enable_expert_parallel"):
        EngineConfig(data_parallel_size=2, record_expert_load=True)
    with pytest.raises(ValueError, match="record_expert_load=True needs data parallelism"):
        EngineConfig(enable_expert_parallel=True, record_expert_load=True)
    one = config.with_data_parallel_size(1)
    assert (one.record_expert_load, one.enable_expert_parallel) == (False, True)
