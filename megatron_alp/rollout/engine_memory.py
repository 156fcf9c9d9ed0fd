"""What of a rollout engine's memory is on its GPU, and the library calls that move it.

A colocated engine gives its GPU memory back while Megatron trains (``free_memory_during_training``).
The libraries track that memory by kind (their *tags*): vLLM's ``weights`` and ``kv_cache``, SGLang's
``cuda_graph``, ``kv_cache`` and ``weights``. An :class:`EngineMemory` holds the kinds asleep, as the
library does, and its :attr:`~EngineMemory.state` is read from them:

- ``awake``: nothing asleep (generation);
- ``weights``: the weights awake and everything else asleep (a weight sync beside Megatron's state);
- ``asleep``: everything asleep (Megatron trains).

:meth:`EngineMemory.move` goes from any of the three to any other with the library's own calls (each
such move only releases or only wakes), as the pinned libraries define them:

- vLLM 0.33 (:class:`VLLMMemory`, on ``vllm.LLM``): ``sleep(level=1)`` offloads the weights to host
  memory and discards the KV cache, ``sleep(level=2)`` discards both. The executor sleeps unless its
  weights already sleep, and the allocator skips what is already asleep, so ``sleep`` also takes an
  engine whose KV cache alone sleeps all the way down. ``wake_up(tags)`` wakes only those kinds.
  ``sleep(level=0)`` (scheduling paused) then ``release_kv_cache_memory()`` discards the KV cache of a
  fully awake engine and leaves its weights where they are.
- SGLang 0.5.23 (:class:`SGLangMemory`, the server's ``release_memory_occupation`` and
  ``resume_memory_occupation``): both move the kinds they are given (``tags``). Released weights are
  discarded unless the server keeps a host copy (``--enable-weights-cpu-backup``, which the engine sets).

vLLM's sleep level is :meth:`VLLMMemory.sleep_level`. Weights a level-2 sleep discarded are
:attr:`~EngineMemory.dropped` until a full weight sync re-sends them (:meth:`EngineMemory.synced`);
waking the engine for generation before that is an error, not a generation from garbage.

Without a library (the CPU, where the engines cannot sleep, or an engine started without sleep mode)
the moves only keep the books, so the phase ledger checks the trainer's moves on the CPU too.
"""

from __future__ import annotations

from typing import Any, Optional

STATES = ("asleep", "weights", "awake")


class EngineMemory:
    """The kinds of one engine's memory asleep (:attr:`asleep`) and the moves between :data:`STATES`;
    ``library``: the object whose sleep/wake calls the subclass makes (None: keep the books only)."""

    kinds: tuple[str, ...] = ()

    def __init__(self, library: Optional[Any] = None):
        self.library = library
        self.asleep: set[str] = set()
        self.dropped = False  # the weights were discarded asleep: only a full weight sync makes them whole

    @property
    def state(self) -> str:
        """``awake``, ``weights`` or ``asleep``; another mix is named by the kinds awake (``kv_cache``)."""
        awake = [k for k in self.kinds if k not in self.asleep]
        if not self.asleep:
            return "awake"
        if not awake:
            return "asleep"
        return "weights" if awake == ["weights"] else "+".join(awake)

    def move(self, state: str, resync: bool = False) -> None:
        """Go to ``state``. ``resync``: a weight sync comes before the engine generates again (what that
        allows: :meth:`VLLMMemory.sleep_level`)."""
        if state not in STATES:
            raise ValueError(f"engine memory state {state!r}; expected one of {STATES}")
        if state == "awake" and self.dropped:
            raise RuntimeError("the engine's weights were discarded when it slept (a weight sync was to re-send "
                               "them) and no weight sync came before it was woken to generate")
        {"asleep": self._sleep, "weights": self._weights, "awake": self._wake}[state](resync)

    def wake_weights(self) -> None:
        """Wake the weights for a weight update if they sleep (the rest stays as it is)."""
        if "weights" in self.asleep:
            self.move("weights")

    def synced(self) -> None:
        """A weight sync re-sent every weight: weights a sleep discarded are whole again."""
        self.dropped = False

    def _call(self, name: str, **kwargs) -> None:
        if self.library is not None:
            getattr(self.library, name)(**kwargs)

    def _sleep(self, resync: bool) -> None:
        raise NotImplementedError

    def _weights(self, resync: bool) -> None:
        raise NotImplementedError

    def _wake(self, resync: bool) -> None:
        raise NotImplementedError


class VLLMMemory(EngineMemory):
    """vLLM's ``weights`` and ``kv_cache``; ``library``: a ``vllm.LLM`` started with sleep mode.
    ``adapters``: its weight syncs send LoRA adapters only (``lora.sync: adapter``), never the base."""

    kinds = ("weights", "kv_cache")

    def __init__(self, library: Optional[Any] = None, adapters: bool = False):
        super().__init__(library)
        self.adapters = adapters

    def sleep_level(self, resync: bool) -> int:
        """2 (discard the weights) when a weight sync comes before the engine generates again and
        re-sends every weight; else 1 (offload them to host memory). Adapter-only syncs never re-send
        the base: always 1."""
        return 2 if resync and not self.adapters else 1

    def _sleep(self, resync: bool) -> None:
        if "weights" not in self.asleep:  # the executor skips a sleep only when its weights sleep
            level = self.sleep_level(resync)
            self._call("sleep", level=level)
            self.asleep.update(self.kinds)
            self.dropped = level == 2

    def _weights(self, resync: bool) -> None:
        if "weights" in self.asleep:
            self._call("wake_up", tags=["weights"])
            self.asleep.discard("weights")
        if "kv_cache" not in self.asleep:  # only the KV cache goes: the weights stay on the GPU
            self._call("sleep", level=0)
            self._call("release_kv_cache_memory")
            self.asleep.add("kv_cache")

    def _wake(self, resync: bool) -> None:
        if self.asleep:
            self._call("wake_up", tags=[k for k in self.kinds if k in self.asleep])
            self.asleep.clear()
            self._call("reset_prefix_cache")  # no cached prefix survives a KV cache that slept


class SGLangMemory(EngineMemory):
    """SGLang's memory kinds (those ``release_memory_occupation`` frees when asked for all);
    ``library``: its ``release_memory_occupation(tags)`` and ``resume_memory_occupation(tags)``."""

    kinds = ("cuda_graph", "kv_cache", "weights")

    def _release(self, kinds: list[str]) -> None:
        if kinds:
            self._call("release_memory_occupation", tags=kinds)
            self.asleep.update(kinds)

    def _resume(self, kinds: list[str]) -> None:
        if kinds:
            self._call("resume_memory_occupation", tags=kinds)
            self.asleep.difference_update(kinds)

    def _sleep(self, resync: bool) -> None:
        self._release([k for k in self.kinds if k not in self.asleep])

    def _weights(self, resync: bool) -> None:
        self._release([k for k in self.kinds if k != "weights" and k not in self.asleep])
        self._resume(["weights"] if "weights" in self.asleep else [])

    def _wake(self, resync: bool) -> None:
        self._resume([k for k in self.kinds if k in self.asleep])
