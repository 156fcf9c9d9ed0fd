"""A run's config, resolved: the schema checked against the registries and the defaults that
follow from other keys set.

The schema (:mod:`megatron_alp.config`) checks each key and each section on its own. Resolving
adds what needs the registries, which sit above the schema: a key that names a registry member
(``json_schema_extra={"registry": ...}`` in the schema: ``loss.name``, ``rollout.engine`` and its
``sync_method``, ``model.tiny``, ``reward.name``, ``trainer.loggers``) must name one, the engine
refuses what it cannot honour, a tracker needs its package, and the derived defaults are set
(``perturbation.enabled`` from the loss, the loss's clip range, the distributed optimizer for
half-precision ALP, MoE routing, the trackers, the TIR instruction).
:func:`load_config` and :func:`config_from_dict` read and resolve; every command loads its config
through them, and :class:`~megatron_alp.trainer.RLTrainer` refuses a config that was not resolved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from pydantic import BaseModel

import megatron_alp.rollout  # noqa: F401  (registers the engines)
from megatron_alp.algorithms.policy_loss import POLICY_LOSSES, get_policy_loss
from megatron_alp.config import TIR_SYSTEM_PROMPT, Config, ConfigError, apply_overrides, validate_schema
from megatron_alp.config.loading import format_errors, override_keys, read_yaml
from megatron_alp.models.families import FAMILIES
from megatron_alp.rewards import REWARDS
from megatron_alp.rollout.base import ENGINES
from megatron_alp.runtime.platform import has_gpu
from megatron_alp.runtime.trackers import TRACKERS, missing_package


def _sync_methods() -> dict:
    return {m: e for e in ENGINES.values() for m in e.sync_methods}


# registry key of the schema -> (what its members are called, its members by name)
REGISTRIES: dict[str, tuple[str, Callable[[], dict]]] = {
    "loss": ("policy loss", lambda: POLICY_LOSSES),
    "engine": ("rollout engine", lambda: ENGINES),
    "sync_method": ("weight sync method", _sync_methods),
    "family": ("model family", lambda: FAMILIES),
    "reward": ("reward", lambda: REWARDS),
    "logger": ("tracker", lambda: TRACKERS),
}


def registry_members(registry: str) -> list[str]:
    """The names a key marked ``registry`` accepts (config docs list them)."""
    return sorted(REGISTRIES[registry][1]())


def _registry_errors(section: BaseModel, prefix: str) -> list[tuple[str, str, Any]]:
    """``(key, message, value)`` of every key of ``section`` (recursively) that names no member of
    its registry."""
    errors = []
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            errors += _registry_errors(value, f"{prefix}{name}.")
            continue
        registry = (field.json_schema_extra or {}).get("registry")
        if registry is None or value is None:
            continue
        what, members = REGISTRIES[registry]
        for item in value if isinstance(value, list) else [value]:
            if item not in members():
                errors.append((f"{prefix}{name}", f"unknown {what} {item!r}; expected one of {sorted(members())}", item))
    return errors


def _engine_options(cfg: Config) -> list[tuple[str, str, Any]]:
    """A key another engine declares as its own (:attr:`RolloutEngine.options`), set to other than its
    default (a config dumped whole and read back sets every key): the chosen engine would ignore it."""
    errors = []
    fields = type(cfg.rollout).model_fields
    for name, engine in ENGINES.items():
        for key in engine.options:
            default = fields[key].get_default(call_default_factory=True)
            if name != cfg.rollout.engine and getattr(cfg.rollout, key) != default:
                errors.append((f"rollout.{key}", f"an option of rollout.engine {name}, which this run does not use "
                               f"(rollout.engine: {cfg.rollout.engine}); remove it or choose that engine",
                               getattr(cfg.rollout, key)))
    return errors


def _perturbation(cfg: Config, gpu: bool) -> None:
    """``perturbation.enabled`` follows the loss (refusing a contradiction), and what needs it."""
    spec, pert = get_policy_loss(cfg.loss.name), cfg.perturbation
    if pert.enabled is None:
        pert.enabled = spec.perturbed
    elif pert.enabled and not spec.perturbed and not pert.allow_with_baseline:
        raise ValueError(
            f"perturbation.enabled: true with loss.name={cfg.loss.name}, a baseline whose update forward is "
            "not perturbed: the run would be ALP under a baseline's name. Remove perturbation.enabled (it "
            "follows the loss), or set perturbation.allow_with_baseline: true for an ablation"
        )
    elif not pert.enabled and spec.perturbed:
        raise ValueError(
            f"perturbation.enabled: false with loss.name={cfg.loss.name}, which is ALP and needs the "
            "perturbed forward (the unperturbed single-ratio baseline is seq_bypass)"
        )
    if pert.calibrate_every and pert.init_std != "auto":
        raise ValueError(f"perturbation.calibrate_every: {pert.calibrate_every} re-calibrates sigma, which needs "
                         f"perturbation.init_std: auto (got {pert.init_std})")
    s = cfg.rollout.sampling
    if pert.init_std == "auto" and (s.top_p < 1.0 or s.top_k > 0):
        raise ValueError(f"perturbation.init_std: auto with rollout.sampling.top_p={s.top_p}, top_k={s.top_k}: the "
                         "engine's logprobs are renormalised over the kept tokens, a constant log(kept mass) per token "
                         "that the calibration would count as mismatch; sample with top_p: 1.0 and top_k: -1, or set "
                         "perturbation.init_std to a number")
    if pert.calibration_mode != "global":
        _per_layer_calibration(cfg, gpu)
    if pert.init_std == "auto" and not pert.enabled:
        raise ValueError(f"perturbation.init_std: auto calibrates the ALP noise, but loss.name={cfg.loss.name} "
                         "runs unperturbed (perturbation.enabled is false)")


def _per_layer_calibration(cfg: Config, gpu: bool) -> None:
    """What ``perturbation.calibration_mode: per_layer`` or ``per_layer_added`` needs: the layer probe
    compares the engine's decoder-layer inputs with one whole-model forward of the trainer's. The
    engine shows them through forward hooks, which a compiled engine (vLLM on GPUs, ``gpu``) never
    runs: there it must be eager."""
    pert, engine = cfg.perturbation, ENGINES[cfg.rollout.engine]
    mode = f"perturbation.calibration_mode: {pert.calibration_mode}"
    if pert.init_std != "auto":
        raise ValueError(f"{mode} sizes the calibrated sigma, which needs perturbation.init_std: auto "
                         f"(got {pert.init_std})")
    if str(pert.layers).strip().lower() == "logits":
        raise ValueError(f"{mode} with perturbation.layers: logits: the one site is the output layer's input, "
                         "not a decoder layer's; use calibration_mode: global")
    if not engine.captures_layers:
        raise ValueError(f"{mode} with rollout.engine={cfg.rollout.engine}: the engine cannot show its layers' "
                         "hidden states; use rollout.engine: vllm or calibration_mode: global")
    if gpu and not cfg.rollout.enforce_eager:
        raise ValueError(f"{mode} on GPUs needs rollout.enforce_eager: true: the engine shows its layer inputs "
                         "through forward hooks, which its compiled model and CUDA graphs never run, so the first "
                         "layer probe would fail; set rollout.enforce_eager: true "
                         "(every rollout then runs eager) or use calibration_mode: global")
    if cfg.parallel.pipeline_model_parallel_size > 1:
        raise ValueError(f"{mode} with parallel.pipeline_model_parallel_size="
                         f"{cfg.parallel.pipeline_model_parallel_size}: the layer probe runs whole-model forwards; "
                         "use calibration_mode: global or pipeline_model_parallel_size 1")


def _distributed_optimizer(cfg: Config) -> None:
    """On for half-precision ALP unless set: Megatron's fp16 optimizer cannot checkpoint fp32 sigmas."""
    half_with_sigmas = cfg.model.dtype != "float32" and cfg.perturbation.enabled
    if cfg.parallel.use_distributed_optimizer is None:
        cfg.parallel.use_distributed_optimizer = half_with_sigmas
    elif half_with_sigmas and not cfg.parallel.use_distributed_optimizer:
        raise ValueError(
            f"parallel.use_distributed_optimizer: false with model.dtype={cfg.model.dtype} and ALP: Megatron-Core's "
            "non-distributed fp16 optimizer cannot checkpoint the fp32 sigmas (the first save would fail); set it "
            "true or leave it null (with one data-parallel rank it shards nothing)")


