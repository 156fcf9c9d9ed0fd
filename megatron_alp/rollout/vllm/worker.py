"""What megatron-alp adds to vLLM's worker processes (``worker_extension_cls``): the receiving
ends of the weight transports, and the capture of every decoder layer's hidden states for the
per-layer mismatch report (:mod:`megatron_alp.diagnostics.layer_divergence`).

vLLM imports this module in every worker, in process or in its engine's subprocesses: keep it
light. The import itself asks for the CPU's AMX tiles (:func:`enable_cpu_amx`), which vLLM's CPU
bf16 kernels need in every process that runs them.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_alp.rollout.weight_broadcast import BroadcastReceiver
from megatron_alp.rollout.weight_sync import load_bucket


def enable_cpu_amx() -> None:
    """vLLM's CPU bf16 kernels use Intel AMX tiles, which Linux grants only to a process that asks
    (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); without it the first bf16 forward dies with SIGILL.
    Ask up front in every process that runs vLLM on the CPU (a no-op elsewhere)."""
    cpu = getattr(torch._C, "_cpu", None)
    if not torch.cuda.is_available() and hasattr(cpu, "_init_amx"):
        cpu._init_amx()


def _branch(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _residual_stream(output) -> torch.Tensor:
    """The residual stream after a decoder layer. vLLM's Llama-style layers return
    ``(hidden, residual)``, the MLP output and the stream before it, and leave the add to the next
    layer's fused add-norm: their sum is the stream a Hugging Face (or Megatron) layer outputs."""
    if isinstance(output, tuple):
        hidden, residual = output[0], output[1]
        return hidden if residual is None else hidden + residual
    return output


