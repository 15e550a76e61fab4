"""One-time compile work: the compile caches every process of a user shares, the counter of
compilations per step the benchmark records, and the suite's cold and warm runs of a system."""

import os

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from lightning_sloth.bench import suite
from lightning_sloth.plugins.compile_cache import (
    CACHE_VARIABLES,
    CompileCounter,
    configure_compile_caches,
    default_cache_root,
)


def test_the_caches_go_under_the_users_cache_unless_set(tmp_path, monkeypatch):
    for variable in CACHE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.delenv("LIGHTNING_SLOTH_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "lightning_sloth"
    dirs = configure_compile_caches()
    assert dirs == {
        "TRITON_CACHE_DIR": str(tmp_path / "xdg" / "lightning_sloth" / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "xdg" / "lightning_sloth" / "inductor"),
    }
    assert all(os.path.isdir(path) and os.stat(path).st_mode & 0o077 == 0 for path in dirs.values())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice wins
    assert configure_compile_caches(tmp_path / "other")["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert configure_compile_caches(tmp_path / "other", override=True)["TRITON_CACHE_DIR"] == str(
        tmp_path / "other" / "triton"
    )


def test_the_counter_sees_triton_compiles_and_dynamo_graphs():
    from triton import knobs

    calls = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: calls.append(kw["key"])  # someone else's hook
    try:
        with CompileCounter() as counter:
            assert counter.available
            hook = {"repr": "_rope_kernel[num_warps=4](Q: *bf16, seq_len: i32)", "fn": None, "compile": {}}
            hook |= {"is_manual_warmup": False, "already_compiled": False}
            # What Triton calls around a compilation (on the GPU; the CPU interpreter compiles nothing).
            assert not knobs.runtime.jit_cache_hook(key="a", **hook)
            knobs.runtime.jit_post_compile_hook(key="a", **hook)
            compiled = torch.compile(lambda x: x.sin() + 1, backend="eager")
            compiled(torch.ones(3))
            first = counter.take()
            compiled(torch.ones(3))
            second = counter.take()
        assert first["triton_compiles"] == 1 and first["triton_kernels"] == ["_rope_kernel"]
        assert first["triton_compile_s"] >= 0 and first["dynamo_graphs"] == 1
        assert second == {
            "triton_compiles": 0,
            "triton_compile_s": 0,
            "triton_kernels": [],
            "dynamo_graphs": 0,
        }
        assert calls == ["a"]  # the hook that was there is still called ...
        assert knobs.runtime.jit_post_compile_hook is not None and knobs.runtime.jit_cache_hook is None
    finally:
        knobs.runtime.jit_post_compile_hook = None  # ... and is back afterwards


@pytest.fixture(scope="module")
def tiny():
    with initialize_config_module(config_module="lightning_sloth.conf.bench", version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="config", overrides=["scenario=tiny"]).scenario)


@pytest.mark.parametrize("name", ["sloth_trainer_offload", "sloth_kernels"])
def test_every_step_records_its_compilations(tiny, name):
    record = suite.measure(name, tiny)
    assert record["status"] == "ok", record
    steps = tiny["workload"]["warmup_steps"] + tiny["workload"]["timed_steps"]
    assert len(record["compiles_per_step"]) == len(record["dynamo_graphs_per_step"]) == steps
    assert record["compiles_in_timed_steps"] == 0 and record["kernels_compiled_in_timed_steps"] == []
    assert record["compile_hooks"] is True


def test_a_cold_run_then_a_warm_one_share_a_fresh_cache(tiny, monkeypatch):
    seen = []

    def fresh_process(task, preamble, timeout_s, env=None):
        seen.append((env, [os.listdir(path) for path in env.values()] if env else None))
        rate = 50.0 if len(seen) == 1 else 100.0
        for path in env.values():
            open(os.path.join(path, "kernel.cubin"), "w").close()  # what a run leaves in the cache
        return {
            "status": "ok",
            "tokens_per_s_median": rate,
            "compiles_per_step": [3, 1] if len(seen) == 1 else [0, 0],
        }

    monkeypatch.setattr(suite, "_in_fresh_process", fresh_process)
    record = suite.cold_and_warm({"kind": "system", "system": "sloth_trainer", "scenario": tiny}, "", 60)
    (cold_env, cold_files), (warm_env, warm_files) = seen
    assert cold_env == warm_env and set(cold_env) == set(CACHE_VARIABLES)
    assert cold_files == [[], []] and warm_files == [["kernel.cubin"], ["kernel.cubin"]]
    assert record["tokens_per_s_median"] == 100.0 and record["compiles_per_step"] == [0, 0]
    assert record["cold"]["tokens_per_s_median"] == 50.0 and record["cold"]["compiles_per_step"] == [3, 1]
    assert record["cold_tokens_per_s_median"] == 50.0 and record["cold_vs_warm"] == 0.5
    assert record["cold"]["page_cache_dropped"] is False
    assert "cold 50 tok/s (50.0% of warm)" in suite._line(
        {"system": "x", "status": "ok", "tokens_per_s_min": 1, "tokens_per_s_max": 1, "first_loss": 1.0}
        | {"last_loss": 1.0, "peak_allocated_gib": None}
        | record
    )


def test_cold_start_needs_fresh_processes(tmp_path):
    with initialize_config_module(config_module="lightning_sloth.conf.bench", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["scenario=tiny", "isolate=false", "cold_start=true"])
    with pytest.raises(ValueError, match="cold_start=true .* needs isolate=true"):
        suite.run_suite(cfg)


def test_process_env_reaches_every_system_process(tmp_path, monkeypatch):
    envs = []

    def fresh_process(task, preamble, timeout_s, env=None):
        envs.append((task["kind"], env))
        if task["kind"] == "probe":
            return {"device": "CPU (test)", "matmul_probe_tflops": 1.0, "datasheet_bf16_tflops": None}
        return {"status": "error", "reason": "not run"}

    monkeypatch.setattr(suite, "_in_fresh_process", fresh_process)
    overrides = ["scenario=tiny", "systems.names=[sloth_trainer]", f"out_dir={tmp_path}"]
    overrides += ["+process_env.CUDA_MODULE_LOADING=EAGER", "git_commit=abc"]
    for cold in ("false", "true"):
        with initialize_config_module(config_module="lightning_sloth.conf.bench", version_base="1.3"):
            suite.run_suite(compose(config_name="config", overrides=[*overrides, f"cold_start={cold}"]))
    systems = [env for kind, env in envs if kind == "system"]
    assert len(systems) == 3 and all(env["CUDA_MODULE_LOADING"] == "EAGER" for env in systems)
    assert (
        "TRITON_CACHE_DIR" not in systems[0]
        and systems[1]["TRITON_CACHE_DIR"] == systems[2]["TRITON_CACHE_DIR"]
    )
