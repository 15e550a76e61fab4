"""benchmarks/ep_probe.py's summary of the ranks' timings, on the CPU (the probe itself needs GPUs)."""

from _scripts import benchmark_script


def _load():
    return benchmark_script("ep_probe")


def test_every_collective_is_summarised_at_its_slowest_rank():
    probe = _load()
    ranks = [
        {
            "all_gather_ms": 2.0,
            "all_gather_bytes": 8,
            "all_to_all_ms_copies_1": 1.0,
            "all_to_all_bytes_copies_1": 4,
            "all_to_all_ms_copies_8": 5.0,
            "all_to_all_bytes_copies_8": 32,
            "moe_block_fwd_bwd_ms": 9.0,
        },
        {
            "all_gather_ms": 3.0,
            "all_gather_bytes": 8,
            "all_to_all_ms_copies_1": 0.5,
            "all_to_all_bytes_copies_1": 4,
            "all_to_all_ms_copies_8": 6.0,
            "all_to_all_bytes_copies_8": 32,
        },
    ]
    timed, sizes = probe._collective_figures(ranks)
    assert timed == {"all_gather_ms": 3.0, "all_to_all_ms_copies_1": 1.0, "all_to_all_ms_copies_8": 6.0}
    assert sizes == {"all_gather_bytes": 8, "all_to_all_bytes_copies_1": 4, "all_to_all_bytes_copies_8": 32}
