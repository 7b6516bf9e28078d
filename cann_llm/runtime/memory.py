"""This machine's memory and this process's share of it (Linux's /proc; None where it cannot be read)."""

from __future__ import annotations

import os


def available_bytes() -> int | None:
    """The memory this machine can still give without swapping (Linux: MemAvailable); None if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def total_bytes() -> int | None:
    """This machine's physical memory; None if unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def resident_bytes() -> int:
    """The process's resident memory now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