def _input_stream(args, kwargs) -> torch.Tensor:
    """The residual stream entering a decoder layer, called ``layer(positions, hidden, residual)``:
    their sum (the first layer gets the embeddings alone, ``residual`` None)."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
    residual = kwargs["residual"] if "residual" in kwargs else (args[2] if len(args) > 2 else None)
    return hidden if residual is None else hidden + residual


def layer_tensor(packed) -> torch.Tensor:
    """A tensor of :meth:`WorkerExtension.captured_layers` back from its (shape, bytes)."""
    shape, data = packed
    return torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy()).reshape(shape)


class WorkerExtension:
    """Mixed into vLLM's worker class: the receiving ends of the weight transports
    (:mod:`megatron_alp.rollout.transports`), and the per-layer capture."""

    def begin_weight_reload(self) -> None:
        """Open one reload session for a whole weight sync: the buckets that follow
        (:meth:`load_weight_bucket`, :meth:`receive_weight_bucket`) load into it and
        :meth:`end_weight_reload` closes it. vLLM's layerwise reload processes each layer (re-quantizes
        it) once all its tensors arrived; its ``reload_weights`` opens and closes such a session on
        every call, which re-initialises and finalises every layer of the model, once per bucket."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())
        self._reload_session = True

    def end_weight_reload(self) -> None:
        """Close the session of :meth:`begin_weight_reload` as vLLM's ``reload_weights`` closes its
        own: layers no bucket reached keep their weights, attention scales are reloaded, and the state
        derived from the old weights (LoRA, encoder and multimodal caches) is dropped."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        self._reload_session = False
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
        self.model_runner.reset_lora_state()
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()

    def _load(self, weights) -> None:
        """One bucket's weights: into the sync's reload session, else in a session of their own."""
        if not getattr(self, "_reload_session", False):
            self.reload_weights(weights_iterator=weights)
            return
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(weights)

    def load_weight_bucket(self, handle: bytes) -> int:
        """Load the weights of one bucket packed by :class:`BucketWriter` (whole layers)."""
        device = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return load_bucket(handle, self._load, device)

    def join_weight_broadcast(self, spec: dict) -> None:
        """Join the replica leader's weight broadcast group (a new one after every engine start)."""
        self._weight_receiver = BroadcastReceiver(spec, self.rank)

    def receive_weight_bucket(self, header: tuple) -> int:
        """Receive one broadcast bucket (whole layers) and load its weights."""
        receiver = getattr(self, "_weight_receiver", None)
        if receiver is None:
            raise RuntimeError("receive_weight_bucket before join_weight_broadcast")
        return receiver.receive(header, self._load)

    def capture_layers(self, kinds: list[str]) -> int:
        """Record ``kinds`` of what every decoder layer of this worker's model computes in the forward
        passes until :meth:`captured_layers`: the residual stream entering it (``input``, what ALP
        perturbs) and after it (``residual``), and, where the layer has them (``self_attn``, ``mlp``),
        its attention and MLP outputs (``attention``, ``mlp``). Only the first worker records:
        tensor-parallel workers hold the same full states after each layer's all-reduce. Forward hooks
        fire only in eager mode (on GPUs ``rollout.enforce_eager``; the CPU engine is always eager).
        Returns the number of layers hooked (0 on the other workers)."""
        self._layer_hooks, self._layer_records = [], {}
        if self.rank != 0:
            return 0
        model = self.model_runner.get_model()
        layers = [m for m in model.model.layers if hasattr(m, "self_attn") or hasattr(m, "mlp")]
        records = self._layer_records = {kind: [[] for _ in layers] for kind in ("input", "residual") if kind in kinds}

        def input_recorder(i):
            def hook(module, args, kwargs):
                records["input"][i].append(_input_stream(args, kwargs).detach().to("cpu", torch.float32, copy=True))
            return hook

        def recorder(kind, i, take):
            # copied at once: vLLM's fused add-norm of the next layer overwrites these tensors in place
            def hook(module, args, output):
                records[kind][i].append(take(output).detach().to("cpu", torch.float32, copy=True))
            return hook

        hooks = self._layer_hooks
        for i, layer in enumerate(layers):
            if "input" in kinds:
                hooks.append(layer.register_forward_pre_hook(input_recorder(i), with_kwargs=True))
            if "residual" in kinds:
                hooks.append(layer.register_forward_hook(recorder("residual", i, _residual_stream)))
            for kind, name in (("attention", "self_attn"), ("mlp", "mlp")):
                if kind in kinds and hasattr(layer, name):
                    records.setdefault(kind, [[] for _ in layers])
                    hooks.append(getattr(layer, name).register_forward_hook(recorder(kind, i, _branch)))
        return len(layers)

    def captured_layers(self) -> dict[str, list[int]] | None:
        """End :meth:`capture_layers`: per kind, the shape ``[layers, tokens, hidden]`` of what was
        recorded (float32, the tokens of every recorded forward pass in order: vLLM flattens a step's
        tokens, request after request), read in chunks of layers with :meth:`captured_chunk`
        (:func:`read_captured`). None on the workers that record nothing."""
        for hook in getattr(self, "_layer_hooks", []):
            hook.remove()
        self._layer_hooks = []
        records = getattr(self, "_layer_records", {})
        self._layer_records, self._layer_result = {}, {}
        if self.rank != 0:
            return None
        ran = next(iter(records.values()), [])
        if not ran or not all(ran):
            raise RuntimeError("no decoder layer ran while capturing: a compiled or CUDA-graph engine skips "
                               "forward hooks (set rollout.enforce_eager: true)")
        self._layer_result = {kind: torch.stack([torch.cat(calls) for calls in layers])
                              for kind, layers in records.items()}
        return {kind: list(t.shape) for kind, t in self._layer_result.items()}

    def captured_chunk(self, kind: str, start: int, stop: int) -> tuple[list[int], bytes] | None:
        """Layers ``start:stop`` of the captured ``kind``, as (shape, raw bytes) (:func:`layer_tensor`):
        vLLM returns a worker's tensors from its engine-core process only as plain lists unless its
        insecure pickle serialization is on, and msgpack holds at most 4 GiB in one value. The chunk
        that reaches the last layer releases the kind's host memory. None on the other workers."""
        if self.rank != 0:
            return None
        result = getattr(self, "_layer_result", {})
        if kind not in result:
            raise RuntimeError(f"captured_chunk({kind!r}): no captured {kind} states (captured_layers first)")
        chunk = result[kind][start:stop].contiguous()
        if stop >= len(result[kind]):
            del result[kind]
        return list(chunk.shape), chunk.numpy().tobytes()


CAPTURE_CHUNK_BYTES = 256 << 20  # one reply of captured states: far below msgpack's 4 GiB a value


def read_captured(call, shapes: dict[str, list[int]], limit: int = CAPTURE_CHUNK_BYTES) -> dict[str, torch.Tensor]:
    """The first worker's captured states per kind of ``shapes`` (:meth:`WorkerExtension.captured_layers`),
    fetched in chunks of whole layers of at most ``limit`` bytes (one layer where a layer is larger).
    ``call(kind, start, stop)``: that worker's :meth:`WorkerExtension.captured_chunk`."""
    states = {}
    for kind, shape in shapes.items():
        step = max(1, limit // max(4 * int(np.prod(shape[1:])), 1))
        states[kind] = torch.cat([layer_tensor(call(kind, start, min(start + step, shape[0])))
                                  for start in range(0, shape[0], step)])
    return states


enable_cpu_amx()
