"""Ray, for the parts that run on it (`cann-run serve --ray`, pipeline stages): an optional dependency, so its
absence is a coded error naming what to install rather than an ImportError's traceback."""

from __future__ import annotations

from cann_llm.runtime.errors import AtcError


def require_ray():
    """The `ray` module; AtcError E10055 naming the extra to install when it is not."""
    try:
        import ray
    except ImportError:
        raise AtcError("E10055", "Ray is not installed: pip install 'cann-llm[ray]'") from None
    return ray
