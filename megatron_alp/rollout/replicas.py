"""The rollout replicas every trainer rank holds a view of: layout, engines, live set, collectives, memory.

Placement (:mod:`megatron_alp.rollout.placement`): ``rollout.replicas`` engines, replica k
started by global rank ``k * world / replicas`` (its leader) on its own GPUs or CPU cores,
colocated with the trainer ranks of its block. Every rank takes part in every call; results,
statistics and errors travel over a gloo group, so a failure raises the same error everywhere
instead of leaving ranks waiting.

Failures: each engine retries and restarts itself (``rollout.max_retries``). A replica whose engine
fails (a RolloutError, a lost-weights restart) twice in a row, within a call or across calls, is
retired: one warning line, its engine shut down; later splits and weight syncs leave it out (its
leader still takes part in the collectives). Every rank takes these decisions from the same gathered
outcomes, so all agree on the live set. Only when no replica is left is it a RolloutError naming the
last one, on every rank.

On GPUs a colocated replica sleeps while Megatron trains when ``free_memory_during_training`` is
set: KV cache freed, weights offloaded, or dropped when the next weight sync re-sends them all
(:mod:`~megatron_alp.rollout.engine_memory`).

What runs on the replicas builds on this: generation (:class:`~megatron_alp.rollout.distributed.DistributedRollout`)
and the weight sync (:mod:`megatron_alp.sync`).
"""

from __future__ import annotations

import os
import pickle
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_alp.config import RolloutConfig
from megatron_alp.rollout.base import EngineRestarted, RolloutEngine, RolloutError, get_engine
from megatron_alp.rollout.placement import Placement, ReplicaLayout, engine_placement, replica_layout
from megatron_alp.rollout.producer import RolloutProducer
from megatron_alp.runtime.comm import cpu_group
from megatron_alp.runtime.console import say
from megatron_alp.runtime.platform import has_gpu


def build_engine(cfg: RolloutConfig, model_dir: str, seed: int, placement: Optional[Placement] = None,
                 lora_rank: Optional[int] = None) -> RolloutEngine:
    """The engine registered under ``cfg.engine`` (``vllm``, ``sglang``), started on ``model_dir``
    once it accepts ``cfg`` (:meth:`~megatron_alp.rollout.base.RolloutEngine.check_config`);
    ``lora_rank``: with LoRA on, for :meth:`~megatron_alp.rollout.base.RolloutEngine.update_adapter`."""
    engine = get_engine(cfg.engine)
    engine.check_config(cfg)
    if lora_rank is None:
        return engine(cfg, model_dir, seed, placement)
    if not engine.takes_adapters:
        raise ValueError(f"lora.sync: adapter with rollout.engine={cfg.engine}, which cannot apply LoRA adapters "
                         "itself; use lora.sync: merged")
    return engine(cfg, model_dir, seed, placement, lora_rank=lora_rank)


