"""The ``sglang`` rollout engine: an SGLang server subprocess driven over its HTTP API (GPU only).

The server (``python -m sglang.launch_server``) is started on ``model_dir`` with the configured
dtype, tensor parallelism, memory fraction, seed, context length and quantization, plus
``rollout.sglang_args``; its log goes to a file next to the weight folders and its last lines are
quoted in every startup or crash error.

- Generation: ``POST /generate`` with token ids, one entry per sample, ``return_logprob``. SGLang
  reports ``log_softmax(logits / T)`` *before* top-k/top-p filtering, not the renormalised
  distribution the token was drawn from, so top-p < 1 or top-k > 0 are refused here (use the
  ``vllm`` engine for filtered sampling), and ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (pre-temperature
  logprobs) is removed from the server's environment.
- Weight sync (``rollout.sync_method: folder``, the only one here): the stream is written as a
  safetensors folder in ``rollout.sync_dir`` and loaded with ``POST /update_weights_from_disk``.
- Replicas: replica k's server listens on ``rollout.sglang_port + k`` and sees only its GPUs.
- No FP8 (refused when the config is validated): SGLang 0.5's online FP8 replaces each weight by a
  parameter without a weight loader, so ``/update_weights_from_disk`` fails at the first sync (only
  its ``flash_rl`` load format reloads FP8, and only for Qwen2/Qwen3). FP8 rollouts use ``vllm``.
- The server runs under ``rollout.sglang_python`` (default ``$MEGATRON_ALP_SGLANG_PYTHON``, set by
  the Docker image, whose SGLang lives in an environment of its own; else this interpreter).
- Failures: a request that times out is aborted and retried; if the server process has exited
  it is restarted from the last synced folder (no weights are lost) and the request retried, up
  to ``max_retries``; then :class:`RolloutError`.
- Memory (``free_memory_during_training``): the server runs with ``--enable-memory-saver`` and
  ``--enable-weights-cpu-backup`` (released weights come back as they were, not as garbage), and
  :attr:`SGLangEngine.memory` releases and resumes each kind by its tag
  (:class:`~megatron_alp.rollout.engine_memory.SGLangMemory`).
- Routed experts (``rollout.return_routed_experts``, MoE routing replay R3): the server runs with
  ``--enable-return-routed-experts`` and every request asks ``return_routed_experts``; the answer's
  ``meta_info["routed_experts"]`` is the base64 of int32 expert ids of every token fed through the
  model (prompt + response - 1), token-major then layer then slot (:func:`decode_routed_experts`).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch

from megatron_alp.config import RolloutConfig
from megatron_alp.models.families import load_hf_config, num_experts
from megatron_alp.rollout.base import (
    Completion,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    attempt_timeout,
    check_prompts,
    check_sampling,
    collect_samples,
    register_engine,
    resolve_max_model_len,
)
from megatron_alp.rollout.engine_memory import SGLangMemory
from megatron_alp.rollout.placement import Placement, placement_vars
from megatron_alp.rollout.quantization import check_model_not_prequantized, sglang_quantization_args
from megatron_alp.rollout.transports import Folder
from megatron_alp.rollout.weight_sync import WeightStream, is_finite
from megatron_alp.runtime.platform import has_gpu

def check_sglang_sampling(params: SamplingParams) -> None:
    """SGLang's logprobs are those of the unfiltered tempered distribution: refuse filters."""
    check_sampling(params)
    if params.top_p < 1.0 or params.top_k > 0:
        raise RolloutError(
            f"rollout.engine=sglang with top_p={params.top_p}, top_k={params.top_k}: SGLang reports "
            "logprobs before top-k/top-p filtering, not those of the distribution it samples from, "
            "which would bias every importance ratio; use top_p=1.0, top_k=-1 or rollout.engine=vllm"
        )
    if params.seed is not None:
        raise RolloutError("rollout.engine=sglang does not take per-sample seeds: set "
                           "rollout.sampling.per_sample_seeds=false or use rollout.engine=vllm")


