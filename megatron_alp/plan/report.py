"""What a memory plan says: the items of each phase on its fullest GPU, whether they fit, and the
table and refusal it prints (``megatron-alp plan``, the trainer's start-up check)."""

from __future__ import annotations

import dataclasses

from megatron_alp.plan.estimates import GiB, Item, fmt_gib

HEADROOM = 0.05  # of the GPU kept free: allocator fragmentation and the error of the estimates


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str  # "training" (the logprob passes and the update), "rollout", or a phase of the table
    title: str
    where: str  # which GPU the phase is counted on
    items: tuple[Item, ...]
    not_run: str = ""  # why this config never runs the phase (then it holds nothing)

    @property
    def total(self) -> int:
        return sum(i.nbytes for i in self.items)

    @property
    def resident(self) -> tuple[str, ...]:
        return tuple(i.key for i in self.items if i.nbytes)

    def nbytes(self, key: str) -> int:
        return next(i.nbytes for i in self.items if i.key == key)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    source: str  # where the architecture came from
    layout: str
    gpus: int  # the trainer's
    gpu_mem_bytes: int
    phases: tuple[Phase, ...]
    offloaded_bytes: int  # host memory per GPU for the state offloaded during rollout
    notes: tuple[str, ...]
    problems: tuple[str, ...]
    failing: tuple[str, ...]  # which checks failed: training, rollout, kv_cache
    engine_minimum: int  # engine weights + workspace + the KV cache of one full-length sequence
    advice: tuple[str, ...] = ()
    engine_gpus: int = 0  # placement: separate: the engines' own GPUs, besides the trainer's

    @property
    def hardware(self) -> str:
        if not self.engine_gpus:
            return _gpus(self.gpus)
        return f"{_gpus(self.gpus).replace('GPU', 'trainer GPU')} + {_gpus(self.engine_gpus).replace('GPU', 'engine GPU')}"

    @property
    def usable(self) -> int:
        return int(self.gpu_mem_bytes * (1 - HEADROOM))

    @property
    def peak(self) -> int:
        return max(p.total for p in self.phases)

    @property
    def fits(self) -> bool:
        return not self.problems

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def report(self) -> str:
        """The table `megatron-alp plan` prints: phase, component, GiB per GPU, how it was counted."""
        rows = [("phase", "component", "GiB/GPU", "counted as")]
        for ph in self.phases:
            rows.append((ph.title, "", "", ""))
            if ph.not_run:
                rows.append((f"  not run ({ph.not_run})", "", "", ""))
                continue
            rows.append((f"  {ph.where}", "", "", ""))
            rows += [("", i.label, fmt_gib(i.nbytes), i.basis) for i in ph.items]
            rows.append(("", "total", fmt_gib(ph.total), ""))
        widths = [max(len(r[c]) for r in rows if r[1] or r is rows[0]) for c in range(3)]  # titles overhang
        lines = [f"model   {self.source}",
                 f"layout  {self.hardware} x {self.gpu_mem_bytes / GiB:g} GiB: {self.layout}", ""]
        for r in rows:
            lines.append(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip())
        verdict = "FITS" if self.fits else "DOES NOT FIT"
        lines += ["", f"peak {fmt_gib(self.peak)} GiB of {fmt_gib(self.usable)} GiB usable "
                      f"({1 - HEADROOM:.0%} of {self.gpu_mem_bytes / GiB:g} GiB): {verdict}"]
        lines += list(self.notes)
        lines.append("Estimates, not measurements (formulas: docs/memory_plan.md); the GPU self-test "
                     "measures the real peaks.")
        return "\n".join(lines)

    def refusal(self) -> str:
        """Why the plan does not fit and which keys would change that (each change planned alone)."""
        lines = [f"the memory plan does not fit {self.hardware} of {self.gpu_mem_bytes / GiB:g} GiB:"]
        lines += [f"  - {p}" for p in self.problems]
        if self.advice:
            lines.append("to make it fit:")
            lines += [f"  {a}" for a in self.advice]
        return "\n".join(lines)


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("s" if n != 1 else "")