def _moe(cfg: Config) -> None:
    """Routing replay needs an MoE model; noise routing and engine routing follow the replay."""
    replay = cfg.moe.routing_replay
    if replay != "none" and cfg.model.tiny is not None and not FAMILIES[cfg.model.tiny].moe:
        moe = sorted(name for name, family in FAMILIES.items() if family.moe)
        raise ValueError(f"moe.routing_replay={replay} needs a mixture-of-experts model; model.tiny="
                         f"{cfg.model.tiny} is dense (use none, or model.tiny={'/'.join(moe)})")
    if cfg.perturbation.moe_routing == "follow" and replay != "none":
        raise ValueError(f"perturbation.moe_routing: follow with moe.routing_replay={replay}: the update pass would "
                         "route on its own instead of replaying the experts; remove perturbation.moe_routing (a replay "
                         "keeps them fixed) or set moe.routing_replay: none")
    if cfg.perturbation.moe_routing is None:
        cfg.perturbation.moe_routing = "fixed" if replay != "none" else "follow"
    engine_routing = cfg.rollout.return_routed_experts
    if engine_routing is None:
        cfg.rollout.return_routed_experts = replay == "r3"
    elif not engine_routing and replay == "r3":
        raise ValueError("moe.routing_replay=r3 replays the engine's routing, which rollout.return_routed_experts="
                         "false turns off: remove that key, or choose moe.routing_replay r2 or none")


