"""Matplotlib behind one door: the Agg backend, and a clear note when matplotlib is missing."""
from __future__ import annotations

import sys
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a note) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'flashnext[bench]')", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path
