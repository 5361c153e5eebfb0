"""The reward-per-step plot as a PNG: with matplotlib when it is installed (the optional extra
``pip install swarm-node[plot]``), else with nothing but the standard library (zlib + struct).

With matplotlib (:func:`render_curve_matplotlib`, headless Agg backend): a title, labelled axes
with tick values, the mean reward per step and its moving average. Without it
(:func:`render_curve`): a white canvas, light grid lines at each tenth of the axes, axes, and the
curve drawn with Bresenham segments (no antialiasing, and no text: a hand-drawn PNG cannot
label its axes, which is why matplotlib is preferred). PNG per RFC 2083: signature, IHDR, one
zlib-compressed IDAT of filter-0 scanlines, IEND, each chunk CRC-32'd. The ASCII plot for
terminals is ``node.app.demo.reward_plot``.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

WIDTH, HEIGHT, MARGIN = 640, 360, 32
WHITE, GRID, AXIS, LINE = (255, 255, 255), (228, 228, 228), (60, 60, 60), (31, 119, 180)
EVAL_LINE = (230, 120, 20)  # the held-out score per evaluated version (node/trainer/evaluation.py)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _segment(px, x0: int, y0: int, x1: int, y1: int, color) -> None:
    """Bresenham's line from (x0, y0) to (x1, y1), 2 pixels thick."""
    dx, dy = abs(x1 - x0), -abs(y1 - y0)
    sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
    err = dx + dy
    while True:
        for ox, oy in ((0, 0), (0, 1), (1, 0)):
            if 0 <= x0 + ox < WIDTH and 0 <= y0 + oy < HEIGHT:
                px[y0 + oy][x0 + ox] = color
        if x0 == x1 and y0 == y1:
            return
        e2 = 2 * err
        if e2 >= dy:
            err += dy
            x0 += sx
        if e2 <= dx:
            err += dx
            y0 += sy


def render_curve(points: Sequence[tuple[float, float]], evals: Sequence[tuple[float, float]] = ()) -> bytes:
    """PNG bytes of the polyline through ``points`` (x = step, y = mean reward) and, in orange, through
    ``evals`` (x = version, y = held-out score), axes scaled to fit both."""
    px = [[WHITE] * WIDTH for _ in range(HEIGHT)]
    every = [*points, *evals]
    x_lo, x_hi = (min(p[0] for p in every), max(p[0] for p in every)) if every else (0.0, 1.0)
    y_lo, y_hi = (min(0.0, *(p[1] for p in every)), max(1e-9, *(p[1] for p in every))) if every else (0.0, 1.0)
    x_hi = x_hi if x_hi > x_lo else x_lo + 1
    w, h = WIDTH - 2 * MARGIN, HEIGHT - 2 * MARGIN

    def to_px(x: float, y: float) -> tuple[int, int]:
        return (MARGIN + round((x - x_lo) / (x_hi - x_lo) * w), HEIGHT - MARGIN - round((y - y_lo) / (y_hi - y_lo) * h))

    for i in range(11):
        gx, gy = MARGIN + i * w // 10, MARGIN + i * h // 10
        _segment(px, gx, MARGIN, gx, HEIGHT - MARGIN, GRID)
        _segment(px, MARGIN, gy, WIDTH - MARGIN, gy, GRID)
    _segment(px, MARGIN, HEIGHT - MARGIN, WIDTH - MARGIN, HEIGHT - MARGIN, AXIS)
    _segment(px, MARGIN, MARGIN, MARGIN, HEIGHT - MARGIN, AXIS)
    for series, color in ((points, LINE), (evals, EVAL_LINE)):
        pts = [to_px(x, y) for x, y in series]
        for (a, b), (c, d) in itertools.pairwise(pts):
            _segment(px, a, b, c, d, color)
        if len(pts) == 1:
            _segment(px, *pts[0], *pts[0], color)
    raw = b"".join(b"\x00" + bytes(v for rgb in row for v in rgb) for row in px)
    ihdr = struct.pack(">IIBBBBB", WIDTH, HEIGHT, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over at most ``window`` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def curve_figure(points: Sequence[tuple[float, float]], title: str = "Mean reward per trainer step",
                 evals: Sequence[tuple[float, float]] = ()):
    """The matplotlib Figure of the reward curve: title, labelled axes with ticks, a moving average,
    and the held-out score of the evaluated versions (``evals``) beside it."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH / 100, HEIGHT / 100), dpi=100)
    ax = fig.add_subplot()
    steps = [p[0] for p in points]
    rewards = [p[1] for p in points]
    window = max(1, len(points) // 10)
    if points:
        ax.plot(steps, rewards, color="#9bb5e6", linewidth=1, label="mean reward")
        ax.plot(steps, moving_average(rewards, window), color="#1a4fb0", linewidth=2,
                label=f"moving average ({window} steps)")
    if evals:
        ax.plot([p[0] for p in evals], [p[1] for p in evals], color="#e67814", linewidth=2, marker="o", markersize=3,
                label="held-out score (greedy)")
    if points or evals:
        ax.legend(loc="lower right", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no training steps yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_xlabel("trainer step (policy version)")
    ax.set_ylabel("mean task reward")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


def render_curve_matplotlib(points: Sequence[tuple[float, float]], evals: Sequence[tuple[float, float]] = ()) -> bytes:
    """PNG bytes of :func:`curve_figure`."""
    import io

    buf = io.BytesIO()
    curve_figure(points, evals=evals).savefig(buf, format="png")
    return buf.getvalue()


def write_curve_png(points: Sequence[tuple[float, float]], path: Path, *, use_matplotlib: bool | None = None,
                    evals: Sequence[tuple[float, float]] = ()) -> Path:
    """Write the reward curve (and the held-out scores ``evals``) to ``path``: matplotlib's when
    importable (or asked), else ours."""
    path = Path(path)
    if use_matplotlib is None:
        use_matplotlib = have_matplotlib()
    path.write_bytes(render_curve_matplotlib(points, evals) if use_matplotlib else render_curve(points, evals))
    return path
