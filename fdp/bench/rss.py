"""Resident memory of this process, from /proc (Linux): what the benchmarks' memory columns read."""

from __future__ import annotations

__all__ = ["reset_peak_rss", "rss", "rss_mib"]


def rss() -> tuple[int, int]:
    """(current RSS, peak RSS) in bytes."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, v = line.split(":")
                vals[key] = int(v.split()[0]) * 1024
    if "VmRSS" not in vals:
        raise RuntimeError("no VmRSS in /proc/self/status")
    return vals["VmRSS"], vals.get("VmHWM", vals["VmRSS"])


def rss_mib() -> float:
    """The current RSS in MiB."""
    return rss()[0] / 2**20


def reset_peak_rss() -> bool:
    """Reset the peak (VmHWM) to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
