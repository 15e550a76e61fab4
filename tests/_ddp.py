"""A two-process DDP training run with and without activation offload (CPU/gloo and CUDA/NCCL tests).

Imported as ``import _ddp``: ``tests/`` is on ``sys.path`` (see ``_models``), and spawned workers
find this module the same way.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_sloth.offload import ActivationOffloader, apply_checkpointing

WORLD = 2  # processes of the CPU (gloo) runs


def gpu_world() -> int:
    """Processes of the multi-GPU tests: ``SLOTH_TEST_GPUS`` if set, else every visible GPU."""
    return int(os.environ.get("SLOTH_TEST_GPUS") or torch.cuda.device_count())


def port_slice() -> range:
    """This pytest-xdist worker's rendezvous ports: 500 of its own, below the kernel's ephemeral
    range (where ``bind(0)`` and Lightning's port picker draw)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    low = 20000 + 500 * (int(worker) % 24 if worker.isdigit() else 0)
    return range(low, low + 500)


def free_port() -> int:
    """A free port of :func:`port_slice`: two multi-process tests running at once never meet on one."""
    ports = port_slice()
    for port in random.Random().sample(ports, len(ports)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports}")


def llama(hidden: int, layers: int, vocab: int, attention: str) -> LlamaForCausalLM:
    """Random-weight float32 Llama, head_dim 64, GQA 2:1."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        vocab_size=vocab,
        use_cache=False,
        attn_implementation=attention,
    )
    return LlamaForCausalLM(config)


def _worker(rank: int, port: int, device_type: str, offloads: tuple, results, world: int) -> None:
    """One rank: for each of ``offloads`` (offload off and on), a fresh model trained 3 DDP steps on
    this rank's data, in one process group (one spawn for both runs: each rank's start-up, its
    imports above all, is most of a CPU run's time)."""
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    try:
        device = torch.device(device_type, rank) if cuda else torch.device("cpu")
        for offload in offloads:
            model = llama(256, 4, 512, "eager").to(device).train()  # eager attention: deterministic backward
            offloader = (
                ActivationOffloader("on", device=device_type, min_offload_bytes=0) if offload else None
            )
            apply_checkpointing(model, offloader=offloader)
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
            gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
            for _ in range(3):
                ids = torch.randint(0, 512, (2, 384), generator=gen).to(device)
                ddp(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            state = {n: p.detach().cpu() for n, p in model.named_parameters()}
            results[(offload, rank)] = (state, offloader.stats() if offloader is not None else {})
            del ddp, model, optimizer
    except BaseException:
        leave_at_once()
    dist.destroy_process_group()


def leave_at_once() -> None:
    """End a failed rank now, its traceback printed, without ``destroy_process_group()``: with NCCL
    that call can wait for peers still inside a collective, and every rank would then wait for the
    collective's timeout. The exit makes the launcher stop the others and raise."""
    import traceback

    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)


RANKS_TIMEOUT = 600
"""Seconds a multi-process run may take before its ranks are killed and the test fails."""


def start_and_join(worker, args: tuple, world: int, timeout: float = RANKS_TIMEOUT) -> None:
    """``mp.start_processes(worker, args, world)`` (spawn), joined with a deadline: a rendezvous or
    collective that never completes kills every rank and fails the test, instead of holding it (and
    a failed rank raises with its traceback, as ``start_processes`` does)."""
    context = mp.start_processes(worker, args=args, nprocs=world, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(1.0, min(30.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(
                f"{world} ranks of {getattr(worker, '__name__', worker)} ran past {timeout} s "
                "(a rendezvous or collective never completed): killed"
            )


def run(device_type: str, world: int = WORLD) -> dict:
    """``{(offload, rank): (parameters after 3 DDP steps, offloader stats)}`` for offload off and on,
    on ``world`` processes (spawned once, both runs in each)."""
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        start_and_join(_worker, (free_port(), device_type, (False, True), results, world), world)
        return dict(results)


def assert_offload_changes_nothing(results: dict) -> None:
    """Every rank, offload on or off, ends with bitwise the same parameters; offload did offload."""
    plain = results[(False, 0)][0]
    for rank in range(max(r for _, r in results) + 1):
        state, stats = results[(True, rank)]
        assert stats["offloaded_bytes_per_step"] > 0
        assert stats["fetched_on_demand"] + stats["prefetched"] > 0
        for name, value in plain.items():
            assert torch.equal(state[name], value), (rank, name)
            assert torch.equal(results[(False, rank)][0][name], value), (rank, name)  # replicas in sync
