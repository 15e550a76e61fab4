"""The app's multi-GPU setups from the command line, on the CPU: the ``experiment=fsdp_*`` configs
compose into the Trainer they name (four ranks of SlothFSDPStrategy, the model shape, LoRA, 4-bit
base), and the multi-node launch (``trainer.num_nodes=2`` under SLURM or torchrun) gives every
process its rank without re-launching anything."""

import os
from pathlib import Path

import _processes
import pytest
import torch
from hydra import compose, initialize_config_module
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from lightning_sloth import SlothFSDPStrategy, build
from lightning_sloth.config import validate
from lightning_sloth.data import build_char_tokenizer
from lightning_sloth.plugins.strategy import _ShardedSpawnLauncher

CONF = Path(build.__file__).parent / "conf"  # the installed config package
if not CONF.is_dir():
    CONF = Path(__file__).resolve().parents[1] / "conf"

# experiment -> (billions of parameters of its shape, LoRA targets 3-D experts, 4-bit base)
EXPERIMENTS = {
    "fsdp_llama_1b": (1.24, False, None),
    "fsdp_llama_8b": (8.03, False, None),
    "fsdp_qwen3_30b_a3b": (30.5, True, None),
    "fsdp_llama_70b_qlora": (70.6, False, "nf4"),
}


@pytest.fixture(scope="module")
def hydra_conf():
    with initialize_config_module("lightning_sloth.conf", version_base="1.3"):
        yield


@pytest.fixture
def process_state(monkeypatch):
    """Building a Trainer under a cluster's variables sets process-wide state later in-process runs
    would inherit: the rank rank_zero_only reads, and MASTER_ADDR/MASTER_PORT."""
    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0))
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.setenv(key, "")  # recorded, so what Lightning sets is undone after the test
        monkeypatch.delenv(key)
    return monkeypatch


@pytest.mark.parametrize("experiment", sorted(EXPERIMENTS))
@pytest.mark.parametrize("multirun", [False, True])
def test_fsdp_experiments_build_four_sharded_ranks_of_their_shape(hydra_conf, tmp_path, experiment, multirun):
    billions, expert_lora, quantize = EXPERIMENTS[experiment]
    cfg = compose("train", overrides=[f"experiment={experiment}", "trainer.accelerator=cpu"])
    validate(cfg)
    assert cfg.data.max_tokens == 16384 and cfg.lora.r == 16
    trainer = build.build_trainer(cfg, tmp_path, multirun=multirun, callbacks=[], loggers=False)
    strategy = trainer.strategy
    assert type(strategy) is SlothFSDPStrategy and trainer.num_devices == 4
    # Under -m the ranks are spawned from the job (re-running sys.argv would start the whole sweep).
    assert isinstance(strategy.launcher, _ShardedSpawnLauncher) == multirun
    assert trainer.precision_plugin.quantize == quantize
    assert trainer.precision_plugin.precision == "bf16-mixed"
    lora = build.build_lora_settings(cfg.lora)
    assert bool(lora.target_parameters) == expert_lora
    config = build.build_model_config(cfg.model, len(build_char_tokenizer()))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=0.01)


SLURM_TWO_NODES = dict(
    SLURM_NTASKS="8",
    SLURM_NTASKS_PER_NODE="4",
    SLURM_NODELIST="gpu-node[07-08]",
    SLURM_PROCID="5",
    SLURM_LOCALID="1",
    SLURM_NODEID="1",
    SLURM_JOB_ID="4242",
    SLURM_JOB_NAME="lightning-sloth",
)


@pytest.mark.parametrize("multirun", [False, True])
def test_two_slurm_nodes_of_four_tasks_each_make_one_rank_per_task(
    hydra_conf, tmp_path, process_state, multirun
):
    """``trainer=fsdp trainer.devices=4 trainer.num_nodes=2`` in a SLURM job of 8 tasks: task 5 is
    global rank 5 (node 1, local rank 1) of 8; the main address is the job's first node; Lightning
    launches nothing (SLURM started every task), under ``-m`` too."""
    for key, value in SLURM_TWO_NODES.items():
        process_state.setenv(key, value)
    overrides = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=4", "trainer.num_nodes=2"]
    cfg = compose("train", overrides=overrides)
    trainer = build.build_trainer(cfg, tmp_path, multirun=multirun, callbacks=[], loggers=False)
    environment = trainer.strategy.cluster_environment
    assert isinstance(environment, SLURMEnvironment) and trainer.strategy.launcher is None
    assert (trainer.num_nodes, trainer.num_devices, trainer.world_size) == (2, 4, 8)
    assert (trainer.global_rank, trainer.node_rank, trainer.local_rank) == (5, 1, 1)
    assert environment.main_address == "gpu-node07"
    assert environment.main_port == 15000 + 4242  # the same on every node: from the job id
    assert type(trainer.strategy) is SlothFSDPStrategy