class ReplicaSet:
    """The replicas' layout, this leader's engine (and producer), the live set and the collectives
    over them. Every rank constructs it and calls every method (collective)."""

    def __init__(self, cfg: RolloutConfig, model_dir: str, seed: int, version: int = 0, background: bool = False,
                 lora_rank: Optional[int] = None):
        """``version``: the weights the engines start with; ``background``: each leader drives its engine
        from a :class:`~megatron_alp.rollout.producer.RolloutProducer` thread; ``lora_rank``: the engines
        start with LoRA on (:func:`build_engine`)."""
        self.cfg = cfg
        self.memory = "awake"  # what of the colocated engines' memory is awake: asleep, weights or awake
        self.version = version  # the weight version the engines hold (trainer iterations)
        self.model_dir = str(model_dir)
        self.multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.multi else 0
        world = dist.get_world_size() if self.multi else 1
        # CPU-side exchanges of Python objects, also on NCCL jobs. Ranks wait in them while the
        # replicas generate, retry and restart; the engines bound all of that themselves (attempt
        # timeouts that scale with the batch, retries), so the wait only ends a rank stuck elsewhere.
        self.group = cpu_group(timeout=timedelta(seconds=24 * 3600)) if self.multi else None
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        self.layout: ReplicaLayout = replica_layout(cfg, world, _data_parallel_size(world), has_gpu(), local_world)
        self.replica = self.layout.replica_of(self.rank)
        self.engine: Optional[RolloutEngine] = None
        self.producer: Optional[RolloutProducer] = None
        # separate placement on the CPU: this leader's engine cores, where its rollout-side work runs too
        self.engine_cores: Optional[tuple[int, ...]] = None
        self.live = list(range(self.layout.replicas))  # replicas not retired, the same on every rank
        self.failures = [0] * self.layout.replicas  # consecutive failures of each replica's engine
        error = None
        if self.replica is not None:
            try:
                local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
                placement = engine_placement(cfg, self.layout, self.rank, local_rank, local_world, has_gpu())
                self.engine = build_engine(cfg, model_dir, seed, placement, lora_rank=lora_rank)
                if cfg.placement == "separate" and placement is not None:
                    self.engine_cores = placement.cores
                if background:
                    self.producer = RolloutProducer(self.engine, version, partial_rollouts=cfg.partial_rollout,
                                                    cores=self.engine_cores)
            except Exception as err:
                error = err
        self.check(self.gather(picklable(error)), error, "starting the rollout engine")

    @property
    def replicas(self) -> int:
        return self.layout.replicas

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank, over the rollout's CPU group (which tolerates the long
        waits of generation): e.g. the output of code that rank 0 ran for a multi-turn episode."""
        if not self.multi:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Each replica leader's ``obj``, indexed by replica, on every rank."""
        if not self.multi:
            return [obj]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, obj, group=self.group)
        return [everyone[self.layout.leader(k)] for k in range(self.replicas)]

    def check(self, failures: list, own: Optional[BaseException], what: str) -> None:
        """Raise the first replica failure (an exception or a message, None for success) everywhere:
        the replica's own exception on its leader, a RolloutError naming the replica elsewhere."""
        failed = [(k, f) for k, f in enumerate(failures) if f is not None]
        if not failed:
            return
        if own is not None:
            raise own
        k, err = failed[0]
        detail = f"{type(err).__name__}: {err}" if isinstance(err, BaseException) else str(err)
        raise RolloutError(f"{what} failed on rollout replica {k} (rank {self.layout.leader(k)}): {detail}")

    def run(self, work: Callable[[RolloutEngine], Any]) -> tuple[int, Any]:
        """``work(engine)`` on this leader's engine, through its producer when there is one:
        ``(weight version, result)``."""
        if self.producer is not None:
            return self.producer.run(work)
        return self.version, work(self.engine)

    @staticmethod
    def outcome(call: Callable[[], Any]) -> tuple[tuple[str, Any], Optional[BaseException]]:
        """``("ok", result)``, ``("resync", why)``, ``("failed", RolloutError)`` (the engine failed)
        or ``("error", exception)`` (anything else), and the exception."""
        try:
            return ("ok", call()), None
        except EngineRestarted as err:
            return ("resync", str(err)), err
        except RolloutError as err:
            return ("failed", picklable(err)), err
        except Exception as err:
            return ("error", picklable(err)), err

    def failed(self, k: int, why: Any, own: Optional[BaseException]) -> bool:
        """Count a failure of replica ``k`` (the same on every rank); at the second in a row retire it,
        and with no replica left raise a RolloutError naming it. Whether it was retired."""
        self.failures[k] += 1
        if self.failures[k] < 2:
            return False
        detail = f"{type(why).__name__}: {why}" if isinstance(why, BaseException) else str(why)
        self.live.remove(k)
        if self.replica == k:
            self.release()
        leader = self.layout.leader(k)
        if not self.live:
            raise RolloutError(f"rollout replica {k} (rank {leader}) failed twice in a row and no other replica "
                               f"is left: {detail}") from (own if self.replica == k else None)
        if self.rank == 0:
            say(f"rollout replica {k} (rank {leader}) failed twice in a row and is retired, "
                f"{len(self.live)} of {self.replicas} left: {detail}")
        return True

    def on_replicas(self, work: Callable[[RolloutEngine], Any], which: set[int]
                    ) -> tuple[list[tuple[str, Any]], Optional[BaseException]]:
        """Run ``work(engine)`` on the replicas in ``which``. Returns every replica's ``(status,
        payload)`` on every rank ("ok" and ``(version, result)``, "resync" and why, "failed" or "error"
        and the exception, "skip") and this rank's own exception, if it raised one."""
        outcome: tuple[str, Any] = ("skip", None)
        own = None
        if self.replica in which:
            outcome, own = self.outcome(lambda: self.run(work))
        return self.gather(outcome), own

    @property
    def prober(self) -> int:
        """The rank whose engine shows its layers (:meth:`layer_states`): :func:`probe_leader`."""
        return probe_leader(self.layout, self.live)

    # --------------------------------------------------------------------------- lifecycle

    @property
    def sleeps(self) -> bool:
        """Whether the engines give their memory back while Megatron trains: colocated engines with
        ``free_memory_during_training`` (the others stay awake)."""
        return self.cfg.placement == "colocated" and self.cfg.free_memory_during_training

    def set_memory(self, state: str, resync: bool = False) -> None:
        """Put the engines' memory in ``state`` where they sleep (:attr:`sleeps`): ``asleep`` (weights
        and KV cache freed while the trainer trains), ``weights`` (the weights awake for a sync, no KV
        cache) or ``awake``. ``resync``: a weight sync comes before the engines generate again
        (:meth:`~megatron_alp.rollout.engine_memory.EngineMemory.move`)."""
        state = state if self.sleeps else "awake"
        if self.engine is not None:
            self.engine.memory.move(state, resync=resync)
        self.memory = state

    @property
    def held_memory(self) -> Optional[str]:
        """What of this rank's engine memory is awake, read from the engine (None without an engine)."""
        return self.engine.memory.state if self.engine is not None else None

    def shutdown(self) -> None:
        self.release()

    def release(self) -> None:
        """Shut this leader's engine and producer down (at the end, or when its replica is retired)."""
        if self.producer is not None:
            self.producer.close()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.producer is not None:
            self.producer.join(timeout=30)
            self.producer = None


def probe_leader(layout: ReplicaLayout, live: list[int]) -> int:
    """The rank that captures an engine's layer states: the leader of the first live replica (replica 0
    may have been retired)."""
    return layout.leader(min(live))


def _data_parallel_size(world: int) -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else world


def picklable(error: Optional[BaseException]) -> Optional[BaseException]:
    """``error`` if it survives the gather's pickling, else a RolloutError with its type and message."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RolloutError(f"{type(error).__name__}: {error}")
