"""The one object that owns DeepSpeed.

Nothing else in the project imports deepspeed: the trainer calls `train_batch`, `save`,
`load_latest` and `export_weights`. ZeRO stage 1, 2 or 3 (optionally offloading the
optimizer to CPU) over gloo on CPU, NCCL on GPU.

Checkpoints: DeepSpeed writes `<dir>/<tag>/...`; once every rank has written its shard
(a barrier), rank 0 writes `<dir>/<tag>/COMPLETE` last, with the client state (records
consumed, world size) as JSON. Only tags with that marker are ever resumed from, so a
checkpoint cut off mid-write is skipped, never half-loaded. Rank 0 also saves the
consolidated trainable weights beside it (`consolidated.safetensors`) so a run with a
different world size can resume from those instead of the sharded optimizer state.

Durability: the trainer acks a checkpoint's records as soon as `save` returns, after which
the stream no longer holds them. So `save` fsyncs every file of the checkpoint and the
directories that name them (each rank its shards, rank 0 the consolidated weights and
COMPLETE, itself written to a temp file and renamed) before it returns: a machine crash
after the ack finds the checkpoint on disk, and COMPLETE is never a torn file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from infra.config import TrainConfig
from infra.common.durable import fsync_path, sync_tree, write_durable

COMPLETE = "COMPLETE"
GRAD_CLIP = 1.0  # gradient norm clipping
# Linear learning-rate warm-up over this many optimizer steps: a fresh Adam's first steps move
# every weight by ~lr whatever the gradient, which undid a trained draft in the first few
# online steps.
WARMUP_STEPS = 20
CONSOLIDATED = "consolidated.safetensors"

# DeepSpeed JIT-compiles its CPU ops (fused Adam, shared-memory all-reduce) on first use: minutes
# of two compilers on a 2-core machine. torch caches the builds in ~/.cache/torch_extensions by op
# name, and a build made for another venv's sources is rebuilt, so two checkouts take turns
# rebuilding. Each venv keeps its own builds instead, made once by `make setup` (prebuild_ops).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.realpath(sys.prefix), "torch_extensions"))
CPU_OPS = ("FusedAdamBuilder", "ShareMemCommBuilder")


def prebuild_ops() -> list[str]:
    """Build (or load from this venv's cache) the DeepSpeed CPU ops the trainer uses."""
    from deepspeed.accelerator import get_accelerator

    built = []
    for name in CPU_OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible():
            print(f"[osd setup] DeepSpeed op {name}: not available here, skipped", flush=True)
            continue
        t0 = time.time()
        print(f"[osd setup] DeepSpeed op {builder.NAME}: loading, or building once for this venv "
              f"(minutes on 2 cores; cached in {os.environ['TORCH_EXTENSIONS_DIR']})", flush=True)
        builder.load(verbose=False)
        print(f"[osd setup] DeepSpeed op {builder.NAME}: ready ({time.time() - t0:.0f} s)", flush=True)
        built.append(builder.NAME)
    return built


@contextlib.contextmanager
def op_build_lock() -> Iterator[None]:
    """One op build at a time per TORCH_EXTENSIONS_DIR, under a lock the kernel drops when its
    holder dies. torch's own build lock is a plain file (<op>/lock): a trainer killed while it
    built (a SIGKILL, `osd up` stopped during a first start) left it behind, and every later
    start waited on it for ever. Whoever holds this lock is the only builder, so any torch
    lock found then is such a leftover, and is removed."""
    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".osd-build.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, or its holder dies
        for stale in root.glob("*/lock"):
            print(f"[osd] removing {stale}, a DeepSpeed op build's lock its killed builder left", flush=True)
            stale.unlink(missing_ok=True)
        yield


def load_cpu_ops() -> list[str]:
    """The CPU ops, built or loaded under op_build_lock before DeepSpeed asks for them."""
    with op_build_lock():
        return prebuild_ops()


class CheckpointError(RuntimeError):
    pass


def prune_checkpoints(ckpt_dir: str | Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` COMPLETE checkpoints, and the half-written ones older
    than the newest COMPLETE (a killed run's). Called once a new one is COMPLETE, so the disk
    holds at most keep + 1 (the one being written); a newer tag without COMPLETE is being
    written and is never touched. COMPLETE goes first, so a tag half-deleted by a crash is
    never resumed from. Returns the tags removed, oldest first."""
    d = Path(ckpt_dir)
    complete = DistillEngine.complete_tags(d)
    if not complete:
        return []
    newest = complete[-1]
    doomed = list(complete[:-keep])
    doomed += [p.name for p in d.iterdir() if p.is_dir() and re.match(r"step-\d+$", p.name)
               and p.name < newest and p.name not in complete]
    for tag in sorted(doomed):
        (d / tag / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(d / tag, ignore_errors=True)
    return sorted(doomed)


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, device: str = "cpu",
                     timeout_s: float = 300.0) -> None:
    """Join the process group once per process (gloo on CPU, NCCL on CUDA)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        load_cpu_ops()  # under a lock a killed builder cannot leave behind
    import deepspeed

    from datetime import timedelta

    # The timeout bounds how long survivors wait in a collective after a rank dies.
    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl", auto_mpi_discovery=False,
                               timeout=timedelta(seconds=timeout_s))


def ds_config(cfg: TrainConfig) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if cfg.zero_stage == 3:
        # Gather small layers whole: tiny drafts otherwise spend their time in fetch bookkeeping.
        zero.update(stage3_param_persistence_threshold=10_000, stage3_prefetch_bucket_size=5e6)
    return {
        "scheduler": {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": cfg.lr, "warmup_num_steps": WARMUP_STEPS,
            "warmup_type": "linear"}},
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": GRAD_CLIP,
        # On a GPU, torch's own AdamW: DeepSpeed's fused one is compiled with nvcc at first use,
        # a minute or more on each fresh machine, for a few-million-parameter draft.
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": 0.0,
                                                  **({"torch_adam": True} if cfg.device != "cpu" else {})}},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "wall_clock_breakdown": False,
        "steps_per_print": 10**9,
    }


def autocast_dtype(setting: str, device: str) -> torch.dtype | None:
    """The dtype a head's steps run their forward under (None: float32); weights, gradients and
    AdamW state stay float32. With native bfloat16 GEMMs a step is much faster that way
    (docs/benchmarks.md, "The warm start's teacher", "The online head trainer's steps"). "auto":
    bfloat16 on a GPU or a CPU with native bfloat16 GEMMs (infra/common/cpu.py), else float32,
    since an AVX2-only CPU emulates bfloat16 several times slower than float32."""
    from infra.common.cpu import native_bf16_gemm

    if setting == "auto":
        setting = "bfloat16" if device.startswith("cuda") or native_bf16_gemm() else "none"
    return torch.bfloat16 if setting == "bfloat16" else None


def autocast_context(dtype: torch.dtype | None, device: str) -> contextlib.AbstractContextManager:
    """torch.autocast in `dtype` on `device`'s type, or nothing where `dtype` is None."""
    return torch.autocast(torch.device(device).type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


class DistillEngine:
    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, autocast: torch.dtype | None = None):
        """autocast: run each step's forward (loss_fn) under torch.autocast in this dtype; the
        weights, gradients and optimizer state stay float32."""
        import deepspeed
        import torch.distributed as dist

        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config(cfg))
        self.module = self.engine.module
        self.steps = 0
        self.autocast = autocast

    # -- training ----------------------------------------------------------------

    def train_batch(self, batch: Any, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]) -> float:
        """One optimizer step on `batch`; loss_fn(model, batch) -> scalar. Returns the loss."""
        self.engine.train()
        device = next(self.module.parameters()).device.type
        with autocast_context(self.autocast, device):
            loss = loss_fn(self.engine, batch)
        self.engine.backward(loss)
        self.engine.step()
        self.steps += 1
        return float(loss.detach())

    # -- checkpoints ----------------------------------------------------------------

    def save(self, ckpt_dir: str | Path, client_state: dict[str, Any]) -> tuple[str, dict[str, torch.Tensor]]:
        """Every rank calls this. Returns (tag, consolidated trainable weights); COMPLETE is
        written last, by rank 0."""
        import torch.distributed as dist

        ckpt_dir = Path(ckpt_dir)
        tag = f"step-{self.steps:08d}"
        state = {**client_state, "world_size": self.world_size, "steps": self.steps, "time": time.time()}
        self.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=state, save_latest=False)
        weights = self.export_weights()  # collective under ZeRO-3: every rank takes part
        sync_tree(ckpt_dir / tag)  # this rank's shards are on disk before COMPLETE can vouch for them
        dist.barrier()
        if self.rank == 0:
            from safetensors.torch import save_file

            save_file(weights, str(ckpt_dir / tag / CONSOLIDATED))
            fsync_path(ckpt_dir / tag / CONSOLIDATED)
            write_durable(ckpt_dir / tag / COMPLETE, json.dumps(state).encode())
            fsync_path(ckpt_dir)  # the tag directory's own name
            prune_checkpoints(ckpt_dir, self.cfg.keep_checkpoints)
        dist.barrier()  # the caller acks the records once this returns, so all of it is durable now
        return tag, weights

    @staticmethod
    def complete_tags(ckpt_dir: str | Path) -> list[str]:
        """Tags with a COMPLETE marker, oldest first."""
        d = Path(ckpt_dir)
        if not d.is_dir():
            return []
        tags = [p.name for p in d.iterdir() if p.is_dir() and (p / COMPLETE).is_file() and re.match(r"step-\d+$", p.name)]
        return sorted(tags)

    def load_latest(self, ckpt_dir: str | Path) -> dict[str, Any] | None:
        """Resume from the newest complete checkpoint; None when there is none.

        Same world size: the full DeepSpeed state (weights, optimizer, step). Another world
        size: the consolidated weights only, with a fresh optimizer - said loudly, never silent.
        """
        tags = self.complete_tags(ckpt_dir)
        if not tags:
            return None
        tag = tags[-1]
        state = json.loads((Path(ckpt_dir) / tag / COMPLETE).read_text())
        if state.get("world_size") == self.world_size:
            path, client = self.engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_strict=False)
            if path is None:
                raise CheckpointError(f"DeepSpeed could not load checkpoint {ckpt_dir}/{tag}")
            self.steps = int(state["steps"])
            return {**state, "resumed": "full", "tag": tag}
        from safetensors.torch import load_file

        weights = load_file(str(Path(ckpt_dir) / tag / CONSOLIDATED))
        if self.rank == 0:
            print(f"[osd] checkpoint {tag} was written by {state.get('world_size')} workers, this run has "
                  f"{self.world_size}: resuming from its consolidated weights with a fresh optimizer", flush=True)
        self.load_weights(weights)
        self.steps = int(state["steps"])
        return {**state, "resumed": "consolidated", "tag": tag}

    # -- weights ----------------------------------------------------------------

    def _trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full trainable tensors on every rank (gathered from their shards under ZeRO-3)."""
        import deepspeed

        named = self._trainable()
        params = [p for _, p in named]
        if self.cfg.zero_stage == 3:
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                return {n: p.detach().clone().cpu().contiguous() for n, p in named}
        return {n: p.detach().clone().cpu().contiguous() for n, p in named}

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        import deepspeed

        named = self._trainable()
        missing = [n for n, _ in named if n not in weights]
        if missing:
            raise CheckpointError(f"consolidated weights lack {missing[:3]}")
        params = [p for _, p in named]
        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=0) if self.cfg.zero_stage == 3 else None
        if ctx is not None:
            ctx.__enter__()
        try:
            with torch.no_grad():
                for n, p in named:
                    p.copy_(weights[n].to(p.dtype))
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        # ZeRO 1/2 keep fp32 master copies in the optimizer: refresh them from the module.
        opt = getattr(self.engine, "optimizer", None)
        refresh = getattr(opt, "refresh_fp32_params", None)
        if refresh is not None and self.cfg.zero_stage in (1, 2):
            refresh()


if __name__ == "__main__":  # `make setup`: python -m train.distill.ds_engine
    load_cpu_ops()
