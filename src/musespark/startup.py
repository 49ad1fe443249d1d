"""What a user sees while an engine starts: the weight-loading bar and `serve`'s summary.

    bar = weights_bar()                      # None unless stderr is a terminal (or forced)
    engine = LLMEngine(config, progress=bar)
    print(serve_summary(engine, parsers, url), file=sys.stderr)

Invariants:
* Progress goes to stderr, never stdout (stdout carries generated text and JSON results).
* The bar counts bytes of the weight files with their total known from the start; it clears
  its line when it ends or is closed, so an error message starts on a line of its own.
* `MUSESPARK_PROGRESS=1` forces the bars (and the kernel-build message, kernels/cpu.py) on,
  `0` off; unset, they show when stderr is a terminal.
"""

from __future__ import annotations

import os
import sys
from typing import Any

PROGRESS_ENV = "MUSESPARK_PROGRESS"


def progress_enabled() -> bool:
    """Progress output wanted: $MUSESPARK_PROGRESS (1/0), else stderr is a terminal."""
    value = os.environ.get(PROGRESS_ENV)
    if value is not None:
        return value.strip() not in ("", "0", "false", "no")
    return sys.stderr.isatty()


class ByteBar:
    """A tqdm bar over bytes, driven by `progress(done, total)` callbacks; `close()` clears it."""

    def __init__(self, desc: str) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False, file=sys.stderr)

    def __call__(self, done: int, total: int) -> None:
        if self._bar.total != total:
            self._bar.total = total
            self._bar.refresh()
        self._bar.update(done - self._bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        self._bar.close()


def weights_bar(force: bool = False) -> ByteBar | None:
    """The weight-loading bar, or None when progress is off (`force`: on regardless)."""
    return ByteBar("Loading weights") if force or progress_enabled() else None


def iterations(n: int, desc: str) -> Any:
    """range(n) with a progress bar on stderr when progress is on (benchmark iterations)."""
    from tqdm.auto import tqdm

    return tqdm(range(n), desc=desc, file=sys.stderr, disable=not progress_enabled(), leave=False)


class BuildNotice:
    """What the first run prints while the C++ kernels compile: one line when the build
    starts (with its expected duration), a ticking elapsed time on a terminal, one line with
    the time it took. Always to stderr: a silent minute-long pause looks like a hang."""

    def __init__(self, what: str, expected: str) -> None:
        self.what, self.expected = what, expected

    def __enter__(self) -> BuildNotice:
        import threading
        import time

        self._start = time.perf_counter()
        print(f"musespark: building {self.what} (first run only; {self.expected})...", file=sys.stderr, flush=True)
        self._stop = threading.Event()
        self._ticker = None
        if sys.stderr.isatty() or os.environ.get(PROGRESS_ENV, "").strip() == "1":
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()
        return self

    def _tick(self) -> None:
        from tqdm.auto import tqdm

        with tqdm(desc=f"building {self.what}", bar_format="{desc}: {elapsed}", file=sys.stderr, leave=False) as bar:
            while not self._stop.wait(1.0):
                bar.refresh()

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        import time

        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2)
        took = time.perf_counter() - self._start
        outcome = "built" if kind is None else "build failed"
        print(f"musespark: {self.what} {outcome} in {took:.0f} s", file=sys.stderr, flush=True)


def _isa_path(backend: Any) -> str | None:
    ops = getattr(backend, "ops", None)
    try:
        return ops.isa_path() if ops is not None else None
    except Exception:  # a backend without an ISA notion
        return None


def serve_summary(engine: Any, parsers: str, url: str) -> str:
    """`serve`'s one start-up summary: model, dtype, backend and ISA path, KV cache in blocks
    and tokens, max_model_len, parsers, URL (one `key: value` line each)."""
    config = engine.engine_config
    model = engine.model
    backend = getattr(model, "backend", None)
    name = getattr(backend, "name", type(backend).__name__)
    isa = _isa_path(backend)
    runner = engine.core.runner
    blocks, block_size = runner.num_blocks, config.cache.block_size
    held = [t for pair in runner.kv_caches if pair is not None for t in pair]
    kv_dtype = str(held[0].dtype).removeprefix("torch.") if held else "none"
    kv_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in held}.values())  # groups share pairs
    par = config.parallel
    lines = [
        f"model:         {engine.model_path}",
        f"dtype:         {str(model.dtype).removeprefix('torch.')}",
        f"backend:       {name}" + (f" (ISA path {isa})" if isa else ""),
        f"KV cache:      {blocks} blocks x {block_size} tokens = {blocks * block_size} tokens, {kv_dtype}, "
        f"{kv_bytes} bytes",
        f"max_model_len: {config.scheduler.max_model_len}",
        f"parsers:       {parsers}",
        f"URL:           {url}",
    ]
    if par.tensor_parallel_size * par.pipeline_parallel_size > 1:
        lines.insert(3, f"parallel:      tp={par.tensor_parallel_size} pp={par.pipeline_parallel_size}")
    return "musespark serve:\n" + "\n".join("  " + line for line in lines)
