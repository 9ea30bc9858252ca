"""fdp's logger: quiet by default; ``FDP_LOG=INFO`` (or DEBUG) prints rank-prefixed lines."""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

log = logging.getLogger("fdp")


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if dist.is_available() and dist.is_initialized():
            record.rank = dist.get_rank()
        else:
            record.rank = int(os.environ.get("RANK", 0))
        return True


def debug_mode() -> bool:
    """Whether ``FDP_DEBUG`` asks for collective fingerprint checks (see ``fdp.Reducer``)."""
    return os.environ.get("FDP_DEBUG", "0").lower() not in ("", "0", "false", "no")


def configure(level: str | None = None) -> None:
    """Send fdp's log lines to stderr as ``[fdp rank 0] ...`` at ``level`` (default: $FDP_LOG)."""
    level = level or os.environ.get("FDP_LOG")
    if not level:
        return
    if not any(getattr(h, "_fdp", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler._fdp = True  # type: ignore[attr-defined]
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[fdp rank %(rank)s] %(message)s"))
        log.addHandler(handler)
    log.setLevel(level.upper())


configure()