def sglang_python(cfg: RolloutConfig) -> str:
    """The interpreter that runs the server: ``rollout.sglang_python``, $MEGATRON_ALP_SGLANG_PYTHON,
    or this one."""
    return cfg.sglang_python or os.environ.get("MEGATRON_ALP_SGLANG_PYTHON") or sys.executable


def check_sglang_installed(python: str) -> None:
    """SGLang must import in the server's interpreter (not necessarily the trainer's)."""
    try:
        found = subprocess.run([python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)"],
                               capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as err:
        raise RolloutError(f"rollout.sglang_python={python!r} cannot be run: {err}") from None
    if not found:
        raise RolloutError(f"rollout.engine=sglang: the sglang package is not installed for {python} "
                           "(pip install sglang there, or point rollout.sglang_python / "
                           "MEGATRON_ALP_SGLANG_PYTHON at the interpreter that has it)")


def server_command(cfg: RolloutConfig, model_path: str, tokenizer_path: str, max_model_len: int,
                   seed: int, port: Optional[int] = None) -> list[str]:
    """The ``sglang.launch_server`` command line for this configuration (``port``: default
    ``rollout.sglang_port``)."""
    cmd = [
        sglang_python(cfg), "-m", "sglang.launch_server",
        "--model-path", model_path, "--tokenizer-path", tokenizer_path,
        "--host", "127.0.0.1", "--port", str(port or cfg.sglang_port),
        "--dtype", cfg.dtype, "--tp-size", str(cfg.tensor_parallel_size),
        "--mem-fraction-static", str(cfg.gpu_memory_utilization),
        "--context-length", str(max_model_len), "--random-seed", str(seed),
    ]
    if cfg.enforce_eager:
        cmd.append("--disable-cuda-graph")
    if cfg.free_memory_during_training:
        cmd += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    if cfg.return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    return cmd + sglang_quantization_args(cfg) + list(cfg.sglang_args)


def decode_routed_experts(meta: dict, fed: int, layers: int, topk: int, experts: int) -> np.ndarray:
    """``meta_info["routed_experts"]`` of an SGLang answer -> ``[fed, layers, topk]`` expert ids in
    vLLM's compact convention (uint8 up to 256 experts, else uint16). ``fed``: the tokens the server
    fed through the model (prompt + response - 1)."""
    payload = meta.get("routed_experts")
    if payload is None:
        raise RolloutError("SGLang returned no routed_experts (moe.routing_replay=r3): is the server running with "
                           "--enable-return-routed-experts?")
    ids = np.frombuffer(base64.b64decode(payload), dtype=np.int32)
    if ids.size != fed * layers * topk:
        raise RolloutError(f"SGLang returned {ids.size} routed expert ids; expected {fed} tokens x {layers} layers "
                           f"x {topk} experts (moe.routing_replay=r3)")
    if ids.size and not (0 <= ids.min() and ids.max() < experts):
        raise RolloutError(f"SGLang returned expert ids in [{ids.min()}, {ids.max()}] for a model of {experts} "
                           "experts (moe.routing_replay=r3)")
    return ids.reshape(fed, layers, topk).astype(np.uint8 if experts <= 256 else np.uint16)


@register_engine("sglang")
class SGLangEngine(RolloutEngine):
    options = ("sglang_port", "sglang_args", "sglang_python")

    @classmethod
    def check_config(cls, cfg: RolloutConfig) -> None:
        super().check_config(cfg)
        if cfg.quantization != "none":
            raise ValueError(
                f"rollout.engine=sglang with rollout.quantization={cfg.quantization}: SGLang's online FP8 "
                "cannot take weight updates (its FP8 parameters have no weight loader, so the first "
                "/update_weights_from_disk fails); use rollout.engine=vllm for FP8 rollouts"
            )

    def __init__(self, cfg: RolloutConfig, model_dir: str, seed: int = 0, placement: Optional[Placement] = None):
        if not has_gpu():
            raise RolloutError(
                "rollout.engine=sglang needs an NVIDIA GPU: SGLang has no CPU build (on the CPU use "
                "rollout.engine=vllm)"
            )
        check_sglang_installed(sglang_python(cfg))
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.seed = seed
        self.placement = placement
        hf = load_hf_config(self.model_dir)
        check_model_not_prequantized(hf, str(self.model_dir / "config.json"))
        self.vocab_size = int(hf["vocab_size"])
        # MoE routing shape, for rollout.return_routed_experts
        self._routing_shape = (int(hf.get("num_hidden_layers", 0)), int(hf.get("num_experts_per_tok", 0)),
                               num_experts(hf))
        self._max_len = resolve_max_model_len(cfg, hf)
        self.transport = Folder(cfg, self.model_dir)  # the server reloads from, and restarts from, its folders
        self._log_path = self.transport.folders.root / "sglang_server.log"
        self._proc: Optional[subprocess.Popen] = None
        self.restarts = 0
        # Replicas on one node listen on consecutive ports.
        self._port = cfg.sglang_port + (placement.replica if placement is not None else 0)
        self._url = f"http://127.0.0.1:{self._port}"
        self._start()

    @property
    def max_model_len(self) -> int:
        return self._max_len

    # ------------------------------------------------------------------------------ server

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "SGLANG_RETURN_ORIGINAL_LOGPROB"}
        env.update(placement_vars(self.placement))  # the replica's GPUs
        cmd = server_command(self.cfg, str(self.transport.start_dir or self.model_dir), str(self.model_dir),
                             self._max_len, self.seed, self._port)
        log = open(self._log_path, "ab")
        try:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RolloutError(f"the SGLang server exited with code {self._proc.returncode} while starting "
                                   f"({' '.join(cmd)}); last log lines:\n{self._log_tail()}")
            if self._healthy(timeout=5.0):
                # all awake, released and resumed by kind through the server's endpoints below
                self.memory = SGLangMemory(self if self.cfg.free_memory_during_training else None)
                return
            time.sleep(1.0)
        self._stop()
        raise RolloutError(f"the SGLang server did not become healthy within rollout.startup_timeout_s="
                           f"{self.cfg.startup_timeout_s:g} s; last log lines:\n{self._log_tail()}")

    def _healthy(self, timeout: float) -> bool:
        try:
            with urllib.request.urlopen(f"{self._url}/health_generate", timeout=timeout) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def keeps_weights(self) -> bool:
        return self.alive()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group (start_new_session)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def _restart(self) -> None:
        self._stop()
        self.restarts += 1
        self._start()

    def shutdown(self) -> None:
        self._stop()
        self.transport.close()

    def engine_pids(self) -> list[int]:
        return [self._proc.pid] if self.alive() else []

    def _post(self, path: str, payload: dict, timeout: float):
        data = json.dumps(payload).encode()
        req = urllib.request.Request(f"{self._url}{path}", data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body.strip().startswith((b"{", b"[")) else body.decode()

    # --------------------------------------------------------------------------- memory

    def release_memory_occupation(self, tags: list[str]) -> None:
        """Free the server's memory of these kinds (:class:`SGLangMemory` calls it)."""
        self._post("/release_memory_occupation", {"tags": tags}, timeout=self.cfg.request_timeout_s)

    def resume_memory_occupation(self, tags: list[str]) -> None:
        """Take the server's memory of these kinds back (:class:`SGLangMemory` calls it)."""
        self._post("/resume_memory_occupation", {"tags": tags}, timeout=self.cfg.request_timeout_s)

    # -------------------------------------------------------------------------- weights

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.transport.send(self, WeightStream(weights))
        self.memory.synced()

    def reload_folder(self, path: str) -> None:
        """The receiving end of the :class:`~megatron_alp.rollout.transports.Folder` transport."""
        self.memory.wake_weights()  # the KV cache stays released beside Megatron's state
        try:
            reply = self._post("/update_weights_from_disk", {"model_path": path}, timeout=self.cfg.request_timeout_s)
        except urllib.error.HTTPError as err:
            reply = {"success": False, "message": err.read().decode(errors="replace")}
        except (urllib.error.URLError, OSError) as err:
            raise RolloutError(f"SGLang weight update failed ({err}); server alive: {self.alive()}; "
                               f"last log lines:\n{self._log_tail()}") from err
        if not (isinstance(reply, dict) and reply.get("success")):
            raise RolloutError(f"SGLang refused the weight update: {reply}")

    # --------------------------------------------------------------------------- generate

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 keys: Optional[list[int]] = None) -> list[list[Completion]]:
        check_prompts(prompts, self.vocab_size, self._max_len)
        check_sglang_sampling(params)
        self.memory.move("awake")
        sampling = {"temperature": params.temperature, "top_p": 1.0, "top_k": -1,
                    "max_new_tokens": params.max_tokens, "stop": list(params.stop) or None,
                    "no_stop_trim": params.include_stop_str_in_output}
        attempts = self.cfg.max_retries + 1

        def attempt(pending, number):
            notes = []
            if not self.alive():
                notes.append(f"server process had exited (code {self._proc.returncode if self._proc else None}); "
                             "restarted")
                self._restart()
            rids = [uuid.uuid4().hex for _ in pending]
            body = {"input_ids": [list(prompts[i]) for i, _ in pending], "sampling_params": [sampling] * len(pending),
                    "return_logprob": True, "rid": rids}
            if self.cfg.return_routed_experts:
                body["return_routed_experts"] = True
            limit = attempt_timeout(self.cfg, len(pending), params.max_tokens)
            try:
                reply = self._post("/generate", body, timeout=limit)
            except urllib.error.HTTPError as err:
                raise RolloutError(f"SGLang rejected the request (HTTP {err.code}): "
                                   f"{err.read().decode(errors='replace')[:2000]}") from err
            except (urllib.error.URLError, OSError) as err:  # timeout, connection refused/reset
                if not self.alive():
                    notes.append(f"the server died ({err}); last log lines:\n{self._log_tail(10)}")
                    return {}, "; ".join(notes)
                for rid in rids:
                    try:
                        self._post("/abort_request", {"rid": rid}, timeout=30)
                    except (urllib.error.URLError, OSError):
                        pass
                notes.append(f"no answer within {limit:g} s ({err})")
                return {}, "; ".join(notes)
            items = reply if isinstance(reply, list) else [reply]
            if len(items) != len(pending):
                notes.append(f"{len(items)} answers for {len(pending)} requests")
                return {}, "; ".join(notes)
            got = {}
            for key, item in zip(pending, items):
                completion = self._completion(item, prompts, key)
                if completion is not None:
                    got[key] = completion
            aborted = len(pending) - len(got)
            if aborted:
                notes.append(f"{aborted} of {len(pending)} samples aborted by the server")
            return got, "; ".join(notes) or None

        return collect_samples("SGLang", prompts, params.n, attempts, attempt)

    def _completion(self, item: dict, prompts, key) -> Optional[Completion]:
        i, j = key
        meta = item.get("meta_info", {})
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind not in ("stop", "length"):
            return None
        steps = meta.get("output_token_logprobs")
        if steps is None:
            raise RolloutError(f"prompt {i} sample {j}: SGLang returned no output_token_logprobs")
        tokens = [int(s[1]) for s in steps]
        logprobs = [float(s[0]) for s in steps]
        if "output_ids" in item and list(item["output_ids"]) != tokens:
            raise RolloutError(f"prompt {i} sample {j}: SGLang's output_ids and logprob tokens disagree")
        if not is_finite(logprobs):
            raise RolloutError(f"prompt {i} sample {j}: non-finite logprob from SGLang")
        matched = finish.get("matched") if isinstance(finish, dict) else None
        routed = None
        if self.cfg.return_routed_experts:
            routed = decode_routed_experts(meta, len(prompts[i]) + len(tokens) - 1, *self._routing_shape)
        return Completion(prompt_ids=list(prompts[i]), response_ids=tokens, logprobs=logprobs,
                          finish_reason=kind, text=item.get("text", ""), stop_reason=matched,
                          routed_experts=routed)
