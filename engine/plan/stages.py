"""Compute cost of a training step by pipeline stage, the balanced layer split, and the CPU layout.

One FLOP model serves all three (the one ``hyflow bench rl`` reports MFU with,
:mod:`hyflow.plan.flops`): a decoder layer costs ``2 P_layer + 4 q c`` FLOPs per token
forward (``P_layer`` its matrix-multiply weights, ``q`` the query width, ``c`` half the mean
sequence), the output layer ``2 h V`` per *scored* token, the embedding lookup nothing. A
training pass costs 3x its forward; the fused output head (``actor.fused_output_layer``) scores
response tokens only and recomputes its logits in the backward (4x instead of 3x).

* :func:`balanced_stage_layers` (in :mod:`hyflow.models.stage_split`, which builds the RL actor's
  split when ``actor.layout.stage_layers`` is null) puts fewer layers on the last stage so that its layers plus the
  output layer cost what the other stages cost (Megatron-Core's
  ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``; the middle
  stages split the rest evenly). For SmolLM2-135M the output layer (49152 x 576) costs as much
  as 8 of its 30 layers per token.
* :func:`cpu_layouts` ranks DP / PP / TP layouts for a CPU box of ``cores`` cores from that model,
  a measured per-thread matmul rate and the gloo all-reduce cost measured on the dev box.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from hyflow.models.stage_split import (  # noqa: F401 - the cost model's pieces, re-exported
    balanced_stage_layers, head_flops, head_in_layers, job_head_layers, layer_flops, resolve_stage_layers,
    stage_costs,
)
from hyflow.parallel.layout import Layout
from hyflow.plan.flops import measure_cpu_peak

#: gloo all-reduce between 2 processes on the 2-core dev box (loopback; 2026-11-24, load ~50,
#: medians of 5): 0.47 ms for 1 KiB, 0.85 GB/s algorithm bandwidth for 32 MiB.
GLOO_LATENCY_S = 4.7e-4
GLOO_BYTES_PER_S = 0.85e9


def bubble_step_factor(layers: Sequence[int], head_layers: float, micro_batches: int) -> float:
    """1F1B step time over perfectly parallel work: the slowest stage sets the pace of every slot,
    ``m + p - 1`` slots for ``m`` micro-batches."""
    costs = stage_costs(layers, head_layers)
    p = len(costs)
    return max(costs) * (micro_batches + p - 1) / (sum(costs) / p * micro_batches)


@dataclass
class CpuCandidate:
    """One candidate of :func:`cpu_layouts`: a layout (its stage split balanced) and its estimates."""

    layout: Layout
    threads: int
    update_s: float          #: estimated update seconds per step
    compute_s: float         #: of which compute (including the pipeline's idle slots)
    comm_s: float            #: of which communication
    state_gib: float         #: weights + gradients + Adam moments per rank (fp32)
    note: str = ""

    @property
    def name(self) -> str:
        return f"TP={self.layout.tp} PP={self.layout.pp} DP={self.layout.dp}, {self.threads} thread(s) per rank"

    def to_dict(self) -> dict[str, Any]:
        """The candidate as plain data (``hyflow plan --json``)."""
        fields = dataclasses.asdict(self)
        del fields["layout"]
        return dict(fields, tp=self.layout.tp, pp=self.layout.pp, dp=self.layout.dp, name=self.name)


def cpu_layouts(desc: Any, cores: int, tokens: float, rows: int, response_tokens: float, micro_batch_size: int,
                per_thread_flops: float, thread_efficiency: float = 1.0, fused: bool = True,
                latency_s: float = GLOO_LATENCY_S, bytes_per_s: float = GLOO_BYTES_PER_S) -> list[CpuCandidate]:
    """Update-phase time of one RL step (``tokens`` prompt + response tokens in ``rows`` sequences,
    ``response_tokens`` of them scored) for every way to use ``cores`` cores as ranks x threads with
    TP x PP x DP = ranks (TP and PP of 1 or 2 ranks), fastest first.

    ``per_thread_flops``: measured matmul FLOP/s of one thread; ``thread_efficiency``: the FLOP/s
    per thread of 2 intra-op threads in one process over one thread's (threads synchronise and
    spin; separate ranks do not). Communication: DP all-reduces the gradients once per step, TP all-reduces
    activations 4 times per layer per micro-batch (forward and backward), PP's point-to-point
    exchanges are cheap but its 1F1B schedule idles ``p - 1`` slots.
    """
    mean_seq = tokens / max(rows, 1)
    L, n = layer_flops(desc, mean_seq), desc.num_layers
    head = head_flops(desc) * (4 * response_tokens if fused else 3 * tokens)
    work = 3 * L * n * tokens + head  # update FLOPs of the whole step
    params = desc.num_parameters()
    out = []
    for ranks in range(1, cores + 1):
        if cores % ranks:
            continue
        threads = cores // ranks
        rate = per_thread_flops * threads * (thread_efficiency if threads > 1 else 1.0)
        for tp in (1, 2):
            for pp in (1, 2):
                if ranks % (tp * pp):
                    continue
                dp = ranks // (tp * pp)
                if rows % dp:
                    continue
                local_rows = rows // dp
                m = max(1, -(-local_rows // micro_batch_size))
                head_layers = head / (3 * L * tokens)  # the head in layers' worth of update work
                layers = balanced_stage_layers(n, pp, head_layers)
                compute = work / dp / tp / rate / pp * (bubble_step_factor(layers, head_layers, m) if pp > 1 else 1.0)
                comm = 0.0
                p_bytes = 4 * params / (tp * pp)
                if dp > 1:
                    comm += latency_s + 2 * (dp - 1) / dp * p_bytes / bytes_per_s
                if tp > 1:
                    act = 4 * desc.hidden_size * tokens / dp  # bytes of [tokens, h] fp32 per step
                    comm += 4 * (n / pp) * (m * latency_s + act / bytes_per_s)
                state = 16 * params / (tp * pp) / (1 << 30)
                note = f"stages {'/'.join(map(str, layers))}" if pp > 1 else ""
                layout = Layout(tp=tp, pp=pp, dp=dp, stage_layers=layers if pp > 1 else None)
                out.append(CpuCandidate(layout, threads, compute + comm, compute, comm, state, note))
    return sorted(out, key=lambda c: c.update_s)




def compute_plan(cfg: Any, desc: Any, layout: Any, device: str, cores: Optional[int] = None) -> dict[str, Any]:
    """What ``hyflow plan`` prints about compute: the actor's stage split (even vs balanced) and,
    on CPU, the ranked layouts for this machine's cores. Sequence lengths are assumed to be half
    the config's bounds (prompt ``max_prompt_length / 2``, response ``max_new_tokens / 2``)."""
    rollout = getattr(cfg, "rollout", None)
    prompt = (getattr(rollout, "max_prompt_length", None) or getattr(cfg.data, "max_length", 512)) / 2
    response = (getattr(rollout, "max_new_tokens", 0) or 0) / 2
    rows = cfg.data.train_batch_size * (getattr(rollout, "n", 1) or 1)
    fused = bool(getattr(cfg.actor, "fused_output_layer", False))
    mean_seq = prompt + response
    head = job_head_layers(cfg, desc)
    out: dict[str, Any] = {"assumed_prompt_tokens": prompt, "assumed_response_tokens": response, "rows": rows,
                           "fused_output_layer": fused, "head_in_layers": head}
    if layout.pp > 1 and not layout.vpp:
        even = [desc.num_layers // layout.pp] * layout.pp if desc.num_layers % layout.pp == 0 else None
        balanced = balanced_stage_layers(desc.num_layers, layout.pp, head)
        built = list(layout.layers_per_stage(desc.num_layers))
        # an update flushes the pipeline after every mini-batch: its micro-batches per flush
        mini = getattr(cfg.actor, "mini_batch_size", None) or rows
        m = max(1, mini // (max(1, layout.dp * layout.cp) * cfg.actor.micro_batch_size))
        out["stages"] = {"even": even, "balanced": balanced, "built": built,
                         "automatic": cfg.actor.layout.stage_layers is None,
                         "built_cost": stage_costs(built, head), "balanced_cost": stage_costs(balanced, head),
                         "built_factor": bubble_step_factor(built, head, m),
                         "balanced_factor": bubble_step_factor(balanced, head, m), "micro_batches": m}
        if even:
            out["stages"].update(even_cost=stage_costs(even, head), even_factor=bubble_step_factor(even, head, m))
    if device == "cpu":
        cores = cores or len(os.sched_getaffinity(0))
        one = measure_cpu_peak(1)  # FLOP/s per CPU-second of one thread
        # per-thread FLOP/s of 2 threads over 1 thread's, both per CPU-second: what threading costs
        # in CPU time (sync, idle spinning), which other load on the machine does not change
        eff = min(1.0, measure_cpu_peak(2) / 2 / one) if cores > 1 else 1.0
        ranked = cpu_layouts(desc, cores, rows * mean_seq, rows, rows * response, cfg.actor.micro_batch_size,
                             one, eff, fused)
        out["cpu"] = {"cores": cores, "per_thread_gflops": one / 1e9, "thread_efficiency": eff,
                      "layouts": [c.to_dict() for c in ranked]}
    return out


def format_compute(d: dict[str, Any]) -> list[str]:
    """Lines of ``hyflow plan``'s compute section."""
    lines = ["", f"Compute (actor update; assumed {d['rows']} rows of {d['assumed_prompt_tokens']:.0f} prompt + "
                 f"{d['assumed_response_tokens']:.0f} response tokens; the output layer costs "
                 f"{d['head_in_layers']:.1f} decoder layers' worth"
                 f"{', response tokens only' if d['fused_output_layer'] else ''})"]
    st = d.get("stages")
    if st:
        split = lambda xs: "/".join(map(str, xs))  # noqa: E731
        how = "automatic (actor.layout.stage_layers=null)" if st["automatic"] else "actor.layout.stage_layers"
        lines.append(f"  pipeline stages: builds {split(st['built'])} layers, {how}: slowest stage "
                     f"{max(st['built_cost']):.1f} layers' worth, update x{st['built_factor']:.2f} of ideal with "
                     f"{st['micro_batches']} micro-batches per flush (one mini-batch)")
        others = []
        if st.get("even") and st["even"] != st["built"]:
            others.append(f"even {split(st['even'])} ({max(st['even_cost']):.1f}, x{st['even_factor']:.2f})")
        if st["balanced"] != st["built"]:
            others.append(f"balanced {split(st['balanced'])} ({max(st['balanced_cost']):.1f}, "
                          f"x{st['balanced_factor']:.2f})")
        if others:
            lines.append("    vs " + "; ".join(others))
    cpu = d.get("cpu")
    if cpu:
        lines.append(f"  CPU layouts on {cpu['cores']} core(s): matmul {cpu['per_thread_gflops']:.1f} GFLOP/s per "
                     f"thread (measured now, CPU time), 2 threads in one process run at "
                     f"{100 * cpu['thread_efficiency']:.0f}% per thread; gloo all-reduce "
                     f"{GLOO_LATENCY_S * 1e3:.2f} ms + {GLOO_BYTES_PER_S / 1e9:.2f} GB/s (measured on the dev box)")
        for i, c in enumerate(cpu["layouts"]):
            mark = "  <- pick" if i == 0 else ""
            note = f"; {c['note']}" if c["note"] else ""
            lines.append(f"    {c['name']:44s} update ~{c['update_s']:6.1f} s (compute {c['compute_s']:.1f}, "
                         f"comm {c['comm_s']:.1f}), {c['state_gib']:.1f} GiB state per rank{note}{mark}")
        best = cpu["layouts"][0]
        lines.append(f"    pick: actor.layout {{tp: {best['tp']}, pp: {best['pp']}}}, trainer.nproc="
                     f"{best['tp'] * best['pp'] * best['dp']}, {best['threads']} thread(s) per rank "
                     f"(OMP_NUM_THREADS); on the dev box DP=2 measured 1.33x faster per step than PP=2 "
                     f"(BENCHMARKS.md, 'Layout: DP=2 vs PP=2')")
    return lines