def test_torchrun_on_two_nodes_makes_one_rank_per_process(hydra_conf, tmp_path, process_state):
    """``torchrun --nnodes 2 --nproc-per-node 4 -m lightning_sloth.train trainer=fsdp
    trainer.devices=4 trainer.num_nodes=2``: the process torchrun started as rank 6 is rank 6."""
    torchrun = dict(TORCHELASTIC_RUN_ID="job", WORLD_SIZE="8", RANK="6", LOCAL_RANK="2", GROUP_RANK="1")
    torchrun |= dict(LOCAL_WORLD_SIZE="4", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    for key, value in torchrun.items():
        process_state.setenv(key, value)
    overrides = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=4", "trainer.num_nodes=2"]
    trainer = build.build_trainer(
        compose("train", overrides=overrides), tmp_path, callbacks=[], loggers=False
    )
    assert isinstance(trainer.strategy.cluster_environment, TorchElasticEnvironment)
    assert trainer.strategy.launcher is None
    assert (trainer.world_size, trainer.global_rank, trainer.node_rank, trainer.local_rank) == (8, 6, 1, 2)
    assert type(trainer.strategy) is SlothFSDPStrategy


def test_the_slurm_launcher_asks_for_one_task_and_gpu_per_device_on_each_node(hydra_conf):
    """``hydra/launcher=slurm`` (hydra-submitit-launcher) reads its sizes from the trainer config:
    resolved against ``trainer=fsdp trainer.devices=4 trainer.num_nodes=2`` it asks SLURM for two
    nodes of four tasks and four GPUs each (the plugin itself is only needed to submit)."""
    launcher = OmegaConf.load(CONF / "hydra" / "launcher" / "slurm.yaml")
    assert launcher.defaults == ["submitit_slurm"]
    cfg = compose("train", overrides=["trainer=fsdp", "trainer.devices=4", "trainer.num_nodes=2"])
    node = OmegaConf.create({"trainer": OmegaConf.to_container(cfg.trainer), "launcher": launcher})
    resolved = OmegaConf.to_container(node, resolve=True)["launcher"]
    assert (resolved["nodes"], resolved["tasks_per_node"], resolved["gpus_per_node"]) == (2, 4, 4)


def test_under_fsdp_a_random_model_is_built_per_shard(hydra_conf, tmp_path):
    """``trainer=fsdp`` with a random-weight model: built on the meta device, each rank drawing its
    shards from the run's seed; DDP and pretrained models are built whole as before."""
    from lightning_sloth.quant.loading import RandomWeights

    cfg = compose("train", overrides=["experiment=fsdp_qwen3_30b_a3b", "trainer.accelerator=cpu", "seed=7"])
    assert build.builds_per_shard(cfg)
    strategy = build.build_trainer(cfg, tmp_path, callbacks=[], loggers=False).strategy
    assert isinstance(strategy.meta_weights, RandomWeights) and strategy.meta_weights.seed == 7
    model = build.build_model(cfg.model, build_char_tokenizer(), meta=True)
    assert all(p.is_meta for p in model.parameters()) and model.config.num_hidden_layers == 48
    assert not build.builds_per_shard(compose("train", overrides=["trainer.devices=2"]))
    assert not build.builds_per_shard(
        compose("train", overrides=["trainer=fsdp"])
    )  # the pretrained tiny base


def _app_on_two_cpu_ranks(tmp_path: Path, *overrides: str, env_extra=None, timeout=600, ok=True):
    """``lightning-sloth trainer=fsdp trainer.devices=2 model=tiny_llama`` (two short steps) on a plain
    machine (no cluster variables); returns the finished process (which exited 0, with ``ok``)."""
    import os
    import sys

    args = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "model=tiny_llama"]
    args += ["trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1"]
    args += ["trainer.samples=0", "trainer.num_sanity_val_steps=0", "data.num_train=64", "data.num_val=8"]
    args += ["trainer.enable_progress_bar=false"]
    flags = [o for o in overrides if o.startswith("-")]
    given = {o.split("=")[0]: o for o in overrides if not o.startswith("-")}  # an override replaces a default
    args = flags + [a for a in args if a.split("=")[0] not in given] + list(given.values())
    app = Path(sys.executable).parent / "lightning-sloth"
    cluster = (
        "SLURM_",
        "MASTER_",
        "TORCHELASTIC_",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "NODE_RANK",
        "GROUP_RANK",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(cluster)}  # a plain machine
    env.update(env_extra or {})
    result = _processes.run(
        [str(app), *args], cwd=tmp_path, capture_output=True, text=True, timeout=timeout, env=env
    )
    if ok:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_the_app_trains_a_model_made_shard_by_shard_on_two_cpu_processes(tmp_path):
    """``lightning-sloth trainer=fsdp trainer.devices=2 model=tiny_llama`` end to end: Lightning
    re-runs the command for rank 1, each rank makes its own shards, and the run trains, validates
    and writes its sharded checkpoint and adapter."""
    import json

    out = tmp_path / "run"
    result = _app_on_two_cpu_ranks(tmp_path, f"hydra.run.dir={out}")
    assert (result.stdout + result.stderr).count("shards made per rank (RandomWeights)") == 2  # both ranks
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["val"]["loss"] > 0
    assert (out / "checkpoints" / "last.ckpt").is_dir() and (
        out / "adapter" / "adapter_model.safetensors"
    ).is_file()


