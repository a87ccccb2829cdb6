"""The PNG helpers every plot uses: matplotlib (an optional extra) found or a one-line error, and an atomic save.

matplotlib is imported only when a plot is asked for, with the Agg backend (no display needed).
"""

from __future__ import annotations

import io
import os

from .errors import UsageError
from .files import atomic_write_bytes

PLOT_HINT = "pip install 'gpt2-port[plot]'"


def require_matplotlib(option: str = "--plot", alternative: str = "") -> None:
    """Fail early, in one line naming `option`, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        also = f" (or pass {alternative})" if alternative else ""
        raise UsageError(f"{option} needs matplotlib, which is not installed: {PLOT_HINT}{also}") from None


def pyplot():  # noqa: ANN201
    """matplotlib.pyplot on the Agg backend."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str | os.PathLike[str]) -> None:  # noqa: ANN001
    """Write `fig` as a PNG atomically (a reader never sees half a file) and close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    pyplot().close(fig)
    atomic_write_bytes(path, buf.getvalue())
