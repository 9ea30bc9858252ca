"""Draw a step's timeline: the backward, each bucket's ready/launch/done, exposed communication.

Needs matplotlib (``pip install 'fdp[viz]'``).

    >>> import fdp.viz
    >>> reducer = fdp.Reducer({"w": torch.zeros(2)})
    >>> grads = reducer.grad(lambda p: (p["w"] ** 2).sum())({"w": torch.ones(2)})
    >>> fdp.viz.plot_timeline(reducer.last_step.timeline, "timeline.png")
    <Figure size ...>

How to read it: the grey bar is the backward. Each bucket row shows when its last gradient
arrived (a dot), then its collective from launch to completion (a bar). The part of a bar
that runs past the end of the backward is communication the backward could not hide: the
*exposed* communication, drawn in red and summed in the title. Well-overlapped steps have
short red tails; a long wait between a dot and its bar means an earlier bucket was not
ready yet (buckets launch strictly in order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._step.record import Timeline

__all__ = ["plot_timeline"]


def plot_timeline(timeline: Timeline, path: str | Path | None = None, *, ax: Any = None,
                  title: str | None = None) -> Any:
    """Plot one step's ``Timeline`` (from ``reducer.last_step.timeline``).

    Rows: the forward and backward, then each bucket's "last gradient ready" dot and its
    collective from launch to completion, green while the backward still runs and red after
    it (the exposed communication, summed in the title). With fully sharded params, each
    bucket's (unit's) all-gathers above it: light while the compute ran, dark while the step
    waited for them. docs/performance.md ("Reading the
    timeline") walks through real ones.

    Args:
      timeline: the step to draw.
      path: if given, save the figure there (PNG by extension) and close it.
      ax: draw into this matplotlib Axes instead of a new figure.
      title: figure title (default: step number, kind and exposed communication).

    Returns:
      The matplotlib Figure.
    """
    import matplotlib

    if path is not None and ax is None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    ms = 1000.0
    nb = len(timeline.buckets)
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 1.6 + 0.42 * (nb + 1)), dpi=110)
    else:
        fig = ax.figure
    rows = ["forward / backward"] + [f"bucket {b.index} ({_size(b.nbytes)})" for b in timeline.buckets]
    y = {name: len(rows) - 1 - i for i, name in enumerate(rows)}
    bwd_end = timeline.backward_end
    if timeline.backward_start is not None and bwd_end is not None:
        row = y["forward / backward"]
        ax.barh(row, timeline.backward_start * ms, left=0, height=0.6, color="#e0e0e0", label="forward")
        ax.barh(row, (bwd_end - timeline.backward_start) * ms, left=timeline.backward_start * ms,
                height=0.6, color="#9e9e9e", label="backward")
        ax.axvline(bwd_end * ms, color="#616161", linestyle="--", linewidth=1)
    hide_until = bwd_end if bwd_end is not None else min((b.launch or 0) for b in timeline.buckets) if nb else 0
    labelled = set()
    for b, name in zip(timeline.buckets, rows[1:]):
        row = y[name]
        for issued, waited, done, _ in b.gathers:  # fully sharded params: the unit's all-gathers
            if waited > issued:
                ax.barh(row + 0.3, (waited - issued) * ms, left=issued * ms, height=0.18, color="#b39ddb",
                        label=None if "gather" in labelled else "params all-gather (behind compute)")
                labelled.add("gather")
            if done > waited:
                ax.barh(row + 0.3, (done - waited) * ms, left=waited * ms, height=0.18, color="#4a148c",
                        label=None if "gather wait" in labelled else "params all-gather (waited for)")
                labelled.add("gather wait")
        if b.ready is not None:
            ax.plot(b.ready * ms, row, "o", color="#1565c0", markersize=5,
                    label=None if "ready" in labelled else "last gradient ready")
            labelled.add("ready")
        if b.launch is None:
            continue
        done = b.done if b.done is not None else b.launch
        hidden_end = min(done, max(hide_until, b.launch))
        if hidden_end > b.launch:
            ax.barh(row, (hidden_end - b.launch) * ms, left=b.launch * ms, height=0.5, color="#43a047",
                    label=None if "hidden" in labelled else "communication (overlapped)")
            labelled.add("hidden")
        start = max(b.launch, hide_until)
        if done > start:
            ax.barh(row, (done - start) * ms, left=start * ms, height=0.5, color="#e53935",
                    label=None if "exposed" in labelled else "communication (exposed)")
            labelled.add("exposed")
    ax.set_yticks(list(y.values()), list(y.keys()))
    ax.set_xlabel("ms since the step started")
    ax.set_xlim(left=0, right=max(timeline.end, timeline.comm_done) * ms * 1.02)
    ax.grid(axis="x", alpha=0.3)
    gathers = "" if not any(b.gathers for b in timeline.buckets) else (
        f", all-gather waits {timeline.exposed_gather * ms:.1f} ms")
    ax.set_title(title or (f"step {timeline.step} ({timeline.kind}): exposed communication "
                           f"{timeline.exposed_comm * ms:.1f} ms{gathers} of {timeline.end * ms:.1f} ms"))
    if ax.get_legend_handles_labels()[0]:  # nothing drawn (e.g. a world of one): no legend
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 / (nb + 1) - 0.12), ncol=5, fontsize=8,
                  frameon=False)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
        plt.close(fig)
    return fig


def _size(nbytes: int) -> str:
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MiB"
    if nbytes >= 1 << 10:
        return f"{nbytes / (1 << 10):.0f} KiB"
    return f"{nbytes} B"