def test_the_app_with_the_base_kept_whole_exports_the_gathered_adapter(tmp_path):
    """``trainer.fsdp_shard_frozen=false`` (what ``auto`` picks on a GPU with room): the adapters sit
    in the root's unit, which keeps its weights gathered from forward to backward, so after the last
    validation pass its parameters are the unsharded tensors while its state dict holds the
    ``DTensor`` shards. The export at the end gathers those (it read the parameters' types, saved
    the shards as they were, and rank 0 failed while rank 1 waited). Six steps, validation at 3 and
    6, as the GPU test of the app runs them; the adapter then holds every tensor at its full shape,
    and a second run resumes from the sharded checkpoint to step 9."""
    import json

    from safetensors import safe_open

    out = tmp_path / "run"
    result = _app_on_two_cpu_ranks(
        tmp_path,
        f"hydra.run.dir={out}",
        "model=tiny_base",  # the shipped base, built whole (a random model is built shard by shard)
        "trainer.fsdp_shard_frozen=false",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=2",
    )
    assert "their adapters in the root's unit" in result.stdout + result.stderr
    assert json.loads((out / "metrics.json").read_text())["steps"] == 6
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    with safe_open(str(out / "adapter" / "adapter_model.safetensors"), "pt") as saved:
        shapes = {k: saved.get_slice(k).get_shape() for k in saved.keys()}  # noqa: SIM118
        values = [saved.get_tensor(k) for k in saved.keys()]  # noqa: SIM118
    assert shapes and all(torch.isfinite(v).all() for v in values)
    rank = config["r"]
    for key, shape in shapes.items():  # lora_A [r, in], lora_B [out, r]: whole, not one rank's half
        assert shape[0 if "lora_A" in key else 1] == rank, (key, shape)
    hidden = json.loads((Path(config["base_model_name_or_path"]) / "config.json").read_text())["hidden_size"]
    assert shapes["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"][0] == hidden
    whole = [f"hydra.run.dir={out}", "model=tiny_base", "trainer.fsdp_shard_frozen=false"]
    _app_on_two_cpu_ranks(tmp_path, *whole, "trainer.max_steps=9", "trainer.val_check_interval=3")
    metrics = json.loads((out / "metrics.json").read_text())  # resumed from the sharded checkpoint
    assert metrics["resumed_from"] == str(out / "checkpoints" / "last.ckpt") and metrics["steps"] == 9


_FAIL_ON_RANK_0 = """
import time

import lightning_sloth.plugins.callbacks as callbacks


def on_train_end(self, trainer, pl_module):
    if trainer.global_rank == 0:
        raise RuntimeError("injected failure on rank 0")
    time.sleep(600)  # rank 1 waits, as in a collective whose peer is gone (NCCL: until its timeout)


callbacks.SaveAdapter.on_train_end = on_train_end
"""


def test_a_failure_on_rank_0_stops_the_rank_it_started(tmp_path):
    """Rank 0 fails at the end of training while rank 1 waits: the strategy's ``on_exception`` kills
    the rank Lightning's launcher started, so the run ends with rank 0's error instead of leaving
    rank 1 behind (the process group then outlives the app: ``_processes.run`` fails at its timeout)."""
    import time

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_FAIL_ON_RANK_0)
    env = {"PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    start = time.monotonic()
    result = _app_on_two_cpu_ranks(
        tmp_path, f"hydra.run.dir={tmp_path / 'run'}", env_extra=env, timeout=240, ok=False
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "injected failure on rank 0" in output, output[-3000:]
    assert "RuntimeError on this rank: stopping the 1 other local rank(s) it started" in output, output[
        -3000:
    ]
    assert time.monotonic() - start < 200


def test_a_sweep_spawns_each_jobs_two_ranks_once(tmp_path):
    """``-m`` with ``trainer=fsdp`` on two CPU processes: each job spawns its ranks from the job
    (the command line, which is the whole sweep, is never re-run), trains and writes its own
    outputs; the sweep launches once."""
    import json

    sweep = tmp_path / "sweep"
    result = _app_on_two_cpu_ranks(tmp_path, "-m", "optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}")
    output = result.stdout + result.stderr
    assert output.count("Launching 2 jobs locally") == 1
    for job, lr in (("0", 1e-3), ("1", 3e-3)):
        metrics = json.loads((sweep / job / "metrics.json").read_text())
        assert metrics["steps"] == 2 and metrics["val"]["loss"] > 0
        assert (sweep / job / "adapter" / "adapter_model.safetensors").is_file()
        assert f"lr: {lr}" in (sweep / job / ".hydra" / "config.yaml").read_text()
    assert not (sweep / "2").exists()