def _lora(cfg: Config) -> None:
    """What a LoRA run needs from the rest of the config: an engine that applies adapters itself for
    ``lora.sync: adapter``, and an HF base (adapters train on the weights the engine also loads)."""
    lora = cfg.lora
    if not lora.enabled:
        return
    if cfg.model.load is not None:
        raise ValueError(f"lora.enabled with model.load={cfg.model.load}: adapters train on a Hugging Face base model "
                         "that the engine loads too; export that checkpoint with `megatron-alp convert` and set "
                         "model.hf_path to the exported folder")
    engine = ENGINES[cfg.rollout.engine]
    if lora.sync == "adapter" and not engine.takes_adapters:
        able = sorted(name for name, e in ENGINES.items() if e.takes_adapters)
        raise ValueError(f"lora.sync: adapter with rollout.engine={cfg.rollout.engine}, which cannot apply LoRA "
                         f"adapters itself (engines that can: {', '.join(able)}); use lora.sync: merged")


def _trackers(cfg: Config) -> None:
    """``trainer.loggers`` with what the older keys ask (``tensorboard: false``, a ``wandb_project``),
    each tracker's package installed."""
    t = cfg.trainer
    loggers = [name for name in t.loggers if t.tensorboard or name != "tensorboard"]
    if t.wandb_project and "wandb" not in loggers:
        loggers.append("wandb")
    if "wandb" in loggers and not t.wandb_project:
        raise ValueError("trainer.loggers lists wandb, which needs trainer.wandb_project (the W&B project name)")
    for name in loggers:
        pip = missing_package(name)
        if pip:
            raise ValueError(f"trainer.loggers lists {name}, whose package is not installed: {pip}")
    t.loggers = list(dict.fromkeys(loggers))


def _tir_instruction(cfg: Config) -> None:
    """TIR runs default to the instruction that describes the interpreter."""
    if cfg.tir.enabled and "system_prompt" not in cfg.data.model_fields_set:
        cfg.data = cfg.data.model_copy(update={"system_prompt": TIR_SYSTEM_PROMPT})


def resolve(cfg: Config, source: str = "<dict>", gpu: Optional[bool] = None) -> Config:
    """Check ``cfg`` against the registries and set its derived defaults, in place; returns it.
    Raises :class:`ConfigError` naming each key. Resolving twice changes nothing. ``gpu``: whether the
    run targets GPUs (default: this machine has one, :func:`~megatron_alp.runtime.platform.has_gpu`)."""
    errors = _registry_errors(cfg, "")
    if not errors:
        errors += _engine_options(cfg)
        try:
            ENGINES[cfg.rollout.engine].check_config(cfg.rollout)
        except ValueError as err:
            errors.append(("rollout", str(err), ...))
    if errors:
        raise ConfigError(format_errors(errors, source))
    try:
        _perturbation(cfg, has_gpu() if gpu is None else gpu)
        _distributed_optimizer(cfg)
        cfg.loss.clip_low, cfg.loss.clip_high = get_policy_loss(cfg.loss.name).clip_range(cfg.loss)
        _moe(cfg)
        _lora(cfg)
        _trackers(cfg)
        _tir_instruction(cfg)
    except ValueError as err:
        raise ConfigError(format_errors([("<top level>", str(err), ...)], source)) from None
    cfg._resolved = True
    return cfg


def config_from_dict(data: dict, source: str = "<dict>", overridden: frozenset[str] = frozenset(),
                     gpu: Optional[bool] = None) -> Config:
    """A raw config dict, schema-validated and resolved (:class:`ConfigError` naming each key;
    ``overridden``: the keys that came from command-line overrides; ``gpu``: as in :func:`resolve`)."""
    return resolve(validate_schema(data, source, overridden), source, gpu)


def load_config(path: str | Path, overrides: Optional[list[str]] = None, gpu: Optional[bool] = None) -> Config:
    """A YAML config file with ``KEY=VALUE`` overrides, schema-validated and resolved (``gpu``: as in
    :func:`resolve`)."""
    overrides = overrides or []
    return config_from_dict(apply_overrides(read_yaml(path), overrides), str(path), override_keys(overrides), gpu)
